// OpProfile: where a CPU graph's time goes, op by op. The caller owns the table and attaches it to a
// Graph (Graph::set_profile); while attached the graph times
//   - each op's forward: the time from the op's output node to the next node made (an op computes right
//     after making its output; what the model does between two ops counts to the earlier one),
//   - each op's backward closure,
// and the caller may time phases outside the graph (the optimizer step) with add(). Ops are named by
// the function that made the node (core/source_location.h), so every op is covered without code in it.
// For finding the ops that stop scaling with threads, or that a baseline runs faster. On a GPU the host
// does not wait for the kernels, so there it times the host's side: the cost of queuing each op.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/shape.h"

namespace bert {

class OpProfile {
 public:
  // by_shape: one row per op and output shape ("linear [4096, 512]"), to tell the calls of an op apart.
  explicit OpProfile(bool by_shape = false) : by_shape_(by_shape) {}

  struct Entry {
    std::string op;  // the function's name, "+quantize" for the variants with a fused quantizer; by
                     // shape, followed by the output's shape
    double forward_s = 0, backward_s = 0, other_s = 0;  // other: time given with add()
    int64_t forward_calls = 0, backward_calls = 0;
    double total_s() const { return forward_s + backward_s + other_s; }
  };

  // From now on, time goes to the forward of the op named by `function` (a function signature, as
  // SourceLocation::function_name gives it; the pointer must stay valid: a string literal) whose
  // output has shape `out`.
  void start_forward(const char* function, const Shape& out);
  // From now on, time goes nowhere (closes the running forward).
  void stop();
  void add_backward(const char* function, const Shape& out, double seconds);
  // Time of a phase outside the graph, under its own label (a string literal).
  void add(const char* label, double seconds);
  void reset();

  // Entries merged by op name, the largest total first.
  std::vector<Entry> entries() const;
  // A table of milliseconds per step (each time divided by `steps`), with each op's share of the total.
  std::string table(int steps) const;

  // The short name for a function signature: "bert::Var bert::gelu(Graph<T>&, Var) [with T = float]"
  // gives "gelu", the overload taking a QuantizeOutput "gelu+quantize".
  static std::string op_name(const char* function);

 private:
  using Clock = std::chrono::steady_clock;
  struct Times {
    double forward_s = 0, backward_s = 0, other_s = 0;
    int64_t forward_calls = 0, backward_calls = 0;
  };
  // The function (by pointer: no string work per op) and, by shape, the output's shape.
  using Key = std::pair<const char*, std::string>;
  Key key(const char* function, const Shape& out) const { return {function, by_shape_ ? out.str() : std::string()}; }
  void close_running(Clock::time_point now);

  bool by_shape_;
  std::map<Key, Times> times_;
  Times* running_ = nullptr;  // the forward being timed (std::map keeps element addresses)
  Clock::time_point running_since_{};
};

}  // namespace bert
