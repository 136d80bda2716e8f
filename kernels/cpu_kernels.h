// Which set of hand-written CPU kernels runs: those compiled for the build's instruction set (BERT_ARCH: Eigen's),
// the AVX2 + FMA set (kernels/gemm_avx2.cpp: the FP32 GEMM) or the AVX-512 set (kernels/gemm_avx512.cpp,
// kernels/vector_math_avx512.cpp: the FP32 GEMM and the exp/erf kernels), the last two compiled for their
// instruction set inside any build and chosen at run time where the CPU has it, so a build for any x86-64
// (BERT_ARCH=avx2 or portable) still runs them there. Every set passes the same tests against the same
// references; what a set has no kernel of its own for runs the build's.
#pragma once

namespace bert {

// kAuto: the best set this CPU runs (avx512, else avx2, else build), unless BERT_CPU_KERNELS=build, avx2 or
// avx512 says otherwise (read once). Under build or avx2 no AVX-512 code is chosen at run time at all (the
// integer GEMM takes its AVX2 kernel too): avx2 is what a machine without AVX-512 runs.
enum class CpuKernels { kAuto, kBuild, kAvx2, kAvx512 };
const char* cpu_kernels_name(CpuKernels kernels);  // kAuto: the set it stands for
bool cpu_kernels_supported(CpuKernels kernels);    // kAuto and kBuild: always
CpuKernels best_cpu_kernels();
// Whether the CPU has AVX512_BF16 (with the AVX-512 set): products with BF16 operands run on vdpbf16ps
// when the kernel set is avx512.
bool cpu_has_avx512_bf16();
// Whether the CPU has Intel's AMX tile unit with its INT8 (tdpbusd) or BF16 (tdpbf16ps) products, and Linux
// lets this process use the tiles (asked once: without that the first tile instruction faults).
enum class AmxOp { kInt8, kBf16 };
bool amx_usable(AmxOp op);
// kAuto resolved to the set it stands for; a set the CPU cannot run is an error naming it.
CpuKernels resolve_cpu_kernels(CpuKernels kernels);

}  // namespace bert
