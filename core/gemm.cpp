#include "core/gemm.h"

#include <Eigen/Core>

namespace bert {

namespace {

template <typename T>
using RowMajor = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using ConstMap = Eigen::Map<const RowMajor<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <typename T>
using MutMap = Eigen::Map<RowMajor<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

template <typename T, typename OpA, typename OpB>
void multiply_into(MutMap<T>& c, const OpA& a, const OpB& b, T alpha, T beta) {
  if (beta == T(0)) {
    c.noalias() = alpha * (a * b);
  } else {
    if (beta != T(1)) c *= beta;
    c.noalias() += alpha * (a * b);
  }
}

}  // namespace

template <typename T>
void gemm(GemmArgs g, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (g.m == 0 || g.n == 0) return;
  MutMap<T> cm(c, g.m, g.n, Eigen::OuterStride<>(ldc));
  if (g.k == 0) {
    cm *= beta;
    return;
  }
  // As stored: A is (M, K), or (K, M) when transposed; likewise B.
  ConstMap<T> am(a, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, Eigen::OuterStride<>(lda));
  ConstMap<T> bm(b, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, Eigen::OuterStride<>(ldb));
  if (!g.trans_a && !g.trans_b) multiply_into(cm, am, bm, alpha, beta);
  if (!g.trans_a && g.trans_b) multiply_into(cm, am, bm.transpose(), alpha, beta);
  if (g.trans_a && !g.trans_b) multiply_into(cm, am.transpose(), bm, alpha, beta);
  if (g.trans_a && g.trans_b) multiply_into(cm, am.transpose(), bm.transpose(), alpha, beta);
}

template <typename T>
void gemm_reference(GemmArgs g, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  for (int64_t i = 0; i < g.m; ++i) {
    for (int64_t j = 0; j < g.n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < g.k; ++p) {
        double av = g.trans_a ? a[p * lda + i] : a[i * lda + p];
        double bv = g.trans_b ? b[j * ldb + p] : b[p * ldb + j];
        acc += av * bv;
      }
      T& out = c[i * ldc + j];
      out = static_cast<T>(alpha * acc + (beta == T(0) ? 0.0 : double(beta) * double(out)));
    }
  }
}

template void gemm<float>(GemmArgs, float, const float*, int64_t, const float*, int64_t, float, float*, int64_t);
template void gemm<double>(GemmArgs, double, const double*, int64_t, const double*, int64_t, double, double*, int64_t);
template void gemm_reference<float>(GemmArgs, float, const float*, int64_t, const float*, int64_t, float, float*,
                                    int64_t);
template void gemm_reference<double>(GemmArgs, double, const double*, int64_t, const double*, int64_t, double, double*,
                                     int64_t);

}  // namespace bert
