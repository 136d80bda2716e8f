#include "core/op_profile.h"

#include <algorithm>
#include <cstdio>
#include <map>

namespace bert {

void OpProfile::close_running(Clock::time_point now) {
  if (!running_) return;
  running_->forward_s += std::chrono::duration<double>(now - running_since_).count();
  ++running_->forward_calls;
  running_ = nullptr;
}

void OpProfile::start_forward(const char* function, const Shape& out) {
  const Clock::time_point now = Clock::now();
  close_running(now);
  running_ = &times_[key(function, out)];
  running_since_ = now;
}

void OpProfile::stop() { close_running(Clock::now()); }

void OpProfile::add_backward(const char* function, const Shape& out, double seconds) {
  Times& t = times_[key(function, out)];
  t.backward_s += seconds;
  ++t.backward_calls;
}

void OpProfile::add(const char* label, double seconds) { times_[{label, std::string()}].other_s += seconds; }

void OpProfile::reset() {
  times_.clear();
  running_ = nullptr;
}

std::string OpProfile::op_name(const char* function) {
  std::string s = function;
  if (s.empty() || s.front() == '(') return s;  // a label given to add(), "(optimizer step)"
  // Clang writes "(anonymous namespace)::" into the name: not the parameter list's parenthesis.
  for (std::size_t at; (at = s.find("(anonymous namespace)::")) != std::string::npos;) s.erase(at, 23);
  const std::size_t paren = s.find('(');
  if (paren == std::string::npos) return s;  // a label given to add()
  std::size_t start = s.rfind(' ', paren);
  start = start == std::string::npos ? 0 : start + 1;
  std::string name = s.substr(start, paren - start);
  const std::size_t scope = name.rfind("::");
  if (scope != std::string::npos) name = name.substr(scope + 2);
  const std::size_t close = s.find(')', paren);
  if (s.substr(paren, close - paren).find("QuantizeOutput") != std::string::npos) name += "+quantize";
  return name;
}

std::vector<OpProfile::Entry> OpProfile::entries() const {
  std::map<std::string, Entry> merged;
  for (const auto& [key, t] : times_) {
    const std::string name = key.second.empty() ? op_name(key.first) : op_name(key.first) + " " + key.second;
    Entry& e = merged[name];
    e.op = name;
    e.forward_s += t.forward_s;
    e.backward_s += t.backward_s;
    e.other_s += t.other_s;
    e.forward_calls += t.forward_calls;
    e.backward_calls += t.backward_calls;
  }
  std::vector<Entry> result;
  for (auto& [name, e] : merged) result.push_back(e);
  std::stable_sort(result.begin(), result.end(),
                   [](const Entry& a, const Entry& b) { return a.total_s() > b.total_s(); });
  return result;
}

std::string OpProfile::table(int steps) const {
  const std::vector<Entry> all = entries();
  double total = 0;
  for (const Entry& e : all) total += e.total_s();
  const double per_step = 1e3 / std::max(steps, 1);
  std::string out;
  const int width = by_shape_ ? 40 : 22;
  char line[200];
  std::snprintf(line, sizeof line, "%-*s %11s %11s %11s %7s %9s\n", width, "op (ms per step)", "forward", "backward",
                "other", "share", "calls");
  out += line;
  for (const Entry& e : all) {
    std::snprintf(line, sizeof line, "%-*s %11.2f %11.2f %11.2f %6.1f%% %9.1f\n", width, e.op.c_str(),
                  e.forward_s * per_step, e.backward_s * per_step, e.other_s * per_step,
                  total > 0 ? 100.0 * e.total_s() / total : 0.0, double(e.forward_calls) / std::max(steps, 1));
    out += line;
  }
  std::snprintf(line, sizeof line, "%-*s %47.2f\n", width, "total", total * per_step);
  out += line;
  return out;
}

}  // namespace bert
