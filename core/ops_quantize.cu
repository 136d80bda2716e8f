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

// Grid (blocks_per_channel, channels): block (b, c) handles channel c's elements [b kBlock, (b+1) kBlock),
// each thread W consecutive elements at a time (W = 4 when every channel holds a multiple of 4 and the
// buffers are 16-byte aligned: fewer, wider memory accesses).
template <int W, typename Y, typename X>
__global__ void fake_quantize_forward(Y* y, const X* x, const float* scale, int64_t per_channel, float lo, float hi,
                                      unsigned long long* clipped) {
  __shared__ int64_t shared[32];
  const int64_t c = blockIdx.y;
  const int64_t begin = c * per_channel + blockIdx.x * kBlock;
  const int64_t end = min(begin + kBlock, (c + 1) * per_channel);
  const float s = scale[c];
  int64_t count = 0;
  for (int64_t i = begin + W * threadIdx.x; i < end; i += W * int64_t(blockDim.x)) {
    const cuda::Pack<X, W> in = cuda::load_pack<W>(x + i);
    cuda::Pack<Y, W> out;
    for (int j = 0; j < W; ++j) {
      const float v = cuda::to_float(in.v[j]) / s;
      count += (v < lo) | (v > hi);  // where backward's straight-through mask blocks the gradient
      out.v[j] = cuda::from_float<Y>(fminf(fmaxf(rintf(v), lo), hi) * s);
    }
    cuda::store_pack<W>(y + i, out);
  }
  if (clipped) {
    count = cuda::block_sum(count, shared);
    if (threadIdx.x == 0 && count) atomicAdd(clipped, static_cast<unsigned long long>(count));
  }
}

template <int W, typename Y, typename X>
__global__ void fake_quantize_backward(X* dx, double* partial, const Y* dy, const X* x, const float* scale,
                                       int64_t per_channel, float lo, float hi, bool accumulate) {
  __shared__ double shared[32];
  const int64_t c = blockIdx.y;
  const int64_t begin = c * per_channel + blockIdx.x * kBlock;
  const int64_t end = min(begin + kBlock, (c + 1) * per_channel);
  const float s = scale[c];
  double acc = 0;
  for (int64_t i = begin + W * threadIdx.x; i < end; i += W * int64_t(blockDim.x)) {
    const cuda::Pack<X, W> in = cuda::load_pack<W>(x + i);
    const cuda::Pack<Y, W> up = cuda::load_pack<W>(dy + i);
    cuda::Pack<X, W> grad;
    if (dx && accumulate) grad = cuda::load_pack<W>(dx + i);
    float part = 0;  // this pack's share of the scale gradient
    for (int j = 0; j < W; ++j) {
      const float v = cuda::to_float(in.v[j]) / s;
      const float d = cuda::to_float(up.v[j]);
      const bool inside = !(v < lo) && !(v > hi);  // the straight-through estimator passes dy inside the range
      const float pass = inside ? d : 0.0f;
      grad.v[j] = cuda::from_float<X>(accumulate ? cuda::to_float(grad.v[j]) + pass : pass);
      part += d * (v < lo ? lo : v > hi ? hi : rintf(v) - v);
    }
    if (dx) cuda::store_pack<W>(dx + i, grad);
    acc += part;
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

// The output in the activation dtype (BF16 in mixed precision: q s rounded to 8 mantissa bits, which
// for |q| <= 256 is q times s rounded once); x, often an F32 weight, in its own.
Var fake_quantize(Graph<float>& g, Var x, Var scale, int qmin, int qmax, double grad_scale, int64_t* clipped) {
  const int64_t n = g.shape(x).numel();
  const int64_t channels = g.value(scale).numel();
  BERT_CHECK(g.shape(scale).rank() == 1 && channels >= 1 && n % channels == 0,
             "fake_quantize: scale " + g.shape(scale).str() + " does not divide x " + g.shape(x).str());
  BERT_CHECK(qmin < 0 && qmax > 0, "fake_quantize: need qmin < 0 < qmax");
  const int64_t per_channel = n / channels;
  const int64_t blocks_per_channel = std::max<int64_t>(1, (per_channel + kBlock - 1) / kBlock);
  BERT_CHECK(channels <= 65535, "fake_quantize on a GPU: at most 65535 channels");
  const dim3 grid(static_cast<unsigned>(blocks_per_channel), static_cast<unsigned>(channels));
  const float lo = static_cast<float>(qmin), hi = static_cast<float>(qmax);
  const DType in_type = g.dtype(x), out_type = g.activation_dtype();
  Var y = g.emit(g.shape(x), {x, scale}, out_type);
  const bool packed = cuda::packs_of_4(per_channel, {g.data(x), g.data(y)});
  if (n > 0) {
    cuda::with_element_type(out_type, [&](auto out_tag) {
      cuda::with_element_type(in_type, [&](auto in_tag) {
        using Y = typename decltype(out_tag)::type;
        using X = typename decltype(in_tag)::type;
        auto* kernel = packed ? &fake_quantize_forward<4, Y, X> : &fake_quantize_forward<1, Y, X>;
        kernel<<<grid, kThreads, 0, cuda::stream(g)>>>(cuda::typed<Y>(g.data(y)), cuda::typed<X>(g.data(x)),
                                                       g.value(scale).data(), per_channel, lo, hi,
                                                       reinterpret_cast<unsigned long long*>(clipped));
        BERT_CUDA_LAUNCHED();
      });
    });
  }
  g.on_backward(y, [=](Graph<float>& g) {
    if (n == 0) return;
    const auto dx_target = g.requires_grad(x) ? g.raw_grad_target(x) : Graph<float>::RawGradTarget{nullptr, false};
    float* ds = g.requires_grad(scale) ? g.grad(scale).data() : nullptr;
    double* partial = ds ? g.scratch<double>(blocks_per_channel * channels) : nullptr;
    cuda::with_element_type(out_type, [&](auto out_tag) {
      cuda::with_element_type(in_type, [&](auto in_tag) {
        using Y = typename decltype(out_tag)::type;
        using X = typename decltype(in_tag)::type;
        void* dy = g.grad_data(y);
        const bool packed = cuda::packs_of_4(per_channel, {dy, g.data(x), dx_target.data});
        auto* kernel = packed ? &fake_quantize_backward<4, Y, X> : &fake_quantize_backward<1, Y, X>;
        kernel<<<grid, kThreads, 0, cuda::stream(g)>>>(cuda::typed<X>(dx_target.data), partial, cuda::typed<Y>(dy),
                                                       cuda::typed<X>(g.data(x)), g.value(scale).data(), per_channel,
                                                       lo, hi, dx_target.accumulate);
        BERT_CUDA_LAUNCHED();
      });
    });
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
