// Shared helpers of the CUDA kernels (ops/*.cu): the graph's stream, launch sizes, warp and block
// reductions, and the activation element types. Kernels compute and accumulate in float (in double
// where a sum spans many elements), whatever the type they load and store: float, or BF16 in mixed
// precision (a template parameter A of the kernels).
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "core/cuda/context.h"
#include "core/graph.h"
#include "core/rng.h"

namespace bert::cuda {

inline const CudaContext& context(const Device& d) { return *d.cuda_context(); }
inline cudaStream_t stream(const Device& d) { return d.cuda_context()->stream; }
inline cudaStream_t stream(const Graph<float>& g) { return stream(g.device()); }
inline cublasHandle_t cublas(const Graph<float>& g) { return g.device().cuda_context()->cublas; }

// --- element types: float, or BF16 (activations in mixed precision), converted at loads and stores
using bf16 = __nv_bfloat16;
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(bf16 v) { return __bfloat162float(v); }
template <typename A>
__device__ __forceinline__ A from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float v) {
  return __float2bfloat16_rn(v);
}
// v0 and v1 rounded to A and back (to_float(from_float<A>(v)) each); to BF16 by one conversion for both
// (F2FP: one instruction on a full-rate pipe, where each alone takes a conversion of its own), and back from
// the pair's word by one shift or mask each (__low2float and __high2float took each half to a register of
// its own first: two instructions a value).
template <typename A>
__device__ __forceinline__ void round_pair(float& v0, float& v1) {
  if constexpr (std::is_same_v<A, bf16>) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(v0, v1);
    const uint32_t word = *reinterpret_cast<const uint32_t*>(&p);
    v0 = __uint_as_float(word << 16), v1 = __uint_as_float(word & 0xFFFF0000u);
  }
}
template <typename A>
struct TypeTag {
  using type = A;
};
// Calls f(TypeTag<A>{}) with A the element type of `dtype`: one kernel instantiation per type.
template <typename F>
void with_element_type(DType dtype, F&& f) {
  BERT_CHECK(dtype != DType::kS8, "an int8 tensor reached an op that reads activations (only int8_linear reads it)");
  if (dtype == DType::kBF16)
    f(TypeTag<bf16>{});
  else
    f(TypeTag<float>{});
}
template <typename A>
constexpr cudaDataType_t cuda_data_type() {
  return std::is_same_v<A, bf16> ? CUDA_R_16BF : CUDA_R_32F;
}
template <typename A>
inline A* typed(void* p) {
  return static_cast<A*>(p);
}

// GELU (erf form) and its derivative, as every GPU kernel that applies it computes them.
constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
__device__ __forceinline__ float gelu_value(float v) { return 0.5f * v * (1.0f + erff(v * kInvSqrt2)); }
__device__ __forceinline__ float gelu_derivative(float v) {
  return 0.5f * (1.0f + erff(v * kInvSqrt2)) + v * kInvSqrt2Pi * expf(-0.5f * v * v);
}
// Both from one erf (the compiler does not share it between the two calls): the same arithmetic, the
// same values.
__device__ __forceinline__ void gelu_value_and_derivative(float v, float& value, float& derivative) {
  const float e = erff(v * kInvSqrt2);
  value = 0.5f * v * (1.0f + e);
  derivative = 0.5f * (1.0f + e) + v * kInvSqrt2Pi * expf(-0.5f * v * v);
}

constexpr int kThreads = 256;
// Blocks for a grid-stride loop over n elements (capped: each thread then loops).
inline unsigned blocks_for(int64_t n, int threads = kThreads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 * 8 ? 65535 * 8 : b));
}

#define BERT_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(blockDim.x) * gridDim.x)

// Launches a grid-stride kernel over n elements on the graph's stream and checks the launch.
#define BERT_LAUNCH(kernel, n, g, ...)                                                                        \
  do {                                                                                                        \
    kernel<<<::bert::cuda::blocks_for(n), ::bert::cuda::kThreads, 0, ::bert::cuda::stream(g)>>>(__VA_ARGS__); \
    BERT_CUDA_LAUNCHED();                                                                                     \
  } while (0)

