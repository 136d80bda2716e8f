#include "train/process_group.h"

#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "sys/error.h"
#include "sys/process.h"

extern char** environ;

namespace bert::train {

namespace fs = std::filesystem;

namespace {

const char* variable(const char* name) {
  const char* value = std::getenv(name);
  return value && *value ? value : nullptr;
}

int integer_variable(const char* name, const char* fallback = nullptr) {
  const char* text = variable(name);
  if (!text) text = fallback;
  if (!text) throw UserError(std::string("environment variable ") + name + " is not set (a rank of a job needs it)");
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  if (*end != '\0' || value < 0 || value > (1 << 20))
    throw UserError(std::string("environment variable ") + name + "='" + text + "': expected a non-negative integer");
  return static_cast<int>(value);
}

// A job id as part of a file name.
std::string file_name_part(std::string text) {
  for (char& c : text)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != '_') c = '_';
  return text;
}

}  // namespace

ProcessGroup process_group_from_environment(const std::string& run_dir) {
  ProcessGroup group;
  std::string job;
  if (variable("BERT_RANK")) {
    group.launcher = "--nproc";
    group.rank = integer_variable("BERT_RANK");
    group.size = integer_variable("BERT_WORLD_SIZE");
    group.local_rank = integer_variable("BERT_LOCAL_RANK", variable("BERT_RANK"));
  } else if (variable("OMPI_COMM_WORLD_SIZE")) {
    group.launcher = "Open MPI";
    group.rank = integer_variable("OMPI_COMM_WORLD_RANK");
    group.size = integer_variable("OMPI_COMM_WORLD_SIZE");
    group.local_rank = integer_variable("OMPI_COMM_WORLD_LOCAL_RANK", variable("OMPI_COMM_WORLD_RANK"));
    for (const char* name : {"PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid"})
      if (variable(name) && job.empty()) job = variable(name);
  } else if (variable("SLURM_NTASKS") && variable("SLURM_PROCID")) {
    group.launcher = "Slurm";
    group.rank = integer_variable("SLURM_PROCID");
    group.size = integer_variable("SLURM_NTASKS");
    group.local_rank = integer_variable("SLURM_LOCALID", "0");
    if (variable("SLURM_JOB_ID"))
      job = std::string(variable("SLURM_JOB_ID")) + "." + (variable("SLURM_STEP_ID") ? variable("SLURM_STEP_ID") : "0");
  } else {
    return group;
  }
  if (group.size < 1 || group.rank >= group.size)
    throw UserError("rank " + std::to_string(group.rank) + " of a job of " + std::to_string(group.size) +
                    " processes (from the " + group.launcher + " environment): the rank must be below the size");
  if (variable("BERT_RENDEZVOUS")) {
    group.rendezvous = variable("BERT_RENDEZVOUS");
  } else if (group.size > 1) {
    if (job.empty())
      throw UserError("a job of " + std::to_string(group.size) + " processes started by " + group.launcher +
                      " without a job id in the environment: set BERT_RENDEZVOUS to a file path that every rank "
                      "sees and that is new for this run");
    group.rendezvous = (fs::path(run_dir) / (".rendezvous-" + file_name_part(job))).string();
  }
  return group;
}

void publish_rendezvous(const std::string& path, std::span<const char> bytes) {
  const fs::path target(path);
  std::error_code ec;
  if (target.has_parent_path()) fs::create_directories(target.parent_path(), ec);
  const std::string partial = path + ".partial-" + std::to_string(::getpid());
  {
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out.flush()) throw UserError("cannot write the rendezvous file '" + partial + "' for the other ranks");
  }
  fs::rename(partial, target, ec);
  if (ec) throw UserError("cannot create the rendezvous file '" + path + "': " + ec.message());
}

