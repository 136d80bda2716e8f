#include "sys/error.h"

namespace bert {

void throw_internal_error(const char* file, int line, const char* condition, const std::string& message) {
  throw InternalError(std::string(file) + ":" + std::to_string(line) + ": check failed (" + condition +
                      "): " + message);
}

}  // namespace bert
