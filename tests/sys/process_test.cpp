// Running programs without a shell, and private temporary folders.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "sys/error.h"
#include "sys/process.h"

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

int open_descriptors() {
  int n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

TEST(RunProgram, StreamsBinaryOutputWhileTheProgramRunsAndStopsItWhenTheReaderFails) {
  const PrivateTempDir dir("bert-process-test");
  const int descriptors = open_descriptors();
  // Two messages through the stream (a NUL byte included), the log apart, the exit status back.
  std::vector<std::string> messages;
  const int status =
      run_program_streaming({"sh", "-c", "printf 'ab\\000c' >&3; echo to-the-log; printf 'defg' >&3; exit 3"},
                            dir.file("log"), [&](ProgramStream& stream) {
                              char buffer[4];
                              while (stream.read_exact(buffer, 4)) messages.emplace_back(buffer, 4);
                            });
  EXPECT_EQ(status, 3);
  ASSERT_EQ(messages.size(), 2u);
  EXPECT_EQ(messages[0], std::string("ab\0c", 4));
  EXPECT_EQ(messages[1], "defg");
  EXPECT_EQ(read(dir.file("log")), "to-the-log\n");
  // A stream that ends inside a message is an error, not a short read.
  EXPECT_THROW(run_program_streaming({"sh", "-c", "printf 'abc' >&3"}, dir.file("log"),
                                     [](ProgramStream& stream) {
                                       char buffer[4];
                                       stream.read_exact(buffer, 4);
                                     }),
               UserError);
  // A reader that gives up stops a program that would write forever; the error goes on.
  EXPECT_THROW(run_program_streaming({"sh", "-c", "while :; do printf 'xxxxxxxx' >&3; done"}, dir.file("log"),
                                     [](ProgramStream& stream) {
                                       char buffer[8];
                                       ASSERT_TRUE(stream.read_exact(buffer, 8));
                                       throw UserError("reader gave up");
                                     }),
               UserError);
  EXPECT_THROW(run_program_streaming({"no-such-program-anywhere"}, dir.file("log"), [](ProgramStream&) {}), UserError);
  EXPECT_EQ(open_descriptors(), descriptors) << "a pipe end was left open";
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
