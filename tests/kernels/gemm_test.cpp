// The fast GEMM against its plain reference: every transpose combination, alpha/beta, strided
// (sub-matrix) operands, degenerate and large sizes, on 1, 2 and 4 threads (C split into blocks, or
// the inner dimension split into parts), with each one-thread kernel this CPU runs (the build's, and
// the AVX-512 one chosen at run time), and with BF16 operands (AMX or vdpbf16ps where the CPU has it, else the FP32
// kernel on rounded copies) against the reference on the same rounded operands.
#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/rng.h"
#include "kernels/gemm.h"

namespace bert {
namespace {

struct GemmCase {
  int64_t m, n, k;
};

std::vector<CpuKernels> kernels_here() {
  std::vector<CpuKernels> kernels = {CpuKernels::kBuild};
  for (CpuKernels set : {CpuKernels::kAvx2, CpuKernels::kAvx512})
    if (cpu_kernels_supported(set)) kernels.push_back(set);
  return kernels;
}

// One product against the reference, made once and held against each kernel at 1, 2 and 4 threads (the
// reference's plain loops take most of the time, above all under the sanitizers).
template <typename T>
void check_against_reference(GemmCase s, bool ta, bool tb, T alpha, T beta, int64_t pad, double tol,
                             bool with_bias = false, bool bf16 = false) {
  Rng rng(static_cast<uint64_t>(s.m * 131 + s.n * 17 + s.k + ta * 2 + tb));
  const int64_t a_rows = ta ? s.k : s.m, a_cols = ta ? s.m : s.k;
  const int64_t b_rows = tb ? s.n : s.k, b_cols = tb ? s.k : s.n;
  const int64_t lda = a_cols + pad, ldb = b_cols + pad, ldc = s.n + pad;
  std::vector<T> a(a_rows * lda), b(b_rows * ldb), c0(s.m * ldc);
  for (auto& v : a) v = static_cast<T>(rng.next_normal());
  for (auto& v : b) v = static_cast<T>(rng.next_normal());
  for (auto& v : c0) v = static_cast<T>(rng.next_normal());
  std::vector<T> expected = c0, bias_values(s.n);
  for (auto& v : bias_values) v = static_cast<T>(rng.next_normal());
  const T* bias = with_bias ? bias_values.data() : nullptr;
  const std::vector<T> a_saved = a, b_saved = b;
  gemm_reference<T>({ta, tb, s.m, s.n, s.k, bf16}, alpha, a.data(), lda, b.data(), ldb, beta, expected.data(), ldc,
                    bias);
  for (CpuKernels kernel : kernels_here())
    for (int threads : {1, 2, 4}) {
      omp_set_num_threads(threads);
      std::vector<T> c = c0;
      gemm<T>({ta, tb, s.m, s.n, s.k, bf16}, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc, kernel, bias);
      ASSERT_EQ(a, a_saved);  // the operands are read, never rounded in place
      ASSERT_EQ(b, b_saved);
      for (int64_t i = 0; i < s.m; ++i) {
        for (int64_t j = 0; j < ldc; ++j) {
          const int64_t at = i * ldc + j;
          // Within the matrix: close to the reference; in the padding: untouched.
          const double scale = 1.0 + std::sqrt(static_cast<double>(s.k));
          ASSERT_NEAR(c[at], expected[at], tol * scale)
              << cpu_kernels_name(kernel) << " threads " << threads << " (" << i << ", " << j << ") ta=" << ta
              << " tb=" << tb << " bf16=" << bf16;
        }
      }
    }
}

class GemmTest : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GemmTest, FastPathMatchesReferenceFloatAndDouble) {
  const int saved = omp_get_max_threads();
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      check_against_reference<float>(GetParam(), ta, tb, 1.0f, 0.0f, 0, 1e-5);
      check_against_reference<float>(GetParam(), ta, tb, 0.5f, 1.0f, 3, 1e-5);
      check_against_reference<double>(GetParam(), ta, tb, -1.5, 0.25, 2, 1e-13);
      // A bias added to every row (a linear layer's forward), with and without beta.
      check_against_reference<float>(GetParam(), ta, tb, 1.0f, 0.0f, 1, 1e-5, /*with_bias=*/true);
      check_against_reference<float>(GetParam(), ta, tb, 0.5f, 1.0f, 0, 1e-5, /*with_bias=*/true);
      check_against_reference<double>(GetParam(), ta, tb, -1.5, 0.25, 2, 1e-13, /*with_bias=*/true);
      // BF16 operands, FP32 sums: as close to the reference on the rounded operands as FP32 is to its own.
      check_against_reference<float>(GetParam(), ta, tb, 1.0f, 0.0f, 0, 1e-5, false, /*bf16=*/true);
      check_against_reference<float>(GetParam(), ta, tb, 0.5f, 1.0f, 3, 1e-5, true, /*bf16=*/true);
    }
  omp_set_num_threads(saved);
}

