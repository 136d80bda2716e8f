// The fused attention's tensor-core kernels, FlashAttention-2 style (ops::attention in BF16 and TF32 steps;
// ops/attention.cu has the contract, the FP32 kernels and the dispatch). One set of kernels for both
// element types E: BF16 operands in m16n8k16 products, or FP32 operands rounded to TF32 as their fragments
// are formed, in m16n8k8 products (ops/cuda/mma.cuh); everything else (softmax, dropout, the quantizer,
// the pipeline) the same arithmetic in FP32 registers.
#include <algorithm>
#include <string>
#include <type_traits>

#include "ops/cuda/attention.cuh"
#include "ops/cuda/common.cuh"
#include "ops/cuda/fake_quantize.cuh"
#include "ops/cuda/mma.cuh"

namespace bert::ops::cuda_impl {

namespace {

using cuda::bf16;

// --- The tiles in registers between products (mma.sync, ops/cuda/mma.cuh), FlashAttention-2 style.
// A block of four warps takes 64 query rows (forward, dQ) or 64 keys (dK, dV), 16 a warp; the other side
// streams through shared memory 64 rows at a time, copied asynchronously (cp.async) while the previous
// tile is multiplied (where T <= 128 the backward is one kernel of its own, flash_backward_fused below).
// Scores, probabilities and their gradients live only in registers (C fragments),
// where they become the A operand of the next product. Exponentials are taken in base 2 (the scores
// scaled by log2 e once). The forward's softmax is online (a running row maximum and sum, the output
// rescaled as the maximum grows); the backward recomputes the probabilities from the saved log-sum-exp,
// exactly normalised, as the FP32 kernels do.
constexpr float kLog2e = 1.4426950408889634f;
// Shared row stride: 16 bytes past D put the 8 rows an ldmatrix reads in 8 distinct 16-byte bank groups
// (and TF32's B reads of V, rows 2t and columns g, in 32 distinct banks).
template <int D, typename E>
constexpr int kFlashLd = D + 16 / int(sizeof(E));
// Blocks an SM the register budget is set for: the forward and dQ kernels four up to head size 64 (128
// registers a thread), two beyond; the dK dV kernel, with two accumulators, three up to 64 (at 64 it
// spills 112 bytes a thread and still takes 5% less time than at two, an H200 at length 128), two beyond.
template <int D>
constexpr int kFlashBlocks = D <= 64 ? 4 : 2;
template <int D>
constexpr int kFlashKeyBlocks = D <= 64 ? 3 : 2;
// TF32's tiles take twice the shared memory: at head size 128 a key-side block takes 205 KB, one an SM.
template <int D, typename E>
constexpr int kFlashKeyBlocksOf = std::is_same_v<E, float> && D > 64 ? 1 : kFlashKeyBlocks<D>;

// Threads of a block: four warps (the one-kernel backward: four a tile of 64 rows).
constexpr int kFlashThreads = 128;

// The 64 rows from src (a (B, T, H D) operand, rows `stride` apart) into shared dst, rows from `valid`
// on as zeros: asynchronous 16-byte copies, part of the caller's next group. A thread copies the same
// 16 bytes of every (128 / chunks a row)-th row, its addresses advanced by a constant (a thread's copies
// were the larger part of the forward's instructions with the row and column worked out per copy).
// kRows, kThreads: the same for another number of rows and a block of another size.
template <int D, typename E, int kRows = kFlashRows, int kThreads = kFlashThreads>
__device__ __forceinline__ void copy_rows_async(E* dst, const E* src, int64_t stride, int valid) {
  constexpr int kPerChunk = 16 / int(sizeof(E)), kChunks = D / kPerChunk, kRowsAPass = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kRows % kRowsAPass == 0, "whole rows a pass");
  constexpr int ld = kFlashLd<D, E>;
  const int r = threadIdx.x / kChunks, c = threadIdx.x % kChunks * kPerChunk;
  const E* from = src + r * stride + c;
  E* to = dst + r * ld + c;
#pragma unroll
  for (int i = 0; i < kRows / kRowsAPass; ++i) {
    const bool row = r + i * kRowsAPass < valid;
    cuda::mma::copy_async<16>(to + i * kRowsAPass * ld, row ? from + i * kRowsAPass * stride : src, row);
  }
}

// 2^x as the SFU gives it (ex2.approx.ftz: results below 2^-126 are 0): exp2f adds a range check and
// two multiplies to each for the subnormal results, which the probabilities do not need.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// s (a warp's 16 x 64 tile, 8 C tiles; or 16 x 8N, N C tiles) = the 16 rows of sa from row r0 times the
// first 8N rows of sb (both row-major over D: s = a b^T).
template <int D, typename E, int N>
__device__ __forceinline__ void product_tile(float (&s)[N][4], const E* sa, int r0, const E* sb) {
  static_assert(N % 2 == 0, "C tiles in pairs");
  constexpr int ld = kFlashLd<D, E>;
  for (auto& c : s)
    for (float& x : c) x = 0.0f;
  if constexpr (std::is_same_v<E, float>) {
#pragma unroll
    for (int kk = 0; kk < D; kk += 8) {
      uint32_t a[4];
      cuda::mma::load_a_tf32(a, sa, ld, r0, kk);
#pragma unroll
      for (int n = 0; n < N; n += 2) {
        uint32_t b[4];
        cuda::mma::load_b_pair_tf32(b, sb, ld, kk, n * 8);
        cuda::mma::product_tf32(s[n], a, b[0], b[1]);
        cuda::mma::product_tf32(s[n + 1], a, b[2], b[3]);
      }
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < D; kk += 16) {
      uint32_t a[4];
      cuda::mma::load_a(a, sa, ld, r0, kk);
#pragma unroll
      for (int n = 0; n < N; n += 2) {
        uint32_t b[4];
        cuda::mma::load_b_pair<false>(b, sb, ld, kk, n * 8);
        cuda::mma::product(s[n], a, b[0], b[1]);
        cuda::mma::product(s[n + 1], a, b[2], b[3]);
      }
    }
  }
}

// acc (16 x D, D / 8 C tiles) += p (16 x 64, or 16 x 8N; rounded to E) times sb (64 or 8N rows x D, row-major).
template <int D, typename E, int N>
__device__ __forceinline__ void accumulate_tile(float (&acc)[D / 8][4], const float (&p)[N][4], const E* sb) {
  constexpr int ld = kFlashLd<D, E>;
  if constexpr (std::is_same_v<E, float>) {
#pragma unroll
    for (int kk = 0; kk < N; ++kk) {  // each C tile of p: 8 keys
      uint32_t a[4];
      cuda::mma::a_from_c_tf32(a, p[kk]);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        uint32_t b0, b1;
        cuda::mma::load_b_permuted_tf32(b0, b1, sb, ld, kk * 8, n * 8);
        cuda::mma::product_tf32(acc[n], a, b0, b1);
      }
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < N / 2; ++kk) {
      uint32_t a[4];
      cuda::mma::a_from_c(a, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
      for (int n = 0; n < D / 8; n += 2) {
        uint32_t b[4];
        cuda::mma::load_b_pair<true>(b, sb, ld, kk * 16, n * 8);
        cuda::mma::product(acc[n], a, b[0], b[1]);
        cuda::mma::product(acc[n + 1], a, b[2], b[3]);
      }
    }
  }
}

// Element e of C tile n of a warp's tile: row half e / 2 (rows g, g + 8), column n * 8 + 2 t + e % 2.
__device__ __forceinline__ int tile_column(int n, int e) { return n * 8 + 2 * (threadIdx.x % 4) + e % 2; }

// The two values of a C tile's row at p (aligned to the pair), or added to what p holds: as BF16, or floats.
__device__ __forceinline__ void store_pair(bf16* p, float a, float b, bool accumulate) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  if (accumulate) {
    const __nv_bfloat162 old = *reinterpret_cast<const __nv_bfloat162*>(p);
    v = __floats2bfloat162_rn(__low2float(old) + a, __high2float(old) + b);
  }
  *reinterpret_cast<__nv_bfloat162*>(p) = v;
}
__device__ __forceinline__ void store_pair(float* p, float a, float b, bool accumulate) {
  float2 v{a, b};
  if (accumulate) {
    const float2 old = *reinterpret_cast<const float2*>(p);
    v = float2{old.x + a, old.y + b};
  }
  *reinterpret_cast<float2*>(p) = v;
}

