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
// - BF16 and TF32 steps (FlashAttention-2 style, in ops/attention_flash.cu): four warps a block, 16 rows a
//   warp; the scores, probabilities and their gradients stay in registers as tensor-core fragments
//   (mma.sync, ops/cuda/mma.cuh) from one product to the next; the forward's softmax is online (running
//   maximum and sum, the output rescaled). TF32 steps where a GPU's shared memory holds their FP32 tiles
//   (head size 128 needs 205 KB a block), else the FP32 kernels below.
// - FP32 steps (FP32 FMAs, so they keep their FP32 arithmetic): each block keeps whole rows of scores in
//   shared memory (lengths up to 512), so the softmax is exact in one pass; 16 x 16 tiles a warp.
//   forward      block = (query tile, b h): S = alpha Q K^T + mask, P = softmax(S), O = dropout(P) V
//   backward dq  block = (query tile, b h): Di = rowsum(dO * O), dP = dO V^T, dS = P (keep dP - Di),
//                dQ = alpha dS K
//   backward dkv block = (key tile, b h): over the query tiles, dV += dropout(P)^T dO, dK += alpha dS^T Q
#include <algorithm>
#include <array>

#include "ops/cuda/attention.cuh"
#include "ops/cuda/common.cuh"
#include "ops/cuda/fake_quantize.cuh"
#include "ops/cuda/gemm.cuh"
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
  const int64_t obase = (bh / q.heads) * q.length * q.out_stride + (bh % q.heads) * D;  // in O and dO
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
      if (i < q.length) out[obase + i * q.out_stride + c * 16 + e % 16] = cuda::from_float<A>(my_stage[e]);
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
  const int64_t obase = (bh / q.heads) * q.length * q.out_stride + (bh % q.heads) * D;  // in O and dO
  const int valid = int(lesser(q.rows, q.length - q0));
  load_rows<D>(sQ, ldd, qp + base + q0 * q.stride, q.stride, q.rows, valid);
  load_rows<D>(sdO, ldd, dop + obase + q0 * q.out_stride, q.out_stride, q.rows, valid);
  float* my_stage = stage + warp * 256;
  float* row_di = stage + (q.rows / 16) * 256 + warp * 16;  // Di of the warp's rows
  __syncthreads();
  for (int r = 0; r < 16; ++r) {
    const int64_t i = q0 + warp * 16 + r;
    float s = 0;
    if (i < q.length)
      for (int c = lane; c < D; c += 32)
        s += cuda::to_float(sdO[(warp * 16 + r) * ldd + c]) * cuda::to_float(op[obase + i * q.out_stride + c]);
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
  const int64_t obase = (bh / q.heads) * q.length * q.out_stride + (bh % q.heads) * D;  // in O and dO
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
    load_rows<D>(sdO, ldd, dop + obase + qt * q.out_stride, q.out_stride, kQueries, queries);
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

size_t shared_limit(const Graph<float>& g) { return cuda::context(g.device()).shared_optin; }

// Whether the tensor-core kernels (ops/attention_flash.cu) run for A on g: always for BF16; for FP32
// operands in a TF32 step where their tiles fit the GPU's shared memory.
template <int D, typename A>
bool flash(const Graph<float>& g) {
  if constexpr (std::is_same_v<A, bf16>) return true;
  return g.device().precision() == Precision::kTf32 && flash_shared_bytes<float>(D) <= shared_limit(g);
}

// The forward's kernel: out and each row's log-sum-exp from Q, K, V (the tensor-core kernels where flash()
// says so, else the FP32 ones; `passed` as launch_flash_forward's, tensor-core kernels only). q.rows set,
// grid (query tiles, B H).
template <int D, typename A>
void forward_kernels(const Graph<float>& g, const Geometry& q, dim3 query_grid, A* out, A* passed, float* lse,
                     const A* qp, const A* kp, const A* vp) {
  if (flash<D, A>(g)) {
    launch_flash_forward(g, D, query_grid, out, passed, lse, qp, kp, vp, q);
    return;
  }
  if constexpr (!std::is_same_v<A, bf16>) {
    (void)passed;
    const size_t fwd = forward_bytes<D, A>(q.rows, q.padded);
    allow_shared(attention_forward<D, A>, fwd);
    attention_forward<D, A><<<query_grid, 32 * (q.rows / 16), fwd, cuda::stream(g)>>>(out, lse, qp, kp, vp, q);
  }
  BERT_CUDA_LAUNCHED();
}

// Where the backward's kernels write the gradients of Q, K and V (each added into where accumulate is set).
// bias_partial: where the one-kernel backward may sum dQ, dK and dV for the projections' biases
// (launch_flash_backward_fused), or nullptr.
template <typename A>
struct AttentionGrads {
  A *dq = nullptr, *dk = nullptr, *dv = nullptr;
  bool accumulate_q = false, accumulate_k = false, accumulate_v = false;
  float* bias_partial = nullptr;
};

// The backward's two kernels: dQ, then dK and dV (skipped when `keys` is false); or the one-kernel backward
// where it covers the geometry: true then (d.bias_partial holds the column sums where it was set).
template <int D, typename A>
bool backward_kernels(Graph<float>& g, const Geometry& q, dim3 query_grid, int64_t bh, int64_t t,
                      const AttentionGrads<A>& d, bool keys, const A* qp, const A* kp, const A* vp, const A* op,
                      const A* dop, const float* lse) {
  const bool tensor_cores = flash<D, A>(g);
  const size_t fused = tensor_cores && keys ? flash_fused_backward_bytes<A>(D, q) : 0;
  if (fused && fused <= shared_limit(g)) {
    launch_flash_backward_fused(g, D, bh, d.dq, d.accumulate_q, d.dk, d.accumulate_k, d.dv, d.accumulate_v, qp, kp, vp,
                                op, dop, lse, q, d.bias_partial);
    return true;
  }
  float* di = g.scratch<float>(size_t(bh * t));
  if (tensor_cores) {
    launch_flash_backward_query(g, D, query_grid, d.dq, d.accumulate_q, di, qp, kp, vp, op, dop, lse, q);
  } else if constexpr (!std::is_same_v<A, bf16>) {
    const size_t query_bytes = backward_query_bytes<D, A>(q.rows, q.padded);
    allow_shared(attention_backward_query<D, A>, query_bytes);
    attention_backward_query<D, A><<<query_grid, 32 * (q.rows / 16), query_bytes, cuda::stream(g)>>>(
        d.dq, d.accumulate_q, di, qp, kp, vp, op, dop, lse, q);
  }
  BERT_CUDA_LAUNCHED();
  if (!keys) return false;
  const dim3 key_grid(unsigned((t + kKeyTile - 1) / kKeyTile), unsigned(bh));
  if (tensor_cores) {
    launch_flash_backward_key(g, D, key_grid, d.dk, d.accumulate_k, d.dv, d.accumulate_v, qp, kp, vp, dop, lse, di, q);
  } else if constexpr (!std::is_same_v<A, bf16>) {
    const size_t key_bytes = backward_key_bytes<D, A>();
    allow_shared(attention_backward_key<D, A>, key_bytes);
    attention_backward_key<D, A><<<key_grid, 32 * (kKeyTile / 16), key_bytes, cuda::stream(g)>>>(
        d.dk, d.accumulate_k, d.dv, d.accumulate_v, qp, kp, vp, dop, lse, di, q);
  }
  BERT_CUDA_LAUNCHED();
  return false;
}

template <int D, typename A>
Geometry with_rows(const Graph<float>& g, Geometry q) {
  q.rows = flash<D, A>(g) ? kFlashRows : rows_that_fit<D, A>(q.padded, shared_limit(g));
  return q;
}

// The forward and its backward on three (B, T, C) nodes, with the probabilities' quantizer where `probs` is
// given (tensor-core kernels only): its scale is then an input of the output, which takes its gradient.
template <int D, typename A>
Var fused(Graph<float>& g, Var qv, Var kv, Var vv, Geometry geometry, int64_t batch, DType dtype,
          const QuantizeOutput* probs) {
  const int64_t bh = batch * geometry.heads, t = geometry.length;
  Var scale;
  if (probs) {
    BERT_CHECK((flash<D, A>(g)),
               "attention: the probabilities' quantizer runs in the BF16 and TF32 tensor-core kernels only");
    const cuda::QuantizeLaunch launch = cuda::fused_launch(g, *probs, bh * t * t);
    scale = probs->scale;
    geometry.probs_scale = launch.scale;
    geometry.probs_lo = launch.lo, geometry.probs_hi = launch.hi;
    geometry.probs_clipped = reinterpret_cast<unsigned long long*>(launch.clipped);
    geometry.probs_grad_scale = launch.grad_scale;
    geometry.arrivals = cuda::context(g.device()).arrivals;
  }
  const Geometry q = with_rows<D, A>(g, geometry);
  Var out = probs ? g.emit(g.shape(qv), {qv, kv, vv, scale}, dtype) : g.emit(g.shape(qv), {qv, kv, vv}, dtype);
  float* lse = g.scratch<float>(size_t(bh * t));
  A* passed = probs ? g.scratch<A>(size_t(bh * t * D)) : nullptr;  // (B, T, C) as out
  const dim3 query_grid(unsigned((t + q.rows - 1) / q.rows), unsigned(bh));
  forward_kernels<D, A>(g, q, query_grid, cuda::typed<A>(g.data(out)), passed, lse, cuda::typed<A>(g.data(qv)),
                        cuda::typed<A>(g.data(kv)), cuda::typed<A>(g.data(vv)));
  g.on_backward(out, [qv, kv, vv, out, scale, passed, lse, q, bh, t, query_grid](Graph<float>& g) {
    // A gradient target for each input that takes one (scratch for one that does not: the kernels write
    // dQ, dK and dV together).
    auto target = [&](Var x) {
      return g.requires_grad(x) ? g.raw_grad_target(x)
                                : Graph<float>::RawGradTarget{g.scratch<A>(size_t(bh * t * D)), false};
    };
    AttentionGrads<A> d;
    const Graph<float>::RawGradTarget dq = target(qv);
    d.dq = cuda::typed<A>(dq.data), d.accumulate_q = dq.accumulate;
    Geometry backward = q;  // with the scale gradient's destination, where the scale takes one
    if (scale.valid() && g.requires_grad(scale)) {
      backward.probs_grad = g.grad(scale).data();
      const int64_t key_blocks = (t + kKeyTile - 1) / kKeyTile * bh;
      backward.probs_partial = key_blocks > 1 ? g.scratch<double>(size_t(key_blocks)) : nullptr;
    }
    // The key side runs for the scale's gradient too.
    const bool keys = g.requires_grad(kv) || g.requires_grad(vv) || backward.probs_grad;
    if (keys) {
      const Graph<float>::RawGradTarget dk = target(kv), dv = target(vv);
      d.dk = cuda::typed<A>(dk.data), d.accumulate_k = dk.accumulate;
      d.dv = cuda::typed<A>(dv.data), d.accumulate_v = dv.accumulate;
    }
    // Di's operand: the output, or with the quantizer what it passes (launch_flash_forward).
    const A* di_operand = passed ? passed : cuda::typed<A>(g.data(out));
    backward_kernels<D, A>(g, backward, query_grid, bh, t, d, keys, cuda::typed<A>(g.data(qv)),
                           cuda::typed<A>(g.data(kv)), cuda::typed<A>(g.data(vv)), di_operand,
                           cuda::typed<A>(g.grad_data(out)), lse);
  });
  return out;
}

// The step's equally spaced pointers: p[i] = p[0] + i stride for a stride > 0 (elements), else 0.
template <typename P>
int64_t spacing(const std::array<P*, 3>& p) {
  const int64_t stride = p[1] - p[0];
  return stride > 0 && p[2] - p[1] == stride ? stride : 0;
}

// The three projections of x (N rows of C) side by side as one (B, T, 3C) node (each position's Q, K and
// V in a row): one batched GEMM where the weights (and biases) lie equally spaced, else three. The
// backward takes the node's gradient (N, 3C): x's as one GEMM of it with the three weights stacked (3C, C)
// (in place where the weights lie side by side, as the model declares them and as fake_quantize_many
// makes them, else three copies); the weights' as one GEMM where their gradients lie side by side (or,
// fresh, into a transient buffer and then copied) and C is small or the operands FP32, else one batched
// GEMM where they lie equally spaced, else three; the biases' as one column sum over the three parts where
// their gradients lie equally spaced too.
template <typename A>
Var projections_of(Graph<float>& g, Var x, const std::array<Var, 3>& w, const std::array<Var, 3>& b, int64_t batch,
                   int64_t t, DType dtype, const ProjectionScales* integers = nullptr) {
  constexpr cudaDataType_t type = cuda::cuda_data_type<A>();
  const int64_t c = g.shape(x)[-1], n = batch * t;
  std::array<const A*, 3> wp{}, bp{};
  for (int i = 0; i < 3; ++i) wp[i] = gemm_operand<A>(g, w[i], c, c, c), bp[i] = gemm_operand<A>(g, b[i], c, c, 1);
  const Var projections = g.emit(Shape{batch, t, 3 * c}, {x, w[0], b[0], w[1], b[1], w[2], b[2]}, dtype);
  A* qkv = cuda::typed<A>(g.data(projections));
  const A* xv = cuda::typed<A>(g.data(x));
  const int64_t w_stride = spacing(wp), b_stride = spacing(bp);
  // QAT's forward on the integers behind x and the weights (quantized_linear_product), else float GEMMs.
  bool done = false;
  if (integers) {
    std::array<QuantizedWeights<A>, 3> parts;
    for (int i = 0; i < 3; ++i)
      parts[i] = {wp[i], g.value(integers->weights[i]).data(), g.value(b[i]).data(), c, g.integers(w[i])};
    done =
        quantized_linear_product<A>(g, xv, g.integers(x), g.value(integers->input).data(), std::span(parts), qkv, n, c);
  }
  if (!done &&
      !(w_stride && b_stride && gemm_bias(g, n, c, c, xv, wp[0], bp[0], qkv, 3 * c, type, 3, w_stride, b_stride, c)))
    for (int i = 0; i < 3; ++i)
      linear_product(g, n, c, c, xv, wp[i], bp[i], g.value(b[i]).data(), c, qkv + i * c, 3 * c, type);
  g.on_backward(projections, [=](Graph<float>& g) {
    const A* dqkv = cuda::typed<A>(g.grad_data(projections));
    const CudaContext& context = cuda::context(g.device());
    if (g.requires_grad(x)) {  // dx (+)= [dQ dK dV] (N, 3C) [Wq; Wk; Wv] (3C, C)
      const A* stacked = wp[0];  // the weights side by side, else copies
      if (w_stride != c * c) {
        A* copies = g.scratch<A>(size_t(3 * c * c));
        for (int i = 0; i < 3; ++i) cuda::copy_on_device(context, copies + i * c * c, wp[i], c * c * sizeof(A));
        stacked = copies;
      }
      const auto dx = g.raw_grad_target(x);
      gemm(g, false, false, n, c, 3 * c, 1.0f, dqkv, 3 * c, 0, stacked, c, 0, dx.accumulate ? 1.0f : 0.0f, dx.data, c,
           0, 1, type, type);
    }
    // dW_i (+)= dY_i^T x, in the weights' own type (F32 parameters, or BF16 quantized weights).
    std::array<Graph<float>::RawGradTarget, 3> dw{};
    std::array<const std::byte*, 3> dw_bytes{};
    bool weights = true, same = true;
    for (int i = 0; i < 3; ++i) {
      if (!g.requires_grad(w[i])) {
        weights = false;
        continue;
      }
      dw[i] = g.raw_grad_target(w[i]);
      dw_bytes[i] = static_cast<const std::byte*>(dw[i].data);
      same = same && dw[i].accumulate == dw[0].accumulate && g.dtype(w[i]) == g.dtype(w[0]);
    }
    auto w_type = [&](int i) { return g.dtype(w[i]) == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F; };
    const int64_t w_size = int64_t(dtype_size(g.dtype(w[0]), sizeof(float)));
    const int64_t dw_byte_stride = weights && same ? spacing(dw_bytes) : 0;
    int64_t dw_stride = dw_byte_stride % w_size == 0 ? dw_byte_stride / w_size : 0;
    // Fresh gradients apart (QAT's quantized weights are nodes, their gradients wherever the allocator puts
    // them: apart in 9 of BERT-base's 12 layers): the products side by side into a transient buffer, then a
    // copy each. Three products of 96 tiles each left an H200's 132 SMs a quarter idle (3 x 27 us a layer
    // against 59 us for the batched one); the copies are 1.2 MB each in BF16.
    const bool apart = weights && same && dw_stride == 0 && !dw[0].accumulate;
    void* dw_out = dw[0].data;
    if (apart) dw_out = g.transient<std::byte>(0, size_t(3 * c * c * w_size)), dw_stride = c * c;
    // Side by side: [dWq; dWk; dWv] (3C, C) (+)= [dQ dK dV]^T x as one product where it is narrow or of FP32
    // operands. The batched one gave BERT-mini's 256 x 256 products 12 output tiles on an H200's 132 SMs
    // (40-50 us a layer; the whole step 1.3% faster as one); at BERT-base's 768 the batched product was as
    // fast in BF16 (41.5 us against 41.6 on an H200), but of FP32 operands cuBLASLt's batched kernels split
    // no sums: 1,310 us in FP32 and 179 in TF32 against 598 and 163 for the one product (8,192 rows), and
    // the FP32 QAT step took 8% longer.
    if (dw_stride == c * c && (c < 512 || type == CUDA_R_32F)) {
      gemm(g, true, false, 3 * c, c, n, 1.0f, dqkv, 3 * c, 0, xv, c, 0, dw[0].accumulate ? 1.0f : 0.0f, dw_out, c, 0, 1,
           type, w_type(0));
    } else if (dw_stride) {
      gemm(g, true, false, c, c, n, 1.0f, dqkv, 3 * c, c, xv, c, 0, dw[0].accumulate ? 1.0f : 0.0f, dw_out, c,
           dw_stride, 3, type, w_type(0));
    } else {
      for (int i = 0; i < 3; ++i)
        if (g.requires_grad(w[i]))
          gemm(g, true, false, c, c, n, 1.0f, dqkv + i * c, 3 * c, 0, xv, c, 0, dw[i].accumulate ? 1.0f : 0.0f,
               dw[i].data, c, 0, 1, type, w_type(i));
    }
    if (apart)
      for (int i = 0; i < 3; ++i)
        cuda::copy_on_device(context, dw[i].data, static_cast<const std::byte*>(dw_out) + i * c * c * w_size,
                             size_t(c * c * w_size));
    std::array<float*, 3> db{};
    // (Summed already where the attention's one-kernel backward wrote this gradient: Graph::bias_summed.)
    for (int i = 0; i < 3; ++i)
      db[i] = g.requires_grad(b[i]) && !g.bias_summed(projections) ? g.grad(b[i]).data() : nullptr;
    if (const int64_t db_stride = db[0] && db[1] && db[2] ? spacing(db) : 0) {
      add_column_sums(g, dqkv, dtype, n, c, 3 * c, db[0], 3, c, db_stride);
    } else {
      for (int i = 0; i < 3; ++i)
        if (db[i]) add_column_sums(g, dqkv + i * c, dtype, n, c, 3 * c, db[i]);
    }
  });
  return projections;
}

// Self-attention from x: the three projections side by side (projections_of), then the fused kernels on
// its three parts, rows 3C apart (the attention's node reads the projections' node); the kernels' dQ, dK,
// dV go side by side into the projections' gradient (N, 3C).
template <int D, typename A>
Var projected(Graph<float>& g, Var x, const std::array<Var, 3>& w, const std::array<Var, 3>& b, Geometry geometry,
              int64_t batch, DType dtype) {
  const int64_t bh = batch * geometry.heads, t = geometry.length, c = geometry.out_stride;
  geometry.stride = 3 * c;
  const Geometry q = with_rows<D, A>(g, geometry);
  const Var projections = projections_of<A>(g, x, w, b, batch, t, dtype);
  const A* qkv = cuda::typed<A>(g.data(projections));
  Var out = g.emit(g.shape(x), {projections}, dtype);
  float* lse = g.scratch<float>(size_t(bh * t));
  const dim3 query_grid(unsigned((t + q.rows - 1) / q.rows), unsigned(bh));
  forward_kernels<D, A>(g, q, query_grid, cuda::typed<A>(g.data(out)), nullptr, lse, qkv, qkv + c, qkv + 2 * c);
  g.on_backward(out, [=](Graph<float>& g) {
    const auto target = g.raw_grad_target(projections);
    A* dqkv = cuda::typed<A>(target.data);
    AttentionGrads<A> d{dqkv, dqkv + c, dqkv + 2 * c, target.accumulate, target.accumulate, target.accumulate};
    // The biases' gradients summed by the one-kernel backward as it writes dQ, dK and dV (where it runs and writes
    // them afresh), so that projections_of's backward does not read them again for that.
    std::array<float*, 3> db{};
    for (int i = 0; i < 3; ++i) db[i] = !target.accumulate && g.requires_grad(b[i]) ? g.grad(b[i]).data() : nullptr;
    if (db[0] || db[1] || db[2]) d.bias_partial = g.scratch<float>(size_t(3 * batch * c));
    const bool summed = backward_kernels<D, A>(g, q, query_grid, bh, t, d, true, qkv, qkv + c, qkv + 2 * c,
                                               cuda::typed<A>(g.data(out)), cuda::typed<A>(g.grad_data(out)), lse);
    if (summed && d.bias_partial) {
      cuda::launch_add_partial_rows(g, db[0], d.bias_partial, db[1], d.bias_partial + batch * c, batch, c, db[2],
                                    d.bias_partial + 2 * batch * c);
      g.set_bias_summed(projections);
    }
  });
  return out;
}

// f(head size as an integral constant, cuda::TypeTag of the element type): the kernels' instantiation for
// the activations' dtype and the head size.
template <typename F>
void with_kernels(DType dtype, int64_t head_size, F&& f) {
  cuda::with_element_type(dtype, [&](auto tag) { with_head_size(int(head_size), [&](auto size) { f(size, tag); }); });
}

// attention's checks and geometry (heads, length, mask, dropout: its draws reserved from rng) for (B, T, C)
// operands.
Geometry make_geometry(Graph<float>& g, const Shape& s, Var mask, int64_t heads, double alpha, double p, bool training,
                       Rng& rng) {
  const int64_t d = s[2] / heads;
  BERT_CHECK(attention_fits(g, d, s[1]),
             "attention: no fused kernel for head size " + std::to_string(d) + " and length " + std::to_string(s[1]));
  if (mask.valid())
    BERT_CHECK(g.shape(mask) == Shape({s[0], s[1]}) && g.dtype(mask) == DType::kF32,
               "attention: mask " + g.shape(mask).str() + " (expected (B, T) floats)");
  Geometry geometry{};
  geometry.heads = heads;
  geometry.length = s[1];
  geometry.stride = s[2];
  geometry.out_stride = s[2];
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
  return geometry;
}

}  // namespace