// The GEMM compute type for operands of type `operands`: BF16 operands always accumulate in FP32 on the
// tensor cores; FP32 operands follow the device's precision (FP32, or TF32 tensor cores).
inline cublasComputeType_t compute_type(const Graph<float>& g, cudaDataType_t operands) {
  if (operands == CUDA_R_16BF) return CUBLAS_COMPUTE_32F;
  return g.device().precision() == Precision::kTf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}

// W consecutive elements moved as one load or store (W = 4: one 16-byte access; W = 1: scalar).
template <typename V, int W>
struct alignas(sizeof(V) * W) Pack {
  V v[W];
};
template <int W, typename V>
__device__ __forceinline__ Pack<V, W> load_pack(const V* p) {
  return *reinterpret_cast<const Pack<V, W>*>(p);
}
// The same for floats written by other blocks of this kernel (read through L2, not a stale L1 line).
template <int W>
__device__ __forceinline__ Pack<float, W> load_pack_cg(const float* p) {
  Pack<float, W> out;
  if constexpr (W == 4) {
    const float4 v = __ldcg(reinterpret_cast<const float4*>(p));
    out.v[0] = v.x, out.v[1] = v.y, out.v[2] = v.z, out.v[3] = v.w;
  } else if constexpr (W == 2) {
    const float2 v = __ldcg(reinterpret_cast<const float2*>(p));
    out.v[0] = v.x, out.v[1] = v.y;
  } else {
    for (int w = 0; w < W; ++w) out.v[w] = __ldcg(p + w);
  }
  return out;
}
template <int W, typename V>
__device__ __forceinline__ void store_pack(V* p, const Pack<V, W>& pack) {
  *reinterpret_cast<Pack<V, W>*>(p) = pack;
}
// Grid-stride loop over n elements (a multiple of W) in packs of W: i is each pack's first element.
#define BERT_GRID_STRIDE_PACKS(i, n, W)                                             \
  for (int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * (W); i < (n); \
       i += int64_t(blockDim.x) * gridDim.x * (W))
// Whether n elements at every pointer can move in packs of 4 (16-byte aligned, n % 4 == 0; a pack of 4
// BF16 values is 8 bytes, so the same test suffices for it).
inline bool packs_of_4(int64_t n, std::initializer_list<const void*> pointers) {
  if (n % 4 != 0) return false;
  for (const void* p : pointers)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}
// Launches kernel<4> over n / 4 packs when packed is true, else kernel<1> over n elements.
#define BERT_LAUNCH_PACKED(kernel, n, packed, g, ...)  \
  do {                                                 \
    if (packed)                                        \
      BERT_LAUNCH(kernel<4>, (n) / 4, g, __VA_ARGS__); \
    else                                               \
      BERT_LAUNCH(kernel<1>, n, g, __VA_ARGS__);       \
  } while (0)

// The same for kernels over elements of type A: 2-byte elements (BF16) move 8 at a time (16 bytes) when
// n is a multiple of 8 (`packed` has checked the 16-byte alignment), else as BERT_LAUNCH_PACKED.
#define BERT_LAUNCH_PACKED_WIDE(A, kernel, n, packed, g, ...)         \
  do {                                                                \
    if constexpr (sizeof(A) == 2) {                                   \
      if ((packed) && (n) % 8 == 0) {                                 \
        BERT_LAUNCH(kernel<8>, (n) / 8, g, __VA_ARGS__);              \
        break;                                                        \
      }                                                               \
    }                                                                 \
    BERT_LAUNCH_PACKED(kernel, n, packed, g, __VA_ARGS__);            \
  } while (0)

// Stores one gradient element: added to what the buffer holds, or written when the buffer is fresh
// (Graph::grad_target; an uninitialised buffer must not be read).
template <typename V>
__device__ __forceinline__ void store_grad(V* d, int64_t i, float v, bool accumulate) {
  d[i] = from_float<V>(accumulate ? to_float(d[i]) + v : v);
}

// W gradient values stored at p, or added to what p holds.
template <int W, typename X>
__device__ __forceinline__ void store_grad_pack(X* p, const float (&g)[W], bool accumulate) {
  Pack<X, W> out;
  if (accumulate) out = load_pack<W>(p);
  for (int j = 0; j < W; ++j) out.v[j] = from_float<X>(accumulate ? to_float(out.v[j]) + g[j] : g[j]);
  store_pack<W>(p, out);
}

