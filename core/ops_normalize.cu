// Row-wise normalisations on a CUDA device (softmax with an additive mask, LayerNorm), forward and
// backward side by side like core/ops_normalize.cpp. One warp per row; LayerNorm's parameter gradients
// are column sums taken in two fixed-order passes (deterministic).
#include "core/cuda/common.cuh"
#include "core/ops_cuda.h"

namespace bert::ops::cuda_impl {

namespace {

constexpr int kWarpsPerBlock = 8;
inline unsigned row_blocks(int64_t rows) { return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock); }

template <typename A>
__global__ void softmax_forward(A* y, const A* x, const float* mask, int64_t rows, int64_t k, int64_t rows_per_item) {
  const int64_t r = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const A* in = x + r * k;
  const float* m = mask ? mask + (r / rows_per_item) * k : nullptr;
  A* out = y + r * k;
  float max = -INFINITY;
  for (int64_t j = lane; j < k; j += 32) max = fmaxf(max, cuda::to_float(in[j]) + (m ? m[j] : 0.0f));
  max = cuda::warp_max(max);
  float sum = 0;
  for (int64_t j = lane; j < k; j += 32) {
    const float e = expf(cuda::to_float(in[j]) + (m ? m[j] : 0.0f) - max);
    if constexpr (std::is_same_v<A, float>) out[j] = e;  // kept for the scaling pass below
    sum += e;
  }
  const float inv = 1.0f / cuda::warp_sum(sum);
  for (int64_t j = lane; j < k; j += 32) {
    if constexpr (std::is_same_v<A, float>) {
      out[j] *= inv;
    } else {  // the exponential again: a BF16 output would have rounded it before the scaling
      out[j] = cuda::from_float<A>(expf(cuda::to_float(in[j]) + (m ? m[j] : 0.0f) - max) * inv);
    }
  }
}

template <typename A>
__global__ void softmax_backward(A* dx, const A* dy, const A* y, int64_t rows, int64_t k, bool accumulate) {
  const int64_t r = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const A *yr = y + r * k, *dyr = dy + r * k;
  float dot = 0;
  for (int64_t j = lane; j < k; j += 32) dot += cuda::to_float(dyr[j]) * cuda::to_float(yr[j]);
  dot = cuda::warp_sum(dot);
  for (int64_t j = lane; j < k; j += 32)
    cuda::store_grad(dx, r * k + j, cuda::to_float(yr[j]) * (cuda::to_float(dyr[j]) - dot), accumulate);
}

template <typename A>
__global__ void layer_norm_forward(A* y, float* mean_out, float* rstd_out, const A* x, const float* gamma,
                                   const float* beta, int64_t rows, int64_t c, float eps) {
  const int64_t r = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const A* in = x + r * c;
  float sum = 0;
  for (int64_t j = lane; j < c; j += 32) sum += cuda::to_float(in[j]);
  const float mean = cuda::warp_sum(sum) / float(c);
  float var = 0;
  for (int64_t j = lane; j < c; j += 32) {
    const float d = cuda::to_float(in[j]) - mean;
    var += d * d;
  }
  const float rstd = rsqrtf(cuda::warp_sum(var) / float(c) + eps);
  for (int64_t j = lane; j < c; j += 32)
    y[r * c + j] = cuda::from_float<A>((cuda::to_float(in[j]) - mean) * rstd * gamma[j] + beta[j]);
  if (lane == 0) mean_out[r] = mean, rstd_out[r] = rstd;
}

template <typename A>
__global__ void layer_norm_backward_input(A* dx, const A* dy, const A* x, const float* gamma, const float* mean,
                                          const float* rstd, int64_t rows, int64_t c, bool accumulate) {
  const int64_t r = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const A *in = x + r * c, *dyr = dy + r * c;
  const float m = mean[r], rs = rstd[r];
  float mean_dn = 0, mean_dn_n = 0;
  for (int64_t j = lane; j < c; j += 32) {
    const float dn = cuda::to_float(dyr[j]) * gamma[j];
    mean_dn += dn;
    mean_dn_n += dn * (cuda::to_float(in[j]) - m) * rs;
  }
  mean_dn = cuda::warp_sum(mean_dn) / float(c);
  mean_dn_n = cuda::warp_sum(mean_dn_n) / float(c);
  for (int64_t j = lane; j < c; j += 32) {
    const float n = (cuda::to_float(in[j]) - m) * rs;
    cuda::store_grad(dx, r * c + j, rs * (cuda::to_float(dyr[j]) * gamma[j] - mean_dn - n * mean_dn_n), accumulate);
  }
}

// Pass 1: partial[chunk][col] of sum dy * n (gamma) and sum dy (beta) over the chunk's rows. Block (32,
// 8): 32 columns, 8 row lanes.
constexpr int64_t kRowsPerChunk = 256;
template <typename A>
__global__ void layer_norm_param_partials(float* partial_gamma, float* partial_beta, const A* dy, const A* x,
                                          const float* mean, const float* rstd, int64_t rows, int64_t c) {
  __shared__ float sg[8][33], sb[8][33];
  const int64_t col = blockIdx.x * 32 + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  float ag = 0, ab = 0;
  if (col < c) {
    const int64_t end = min(rows, (chunk + 1) * kRowsPerChunk);
    for (int64_t r = chunk * kRowsPerChunk + threadIdx.y; r < end; r += 8) {
      const float d = cuda::to_float(dy[r * c + col]);
      ag += d * (cuda::to_float(x[r * c + col]) - mean[r]) * rstd[r];
      ab += d;
    }
  }
  sg[threadIdx.y][threadIdx.x] = ag;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && col < c) {
    for (int k = 1; k < 8; ++k) ag += sg[k][threadIdx.x], ab += sb[k][threadIdx.x];
    partial_gamma[chunk * c + col] = ag;
    partial_beta[chunk * c + col] = ab;
  }
}

