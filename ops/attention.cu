// Fused self-attention on a CUDA device (ops::attention): softmax(alpha q k^T + mask), dropout, times v,
// forward and backward side by side like ops/attention.cpp, whose composition of ops is the
// reference. FlashAttention-style: the (B, H, T, T) scores and probabilities never reach memory; the
// forward saves each row's log-sum-exp and one dropout bit per probability, and the backward recomputes
// the probabilities from them. Q, K, V, the output and their gradients stay in the projections' (B, T, C)
// layout (head h of position t at columns h D .. h D + D - 1), so no permutes run. Dropout draws are
// those the unfused dropout would make on the probabilities (the same counter RNG indices), so fused and
// unfused agree element for element.
//
// Two sets of kernels, each forward with its two backward kernels:
// - BF16 (FlashAttention-2 style): four warps a block, 16 rows a warp; the scores, probabilities and
//   their gradients stay in registers as tensor-core fragments (mma.sync, ops/cuda/mma.cuh) from one
//   product to the next; the forward's softmax is online (running maximum and sum, the output rescaled).
// - FP32 and TF32 steps (FP32 FMAs, so they keep their FP32 arithmetic): each block keeps whole rows of
//   scores in shared memory (lengths up to 512), so the softmax is exact in one pass; 16 x 16 tiles a warp.
//   forward      block = (query tile, b h): S = alpha Q K^T + mask, P = softmax(S), O = dropout(P) V
//   backward dq  block = (query tile, b h): Di = rowsum(dO * O), dP = dO V^T, dS = P (keep dP - Di),
//                dQ = alpha dS K
//   backward dkv block = (key tile, b h): over the query tiles, dV += dropout(P)^T dO, dK += alpha dS^T Q
#include <algorithm>

#include "ops/cuda/common.cuh"
#include "ops/cuda/mma.cuh"
#include "ops/cuda_impl.h"

