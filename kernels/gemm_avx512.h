// The one-thread GEMM kernel compiled for AVX-512 (x86-64-v4) whatever the build targets, for gemm()'s
// run-time choice (kernels/gemm.h). Call only where cpu_kernels_supported(CpuKernels::kAvx512).
#pragma once

#include <cstdint>

#include "kernels/gemm.h"

namespace bert::gemm_avx512 {

void one_thread(GemmArgs g, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                int64_t ldc, const float* bias);
void one_thread(GemmArgs g, double alpha, const double* a, int64_t lda, const double* b, int64_t ldb, double beta,
                double* c, int64_t ldc, const double* bias);

}  // namespace bert::gemm_avx512