// The quad's four lanes' values combined (each lane holds its own columns of the quad's rows).
__device__ __forceinline__ uint32_t quad_or(uint32_t w) {
  w |= __shfl_xor_sync(0xffffffffu, w, 1);
  return w | __shfl_xor_sync(0xffffffffu, w, 2);
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// The dropout draws of the lane's two columns of C tile n (keys kt + n * 8 + 2t, + 1) in the rows of
// half h, as bits 0 and 1 of kept[h]. Where T is a multiple of 4, the four keys of a hash (DropoutDraws)
// lie in one row of one quad: lane t hashes row half t / 2's keys n * 8 + 4 (t % 2) .. + 3 (the index of
// their first draw less kt + n * 8 is `lane_draws`, lane_draws() below), and the quad hands each lane its
// bits (one hash a lane a tile instead of four).
__device__ __forceinline__ uint64_t lane_draws(const Geometry& q, int64_t bh, const int64_t (&rows)[2]) {
  const int t = threadIdx.x % 4;
  return q.first + uint64_t((bh * q.length + (t / 2 ? rows[1] : rows[0])) * q.length + 4 * (t % 2));
}
__device__ __forceinline__ void draw_tile(const Geometry& q, int64_t bh, const int64_t (&rows)[2], uint64_t first,
                                          int kt, int n, uint32_t (&kept)[2]) {
  const int t = threadIdx.x % 4;
  if (q.length % 4 == 0) {
    const uint32_t four = DropoutDraws::kept4(q.seed, (first + uint64_t(kt + n * 8)) / 4, q.threshold);
    const int quad = threadIdx.x % 32 & ~3;
#pragma unroll
    for (int h = 0; h < 2; ++h) kept[h] = (__shfl_sync(0xffffffffu, four, quad + 2 * h + t / 2) >> (2 * (t % 2))) & 3u;
    return;
  }
  const int c = kt + n * 8 + 2 * t;
#pragma unroll
  for (int h = 0; h < 2; ++h)
    kept[h] = uint32_t(draw_keep(q, bh, rows[h], c)) | uint32_t(draw_keep(q, bh, rows[h], c + 1)) << 1;
}

// Dropout on a warp's tile of probabilities (rows `rows`, keys kt .. kt + 63; `first` as draw_tile takes
// it): kept ones times keep_scale, the others 0, drawn as the unfused dropout draws them; the keep bits go
// to q.bits (two words a row) for the backward. kFull: every row and key of the tile lies below T.
template <bool kFull>
__device__ void drop_tile(const Geometry& q, int64_t bh, const int64_t (&rows)[2], uint64_t first, int kt,
                          float (&p)[8][4]) {
  const int t = threadIdx.x % 4;
  uint32_t words[2][2] = {};
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    uint32_t kept[2];
    draw_tile(q, bh, rows, first, kt, n, kept);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (!kFull) {  // bits beyond T cleared
        const int64_t c = kt + n * 8 + 2 * t;
        if (rows[h] >= q.length || c >= q.length) kept[h] = 0;
        if (c + 1 >= q.length) kept[h] &= 1u;
      }
      words[h][n / 4] |= kept[h] << (n % 4 * 8 + 2 * t);  // this lane's two keys of the word
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) p[n][e] *= (kept[e / 2] >> (e % 2)) & 1u ? q.keep_scale : 0.0f;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    words[h][0] = quad_or(words[h][0]);
    words[h][1] = quad_or(words[h][1]);
    if ((kFull || rows[h] < q.length) && t == 0) {
      uint32_t* out = q.bits + (bh * q.length + rows[h]) * q.words + kt / 32;
      out[0] = words[h][0];
      out[1] = words[h][1];
    }
  }
}

// The additive mask of the lane's two keys of C tile n (kt + n * 8 + 2t, + 1) times log2 e, -inf for keys
// beyond T.
template <bool kFull>
__device__ __forceinline__ float2 key_bias(const Geometry& q, int64_t b, int kt, int n) {
  const int64_t j = kt + n * 8 + 2 * (threadIdx.x % 4);
  const float* mask = q.mask ? q.mask + b * q.length + j : nullptr;
  if (kFull) {
    if (!mask) return {0.0f, 0.0f};
    const float2 m = *reinterpret_cast<const float2*>(mask);  // T a multiple of 64, j even: 8-byte aligned
    return {m.x * kLog2e, m.y * kLog2e};
  }
  return {j < q.length ? (mask ? mask[0] * kLog2e : 0.0f) : -INFINITY,
          j + 1 < q.length ? (mask ? mask[1] * kLog2e : 0.0f) : -INFINITY};
}

// Rows of a tile starting at `first`: 64, or what is left of T (kFull: 64, known to the compiler).
template <bool kFull>
__device__ __forceinline__ int tile_rows(const Geometry& q, int64_t first) {
  return kFull ? kFlashRows : int(lesser(kFlashRows, q.length - first));
}

// The pipeline's two steps. arrive(): this thread's copies but the newest group have landed, and (after
// the barrier) every thread's. refill(): once every warp has read `tile`, the copy of the tile of rows from
// `next` on into its place, if any; a group is committed either way.
__device__ __forceinline__ void arrive() {
  cuda::mma::wait<1>();
  __syncthreads();
}
template <int D, bool kFull, typename E>
__device__ __forceinline__ void refill(E* tile, const E* src, const Geometry& q, int64_t next) {
  __syncthreads();
  if (next < q.padded) copy_rows_async<D>(tile, src + next * q.stride, q.stride, tile_rows<kFull>(q, next));
  cuda::mma::commit();
}