namespace bert::ops::cuda_impl {

namespace {

using cuda::bf16;
constexpr int kKeyTile = 64;      // keys per tile of K or V in shared memory
constexpr int kMaxLength = 512;   // the FP32 kernels' whole score rows fit in shared memory up to here
// Elements added to each shared row of the FP32 kernels' operands: rows stay 16-byte aligned for vector
// loads and land 4 banks apart (at most 2-way conflicts in the FMA products).
template <typename A>
constexpr int kTilePad = 4;
constexpr int kScorePad = 8;  // floats added to each score row (32-byte aligned rows)

// A warp's 16 x 16 products from shared memory (the FP32 kernels): acc += a (16 x k, row-major, lda) times
// b (k x 16), b row-major (b[k * ldb + c]) or, with TransB, stored transposed (b[c * ldb + k]).
template <typename A>
struct WarpTile;

// FP32: lane l owns row l / 2, columns (l % 2) * 8 .. + 8.
template <>
struct WarpTile<float> {
  struct Acc {
    float v[8];
  };
  static __device__ void zero(Acc& acc) {
    for (float& x : acc.v) x = 0.0f;
  }
  // Four k at a time in 16-byte loads (k, lda, ldb multiples of 4; rows 16-byte aligned).
  template <bool TransB>
  static __device__ void mma(Acc& acc, const float* a, int lda, const float* b, int ldb, int k) {
    const int lane = threadIdx.x % 32, r = lane / 2, c0 = (lane % 2) * 8;
    for (int kk = 0; kk < k; kk += 4) {
      const float4 x = *reinterpret_cast<const float4*>(a + r * lda + kk);
      if constexpr (TransB) {
        for (int j = 0; j < 8; ++j) {
          const float4 y = *reinterpret_cast<const float4*>(b + (c0 + j) * ldb + kk);
          acc.v[j] = fmaf(x.w, y.w, fmaf(x.z, y.z, fmaf(x.y, y.y, fmaf(x.x, y.x, acc.v[j]))));
        }
      } else {
        const float xs[4] = {x.x, x.y, x.z, x.w};
        for (int u = 0; u < 4; ++u) {
          const float4 y0 = *reinterpret_cast<const float4*>(b + (kk + u) * ldb + c0);
          const float4 y1 = *reinterpret_cast<const float4*>(b + (kk + u) * ldb + c0 + 4);
          acc.v[0] = fmaf(xs[u], y0.x, acc.v[0]);
          acc.v[1] = fmaf(xs[u], y0.y, acc.v[1]);
          acc.v[2] = fmaf(xs[u], y0.z, acc.v[2]);
          acc.v[3] = fmaf(xs[u], y0.w, acc.v[3]);
          acc.v[4] = fmaf(xs[u], y1.x, acc.v[4]);
          acc.v[5] = fmaf(xs[u], y1.y, acc.v[5]);
          acc.v[6] = fmaf(xs[u], y1.z, acc.v[6]);
          acc.v[7] = fmaf(xs[u], y1.w, acc.v[7]);
        }
      }
    }
  }
  static __device__ void store(float* out, int ld, const Acc& acc) {
    const int lane = threadIdx.x % 32, r = lane / 2, c0 = (lane % 2) * 8;
    for (int j = 0; j < 8; ++j) out[r * ld + c0 + j] = acc.v[j];
    __syncwarp();
  }
};

__device__ __forceinline__ int64_t lesser(int64_t a, int64_t b) { return a < b ? a : b; }

struct Geometry {
  int64_t heads, length;  // H, T
  int64_t stride;         // elements from one position to the next within a head: H D ((B, T, H, D) operands)
  int rows;               // query rows per block (16 per warp)
  int padded;             // T rounded up to the key tile
  float alpha;
  const float* mask;  // (B, T) additive, or nullptr
  uint64_t seed, first;
  uint32_t threshold;
  float keep_scale;  // 1 / (1 - p)
  bool dropout;
  // Dropout's keep bits, drawn once by the forward: row (bh, i) holds `words` 32-bit words, bit j % 32 of
  // word j / 32 for key j. The backward reads them instead of drawing again.
  uint32_t* bits;
  int words;
};

__device__ __forceinline__ float mask_at(const Geometry& q, int64_t b, int64_t key) {
  return q.mask ? q.mask[b * q.length + key] : 0.0f;
}
// Whether probability (bh, i, j) survives dropout, as the unfused dropout draws it (forward).
__device__ __forceinline__ bool draw_keep(const Geometry& q, int64_t bh, int64_t i, int64_t j) {
  const uint64_t index = q.first + uint64_t((bh * q.length + i) * q.length + j);
  return DropoutDraws::kept(q.seed, index, q.threshold);
}
// The dropout factor of probability (bh, i, j) from the forward's bits: keep_scale or 0 (backward).
__device__ __forceinline__ float keep_factor(const Geometry& q, int64_t bh, int64_t i, int64_t j) {
  if (!q.dropout) return 1.0f;
  const uint32_t word = q.bits[(bh * q.length + i) * q.words + j / 32];
  return (word >> (j % 32)) & 1u ? q.keep_scale : 0.0f;
}

// rows x D of src (rows `stride` apart, rows beyond `valid` as zeros) into shared dst (row stride ld), 16
// bytes at a time (D, stride and ld times sizeof(A) are multiples of 16).
template <int D, typename A>
__device__ void load_rows(A* dst, int ld, const A* src, int64_t stride, int rows, int valid) {
  constexpr int kPerChunk = 16 / sizeof(A), kChunks = D / kPerChunk;
  for (int e = threadIdx.x; e < rows * kChunks; e += blockDim.x) {
    const int r = e / kChunks, c = (e % kChunks) * kPerChunk;
    const uint4 v = r < valid ? *reinterpret_cast<const uint4*>(src + r * stride + c) : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(dst + r * ld + c) = v;
  }
}

// The warp's rows of Q K^T over every key into sS (floats, ld; score() turns them into the softmax's input).
// sQ holds the block's query rows; K is streamed through sKV a tile at a time.
template <int D, typename A>
__device__ void products(const Geometry& q, const A* k, const A* sQ, A* sKV, float* sS, int ld) {
  using Tile = WarpTile<A>;
  const int warp = threadIdx.x / 32;
  constexpr int ldd = D + kTilePad<A>;
  for (int kt = 0; kt < q.padded; kt += kKeyTile) {
    __syncthreads();  // sKV free
    load_rows<D>(sKV, ldd, k + int64_t(kt) * q.stride, q.stride, kKeyTile, int(lesser(kKeyTile, q.length - kt)));
    __syncthreads();
    for (int c = 0; c < kKeyTile / 16; ++c) {
      typename Tile::Acc acc;
      Tile::zero(acc);
      Tile::template mma<true>(acc, sQ + warp * 16 * ldd, ldd, sKV + c * 16 * ldd, ldd, D);
      Tile::store(sS + warp * 16 * ld + kt + c * 16, ld, acc);
    }
  }
  __syncwarp();
}

// A score as the softmax reads it: alpha times the product, plus the mask; keys beyond T at -inf.
__device__ __forceinline__ float score(const Geometry& q, int64_t b, int64_t j, float product) {
  return j < q.length ? product * q.alpha + mask_at(q, b, j) : -INFINITY;
}

// A shared row of floats rewritten in place as A values (the same bytes: BF16 takes the first half):
// every lane reads its values first.
template <typename A>
__device__ void row_to(float* row, const float* values_per_lane, int count) {
  __syncwarp();
  A* out = reinterpret_cast<A*>(row);
  const int lane = threadIdx.x % 32;
  for (int i = 0; i < count; ++i) out[lane + 32 * i] = cuda::from_float<A>(values_per_lane[i]);
  __syncwarp();
}

template <int D, typename A>
__global__ void attention_forward(A* out, float* lse, const A* qp, const A* kp, const A* vp, Geometry q) {
  using Tile = WarpTile<A>;
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int ldd = D + kTilePad<A>;
  const int ld = q.padded + kScorePad;  // floats per score row (P as A values: 2 ld BF16 per row)
  A* sQ = reinterpret_cast<A*>(smem);
  A* sKV = sQ + q.rows * ldd;
  float* sS = reinterpret_cast<float*>(sKV + kKeyTile * ldd);
  float* stage = sS + q.rows * ld;  // 16 x 16 floats per warp
  const int64_t bh = blockIdx.y, b = bh / q.heads, q0 = int64_t(blockIdx.x) * q.rows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t base = (bh / q.heads) * q.length * q.stride + (bh % q.heads) * D;
  load_rows<D>(sQ, ldd, qp + base + q0 * q.stride, q.stride, q.rows, int(lesser(q.rows, q.length - q0)));
  products<D>(q, kp + base, sQ, sKV, sS, ld);
  // Softmax of each of the warp's rows, dropout, and the row back as A values in place.
  constexpr int kMaxPerLane = kMaxLength / 32;
  for (int r = 0; r < 16; ++r) {
    const int64_t i = q0 + warp * 16 + r;
    float* row = sS + (warp * 16 + r) * ld;
    float v[kMaxPerLane];
    const int count = q.padded / 32;
    float max = -INFINITY;
    for (int t = 0; t < count; ++t) max = fmaxf(max, v[t] = score(q, b, lane + 32 * t, row[lane + 32 * t]));
    max = cuda::warp_max(max);
    float sum = 0;
    for (int t = 0; t < count; ++t) sum += v[t] = expf(v[t] - max);
    sum = cuda::warp_sum(sum);
    const float inv = i < q.length ? 1.0f / sum : 0.0f;
    if (q.dropout && i < q.length) {
      for (int t = 0; t < count; ++t) {
        const bool keep = draw_keep(q, bh, i, lane + 32 * t);
        const uint32_t word = __ballot_sync(0xffffffffu, keep);
        if (lane == 0) q.bits[(bh * q.length + i) * q.words + t] = word;
        v[t] *= keep ? inv * q.keep_scale : 0.0f;
      }
    } else {
      for (int t = 0; t < count; ++t) v[t] *= inv;
    }
    row_to<A>(row, v, count);
    if (lane == 0 && i < q.length) lse[bh * q.length + i] = max + logf(sum);
  }
  // O = dropout(P) V, V a tile at a time; the warp's D / 16 output tiles stay in registers.
  const A* sP = reinterpret_cast<const A*>(sS) + warp * 16 * (ld * sizeof(float) / sizeof(A));
  const int ldp = int(ld * sizeof(float) / sizeof(A));
  typename Tile::Acc acc[D / 16];
  for (auto& a : acc) Tile::zero(a);
  for (int kt = 0; kt < q.padded; kt += kKeyTile) {
    __syncthreads();
    load_rows<D>(sKV, ldd, vp + base + int64_t(kt) * q.stride, q.stride, kKeyTile, int(lesser(kKeyTile, q.length - kt)));
    __syncthreads();
    for (int c = 0; c < D / 16; ++c) Tile::template mma<false>(acc[c], sP + kt, ldp, sKV + c * 16, ldd, kKeyTile);
  }
  float* my_stage = stage + warp * 256;
  for (int c = 0; c < D / 16; ++c) {
    Tile::store(my_stage, 16, acc[c]);
    for (int e = lane; e < 256; e += 32) {
      const int64_t i = q0 + warp * 16 + e / 16;
      if (i < q.length) out[base + i * q.stride + c * 16 + e % 16] = cuda::from_float<A>(my_stage[e]);
    }
    __syncwarp();
  }
}

// dQ, and Di = rowsum(dO * O) for the key-side kernel.
template <int D, typename A>
__global__ void attention_backward_query(A* dq, bool accumulate, float* di, const A* qp, const A* kp, const A* vp,
                                         const A* op, const A* dop, const float* lse, Geometry q) {
  using Tile = WarpTile<A>;
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int ldd = D + kTilePad<A>;
  const int ld = q.padded + kScorePad;
  A* sQ = reinterpret_cast<A*>(smem);
  A* sdO = sQ + q.rows * ldd;
  A* sKV = sdO + q.rows * ldd;
  float* sS = reinterpret_cast<float*>(sKV + kKeyTile * ldd);
  float* stage = sS + q.rows * ld;
  const int64_t bh = blockIdx.y, b = bh / q.heads, q0 = int64_t(blockIdx.x) * q.rows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t base = (bh / q.heads) * q.length * q.stride + (bh % q.heads) * D;
  const int valid = int(lesser(q.rows, q.length - q0));
  load_rows<D>(sQ, ldd, qp + base + q0 * q.stride, q.stride, q.rows, valid);
  load_rows<D>(sdO, ldd, dop + base + q0 * q.stride, q.stride, q.rows, valid);
  float* my_stage = stage + warp * 256;
  float* row_di = stage + (q.rows / 16) * 256 + warp * 16;  // Di of the warp's rows
  __syncthreads();
  for (int r = 0; r < 16; ++r) {
    const int64_t i = q0 + warp * 16 + r;
    float s = 0;
    if (i < q.length)
      for (int c = lane; c < D; c += 32)
        s += cuda::to_float(sdO[(warp * 16 + r) * ldd + c]) * cuda::to_float(op[base + i * q.stride + c]);
    s = cuda::warp_sum(s);
    if (lane == 0) row_di[r] = s;
    if (lane == 0 && i < q.length) di[bh * q.length + i] = s;
  }
  __syncwarp();
  products<D>(q, kp + base, sQ, sKV, sS, ld);
  // P from the saved log-sum-exp (rows beyond T: 0).
  for (int r = 0; r < 16; ++r) {
    const int64_t i = q0 + warp * 16 + r;
    const float row_lse = i < q.length ? lse[bh * q.length + i] : INFINITY;
    float* row = sS + (warp * 16 + r) * ld;
    for (int j = lane; j < q.padded; j += 32) row[j] = expf(score(q, b, j, row[j]) - row_lse);
  }
  // dS = P (keep dP - Di) with dP = dO V^T, a key tile at a time.
  for (int kt = 0; kt < q.padded; kt += kKeyTile) {
    __syncthreads();
    load_rows<D>(sKV, ldd, vp + base + int64_t(kt) * q.stride, q.stride, kKeyTile, int(lesser(kKeyTile, q.length - kt)));
    __syncthreads();
    for (int c = 0; c < kKeyTile / 16; ++c) {
      typename Tile::Acc acc;
      Tile::zero(acc);
      Tile::template mma<true>(acc, sdO + warp * 16 * ldd, ldd, sKV + c * 16 * ldd, ldd, D);
      Tile::store(my_stage, 16, acc);
      for (int e = lane; e < 256; e += 32) {
        const int r = e / 16;
        const int64_t i = q0 + warp * 16 + r, j = kt + c * 16 + e % 16;
        float& s = sS[(warp * 16 + r) * ld + j];
        s = (i < q.length && j < q.length) ? s * (my_stage[e] * keep_factor(q, bh, i, j) - row_di[r]) : 0.0f;
      }
      __syncwarp();
    }
  }
  // dS as A values in place, then dQ = alpha dS K.
  constexpr int kMaxPerLane = kMaxLength / 32;
  const int count = q.padded / 32;
  for (int r = 0; r < 16; ++r) {
    float* row = sS + (warp * 16 + r) * ld;
    float v[kMaxPerLane];
    for (int t = 0; t < count; ++t) v[t] = row[lane + 32 * t];
    row_to<A>(row, v, count);
  }
  const A* sdS = reinterpret_cast<const A*>(sS) + warp * 16 * (ld * sizeof(float) / sizeof(A));
  const int ldp = int(ld * sizeof(float) / sizeof(A));
  typename Tile::Acc acc[D / 16];
  for (auto& a : acc) Tile::zero(a);
  for (int kt = 0; kt < q.padded; kt += kKeyTile) {
    __syncthreads();
    load_rows<D>(sKV, ldd, kp + base + int64_t(kt) * q.stride, q.stride, kKeyTile, int(lesser(kKeyTile, q.length - kt)));
    __syncthreads();
    for (int c = 0; c < D / 16; ++c) Tile::template mma<false>(acc[c], sdS + kt, ldp, sKV + c * 16, ldd, kKeyTile);
  }
  for (int c = 0; c < D / 16; ++c) {
    Tile::store(my_stage, 16, acc[c]);
    for (int e = lane; e < 256; e += 32) {
      const int64_t i = q0 + warp * 16 + e / 16;
      if (i < q.length) cuda::store_grad(dq, base + i * q.stride + c * 16 + e % 16, q.alpha * my_stage[e], accumulate);
    }
    __syncwarp();
  }
}

// dK and dV of one key tile (16 keys a warp), over every query tile.
template <int D, typename A>
__global__ void attention_backward_key(A* dk, bool accumulate_k, A* dv, bool accumulate_v, const A* qp, const A* kp,
                                       const A* vp, const A* dop, const float* lse, const float* di, Geometry q) {
  using Tile = WarpTile<A>;
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int ldd = D + kTilePad<A>;
  constexpr int kQueries = 64;                 // query rows per step
  constexpr int ldq = kQueries + kTilePad<A>;     // P^T and dS^T rows (keys) of kQueries queries
  A* sK = reinterpret_cast<A*>(smem);
  A* sV = sK + kKeyTile * ldd;
  A* sQ = sV + kKeyTile * ldd;
  A* sdO = sQ + kQueries * ldd;
  A* sP = sdO + kQueries * ldd;   // dropout(P)^T, keys x queries
  A* sdS = sP + kKeyTile * ldq;   // dS^T
  float* stage = reinterpret_cast<float*>(sdS + kKeyTile * ldq);
  float* s_lse = stage + (kKeyTile / 16) * 512;  // the query step's log-sum-exp and Di
  float* s_di = s_lse + kQueries;
  const int64_t bh = blockIdx.y, b = bh / q.heads, k0 = int64_t(blockIdx.x) * kKeyTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t base = (bh / q.heads) * q.length * q.stride + (bh % q.heads) * D;
  const int keys = int(lesser(kKeyTile, q.length - k0));
  load_rows<D>(sK, ldd, kp + base + k0 * q.stride, q.stride, kKeyTile, keys);
  load_rows<D>(sV, ldd, vp + base + k0 * q.stride, q.stride, kKeyTile, keys);
  float* my_stage = stage + warp * 512;  // two 16 x 16 tiles: S^T and dP^T
  typename Tile::Acc acc_k[D / 16], acc_v[D / 16];
  for (auto& a : acc_k) Tile::zero(a);
  for (auto& a : acc_v) Tile::zero(a);
  for (int64_t qt = 0; qt < q.length; qt += kQueries) {
    __syncthreads();
    const int queries = int(lesser(kQueries, q.length - qt));
    load_rows<D>(sQ, ldd, qp + base + qt * q.stride, q.stride, kQueries, queries);
    load_rows<D>(sdO, ldd, dop + base + qt * q.stride, q.stride, kQueries, queries);
    for (int r = threadIdx.x; r < kQueries; r += blockDim.x) {
      s_lse[r] = r < queries ? lse[bh * q.length + qt + r] : INFINITY;
      s_di[r] = r < queries ? di[bh * q.length + qt + r] : 0.0f;
    }
    __syncthreads();
    for (int c = 0; c < kQueries / 16; ++c) {
      typename Tile::Acc s, dp;
      Tile::zero(s);
      Tile::zero(dp);
      Tile::template mma<true>(s, sK + warp * 16 * ldd, ldd, sQ + c * 16 * ldd, ldd, D);
      Tile::template mma<true>(dp, sV + warp * 16 * ldd, ldd, sdO + c * 16 * ldd, ldd, D);
      Tile::store(my_stage, 16, s);
      Tile::store(my_stage + 256, 16, dp);
      for (int e = lane; e < 256; e += 32) {
        const int r = e / 16, col = c * 16 + e % 16;
        const int64_t j = k0 + warp * 16 + r, i = qt + col;
        float p = 0, ds = 0;
        if (i < q.length && j < q.length) {
          const float prob = expf(my_stage[e] * q.alpha + mask_at(q, b, j) - s_lse[col]);
          const float keep = keep_factor(q, bh, i, j);
          p = prob * keep;
          ds = prob * (my_stage[256 + e] * keep - s_di[col]);
        }
        sP[(warp * 16 + r) * ldq + col] = cuda::from_float<A>(p);
        sdS[(warp * 16 + r) * ldq + col] = cuda::from_float<A>(ds);
      }
      __syncwarp();
    }
    for (int c = 0; c < D / 16; ++c) {
      Tile::template mma<false>(acc_v[c], sP + warp * 16 * ldq, ldq, sdO + c * 16, ldd, kQueries);
      Tile::template mma<false>(acc_k[c], sdS + warp * 16 * ldq, ldq, sQ + c * 16, ldd, kQueries);
    }
  }
  for (int c = 0; c < D / 16; ++c) {
    Tile::store(my_stage, 16, acc_k[c]);
    Tile::store(my_stage + 256, 16, acc_v[c]);
    for (int e = lane; e < 256; e += 32) {
      const int64_t j = k0 + warp * 16 + e / 16, at = base + j * q.stride + c * 16 + e % 16;
      if (j >= q.length) continue;
      cuda::store_grad(dk, at, q.alpha * my_stage[e], accumulate_k);
      cuda::store_grad(dv, at, my_stage[256 + e], accumulate_v);
    }
    __syncwarp();
  }
}

// --- BF16: the tiles in registers between products (mma.sync, ops/cuda/mma.cuh), FlashAttention-2 style.
// A block of four warps takes 64 query rows (forward, dQ) or 64 keys (dK, dV), 16 a warp; the other side
// streams through shared memory 64 rows at a time, copied asynchronously (cp.async) while the previous
// tile is multiplied. Scores, probabilities and their gradients live only in registers (C fragments),
// where they become the A operand of the next product. Exponentials are taken in base 2 (the scores
// scaled by log2 e once). The forward's softmax is online (a running row maximum and sum, the output
// rescaled as the maximum grows); the backward recomputes the probabilities from the saved log-sum-exp,
// exactly normalised, as the FP32 kernels do.
constexpr int kFlashRows = 64;  // rows of every tile: the block's own and each streamed one
constexpr float kLog2e = 1.4426950408889634f;
// Shared row stride: 8 elements past D put the 8 rows an ldmatrix reads in 8 distinct 16-byte bank groups.
template <int D>
constexpr int kFlashLd = D + 8;
// Blocks an SM the register budget is set for: the forward and dQ kernels four up to head size 64 (128
// registers a thread), two beyond; the dK dV kernel, with two accumulators, three up to 32, two beyond
// (at three it would spill).
template <int D>
constexpr int kFlashBlocks = D <= 64 ? 4 : 2;
template <int D>
constexpr int kFlashKeyBlocks = D <= 32 ? 3 : 2;

// The 64 rows from src (a (B, T, H D) operand, rows `stride` apart) into shared dst, rows from `valid`
// on as zeros: asynchronous 16-byte copies, part of the caller's next group.
template <int D>
__device__ __forceinline__ void copy_rows_async(bf16* dst, const bf16* src, int64_t stride, int valid) {
  constexpr int kChunks = D / 8;
  for (int e = threadIdx.x; e < kFlashRows * kChunks; e += blockDim.x) {
    const int r = e / kChunks, c = (e % kChunks) * 8;
    const bool row = r < valid;
    cuda::mma::copy_async<16>(dst + r * kFlashLd<D> + c, src + (row ? r : 0) * stride + c, row);
  }
}

// s (a warp's 16 x 64 tile, 8 C tiles) = the 16 rows of sa from row r0 times the 64 rows of sb (both
// row-major over D: s = a b^T).
template <int D>
__device__ __forceinline__ void product_tile(float (&s)[8][4], const bf16* sa, int r0, const bf16* sb) {
  constexpr int ld = kFlashLd<D>;
  for (auto& c : s)
    for (float& x : c) x = 0.0f;
#pragma unroll
  for (int kk = 0; kk < D; kk += 16) {
    uint32_t a[4];
    cuda::mma::load_a(a, sa, ld, r0, kk);
#pragma unroll
    for (int n = 0; n < 8; n += 2) {
      uint32_t b[4];
      cuda::mma::load_b_pair<false>(b, sb, ld, kk, n * 8);
      cuda::mma::product(s[n], a, b[0], b[1]);
      cuda::mma::product(s[n + 1], a, b[2], b[3]);
    }
  }
}

// acc (16 x D, D / 8 C tiles) += p (16 x 64, as BF16) times sb (64 rows x D, row-major).
template <int D>
__device__ __forceinline__ void accumulate_tile(float (&acc)[D / 8][4], const float (&p)[8][4], const bf16* sb) {
  constexpr int ld = kFlashLd<D>;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
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

// Element e of C tile n of a warp's tile: row half e / 2 (rows g, g + 8), column n * 8 + 2 t + e % 2.
__device__ __forceinline__ int tile_column(int n, int e) { return n * 8 + 2 * (threadIdx.x % 4) + e % 2; }

// The two values of a C tile's row as BF16 at p (4-byte aligned), or added to what p holds.
__device__ __forceinline__ void store_pair(bf16* p, float a, float b, bool accumulate) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  if (accumulate) {
    const __nv_bfloat162 old = *reinterpret_cast<const __nv_bfloat162*>(p);
    v = __floats2bfloat162_rn(__low2float(old) + a, __high2float(old) + b);
  }
  *reinterpret_cast<__nv_bfloat162*>(p) = v;
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
// lie in one row of one quad: lane t hashes row half t / 2's keys n * 8 + 4 (t % 2) .. + 3, and the quad
// hands each lane its bits (one hash a lane a tile instead of four).
__device__ __forceinline__ void draw_tile(const Geometry& q, int64_t bh, const int64_t (&rows)[2], int kt, int n,
                                          uint32_t (&kept)[2]) {
  const int t = threadIdx.x % 4;
  if (q.length % 4 == 0) {
    const int64_t i = t / 2 ? rows[1] : rows[0];
    const uint64_t e = q.first + uint64_t((bh * q.length + i) * q.length + kt + n * 8 + 4 * (t % 2));
    const uint32_t four = DropoutDraws::kept4(q.seed, e / 4, q.threshold);
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

// Dropout on a warp's tile of probabilities (rows `rows`, keys kt .. kt + 63): kept ones times
// keep_scale, the others 0, drawn as the unfused dropout draws them; the keep bits go to q.bits (two words
// a row) for the backward.
__device__ void drop_tile(const Geometry& q, int64_t bh, const int64_t (&rows)[2], int kt, float (&p)[8][4]) {
  uint32_t words[2][2] = {};
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    uint32_t kept[2];
    draw_tile(q, bh, rows, kt, n, kept);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = tile_column(n, e), h = e / 2;
      const bool keep = rows[h] < q.length && kt + c < q.length && (kept[h] >> (e % 2)) & 1u;
      p[n][e] *= keep ? q.keep_scale : 0.0f;
      words[h][n / 4] |= uint32_t(keep) << (c % 32);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    words[h][0] = quad_or(words[h][0]);
    words[h][1] = quad_or(words[h][1]);
    if (rows[h] < q.length && threadIdx.x % 4 == 0) {
      uint32_t* out = q.bits + (bh * q.length + rows[h]) * q.words + kt / 32;
      out[0] = words[h][0];
      out[1] = words[h][1];
    }
  }
}

// Rows of a tile starting at `first`: 64, or what is left of T.
__device__ __forceinline__ int tile_rows(const Geometry& q, int64_t first) {
  return int(lesser(kFlashRows, q.length - first));
}

// The pipeline's two steps. arrive(): this thread's copies but the newest group have landed, and (after
// the barrier) every thread's. refill(): once every warp has read `tile`, the copy of the tile of rows from
// `next` on into its place, if any; a group is committed either way.
__device__ __forceinline__ void arrive() {
  cuda::mma::wait<1>();
  __syncthreads();
}
template <int D>
__device__ __forceinline__ void refill(bf16* tile, const bf16* src, const Geometry& q, int64_t next) {
  __syncthreads();
  if (next < q.padded) copy_rows_async<D>(tile, src + next * q.stride, q.stride, tile_rows(q, next));
  cuda::mma::commit();
}

// Where a BF16 kernel's block and lane sit: item and head (bh, b), the first of the block's 64 rows (query
// rows or keys), the head's offset in a (B, T, H D) operand, the lane's warp and quad roles, and its two
// rows (g and g + 8 of its warp's 16) within the block and in T.
template <int D>
struct FlashBlock {
  int64_t bh, b, first, base;
  int warp, g, t;
  int local[2];
  int64_t rows[2];
  __device__ explicit FlashBlock(const Geometry& q)
      : bh(blockIdx.y),
        b(bh / q.heads),
        first(int64_t(blockIdx.x) * kFlashRows),
        base(b * q.length * q.stride + (bh % q.heads) * D),
        warp(threadIdx.x / 32),
        g(threadIdx.x % 32 / 4),
        t(threadIdx.x % 4),
        local{warp * 16 + g, warp * 16 + g + 8},
        rows{first + local[0], first + local[1]} {}
};

// Copies in flight, in groups (cp.async): Q with the first K, then the first V; then, as each tile's K
// (V) has been read by every warp, the next tile's K (V) into its place. Every step commits a group, empty
// or not, so that wait<1> always means "all but the newest".
template <int D>
__global__ void __launch_bounds__(128, kFlashBlocks<D>)
    flash_forward(bf16* out, float* lse, const bf16* qp, const bf16* kp, const bf16* vp, Geometry q) {
  constexpr int ld = kFlashLd<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sK = sQ + kFlashRows * ld;
  bf16* sV = sK + kFlashRows * ld;
  const auto [bh, b, q0, base, warp, g, t, local, rows] = FlashBlock<D>(q);
  copy_rows_async<D>(sQ, qp + base + q0 * q.stride, q.stride, tile_rows(q, q0));
  copy_rows_async<D>(sK, kp + base, q.stride, tile_rows(q, 0));
  cuda::mma::commit();
  copy_rows_async<D>(sV, vp + base, q.stride, tile_rows(q, 0));
  cuda::mma::commit();
  const float scale = q.alpha * kLog2e;
  float o[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // running row maximum (base 2); this lane's sum
  for (int kt = 0; kt < q.padded; kt += kFlashRows) {
    const int64_t next = kt + kFlashRows;
    arrive();  // this K (and Q)
    float s[8][4];
    product_tile<D>(s, sQ, warp * 16, sK);
    refill<D>(sK, kp + base, q, next);  // sK read by every warp
    float top[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t j = kt + tile_column(n, e);
        s[n][e] = j < q.length ? fmaf(s[n][e], scale, mask_at(q, b, j) * kLog2e) : -INFINITY;
        top[e / 2] = fmaxf(top[e / 2], s[n][e]);
      }
    float rescale[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float next_max = fmaxf(m[h], quad_max(top[h]));  // finite: every tile holds a key below T
      rescale[h] = exp2f(m[h] - next_max);                   // 0 on the first tile
      m[h] = next_max;
      l[h] *= rescale[h];
    }
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) l[e / 2] += s[n][e] = exp2f(s[n][e] - m[e / 2]);
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[n][e] *= rescale[e / 2];
    if (q.dropout) drop_tile(q, bh, rows, kt, s);
    arrive();  // this V
    accumulate_tile<D>(o, s, sV);
    refill<D>(sV, vp + base, q, next);  // sV read by every warp
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = quad_sum(l[h]);
    if (rows[h] >= q.length) continue;
    const float inv = 1.0f / sum;
    bf16* row = out + base + rows[h] * q.stride + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) store_pair(row + n * 8, o[n][2 * h] * inv, o[n][2 * h + 1] * inv, false);
    if (t == 0) lse[bh * q.length + rows[h]] = m[h] / kLog2e + logf(sum);
  }
}

// dQ = alpha dS K over every key tile, dS = P (keep dP - Di), dP = dO V^T; and Di = rowsum(dO * O) of the
// block's rows for the key-side kernel. Copies: Q, dO and the first V, then the first K; then each tile's
// V (K) replaced by the next once read.
template <int D>
__global__ void __launch_bounds__(128, kFlashBlocks<D>)
    flash_backward_query(bf16* dq, bool accumulate, float* di, const bf16* qp, const bf16* kp, const bf16* vp,
                         const bf16* op, const bf16* dop, const float* lse, Geometry q) {
  constexpr int ld = kFlashLd<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sQ = reinterpret_cast<bf16*>(smem);
  bf16* sdO = sQ + kFlashRows * ld;
  bf16* sK = sdO + kFlashRows * ld;
  bf16* sV = sK + kFlashRows * ld;
  const auto [bh, b, q0, base, warp, g, t, local, rows] = FlashBlock<D>(q);
  copy_rows_async<D>(sQ, qp + base + q0 * q.stride, q.stride, tile_rows(q, q0));
  copy_rows_async<D>(sdO, dop + base + q0 * q.stride, q.stride, tile_rows(q, q0));
  copy_rows_async<D>(sV, vp + base, q.stride, tile_rows(q, 0));
  cuda::mma::commit();
  copy_rows_async<D>(sK, kp + base, q.stride, tile_rows(q, 0));
  cuda::mma::commit();
  float row_di[2], row_lse[2];  // row_lse in base 2
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // Di from global memory while the copies run; the quad's lanes take 8 columns in turn
    float s = 0;
    if (rows[h] < q.length)
      for (int c = 8 * t; c < D; c += 32) {
        const cuda::Pack<bf16, 8> x = cuda::load_pack<8>(op + base + rows[h] * q.stride + c);
        const cuda::Pack<bf16, 8> y = cuda::load_pack<8>(dop + base + rows[h] * q.stride + c);
#pragma unroll
        for (int j = 0; j < 8; ++j) s += cuda::to_float(x.v[j]) * cuda::to_float(y.v[j]);
      }
    row_di[h] = quad_sum(s);
    row_lse[h] = rows[h] < q.length ? lse[bh * q.length + rows[h]] * kLog2e : INFINITY;
    if (t == 0 && rows[h] < q.length) di[bh * q.length + rows[h]] = row_di[h];
  }
  const float scale = q.alpha * kLog2e;
  float acc[D / 8][4] = {};
  for (int kt = 0; kt < q.padded; kt += kFlashRows) {
    const int64_t next = kt + kFlashRows;
    uint32_t words[2][2] = {};
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (q.dropout && rows[h] < q.length)
        for (int w = 0; w < 2; ++w) words[h][w] = q.bits[(bh * q.length + rows[h]) * q.words + kt / 32 + w];
    arrive();  // this V (and Q, dO)
    float s[8][4], dp[8][4];
    product_tile<D>(dp, sdO, warp * 16, sV);
    refill<D>(sV, vp + base, q, next);  // sV read by every warp
    arrive();                           // this K
    product_tile<D>(s, sQ, warp * 16, sK);
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = tile_column(n, e), h = e / 2;
        const int64_t j = kt + c;
        float ds = 0.0f;
        if (rows[h] < q.length && j < q.length) {
          const float p = exp2f(fmaf(s[n][e], scale, fmaf(mask_at(q, b, j), kLog2e, -row_lse[h])));
          const float keep = !q.dropout ? 1.0f : (words[h][n / 4] >> (c % 32)) & 1u ? q.keep_scale : 0.0f;
          ds = p * (dp[n][e] * keep - row_di[h]);
        }
        s[n][e] = ds;
      }
    accumulate_tile<D>(acc, s, sK);
    refill<D>(sK, kp + base, q, next);  // sK read by every warp
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (rows[h] >= q.length) continue;
    bf16* row = dq + base + rows[h] * q.stride + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      store_pair(row + n * 8, q.alpha * acc[n][2 * h], q.alpha * acc[n][2 * h + 1], accumulate);
  }
}

// One query tile as the key-side kernel reads it: Q and dO rows, and per query its log-sum-exp, Di and the
// two keep-bit words of the block's keys.
template <int D>
struct QueryStage {
  bf16* q;
  bf16* dout;
  float* lse;
  float* di;
  uint32_t* bits;
  static constexpr size_t kBytes = size_t(2 * kFlashRows) * kFlashLd<D> * sizeof(bf16) + 4 * kFlashRows * sizeof(float);
  __device__ explicit QueryStage(unsigned char* at)
      : q(reinterpret_cast<bf16*>(at)),
        dout(q + kFlashRows * kFlashLd<D>),
        lse(reinterpret_cast<float*>(dout + kFlashRows * kFlashLd<D>)),
        di(lse + kFlashRows),
        bits(reinterpret_cast<uint32_t*>(di + kFlashRows)) {}
  // Asynchronous copies of the tile starting at query qt (the caller commits them).
  __device__ void copy(const Geometry& g, int64_t bh, int64_t base, int64_t qt, int64_t k0, const bf16* qp,
                       const bf16* dop, const float* lse_in, const float* di_in) {
    const int queries = tile_rows(g, qt);
    copy_rows_async<D>(q, qp + base + qt * g.stride, g.stride, queries);
    copy_rows_async<D>(dout, dop + base + qt * g.stride, g.stride, queries);
    for (int r = threadIdx.x; r < kFlashRows; r += blockDim.x) {
      const bool row = r < queries;
      const int64_t at = bh * g.length + qt + (row ? r : 0);
      cuda::mma::copy_async<4>(lse + r, lse_in + at, row);
      cuda::mma::copy_async<4>(di + r, di_in + at, row);
      if (g.dropout) cuda::mma::copy_async<8>(bits + 2 * r, g.bits + at * g.words + k0 / 32, row);
    }
  }
};

// dK = alpha dS^T Q and dV = dropout(P)^T dO of the block's 64 keys, over every query tile; the query tiles
// in two stages, the next one copied while this one is multiplied.
template <int D>
__global__ void __launch_bounds__(128, kFlashKeyBlocks<D>)
    flash_backward_key(bf16* dk, bool accumulate_k, bf16* dv, bool accumulate_v, const bf16* qp, const bf16* kp,
                       const bf16* vp, const bf16* dop, const float* lse, const float* di, Geometry q) {
  constexpr int ld = kFlashLd<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sK = reinterpret_cast<bf16*>(smem);
  bf16* sV = sK + kFlashRows * ld;
  unsigned char* stages = reinterpret_cast<unsigned char*>(sV + kFlashRows * ld);
  auto stage = [stages](int i) { return QueryStage<D>(stages + i * QueryStage<D>::kBytes); };
  const auto [bh, b, k0, base, warp, g, t, local, keys] = FlashBlock<D>(q);  // the lane's keys: local, keys
  copy_rows_async<D>(sK, kp + base + k0 * q.stride, q.stride, tile_rows(q, k0));
  copy_rows_async<D>(sV, vp + base + k0 * q.stride, q.stride, tile_rows(q, k0));
  stage(0).copy(q, bh, base, 0, k0, qp, dop, lse, di);
  cuda::mma::commit();
  float key_mask[2];  // base 2
#pragma unroll
  for (int h = 0; h < 2; ++h) key_mask[h] = keys[h] < q.length ? mask_at(q, b, keys[h]) * kLog2e : 0.0f;
  const float scale = q.alpha * kLog2e;
  float acc_k[D / 8][4] = {}, acc_v[D / 8][4] = {};
  int at = 0;
  for (int64_t qt = 0; qt < q.length; qt += kFlashRows, at ^= 1) {
    if (qt + kFlashRows < q.length) stage(at ^ 1).copy(q, bh, base, qt + kFlashRows, k0, qp, dop, lse, di);
    cuda::mma::commit();
    arrive();  // this stage (and K, V)
    const QueryStage<D> s_q = stage(at);
    const int queries = tile_rows(q, qt);
    float s[8][4], dp[8][4];  // S^T and dP^T: the warp's 16 keys by 64 queries
    product_tile<D>(s, sK, warp * 16, s_q.q);
    product_tile<D>(dp, sV, warp * 16, s_q.dout);
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
        if (c < queries && keys[h] < q.length) {
          const float query_lse = e % 2 ? row_lse.y : row_lse.x, query_di = e % 2 ? row_di.y : row_di.x;
          const float prob = exp2f(fmaf(s[n][e], scale, fmaf(-query_lse, kLog2e, key_mask[h])));
          const uint32_t word = e % 2 ? (local[h] < 32 ? words.z : words.w) : (local[h] < 32 ? words.x : words.y);
          const float keep = !q.dropout ? 1.0f : (word >> (local[h] % 32)) & 1u ? q.keep_scale : 0.0f;
          p = prob * keep;
          ds = prob * (dp[n][e] * keep - query_di);
        }
        s[n][e] = p;
        dp[n][e] = ds;
      }
    }
    accumulate_tile<D>(acc_v, s, s_q.dout);
    accumulate_tile<D>(acc_k, dp, s_q.q);
    __syncthreads();  // the stage read by every warp before the next step copies into it
  }
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

