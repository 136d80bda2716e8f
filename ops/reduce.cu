// Reductions on a CUDA device (sum, cross-entropy) and the row argmax query, forward and backward side
// by side like ops/reduce.cpp. Sums over many elements accumulate in double in a fixed order.
#include <algorithm>
#include <cfloat>
#include <cstring>
#include <limits>

#include "ops/cuda/common.cuh"
#include "ops/cuda/cross_entropy.cuh"
#include "ops/cuda/gemm.cuh"
#include "ops/cuda_impl.h"

namespace bert::ops::cuda_impl {

namespace {

constexpr int kReduceThreads = 1024;

template <typename A>
__global__ void sum_kernel(float* y, const A* x, int64_t n) {
  __shared__ double shared[32];
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += cuda::to_float(x[i]);
  acc = cuda::block_sum(acc, shared);
  if (threadIdx.x == 0) y[0] = static_cast<float>(acc);
}

template <typename A>
__global__ void broadcast_scalar_add(A* dx, const float* dy, int64_t n, bool accumulate) {
  BERT_GRID_STRIDE(i, n) cuda::store_grad(dx, i, dy[0], accumulate);
}

// Visits a row of c elements as f(j, pack of W values at j) for the 16-byte-aligned middle of the row
// (W = 16 / sizeof(A)) and f(j, one value) before and after it: the calling thread takes the elements of
// `first` + k `step` (in packs: pack positions), in increasing j. A vocabulary-wide row of odd width
// (30,522) starts anywhere: its head is scalar. Four packs are loaded before any is used (loads in flight).
template <typename A, typename F>
__device__ __forceinline__ void visit_row(const A* row, int64_t c, int first, int step, F&& f) {
  constexpr int W = 16 / sizeof(A), U = 4;
  const int64_t misaligned = int64_t(reinterpret_cast<uintptr_t>(row) % 16 / sizeof(A));
  const int64_t head = misaligned == 0 ? 0 : min(c, W - misaligned);
  const int64_t body_end = head + (c - head) / W * W;
  for (int64_t h = first; h < head; h += step) f(h, cuda::Pack<A, 1>{row[h]});
  const int64_t stride = int64_t(step) * W;
  int64_t j = head + int64_t(first) * W;
  for (; j + (U - 1) * stride < body_end; j += U * stride) {
    cuda::Pack<A, W> p[U];
#pragma unroll
    for (int u = 0; u < U; ++u) p[u] = cuda::load_pack<W>(row + j + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) f(j + u * stride, p[u]);
  }
  for (; j < body_end; j += stride) f(j, cuda::load_pack<W>(row + j));
  for (int64_t t = body_end + first; t < c; t += step) f(t, cuda::Pack<A, 1>{row[t]});
}

// A running (max, sum of exp(v - max)) pair: the log-sum-exp of a row in one read (online softmax).
struct OnlineSum {
  float max = -INFINITY, sum = 0.0f;
  __device__ __forceinline__ void merge(float other_max, float other_sum) {
    const float m = fmaxf(max, other_max);
    if (m == -INFINITY) return;  // both empty (or every value -inf): nothing to add
    sum = (max == -INFINITY ? 0.0f : sum * expf(max - m)) +
          (other_max == -INFINITY ? 0.0f : other_sum * expf(other_max - m));
    max = m;
  }
};

// A running first-largest (value, index): the first index of the largest value, as row_argmax.
struct FirstLargest {
  float value = -INFINITY;
  int64_t index = -1;
  __device__ __forceinline__ void see(float v, int64_t j) {  // j increases within a thread
    if (index < 0 || v > value) value = v, index = j;
  }
  __device__ __forceinline__ void merge(float v, int64_t j) {
    if (j < 0) return;
    if (index < 0 || v > value || (v == value && j < index)) value = v, index = j;
  }
};

// One warp per row (kRowsPerBlock rows a block): the row's log-sum-exp and weighted loss (0 for skipped
// rows) from one read of the row, and where `argmax` is set the first index of its largest value
// (row_argmax's answer, every row). A warp a row keeps every warp streaming: with a block a row, the
// block-wide reductions left the memory idle (BF16 BERT-mini's MLM rows took 1.6-2x as long under ncu).
constexpr int kRowsPerBlock = 8;
template <typename A>
__global__ void cross_entropy_rows(float* logsumexp, double* row_loss, int32_t* argmax, const A* z,
                                   const int32_t* target, const float* row_weight, int64_t n, int64_t c, int64_t ld) {
  const int lane = threadIdx.x % 32;
  const int64_t r = blockIdx.x * int64_t(kRowsPerBlock) + threadIdx.x / 32;
  if (r >= n) return;  // uniform per warp
  const bool skipped = row_weight[r] == 0.0f;
  if (skipped && !argmax) {
    if (lane == 0) row_loss[r] = 0.0, logsumexp[r] = 0.0f;
    return;
  }
  const A* row = z + r * ld;
  OnlineSum online;
  FirstLargest best;
  visit_row(row, c, lane, 32, [&](int64_t j, const auto& pack) {
    constexpr int w = sizeof(pack.v) / sizeof(pack.v[0]);
    float v[w], m = -INFINITY;
    for (int i = 0; i < w; ++i) v[i] = cuda::to_float(pack.v[i]), m = fmaxf(m, v[i]);
    if (argmax && (best.index < 0 || m > best.value))  // only a pack that can hold a new first-largest
      for (int i = 0; i < w; ++i) best.see(v[i], j + i);
    if (m > online.max) {
      online.sum = online.max == -INFINITY ? 0.0f : online.sum * expf(online.max - m);
      online.max = m;
    }
    for (int i = 0; i < w; ++i) online.sum += expf(v[i] - online.max);  // a NaN makes the sum NaN
  });
  for (int offset = 16; offset > 0; offset >>= 1) {
    online.merge(__shfl_xor_sync(0xffffffffu, online.max, offset), __shfl_xor_sync(0xffffffffu, online.sum, offset));
    if (argmax)
      best.merge(__shfl_xor_sync(0xffffffffu, best.value, offset), __shfl_xor_sync(0xffffffffu, best.index, offset));
  }
  if (lane != 0) return;
  if (argmax) argmax[r] = static_cast<int32_t>(best.index < 0 ? 0 : best.index);
  if (skipped) {
    row_loss[r] = 0.0, logsumexp[r] = 0.0f;
    return;
  }
  const float lse = online.max + logf(online.sum);
  logsumexp[r] = lse;
  row_loss[r] = double(row_weight[r]) * (double(lse) - double(cuda::to_float(row[target[r]])));
}

// y = factor * the sum of the rows' losses (a fixed order: deterministic).
__global__ void sum_rows_kernel(float* y, const double* row_loss, int64_t n, double factor) {
  __shared__ double shared[32];
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += row_loss[i];
  acc = cuda::block_sum(acc, shared);
  if (threadIdx.x == 0) y[0] = static_cast<float>(factor * acc);
}

// The log-sum-exp of row * inv_t over the block (every thread gets it).
__device__ float block_logsumexp(const float* row, int64_t c, float inv_t, float* shared) {
  float max = -INFINITY;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) max = fmaxf(max, row[j] * inv_t);
  max = cuda::warp_max(max);
  __syncthreads();
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = max;
  __syncthreads();
  max = threadIdx.x % 32 < blockDim.x / 32 ? shared[threadIdx.x % 32] : -INFINITY;
  max = cuda::warp_max(max);
  float sum = 0;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) sum += expf(row[j] * inv_t - max);
  sum = cuda::block_sum(sum, shared);
  return max + logf(sum);
}