// dx (+)= alpha dy, in packs of W (a template so each kernel file has its own copy without relocatable
// device code). dx and dy may differ in type (a conversion's backward).
template <int W, typename X, typename Y>
__global__ void scaled_grad_kernel(X* dx, const Y* dy, float alpha, int64_t n, bool accumulate) {
  BERT_GRID_STRIDE_PACKS(i, n, W) {
    const Pack<Y, W> d = load_pack<W>(dy + i);
    Pack<X, W> out;
    if (accumulate) out = load_pack<W>(dx + i);
    for (int j = 0; j < W; ++j) {
      const float v = alpha * to_float(d.v[j]);
      out.v[j] = from_float<X>(accumulate ? to_float(out.v[j]) + v : v);
    }
    store_pack<W>(dx + i, out);
  }
}

// Second pass of a deterministic column sum: out_a[col] += sum over k < chunks of partial_a[k][col] (and
// the same for b and c where out_b, out_c are set). Grid (column groups of 32, arrays): block (32, kLanes)
// adds one array's 32 columns, kLanes lanes over the chunks (lane y: chunks y, y + kLanes, ..., eight loads
// in flight), the lanes' sums added in lane order. One block an array: BERT-base's LayerNorm (264 chunks of
// 768 columns, three arrays) 6.6 -> 4.7 us on an H200 (it had 24 blocks, each adding the three arrays one
// after another). A template so each kernel file has its own copy.
struct PartialRows {
  float* out[3];
  const float* partial[3];
};
template <int kLanes = 32>
__global__ void add_partial_rows(PartialRows rows, int64_t chunks, int64_t cols) {
  __shared__ float lanes[kLanes][33];
  float* const out = rows.out[blockIdx.y];
  const float* const partial = rows.partial[blockIdx.y];
  const int64_t col = blockIdx.x * 32 + threadIdx.x;
  constexpr int kInFlight = 8;
  float sum = 0;
  if (col < cols)
    for (int64_t k0 = threadIdx.y; k0 < chunks; k0 += kInFlight * kLanes) {
      float v[kInFlight];
#pragma unroll
      for (int j = 0; j < kInFlight; ++j)
        if (k0 + j * kLanes < chunks) v[j] = partial[(k0 + j * kLanes) * cols + col];
#pragma unroll
      for (int j = 0; j < kInFlight; ++j)
        if (k0 + j * kLanes < chunks) sum += v[j];
    }
  lanes[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || col >= cols) return;
  for (int k = 1; k < kLanes; ++k) sum += lanes[k][threadIdx.x];
  out[col] += sum;
}
inline void launch_add_partial_rows(const Graph<float>& g, float* out_a, const float* partial_a, float* out_b,
                                    const float* partial_b, int64_t chunks, int64_t cols, float* out_c = nullptr,
                                    const float* partial_c = nullptr) {
  PartialRows rows{};
  unsigned arrays = 0;
  for (auto [out, partial] : {std::pair{out_a, partial_a}, std::pair{out_b, partial_b}, std::pair{out_c, partial_c}})
    if (out) rows.out[arrays] = out, rows.partial[arrays] = partial, ++arrays;
  if (arrays == 0) return;
  add_partial_rows<<<dim3(unsigned((cols + 31) / 32), arrays), dim3(32, 32), 0, stream(g)>>>(rows, chunks, cols);
  BERT_CUDA_LAUNCHED();
}

// Dropout's keep flags for the W elements first + i .. first + i + W - 1 of a stream (core/rng.h's
// DropoutDraws): one hash per four where they are whole groups of four, as they are in packs of four or
// more when `first` and i are multiples of the pack (DropoutDraws::reserve makes `first` one).
template <int W>
__device__ __forceinline__ void draw_keeps(bool (&keep)[W], uint64_t seed, uint64_t first, int64_t i,
                                           uint32_t threshold) {
  const uint64_t e = first + uint64_t(i);
  if constexpr (W % 4 == 0) {
    if (e % 4 == 0) {
      for (int q = 0; q < W / 4; ++q) {
        const uint32_t m = DropoutDraws::kept4(seed, e / 4 + q, threshold);
        for (int l = 0; l < 4; ++l) keep[4 * q + l] = (m >> l) & 1u;
      }
      return;
    }
  }
  for (int j = 0; j < W; ++j) keep[j] = DropoutDraws::kept(seed, e + j, threshold);
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
