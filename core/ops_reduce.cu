// Reductions on a CUDA device (sum, cross-entropy) and the row argmax query, forward and backward side
// by side like core/ops_reduce.cpp. Sums over many elements accumulate in double in a fixed order.
#include <cfloat>
#include <cstring>
#include <limits>

#include "core/cuda/common.cuh"
#include "core/ops_cuda.h"

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

// One block per row: logsumexp of the row and the row's weighted loss (0 for skipped rows).
template <typename A>
__global__ void cross_entropy_rows(float* logsumexp, double* row_loss, const A* z, const int32_t* target,
                                   const float* row_weight, int64_t c) {
  __shared__ float shared_f[32];
  const int64_t r = blockIdx.x;
  if (row_weight[r] == 0.0f) {  // uniform per block: every thread returns
    if (threadIdx.x == 0) row_loss[r] = 0.0, logsumexp[r] = 0.0f;
    return;
  }
  const A* row = z + r * c;
  float max = -INFINITY;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) max = fmaxf(max, cuda::to_float(row[j]));
  max = cuda::warp_max(max);
  __syncthreads();
  if (threadIdx.x % 32 == 0) shared_f[threadIdx.x / 32] = max;
  __syncthreads();
  max = threadIdx.x % 32 < blockDim.x / 32 ? shared_f[threadIdx.x % 32] : -INFINITY;  // every warp
  max = cuda::warp_max(max);
  float sum = 0;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) sum += expf(cuda::to_float(row[j]) - max);
  sum = cuda::block_sum(sum, shared_f);
  if (threadIdx.x == 0) {
    const float lse = max + logf(sum);
    logsumexp[r] = lse;
    row_loss[r] = double(row_weight[r]) * (double(lse) - double(cuda::to_float(row[target[r]])));
  }
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

template <typename A>
__global__ void cross_entropy_backward(A* dz, const A* z, const float* upstream, const int32_t* target,
                                       const float* row_weight, const float* logsumexp, int64_t c, bool accumulate) {
  const int64_t r = blockIdx.x;
  if (row_weight[r] == 0.0f) {  // a skipped row: its gradient is zero
    if (!accumulate)
      for (int64_t j = threadIdx.x; j < c; j += blockDim.x) dz[r * c + j] = cuda::from_float<A>(0.0f);
    return;
  }
  const float w = upstream[0] * row_weight[r], lse = logsumexp[r];
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
    float d = w * expf(cuda::to_float(z[r * c + j]) - lse);
    if (j == target[r]) d -= w;
    cuda::store_grad(dz, r * c + j, d, accumulate);
  }
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

Var cross_entropy(Graph<float>& g, Var logits, std::span<const int32_t> targets, std::span<const float> weights,
                  int32_t ignore_index) {
  const Shape ls = g.shape(logits);
  BERT_CHECK(ls.rank() == 2, "cross_entropy: logits must be (N, C), got " + ls.str());
  const int64_t n = ls[0], c = ls[1];
  BERT_CHECK(static_cast<int64_t>(targets.size()) == n,
             "cross_entropy: " + std::to_string(targets.size()) + " targets for " + std::to_string(n) + " rows");
  BERT_CHECK(weights.empty() || static_cast<int64_t>(weights.size()) == n, "cross_entropy: weights size");
  // Row weights normalised on the host exactly as on the CPU; targets of skipped rows become 0.
  std::vector<int32_t> target(static_cast<size_t>(n));
  std::vector<float> row_weight(static_cast<size_t>(n));
  double total_weight = 0;
  for (int64_t i = 0; i < n; ++i) {
    const bool active = targets[i] != ignore_index;
    if (active)
      BERT_CHECK(targets[i] >= 0 && targets[i] < c,
                 "cross_entropy: target " + std::to_string(targets[i]) + " outside [0, " + std::to_string(c) + ")");
    target[i] = active ? targets[i] : 0;
    row_weight[i] = active ? (weights.empty() ? 1.0f : weights[i]) : 0.0f;
    total_weight += row_weight[i];
  }
  const float inv_total = total_weight > 0 ? static_cast<float>(1.0 / total_weight) : 0.0f;
  for (float& w : row_weight) w *= inv_total;
  const int32_t* d_target = g.upload(target.data(), target.size());
  const float* d_weight = g.upload(row_weight.data(), row_weight.size());
  float* logsumexp = g.scratch<float>(std::max<int64_t>(n, 1));
  double* row_loss = g.scratch<double>(std::max<int64_t>(n, 1));
  Var y = g.emit(Shape{}, {logits});
  const DType dtype = g.dtype(logits);
  if (n > 0) {
    cuda::with_element_type(dtype, [&](auto tag) {
      using A = typename decltype(tag)::type;
      cross_entropy_rows<A><<<unsigned(n), 256, 0, cuda::stream(g)>>>(
          logsumexp, row_loss, cuda::typed<A>(g.data(logits)), d_target, d_weight, c);
      BERT_CUDA_LAUNCHED();
    });
  }
  sum_rows_kernel<<<1, kReduceThreads, 0, cuda::stream(g)>>>(g.value(y).data(), row_loss, n, 1.0);
  BERT_CUDA_LAUNCHED();
  g.on_backward(y, [logits, y, d_target, d_weight, logsumexp, n, c, dtype](Graph<float>& g) {
    if (n == 0) return;
    cuda::with_element_type(dtype, [&](auto tag) {
      using A = typename decltype(tag)::type;
      const auto dz = g.raw_grad_target(logits);
      cross_entropy_backward<A>
          <<<unsigned(n), 256, 0, cuda::stream(g)>>>(cuda::typed<A>(dz.data), cuda::typed<A>(g.data(logits)),
                                                     g.grad(y).data(), d_target, d_weight, logsumexp, c, dz.accumulate);
      BERT_CUDA_LAUNCHED();
    });
  });
  return y;
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