std::vector<char> await_rendezvous(const std::string& path, std::size_t size, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    std::error_code ec;
    if (fs::file_size(path, ec) == size && !ec) {
      std::ifstream in(path, std::ios::binary);
      std::vector<char> bytes(size);
      if (in.read(bytes.data(), static_cast<std::streamsize>(size))) return bytes;
    }
    if (std::chrono::steady_clock::now() > deadline)
      throw UserError("waited " + std::to_string(timeout.count() / 1000) +
                      " s for rank 0 to publish its connection id in '" + path +
                      "': is rank 0 running, and does every rank see that file?");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

namespace {

volatile std::sig_atomic_t g_signals_received = 0;
volatile std::sig_atomic_t g_last_signal = 0;

void remember_signal(int signal) {
  g_last_signal = signal;
  g_signals_received = g_signals_received + 1;
}

std::string describe_status(int status) {
  if (WIFSIGNALED(status))
    return "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  return "exited with status " + std::to_string(WEXITSTATUS(status));
}

// Each rank's environment: this process's without the rank variables, plus its own.
std::vector<std::vector<std::string>> rank_environments(int ranks, const std::string& rendezvous) {
  std::vector<std::string> inherited;
  for (char** e = environ; *e; ++e) {
    const std::string entry(*e);
    bool ours = false;
    for (const char* name : {"BERT_RANK=", "BERT_LOCAL_RANK=", "BERT_WORLD_SIZE=", "BERT_RENDEZVOUS="})
      ours = ours || entry.rfind(name, 0) == 0;
    if (!ours) inherited.push_back(entry);
  }
  std::vector<std::vector<std::string>> environments(ranks, inherited);
  for (int r = 0; r < ranks; ++r)
    for (const std::string& e : {"BERT_RANK=" + std::to_string(r), "BERT_LOCAL_RANK=" + std::to_string(r),
                                 "BERT_WORLD_SIZE=" + std::to_string(ranks), "BERT_RENDEZVOUS=" + rendezvous})
      environments[r].push_back(e);
  return environments;
}

// One process per rank running argv with its environment; those already started are killed when a
// fork fails.
std::vector<pid_t> start_ranks(const std::vector<std::string>& argv,
                               std::vector<std::vector<std::string>>& environments) {
  // Everything the children need is built before the first fork.
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const int ranks = static_cast<int>(environments.size());
  std::vector<std::vector<char*>> envps(ranks);
  for (int r = 0; r < ranks; ++r) {
    for (std::string& e : environments[r]) envps[r].push_back(e.data());
    envps[r].push_back(nullptr);
  }
  const pid_t parent = ::getpid();
  std::vector<pid_t> pids(ranks, -1);
  for (int r = 0; r < ranks; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      for (pid_t p : pids)
        if (p > 0) ::kill(p, SIGKILL);
      throw UserError(std::string("--nproc: cannot start a process: ") + std::strerror(errno));
    }
    if (pid == 0) {
      // The terminal's Ctrl-C reaches the launcher only, which passes it on once; and the ranks end
      // with the launcher if it is killed.
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) ::_exit(128 + SIGTERM);
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::execve(args[0], args.data(), envps[r].data());
      const std::string message = "cannot run '" + argv[0] + "': " + std::strerror(errno) + "\n";
      [[maybe_unused]] auto ignored = ::write(2, message.data(), message.size());
      ::_exit(127);
    }
    pids[r] = pid;
  }
  return pids;
}

// Waits for every rank, passing on SIGINT/SIGTERM the launcher receives; the first rank that fails
// stops the others (SIGTERM, then SIGKILL after `grace`) and gives the result.
int wait_for_ranks(std::vector<pid_t>& pids, std::string* failure, std::chrono::milliseconds grace) {
  const int ranks = static_cast<int>(pids.size());
  int running = ranks, result = 0, forwarded = 0;
  bool failed = false;
  auto kill_deadline = std::chrono::steady_clock::time_point::max();
  auto signal_all = [&](int signal) {
    for (pid_t p : pids)
      if (p > 0) ::kill(p, signal);
  };
  while (running > 0) {
    if (g_signals_received > forwarded) {
      forwarded = g_signals_received;
      signal_all(g_last_signal);
    }
    if (failed && std::chrono::steady_clock::now() > kill_deadline) {
      signal_all(SIGKILL);
      kill_deadline = std::chrono::steady_clock::time_point::max();
    }
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, failed ? WNOHANG : 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;  // ECHILD: none left
    }
    if (pid == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    int rank = 0;
    while (rank < ranks && pids[rank] != pid) ++rank;
    if (rank == ranks) continue;
    pids[rank] = -1;
    --running;
    const int code = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
    const bool stopped = WIFEXITED(status) && (code == 128 + SIGINT || code == 128 + SIGTERM);
    if (code == 0 || stopped) {
      if (!failed && code != 0) result = code;
      continue;
    }
    if (!failed) {
      failed = true;
      result = code;
      if (failure)
        *failure = "rank " + std::to_string(rank) + " of " + std::to_string(ranks) + " " + describe_status(status);
      signal_all(SIGTERM);
      kill_deadline = std::chrono::steady_clock::now() + grace;
    }
  }
  return result;
}

}  // namespace

int launch_local_ranks(const std::vector<std::string>& argv, int ranks, std::string* failure,
                       std::chrono::milliseconds grace) {
  if (ranks < 1) throw UserError("--nproc: at least one process");
  if (argv.empty()) throw UserError("launch_local_ranks: no program");
  PrivateTempDir dir("bert-ranks");
  std::vector<std::vector<std::string>> environments = rank_environments(ranks, dir.file("rendezvous"));
  // SIGINT and SIGTERM are recorded and passed on; without SA_RESTART they interrupt waitpid. The
  // launcher's own handlers come back however this ends.
  struct sigaction action {
  }, old_int{}, old_term{};
  action.sa_handler = remember_signal;
  sigemptyset(&action.sa_mask);
  g_signals_received = 0;
  sigaction(SIGINT, &action, &old_int);
  sigaction(SIGTERM, &action, &old_term);
  struct RestoreSignals {
    struct sigaction *old_int, *old_term;
    ~RestoreSignals() {
      sigaction(SIGINT, old_int, nullptr);
      sigaction(SIGTERM, old_term, nullptr);
    }
  } restore{&old_int, &old_term};
  std::vector<pid_t> pids = start_ranks(argv, environments);
  return wait_for_ranks(pids, failure, grace);
}

}  // namespace bert::train
