// Which set of hand-written CPU kernels runs: those compiled for the build's instruction set (BERT_ARCH),
// or those compiled for AVX-512 inside any build (core/gemm_avx512.cpp, core/vector_math_avx512.cpp),
// chosen at run time where the CPU has AVX-512, so a build for any x86-64 (BERT_ARCH=avx2 or portable)
// still runs AVX-512 code there. Both sets pass the same tests against the same references.
#pragma once

namespace bert {

// kAuto: the best set this CPU runs, unless BERT_CPU_KERNELS=build (or avx512) says otherwise (read once).
// Under build no AVX-512 code is chosen at run time at all (the integer GEMM takes its AVX2 kernel too):
// what a machine without AVX-512 runs.
enum class CpuKernels { kAuto, kBuild, kAvx512 };
const char* cpu_kernels_name(CpuKernels kernels);  // kAuto: the set it stands for
bool cpu_kernels_supported(CpuKernels kernels);    // kAuto and kBuild: always
CpuKernels best_cpu_kernels();
// kAuto resolved to the set it stands for; a set the CPU cannot run is an error naming it.
CpuKernels resolve_cpu_kernels(CpuKernels kernels);

}  // namespace bert
