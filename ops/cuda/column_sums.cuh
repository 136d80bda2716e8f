// Deterministic column sums on a CUDA device (a linear's bias gradient), from a source that may compute
// what it sums in the same pass: RowsOf reads a matrix; an op's backward (the feed-forward block's GELU,
// ops/matmul.cu; the quantized GELU, ops/elementwise.cu) writes its input's gradient and sums it, so that
// gradient is not read again.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ops/cuda/common.cuh"

namespace bert::cuda {

// dbias (cols) += the column sums of dy (rows, cols; rows ld apart), deterministically. Block (32, 8) of grid
// (row chunks, column groups, parts) sums `chunk` rows of 32 W columns (thread x: W adjacent columns, W-wide
// accesses; y: every 8th row, kRowsInFlight of them loaded before the first is added), its 8 lanes added in
// order into partial[chunk][col]. The last block of a column group to finish (counted in arrivals[group])
// then adds the group's partials over the chunks in a fixed order (lane y: chunks y, y + 8, ...; the lanes
// in order) into dbias and resets its counter: one launch instead of a second kernel for the partials (3.5
// us a call on an H200, most of it latency). The chunks run fastest in the grid, so a group's blocks run
// together and its last block's sums overlap the next groups' reads. Without counters (more column groups
// than the context has) the second kernel does it (add_partial_rows).
//
// The rows come from a Source: `read(part, r, col)` loads what row r's W columns need (the loads of
// kRowsInFlight rows are issued together: one at a time left the kernel waiting on memory), `value(part, r,
// col, loaded)` gives the W values to add, after writing whatever the source produces. RowsOf reads a
// matrix; GeluBackwardRows (ops/matmul.cu) is the feed-forward block's GELU backward, which sums the
// gradient it writes: the same values in the same order, so the same bits as writing it, then summing it.
// A source that also sums a quantizer's LSQ scale gradient names a type SumsScaleGradient (ops/elementwise.cu's
// quantized GELU): `setup()` runs once a thread before any row (the quantizer's division from its scale on
// the device), and `value` takes a fifth argument, the thread's share in double, to which it adds its W
// elements' terms. The block's lanes are added in a fixed order into scale_shares[block], and
// add_scale_shares adds the blocks' shares in block order: deterministic, in another order than
// fake_quantize_backward's blocks.
constexpr int64_t kColumnChunk = 64, kMostChunks = 128;  // 8192 rows: 128 chunks, hundreds of blocks
constexpr int kRowsInFlight = 4;
template <int W, typename A>
struct RowsOf {
  const A* dy;
  int64_t ld, part_stride;
  __device__ Pack<A, W> read(unsigned part, int64_t r, int64_t col) const {
    return load_pack<W>(dy + part * part_stride + r * ld + col);
  }
  __device__ Pack<A, W> value(unsigned, int64_t, int64_t, const Pack<A, W>& loaded) const { return loaded; }
};
template <typename Source>
constexpr bool kScaleShares = requires {
  typename Source::SumsScaleGradient;
};
// At least four blocks an SM (64 registers a thread) where the source sums no scale gradient: the feed-forward
// block's GELU backward took 91 registers, two blocks an SM, and waited on its loads (one H200: 25% occupancy,
// 5.9 cycles an issued instruction). 0: no minimum.
template <typename Source>
constexpr int kColumnSumsMinBlocks = kScaleShares<Source> ? 0 : 4;
template <int W, typename Source>
__global__ void __launch_bounds__(256, kColumnSumsMinBlocks<Source>)
    column_sums(float* dbias, float* partial, unsigned int* arrivals, Source source, int64_t rows, int64_t cols,
                int64_t chunk, int64_t dbias_part_stride, double* scale_shares) {
  __shared__ float lanes[8][32 * W + 1];
  __shared__ bool last;
  double scale_share = 0;  // kScaleShares
  if constexpr (kScaleShares<Source>) source.setup();
  const unsigned chunks = gridDim.x, group = blockIdx.y, part = blockIdx.z;  // grid z: the parts
  dbias += part * dbias_part_stride;
  partial += int64_t(part) * chunks * cols;
  if (arrivals) arrivals += part * gridDim.y;
  const int64_t col = (group * 32 + threadIdx.x) * int64_t(W);
  const bool here = col < cols;
  float acc[W] = {};
  if (here) {
    const int64_t end = min(rows, (blockIdx.x + 1) * chunk);
    for (int64_t r0 = blockIdx.x * chunk + threadIdx.y; r0 < end; r0 += 8 * kRowsInFlight) {
      decltype(source.read(0, 0, 0)) loaded[kRowsInFlight];
#pragma unroll
      for (int j = 0; j < kRowsInFlight; ++j)
        if (r0 + 8 * j < end) loaded[j] = source.read(part, r0 + 8 * j, col);
#pragma unroll
      for (int j = 0; j < kRowsInFlight; ++j)
        if (r0 + 8 * j < end) {
          const auto p = [&] {
            if constexpr (kScaleShares<Source>)
              return source.value(part, r0 + 8 * j, col, loaded[j], scale_share);
            else
              return source.value(part, r0 + 8 * j, col, loaded[j]);
          }();
          for (int w = 0; w < W; ++w) acc[w] += to_float(p.v[w]);
        }
    }
  }
  for (int w = 0; w < W; ++w) lanes[threadIdx.y][threadIdx.x * W + w] = acc[w];
  if constexpr (kScaleShares<Source>) {  // a warp a lane y: each warp's sum, then the 8 in order
    __shared__ double warps[8];
    scale_share = warp_sum(scale_share);
    if (threadIdx.x == 0) warps[threadIdx.y] = scale_share;
    __syncthreads();
    if (scale_shares && threadIdx.x == 0 && threadIdx.y == 0) {
      double total = 0;
      for (int y = 0; y < 8; ++y) total += warps[y];
      scale_shares[(int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x] = total;
    }
  }
  __syncthreads();
  if (threadIdx.y == 0 && here) {
    for (int w = 0; w < W; ++w) {
      float total = 0;
      for (int y = 0; y < 8; ++y) total += lanes[y][threadIdx.x * W + w];
      partial[blockIdx.x * cols + col + w] = total;
    }
    __threadfence();  // the partials are visible everywhere before this block counts as arrived
  }
  if (!arrivals) return;
  __syncthreads();
  if (threadIdx.x == 0 && threadIdx.y == 0) last = atomicAdd(arrivals + group, 1u) == chunks - 1;
  __syncthreads();
  if (!last) return;
  // Lane y adds chunks y, y + 8, ... in order, their partials loaded eight at a time (loads in flight: one
  // block reads the whole group's partials, so their latency is its time).
  for (int w = 0; w < W; ++w) acc[w] = 0;
  constexpr int kInFlight = 8;
  if (here)
    for (unsigned k0 = threadIdx.y; k0 < chunks; k0 += 8 * kInFlight) {
      Pack<float, W> p[kInFlight];
#pragma unroll
      for (int j = 0; j < kInFlight; ++j)
        if (k0 + 8 * j < chunks) p[j] = load_pack_cg<W>(partial + (k0 + 8 * j) * cols + col);
#pragma unroll
      for (int j = 0; j < kInFlight; ++j)
        if (k0 + 8 * j < chunks)
          for (int w = 0; w < W; ++w) acc[w] += p[j].v[w];
    }
  for (int w = 0; w < W; ++w) lanes[threadIdx.y][threadIdx.x * W + w] = acc[w];
  __syncthreads();
  if (threadIdx.y == 0 && here)
    for (int w = 0; w < W; ++w) {
      float total = 0;
      for (int y = 0; y < 8; ++y) total += lanes[y][threadIdx.x * W + w];
      dbias[col + w] += total;
    }
  if (threadIdx.x == 0 && threadIdx.y == 0) arrivals[group] = 0;
}

// ds += grad_scale times the sum of column_sums' n block shares of a scale gradient, in block order
// (each thread's blocks in order, then block_sum's fixed tree), as fake_quantize's kernels add theirs.
// A thread's shares are loaded kInFlight at a time before any is added (the same order of additions): one
// at a time, a BF16 BERT-base GELU's 3,072 shares took 8 us, twelve dependent trips to memory a thread.
template <typename Share>
__global__ void add_scale_shares(float* ds, const Share* shares, int64_t n, double grad_scale) {
  constexpr int kInFlight = 16;
  __shared__ Share shared[32];
  Share total = 0;
  for (int64_t b0 = threadIdx.x; b0 < n; b0 += int64_t(kInFlight) * blockDim.x) {
    Share loaded[kInFlight];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) {
      const int64_t b = b0 + int64_t(j) * blockDim.x;
      loaded[j] = b < n ? shares[b] : Share(0);
    }
#pragma unroll
    for (int j = 0; j < kInFlight; ++j)
      if (b0 + int64_t(j) * blockDim.x < n) total += loaded[j];
  }
  total = block_sum(total, shared);
  if (threadIdx.x == 0) *ds += static_cast<float>(grad_scale * total);
}
// Where a kScaleShares source's scale gradient goes: ds (nullptr: the scale takes none), times grad_scale.
struct ScaleShares {
  float* ds = nullptr;
  double grad_scale = 1.0;
};

// Launches column_sums over `parts` parts of (rows, cols) from the source make_source<W>() gives, W the
// widest of 4, 2, 1 that `fits(W)`; a kScaleShares source's scale gradient is added to scale.ds.
template <typename MakeSource>
void launch_column_sums(Graph<float>& g, int64_t rows, int64_t cols, float* dbias, int parts, int64_t dbias_part_stride,
                        auto fits, MakeSource make_source, ScaleShares scale = {}) {
  // At most kMostChunks chunks: the last block of a column group reads that many partial rows.
  const int64_t chunk = std::max<int64_t>(kColumnChunk, (rows + kMostChunks - 1) / kMostChunks);
  const int64_t chunks = (rows + chunk - 1) / chunk;
  float* partial = g.scratch<float>(parts * chunks * cols);
  // Packs of 4 where the rows allow (16 bytes of floats, 8 of BF16: 16-byte BF16 packs made groups of 256
  // columns, too few for the final sums), else 2 elements on an even width (the vocabulary's 30,522), else
  // one by one.
  const int w = fits(4) ? 4 : fits(2) ? 2 : 1;
  const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>((cols + 32 * w - 1) / (32 * w)),
                  static_cast<unsigned>(parts));
  unsigned int* arrivals = grid.y * grid.z <= CudaContext::kArrivals ? context(g.device()).arrivals : nullptr;
  const int64_t blocks = int64_t(grid.x) * grid.y * grid.z;
  // (A source that sums no scale gradient has no scale shares to add: a ds given with one is a caller's error.)
  using Source = decltype(make_source.template operator()<1>());
  BERT_CHECK(kScaleShares<Source> || !scale.ds, "column sums: a scale gradient asked of a source that sums none");
  double* scale_shares = kScaleShares<Source> && scale.ds ? g.scratch<double>(blocks) : nullptr;
  auto launch = [&](auto width) {
    constexpr int W = decltype(width)::value;
    column_sums<W><<<grid, dim3(32, 8), 0, stream(g)>>>(dbias, partial, arrivals, make_source.template operator()<W>(),
                                                        rows, cols, chunk, dbias_part_stride, scale_shares);
  };
  if (w == 4)
    launch(std::integral_constant<int, 4>{});
  else if (w == 2)
    launch(std::integral_constant<int, 2>{});
  else
    launch(std::integral_constant<int, 1>{});
  BERT_CUDA_LAUNCHED();
  if (scale_shares) {
    add_scale_shares<<<1, kThreads, 0, stream(g)>>>(scale.ds, scale_shares, blocks, scale.grad_scale);
    BERT_CUDA_LAUNCHED();
  }
  if (arrivals) return;
  for (int part = 0; part < parts; ++part)
    launch_add_partial_rows(g, dbias + part * dbias_part_stride, partial + part * chunks * cols, nullptr, nullptr,
                            chunks, cols);
}

}  // namespace bert::cuda
