#include "kernels/gemm.h"

#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/gemm_avx2.h"
#include "kernels/gemm_avx512.h"
#include "kernels/gemm_avx512_bf16.h"
#include "sys/error.h"
#include "sys/parallel.h"

namespace bert {

namespace {

#include "kernels/gemm_eigen.inc"

// A one-thread product: Eigen for the build's target, our AVX2 kernel (single precision), or AVX-512's.
template <typename T>
using OneThread = void (*)(GemmArgs, T, const T*, int64_t, const T*, int64_t, T, T*, int64_t, const T*);

template <typename T>
OneThread<T> one_thread_kernel(CpuKernels kernel, bool bf16) {
  const CpuKernels set = resolve_cpu_kernels(kernel);
  if constexpr (std::is_same_v<T, float>)
    if (bf16)  // only where gemm_bf16_native(kernel)
      return bf16_products(kernel) == Bf16Products::kAmx ? &gemm_avx512_bf16::one_thread_amx
                                                         : &gemm_avx512_bf16::one_thread;
  if (set == CpuKernels::kAvx512) return static_cast<OneThread<T>>(&gemm_avx512::one_thread);
  if constexpr (std::is_same_v<T, float>)
    if (set == CpuKernels::kAvx2) return &gemm_avx2::one_thread;
  return &eigen_one_thread<T>;
}

// Below this many multiply-adds a product runs on one thread: waking threads costs more than it saves.
constexpr double kMinParallelWork = 1 << 18;
// The shortest inner dimension a split of k gives each part.
constexpr int64_t kMinKPart = 256;
// C is cut into about this many blocks per thread, each at least kMinBlockSide on a side where C allows:
// more blocks balance better (a thread held up takes fewer), bigger ones repack less. Chosen on the
// 16-core Intel Xeon among 2 or 4 per thread and 64 or 128 (docs/performance.md).
constexpr int64_t kBlocksPerThread = 4;
constexpr int64_t kMinBlockSide = 64;

// C split into rows x cols blocks, about `target` of them, each at least min_side on a side where C allows,
// as square as the shape allows: each block packs its slice of A and of B, so thin blocks repack the
// other operand many times over.
struct GemmGrid {
  int64_t rows = 1, cols = 1;
  // Edge i of n split into `parts` (multiples of 16: whole AVX-512 vectors, Eigen's panels).
  static int64_t edge(int64_t n, int64_t parts, int64_t i) { return i >= parts ? n : (n * i / parts) / 16 * 16; }
};

GemmGrid gemm_grid(int64_t m, int64_t n, int64_t target, int64_t min_side) {
  const int64_t max_rows = std::max<int64_t>(1, m / min_side), max_cols = std::max<int64_t>(1, n / min_side);
  GemmGrid grid;
  grid.rows = std::clamp<int64_t>(std::llround(std::sqrt(double(target) * double(m) / double(n))), 1, max_rows);
  grid.cols = std::clamp<int64_t>((target + grid.rows - 1) / grid.rows, 1, max_cols);
  grid.rows = std::clamp<int64_t>((target + grid.cols - 1) / grid.cols, 1, max_rows);
  return grid;
}

// A small C and a long inner dimension (a weight's gradient sums over every token): k split into
// `parts`, part 0 into C (with beta and the bias), the others into buffers of their own, added to C in a fixed order.
template <typename T>
void gemm_split_k(OneThread<T> gemm_one_thread, GemmArgs g, int64_t parts, T alpha, const T* a, int64_t lda, const T* b,
                  int64_t ldb, T beta, T* c, int64_t ldc, const T* bias, const GemmFinish* finish) {
  thread_local std::vector<T> partial;  // kept: the same shapes come back every step
  const int64_t mn = g.m * g.n;
  if (partial.size() < static_cast<std::size_t>((parts - 1) * mn)) partial.resize((parts - 1) * mn);
  T* buffers = partial.data();
#pragma omp parallel for schedule(dynamic, 1) num_threads(static_cast <int>(parts))
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t k0 = GemmGrid::edge(g.k, parts, p), k1 = GemmGrid::edge(g.k, parts, p + 1);
    GemmArgs part = g;
    part.k = k1 - k0;
    const T* ap = g.trans_a ? a + k0 * lda : a + k0;
    const T* bp = g.trans_b ? b + k0 : b + k0 * ldb;
    if (p == 0)
      gemm_one_thread(part, alpha, ap, lda, bp, ldb, beta, c, ldc, bias);
    else
      gemm_one_thread(part, alpha, ap, lda, bp, ldb, T(0), buffers + (p - 1) * mn, g.n, nullptr);
  }
  parallel_for(g.m, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      for (int64_t p = 1; p < parts; ++p) {
        const T* src = buffers + (p - 1) * mn + i * g.n;
        T* dst = c + i * ldc;
        for (int64_t j = 0; j < g.n; ++j) dst[j] += src[j];
      }
    if (finish) (*finish)(lo, hi, 0, g.n);
  });
}