// Shared memory of the BF16 kernels (bytes).
template <int D>
constexpr size_t flash_forward_bytes() {
  return size_t(3 * kFlashRows) * kFlashLd<D> * sizeof(bf16);
}
template <int D>
constexpr size_t flash_backward_bytes() {  // either backward kernel (the key side's is the larger)
  return size_t(2 * kFlashRows) * kFlashLd<D> * sizeof(bf16) + 2 * QueryStage<D>::kBytes;
}

// Shared memory of each FP32 kernel (bytes) for query rows `rows` a block.
template <int D, typename A>
size_t forward_bytes(int rows, int padded) {
  return (size_t(rows + kKeyTile) * (D + kTilePad<A>)) * sizeof(A) +
         (size_t(rows) * (padded + kScorePad) + size_t(rows / 16) * 256) * sizeof(float);
}
template <int D, typename A>
size_t backward_query_bytes(int rows, int padded) {
  return (size_t(2 * rows + kKeyTile) * (D + kTilePad<A>)) * sizeof(A) +
         (size_t(rows) * (padded + kScorePad) + size_t(rows / 16) * 256 + size_t(rows)) * sizeof(float);
}
template <int D, typename A>
size_t backward_key_bytes() {
  return (size_t(4 * kKeyTile) * (D + kTilePad<A>) + size_t(2 * kKeyTile) * (64 + kTilePad<A>)) * sizeof(A) +
         (size_t(kKeyTile / 16) * 512 + 2 * 64) * sizeof(float);
}

