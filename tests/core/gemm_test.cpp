// The fast GEMM against its plain reference: every transpose combination, alpha/beta, strided
// (sub-matrix) operands, degenerate and large sizes, on 1, 2 and 4 threads (C split into blocks, or
// the inner dimension split into parts).
#include <gtest/gtest.h>
#include <omp.h>

#include <vector>

#include "core/gemm.h"
#include "core/rng.h"

namespace bert {
namespace {

struct GemmCase {
  int64_t m, n, k;
};

template <typename T>
void check_against_reference(GemmCase s, bool ta, bool tb, T alpha, T beta, int64_t pad, double tol) {
  Rng rng(static_cast<uint64_t>(s.m * 131 + s.n * 17 + s.k + ta * 2 + tb));
  const int64_t a_rows = ta ? s.k : s.m, a_cols = ta ? s.m : s.k;
  const int64_t b_rows = tb ? s.n : s.k, b_cols = tb ? s.k : s.n;
  const int64_t lda = a_cols + pad, ldb = b_cols + pad, ldc = s.n + pad;
  std::vector<T> a(a_rows * lda), b(b_rows * ldb), c(s.m * ldc);
  for (auto& v : a) v = static_cast<T>(rng.next_normal());
  for (auto& v : b) v = static_cast<T>(rng.next_normal());
  for (auto& v : c) v = static_cast<T>(rng.next_normal());
  std::vector<T> expected = c;
  gemm<T>({ta, tb, s.m, s.n, s.k}, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
  gemm_reference<T>({ta, tb, s.m, s.n, s.k}, alpha, a.data(), lda, b.data(), ldb, beta, expected.data(), ldc);
  for (int64_t i = 0; i < s.m; ++i) {
    for (int64_t j = 0; j < ldc; ++j) {
      const int64_t at = i * ldc + j;
      // Within the matrix: close to the reference; in the padding: untouched.
      const double scale = 1.0 + std::sqrt(static_cast<double>(s.k));
      ASSERT_NEAR(c[at], expected[at], tol * scale) << "(" << i << ", " << j << ") ta=" << ta << " tb=" << tb;
    }
  }
}

class GemmTest : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GemmTest, FastPathMatchesReferenceFloatAndDouble) {
  const int saved = omp_get_max_threads();
  for (int threads : {1, 2, 4}) {
    omp_set_num_threads(threads);
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        check_against_reference<float>(GetParam(), ta, tb, 1.0f, 0.0f, 0, 1e-5);
        check_against_reference<float>(GetParam(), ta, tb, 0.5f, 1.0f, 3, 1e-5);
        check_against_reference<double>(GetParam(), ta, tb, -1.5, 0.25, 2, 1e-13);
      }
  }
  omp_set_num_threads(saved);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmTest,
                         ::testing::Values(GemmCase{1, 1, 1}, GemmCase{3, 5, 7}, GemmCase{17, 1, 9},
                                           GemmCase{64, 64, 64}, GemmCase{130, 70, 33},
                                           GemmCase{256, 192, 160},  // large enough to be threaded
                                           GemmCase{520, 300, 48},   // C in blocks, ragged edges
                                           GemmCase{1000, 20, 40},   // tall and thin
                                           GemmCase{96, 80, 1100},   // small C, long k: k split
                                           GemmCase{4, 6, 0}));      // k = 0: C = beta C

}  // namespace
}  // namespace bert