// The rows x cols matrix at src (row stride ld) rounded to BF16 into dst (row stride cols).
void rounded_copy(const float* src, int64_t rows, int64_t cols, int64_t ld, std::vector<float>& dst) {
  dst.resize(static_cast<std::size_t>(rows * cols));
  float* out = dst.data();
  parallel_for(rows, std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(cols, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      for (int64_t j = 0; j < cols; ++j) out[i * cols + j] = round_to_bf16(src[i * ld + j]);
  });
}

}  // namespace

const char* bf16_products_name(Bf16Products products) {
  switch (products) {
    case Bf16Products::kAmx:
      return "AMX";
    case Bf16Products::kVdpbf16ps:
      return "vdpbf16ps";
    case Bf16Products::kRoundedCopies:
      return "FP32 kernel on rounded copies";
  }
  return "?";
}

Bf16Products choose_bf16_products(bool avx512_set, bool avx512_bf16, bool amx_bf16) {
  if (!avx512_set || !avx512_bf16) return Bf16Products::kRoundedCopies;
  return amx_bf16 ? Bf16Products::kAmx : Bf16Products::kVdpbf16ps;
}

Bf16Products bf16_products(CpuKernels kernel) {
  if (resolve_cpu_kernels(kernel) != CpuKernels::kAvx512) return Bf16Products::kRoundedCopies;
  static const Bf16Products chosen = [] {
    const bool bf16 = cpu_has_avx512_bf16(), amx = amx_usable(AmxOp::kBf16);
    const char* asked = std::getenv("BERT_BF16_PRODUCTS");
    if (!asked || !*asked) return choose_bf16_products(true, bf16, amx);
    const std::string name(asked);
    if (name == "copies") return Bf16Products::kRoundedCopies;
    if (name == "vdpbf16ps" && bf16) return Bf16Products::kVdpbf16ps;
    if (name == "amx" && amx) return Bf16Products::kAmx;
    throw UserError("BERT_BF16_PRODUCTS='" + name + "': expected 'amx', 'vdpbf16ps' or 'copies', one this CPU runs (" +
                    (amx ? "AMX, " : "") + (bf16 ? "vdpbf16ps, " : "") + "copies)");
  }();
  return chosen;
}

bool gemm_bf16_native(CpuKernels kernel) { return bf16_products(kernel) != Bf16Products::kRoundedCopies; }

const char* gemm_bf16_kernel_name(CpuKernels kernel) { return bf16_products_name(bf16_products(kernel)); }

float round_to_bf16(float x) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return std::bit_cast<float>((u | 0x00400000u) & 0xFFFF0000u);  // NaN: quiet
  u += 0x7FFFu + ((u >> 16) & 1u);  // to nearest, ties to even (a carry into the exponent rounds up to it)
  return std::bit_cast<float>(u & 0xFFFF0000u);
}

// Threads split C into independent blocks (gemm_grid), each a one-thread product, handed out as threads
// come free; a small C with a long inner dimension splits k instead (gemm_split_k). Eigen's own parallel
// GEMM shares packed panels between threads that wait for each other by spinning, and on 16 cores
// scaled poorly on BERT's shapes (tall-skinny products: 2-3x slower than these blocks in gemm-bench);
// independent blocks meet only at the end. Results are bit-identical at a fixed thread count.
template <typename T>
void gemm(GemmArgs g, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc,
          CpuKernels kernel, const T* bias, const GemmFinish* finish) {
  if (g.bf16) {
    BERT_CHECK((std::is_same_v<T, float>), "gemm: BF16 operands are for single precision only");
    if constexpr (std::is_same_v<T, float>)
      if (!gemm_bf16_native(kernel)) {
        // No vdpbf16ps here: the FP32 kernel on rounded copies (exact products of BF16 values, FP32 sums).
        thread_local std::vector<float> a_copy, b_copy;  // kept: the same shapes come back every step
        const int64_t a_rows = g.trans_a ? g.k : g.m, a_cols = g.trans_a ? g.m : g.k;
        const int64_t b_rows = g.trans_b ? g.n : g.k, b_cols = g.trans_b ? g.k : g.n;
        rounded_copy(a, a_rows, a_cols, lda, a_copy);
        rounded_copy(b, b_rows, b_cols, ldb, b_copy);
        g.bf16 = false;
        gemm<T>(g, alpha, a_copy.data(), a_cols, b_copy.data(), b_cols, beta, c, ldc, kernel, bias, finish);
        return;
      }
  }
  const OneThread<T> gemm_one_thread = one_thread_kernel<T>(kernel, g.bf16);
  const int threads = omp_in_parallel() ? 1 : num_threads();
  if (threads == 1 || double(g.m) * double(g.n) * double(g.k) < kMinParallelWork) {
    gemm_one_thread(g, alpha, a, lda, b, ldb, beta, c, ldc, bias);
    if (finish) (*finish)(0, g.m, 0, g.n);
    return;
  }
  // AMX multiplies so fast that converting and packing a block's slices of A and B costs more than its tiles
  // on BERT's short inner dimensions (k 128-256): one block per thread packs each operand fewest times.
  const bool amx = g.bf16 && bf16_products(kernel) == Bf16Products::kAmx;
  const GemmGrid grid = gemm_grid(g.m, g.n, threads * (amx ? 1 : kBlocksPerThread), kMinBlockSide);
  const int64_t blocks = grid.rows * grid.cols;
  const int64_t k_parts = std::min<int64_t>(threads, g.k / kMinKPart);
  if (blocks * 2 <= threads && k_parts >= 2) {
    gemm_split_k(gemm_one_thread, g, k_parts, alpha, a, lda, b, ldb, beta, c, ldc, bias, finish);
    return;
  }
  if (blocks <= 1) {
    gemm_one_thread(g, alpha, a, lda, b, ldb, beta, c, ldc, bias);
    if (finish) (*finish)(0, g.m, 0, g.n);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(static_cast <int>(std::min <int64_t>(threads, blocks)))
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t r0 = grid.edge(g.m, grid.rows, i / grid.cols), r1 = grid.edge(g.m, grid.rows, i / grid.cols + 1);
    const int64_t c0 = grid.edge(g.n, grid.cols, i % grid.cols), c1 = grid.edge(g.n, grid.cols, i % grid.cols + 1);
    if (r1 <= r0 || c1 <= c0) continue;
    GemmArgs part = g;
    part.m = r1 - r0;
    part.n = c1 - c0;
    gemm_one_thread(part, alpha, g.trans_a ? a + r0 : a + r0 * lda, lda, g.trans_b ? b + c0 * ldb : b + c0, ldb, beta,
                    c + r0 * ldc + c0, ldc, bias ? bias + c0 : nullptr);
    if (finish) (*finish)(r0, r1, c0, c1);
  }
}

