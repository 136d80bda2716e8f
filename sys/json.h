// Json: a JSON value (null, bool, number, string, array, object) for configs, checkpoint/export metadata,
// metrics logs and safetensors headers, with typed accessors that throw UserError naming the expected
// type. Parsing and writing are nlohmann::json's (sys/json.cpp).
// Objects keep their keys in insertion order (files read back the way they were written).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace bert {

class Json {
 public:
  using Array = std::vector<Json>;
  using Object = std::vector<std::pair<std::string, Json>>;

  Json() = default;  // null
  Json(std::nullptr_t) {}
  Json(bool b) : value_(b) {}
  // Integers are kept as integers (64 bits, exactly: a seed above 2^53 survives), other numbers as
  // doubles; the parser does the same for a number written without fraction or exponent.
  Json(double d) : value_(d) {}
  Json(int i) : value_(static_cast<int64_t>(i)) {}
  Json(int64_t i) : value_(i) {}
  Json(uint64_t i) { set_unsigned(i); }
  Json(const char* s) : value_(std::string(s)) {}
  Json(std::string s) : value_(std::move(s)) {}
  Json(Array a) : value_(std::move(a)) {}
  Json(Object o) : value_(std::move(o)) {}

  // Parses a whole document. Throws UserError "invalid JSON at line L, column C: <what was expected>";
  // nesting deeper than 256 levels and numbers beyond a double's range are rejected.
  static Json parse(std::string_view text);
  // Compact when indent < 0, else pretty-printed with `indent` spaces. Doubles as the shortest text that
  // reads back to the same value (NaN and infinities as null); bytes of a string that are not UTF-8 as U+FFFD.
  std::string dump(int indent = -1) const;

  bool is_null() const { return std::holds_alternative<std::monostate>(value_); }
  bool is_bool() const { return std::holds_alternative<bool>(value_); }
  bool is_number() const {
    return std::holds_alternative<double>(value_) || std::holds_alternative<int64_t>(value_) ||
           std::holds_alternative<uint64_t>(value_);
  }
  bool is_string() const { return std::holds_alternative<std::string>(value_); }
  bool is_array() const { return std::holds_alternative<Array>(value_); }
  bool is_object() const { return std::holds_alternative<Object>(value_); }

  // Typed access; throws UserError naming the expected type.
  bool as_bool() const;
  double as_number() const;
  int64_t as_int() const;    // an integer that fits int64 (exactly as written)
  uint64_t as_uint() const;  // a non-negative integer that fits uint64 (exactly as written)
  const std::string& as_string() const;
  const Array& as_array() const;
  const Object& as_object() const;
  Array& as_array();
  Object& as_object();

  // How an integer is held (for the writer): not one, signed, or unsigned above INT64_MAX.
  struct IntegerView {
    bool is_integer = false, is_unsigned = false;
    int64_t s = 0;
    uint64_t u = 0;
  };
  IntegerView integer() const;

  // Object member or nullptr. Throws if this is not an object.
  const Json* find(std::string_view key) const;
  // Object member, inserted as null if absent (this becomes an object if it was null).
  Json& operator[](std::string_view key);

 private:
  void set_unsigned(uint64_t u) {
    if (u <= static_cast<uint64_t>(INT64_MAX))
      value_ = static_cast<int64_t>(u);
    else
      value_ = u;
  }
  // uint64_t only above INT64_MAX, so each integer has one representation.
  std::variant<std::monostate, bool, double, int64_t, uint64_t, std::string, Array, Object> value_;
};

}  // namespace bert