// Query rows a block (64, 32 or 16) whose shared memory fits the device.
template <int D, typename A>
int rows_that_fit(int padded, size_t limit) {
  for (int rows : {64, 32, 16})
    if (forward_bytes<D, A>(rows, padded) <= limit && backward_query_bytes<D, A>(rows, padded) <= limit) return rows;
  return 0;
}

size_t shared_limit() {
  int device = 0, bytes = 0;
  BERT_CUDA_CHECK(cudaGetDevice(&device));
  BERT_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return size_t(bytes);
}

template <typename Kernel>
void allow_shared(Kernel kernel, size_t bytes) {
  BERT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

// The forward and its backward: the BF16 kernels for BF16 activations (A = bf16), else the FP32 ones.
template <int D, typename A>
Var fused(Graph<float>& g, Var qv, Var kv, Var vv, Geometry geometry, int64_t batch, DType dtype) {
  constexpr bool kBf16 = std::is_same_v<A, bf16>;
  const int64_t bh = batch * geometry.heads, t = geometry.length;
  Geometry q = geometry;
  q.rows = kBf16 ? kFlashRows : rows_that_fit<D, A>(q.padded, shared_limit());
  Var out = g.emit(g.shape(qv), {qv, kv, vv}, dtype);
  float* lse = g.scratch<float>(size_t(bh * t));
  const dim3 query_grid(unsigned((t + q.rows - 1) / q.rows), unsigned(bh));
  const A *qp = cuda::typed<A>(g.data(qv)), *kp = cuda::typed<A>(g.data(kv)), *vp = cuda::typed<A>(g.data(vv));
  if constexpr (kBf16) {
    allow_shared(flash_forward<D>, flash_forward_bytes<D>());
    flash_forward<D><<<query_grid, 128, flash_forward_bytes<D>(), cuda::stream(g)>>>(cuda::typed<A>(g.data(out)), lse,
                                                                                     qp, kp, vp, q);
  } else {
    const size_t fwd = forward_bytes<D, A>(q.rows, q.padded);
    allow_shared(attention_forward<D, A>, fwd);
    attention_forward<D, A>
        <<<query_grid, 32 * (q.rows / 16), fwd, cuda::stream(g)>>>(cuda::typed<A>(g.data(out)), lse, qp, kp, vp, q);
  }
  BERT_CUDA_LAUNCHED();
  g.on_backward(out, [qv, kv, vv, out, lse, q, bh, t, query_grid](Graph<float>& g) {
    const A *qp = cuda::typed<A>(g.data(qv)), *kp = cuda::typed<A>(g.data(kv)), *vp = cuda::typed<A>(g.data(vv));
    const A *op = cuda::typed<A>(g.data(out)), *dop = cuda::typed<A>(g.grad_data(out));
    float* di = g.scratch<float>(size_t(bh * t));
    // A gradient target for each input that takes one (scratch for one that does not: the kernels write
    // dQ, dK and dV together).
    auto target = [&](Var x) {
      return g.requires_grad(x) ? g.raw_grad_target(x)
                                : Graph<float>::RawGradTarget{g.scratch<A>(size_t(bh * t * D)), false};
    };
    const Graph<float>::RawGradTarget dq = target(qv);
    if constexpr (kBf16) {
      allow_shared(flash_backward_query<D>, flash_backward_bytes<D>());
      flash_backward_query<D><<<query_grid, 128, flash_backward_bytes<D>(), cuda::stream(g)>>>(
          cuda::typed<A>(dq.data), dq.accumulate, di, qp, kp, vp, op, dop, lse, q);
    } else {
      const size_t query_bytes = backward_query_bytes<D, A>(q.rows, q.padded);
      allow_shared(attention_backward_query<D, A>, query_bytes);
      attention_backward_query<D, A><<<query_grid, 32 * (q.rows / 16), query_bytes, cuda::stream(g)>>>(
          cuda::typed<A>(dq.data), dq.accumulate, di, qp, kp, vp, op, dop, lse, q);
    }
    BERT_CUDA_LAUNCHED();
    if (!g.requires_grad(kv) && !g.requires_grad(vv)) return;
    const Graph<float>::RawGradTarget dk = target(kv), dv = target(vv);
    const dim3 key_grid(unsigned((t + kKeyTile - 1) / kKeyTile), unsigned(bh));
    if constexpr (kBf16) {
      allow_shared(flash_backward_key<D>, flash_backward_bytes<D>());
      flash_backward_key<D><<<key_grid, 128, flash_backward_bytes<D>(), cuda::stream(g)>>>(
          cuda::typed<A>(dk.data), dk.accumulate, cuda::typed<A>(dv.data), dv.accumulate, qp, kp, vp, dop, lse, di, q);
    } else {
      const size_t key_bytes = backward_key_bytes<D, A>();
      allow_shared(attention_backward_key<D, A>, key_bytes);
      attention_backward_key<D, A><<<key_grid, 32 * (kKeyTile / 16), key_bytes, cuda::stream(g)>>>(
          cuda::typed<A>(dk.data), dk.accumulate, cuda::typed<A>(dv.data), dv.accumulate, qp, kp, vp, dop, lse, di, q);
    }
    BERT_CUDA_LAUNCHED();
  });
  return out;
}

}  // namespace

