// What the two kernel sets of the fused attention (ops/attention.cu: FP32, and the dispatch;
// ops/attention_flash.cu: BF16 and TF32 on the tensor cores) share: the problem's geometry, the mask and
// dropout as both read them, the head sizes they are made for, and the tensor-core kernels' launches.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/graph.h"
#include "core/rng.h"
#include "ops/cuda/common.cuh"

namespace bert::ops::cuda_impl {

__device__ __forceinline__ int64_t lesser(int64_t a, int64_t b) { return a < b ? a : b; }

struct Geometry {
  int64_t heads, length;  // H, T
  int64_t stride;         // elements from one position to the next within a head in Q, K, V and their gradients:
                          // H D for (B, T, H D) operands, 3 H D where the three lie side by side in one tensor
  int64_t out_stride;     // the same in the output and its gradient: H D
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
  // The probabilities' quantizer (the tensor-core kernels only): fake_quantize of the dropped-out probabilities
  // before the product with V, per tensor at *probs_scale to [probs_lo, probs_hi] (nullptr: none), its
  // saturations counted into probs_clipped (or not: nullptr). The backward's LSQ scale gradient goes to
  // probs_grad (nullptr: none) times probs_grad_scale, summed over the key-side grid's blocks in
  // probs_partial (cuda::add_grid_scale_gradient, the arrival counter `arrivals`).
  const float* probs_scale;
  float probs_lo, probs_hi;
  unsigned long long* probs_clipped;
  float* probs_grad;
  double probs_grad_scale;
  double* probs_partial;
  unsigned int* arrivals;
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

// f called with std::integral_constant<int, D> for head size D (16, 32, 64 or 128): the kernels are made
// for each.
template <typename F>
void with_head_size(int head_size, F&& f) {
  switch (head_size) {
    case 16:
      return f(std::integral_constant<int, 16>{});
    case 32:
      return f(std::integral_constant<int, 32>{});
    case 64:
      return f(std::integral_constant<int, 64>{});
    case 128:
      return f(std::integral_constant<int, 128>{});
    default:
      BERT_CHECK(false, "fused attention: no kernel for head size " + std::to_string(head_size) + " (16, 32, 64, 128)");
  }
}

// Rows of every tile of the tensor-core kernels: a block's own 64 query rows (or keys) and each streamed tile.
constexpr int kFlashRows = 64;

// A kernel's dynamic shared memory above the default 48 KiB.
template <typename Kernel>
void allow_shared(Kernel kernel, size_t bytes) {
  BERT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

// The tensor-core kernels (ops/attention_flash.cu) for E = cuda::bf16 (BF16 steps) or float (TF32 steps),
// head sizes 16, 32, 64 and 128: the shared memory a block of theirs needs (the largest of the three kernels),
// and their launches on the graph's stream, grids of (query tiles or key tiles of 64, B H).
template <typename E>
size_t flash_shared_bytes(int head_size);
// With the probabilities' quantizer (geometry.probs_scale), the forward also writes `passed`: the context
// of the dropped-out probabilities where the quantizer passes their gradient (inside its range), else 0,
// which the query-side backward reads in place of `out` for Di (the softmax's row sum of gradient times
// probability).
template <typename E>
void launch_flash_forward(const Graph<float>& g, int head_size, dim3 grid, E* out, E* passed, float* lse, const E* q,
                          const E* k, const E* v, const Geometry& geometry);
template <typename E>
void launch_flash_backward_query(const Graph<float>& g, int head_size, dim3 grid, E* dq, bool accumulate, float* di,
                                 const E* q, const E* k, const E* v, const E* out, const E* dout, const float* lse,
                                 const Geometry& geometry);
template <typename E>
void launch_flash_backward_key(const Graph<float>& g, int head_size, dim3 grid, E* dk, bool accumulate_k, E* dv,
                               bool accumulate_v, const E* q, const E* k, const E* v, const E* dout, const float* lse,
                               const float* di, const Geometry& geometry);

// The backward in one kernel (dQ, dK and dV of a (b, h) in one block, five products where the two kernels make
// seven): BF16, head sizes up to 64, T <= 128, with or without the probabilities' quantizer. Its shared memory
// where it covers the geometry (the caller checks it against the GPU's), else 0; its launch, a block a (b, h).
// bias_partial: nullptr, or 3 B C floats that receive the column sums of dQ, dK and dV (stored, not added to:
// side by side in a projections' gradient) over each b's rows, [part][b][C] (C = heads x head size).
template <typename E>
size_t flash_fused_backward_bytes(int head_size, const Geometry& geometry);
template <typename E>
void launch_flash_backward_fused(const Graph<float>& g, int head_size, int64_t bh, E* dq, bool accumulate_q, E* dk,
                                 bool accumulate_k, E* dv, bool accumulate_v, const E* q, const E* k, const E* v,
                                 const E* out, const E* dout, const float* lse, const Geometry& geometry,
                                 float* bias_partial = nullptr);

}  // namespace bert::ops::cuda_impl