// Where a BF16 kernel's block and lane sit: item and head (bh, b), the first of the block's 64 rows (query
// rows or keys), the head's offset in a (B, T, H D) operand, the lane's warp and quad roles, and its two
// rows (g and g + 8 of its warp's 16) within the block and in T.
template <int D>
struct FlashBlock {
  int64_t bh, b, first, base, obase;  // base: in Q, K, V (and their gradients); obase: in O and dO
  int warp, g, t;
  int local[2];
  int64_t rows[2];
  __device__ explicit FlashBlock(const Geometry& q)
      : bh(blockIdx.y),
        b(bh / q.heads),
        first(int64_t(blockIdx.x) * kFlashRows),
        base(b * q.length * q.stride + (bh % q.heads) * D),
        obase(b * q.length * q.out_stride + (bh % q.heads) * D),
        warp(threadIdx.x / 32),
        g(threadIdx.x % 32 / 4),
        t(threadIdx.x % 4),
        local{warp * 16 + g, warp * 16 + g + 8},
        rows{first + local[0], first + local[1]} {}
};

// A tile of scores s (16 x 64, keys kt ..) in base 2, scaled and with the keys' bias; this lane's row
// maxima of it in top.
template <bool kFull>
__device__ __forceinline__ void scores_base2(const Geometry& q, int64_t b, int kt, float scale, float (&s)[8][4],
                                             float (&top)[2]) {
  top[0] = top[1] = -INFINITY;
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    const float2 bias = key_bias<kFull>(q, b, kt, n);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[n][e] = fmaf(s[n][e], scale, e % 2 ? bias.y : bias.x);
      top[e / 2] = fmaxf(top[e / 2], s[n][e]);
    }
  }
}
// The online softmax's step for a tile s from scores_base2: the running maxima m grow to include it (the
// factor by which earlier sums shrink in rescale), s becomes exp2(s - m), and the lane's sums l gain it.
__device__ __forceinline__ void online_softmax(float (&s)[8][4], const float (&top)[2], float (&m)[2], float (&l)[2],
                                               float (&rescale)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float next_max = fmaxf(m[h], quad_max(top[h]));  // finite: every tile holds a key below T
    rescale[h] = exp2_approx(m[h] - next_max);             // 0 on the first tile
    m[h] = next_max;
    l[h] *= rescale[h];
  }
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) l[e / 2] += s[n][e] = exp2_approx(s[n][e] - m[e / 2]);
}

// The probabilities' quantizer on a dropped-out probability x (Geometry::probs_scale): its fake-quantized
// value (cuda::fake_quantize_value's arithmetic); `passed` is x where the quantizer passes the gradient
// (inside its range), else 0, and `clipped` counts x where it saturates. kNormal as cuda::quotient's.
template <bool kNormal>
__device__ __forceinline__ float quantize_probability(float x, const Geometry& q, const cuda::ScaleDivision& divide,
                                                      float& passed, int& clipped) {
  int saturated = 0;
  const float value = cuda::fake_quantize_value<kNormal>(x, divide, q.probs_lo, q.probs_hi, saturated);
  clipped += saturated;
  passed = saturated ? 0.0f : x;
  return value;
}

// f(std::true_type{}) or f(std::false_type{}) as cuda::with_division picks them for the probabilities'
// quantizer's scale (kQuant; f(std::true_type{}) without it): a tile's loop over its probabilities compiled
// without the branch to the IEEE division that each value otherwise carries (with it, the BF16 QAT forward
// of BERT-base took 1,020 us a step against 940, ncu on an H100).
template <bool kQuant, typename F>
__device__ __forceinline__ void with_probs_division(const cuda::ScaleDivision& divide, F&& f) {
  if constexpr (kQuant)
    cuda::with_division(divide.normal, f);
  else
    f(std::true_type{});
}

// Copies in flight, in groups (cp.async): Q with the first K, then the first V; then, as each tile's K
// (V) has been read by every warp, the next tile's K (V) into its place. Every step commits a group, empty
// or not, so that wait<1> always means "all but the newest".
// kQuant: the probabilities' quantizer (Geometry::probs_scale) reads them exactly normalised, so a first
// pass over the K tiles (alternating between sK and sV) finds each row's log-sum-exp; the second computes
// the probabilities from it as the backward does, and multiplies V by their fake-quantized values (out)
// and by those the quantizer passes (passed: Di's operand in the backward).
template <int D, bool kFull, bool kQuant, typename E>
__global__ void __launch_bounds__(kFlashThreads, kFlashBlocks<D>)
    flash_forward(E* out, E* passed, float* lse, const E* qp, const E* kp, const E* vp, Geometry q) {
  constexpr int ld = kFlashLd<D, E>;
  extern __shared__ __align__(128) unsigned char smem[];
  E* sQ = reinterpret_cast<E*>(smem);
  E* sK = sQ + kFlashRows * ld;
  E* sV = sK + kFlashRows * ld;
  const auto [bh, b, q0, base, obase, warp, g, t, local, rows] = FlashBlock<D>(q);
  const float scale = q.alpha * kLog2e;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // running row maximum (base 2); this lane's sum
  float row_lse[2];                                          // kQuant: each row's log-sum-exp, base 2
  copy_rows_async<D>(sQ, qp + base + q0 * q.stride, q.stride, tile_rows<kFull>(q, q0));
  if constexpr (kQuant) {
    copy_rows_async<D>(sK, kp + base, q.stride, tile_rows<kFull>(q, 0));
    cuda::mma::commit();
    if (kFlashRows < q.padded)
      copy_rows_async<D>(sV, kp + base + kFlashRows * q.stride, q.stride, tile_rows<kFull>(q, kFlashRows));
    cuda::mma::commit();
    for (int kt = 0; kt < q.padded; kt += kFlashRows) {
      E* tile = kt / kFlashRows % 2 ? sV : sK;
      arrive();  // this K (and Q)
      float s[8][4], top[2], rescale[2];
      product_tile<D>(s, sQ, warp * 16, tile);
      refill<D, kFull>(tile, kp + base, q, kt + 2 * kFlashRows);  // read by every warp
      scores_base2<kFull>(q, b, kt, scale, s, top);
      online_softmax(s, top, m, l, rescale);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = quad_sum(l[h]);  // every lane of the warp takes part in the shuffles
      row_lse[h] = rows[h] < q.length ? m[h] + log2f(sum) : INFINITY;
    }
    // Both tiles free: the last refill's barrier follows every warp's last read of either.
  }
  copy_rows_async<D>(sK, kp + base, q.stride, tile_rows<kFull>(q, 0));
  cuda::mma::commit();
  copy_rows_async<D>(sV, vp + base, q.stride, tile_rows<kFull>(q, 0));
  cuda::mma::commit();
  float o[D / 8][4] = {}, o_passed[kQuant ? D / 8 : 1][4] = {};
  const uint64_t draws = q.dropout ? lane_draws(q, bh, rows) : 0;
  const cuda::ScaleDivision divide(kQuant ? *q.probs_scale : 1.0f);
  int clipped = 0;
  for (int kt = 0; kt < q.padded; kt += kFlashRows) {
    const int64_t next = kt + kFlashRows;
    arrive();  // this K (and Q)
    float s[8][4];
    product_tile<D>(s, sQ, warp * 16, sK);
    refill<D, kFull>(sK, kp + base, q, next);  // sK read by every warp
    if constexpr (kQuant) {
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const float2 bias = key_bias<kFull>(q, b, kt, n);  // -inf beyond T: p = 0 there
#pragma unroll
        for (int e = 0; e < 4; ++e)
          s[n][e] = exp2_approx(fmaf(s[n][e], scale, (e % 2 ? bias.y : bias.x) - row_lse[e / 2]));
      }
    } else {
      float top[2], rescale[2];
      scores_base2<kFull>(q, b, kt, scale, s, top);
      online_softmax(s, top, m, l, rescale);
#pragma unroll
      for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[n][e] *= rescale[e / 2];
    }
    if (q.dropout) drop_tile<kFull>(q, bh, rows, draws, kt, s);
    if constexpr (kQuant) {
      float pass[8][4];
      cuda::with_division(divide.normal, [&](auto normal) {
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            s[n][e] = quantize_probability<decltype(normal)::value>(s[n][e], q, divide, pass[n][e], clipped);
      });
      arrive();  // this V
      accumulate_tile<D>(o, s, sV);
      accumulate_tile<D>(o_passed, pass, sV);
    } else {
      arrive();  // this V
      accumulate_tile<D>(o, s, sV);
    }
    refill<D, kFull>(sV, vp + base, q, next);  // sV read by every warp
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = kQuant ? 1.0f : quad_sum(l[h]);
    if (rows[h] >= q.length) continue;
    const float inv = 1.0f / sum;
    E* row = out + obase + rows[h] * q.out_stride + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) store_pair(row + n * 8, o[n][2 * h] * inv, o[n][2 * h + 1] * inv, false);
    if constexpr (kQuant) {
      E* passed_row = passed + obase + rows[h] * q.out_stride + 2 * t;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) store_pair(passed_row + n * 8, o_passed[n][2 * h], o_passed[n][2 * h + 1], false);
      if (t == 0) lse[bh * q.length + rows[h]] = row_lse[h] / kLog2e;
    } else {
      if (t == 0) lse[bh * q.length + rows[h]] = m[h] / kLog2e + logf(sum);
    }
  }
  if (kQuant && q.probs_clipped) {
    const int warp_clipped = cuda::warp_sum(clipped);
    if (threadIdx.x % 32 == 0 && warp_clipped)
      atomicAdd(q.probs_clipped, static_cast<unsigned long long>(warp_clipped));
  }
}

