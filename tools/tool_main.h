// run_tool: the error tier of every command-line main. A UserError (bad input, a flag out of range, a
// missing file) prints its message and exits 1; anything else is an internal error and exits 2. Before
// the body runs (and any thread starts), denormal floats are flushed to zero (core/float_env.h) unless
// BERT_KEEP_DENORMALS=1, and the CPU kernel set is chosen (core/cpu_kernels.h), so a bad BERT_CPU_KERNELS
// fails before anything is read or written.
#pragma once

#include <spdlog/spdlog.h>

#include <exception>

#include "core/cpu_kernels.h"
#include "core/error.h"
#include "core/float_env.h"

namespace bert::tools {

template <typename Body>
int run_tool(Body&& body) {
  apply_denormal_setting();
  try {
    best_cpu_kernels();
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