bool attention_fits(int64_t head_size, int64_t length, DType dtype) {
  if (length < 1 || length > kMaxLength) return false;
  if (head_size != 16 && head_size != 32 && head_size != 64 && head_size != 128) return false;
  const int padded = int((length + kKeyTile - 1) / kKeyTile * kKeyTile);
  const size_t limit = shared_limit();
  auto fits = [&](auto size) {
    constexpr int D = decltype(size)::value;
    if (dtype == DType::kBF16) return std::max(flash_forward_bytes<D>(), flash_backward_bytes<D>()) <= limit;
    return rows_that_fit<D, float>(padded, limit) > 0 && backward_key_bytes<D, float>() <= limit;
  };
  switch (head_size) {
    case 16:
      return fits(std::integral_constant<int, 16>{});
    case 32:
      return fits(std::integral_constant<int, 32>{});
    case 64:
      return fits(std::integral_constant<int, 64>{});
    default:
      return fits(std::integral_constant<int, 128>{});
  }
}

Var attention(Graph<float>& g, Var q, Var k, Var v, Var mask, int64_t heads, double alpha, double p, bool training,
              Rng& rng) {
  const Shape s = g.shape(q);
  BERT_CHECK(s.rank() == 3 && g.shape(k) == s && g.shape(v) == s && heads > 0 && s[2] % heads == 0,
             "attention: q " + s.str() + ", k " + g.shape(k).str() + ", v " + g.shape(v).str() + " (expected (B, T, C) " +
                 "each, C a multiple of " + std::to_string(heads) + " heads)");
  const int64_t d = s[2] / heads;
  const DType dtype = g.activation_dtype();
  BERT_CHECK(attention_fits(d, s[1], dtype),
             "attention: no fused kernel for head size " + std::to_string(d) + " and length " + std::to_string(s[1]));
  if (mask.valid())
    BERT_CHECK(g.shape(mask) == Shape({s[0], s[1]}) && g.dtype(mask) == DType::kF32,
               "attention: mask " + g.shape(mask).str() + " (expected (B, T) floats)");
  q = as_activation(g, q);
  k = as_activation(g, k);
  v = as_activation(g, v);
  Geometry geometry{};
  geometry.heads = heads;
  geometry.length = s[1];
  geometry.stride = s[2];
  geometry.padded = int((s[1] + kKeyTile - 1) / kKeyTile * kKeyTile);
  geometry.alpha = static_cast<float>(alpha);
  geometry.mask = mask.valid() ? static_cast<const float*>(g.data(mask)) : nullptr;
  geometry.dropout = training && p > 0.0;
  if (geometry.dropout) {
    const int64_t rows = s[0] * heads * s[1];  // B H T rows of T probabilities
    geometry.seed = rng.state().seed;
    geometry.first = DropoutDraws::reserve(rng, static_cast<uint64_t>(rows * s[1]));
    geometry.threshold = DropoutDraws::threshold(p);
    geometry.keep_scale = static_cast<float>(1.0 / (1.0 - p));
    geometry.words = geometry.padded / 32;
    geometry.bits = g.scratch<uint32_t>(size_t(rows * geometry.words));
  }
  Var out;
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    switch (d) {
      case 16:
        out = fused<16, A>(g, q, k, v, geometry, s[0], dtype);
        break;
      case 32:
        out = fused<32, A>(g, q, k, v, geometry, s[0], dtype);
        break;
      case 64:
        out = fused<64, A>(g, q, k, v, geometry, s[0], dtype);
        break;
      default:
        out = fused<128, A>(g, q, k, v, geometry, s[0], dtype);
    }
  });
  return out;
}

}  // namespace bert::ops::cuda_impl
