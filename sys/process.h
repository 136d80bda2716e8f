// Running another program, and a private folder to exchange files with it. The program gets an
// argument vector, never a shell command line, so a quote, a space or a `$` in a path is just a
// character of that path.
#pragma once

#include <cstddef>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace bert {

// Runs argv[0] (looked up in PATH) with the arguments argv[1..], its stdout and stderr appended to
// `log_path`, and waits for it. Returns the exit status (128 + N when signal N ended it). UserError when
// it cannot be started (not installed, not executable).
int run_program(const std::vector<std::string>& argv, const std::string& log_path);

// The file descriptor a program started by run_program_streaming writes its stream to.
constexpr int kStreamFd = 3;

// Reads a program's stream (its file descriptor kStreamFd, a pipe) while the program runs.
class ProgramStream {
 public:
  explicit ProgramStream(int fd) : fd_(fd) {}
  // Fills `out` with exactly `size` bytes. False at a clean end of the stream (no byte read); UserError
  // when it ends inside the read (the program stopped mid-message).
  bool read_exact(void* out, size_t size);

 private:
  int fd_;
};

// run_program, and while the program runs, `consume` reads what it writes to kStreamFd until the end
// of the stream (the program exits or closes it): binary results of any size pass without files. If
// `consume` throws, the program is killed and waited for, and the exception goes on.
int run_program_streaming(const std::vector<std::string>& argv, const std::string& log_path,
                          const std::function<void(ProgramStream&)>& consume);

// A new folder under the system's temporary directory, readable by this user only (mkdtemp), removed
// with everything in it when this goes out of scope: concurrent runs never share files.
class PrivateTempDir {
 public:
  explicit PrivateTempDir(const std::string& prefix = "bert");
  ~PrivateTempDir();
  PrivateTempDir(const PrivateTempDir&) = delete;
  PrivateTempDir& operator=(const PrivateTempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace bert
