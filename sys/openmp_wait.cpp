#include "sys/openmp_wait.h"

#include <unistd.h>

#include <cstdlib>

namespace bert {

void wait_passively_unless_chosen(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT")) return;
  if (setenv("OMP_WAIT_POLICY", "passive", 1) != 0) return;
  execv("/proc/self/exe", argv);  // returns only on failure: this process spins, its children will not
}

std::string openmp_wait_policy() {
  if (const char* policy = std::getenv("OMP_WAIT_POLICY")) return policy;
  if (const char* spins = std::getenv("GOMP_SPINCOUNT")) return std::string("GOMP_SPINCOUNT=") + spins;
  return "default";
}

}  // namespace bert
