// SourceLocation: std::source_location where the standard library has it, else the same accessors from
// the compiler's builtins (clang 14 with Debian's libstdc++ 12, the fuzzing build, has no
// std::source_location; its function_name() is then the bare name, not the whole signature).
#pragma once

#include <version>

#if defined(__cpp_lib_source_location)
#include <source_location>
namespace bert {
using SourceLocation = std::source_location;
}  // namespace bert
#else
namespace bert {
class SourceLocation {
 public:
  static constexpr SourceLocation current(const char* file = __builtin_FILE(),
                                          const char* function = __builtin_FUNCTION(),
                                          unsigned line = __builtin_LINE()) noexcept {
    SourceLocation s;
    s.file_ = file, s.function_ = function, s.line_ = line;
    return s;
  }
  constexpr const char* file_name() const noexcept { return file_; }
  constexpr const char* function_name() const noexcept { return function_; }
  constexpr unsigned line() const noexcept { return line_; }
  constexpr unsigned column() const noexcept { return 0; }

 private:
  const char* file_ = "";
  const char* function_ = "";
  unsigned line_ = 0;
};
}  // namespace bert
#endif