// dQ = alpha dS K over every key tile, dS = P (keep dP - Di), dP = dO V^T; and Di = rowsum(dO * O) of the
// block's rows for the key-side kernel. Copies: Q, dO and the first V, then the first K; then each tile's
// V (K) replaced by the next once read. kQuant: dP reaches the probabilities only where their quantizer
// passes it (dS = P (pass keep dP - Di)), and `op` is the forward's `passed`, so that Di is still the row
// sum of P times its gradient.
template <int D, bool kFull, bool kQuant, typename E>
__global__ void __launch_bounds__(kFlashThreads, kFlashBlocks<D>)
    flash_backward_query(E* dq, bool accumulate, float* di, const E* qp, const E* kp, const E* vp,
                         const E* op, const E* dop, const float* lse, Geometry q) {
  constexpr int ld = kFlashLd<D, E>;
  extern __shared__ __align__(128) unsigned char smem[];
  E* sQ = reinterpret_cast<E*>(smem);
  E* sdO = sQ + kFlashRows * ld;
  E* sK = sdO + kFlashRows * ld;
  E* sV = sK + kFlashRows * ld;
  const auto [bh, b, q0, base, obase, warp, g, t, local, rows] = FlashBlock<D>(q);
  copy_rows_async<D>(sQ, qp + base + q0 * q.stride, q.stride, tile_rows<kFull>(q, q0));
  copy_rows_async<D>(sdO, dop + obase + q0 * q.out_stride, q.out_stride, tile_rows<kFull>(q, q0));
  copy_rows_async<D>(sV, vp + base, q.stride, tile_rows<kFull>(q, 0));
  cuda::mma::commit();
  copy_rows_async<D>(sK, kp + base, q.stride, tile_rows<kFull>(q, 0));
  cuda::mma::commit();
  float row_di[2], row_lse[2];  // row_lse in base 2
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // Di from global memory while the copies run; the quad's lanes take 8 columns in turn
    float s = 0;
    if (rows[h] < q.length)
      for (int c = 8 * t; c < D; c += 32) {
        const cuda::Pack<E, 8> x = cuda::load_pack<8>(op + obase + rows[h] * q.out_stride + c);
        const cuda::Pack<E, 8> y = cuda::load_pack<8>(dop + obase + rows[h] * q.out_stride + c);
#pragma unroll
        for (int j = 0; j < 8; ++j) s += cuda::to_float(x.v[j]) * cuda::to_float(y.v[j]);
      }
    row_di[h] = quad_sum(s);
    row_lse[h] = rows[h] < q.length ? lse[bh * q.length + rows[h]] * kLog2e : INFINITY;
    if (t == 0 && rows[h] < q.length) di[bh * q.length + rows[h]] = row_di[h];
  }
  const float scale = q.alpha * kLog2e;
  const cuda::ScaleDivision divide(kQuant ? *q.probs_scale : 1.0f);
  float acc[D / 8][4] = {};
  for (int kt = 0; kt < q.padded; kt += kFlashRows) {
    const int64_t next = kt + kFlashRows;
    uint32_t words[2][2] = {};  // shifted to this lane's keys: bit (n % 4) 8 + w for key kt + n 8 + 2t + w
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (q.dropout && (kFull || rows[h] < q.length))
        for (int w = 0; w < 2; ++w) words[h][w] = q.bits[(bh * q.length + rows[h]) * q.words + kt / 32 + w] >> 2 * t;
    arrive();  // this V (and Q, dO)
    float s[8][4], dp[8][4];
    product_tile<D>(dp, sdO, warp * 16, sV);
    refill<D, kFull>(sV, vp + base, q, next);  // sV read by every warp
    arrive();                           // this K
    product_tile<D>(s, sQ, warp * 16, sK);
    with_probs_division<kQuant>(divide, [&](auto normal) {
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const float2 bias = key_bias<kFull>(q, b, kt, n);  // -inf beyond T: p = 0 there
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e / 2;
          float ds = 0.0f;
          if (kFull || rows[h] < q.length) {
            const float p = exp2_approx(fmaf(s[n][e], scale, (e % 2 ? bias.y : bias.x) - row_lse[h]));
            const float keep = !q.dropout ? 1.0f : (words[h][n / 4] >> (n % 4 * 8 + e % 2)) & 1u ? q.keep_scale : 0.0f;
            float gradient = dp[n][e] * keep;
            if constexpr (kQuant) {
              const float u = cuda::quotient<decltype(normal)::value>(p * keep, divide);
              if (u < q.probs_lo || u > q.probs_hi) gradient = 0.0f;
            }
            ds = p * (gradient - row_di[h]);
          }
          s[n][e] = ds;
        }
      }
    });
    accumulate_tile<D>(acc, s, sK);
    refill<D, kFull>(sK, kp + base, q, next);  // sK read by every warp
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (rows[h] >= q.length) continue;
    E* row = dq + base + rows[h] * q.stride + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      store_pair(row + n * 8, q.alpha * acc[n][2 * h], q.alpha * acc[n][2 * h + 1], accumulate);
  }
}

