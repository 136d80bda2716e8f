// Helper of OpenMpWait tests: calls wait_passively_unless_chosen first, as the tools do, then prints
// the OMP_WAIT_POLICY this process image saw when it was loaded (where libgomp reads it) and the one it
// sees now, and its process id.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "sys/openmp_wait.h"

namespace {
std::string policy_now() {
  const char* p = std::getenv("OMP_WAIT_POLICY");
  return p ? p : "unset";
}
// Read while the image loads, before main: what a runtime initialised at load time reads.
const std::string policy_at_load = policy_now();
}  // namespace

int main(int, char** argv) {
  const long pid_before = static_cast<long>(getpid());
  bert::wait_passively_unless_chosen(argv);
  std::printf("at-load=%s now=%s pid=%ld first-pid=%ld args=%s\n", policy_at_load.c_str(), policy_now().c_str(),
              static_cast<long>(getpid()), pid_before, argv[1] ? argv[1] : "");
  return 0;
}