// Pass 2: sum the chunks of each column in order.
__global__ void layer_norm_param_sums(float* dgamma, float* dbeta, const float* partial_gamma,
                                      const float* partial_beta, int64_t chunks, int64_t c) {
  BERT_GRID_STRIDE(col, c) {
    float ag = 0, ab = 0;
    for (int64_t k = 0; k < chunks; ++k) ag += partial_gamma[k * c + col], ab += partial_beta[k * c + col];
    if (dgamma) dgamma[col] += ag;
    if (dbeta) dbeta[col] += ab;
  }
}

// LayerNorm's backward: the input's gradient, then gamma's and beta's (F32 parameters).
template <typename A>
void layer_norm_backward(Graph<float>& g, Var x, Var gamma, Var beta, Var y, const float* mean, const float* rstd,
                         int64_t rows, int64_t c) {
  const A* dy = cuda::typed<A>(g.grad_data(y));
  const A* xv = cuda::typed<A>(g.data(x));
  if (g.requires_grad(x)) {
    const auto dx = g.raw_grad_target(x);
    layer_norm_backward_input<A><<<row_blocks(rows), 32 * kWarpsPerBlock, 0, cuda::stream(g)>>>(
        cuda::typed<A>(dx.data), dy, xv, g.value(gamma).data(), mean, rstd, rows, c, dx.accumulate);
    BERT_CUDA_LAUNCHED();
  }
  float* dgamma = g.requires_grad(gamma) ? g.grad(gamma).data() : nullptr;
  float* dbeta = g.requires_grad(beta) ? g.grad(beta).data() : nullptr;
  if (!dgamma && !dbeta) return;
  const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  float* partial_gamma = g.scratch<float>(chunks * c);
  float* partial_beta = g.scratch<float>(chunks * c);
  layer_norm_param_partials<A><<<dim3(unsigned((c + 31) / 32), unsigned(chunks)), dim3(32, 8), 0, cuda::stream(g)>>>(
      partial_gamma, partial_beta, dy, xv, mean, rstd, rows, c);
  BERT_CUDA_LAUNCHED();
  BERT_LAUNCH(layer_norm_param_sums, c, g, dgamma, dbeta, partial_gamma, partial_beta, chunks, c);
}

}  // namespace

Var softmax(Graph<float>& g, Var x, Var mask) {
  const Shape xs = g.shape(x);
  const int64_t k = xs.last(), rows = xs.rows();
  const float* mv = nullptr;
  int64_t rows_per_item = rows;
  if (mask.valid()) {
    const Shape ms = g.shape(mask);
    BERT_CHECK(!g.requires_grad(mask), "softmax: the mask is a constant; its gradient is not supported");
    BERT_CHECK(xs.rank() >= 2 && ms == Shape({xs[0], k}),
               "softmax: mask " + ms.str() + " must be (B, K) for x " + xs.str());
    rows_per_item = rows / xs[0];
    mv = g.value(mask).data();
  }
  x = as_activation(g, x);
  const DType dtype = g.dtype(x);
  Var y = g.emit(xs, {x}, dtype);
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    softmax_forward<A><<<row_blocks(rows), 32 * kWarpsPerBlock, 0, cuda::stream(g)>>>(
        cuda::typed<A>(g.data(y)), cuda::typed<A>(g.data(x)), mv, rows, k, rows_per_item);
    BERT_CUDA_LAUNCHED();
  });
  g.on_backward(y, [x, y, k, rows, dtype](Graph<float>& g) {
    cuda::with_element_type(dtype, [&](auto tag) {
      using A = typename decltype(tag)::type;
      const auto dx = g.raw_grad_target(x);
      softmax_backward<A><<<row_blocks(rows), 32 * kWarpsPerBlock, 0, cuda::stream(g)>>>(
          cuda::typed<A>(dx.data), cuda::typed<A>(g.grad_data(y)), cuda::typed<A>(g.data(y)), rows, k, dx.accumulate);
      BERT_CUDA_LAUNCHED();
    });
  });
  return y;
}

Var layer_norm(Graph<float>& g, Var x, Var gamma, Var beta, double eps) {
  const Shape xs = g.shape(x);
  const int64_t c = xs.last(), rows = xs.rows();
  BERT_CHECK(g.shape(gamma) == Shape({c}) && g.shape(beta) == Shape({c}),
             "layer_norm: gamma " + g.shape(gamma).str() + " / beta " + g.shape(beta).str() + " for x " + xs.str());
  x = as_activation(g, x);
  const DType dtype = g.dtype(x);
  Var y = g.emit(xs, {x, gamma, beta}, dtype);
  float* mean = g.scratch<float>(rows);
  float* rstd = g.scratch<float>(rows);
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    layer_norm_forward<A><<<row_blocks(rows), 32 * kWarpsPerBlock, 0, cuda::stream(g)>>>(
        cuda::typed<A>(g.data(y)), mean, rstd, cuda::typed<A>(g.data(x)), g.value(gamma).data(), g.value(beta).data(),
        rows, c, static_cast<float>(eps));
    BERT_CUDA_LAUNCHED();
  });
  g.on_backward(y, [x, gamma, beta, y, mean, rstd, rows, c, dtype](Graph<float>& g) {
    cuda::with_element_type(dtype, [&](auto tag) {
      using A = typename decltype(tag)::type;
      layer_norm_backward<A>(g, x, gamma, beta, y, mean, rstd, rows, c);
    });
  });
  return y;
}

}  // namespace bert::ops::cuda_impl
