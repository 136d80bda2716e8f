// run_tool: the error tier of every command-line main. A UserError (bad input, a flag out of range, a
// missing file) prints its message and exits 1; anything else is an internal error and exits 2.
#pragma once

#include <spdlog/spdlog.h>

#include <exception>

#include "core/error.h"

namespace bert::tools {

template <typename Body>
int run_tool(Body&& body) {
  try {
    return body();
  } catch (const UserError& e) {
    spdlog::error("{}", e.what());
    return 1;
  } catch (const std::exception& e) {
    spdlog::error("internal error: {}", e.what());
    return 2;
  }
}

}  // namespace bert::tools
