// Several training processes as one job (one per GPU): which rank this process is, how rank 0 hands
// the others the id they connect with (a rendezvous file), and the launcher behind `bert-train
// --nproc N`, which starts one process per GPU on this machine and ends the job when one of them fails.
#pragma once

#include <chrono>
#include <span>
#include <string>
#include <vector>

namespace bert::train {

struct ProcessGroup {
  int rank = 0, size = 1;
  int local_rank = 0;      // the rank among the processes of this machine: its GPU
  std::string rendezvous;  // the file rank 0 publishes the connection id in (every rank must see it)
  std::string launcher;    // who started the processes, for messages: "--nproc", "Open MPI", "Slurm"
  bool distributed() const { return size > 1; }
};

// The group this process belongs to, from its environment: BERT_RANK, BERT_WORLD_SIZE, BERT_LOCAL_RANK
// and BERT_RENDEZVOUS (set by --nproc), else Open MPI's OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK} (mpirun),
// else Slurm's SLURM_{PROCID,NTASKS,LOCALID} (srun); a group of one when none is set. Under MPI or
// Slurm the rendezvous file is BERT_RENDEZVOUS when set, else `<run_dir>/.rendezvous-<job id>`: the
// run folder must then be on a file system every machine of the job sees. UserError for malformed
// values (naming the variable).
ProcessGroup process_group_from_environment(const std::string& run_dir);

// Rank 0: writes the connection id to `path` whole (a temporary file, then a rename), so a reader never
// sees half of it.
void publish_rendezvous(const std::string& path, std::span<const char> bytes);
// The other ranks: waits until `path` holds `size` bytes and returns them; UserError naming the file
// after `timeout`.
std::vector<char> await_rendezvous(const std::string& path, std::size_t size, std::chrono::milliseconds timeout);

// Runs `ranks` copies of the program argv[0] (a path) with arguments argv[1..], rank i with BERT_RANK=i,
// BERT_LOCAL_RANK=i, BERT_WORLD_SIZE=ranks and BERT_RENDEZVOUS=<a file in a private folder>, and waits
// for all of them. Ctrl-C and SIGTERM reach each rank once (they stop together with a checkpoint).
// A rank that fails (an exit status other than 0 or a stop by SIGINT/SIGTERM, or killed by a signal)
// ends the job: the others get SIGTERM, then SIGKILL after `grace` (they may be waiting for the dead
// rank and never see the signal). Returns 0 when every rank finished, 128 + N when they stopped on
// signal N, else the failed rank's status; `failure` then names the rank and what happened.
int launch_local_ranks(const std::vector<std::string>& argv, int ranks, std::string* failure,
                       std::chrono::milliseconds grace = std::chrono::seconds(10));

}  // namespace bert::train
