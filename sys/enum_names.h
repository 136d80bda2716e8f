// One table of names per enum: what a flag or a record spells each value as, parsed back with an error
// that names the flag and the choices, and listed for a command line's checks (CLI::IsMember(names())).
// Each enum declares its table once beside it, e.g.
//   inline constexpr EnumNames<Precision, 3> kPrecisionNames{{{{Precision::kFp32, "fp32"}, ...}}};
// and its parse/name functions are the table's.
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "sys/error.h"

namespace bert {

template <typename E>
struct EnumName {
  E value;
  std::string_view name;
  std::string_view meaning = {};  // shown after the name in an error ("per-tensor (one scale per weight)")
};

template <typename E, std::size_t N>
struct EnumNames {
  std::array<EnumName<E>, N> entries;

  // The value spelled `name`; otherwise a UserError "<what> '<name>': expected a, b or c".
  E parse(std::string_view name, std::string_view what) const {
    for (const EnumName<E>& e : entries)
      if (e.name == name) return e.value;
    throw UserError(std::string(what) + " '" + std::string(name) + "': expected " + choices());
  }
  // The name of `value` ("?" for a value outside the table).
  std::string name(E value) const {
    for (const EnumName<E>& e : entries)
      if (e.value == value) return std::string(e.name);
    return "?";
  }
  // Every name, in the table's order.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const EnumName<E>& e : entries) out.emplace_back(e.name);
    return out;
  }
  // "a, b or c", each with its meaning in parentheses where it has one.
  std::string choices() const {
    std::string out;
    for (std::size_t i = 0; i < N; ++i) {
      if (i > 0) out += i + 1 == N ? " or " : ", ";
      out += entries[i].name;
      if (!entries[i].meaning.empty()) out += " (" + std::string(entries[i].meaning) + ")";
    }
    return out;
  }
};

}  // namespace bert
