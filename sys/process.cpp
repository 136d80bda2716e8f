#include "sys/process.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>

#include "sys/error.h"

extern char** environ;

namespace bert {

namespace {

// Starts argv with stdout and stderr appended to log_path and, when stream_fd >= 0, that descriptor
// as the child's kStreamFd. Returns the child's pid.
pid_t spawn(const std::vector<std::string>& argv, const std::string& log_path, int stream_fd) {
  BERT_CHECK(!argv.empty(), "run_program needs a program");
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  if (stream_fd >= 0) posix_spawn_file_actions_adddup2(&actions, stream_fd, kStreamFd);
  pid_t pid = 0;
  const int started = posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (started != 0)
    throw UserError("cannot run '" + argv[0] + "': " + std::strerror(started) +
                    (started == ENOENT ? " (is it installed and on PATH?)" : ""));
  return pid;
}

int wait_for(pid_t pid, const std::string& program) {
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) throw UserError("waiting for '" + program + "' failed: " + std::strerror(errno));
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

int run_program(const std::vector<std::string>& argv, const std::string& log_path) {
  return wait_for(spawn(argv, log_path, -1), argv.at(0));
}

bool ProgramStream::read_exact(void* out, size_t size) {
  auto* bytes = static_cast<char*>(out);
  size_t done = 0;
  while (done < size) {
    const ssize_t n = read(fd_, bytes + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw UserError(std::string("reading another program's output failed: ") + std::strerror(errno));
    if (n == 0) {
      if (done == 0) return false;
      throw UserError("another program's output ended inside a message (" + std::to_string(done) + " of " +
                      std::to_string(size) + " bytes)");
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

int run_program_streaming(const std::vector<std::string>& argv, const std::string& log_path,
                          const std::function<void(ProgramStream&)>& consume) {
  int ends[2];
  if (pipe2(ends, O_CLOEXEC) != 0) throw UserError(std::string("cannot create a pipe: ") + std::strerror(errno));
  // The child's end must not already be kStreamFd: dup2 onto itself would keep its close-on-exec flag.
  if (ends[1] == kStreamFd) {
    const int moved = fcntl(ends[1], F_DUPFD_CLOEXEC, kStreamFd + 1);
    close(ends[1]);
    ends[1] = moved;
  }
  pid_t pid = 0;
  try {
    pid = spawn(argv, log_path, ends[1]);
  } catch (...) {
    close(ends[0]);
    close(ends[1]);
    throw;
  }
  close(ends[1]);  // the child holds the only write end: its exit ends the stream
  ProgramStream stream(ends[0]);
  try {
    consume(stream);
  } catch (...) {
    close(ends[0]);
    kill(pid, SIGKILL);
    wait_for(pid, argv[0]);
    throw;
  }
  close(ends[0]);
  return wait_for(pid, argv[0]);
}

PrivateTempDir::PrivateTempDir(const std::string& prefix) {
  std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
  if (!mkdtemp(pattern.data()))
    throw UserError("cannot create a temporary folder '" + pattern + "': " + std::strerror(errno));
  path_ = pattern;
}

PrivateTempDir::~PrivateTempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

}  // namespace bert
