// The GEMM helpers of ops/matmul.cu (cuBLAS and cuBLASLt on the graph's stream) for the other ops that
// multiply: the fused self-attention (ops/attention.cu) runs its three projections through them.
#pragma once

#include <cuda_runtime.h>
#include <library_types.h>

#include <cstdint>

#include "core/graph.h"

namespace bert::ops::cuda_impl {

// Row-major C (M, N) = alpha op(A) op(B) + beta C for `batch` items at the given element strides; A and B
// of type ab, C of type c (BF16 operands may write an FP32 C: weight gradients into FP32 parameters).
void gemm(const Graph<float>& g, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const void* a, int64_t lda, int64_t stride_a, const void* b, int64_t ldb, int64_t stride_b, float beta,
          void* c, int64_t ldc, int64_t stride_c, int64_t batch, cudaDataType_t ab = CUDA_R_32F,
          cudaDataType_t ct = CUDA_R_32F);

// y_i (rows, out) = x (rows, in) W_i^T + bias_i for i < batch, in one cuBLASLt product with the bias in its
// epilogue: W_i at w + i w_stride, bias_i at bias + i bias_stride, y_i at y + i y_stride (rows ldy apart),
// all of type `type` (elements). Returns false when cuBLASLt has no algorithm for it (the caller then
// multiplies otherwise).
bool gemm_bias(const Graph<float>& g, int64_t rows, int64_t in, int64_t out, const void* x, const void* w,
               const void* bias, void* y, int64_t ldy, cudaDataType_t type, int64_t batch = 1, int64_t w_stride = 0,
               int64_t bias_stride = 0, int64_t y_stride = 0);

// y (rows, out; rows ldy apart) = x (rows, in) W^T (+ bias), W (out, in), all of type `type`: the bias in
// cuBLASLt's epilogue (bias_gemm, of y's type), else added by a kernel of its own (bias: its F32 values, over
// the first bias_cols columns; nullptr: no bias).
void linear_product(const Graph<float>& g, int64_t rows, int64_t in, int64_t out, const void* x, const void* w,
                    const void* bias_gemm, const float* bias, int64_t bias_cols, void* y, int64_t ldy,
                    cudaDataType_t type);

// A parameter-like F32 operand (rows, cols) as the GEMM's operand type A (float or cuda::bf16), with zero
// rows up to padded_rows: the node's own storage when nothing is to change, a parameter's BF16 copy kept
// by its arena (written by the optimizer), else a converted copy in the graph's scratch.
template <typename A>
const A* gemm_operand(Graph<float>& g, Var v, int64_t rows, int64_t padded_rows, int64_t cols);

// dbias_p (cols) += the column sums of dy_p (rows, cols; rows ld apart) for each of `parts` parts: dy_p at
// dy + p dy_part_stride, dbias_p at dbias + p dbias_part_stride (elements). Deterministic.
void add_column_sums(Graph<float>& g, const void* dy, DType dy_type, int64_t rows, int64_t cols, int64_t ld,
                     float* dbias, int parts = 1, int64_t dy_part_stride = 0, int64_t dbias_part_stride = 0);

}  // namespace bert::ops::cuda_impl