// One query tile as the key-side kernel reads it: Q and dO rows, and per query its log-sum-exp, Di and the
// two keep-bit words of the block's keys.
template <int D, typename E>
struct QueryStage {
  E* q;
  E* dout;
  float* lse;
  float* di;
  uint32_t* bits;
  static constexpr size_t kBytes = size_t(2 * kFlashRows) * kFlashLd<D, E> * sizeof(E) + 4 * kFlashRows * sizeof(float);
  __device__ explicit QueryStage(unsigned char* at)
      : q(reinterpret_cast<E*>(at)),
        dout(q + kFlashRows * kFlashLd<D, E>),
        lse(reinterpret_cast<float*>(dout + kFlashRows * kFlashLd<D, E>)),
        di(lse + kFlashRows),
        bits(reinterpret_cast<uint32_t*>(di + kFlashRows)) {}
  // Asynchronous copies of the tile starting at query qt (the caller commits them).
  template <bool kFull>
  __device__ void copy(const Geometry& g, int64_t bh, int64_t base, int64_t obase, int64_t qt, int64_t k0,
                       const E* qp, const E* dop, const float* lse_in, const float* di_in) {
    const int queries = tile_rows<kFull>(g, qt);
    copy_rows_async<D>(q, qp + base + qt * g.stride, g.stride, queries);
    copy_rows_async<D>(dout, dop + obase + qt * g.out_stride, g.out_stride, queries);
    for (int r = threadIdx.x; r < kFlashRows; r += kFlashThreads) {
      const bool row = r < queries;
      const int64_t at = bh * g.length + qt + (row ? r : 0);
      cuda::mma::copy_async<4>(lse + r, lse_in + at, row);
      cuda::mma::copy_async<4>(di + r, di_in + at, row);
      if (g.dropout) cuda::mma::copy_async<8>(bits + 2 * r, g.bits + at * g.words + k0 / 32, row);
    }
  }
};

// One (query, key) element of the key side's tile: from the probability `prob`, whether the dropout kept
// it, dP and the query's Di: p, dV's operand (the dropped-out probability; kQuant: fake-quantized), and dS. kQuant:
// through the quantizer (straight through inside its range) and the dropout, its scale gradient's share added to
// scale_part. kNormal as cuda::quotient's.
template <bool kQuant, bool kNormal>
__device__ __forceinline__ void key_side_element(float prob, bool kept, float dp, float di, const Geometry& q,
                                                 const cuda::ScaleDivision& divide, float& scale_part, float& p,
                                                 float& ds) {
  const float keep = !q.dropout ? 1.0f : kept ? q.keep_scale : 0.0f;
  p = prob * keep;
  float gradient = dp * keep;
  if constexpr (kQuant) {
    gradient = cuda::fake_quantize_value_grad<kNormal>(p, dp, keep, divide, q.probs_lo, q.probs_hi, scale_part);
    int saturated = 0;  // (counted by the forward)
    p = cuda::fake_quantize_value<kNormal>(p, divide, q.probs_lo, q.probs_hi, saturated);
  }
  ds = prob * (gradient - di);
}

// dK (times alpha) and dV of the lane's two keys (rows `keys` of T) from the register tiles, where below T.
template <int D, typename E>
__device__ __forceinline__ void store_key_gradients(E* dk, bool accumulate_k, E* dv, bool accumulate_v,
                                                    const float (&acc_k)[D / 8][4], const float (&acc_v)[D / 8][4],
                                                    const Geometry& q, int64_t base, const int64_t (&keys)[2], int t) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (keys[h] >= q.length) continue;
    const int64_t at_key = base + keys[h] * q.stride + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      store_pair(dk + at_key + n * 8, q.alpha * acc_k[n][2 * h], q.alpha * acc_k[n][2 * h + 1], accumulate_k);
      store_pair(dv + at_key + n * 8, acc_v[n][2 * h], acc_v[n][2 * h + 1], accumulate_v);
    }
  }
}

// dK = alpha dS^T Q and dV = dropout(P)^T dO of the block's 64 keys, over every query tile; the query tiles
// in two stages, the next one copied while this one is multiplied. kQuant: dV from the fake-quantized
// dropout(P), dS as the query side's, and the quantizer's scale gradient (LSQ: dP times the rounding error
// inside the range, times the bound outside) summed over the grid.
template <int D, bool kFull, bool kQuant, typename E>
__global__ void __launch_bounds__(kFlashThreads, kFlashKeyBlocksOf<D, E>)
    flash_backward_key(E* dk, bool accumulate_k, E* dv, bool accumulate_v, const E* qp, const E* kp,
                       const E* vp, const E* dop, const float* lse, const float* di, Geometry q) {
  constexpr int ld = kFlashLd<D, E>;
  extern __shared__ __align__(128) unsigned char smem[];
  E* sK = reinterpret_cast<E*>(smem);
  E* sV = sK + kFlashRows * ld;
  unsigned char* stages = reinterpret_cast<unsigned char*>(sV + kFlashRows * ld);
  auto stage = [stages](int i) { return QueryStage<D, E>(stages + i * QueryStage<D, E>::kBytes); };
  const auto [bh, b, k0, base, obase, warp, g, t, local, keys] = FlashBlock<D>(q);  // the lane's keys: local, keys
  copy_rows_async<D>(sK, kp + base + k0 * q.stride, q.stride, tile_rows<kFull>(q, k0));
  copy_rows_async<D>(sV, vp + base + k0 * q.stride, q.stride, tile_rows<kFull>(q, k0));
  stage(0).template copy<kFull>(q, bh, base, obase, 0, k0, qp, dop, lse, di);
  cuda::mma::commit();
  float key_mask[2];  // base 2
#pragma unroll
  for (int h = 0; h < 2; ++h) key_mask[h] = keys[h] < q.length ? mask_at(q, b, keys[h]) * kLog2e : 0.0f;
  const float scale = q.alpha * kLog2e;
  const cuda::ScaleDivision divide(kQuant ? *q.probs_scale : 1.0f);
  float scale_part = 0.0f;  // kQuant: this lane's share of the scale gradient
  float acc_k[D / 8][4] = {}, acc_v[D / 8][4] = {};
  int at = 0;
  for (int64_t qt = 0; qt < q.length; qt += kFlashRows, at ^= 1) {
    if (qt + kFlashRows < q.length)
      stage(at ^ 1).template copy<kFull>(q, bh, base, obase, qt + kFlashRows, k0, qp, dop, lse, di);
    cuda::mma::commit();
    arrive();  // this stage (and K, V)
    const QueryStage<D, E> s_q = stage(at);
    const int queries = tile_rows<kFull>(q, qt);
    float s[8][4], dp[8][4];  // S^T and dP^T: the warp's 16 keys by 64 queries
    product_tile<D>(s, sK, warp * 16, s_q.q);
    product_tile<D>(dp, sV, warp * 16, s_q.dout);
    with_probs_division<kQuant>(divide, [&](auto normal) {
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        const int c0 = tile_column(n, 0);
        const float2 row_lse = *reinterpret_cast<const float2*>(s_q.lse + c0);
        const float2 row_di = *reinterpret_cast<const float2*>(s_q.di + c0);
        const uint4 words = *reinterpret_cast<const uint4*>(s_q.bits + 2 * c0);  // queries c0, c0 + 1
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = c0 + e % 2, h = e / 2;
          float p = 0.0f, ds = 0.0f;
          if (kFull || (c < queries && keys[h] < q.length)) {
            const float query_lse = e % 2 ? row_lse.y : row_lse.x, query_di = e % 2 ? row_di.y : row_di.x;
            const float prob = exp2_approx(fmaf(s[n][e], scale, fmaf(-query_lse, kLog2e, key_mask[h])));
            const uint32_t word = e % 2 ? (local[h] < 32 ? words.z : words.w) : (local[h] < 32 ? words.x : words.y);
            key_side_element<kQuant, decltype(normal)::value>(prob, (word >> (local[h] % 32)) & 1u, dp[n][e], query_di,
                                                              q, divide, scale_part, p, ds);
          }
          s[n][e] = p;
          dp[n][e] = ds;
        }
      }
    });
    accumulate_tile<D>(acc_v, s, s_q.dout);
    accumulate_tile<D>(acc_k, dp, s_q.q);
    __syncthreads();  // the stage read by every warp before the next step copies into it
  }
  store_key_gradients<D>(dk, accumulate_k, dv, accumulate_v, acc_k, acc_v, q, base, keys, t);
  if (kQuant && q.probs_grad)
    cuda::add_grid_scale_gradient(scale_part, q.probs_grad, q.probs_grad_scale, q.probs_partial, q.arrivals);
}

