// Shared helpers of the CUDA kernels (core/ops_*.cu): the graph's stream, launch sizes, warp and block
// reductions. Kernels accumulate in float and, where a sum spans many elements, in double.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda/context.h"
#include "core/graph.h"

namespace bert::cuda {

inline const CudaContext& context(const Device& d) { return *d.cuda_context(); }
inline cudaStream_t stream(const Device& d) { return d.cuda_context()->stream; }
inline cudaStream_t stream(const Graph<float>& g) { return stream(g.device()); }
inline cublasHandle_t cublas(const Graph<float>& g) { return g.device().cuda_context()->cublas; }

constexpr int kThreads = 256;
// Blocks for a grid-stride loop over n elements (capped: each thread then loops).
inline unsigned blocks_for(int64_t n, int threads = kThreads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 * 8 ? 65535 * 8 : b));
}

#define BERT_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(blockDim.x) * gridDim.x)

// Launches a grid-stride kernel over n elements on the graph's stream and checks the launch.
#define BERT_LAUNCH(kernel, n, g, ...)                                                   \
  do {                                                                                   \
    kernel<<<::bert::cuda::blocks_for(n), ::bert::cuda::kThreads, 0, ::bert::cuda::stream(g)>>>(__VA_ARGS__); \
    BERT_CUDA_LAUNCHED();                                                                \
  } while (0)

// Stores one gradient element: added to what the buffer holds, or written when the buffer is fresh
// (Graph::grad_target; an uninitialised buffer must not be read).
template <typename V>
__device__ __forceinline__ void store_grad(V* d, int64_t i, V v, bool accumulate) {
  d[i] = accumulate ? d[i] + v : v;
}

// dx (+)= alpha dy (a template so each kernel file has its own copy without relocatable device code).
template <typename V>
__global__ void scaled_grad_kernel(V* dx, const V* dy, V alpha, int64_t n, bool accumulate) {
  BERT_GRID_STRIDE(i, n) store_grad(dx, i, alpha * dy[i], accumulate);
}

template <typename V>
__device__ __forceinline__ V warp_sum(V v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `shared` holds at least 32 values. Deterministic: a fixed tree for a fixed block size.
template <typename V>
__device__ V block_sum(V v, V* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : V(0);
  return warp_sum(v);
}

}  // namespace bert::cuda
