#include "core/cpu_kernels.h"

#include <cstdlib>
#include <string>
#include <string_view>

#include "core/error.h"

namespace bert {

const char* cpu_kernels_name(CpuKernels kernels) {
  switch (kernels) {
    case CpuKernels::kAuto:
      return cpu_kernels_name(best_cpu_kernels());
    case CpuKernels::kBuild:
      return "build";
    case CpuKernels::kAvx512:
      return "avx512";
  }
  return "?";
}

bool cpu_kernels_supported(CpuKernels kernels) {
  if (kernels != CpuKernels::kAvx512) return true;
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

CpuKernels best_cpu_kernels() {
  static const CpuKernels best = [] {
    const char* asked = std::getenv("BERT_CPU_KERNELS");
    if (asked && std::string_view(asked) == "build") return CpuKernels::kBuild;
    if (asked && *asked && std::string_view(asked) != "avx512")
      throw UserError(std::string("BERT_CPU_KERNELS='") + asked + "': expected 'build' or 'avx512'");
    if (asked && *asked && !cpu_kernels_supported(CpuKernels::kAvx512))
      throw UserError("BERT_CPU_KERNELS=avx512: this CPU has no AVX-512 (F, BW, DQ and VL)");
    return cpu_kernels_supported(CpuKernels::kAvx512) ? CpuKernels::kAvx512 : CpuKernels::kBuild;
  }();
  return best;
}

CpuKernels resolve_cpu_kernels(CpuKernels kernels) {
  if (kernels == CpuKernels::kAuto) return best_cpu_kernels();
  BERT_CHECK(cpu_kernels_supported(kernels),
             std::string("this CPU cannot run the CPU kernels ") + cpu_kernels_name(kernels));
  return kernels;
}

}  // namespace bert
