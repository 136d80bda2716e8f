// One fuzz target per parser of outside data. Each file defines LLVMFuzzerTestOneInput; built with
// clang -fsanitize=fuzzer it is a libFuzzer binary (tests/fuzz/run.sh), built with any compiler and
// replay_main.cpp it replays a corpus (CTest runs every seed and every past crash that way, also
// under ASan+UBSan). A target may throw UserError (bad input, reported cleanly); anything else -
// a crash, a sanitizer report, another exception - is a finding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include <unistd.h>

#include "sys/error.h"

namespace bert::fuzz {

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// The input as a file (for parsers that take a path), removed at scope end.
class InputFile {
 public:
  InputFile(const uint8_t* data, size_t size, const char* suffix) {
    path_ = (std::filesystem::temp_directory_path() / ("bert-fuzz-" + std::to_string(::getpid()) + suffix)).string();
    std::ofstream(path_, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data), size);
  }
  ~InputFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Runs f; a UserError is the expected outcome for bad input.
template <typename F>
void expect_clean(F&& f) {
  try {
    f();
  } catch (const UserError&) {
  }
}

}  // namespace bert::fuzz
