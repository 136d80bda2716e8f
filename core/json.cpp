#include "core/json.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "core/error.h"
#include "core/utf8.h"

namespace bert {

namespace {

class Parser {
 public:
  explicit Parser(std::string_view text) : s_(text) {}

  Json document() {
    Json v = value(0);
    skip_space();
    if (pos_ != s_.size()) fail("end of input after the value");
    return v;
  }

 private:
  static constexpr int kMaxDepth = 256;

  [[noreturn]] void fail(const std::string& expected) const {
    int line = 1, column = 1;
    for (size_t i = 0; i < pos_ && i < s_.size(); ++i) {
      if (s_[i] == '\n')
        ++line, column = 1;
      else
        ++column;
    }
    throw UserError("invalid JSON at line " + std::to_string(line) + ", column " + std::to_string(column) +
                    ": expected " + expected);
  }
  void skip_space() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }
  bool consume(char c) {
    skip_space();
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  void expect_word(std::string_view w) {
    if (s_.substr(pos_, w.size()) != w) {
      std::string expected(1, '\'');  // built step by step: GCC 12 warns falsely on "'" + string&& (bug 105329)
      expected.append(w).push_back('\'');
      fail(expected);
    }
    pos_ += w.size();
  }

  Json value(int depth) {
    if (depth > kMaxDepth) fail("nesting no deeper than 256 levels");
    skip_space();
    if (pos_ >= s_.size()) fail("a value");
    const char c = s_[pos_];
    if (c == '{') return object(depth);
    if (c == '[') return array(depth);
    if (c == '"') return Json(string());
    if (c == 't') return expect_word("true"), Json(true);
    if (c == 'f') return expect_word("false"), Json(false);
    if (c == 'n') return expect_word("null"), Json();
    if (c == '-' || (c >= '0' && c <= '9')) return number();
    fail("a value");
  }

  Json object(int depth) {
    ++pos_;
    Json::Object members;
    if (consume('}')) return Json(std::move(members));
    do {
      skip_space();
      if (pos_ >= s_.size() || s_[pos_] != '"') fail("a string key");
      std::string key = string();
      if (!consume(':')) fail("':'");
      members.emplace_back(std::move(key), value(depth + 1));
    } while (consume(','));
    if (!consume('}')) fail("',' or '}'");
    return Json(std::move(members));
  }

  Json array(int depth) {
    ++pos_;
    Json::Array items;
    if (consume(']')) return Json(std::move(items));
    do {
      items.push_back(value(depth + 1));
    } while (consume(','));
    if (!consume(']')) fail("',' or ']'");
    return Json(std::move(items));
  }

  Json number() {
    const size_t start = pos_;
    if (s_[pos_] == '-') ++pos_;
    auto digits = [&] {
      size_t n = 0;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_, ++n;
      return n;
    };
    if (pos_ < s_.size() && s_[pos_] == '0')
      ++pos_;
    else if (digits() == 0)
      fail("a digit");
    bool integer = true;
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_, integer = false;
      if (digits() == 0) fail("a digit after '.'");
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_, integer = false;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (digits() == 0) fail("a digit in the exponent");
    }
    const std::string text(s_.substr(start, pos_ - start));
    if (integer) {  // exactly, when it fits 64 bits; a larger integer becomes a double below
      errno = 0;
      char* end = nullptr;
      if (text[0] == '-') {
        const long long v = std::strtoll(text.c_str(), &end, 10);
        if (errno == 0) return Json(static_cast<int64_t>(v));
      } else {
        const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
        if (errno == 0) return Json(static_cast<uint64_t>(v));
      }
    }
    const double v = std::strtod(text.c_str(), nullptr);
    if (!std::isfinite(v)) fail("a finite number");
    return Json(v);
  }

  uint32_t hex4() {
    if (pos_ + 4 > s_.size()) fail("4 hex digits");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= c - '0';
      else if (c >= 'a' && c <= 'f')
        v |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F')
        v |= c - 'A' + 10;
      else
        fail("a hex digit");
    }
    return v;
  }

  std::string string() {
    ++pos_;  // opening quote
    std::string out;
    while (true) {
      if (pos_ >= s_.size()) fail("a closing '\"'");
      const char c = s_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("no control characters inside a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= s_.size()) fail("an escape character");
      const char e = s_[pos_++];
      switch (e) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {  // surrogate pair
            if (s_.substr(pos_, 2) != "\\u") fail("a low surrogate");
            pos_ += 2;
            const uint32_t low = hex4();
            if (low < 0xDC00 || low > 0xDFFF) fail("a low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("a high surrogate before a low one");
          }
          utf8::append(out, cp);
          break;
        }
        default:
          fail("a valid escape (\\\" \\\\ \\/ \\b \\f \\n \\r \\t \\u)");
      }
    }
  }

