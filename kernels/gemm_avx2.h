// The single-precision one-thread GEMM kernel compiled for AVX2 + FMA (x86-64-v3) whatever the build targets,
// for gemm()'s run-time choice on CPUs without AVX-512 (kernels/gemm.h). Call only where
// cpu_kernels_supported(CpuKernels::kAvx2).
#pragma once

#include <cstdint>

#include "kernels/gemm.h"

namespace bert::gemm_avx2 {

void one_thread(GemmArgs g, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                int64_t ldc, const float* bias);

}  // namespace bert::gemm_avx2