// One block per row: both log-sum-exps and the row's KL(p || q), p from the teacher, q the student.
__global__ void distillation_rows(float* lse_student, float* lse_teacher, double* row_kl, const float* s,
                                  const float* t, int64_t c, float inv_t) {
  __shared__ float shared_f[32];
  __shared__ double shared_d[32];
  const int64_t r = blockIdx.x;
  const float ls = block_logsumexp(s + r * c, c, inv_t, shared_f);
  const float lt = block_logsumexp(t + r * c, c, inv_t, shared_f);
  double kl = 0;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
    const double log_p = double(t[r * c + j] * inv_t) - double(lt);
    const double log_q = double(s[r * c + j] * inv_t) - double(ls);
    kl += exp(log_p) * (log_p - log_q);
  }
  kl = cuda::block_sum(kl, shared_d);
  if (threadIdx.x == 0) lse_student[r] = ls, lse_teacher[r] = lt, row_kl[r] = kl;
}

__global__ void distillation_backward(float* ds, const float* s, const float* t, const float* upstream,
                                      const float* lse_student, const float* lse_teacher, int64_t c, float inv_t,
                                      float factor, bool accumulate) {
  const int64_t r = blockIdx.x;
  const float w = upstream[0] * factor;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
    const float q = expf(s[r * c + j] * inv_t - lse_student[r]);
    const float p = expf(t[r * c + j] * inv_t - lse_teacher[r]);
    cuda::store_grad(ds, r * c + j, w * (q - p), accumulate);
  }
}