bool attention_fits(const Graph<float>& g, int64_t head_size, int64_t length) {
  const DType dtype = g.activation_dtype();
  if (length < 1 || length > kMaxLength) return false;
  if (head_size != 16 && head_size != 32 && head_size != 64 && head_size != 128) return false;
  const int padded = int((length + kKeyTile - 1) / kKeyTile * kKeyTile);
  const size_t limit = shared_limit(g);
  auto fits = [&](auto size) {
    constexpr int D = decltype(size)::value;
    if (dtype == DType::kBF16) return flash_shared_bytes<bf16>(D) <= limit;
    return flash<D, float>(g) ||
           (rows_that_fit<D, float>(padded, limit) > 0 && backward_key_bytes<D, float>() <= limit);
  };
  bool fit = false;
  with_head_size(int(head_size), [&](auto size) { fit = fits(size); });
  return fit;
}

bool attention_on_tensor_cores(const Graph<float>& g, int64_t head_size, int64_t length) {
  if (!attention_fits(g, head_size, length)) return false;
  if (g.activation_dtype() == DType::kBF16) return true;
  bool tensor_cores = false;
  with_head_size(int(head_size), [&](auto size) { tensor_cores = flash<decltype(size)::value, float>(g); });
  return tensor_cores;
}

Var attention(Graph<float>& g, Var q, Var k, Var v, Var mask, int64_t heads, double alpha, double p, bool training,
              Rng& rng, const QuantizeOutput* probs) {
  const Shape s = g.shape(q);
  BERT_CHECK(s.rank() == 3 && g.shape(k) == s && g.shape(v) == s && heads > 0 && s[2] % heads == 0,
             "attention: q " + s.str() + ", k " + g.shape(k).str() + ", v " + g.shape(v).str() + " (expected (B, T, C) " +
                 "each, C a multiple of " + std::to_string(heads) + " heads)");
  q = as_activation(g, q);
  k = as_activation(g, k);
  v = as_activation(g, v);
  const Geometry geometry = make_geometry(g, s, mask, heads, alpha, p, training, rng);
  const DType dtype = g.activation_dtype();
  Var out;
  with_kernels(dtype, s[2] / heads, [&](auto size, auto tag) {
    out = fused<decltype(size)::value, typename decltype(tag)::type>(g, q, k, v, geometry, s[0], dtype, probs);
  });
  return out;
}

