// expect_user_error: asserts that f() throws a UserError whose message contains `fragment`.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "sys/error.h"

namespace bert::testing {

inline void expect_user_error(const std::function<void()>& f, const std::string& fragment) {
  try {
    f();
    ADD_FAILURE() << "expected a UserError containing '" << fragment << "'";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

}  // namespace bert::testing
