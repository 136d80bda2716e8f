#include "kernels/cpu_kernels.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <string_view>

#include "sys/error.h"

namespace bert {

const char* cpu_kernels_name(CpuKernels kernels) {
  switch (kernels) {
    case CpuKernels::kAuto:
      return cpu_kernels_name(best_cpu_kernels());
    case CpuKernels::kBuild:
      return "build";
    case CpuKernels::kAvx2:
      return "avx2";
    case CpuKernels::kAvx512:
      return "avx512";
  }
  return "?";
}

bool cpu_kernels_supported(CpuKernels kernels) {
  switch (kernels) {
    case CpuKernels::kAuto:
    case CpuKernels::kBuild:
      return true;
    case CpuKernels::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case CpuKernels::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  }
  return false;
}

CpuKernels best_cpu_kernels() {
  static const CpuKernels best = [] {
    const char* asked = std::getenv("BERT_CPU_KERNELS");
    if (asked && *asked) {
      const std::string_view name(asked);
      for (CpuKernels set : {CpuKernels::kBuild, CpuKernels::kAvx2, CpuKernels::kAvx512}) {
        if (name != cpu_kernels_name(set)) continue;
        if (!cpu_kernels_supported(set))
          throw UserError(std::string("BERT_CPU_KERNELS=") + asked + ": this CPU has no " +
                          (set == CpuKernels::kAvx2 ? "AVX2 and FMA" : "AVX-512 (F, BW, DQ and VL)"));
        return set;
      }
      throw UserError(std::string("BERT_CPU_KERNELS='") + asked + "': expected 'build', 'avx2' or 'avx512'");
    }
    for (CpuKernels set : {CpuKernels::kAvx512, CpuKernels::kAvx2})
      if (cpu_kernels_supported(set)) return set;
    return CpuKernels::kBuild;
  }();
  return best;
}

bool cpu_has_avx512_bf16() {
  return cpu_kernels_supported(CpuKernels::kAvx512) && __builtin_cpu_supports("avx512bf16");
}

bool amx_usable(AmxOp op) {
  struct Amx {
    bool int8 = false, bf16 = false;
  };
  static const Amx amx = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !((edx >> 24) & 1)) return Amx{};  // AMX-TILE
    // Linux gives a process the tile registers' state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
    // XTILEDATA).
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    if (syscall(SYS_arch_prctl, kRequestPermission, kTileData) != 0) return Amx{};
    return Amx{((edx >> 25) & 1) != 0, ((edx >> 22) & 1) != 0};  // AMX-INT8, AMX-BF16
  }();
  return op == AmxOp::kInt8 ? amx.int8 : amx.bf16;
}

CpuKernels resolve_cpu_kernels(CpuKernels kernels) {
  if (kernels == CpuKernels::kAuto) return best_cpu_kernels();
  BERT_CHECK(cpu_kernels_supported(kernels),
             std::string("this CPU cannot run the CPU kernels ") + cpu_kernels_name(kernels));
  return kernels;
}

}  // namespace bert
