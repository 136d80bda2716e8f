// Running another program, and a private folder to exchange files with it. The program gets an
// argument vector, never a shell command line, so a quote, a space or a `$` in a path is just a
// character of that path.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace bert {

// Runs argv[0] (looked up in PATH) with the arguments argv[1..], its stdout and stderr appended to
// `log_path`, and waits for it. Returns the exit status (128 + N when signal N ended it). UserError when
// it cannot be started (not installed, not executable).
int run_program(const std::vector<std::string>& argv, const std::string& log_path);

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
