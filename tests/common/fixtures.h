// Where the committed test fixtures are: the source tree's tests/fixtures (compiled in), unless
// BERT_TEST_FIXTURES names another copy (a test bundle run on another machine, e.g. one with a GPU).
#pragma once

#include <cstdlib>
#include <string>

namespace bert::testing {

inline std::string fixtures_dir() {
  const char* override_dir = std::getenv("BERT_TEST_FIXTURES");
  return override_dir && *override_dir ? override_dir : BERT_TEST_FIXTURES_DIR;
}

}  // namespace bert::testing
