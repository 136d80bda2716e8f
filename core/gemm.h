// General matrix multiply on row-major matrices:  C = alpha * op(A) * op(B) + beta * C,
// op(X) = X or X^T.  A is (M, K) after op, B is (K, N) after op, C is (M, N); lda/ldb/ldc are the
// row strides of the matrices as stored.
#pragma once

#include <cstdint>

namespace bert {

struct GemmArgs {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
};

// The fast path: Eigen's blocked, vectorised one-thread kernel on independent blocks of C (or parts
// of k) spread over the OpenMP threads. Measured against OpenBLAS 0.3.21 on the development machine's
// kind (2 cores, AVX-512): equal or faster on every BERT shape tried.
template <typename T>
void gemm(GemmArgs args, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc);

// Plain triple loop, accumulating in double: the reference the fast path is tested against.
template <typename T>
void gemm_reference(GemmArgs args, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c,
                    int64_t ldc);

}  // namespace bert