// `finish` gets every element of C exactly once, after its final value is in place, on every path
// (one thread, blocks, k split) and kernel: here it counts its visits and maps c to 2 c + 1.
TEST_P(GemmTest, FinishSeesEachFinalBlockOnce) {
  const GemmCase s = GetParam();
  const int saved = omp_get_max_threads();
  const int64_t ldc = s.n + 2;  // two padding columns the finish must not see
  Rng rng(static_cast<uint64_t>(s.m * 7 + s.n * 3 + s.k));
  std::vector<float> a(s.m * s.k), b(s.k * s.n);
  for (auto& v : a) v = static_cast<float>(rng.next_normal());
  for (auto& v : b) v = static_cast<float>(rng.next_normal());
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (bool bf16 : {false, true}) {
        const GemmArgs args{ta, tb, s.m, s.n, s.k, bf16};
        const int64_t lda = ta ? s.m : s.k, ldb = tb ? s.k : s.n;
        std::vector<float> expected(s.m * ldc, -7.0f);  // made once, held against every kernel and thread count
        gemm_reference<float>(args, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, expected.data(), ldc);
        for (CpuKernels kernel : kernels_here())
          for (int threads : {1, 2, 4}) {
            SCOPED_TRACE(std::string(cpu_kernels_name(kernel)) + " threads " + std::to_string(threads) +
                         " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) + " bf16=" + std::to_string(bf16));
            omp_set_num_threads(threads);
            std::vector<float> c(s.m * ldc, -7.0f);
            std::vector<std::atomic<int>> visits(s.m * ldc);
            const GemmFinish finish = [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
              for (int64_t i = r0; i < r1; ++i)
                for (int64_t j = c0; j < c1; ++j) {
                  ++visits[i * ldc + j];
                  c[i * ldc + j] = 2.0f * c[i * ldc + j] + 1.0f;
                }
            };
            gemm<float>(args, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, c.data(), ldc, kernel, nullptr, &finish);
            for (int64_t i = 0; i < s.m; ++i)
              for (int64_t j = 0; j < ldc; ++j) {
                const int64_t at = i * ldc + j;
                const bool inside = j < s.n;
                ASSERT_EQ(visits[at].load(), inside ? 1 : 0) << "(" << i << ", " << j << ")";
                const double want = inside ? 2.0 * expected[at] + 1.0 : -7.0;
                ASSERT_NEAR(c[at], want, 2e-5 * (1.0 + std::sqrt(static_cast<double>(s.k))))
                    << "(" << i << ", " << j << ")";
              }
          }
      }
  omp_set_num_threads(saved);
}

// gemm_tiles hands every element of C (with the bias) to its visitor exactly once, in tiles no larger than asked,
// with the reference's values, on every kernel, thread count, transpose and with BF16 operands.
TEST_P(GemmTest, TilesCoverCOnceWithTheProductsValues) {
  const GemmCase s = GetParam();
  const int saved = omp_get_max_threads();
  const int64_t tile_rows = 37, tile_cols = 48;
  Rng rng(static_cast<uint64_t>(s.m * 5 + s.n * 11 + s.k));
  std::vector<float> a(s.m * s.k), b(s.k * s.n), bias(s.n);
  for (auto& v : a) v = static_cast<float>(rng.next_normal());
  for (auto& v : b) v = static_cast<float>(rng.next_normal());
  for (auto& v : bias) v = static_cast<float>(rng.next_normal());
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (bool bf16 : {false, true}) {
        const GemmArgs args{ta, tb, s.m, s.n, s.k, bf16};
        const int64_t lda = ta ? s.m : s.k, ldb = tb ? s.k : s.n;
        std::vector<float> expected(s.m * s.n);  // made once, held against every kernel and thread count
        gemm_reference<float>(args, 1.0f, a.data(), lda, b.data(), ldb, 0.0f, expected.data(), s.n, bias.data());
        for (CpuKernels kernel : kernels_here())
          for (int threads : {1, 2}) {
            SCOPED_TRACE(std::string(cpu_kernels_name(kernel)) + " threads " + std::to_string(threads) +
                         " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) + " bf16=" + std::to_string(bf16));
            omp_set_num_threads(threads);
            std::vector<float> c(s.m * s.n, -7.0f);
            std::vector<std::atomic<int>> visits(s.m * s.n);
            std::atomic<bool> oversized{false};
            const OutputTileVisitor visit = [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1, const float* tile,
                                                int64_t ld) {
              if (r1 - r0 > tile_rows || c1 - c0 > tile_cols || ld < c1 - c0) oversized = true;
              for (int64_t i = r0; i < r1; ++i)
                for (int64_t j = c0; j < c1; ++j) {
                  ++visits[i * s.n + j];
                  c[i * s.n + j] = tile[(i - r0) * ld + (j - c0)];
                }
            };
            gemm_tiles(args, a.data(), lda, b.data(), ldb, bias.data(), tile_rows, tile_cols, visit, kernel);
            ASSERT_FALSE(oversized);
            for (int64_t at = 0; at < s.m * s.n; ++at) {
              ASSERT_EQ(visits[at].load(), 1) << "(" << at / s.n << ", " << at % s.n << ")";
              ASSERT_NEAR(c[at], expected[at], 1e-5 * (1.0 + std::sqrt(static_cast<double>(s.k))))
                  << "(" << at / s.n << ", " << at % s.n << ")";
            }
          }
      }
  omp_set_num_threads(saved);
}

// Rounding to BF16: to nearest, ties to even, NaN kept (quiet), infinities kept, the largest finite values
// rounding up to infinity as the hardware's conversion does.
TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(round_to_bf16(1.0f), 1.0f);
  EXPECT_EQ(round_to_bf16(1.0f + 0x1p-8f), 1.0f);                         // a tie: down to the even 1.0
  EXPECT_EQ(round_to_bf16(1.0f + 3 * 0x1p-8f), 1.0f + 0x1p-6f);           // a tie: up to the even neighbour
  EXPECT_EQ(round_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 1.0f + 0x1p-7f);    // above the tie: up
  EXPECT_EQ(round_to_bf16(-1.0f - 0x1p-8f - 0x1p-20f), -1.0f - 0x1p-7f);  // sign-symmetric
  EXPECT_EQ(round_to_bf16(0.0f), 0.0f);
  EXPECT_TRUE(std::signbit(round_to_bf16(-0.0f)));
  EXPECT_EQ(round_to_bf16(INFINITY), INFINITY);
  EXPECT_EQ(round_to_bf16(-INFINITY), -INFINITY);
  EXPECT_EQ(round_to_bf16(3.4028235e38f), INFINITY);
  EXPECT_TRUE(std::isnan(round_to_bf16(NAN)));
  EXPECT_TRUE(std::isnan(round_to_bf16(std::bit_cast<float>(0x7F800001u))));  // a NaN whose payload would round away
  // 8 significant bits: the low 16 bits are zero, and r is within half a unit in the last place (2^-8 relative) of x.
  Rng rng(11);
  for (int i = 0; i < 1000; ++i) {
    const float x = static_cast<float>(rng.next_normal()), r = round_to_bf16(x);
    EXPECT_EQ(std::bit_cast<uint32_t>(r) & 0xFFFFu, 0u);
    EXPECT_LE(std::abs(r - x), std::abs(x) * 0x1p-8f);
  }
}

// Which BF16 products a CPU gets: AMX where usable, else vdpbf16ps where the CPU has it, else the rounded copies;
// this CPU's choice is one of those it runs; BERT_BF16_PRODUCTS names the others (bench/ compares them).
TEST(Bf16, ProductsAreChosenByWhatTheCpuRuns) {
  using enum Bf16Products;
  EXPECT_EQ(choose_bf16_products(true, true, true), kAmx);
  EXPECT_EQ(choose_bf16_products(true, true, false), kVdpbf16ps);
  EXPECT_EQ(choose_bf16_products(true, false, false), kRoundedCopies);
  EXPECT_EQ(choose_bf16_products(false, true, true), kRoundedCopies);  // the AVX-512 set not in use
  EXPECT_EQ(bf16_products(CpuKernels::kBuild), kRoundedCopies);
  const Bf16Products here = bf16_products();
  EXPECT_STREQ(gemm_bf16_kernel_name(), bf16_products_name(here));
  EXPECT_EQ(gemm_bf16_native(), here != kRoundedCopies);
  if (here == kAmx) {
    EXPECT_TRUE(amx_usable(AmxOp::kBf16));
  }
  if (here == kVdpbf16ps) {
    EXPECT_TRUE(cpu_has_avx512_bf16());
  }
  if (std::getenv("BERT_BF16_PRODUCTS") == nullptr && best_cpu_kernels() == CpuKernels::kAvx512) {
    EXPECT_EQ(here, choose_bf16_products(true, cpu_has_avx512_bf16(), amx_usable(AmxOp::kBf16)));
  }
}

// BF16 operands really are rounded (the product moves away from the FP32 one by their rounding), on every
// kernel set, and double precision refuses them.
TEST(Bf16, ProductsDifferFromFp32ByOperandRounding) {
  const int64_t m = 40, n = 48, k = 200;
  Rng rng(12);
  std::vector<float> a(m * k), b(k * n), fp32(m * n), bf16(m * n);
  for (auto& v : a) v = static_cast<float>(rng.next_normal());
  for (auto& v : b) v = static_cast<float>(rng.next_normal());
  for (CpuKernels kernel : kernels_here()) {
    gemm<float>({false, false, m, n, k}, 1.0f, a.data(), k, b.data(), n, 0.0f, fp32.data(), n, kernel);
    gemm<float>({false, false, m, n, k, true}, 1.0f, a.data(), k, b.data(), n, 0.0f, bf16.data(), n, kernel);
    double largest = 0;
    for (int64_t i = 0; i < m * n; ++i) largest = std::max(largest, std::abs(double(bf16[i]) - fp32[i]));
    // Each operand within 2^-8 relative: sums of 200 unit products move by about 1e-2, far above FP32's 1e-5.
    EXPECT_GT(largest, 1e-3) << cpu_kernels_name(kernel);
    EXPECT_LT(largest, 0.2) << cpu_kernels_name(kernel);
  }
  std::vector<double> ad(4, 1.0), cd(4);
  EXPECT_THROW(gemm<double>({false, false, 2, 2, 2, true}, 1.0, ad.data(), 2, ad.data(), 2, 0.0, cd.data(), 2),
               std::exception);
}

// kAuto stands for the AVX-512 kernel exactly where the CPU has AVX-512, else for the AVX2 one where it has
// AVX2 and FMA (unless BERT_CPU_KERNELS says otherwise), and the kernel it stands for gives the same bits as
// asking for that kernel.
TEST(GemmKernels, AutoPicksTheBestKernelThisCpuRuns) {
  const char* asked = std::getenv("BERT_CPU_KERNELS");
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  EXPECT_EQ(cpu_kernels_supported(CpuKernels::kAvx512), avx512);
  EXPECT_EQ(cpu_kernels_supported(CpuKernels::kAvx2), avx2);
  EXPECT_TRUE(cpu_kernels_supported(CpuKernels::kBuild));
  if (!asked || !*asked) {
    EXPECT_EQ(best_cpu_kernels(), avx512 ? CpuKernels::kAvx512 : avx2 ? CpuKernels::kAvx2 : CpuKernels::kBuild);
  }
  EXPECT_STREQ(cpu_kernels_name(CpuKernels::kAuto), cpu_kernels_name(best_cpu_kernels()));
  Rng rng(5);
  std::vector<float> a(300 * 200), b(200 * 100), auto_c(300 * 100), best_c(300 * 100);
  for (auto& v : a) v = static_cast<float>(rng.next_normal());
  for (auto& v : b) v = static_cast<float>(rng.next_normal());
  gemm<float>({false, false, 300, 100, 200}, 1.0f, a.data(), 200, b.data(), 100, 0.0f, auto_c.data(), 100);
  gemm<float>({false, false, 300, 100, 200}, 1.0f, a.data(), 200, b.data(), 100, 0.0f, best_c.data(), 100,
              best_cpu_kernels());
  EXPECT_EQ(auto_c, best_c);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmTest,
                         ::testing::Values(GemmCase{1, 1, 1}, GemmCase{3, 5, 7}, GemmCase{17, 1, 9},
                                           GemmCase{64, 64, 64}, GemmCase{130, 70, 33},
                                           GemmCase{256, 192, 160},  // large enough to be threaded
                                           GemmCase{520, 300, 48},   // C in blocks, ragged edges
                                           GemmCase{1000, 20, 40},   // tall and thin
                                           GemmCase{96, 80, 1100},   // small C, long k: k split
                                           GemmCase{37, 1100, 300},  // several column and k slices, ragged
                                           GemmCase{4, 6, 0}));      // k = 0: C = beta C

}  // namespace
}  // namespace bert