// --- The backward in one kernel where T <= 128 (BF16, head sizes up to 64; kQuant: with the probabilities'
// quantizer, as the key-side kernel applies it): a block a (b, h), kTiles tiles of 64 rows, holds all of that
// head's Q, K, V and dO in shared memory and makes dQ, dK and dV in one pass, five products where the two
// kernels above make seven (S and dP made once; Q, K, V and dO read once). Its warps first own 16 keys each
// as the key-side kernel's do: S^T and dP^T over the queries kChunk at a time, dK and dV summed in
// registers, and dS^T (rounded to BF16, as the query side rounds dS for its product) kept in shared memory;
// then each warp owns 16 queries and sums dQ = alpha dS K from it. Di (the row sums of dO * O) is formed in
// the block from O and the copied dO.
template <int D, int kTiles>
struct FusedLayout {
  static constexpr int kRows = kTiles * kFlashRows, kThreads = kTiles * kFlashThreads;
  static constexpr int kLd = kFlashLd<D, bf16>, kLdS = kRows + 8;  // dS^T's stride: 16 bytes past a row
  static constexpr int kWords = kRows / 32;                        // keep-bit words a query
  static constexpr size_t kBytes = (size_t(4 * kRows) * kLd + size_t(kRows) * kLdS) * sizeof(bf16) +
                                   size_t(kRows) * (2 * sizeof(float) + kWords * sizeof(uint32_t));
};
// Queries a step of the key-side phase (two 16 x 32 C tiles in registers: at 64, twice that, the kernel takes 250
// registers and one block an SM, 0.85x the speed on an H200), and blocks an SM: two at 128 keys (111 KB of
// shared memory each at head size 64, 128 registers), four at 64.
constexpr int kFusedChunk = 32;
template <int kTiles>
constexpr int kFusedBlocks = kTiles == 1 ? 4 : 2;

// The column sums of a warp's 16 rows of a C-tile accumulator as they are stored (times `factor`, rounded to
// BF16; rows at or beyond T count 0) into out[0, D), written by the lanes of quad 0: rows g and g + 8 of the
// lane, then the warp's eight quads in a fixed order.
template <int D>
__device__ __forceinline__ void warp_column_sums(float* out, const float (&acc)[D / 8][4], float factor,
                                                 const int (&rows)[2], int64_t length) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float sum = 0.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (rows[h] < length) sum += __bfloat162float(__float2bfloat16_rn(factor * acc[n][2 * h + e]));
      sum += __shfl_xor_sync(0xffffffffu, sum, 4);
      sum += __shfl_xor_sync(0xffffffffu, sum, 8);
      sum += __shfl_xor_sync(0xffffffffu, sum, 16);
      if (threadIdx.x % 32 < 4) out[n * 8 + 2 * t + e] = sum;
    }
}

