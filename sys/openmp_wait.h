// How OpenMP's idle threads wait between parallel regions. libgomp's default spins for a while at every
// barrier before sleeping; when another process holds some cores, the spinning threads take the time
// the descheduled ones need, and a step collapses (16 threads on the Xeon with four busy processes:
// 3-10x slower). Passive waiting (sleep at once) kept 60-85% of the unloaded speed there and cost
// nothing measurable unloaded (docs/performance.md, "Sharing the CPU").
#pragma once

#include <string>

namespace bert {

// libgomp reads the policy once, when it is loaded, before main runs: so this re-executes the program
// (same arguments and process id) with OMP_WAIT_POLICY=passive, unless the environment already chooses
// (OMP_WAIT_POLICY or GOMP_SPINCOUNT set; OMP_WAIT_POLICY=active spins as before). Call first in main,
// before any thread starts. Returns when nothing was to be done, or when the re-execution failed (the
// program then runs on with the default policy).
void wait_passively_unless_chosen(char** argv);

// The policy this process's OpenMP runtime was started with, for logs: "passive", "active",
// "GOMP_SPINCOUNT=N" or "default".
std::string openmp_wait_policy();

}  // namespace bert
