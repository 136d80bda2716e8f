#include "sys/openmp_wait.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>

#include "sys/process.h"

namespace bert {
namespace {

// Sets (or, with nullopt, removes) an environment variable for the scope, then restores it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      setenv(name, value->c_str(), 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_)
      setenv(name_, old_->c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// The probe program: where the build put it, else beside this test program (a copied bundle of tests).
std::string probe_program() {
  if (std::filesystem::exists(BERT_OPENMP_WAIT_PROBE)) return BERT_OPENMP_WAIT_PROBE;
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "openmp_wait_probe").string();
}

std::string probe(const std::string& arg) {
  PrivateTempDir dir;
  EXPECT_EQ(run_program({probe_program(), arg}, dir.file("out.txt")), 0);
  std::ifstream in(dir.file("out.txt"));
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(OpenMpWait, ReexecutesWithPassiveWaitingSoTheRuntimeSeesItAtLoad) {
  ScopedEnv policy("OMP_WAIT_POLICY", std::nullopt), spins("GOMP_SPINCOUNT", std::nullopt);
  const std::string out = probe("a b");
  // The image that runs main's rest was loaded with the policy set: the program was executed again,
  // as the same process, with its arguments.
  EXPECT_NE(out.find("at-load=passive now=passive"), std::string::npos) << out;
  const auto pid = out.find(" pid="), first = out.find(" first-pid=");
  ASSERT_NE(pid, std::string::npos);
  ASSERT_NE(first, std::string::npos);
  EXPECT_EQ(std::stol(out.substr(pid + 5)), std::stol(out.substr(first + 11))) << out;
  EXPECT_NE(out.find("args=a b"), std::string::npos) << out;
}

TEST(OpenMpWait, LeavesAChoiceMadeInTheEnvironment) {
  {
    ScopedEnv policy("OMP_WAIT_POLICY", "active"), spins("GOMP_SPINCOUNT", std::nullopt);
    EXPECT_NE(probe("x").find("at-load=active now=active"), std::string::npos);
    EXPECT_EQ(openmp_wait_policy(), "active");
  }
  {
    ScopedEnv policy("OMP_WAIT_POLICY", std::nullopt), spins("GOMP_SPINCOUNT", "1000");
    EXPECT_NE(probe("x").find("at-load=unset now=unset"), std::string::npos);
    EXPECT_EQ(openmp_wait_policy(), "GOMP_SPINCOUNT=1000");
  }
  ScopedEnv policy("OMP_WAIT_POLICY", std::nullopt), spins("GOMP_SPINCOUNT", std::nullopt);
  EXPECT_EQ(openmp_wait_policy(), "default");
}

}  // namespace
}  // namespace bert
