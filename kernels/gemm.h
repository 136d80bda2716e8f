// General matrix multiply on row-major matrices:  C = alpha * op(A) * op(B) + beta * C,
// op(X) = X or X^T.  A is (M, K) after op, B is (K, N) after op, C is (M, N); lda/ldb/ldc are the
// row strides of the matrices as stored.
#pragma once

#include <cstdint>
#include <functional>

#include "kernels/cpu_kernels.h"
#include "kernels/output_tiles.h"

namespace bert {

struct GemmArgs {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  // BF16 operands (single precision only): A and B rounded to BF16 (nearest even, as vcvtneps2bf16 rounds;
  // the caller's matrices are left alone), their products summed in FP32: on Intel's AMX tiles where the CPU
  // has them, else on AVX512_BF16 CPUs by vdpbf16ps (on AMD's twice the FP32 kernel's multiply-adds per
  // instruction; on Intel's only FP32's rate), elsewhere by the FP32 kernel on rounded copies (the same values
  // up to summation order).
  bool bf16 = false;
};

// The one-thread kernel every product runs on its blocks (kernels/cpu_kernels.h): Eigen compiled for the
// build's instruction set, or the AVX-512 set (kernels/gemm_avx512.cpp: our own register-tiled kernel in
// single precision, Eigen in double), on independent blocks of C (or parts of k) spread over the
// OpenMP threads. Measured against OpenBLAS 0.3.21 on the AMD EPYC (Zen 4), 2 cores:
// equal or faster on every BERT shape tried.
// With a bias (n values), C = alpha op(A) op(B) + beta C + bias added to every row, in the kernel's
// store of C (a linear layer's forward: no pass of its own).
// With `finish`, each block of C, once final, is handed to finish(r0, r1, c0, c1) (rows r0 .. r1, columns
// c0 .. c1) on the thread that computed it, while the block is still in its cache: an activation applied
// as the product is made (ops::linear_gelu) instead of in a pass over memory of its own. The blocks cover C
// once each.
using GemmFinish = std::function<void(int64_t r0, int64_t r1, int64_t c0, int64_t c1)>;
template <typename T>
void gemm(GemmArgs args, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc,
          CpuKernels kernel = CpuKernels::kAuto, const T* bias = nullptr, const GemmFinish* finish = nullptr);

// C = op(A) op(B) + bias (bias may be null) made tile by tile, at most tile_rows x tile_cols each, in a buffer
// of the thread that made it and handed to visit (kernels/output_tiles.h); C is never stored whole. Each tile
// is the one-thread product of its block, as gemm makes its blocks of C (where gemm splits k instead, its
// sums run in another order).
void gemm_tiles(GemmArgs args, const float* a, int64_t lda, const float* b, int64_t ldb, const float* bias,
                int64_t tile_rows, int64_t tile_cols, const OutputTileVisitor& visit,
                CpuKernels kernel = CpuKernels::kAuto);

// Plain triple loop, accumulating in double (of BF16-rounded operands with args.bf16): the reference the fast
// path is tested against.
template <typename T>
void gemm_reference(GemmArgs args, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc,
                    const T* bias = nullptr);

// What products with BF16 operands run on: AMX's tdpbf16ps, AVX512_BF16's vdpbf16ps, or the FP32 kernel on
// operands rounded to BF16 first (the same values up to summation order).
enum class Bf16Products { kAmx, kVdpbf16ps, kRoundedCopies };
const char* bf16_products_name(Bf16Products products);  // "AMX", "vdpbf16ps", "FP32 kernel on rounded copies"
// The choice for a CPU with these features: AMX where its BF16 tiles are usable, else vdpbf16ps where the CPU
// has AVX512_BF16 (with the AVX-512 kernel set), else the rounded copies. On Intel cores without usable AMX
// vdpbf16ps (one a cycle against two FP32 FMAs) is slower than FP32, yet still faster than the rounded
// copies (a 16-core Intel Xeon, tiny training step: 1.30-1.44x the copies, 0.78-0.89x FP32): FP32 training
// is the better choice there (docs/training.md).
Bf16Products choose_bf16_products(bool avx512_set, bool avx512_bf16, bool amx_bf16);
// This CPU's choice under `kernel` (not AVX-512: the rounded copies). BERT_BF16_PRODUCTS=amx, vdpbf16ps or copies
// overrides it where the CPU runs that (read once; the comparisons in bench/ use it).
Bf16Products bf16_products(CpuKernels kernel = CpuKernels::kAuto);
// Whether products with BF16 operands run on BF16 instructions under this kernel set, and which.
bool gemm_bf16_native(CpuKernels kernel = CpuKernels::kAuto);
const char* gemm_bf16_kernel_name(CpuKernels kernel = CpuKernels::kAuto);

// x rounded to the nearest BF16 value (ties to even), returned as the float it stands for; NaN stays NaN
// (quiet), infinities stay.
float round_to_bf16(float x);

}  // namespace bert
