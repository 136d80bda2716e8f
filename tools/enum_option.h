// A command-line option bound to an enum through its table of names (sys/enum_names.h): the word given
// is checked against the table (CLI11's error names the flag and the choices) and stored as the value,
// so the options the tools hand on are typed, never words parsed later.
#pragma once

#include <CLI/CLI.hpp>

#include <cstddef>
#include <string>

#include "sys/enum_names.h"

namespace bert::tools {

// `names` must outlive the parse (the tables are constants beside their enums).
template <typename E, std::size_t N>
CLI::Option* add_enum_option(CLI::App& app, const std::string& flag, E& value, const EnumNames<E, N>& names,
                             const std::string& help) {
  CLI::Option* option = app.add_option_function<std::string>(
      flag, [&value, &names, flag](const std::string& word) { value = names.parse(word, flag); }, help);
  option->check(CLI::IsMember(names.names()));
  option->default_str(names.name(value));
  return option;
}

}  // namespace bert::tools