// One block per row: dz = upstream w_r (softmax(z_r) - onehot(target_r)), from the saved log-sum-exp (a
// warp a row, as the forward, measured slower here: nothing to reduce), rows ld apart, columns c..ld-1
// zeroed. Packed = dz sits as z does against 16-byte boundaries (both rows then move in 16-byte packs).
template <bool Packed, typename A>
__global__ void cross_entropy_backward_rows(A* dz, const A* z, const float* upstream, const int32_t* target,
                                            const float* row_weight, const float* logsumexp, int64_t c, int64_t ld,
                                            bool accumulate) {
  const int64_t r = blockIdx.x;
  const float w = upstream[0] * row_weight[r], lse = logsumexp[r];
  const int64_t t = target[r];
  A* out = dz + r * ld;
  auto grad = [&](int64_t j, const auto& pack) {
    constexpr int n = sizeof(pack.v) / sizeof(pack.v[0]);
    cuda::Pack<A, n> d;
    if (accumulate) d = cuda::load_pack<n>(out + j);
    for (int i = 0; i < n; ++i) {
      float v = w == 0.0f ? 0.0f : w * expf(cuda::to_float(pack.v[i]) - lse);  // a skipped row: zero
      if (j + i == t) v -= w;
      d.v[i] = cuda::from_float<A>(accumulate ? cuda::to_float(d.v[i]) + v : v);
    }
    cuda::store_pack<n>(out + j, d);
  };
  if constexpr (Packed) {
    visit_row(z + r * ld, c, threadIdx.x, blockDim.x, grad);
  } else {
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) grad(j, cuda::Pack<A, 1>{z[r * ld + j]});
  }
  for (int64_t j = c + threadIdx.x; j < ld; j += blockDim.x) out[j] = cuda::from_float<A>(0.0f);
}

// cross_entropy_backward_rows with the column sums of dz beside it: block (x, y) covers one 16-byte pack of
// W columns a thread (columns W (x blockDim.x + threadIdx.x) ..) over rows y rows_per_block .. (that many),
// four rows' loads in flight at a time, and writes each column's sum over its rows to row y of `partial`
// (gridDim.y, ld). The sums are of the values as stored (rounded to A), as a column sum of dz reads them. dz
// may be z itself. Needs ld a multiple of W and z, dz with 16-byte aligned rows.
template <typename A>
__global__ void cross_entropy_backward_sums(A* dz, const A* z, const float* upstream, const int32_t* target,
                                            const float* row_weight, const float* logsumexp, int64_t n, int64_t c,
                                            int64_t ld, int64_t rows_per_block, float* partial) {
  constexpr int W = 16 / sizeof(A), kRows = 4;
  const int64_t j = int64_t(W) * (int64_t(blockIdx.x) * blockDim.x + threadIdx.x);
  if (j >= ld) return;
  float sums[W];
#pragma unroll
  for (int i = 0; i < W; ++i) sums[i] = 0.0f;
  const float up = upstream[0];
  const int64_t first = int64_t(blockIdx.y) * rows_per_block, last = min(n, first + rows_per_block);
  for (int64_t r0 = first; r0 < last; r0 += kRows) {
    cuda::Pack<A, W> in[kRows];
#pragma unroll
    for (int k = 0; k < kRows; ++k)
      if (r0 + k < last) in[k] = cuda::load_pack<W>(z + (r0 + k) * ld + j);
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      const int64_t r = r0 + k;
      if (r >= last) continue;
      const float w = up * row_weight[r], lse = logsumexp[r];
      const int64_t t = target[r];
      cuda::Pack<A, W> out;
#pragma unroll
      for (int i = 0; i < W; ++i) {
        float v = 0.0f;  // the padding (columns c..ld-1), and a skipped row: zero
        if (j + i < c && w != 0.0f) v = w * expf(cuda::to_float(in[k].v[i]) - lse) - (j + i == t ? w : 0.0f);
        out.v[i] = cuda::from_float<A>(v);
        sums[i] += cuda::to_float(out.v[i]);
      }
      cuda::store_pack<W>(dz + r * ld + j, out);
    }
  }
