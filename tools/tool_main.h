// run_tool: the error tier of every command-line main. A UserError (bad input, a flag out of range, a
// missing file) prints its message and exits 1; anything else is an internal error and exits 2. Before
// the body runs (and any thread starts), denormal floats are flushed to zero (sys/float_env.h) unless
// BERT_KEEP_DENORMALS=1, and the CPU kernel set is chosen (kernels/cpu_kernels.h), so a bad BERT_CPU_KERNELS
// fails before anything is read or written.
#pragma once

#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include "core/device.h"
#include "kernels/cpu_kernels.h"
#include "sys/error.h"
#include "sys/float_env.h"

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

// --list-devices: prints the devices this program can run on, one a line ("cpu", then
// "cuda:0 (NVIDIA H100 80GB HBM3, 79.1 GiB)" for each GPU), and exits 0 before any other flag is checked;
// scripts use it to choose a GPU recipe.
inline void add_list_devices_flag(CLI::App& app) {
  app.add_flag_callback(
      "--list-devices",
      [] {
        std::printf("cpu\n");
        for (int i = 0; i < Device::cuda_device_count(); ++i)
          std::printf("%s\n", Device::cuda(i)->hardware_name().c_str());
        throw CLI::Success();
      },
      "print the devices this program can use (cpu, cuda:N with its GPU's name) and exit");
}

}  // namespace bert::tools