void gemm_tiles(GemmArgs g, const float* a, int64_t lda, const float* b, int64_t ldb, const float* bias,
                int64_t tile_rows, int64_t tile_cols, const OutputTileVisitor& visit, CpuKernels kernel) {
  BERT_CHECK(tile_rows > 0 && tile_cols > 0,
             "gemm_tiles: tiles of " + std::to_string(tile_rows) + " x " + std::to_string(tile_cols));
  if (g.m <= 0 || g.n <= 0) return;
  // Column tiles outer: a thread's consecutive tiles share their columns of B (packed again from cache).
  const int64_t row_tiles = (g.m + tile_rows - 1) / tile_rows, col_tiles = (g.n + tile_cols - 1) / tile_cols;
  parallel_for(row_tiles * col_tiles, 1, [&](int64_t lo, int64_t hi) {
    thread_local std::vector<float> tile;  // kept: the same shapes come back every batch
    tile.resize(static_cast<size_t>(tile_rows * tile_cols));
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t r0 = (i % row_tiles) * tile_rows, r1 = std::min(g.m, r0 + tile_rows);
      const int64_t c0 = (i / row_tiles) * tile_cols, c1 = std::min(g.n, c0 + tile_cols);
      GemmArgs part = g;
      part.m = r1 - r0;
      part.n = c1 - c0;
      // Inside parallel_for's threads gemm runs on the calling thread only.
      gemm<float>(part, 1.0f, g.trans_a ? a + r0 : a + r0 * lda, lda, g.trans_b ? b + c0 * ldb : b + c0, ldb, 0.0f,
                  tile.data(), tile_cols, kernel, bias ? bias + c0 : nullptr);
      visit(r0, r1, c0, c1, tile.data(), tile_cols);
    }
  });
}

template <typename T>
void gemm_reference(GemmArgs g, T alpha, const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc,
                    const T* bias) {
  for (int64_t i = 0; i < g.m; ++i) {
    for (int64_t j = 0; j < g.n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < g.k; ++p) {
        T av = g.trans_a ? a[p * lda + i] : a[i * lda + p];
        T bv = g.trans_b ? b[j * ldb + p] : b[p * ldb + j];
        if (g.bf16) av = T(round_to_bf16(float(av))), bv = T(round_to_bf16(float(bv)));
        acc += double(av) * double(bv);
      }
      T& out = c[i * ldc + j];
      out = static_cast<T>(alpha * acc + (beta == T(0) ? 0.0 : double(beta) * double(out)) +
                           (bias ? double(bias[j]) : 0.0));
    }
  }
}

template void gemm<float>(GemmArgs, float, const float*, int64_t, const float*, int64_t, float, float*, int64_t,
                          CpuKernels, const float*, const GemmFinish*);
template void gemm<double>(GemmArgs, double, const double*, int64_t, const double*, int64_t, double, double*, int64_t,
                           CpuKernels, const double*, const GemmFinish*);
template void gemm_reference<float>(GemmArgs, float, const float*, int64_t, const float*, int64_t, float, float*,
                                    int64_t, const float*);
template void gemm_reference<double>(GemmArgs, double, const double*, int64_t, const double*, int64_t, double, double*,
                                     int64_t, const double*);

}  // namespace bert