#pragma unroll
  for (int i = 0; i < W; ++i) partial[int64_t(blockIdx.y) * ld + j + i] = sums[i];
}

// One block per row: the index of the largest value, the first one on ties (as std::max_element).
template <typename A>
__global__ void row_argmax_kernel(int32_t* out, const A* x, int64_t c) {
  __shared__ float best_value[32];
  __shared__ int64_t best_index[32];
  const int64_t r = blockIdx.x;
  float v = -INFINITY;
  int64_t idx = c;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
    const float e = cuda::to_float(x[r * c + j]);
    if (e > v || idx == c) v = e, idx = j;
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, offset);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, idx, offset);
    if (ov > v || (ov == v && oi < idx)) v = ov, idx = oi;
  }
  if (threadIdx.x % 32 == 0) best_value[threadIdx.x / 32] = v, best_index[threadIdx.x / 32] = idx;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (unsigned w = 1; w < blockDim.x / 32; ++w)
      if (best_value[w] > v || (best_value[w] == v && best_index[w] < idx)) v = best_value[w], idx = best_index[w];
    out[r] = static_cast<int32_t>(idx);
  }
}

// result[0] (+)= the largest |x| as float bits (atomicMax on the bits orders non-negative floats);
// result[1] |= 1 when an element is NaN or infinite. One atomic per block: with one per warp, hundreds of
// thousands of them on one address serialised the kernel (about 20x slower than reading x).
template <typename A>
__global__ void abs_max_kernel(unsigned* result, const A* x, int64_t n) {
  __shared__ float warp_max[32];
  __shared__ bool warp_bad[32];
  float m = 0;
  bool bad = false;
  BERT_GRID_STRIDE(i, n) {
    const float a = fabsf(cuda::to_float(x[i]));
    if (a <= FLT_MAX)
      m = fmaxf(m, a);
    else
      bad = true;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  m = cuda::warp_max(m);
  bad = __any_sync(0xffffffffu, bad);
  if (lane == 0) warp_max[warp] = m, warp_bad[warp] = bad;
  __syncthreads();
  if (warp != 0) return;
  const bool present = lane < int(blockDim.x / 32);
  m = cuda::warp_max(present ? warp_max[lane] : 0.0f);
  bad = __any_sync(0xffffffffu, present && warp_bad[lane]);
  if (lane == 0) {
    atomicMax(result, __float_as_uint(m));
    if (bad) atomicOr(result + 1, 1u);
  }
}

// Counts per bin in shared memory, then added to the global counts (integers: any order gives the same).
template <typename A>
__global__ void abs_histogram_kernel(unsigned long long* counts, const A* x, int64_t n, double inv_width, int bins) {
  extern __shared__ unsigned block_counts[];
  for (int b = threadIdx.x; b < bins; b += blockDim.x) block_counts[b] = 0;
  __syncthreads();
  BERT_GRID_STRIDE(i, n) {
    const double a = fabs(double(cuda::to_float(x[i])));
    atomicAdd(&block_counts[min(bins - 1, int(a * inv_width))], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < bins; b += blockDim.x)
    if (block_counts[b]) atomicAdd(&counts[b], static_cast<unsigned long long>(block_counts[b]));
}

}  // namespace

CrossEntropyRows prepare_cross_entropy(Graph<float>& g, std::span<const int32_t> targets,
                                       std::span<const float> weights, int32_t ignore_index, int64_t classes) {
  const auto n = static_cast<int64_t>(targets.size());
  BERT_CHECK(weights.empty() || static_cast<int64_t>(weights.size()) == n, "cross_entropy: weights size");
  // Row weights normalised on the host exactly as on the CPU; targets of skipped rows become 0.
  std::vector<int32_t> target(static_cast<size_t>(n));
  std::vector<float> row_weight(static_cast<size_t>(n));
  double total_weight = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool active = targets[i] != ignore_index;
    if (active)
      BERT_CHECK(targets[i] >= 0 && targets[i] < classes, "cross_entropy: target " + std::to_string(targets[i]) +
                                                              " outside [0, " + std::to_string(classes) + ")");
    target[i] = active ? targets[i] : 0;
    row_weight[i] = active ? (weights.empty() ? 1.0f : weights[i]) : 0.0f;
    total_weight += row_weight[i];
  }
  const float inv_total = total_weight > 0 ? static_cast<float>(1.0 / total_weight) : 0.0f;
  for (float& w : row_weight) w *= inv_total;
  CrossEntropyRows rows;
  rows.n = n, rows.c = classes;
  rows.target = g.upload(target.data(), target.size());
  rows.weight = g.upload(row_weight.data(), row_weight.size());
  rows.logsumexp = g.scratch<float>(std::max<int64_t>(n, 1));
  return rows;
}