  std::string_view s_;
  size_t pos_ = 0;
};

void dump_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

void dump_number(std::string& out, const Json& v) {
  char buf[32];
  if (const Json::IntegerView i = v.integer(); i.is_integer) {
    if (i.is_unsigned)
      std::snprintf(buf, sizeof buf, "%llu", static_cast<unsigned long long>(i.u));
    else
      std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(i.s));
    out += buf;
    return;
  }
  const double d = v.as_number();
  if (std::nearbyint(d) == d && std::abs(d) < 1e15) {
    std::snprintf(buf, sizeof buf, "%.0f", d);
  } else {
    std::snprintf(buf, sizeof buf, "%.17g", d);  // round-trips exactly
  }
  out += buf;
}

}  // namespace

Json Json::parse(std::string_view text) { return Parser(text).document(); }

namespace {
void dump_value(std::string& out, const Json& v, int indent, int level) {
  auto newline = [&](int l) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent * l), ' ');
  };
  if (v.is_null())
    out += "null";
  else if (v.is_bool())
    out += v.as_bool() ? "true" : "false";
  else if (v.is_number())
    dump_number(out, v);
  else if (v.is_string())
    dump_string(out, v.as_string());
  else if (v.is_array()) {
    const auto& a = v.as_array();
    out += '[';
    for (size_t i = 0; i < a.size(); ++i) {
      if (i) out += indent < 0 ? "," : ",";
      newline(level + 1);
      dump_value(out, a[i], indent, level + 1);
    }
    if (!a.empty()) newline(level);
    out += ']';
  } else {
    const auto& o = v.as_object();
    out += '{';
    for (size_t i = 0; i < o.size(); ++i) {
      if (i) out += ',';
      newline(level + 1);
      dump_string(out, o[i].first);
      out += indent < 0 ? ":" : ": ";
      dump_value(out, o[i].second, indent, level + 1);
    }
    if (!o.empty()) newline(level);
    out += '}';
  }
}
}  // namespace

std::string Json::dump(int indent) const {
  std::string out;
  dump_value(out, *this, indent, 0);
  return out;
}

namespace {
[[noreturn]] void wrong_type(const char* expected) { throw UserError(std::string("JSON value is not ") + expected); }
}  // namespace

bool Json::as_bool() const { return is_bool() ? std::get<bool>(value_) : (wrong_type("a boolean"), false); }
double Json::as_number() const {
  if (const auto* i = std::get_if<int64_t>(&value_)) return static_cast<double>(*i);
  if (const auto* u = std::get_if<uint64_t>(&value_)) return static_cast<double>(*u);
  return std::holds_alternative<double>(value_) ? std::get<double>(value_) : (wrong_type("a number"), 0.0);
}
int64_t Json::as_int() const {
  if (const auto* i = std::get_if<int64_t>(&value_)) return *i;
  if (std::holds_alternative<uint64_t>(value_)) wrong_type("an integer that fits 64 signed bits");
  const double d = as_number();
  if (std::nearbyint(d) != d || std::abs(d) > 9.007199254740992e15) wrong_type("an integer");
  return static_cast<int64_t>(d);
}
uint64_t Json::as_uint() const {
  if (const auto* u = std::get_if<uint64_t>(&value_)) return *u;
  const int64_t i = as_int();
  if (i < 0) wrong_type("a non-negative integer");
  return static_cast<uint64_t>(i);
}
Json::IntegerView Json::integer() const {
  if (const auto* i = std::get_if<int64_t>(&value_)) return {true, false, *i, 0};
  if (const auto* u = std::get_if<uint64_t>(&value_)) return {true, true, 0, *u};
  return {};
}
const std::string& Json::as_string() const {
  if (!is_string()) wrong_type("a string");
  return std::get<std::string>(value_);
}
const Json::Array& Json::as_array() const {
  if (!is_array()) wrong_type("an array");
  return std::get<Array>(value_);
}
const Json::Object& Json::as_object() const {
  if (!is_object()) wrong_type("an object");
  return std::get<Object>(value_);
}
Json::Array& Json::as_array() {
  if (!is_array()) wrong_type("an array");
  return std::get<Array>(value_);
}
Json::Object& Json::as_object() {
  if (!is_object()) wrong_type("an object");
  return std::get<Object>(value_);
}

const Json* Json::find(std::string_view key) const {
  for (const auto& [k, v] : as_object())
    if (k == key) return &v;
  return nullptr;
}

Json& Json::operator[](std::string_view key) {
  if (is_null()) value_ = Object{};
  Object& o = as_object();
  for (auto& [k, v] : o)
    if (k == key) return v;
  o.emplace_back(std::string(key), Json());
  return o.back().second;
}

}  // namespace bert