// With bias_partial set (dQ, dK and dV side by side in a projections' gradient, written, not added to), the
// block also sums the three over its T rows as it stores them (the projections' bias gradients, without a
// pass over dQ, dK and dV of their own): bias_partial[part][b][C] for part 0, 1, 2 (Q, K, V), C = heads D,
// the block's head's D columns; the caller adds the B rows (cuda::launch_add_partial_rows).
template <int D, bool kFull, int kTiles, bool kQuant>
__global__ void __launch_bounds__(FusedLayout<D, kTiles>::kThreads, kFusedBlocks<kTiles>)
    flash_backward_fused(bf16* dq, bool accumulate_q, bf16* dk, bool accumulate_k, bf16* dv, bool accumulate_v,
                         const bf16* qp, const bf16* kp, const bf16* vp, const bf16* op, const bf16* dop,
                         const float* lse, float* bias_partial, Geometry q) {
  using L = FusedLayout<D, kTiles>;
  constexpr int kRows = L::kRows, kThreads = L::kThreads, ld = L::kLd, lds = L::kLdS, kWords = L::kWords;
  constexpr int kChunk = kFusedChunk;
  static_assert(kThreads == 2 * kRows && kRows % kChunk == 0, "two threads a query for Di; whole chunks");
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sK = reinterpret_cast<bf16*>(smem);
  bf16* sV = sK + kRows * ld;
  bf16* sQ = sV + kRows * ld;
  bf16* sdO = sQ + kRows * ld;
  bf16* sdS = sdO + kRows * ld;  // dS^T: row j holds key j's scores' gradients, query by query
  float2* s_stats = reinterpret_cast<float2*>(sdS + kRows * lds);   // a query's log-sum-exp (base 2) and Di
  uint32_t* s_bits = reinterpret_cast<uint32_t*>(s_stats + kRows);  // keep bits, word w of query i at w kRows + i
  // The lane's keys (phase one) and queries (phase two) are both `local` (the block's first row is 0).
  const auto [bh, b, first, base, obase, warp, g, t, local, rows] = FlashBlock<D>(q);
  // Two threads a query: its O (for Di), log-sum-exp and keep bits loaded first, so that they are on their way
  // while the copies of K, V, Q and dO are issued; Di is then formed with the copied dO.
  constexpr int kPacks = D / 16;  // packs of 8 columns a thread: every other one of the row's
  const int r = threadIdx.x / 2, half = threadIdx.x % 2;
  cuda::Pack<bf16, 8> o[kPacks] = {};  // zeros beyond T
  float row_lse = 0.0f;
  uint32_t words[kWords / 2] = {};
  if (r < q.length) {
#pragma unroll
    for (int i = 0; i < kPacks; ++i) o[i] = cuda::load_pack<8>(op + obase + r * q.out_stride + 8 * half + 16 * i);
    row_lse = lse[bh * q.length + r];
    if (q.dropout)
#pragma unroll
      for (int w = 0; w < kWords / 2; ++w) words[w] = q.bits[(bh * q.length + r) * kWords + half * kWords / 2 + w];
  }
  const int valid = kFull ? kRows : int(q.length);
  copy_rows_async<D, bf16, kRows, kThreads>(sK, kp + base, q.stride, valid);
  copy_rows_async<D, bf16, kRows, kThreads>(sV, vp + base, q.stride, valid);
  copy_rows_async<D, bf16, kRows, kThreads>(sQ, qp + base, q.stride, valid);
  copy_rows_async<D, bf16, kRows, kThreads>(sdO, dop + obase, q.out_stride, valid);
  cuda::mma::commit();
#pragma unroll
  for (int w = 0; w < kWords / 2; ++w) s_bits[(half * kWords / 2 + w) * kRows + r] = words[w];
  cuda::mma::wait<0>();
  __syncthreads();
  {
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kPacks; ++i) {
      const cuda::Pack<bf16, 8> y = *reinterpret_cast<const cuda::Pack<bf16, 8>*>(sdO + r * ld + 8 * half + 16 * i);
#pragma unroll
      for (int j = 0; j < 8; ++j) sum += cuda::to_float(o[i].v[j]) * cuda::to_float(y.v[j]);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if (half == 0) s_stats[r] = float2{row_lse * kLog2e, sum};
  }
  __syncthreads();

  float key_mask[2];  // base 2
#pragma unroll
  for (int h = 0; h < 2; ++h) key_mask[h] = local[h] < q.length ? mask_at(q, b, local[h]) * kLog2e : 0.0f;
  const float scale = q.alpha * kLog2e;
  const cuda::ScaleDivision divide(kQuant ? *q.probs_scale : 1.0f);
  float scale_part = 0.0f;  // kQuant: this lane's share of the scale gradient
  float acc_k[D / 8][4] = {}, acc_v[D / 8][4] = {};
  constexpr int N = kChunk / 8;
#pragma unroll 1
  for (int qt = 0; qt < kRows; qt += kChunk) {
    float s[N][4], dp[N][4];  // S^T and dP^T: the warp's 16 keys by kChunk queries
    product_tile<D>(s, sK, warp * 16, sQ + qt * ld);
    product_tile<D>(dp, sV, warp * 16, sdO + qt * ld);
    with_probs_division<kQuant>(divide, [&](auto normal) {
#pragma unroll
      for (int n = 0; n < N; ++n) {
        const int c0 = qt + tile_column(n, 0);
        const float4 stats = *reinterpret_cast<const float4*>(s_stats + c0);  // queries c0, c0 + 1
        // Queries c0 and c0 + 1: the word of the warp's 16 keys.
        const uint2 words = q.dropout ? *reinterpret_cast<const uint2*>(s_bits + warp / 2 * kRows + c0) : uint2{};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = c0 + e % 2, h = e / 2;
          float p = 0.0f, ds = 0.0f;
          if (kFull || (c < q.length && local[h] < q.length)) {
            const float query_lse = e % 2 ? stats.z : stats.x, query_di = e % 2 ? stats.w : stats.y;
            const float prob = exp2_approx(fmaf(s[n][e], scale, key_mask[h] - query_lse));
            key_side_element<kQuant, decltype(normal)::value>(prob,
                                                              ((e % 2 ? words.y : words.x) >> (local[h] % 32)) & 1u,
                                                              dp[n][e], query_di, q, divide, scale_part, p, ds);
          }
          s[n][e] = p;
          dp[n][e] = ds;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h)
          *reinterpret_cast<__nv_bfloat162*>(sdS + local[h] * lds + c0) =
              __floats2bfloat162_rn(dp[n][2 * h], dp[n][2 * h + 1]);
      }
    });
    accumulate_tile<D>(acc_v, s, sdO + qt * ld);
    accumulate_tile<D>(acc_k, dp, sQ + qt * ld);
  }
  store_key_gradients<D>(dk, accumulate_k, dv, accumulate_v, acc_k, acc_v, q, base, rows, t);  // rows == local
  __syncthreads();  // every warp's dS^T in place, and sV read by every warp (free for the column sums)
  constexpr int kWarps = kThreads / 32;
  static_assert(3 * kWarps * D * sizeof(float) <= kRows * ld * sizeof(bf16), "the column sums fit in sV");
  float* const column_sums = reinterpret_cast<float*>(sV);  // [3][kWarps][D]: Q, K, V
  if (bias_partial) {
    warp_column_sums<D>(column_sums + (kWarps + warp) * D, acc_k, q.alpha, local, q.length);
    warp_column_sums<D>(column_sums + (2 * kWarps + warp) * D, acc_v, 1.0f, local, q.length);
  }

  float acc_q[D / 8][4] = {};  // dQ of the warp's 16 queries: dS (read through its transpose) times K
#pragma unroll
  for (int kk = 0; kk < kRows; kk += 16) {
    uint32_t a[4];
    cuda::mma::load_a_transposed(a, sdS, lds, warp * 16, kk);
#pragma unroll
    for (int n = 0; n < D / 8; n += 2) {
      uint32_t k_frag[4];
      cuda::mma::load_b_pair<true>(k_frag, sK, ld, kk, n * 8);
      cuda::mma::product(acc_q[n], a, k_frag[0], k_frag[1]);
      cuda::mma::product(acc_q[n + 1], a, k_frag[2], k_frag[3]);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (local[h] >= q.length) continue;
    bf16* row = dq + base + local[h] * q.stride + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      store_pair(row + n * 8, q.alpha * acc_q[n][2 * h], q.alpha * acc_q[n][2 * h + 1], accumulate_q);
  }
  if (bias_partial) {
    warp_column_sums<D>(column_sums + warp * D, acc_q, q.alpha, local, q.length);
    __syncthreads();
    const int64_t batch = gridDim.y / q.heads, c = q.out_stride;
    for (int i = threadIdx.x; i < 3 * D; i += kThreads) {
      const int part = i / D, col = i % D;
      float total = 0.0f;
      for (int w = 0; w < kWarps; ++w) total += column_sums[(part * kWarps + w) * D + col];
      bias_partial[(part * batch + b) * c + (bh % q.heads) * D + col] = total;
    }
  }
  if (kQuant && q.probs_grad)
    cuda::add_grid_scale_gradient(scale_part, q.probs_grad, q.probs_grad_scale, q.probs_partial, q.arrivals);
}

// Shared memory of each kernel (bytes): the forward's Q, K, V tiles; the query side's Q, dO, K, V; the key
// side's K, V and two stages of queries.
template <int D, typename E>
constexpr size_t flash_forward_bytes() {
  return size_t(3 * kFlashRows) * kFlashLd<D, E> * sizeof(E);
}
template <int D, typename E>
constexpr size_t flash_query_bytes() {
  return size_t(4 * kFlashRows) * kFlashLd<D, E> * sizeof(E);
}
template <int D, typename E>
constexpr size_t flash_key_bytes() {
  return size_t(2 * kFlashRows) * kFlashLd<D, E> * sizeof(E) + 2 * QueryStage<D, E>::kBytes;
}

// The same with kFull and kQuant (std::bool_constant) as well: whether T is a multiple of the tile (no
// bounds checks), and whether the probabilities are quantized.
template <typename F>
void with_kernel(int head_size, const Geometry& geometry, F&& f) {
  with_head_size(head_size, [&](auto size) {
    auto quant = [&](auto full) {
      if (geometry.probs_scale)
        f(size, full, std::true_type{});
      else
        f(size, full, std::false_type{});
    };
    if (geometry.length % kFlashRows == 0)
      quant(std::true_type{});
    else
      quant(std::false_type{});
  });
}

}  // namespace