void cross_entropy_forward(Graph<float>& g, const CrossEntropyRows& rows, DType dtype, const void* z, int64_t ld,
                           int32_t* argmax, float* loss) {
  double* row_loss = g.scratch<double>(std::max<int64_t>(rows.n, 1));
  if (rows.n > 0) {
    const unsigned blocks = unsigned((rows.n + kRowsPerBlock - 1) / kRowsPerBlock);
    cuda::with_element_type(dtype, [&](auto tag) {
      using A = typename decltype(tag)::type;
      cross_entropy_rows<A><<<blocks, 32 * kRowsPerBlock, 0, cuda::stream(g)>>>(
          rows.logsumexp, row_loss, argmax, static_cast<const A*>(z), rows.target, rows.weight, rows.n, rows.c, ld);
      BERT_CUDA_LAUNCHED();
    });
  }
  sum_rows_kernel<<<1, kReduceThreads, 0, cuda::stream(g)>>>(loss, row_loss, rows.n, 1.0);
  BERT_CUDA_LAUNCHED();
}

void cross_entropy_backward(Graph<float>& g, const CrossEntropyRows& rows, DType dtype, const void* z, int64_t ld,
                            const float* upstream, void* dz, bool accumulate) {
  if (rows.n == 0) return;
  const unsigned threads = rows.c >= 8192 ? 512 : rows.c >= 512 ? 256 : 32;
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    const bool packed = (reinterpret_cast<uintptr_t>(dz) - reinterpret_cast<uintptr_t>(z)) % 16 == 0;
    auto* kernel = packed ? &cross_entropy_backward_rows<true, A> : &cross_entropy_backward_rows<false, A>;
    kernel<<<unsigned(rows.n), threads, 0, cuda::stream(g)>>>(static_cast<A*>(dz), static_cast<const A*>(z), upstream,
                                                              rows.target, rows.weight, rows.logsumexp, rows.c, ld,
                                                              accumulate);
    BERT_CUDA_LAUNCHED();
  });
}

bool cross_entropy_backward_with_column_sums(Graph<float>& g, const CrossEntropyRows& rows, DType dtype, const void* z,
                                             int64_t ld, const float* upstream, void* dz, float* dbias) {
  constexpr int kThreads = 256;
  const int pack = dtype == DType::kBF16 ? 8 : 4;  // elements in 16 bytes
  const bool aligned = reinterpret_cast<uintptr_t>(z) % 16 == 0 && reinterpret_cast<uintptr_t>(dz) % 16 == 0;
  if (rows.n == 0 || ld % pack != 0 || !aligned) return false;
  // About eight blocks of 256 threads an SM in all (the GPU's threads full), a column slice of 256 packs by
  // a range of rows each; then the row ranges' sums are added in order (add_column_sums).
  const int sms = g.device().cuda_context()->sm_count;
  const int64_t column_blocks = (ld / pack + kThreads - 1) / kThreads;
  const int64_t row_blocks = std::clamp<int64_t>(8 * int64_t(std::max(sms, 1)) / column_blocks, 1, rows.n);
  const int64_t rows_per_block = (rows.n + row_blocks - 1) / row_blocks;
  const int64_t used = (rows.n + rows_per_block - 1) / rows_per_block;
  if (used > 65535) return false;  // (the grid's y limit; not with these sizes)
  float* partial = g.scratch<float>(used * ld);
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    cross_entropy_backward_sums<A><<<dim3(unsigned(column_blocks), unsigned(used)), kThreads, 0, cuda::stream(g)>>>(
        static_cast<A*>(dz), static_cast<const A*>(z), upstream, rows.target, rows.weight, rows.logsumexp, rows.n,
        rows.c, ld, rows_per_block, partial);
    BERT_CUDA_LAUNCHED();
  });
  add_column_sums(g, partial, DType::kF32, used, rows.c, ld, dbias);
  return true;
}

