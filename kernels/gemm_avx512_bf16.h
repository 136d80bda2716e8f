// The one-thread GEMM with BF16 operands compiled for AVX-512 + AVX512_BF16 whatever the build targets, for
// gemm()'s run-time choice (kernels/gemm.h: GemmArgs::bf16). Call only where cpu_has_avx512_bf16().
#pragma once

#include <cstdint>

#include "kernels/gemm.h"

namespace bert::gemm_avx512_bf16 {

// C = alpha op(A) op(B) + beta C (+ bias per column), A and B rounded to BF16, products summed in FP32:
// on vdpbf16ps, or on AMX's tile unit (one_thread_amx: call only where amx_usable(AmxOp::kBf16)).
void one_thread(GemmArgs g, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                int64_t ldc, const float* bias);
void one_thread_amx(GemmArgs g, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                    float* c, int64_t ldc, const float* bias);

}  // namespace bert::gemm_avx512_bf16
