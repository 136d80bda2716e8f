// Flushing denormals: a product below the smallest normal float becomes zero, a denormal operand reads
// as zero, and a thread started afterwards inherits the setting (what the tools rely on for OpenMP's
// workers). Runs in threads of its own so the rest of the suite keeps the default environment.
#include <gtest/gtest.h>

#include <limits>
#include <thread>

#include "sys/float_env.h"

namespace bert {
namespace {

struct Seen {
  bool flushes = false;
  float product = -1, sum = -1;
};

Seen observe() {
  volatile float tiny = 1e-30f, small = 1e-10f;  // volatile: computed at run time, in this thread
  volatile float denormal = std::numeric_limits<float>::denorm_min() * 1000;
  Seen s;
  s.flushes = flushes_denormals();
  s.product = tiny * small;  // 1e-40: a denormal result
  s.sum = denormal + 0.0f;   // a denormal operand
  return s;
}

TEST(FloatEnv, FlushedDenormalsAreZeroAndNewThreadsInheritIt) {
  Seen before, after, child;
  std::thread([&] {
    before = observe();
    flush_denormals_to_zero();
    after = observe();
    std::thread([&] { child = observe(); }).join();
  }).join();
#if defined(__x86_64__)
  EXPECT_FALSE(before.flushes);
  EXPECT_GT(before.product, 0.0f) << "denormals are kept by default";
  EXPECT_GT(before.sum, 0.0f);
  EXPECT_TRUE(after.flushes);
  EXPECT_EQ(after.product, 0.0f);
  EXPECT_EQ(after.sum, 0.0f);
  EXPECT_TRUE(child.flushes) << "a thread started afterwards inherits the setting";
  EXPECT_EQ(child.product, 0.0f);
#else
  GTEST_SKIP() << "flushing denormals is set on x86-64 only";
#endif
}

}  // namespace
}  // namespace bert