Var sum(Graph<float>& g, Var x) {
  const DType dtype = g.dtype(x);
  Var y = g.emit(Shape{}, {x});
  const int64_t n = g.shape(x).numel();
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    sum_kernel<A><<<1, kReduceThreads, 0, cuda::stream(g)>>>(g.value(y).data(), cuda::typed<A>(g.data(x)), n);
    BERT_CUDA_LAUNCHED();
  });
  g.on_backward(y, [x, y, n, dtype](Graph<float>& g) {
    cuda::with_element_type(dtype, [&](auto tag) {
      using A = typename decltype(tag)::type;
      const auto dx = g.raw_grad_target(x);
      BERT_LAUNCH(broadcast_scalar_add<A>, n, g, cuda::typed<A>(dx.data), g.grad(y).data(), n, dx.accumulate);
    });
  });
  return y;
}

namespace {

// cross_entropy, and where `argmax` (device, one per row) is set each row's first largest column.
Var cross_entropy_rows_op(Graph<float>& g, Var logits, std::span<const int32_t> targets,
                          std::span<const float> weights, int32_t ignore_index, int32_t* argmax) {
  const Shape ls = g.shape(logits);
  BERT_CHECK(ls.rank() == 2, "cross_entropy: logits must be (N, C), got " + ls.str());
  BERT_CHECK(static_cast<int64_t>(targets.size()) == ls[0],
             "cross_entropy: " + std::to_string(targets.size()) + " targets for " + std::to_string(ls[0]) + " rows");
  const CrossEntropyRows rows = prepare_cross_entropy(g, targets, weights, ignore_index, ls[1]);
  Var y = g.emit(Shape{}, {logits});
  const DType dtype = g.dtype(logits);
  cross_entropy_forward(g, rows, dtype, g.data(logits), rows.c, argmax, g.value(y).data());
  g.on_backward(y, [logits, y, rows, dtype](Graph<float>& g) {
    if (rows.n == 0) return;
    const auto dz = g.raw_grad_target(logits);
    cross_entropy_backward(g, rows, dtype, g.data(logits), rows.c, g.grad(y).data(), dz.data, dz.accumulate);
  });
  return y;
}

}  // namespace

Var cross_entropy(Graph<float>& g, Var logits, std::span<const int32_t> targets, std::span<const float> weights,
                  int32_t ignore_index) {
  return cross_entropy_rows_op(g, logits, targets, weights, ignore_index, nullptr);
}

LinearScores cross_entropy_scores(Graph<float>& g, Var logits, std::span<const int32_t> targets, PredictionsTo to) {
  const int64_t n = g.shape(logits).rank() == 2 ? g.shape(logits)[0] : 0;
  int32_t* argmax = g.scratch<int32_t>(std::max<int64_t>(n, 1));
  LinearScores scores;
  scores.loss = cross_entropy_rows_op(g, logits, targets, {}, -1, argmax);
  if (to == PredictionsTo::kDevice) {
    scores.device_predictions = argmax;
    return scores;
  }
  scores.predictions.resize(static_cast<size_t>(n));
  g.device().copy_to_host(scores.predictions.data(), argmax, scores.predictions.size() * sizeof(int32_t));
  return scores;
}

