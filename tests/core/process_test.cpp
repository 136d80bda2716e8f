// Running programs without a shell, and private temporary folders.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/process.h"

namespace bert {
namespace {

std::string read(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

TEST(RunProgram, PathsWithQuotesSpacesAndDollarsPassIntact) {
  const PrivateTempDir dir("bert-process-test");
  const std::string awkward = dir.file("it's a \"file\" $HOME; rm -rf x");
  std::ofstream(awkward) << "content";
  const std::string copy = dir.file("copy of it's");
  EXPECT_EQ(run_program({"cp", awkward, copy}, dir.file("log")), 0);
  EXPECT_EQ(read(copy), "content");
  // stdout and stderr land in the log; the exit status comes back.
  EXPECT_EQ(run_program({"ls", dir.file("no such file")}, dir.file("log")), 2);
  EXPECT_NE(read(dir.file("log")).find("no such file"), std::string::npos);
  EXPECT_EQ(run_program({"echo", "a b", "'c'"}, dir.file("echo.log")), 0);
  EXPECT_EQ(read(dir.file("echo.log")), "a b 'c'\n");
  EXPECT_THROW(run_program({"no-such-program-anywhere"}, dir.file("log")), UserError);
}

TEST(PrivateTempDir, IsFreshPrivateAndRemoved) {
  std::filesystem::path first;
  {
    const PrivateTempDir a("bert-process-test"), b("bert-process-test");
    EXPECT_NE(a.path(), b.path());
    struct stat st {};
    ASSERT_EQ(stat(a.path().c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700u);
    std::ofstream(a.file("x")) << "1";
    first = a.path();
  }
  EXPECT_FALSE(std::filesystem::exists(first));
}

}  // namespace
}  // namespace bert
