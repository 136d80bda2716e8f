// Fake quantization with the LSQ scale gradient on a CUDA device, forward and backward side by side
// like core/ops_quantize.cpp. It divides by the scale and rounds half to even (rintf) exactly as
// QuantizeLinear does, so the GPU agrees bit for bit with the CPU and the ONNX export. The scale
// gradient is summed per channel in fixed-size blocks in double, in a fixed order.
#include "core/cuda/common.cuh"
#include "core/ops_cuda.h"

namespace bert::ops::cuda_impl {

namespace {

// Elements per thread block, never straddling a channel: small enough that a per-tensor scale spreads
// over thousands of blocks (the GPU needs them to hide memory latency).
constexpr int64_t kBlock = int64_t{1} << 12;
constexpr int kThreads = 256;

// Grid (blocks_per_channel, channels): block (b, c) handles channel c's elements [b kBlock, (b+1) kBlock).
__global__ void fake_quantize_forward(float* y, const float* x, const float* scale, int64_t per_channel, float lo,
                                      float hi, unsigned long long* clipped) {
  __shared__ int64_t shared[32];
  const int64_t c = blockIdx.y;
  const int64_t begin = c * per_channel + blockIdx.x * kBlock;
  const int64_t end = min(begin + kBlock, (c + 1) * per_channel);
  const float s = scale[c];
  int64_t count = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float v = x[i] / s;
    const float q = rintf(v);
    count += (v < lo) | (v > hi);  // where backward's straight-through mask blocks the gradient
    y[i] = fminf(fmaxf(q, lo), hi) * s;
  }
  if (clipped) {
    count = cuda::block_sum(count, shared);
    if (threadIdx.x == 0 && count) atomicAdd(clipped, static_cast<unsigned long long>(count));
  }
}

__global__ void fake_quantize_backward(float* dx, double* partial, const float* dy, const float* x, const float* scale,
                                       int64_t per_channel, float lo, float hi, bool accumulate) {
  __shared__ double shared[32];
  const int64_t c = blockIdx.y;
  const int64_t begin = c * per_channel + blockIdx.x * kBlock;
  const int64_t end = min(begin + kBlock, (c + 1) * per_channel);
  const float s = scale[c];
  double acc = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const float v = x[i] / s;
    const bool inside = !(v < lo) && !(v > hi);  // the straight-through estimator passes dy inside the range
    if (dx) cuda::store_grad(dx, i, inside ? dy[i] : 0.0f, accumulate);
    if (v < lo) {
      acc += double(dy[i]) * lo;
    } else if (v > hi) {
      acc += double(dy[i]) * hi;
    } else {
      acc += double(dy[i]) * (rintf(v) - v);
    }
  }
  if (partial) {
    acc = cuda::block_sum(acc, shared);
    if (threadIdx.x == 0) partial[c * gridDim.x + blockIdx.x] = acc;
  }
}

// One block per channel sums its partials (a fixed tree: deterministic).
__global__ void scale_gradient_sums(float* ds, const double* partial, int64_t blocks_per_channel, double grad_scale) {
  __shared__ double shared[32];
  const int64_t c = blockIdx.x;
  double total = 0;
  for (int64_t b = threadIdx.x; b < blocks_per_channel; b += blockDim.x) total += partial[c * blocks_per_channel + b];
  total = cuda::block_sum(total, shared);
  if (threadIdx.x == 0) ds[c] += static_cast<float>(grad_scale * total);
}

}  // namespace

Var fake_quantize(Graph<float>& g, Var x, Var scale, int qmin, int qmax, double grad_scale, int64_t* clipped) {
  const int64_t n = g.value(x).numel();
  const int64_t channels = g.value(scale).numel();
  BERT_CHECK(g.shape(scale).rank() == 1 && channels >= 1 && n % channels == 0,
             "fake_quantize: scale " + g.shape(scale).str() + " does not divide x " + g.shape(x).str());
  BERT_CHECK(qmin < 0 && qmax > 0, "fake_quantize: need qmin < 0 < qmax");
  const int64_t per_channel = n / channels;
  const int64_t blocks_per_channel = std::max<int64_t>(1, (per_channel + kBlock - 1) / kBlock);
  BERT_CHECK(channels <= 65535, "fake_quantize on a GPU: at most 65535 channels");
  const dim3 grid(static_cast<unsigned>(blocks_per_channel), static_cast<unsigned>(channels));
  const float lo = static_cast<float>(qmin), hi = static_cast<float>(qmax);
  Var y = g.emit(g.shape(x), {x, scale});
  if (n > 0) {
    fake_quantize_forward<<<grid, kThreads, 0, cuda::stream(g)>>>(g.value(y).data(), g.value(x).data(),
                                                                  g.value(scale).data(), per_channel, lo, hi,
                                                                  reinterpret_cast<unsigned long long*>(clipped));
    BERT_CUDA_LAUNCHED();
  }
  g.on_backward(y, [=](Graph<float>& g) {
    if (n == 0) return;
    const auto dx_target = g.requires_grad(x) ? g.grad_target(x) : Graph<float>::GradTarget{nullptr, false};
    float* dx = dx_target.data;
    float* ds = g.requires_grad(scale) ? g.grad(scale).data() : nullptr;
    double* partial = ds ? g.scratch<double>(blocks_per_channel * channels) : nullptr;
    fake_quantize_backward<<<grid, kThreads, 0, cuda::stream(g)>>>(dx, partial, g.grad(y).data(), g.value(x).data(),
                                                                   g.value(scale).data(), per_channel, lo, hi,
                                                                   dx_target.accumulate);
    BERT_CUDA_LAUNCHED();
    if (ds) {
      const unsigned threads = blocks_per_channel > 32 ? 256 : 32;
      scale_gradient_sums<<<static_cast<unsigned>(channels), threads, 0, cuda::stream(g)>>>(
          ds, partial, blocks_per_channel, grad_scale);
      BERT_CUDA_LAUNCHED();
    }
  });
  return y;
}

}  // namespace bert::ops::cuda_impl