// Shapes, the teacher and the temperature are checked by ops::distillation_loss before it dispatches here.
// In F32 whatever the logits' dtype (task logits are small: converting them costs nothing).
Var distillation_loss(Graph<float>& g, Var student, Var teacher, double temperature) {
  student = to_dtype(g, student, DType::kF32);
  if (g.dtype(teacher) != DType::kF32) {
    NoGradGuard<float> no_grad(g);
    teacher = to_dtype(g, teacher, DType::kF32);
  }
  const Shape ss = g.shape(student);
  const int64_t n = ss[0], c = ss[1];
  const float inv_t = static_cast<float>(1.0 / temperature);
  float* lse_student = g.scratch<float>(std::max<int64_t>(n, 1));
  float* lse_teacher = g.scratch<float>(std::max<int64_t>(n, 1));
  double* row_kl = g.scratch<double>(std::max<int64_t>(n, 1));
  Var y = g.emit(Shape{}, {student, teacher});
  if (n > 0) {
    distillation_rows<<<unsigned(n), 256, 0, cuda::stream(g)>>>(
        lse_student, lse_teacher, row_kl, g.value(student).data(), g.value(teacher).data(), c, inv_t);
    BERT_CUDA_LAUNCHED();
  }
  const double factor = n > 0 ? temperature * temperature / double(n) : 0.0;
  sum_rows_kernel<<<1, kReduceThreads, 0, cuda::stream(g)>>>(g.value(y).data(), row_kl, n, factor);
  BERT_CUDA_LAUNCHED();
  g.on_backward(y, [student, teacher, y, lse_student, lse_teacher, n, c, inv_t, temperature](Graph<float>& g) {
    if (n == 0) return;
    const auto ds = g.grad_target(student);
    distillation_backward<<<unsigned(n), 256, 0, cuda::stream(g)>>>(
        ds.data, g.value(student).data(), g.value(teacher).data(), g.grad(y).data(), lse_student, lse_teacher, c, inv_t,
        static_cast<float>(temperature / double(n)), ds.accumulate);
    BERT_CUDA_LAUNCHED();
  });
  return y;
}

std::vector<int32_t> row_argmax(const Graph<float>& g, Var x) {
  const Shape shape = g.shape(x);
  const int64_t c = shape.last(), rows = shape.rows();
  std::vector<int32_t> out(static_cast<size_t>(rows));
  if (rows == 0) return out;
  DeviceBuffer result(g.device(), out.size() * sizeof(int32_t));
  cuda::with_element_type(g.dtype(x), [&](auto tag) {
    using A = typename decltype(tag)::type;
    row_argmax_kernel<A>
        <<<unsigned(rows), 256, 0, cuda::stream(g)>>>(result.as<int32_t>(), cuda::typed<A>(g.data(x)), c);
    BERT_CUDA_LAUNCHED();
  });
  g.device().copy_to_host(out.data(), result.data(), out.size() * sizeof(int32_t));
  return out;
}

double abs_max(Graph<float>& g, Var x) {
  const int64_t n = g.shape(x).numel();
  unsigned* result = g.scratch<unsigned>(2);
  cuda::fill_zero(cuda::context(g.device()), result, 2 * sizeof(unsigned));
  cuda::with_element_type(g.dtype(x), [&](auto tag) {
    using A = typename decltype(tag)::type;
    if (n == 0) return;
    const unsigned blocks = std::min<unsigned>(cuda::blocks_for(n), 1024);
    abs_max_kernel<A><<<blocks, cuda::kThreads, 0, cuda::stream(g)>>>(result, cuda::typed<A>(g.data(x)), n);
    BERT_CUDA_LAUNCHED();
  });
  unsigned host[2];
  g.device().copy_to_host(host, result, sizeof host);
  if (host[1]) return std::numeric_limits<double>::infinity();
  float m;
  std::memcpy(&m, &host[0], sizeof m);
  return m;
}

std::vector<int64_t> abs_histogram(Graph<float>& g, Var x, double range, int bins) {
  const int64_t n = g.shape(x).numel();
  unsigned long long* counts = g.scratch<unsigned long long>(bins);
  cuda::fill_zero(cuda::context(g.device()), counts, bins * sizeof(unsigned long long));
  cuda::with_element_type(g.dtype(x), [&](auto tag) {
    using A = typename decltype(tag)::type;
    if (n == 0) return;
    const unsigned blocks = std::min<unsigned>(cuda::blocks_for(n), 1024);  // each block flushes `bins` counts
    abs_histogram_kernel<A><<<blocks, cuda::kThreads, bins * sizeof(unsigned), cuda::stream(g)>>>(
        counts, cuda::typed<A>(g.data(x)), n, bins / range, bins);
    BERT_CUDA_LAUNCHED();
  });
  std::vector<unsigned long long> host(static_cast<size_t>(bins));
  g.device().copy_to_host(host.data(), counts, host.size() * sizeof(unsigned long long));
  return std::vector<int64_t>(host.begin(), host.end());
}

}  // namespace bert::ops::cuda_impl
