#include "sys/json.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include <nlohmann/json.hpp>

#include "sys/error.h"

namespace bert {

namespace {

// The parsing and writing are nlohmann::json's (Debian's nlohmann-json3-dev); Json keeps the project's
// value type and its typed accessors (UserError naming the expected type).
using Native = nlohmann::ordered_json;
constexpr int kMaxDepth = 256;

Json from_native(const Native& n) {
  switch (n.type()) {
    case Native::value_t::null:
      return Json();
    case Native::value_t::boolean:
      return Json(n.get<bool>());
    case Native::value_t::number_integer:
      return Json(n.get<int64_t>());
    case Native::value_t::number_unsigned:
      return Json(n.get<uint64_t>());
    case Native::value_t::number_float:
      return Json(n.get<double>());
    case Native::value_t::string:
      return Json(n.get_ref<const std::string&>());
    case Native::value_t::array: {
      Json::Array a;
      a.reserve(n.size());
      for (const Native& e : n) a.push_back(from_native(e));  // depth bounded while parsing
      return Json(std::move(a));
    }
    case Native::value_t::object: {
      Json::Object o;
      o.reserve(n.size());
      for (const auto& [key, value] : n.items()) o.emplace_back(key, from_native(value));
      return Json(std::move(o));
    }
    default:
      throw UserError("invalid JSON: a value of a kind JSON text does not have");
  }
}

Native to_native(const Json& v) {
  if (v.is_null()) return nullptr;
  if (v.is_bool()) return v.as_bool();
  if (v.is_number()) {
    const Json::IntegerView i = v.integer();
    if (!i.is_integer) return v.as_number();
    return i.is_unsigned ? Native(i.u) : Native(i.s);
  }
  if (v.is_string()) return v.as_string();
  if (v.is_array()) {
    Native a = Native::array();
    for (const Json& e : v.as_array()) a.push_back(to_native(e));
    return a;
  }
  Native o = Native::object();
  for (const auto& [key, value] : v.as_object()) o[key] = to_native(value);
  return o;
}

// "line L, column C: what" from nlohmann's "[json.exception.parse_error.101] parse error at line L, column
// C: what".
std::string where_and_what(const std::string& message) {
  const std::string at = "parse error at ";
  const size_t p = message.find(at);
  return p == std::string::npos ? message : message.substr(p + at.size());
}

}  // namespace

Json Json::parse(std::string_view text) {
  // Nesting is refused as it opens, before the document is built (a deep one would exhaust the stack
  // in from_native and in the destructors).
  const Native::parser_callback_t depth_limit = [](int depth, Native::parse_event_t event, Native&) {
    if ((event == Native::parse_event_t::object_start || event == Native::parse_event_t::array_start) &&
        depth >= kMaxDepth)
      throw UserError("invalid JSON: nesting deeper than " + std::to_string(kMaxDepth) + " levels");
    return true;
  };
  Native native;
  try {
    native = Native::parse(text.begin(), text.end(), depth_limit);
  } catch (const Native::parse_error& e) {
    throw UserError("invalid JSON at " + where_and_what(e.what()));
  } catch (const Native::out_of_range& e) {  // a number beyond a double's range
    const std::string what = e.what();
    throw UserError("invalid JSON: " + what.substr(what.find(']') + 2));
  }
  return from_native(native);
}

std::string Json::dump(int indent) const {
  // Numbers as nlohmann writes them (the shortest text that reads back to the same double); bytes of a
  // string that are not UTF-8 become U+FFFD.
  return to_native(*this).dump(indent, ' ', false, Native::error_handler_t::replace);
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