Var self_attention(Graph<float>& g, Var x, const std::array<Var, 3>& weights, const std::array<Var, 3>& biases,
                   Var mask, int64_t heads, double alpha, double p, bool training, Rng& rng) {
  const Shape s = g.shape(x);
  x = as_activation(g, x);
  const Geometry geometry = make_geometry(g, s, mask, heads, alpha, p, training, rng);
  const DType dtype = g.activation_dtype();
  Var out;
  with_kernels(dtype, s[2] / heads, [&](auto size, auto tag) {
    out = projected<decltype(size)::value, typename decltype(tag)::type>(g, x, weights, biases, geometry, s[0], dtype);
  });
  return out;
}

std::array<Var, 3> quantized_projections(Graph<float>& g, Var x, const std::array<Var, 3>& weights,
                                         const std::array<Var, 3>& biases,
                                         const std::array<QuantizeOutput, 3>& quantizers,
                                         const ProjectionScales* integers) {
  const Shape s = g.shape(x);
  const int64_t c = s[-1], n = s.numel() / c;
  if (c % 8 != 0 || n * c >= (int64_t{1} << 32)) return {};
  std::array<cuda::QuantizeLaunch, 3> launches;
  for (int i = 0; i < 3; ++i) launches[i] = cuda::fused_launch(g, quantizers[i], n * c);  // checks: per tensor
  x = as_activation(g, x);
  const DType dtype = g.dtype(x);
  std::array<Var, 3> out;
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    const Var projections = projections_of<A>(g, x, weights, biases, n, 1, dtype, integers);
    const A* p = cuda::typed<A>(g.data(projections));
    auto part = [p, c](int i, A* dx) {
      return cuda::ColumnsSource<A>{p + i * c, dx, cuda::Columns{uint32_t(c), 3 * c}};
    };
    // The three quantizers in one launch each way (cuda::QuantizeParts: the same bits as one launch each,
    // without two launches' starts and tails).
    using Parts = cuda::QuantizeParts<A, cuda::ColumnsSource<A>>;
    Parts parts;
    parts.n = n * c;
    int width = 8;
    for (int i = 0; i < 3; ++i) {
      out[i] = g.emit(s, {projections, quantizers[i].scale}, dtype);
      A* y = cuda::typed<A>(g.data(out[i]));
      parts.y[i] = y, parts.source[i] = part(i, nullptr), parts.scale[i] = launches[i].scale;
      parts.lo[i] = launches[i].lo, parts.hi[i] = launches[i].hi, parts.grad_scale[i] = launches[i].grad_scale;
      parts.clipped[i] = reinterpret_cast<unsigned long long*>(launches[i].clipped);
      width = std::min(width, cuda::pack_width(sizeof(A), sizeof(A), c, {p + i * c, y}));
    }
    cuda::launch_fake_quantize_parts_forward(g, parts, 3, width);
    // One backward for the three outputs, run by the first of their closures to run (the last output's:
    // every output's readers were recorded after it); the others find it done. It writes the projections'
    // gradient whole (each part through its quantizer), so one target serves the three parts.
    bool* done = g.host_scratch<bool>(1);
    *done = false;
    const std::array<Var, 3> ys = out;
    const std::array<Var, 3> scales = {quantizers[0].scale, quantizers[1].scale, quantizers[2].scale};
    for (int i = 0; i < 3; ++i)
      g.on_backward(out[i], [=](Graph<float>& g) {
        if (*done) return;
        *done = true;
        const auto target =
            g.requires_grad(projections) ? g.raw_grad_target(projections) : Graph<float>::RawGradTarget{nullptr, false};
        A* dp = cuda::typed<A>(target.data);
        Parts back = parts;
        int back_width = 8;
        bool together = true;  // every output took a gradient: one launch for the three
        for (int j = 0; j < 3; ++j) {
          A* dpart = dp ? dp + j * c : nullptr;
          together = together && g.has_grad(ys[j]);
          back.source[j] = part(j, dpart);
          back.ds[j] = g.requires_grad(scales[j]) ? g.grad(scales[j]).data() : nullptr;
          back.dy[j] = g.has_grad(ys[j]) ? cuda::typed<A>(g.grad_data(ys[j])) : nullptr;
          back_width = std::min(back_width, cuda::pack_width(sizeof(A), sizeof(A), c, {back.dy[j], p + j * c, dpart}));
        }
        if (together) {
          cuda::launch_fake_quantize_parts_backward(g, back, 3, back_width, target.accumulate);
          return;
        }
        for (int j = 0; j < 3; ++j) {
          A* dpart = dp ? dp + j * c : nullptr;
          if (!g.has_grad(ys[j])) {  // nothing flowed into this output: its part of a fresh gradient is zero
            if (dpart && !target.accumulate)
              BERT_CUDA_CHECK(cudaMemset2DAsync(dpart, 3 * c * sizeof(A), 0, c * sizeof(A), n, cuda::stream(g)));
            continue;
          }
          cuda::QuantizeLaunch one = launches[j];
          one.scale_grad = back.ds[j];
          cuda::launch_fake_quantize_backward(g, one, back.dy[j], part(j, dpart),
                                              cuda::pack_width(sizeof(A), sizeof(A), c, {back.dy[j], p + j * c, dpart}),
                                              target.accumulate);
        }
      });
  });
  return out;
}

}  // namespace bert::ops::cuda_impl