template <typename E>
size_t flash_shared_bytes(int head_size) {
  size_t bytes = 0;
  with_head_size(head_size, [&](auto size) {
    constexpr int D = decltype(size)::value;
    bytes = std::max({flash_forward_bytes<D, E>(), flash_query_bytes<D, E>(), flash_key_bytes<D, E>()});
  });
  return bytes;
}

template <typename E>
void launch_flash_forward(const Graph<float>& g, int head_size, dim3 grid, E* out, E* passed, float* lse, const E* q,
                          const E* k, const E* v, const Geometry& geometry) {
  with_kernel(head_size, geometry, [&](auto size, auto full, auto quant) {
    constexpr int D = decltype(size)::value;
    constexpr size_t bytes = flash_forward_bytes<D, E>();
    const auto kernel = flash_forward<D, decltype(full)::value, decltype(quant)::value, E>;
    allow_shared(kernel, bytes);
    kernel<<<grid, kFlashThreads, bytes, cuda::stream(g)>>>(out, passed, lse, q, k, v, geometry);
    BERT_CUDA_LAUNCHED();
  });
}

template <typename E>
void launch_flash_backward_query(const Graph<float>& g, int head_size, dim3 grid, E* dq, bool accumulate, float* di,
                                 const E* q, const E* k, const E* v, const E* out, const E* dout, const float* lse,
                                 const Geometry& geometry) {
  with_kernel(head_size, geometry, [&](auto size, auto full, auto quant) {
    constexpr int D = decltype(size)::value;
    constexpr size_t bytes = flash_query_bytes<D, E>();
    const auto kernel = flash_backward_query<D, decltype(full)::value, decltype(quant)::value, E>;
    allow_shared(kernel, bytes);
    kernel<<<grid, kFlashThreads, bytes, cuda::stream(g)>>>(dq, accumulate, di, q, k, v, out, dout, lse, geometry);
    BERT_CUDA_LAUNCHED();
  });
}

template <typename E>
void launch_flash_backward_key(const Graph<float>& g, int head_size, dim3 grid, E* dk, bool accumulate_k, E* dv,
                               bool accumulate_v, const E* q, const E* k, const E* v, const E* dout, const float* lse,
                               const float* di, const Geometry& geometry) {
  with_kernel(head_size, geometry, [&](auto size, auto full, auto quant) {
    constexpr int D = decltype(size)::value;
    constexpr size_t bytes = flash_key_bytes<D, E>();
    const auto kernel = flash_backward_key<D, decltype(full)::value, decltype(quant)::value, E>;
    allow_shared(kernel, bytes);
    kernel<<<grid, kFlashThreads, bytes, cuda::stream(g)>>>(dk, accumulate_k, dv, accumulate_v, q, k, v, dout, lse, di,
                                                           geometry);
    BERT_CUDA_LAUNCHED();
  });
}

// The one-kernel backward's tiles of 64 rows for a geometry (1 or 2), or 0 where it does not cover it.
template <typename E>
int fused_tiles(int head_size, const Geometry& geometry) {
  if (!std::is_same_v<E, bf16> || head_size > 64 || geometry.padded > 2 * kFlashRows) return 0;
  return geometry.padded / kFlashRows;
}

template <typename E>
size_t flash_fused_backward_bytes(int head_size, const Geometry& geometry) {
  const int tiles = fused_tiles<E>(head_size, geometry);
  size_t bytes = 0;
  if (tiles)
    with_head_size(head_size, [&](auto size) {
      constexpr int D = decltype(size)::value;
      if constexpr (D <= 64) bytes = tiles == 1 ? FusedLayout<D, 1>::kBytes : FusedLayout<D, 2>::kBytes;
    });
  return bytes;
}

template <typename E>
void launch_flash_backward_fused(const Graph<float>& g, int head_size, int64_t bh, E* dq, bool accumulate_q, E* dk,
                                 bool accumulate_k, E* dv, bool accumulate_v, const E* q, const E* k, const E* v,
                                 const E* out, const E* dout, const float* lse, const Geometry& geometry,
                                 float* bias_partial) {
  const int tiles = fused_tiles<E>(head_size, geometry);
  BERT_CHECK(tiles > 0, "fused attention: the one-kernel backward does not cover this geometry");
  if constexpr (std::is_same_v<E, bf16>) {
    auto run = [&](auto size, auto full, auto tile_count, auto quant) {
      constexpr int D = decltype(size)::value, kTiles = decltype(tile_count)::value;
      using L = FusedLayout<D, kTiles>;
      const auto kernel = flash_backward_fused<D, decltype(full)::value, kTiles, decltype(quant)::value>;
      allow_shared(kernel, L::kBytes);
      kernel<<<dim3(1, unsigned(bh)), L::kThreads, L::kBytes, cuda::stream(g)>>>(
          dq, accumulate_q, dk, accumulate_k, dv, accumulate_v, q, k, v, out, dout, lse, bias_partial, geometry);
      BERT_CUDA_LAUNCHED();
    };
    with_head_size(head_size, [&](auto size) {
      if constexpr (decltype(size)::value <= 64) {
        auto with_quant = [&](auto full, auto tile_count) {
          if (geometry.probs_scale)
            run(size, full, tile_count, std::true_type{});
          else
            run(size, full, tile_count, std::false_type{});
        };
        auto with_tiles = [&](auto full) {
          if (tiles == 1)
            with_quant(full, std::integral_constant<int, 1>{});
          else
            with_quant(full, std::integral_constant<int, 2>{});
        };
        if (geometry.length % kFlashRows == 0)
          with_tiles(std::true_type{});
        else
          with_tiles(std::false_type{});
      }
    });
  }
}

// BF16 steps, and TF32 steps (FP32 operands).
#define BERT_FLASH_KERNELS(E)                                                                                         \
  template size_t flash_shared_bytes<E>(int);                                                                         \
  template void launch_flash_forward<E>(const Graph<float>&, int, dim3, E*, E*, float*, const E*, const E*, const E*, \
                                        const Geometry&);                                                             \
  template void launch_flash_backward_query<E>(const Graph<float>&, int, dim3, E*, bool, float*, const E*, const E*,  \
                                               const E*, const E*, const E*, const float*, const Geometry&);          \
  template void launch_flash_backward_key<E>(const Graph<float>&, int, dim3, E*, bool, E*, bool, const E*, const E*,  \
                                             const E*, const E*, const float*, const float*, const Geometry&);        \
  template size_t flash_fused_backward_bytes<E>(int, const Geometry&);                                                \
  template void launch_flash_backward_fused<E>(const Graph<float>&, int, int64_t, E*, bool, E*, bool, E*, bool,       \
                                               const E*, const E*, const E*, const E*, const E*, const float*,        \
                                               const Geometry&, float*);
BERT_FLASH_KERNELS(bf16)
BERT_FLASH_KERNELS(float)
#undef BERT_FLASH_KERNELS

}  // namespace bert::ops::cuda_impl
