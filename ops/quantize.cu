// Fake quantization with the LSQ scale gradient on a CUDA device, forward and backward side by side
// like ops/quantize.cpp. It divides by the scale and rounds half to even (rintf) exactly as
// QuantizeLinear does, so the GPU agrees bit for bit with the CPU and the ONNX export. The scale
// gradient is summed per channel in fixed-size blocks in double, in a fixed order.
#include <algorithm>
#include <memory>
#include <numeric>
#include <vector>

#include "ops/cuda/fake_quantize.cuh"
#include "ops/cuda_impl.h"

namespace bert::ops::cuda_impl {

// The output in the activation dtype (BF16 in mixed precision: q s rounded to 8 mantissa bits, which
// for |q| <= 256 is q times s rounded once); x, often an F32 weight, in its own.
Var fake_quantize(Graph<float>& g, Var x, Var scale, int qmin, int qmax, double grad_scale, int64_t* clipped,
                  bool integers) {
  const int64_t n = g.shape(x).numel();
  const int64_t channels = g.value(scale).numel();
  BERT_CHECK(g.shape(scale).rank() == 1 && channels >= 1 && n % channels == 0,
             "fake_quantize: scale " + g.shape(scale).str() + " does not divide x " + g.shape(x).str());
  BERT_CHECK(qmin < 0 && qmax > 0, "fake_quantize: need qmin < 0 < qmax");
  BERT_CHECK(channels <= 65535, "fake_quantize on a GPU: at most 65535 channels");
  cuda::QuantizeLaunch q{g.value(scale).data(),    nullptr,    n,      channels, static_cast<float>(qmin),
                         static_cast<float>(qmax), grad_scale, clipped};
  const DType in_type = g.dtype(x), out_type = g.activation_dtype();
  Var y = g.emit(g.shape(x), {x, scale}, out_type);
  if (integers && channels == 1 && qmin >= -128 && qmax <= 127) {
    q.integers = g.scratch<int8_t>(std::size_t(n));
    g.set_integers(y, q.integers);
  }
  cuda::with_element_type(out_type, [&](auto out_tag) {
    cuda::with_element_type(in_type, [&](auto in_tag) {
      using Y = typename decltype(out_tag)::type;
      using X = typename decltype(in_tag)::type;
      const int width = cuda::pack_width(sizeof(Y), sizeof(X), q.per_channel(), {g.data(x), g.data(y)});
      cuda::launch_fake_quantize_forward(g, q, cuda::typed<Y>(g.data(y)),
                                         cuda::TensorSource<X>{cuda::typed<X>(g.data(x)), nullptr}, width);
    });
  });
  g.on_backward(y, [=](Graph<float>& g) {
    const auto dx = g.requires_grad(x) ? g.raw_grad_target(x) : Graph<float>::RawGradTarget{nullptr, false};
    cuda::QuantizeLaunch back = q;
    back.scale_grad = g.requires_grad(scale) ? g.grad(scale).data() : nullptr;
    cuda::with_element_type(out_type, [&](auto out_tag) {
      cuda::with_element_type(in_type, [&](auto in_tag) {
        using Y = typename decltype(out_tag)::type;
        using X = typename decltype(in_tag)::type;
        void* dy = g.grad_data(y);
        const int width = cuda::pack_width(sizeof(Y), sizeof(X), q.per_channel(), {dy, g.data(x), dx.data});
        cuda::launch_fake_quantize_backward(g, back, cuda::typed<Y>(dy),
                                            cuda::TensorSource<X>{cuda::typed<X>(g.data(x)), cuda::typed<X>(dx.data)},
                                            width, dx.accumulate);
      });
    });
  });
  return y;
}

namespace {

// fake_quantize_each: up to kMaxEach per-tensor quantizers of one input, in one pass each way.
constexpr int kMaxEach = 4;
template <typename A>
struct Each {
  int k;
  const float* scale[kMaxEach];
  float lo[kMaxEach], hi[kMaxEach];
  A* y[kMaxEach];
  const A* dy[kMaxEach];  // nullptr: that output has no gradient
  float* ds[kMaxEach];    // nullptr: no scale gradient wanted
  double grad_scale[kMaxEach];
  unsigned long long* clipped[kMaxEach];
};

// Block b handles elements [b kQuantizeBlock, (b + 1) kQuantizeBlock), each thread W at a time.
template <int W, typename A>
__global__ void fake_quantize_each_forward(Each<A> e, const A* x, int64_t n) {
  __shared__ int64_t shared[32];
  const int64_t begin = blockIdx.x * cuda::kQuantizeBlock, end = min(begin + cuda::kQuantizeBlock, n);
  int count[kMaxEach] = {0, 0, 0, 0};  // each at most kQuantizeBlock
  // The divisions made once (a reciprocal each), and tested once for their branch-free quotient.
  cuda::ScaleDivision divide[kMaxEach] = {cuda::ScaleDivision(1.0f), cuda::ScaleDivision(1.0f),
                                          cuda::ScaleDivision(1.0f), cuda::ScaleDivision(1.0f)};
  bool normal = true;
#pragma unroll
  for (int q = 0; q < kMaxEach; ++q)
    if (q < e.k) divide[q] = cuda::ScaleDivision(*e.scale[q]), normal = normal && divide[q].normal;
  cuda::with_division(normal, [&](auto normal_tag) {
    constexpr bool kNormal = decltype(normal_tag)::value;
    for (int64_t i = begin + W * threadIdx.x; i < end; i += W * int64_t(blockDim.x)) {
      const cuda::Pack<A, W> in = cuda::load_pack<W>(x + i);
#pragma unroll
      for (int q = 0; q < kMaxEach; ++q) {
        if (q >= e.k) break;
        cuda::Pack<A, W> out;
        for (int j = 0; j < W; ++j)
          out.v[j] = cuda::from_float<A>(
              cuda::fake_quantize_value<kNormal>(cuda::to_float(in.v[j]), divide[q], e.lo[q], e.hi[q], count[q]));
        cuda::store_pack<W>(e.y[q] + i, out);
      }
    }
  });
#pragma unroll
  for (int q = 0; q < kMaxEach; ++q) {
    if (q >= e.k || !e.clipped[q]) continue;
    const int64_t c = cuda::block_sum(int64_t{count[q]}, shared);
    if (threadIdx.x == 0 && c) atomicAdd(e.clipped[q], static_cast<unsigned long long>(c));
  }
}

// dx (+)= the sum of each quantizer's straight-through gradient; each scale's gradient summed as in
// fake_quantize_backward (block shares in double, the last block adds them up in block order). Held to six
// blocks an SM (40 registers; BF16 spills 32 bytes a thread): at 64 registers, four blocks an SM, the kernel
// waited on memory at 1.4 TB/s (BERT-base b64 BF16 on an H200, a LayerNorm's two quantizers: 29.7 -> 27.3 us).
// K = e.k, known when compiled: with arrays sized for kMaxEach quantizers and loops bounded at run time, the
// unused ones' divisions and sums held registers (a LayerNorm's two in BF16 spilled 32 bytes a thread, now
// 20: 27.5 -> 26.2 us).
template <int W, int K, typename A>
__global__ void __launch_bounds__(cuda::kThreads, 6)
    fake_quantize_each_backward(Each<A> e, A* dx, const A* x, int64_t n, bool accumulate, double* partial,
                                unsigned int* arrivals) {
  __shared__ double shared[32];
  __shared__ bool last;
  const int64_t begin = blockIdx.x * cuda::kQuantizeBlock, end = min(begin + cuda::kQuantizeBlock, n);
  double acc[K] = {};
  // The divisions made once, and tested once for their branch-free quotient (as in the forward).
  cuda::ScaleDivision divide[K];
  bool normal = true;
#pragma unroll
  for (int q = 0; q < K; ++q)
    if (e.dy[q]) divide[q] = cuda::ScaleDivision(*e.scale[q]), normal = normal && divide[q].normal;
  cuda::with_division(normal, [&](auto normal_tag) {
    constexpr bool kNormal = decltype(normal_tag)::value;
    for (int64_t i = begin + W * threadIdx.x; i < end; i += W * int64_t(blockDim.x)) {
      const cuda::Pack<A, W> in = cuda::load_pack<W>(x + i);
      float total[W];
      for (int j = 0; j < W; ++j) total[j] = 0.0f;
#pragma unroll
      for (int q = 0; q < K; ++q) {
        if (!e.dy[q]) continue;
        const cuda::Pack<A, W> up = cuda::load_pack<W>(e.dy[q] + i);
        float part = 0;
        for (int j = 0; j < W; ++j)
          total[j] += cuda::fake_quantize_value_grad<kNormal>(cuda::to_float(in.v[j]), cuda::to_float(up.v[j]), 1.0f,
                                                              divide[q], e.lo[q], e.hi[q], part);
        acc[q] += part;
      }
      if (dx) cuda::store_grad_pack<W>(dx + i, total, accumulate);
    }
  });
  bool any_scale = false;
#pragma unroll
  for (int q = 0; q < K; ++q) {
    if (!e.ds[q]) continue;
    any_scale = true;
    acc[q] = cuda::block_sum(acc[q], shared);
    if (gridDim.x == 1) {
      if (threadIdx.x == 0) *e.ds[q] += static_cast<float>(e.grad_scale[q] * acc[q]);
    } else if (threadIdx.x == 0) {
      partial[q * gridDim.x + blockIdx.x] = acc[q];
    }
  }
  if (!any_scale || gridDim.x == 1) return;
  if (threadIdx.x == 0) {
    __threadfence();  // the shares are visible everywhere before this block counts as arrived
    last = atomicAdd(arrivals, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  for (int q = 0; q < K; ++q) {
    if (!e.ds[q]) continue;
    double total = 0;
    for (unsigned b = threadIdx.x; b < gridDim.x; b += blockDim.x) total += __ldcg(partial + q * gridDim.x + b);
    total = cuda::block_sum(total, shared);
    if (threadIdx.x == 0) *e.ds[q] += static_cast<float>(e.grad_scale[q] * total);
  }
  if (threadIdx.x == 0) *arrivals = 0;
}

}  // namespace

namespace {

// fake_quantize_many: up to kMaxMany F32 tensors, a warp a channel, kChannels of one tensor a block (grid:
// every tensor's blocks in turn). A block a channel (fake_quantize's layout for channels that fit one) made
// thousands of small blocks, whose starting and finishing bounded the kernel (about 7 ns a block however
// many tensors one launch took: a layer's six weights in 50 us). A channel's scale gradient is its warp's
// sum in double (a fixed tree), added by lane 0: one writer a channel, deterministic.
// A lane loads kManyPacks packs before it stores any (the stores may alias the loads, so the compiler
// would not move a later pack's loads above them): a 3,072-wide row is 24 packs of 4 a lane.
constexpr int kMaxMany = 8, kChannels = cuda::kThreads / 32, kManyPacks = 4;
template <typename Y>
struct Many {
  int k;
  unsigned first[kMaxMany + 1];  // tensor t's channels are in blocks first[t] .. first[t + 1] - 1
  const float* x[kMaxMany];
  Y* y[kMaxMany];
  int8_t* integers[kMaxMany];  // nullptr: none written (QuantizeOutput::integers)
  const float* scale[kMaxMany];
  int64_t channels[kMaxMany], per_channel[kMaxMany];
  float lo[kMaxMany], hi[kMaxMany];
  unsigned long long* clipped[kMaxMany];
  const Y* dy[kMaxMany];  // backward: nullptr, that output took no gradient
  float* dx[kMaxMany];    // nullptr: that input takes none
  bool accumulate[kMaxMany];
  float* ds[kMaxMany];  // nullptr: no scale gradient wanted
  double grad_scale[kMaxMany];
};
// The block's tensor and the warp's channel (channels at or past the tensor's count: none). The table's
// fields are read through compile-time indices (loops that unroll): a kernel parameter indexed at run time
// is copied to local memory first.
struct ManyBlock {
  int t;
  int64_t channel;
};
template <typename Y>
__device__ __forceinline__ ManyBlock many_block(const Many<Y>& m) {
  ManyBlock b{0, 0};
#pragma unroll
  for (int t = 1; t < kMaxMany; ++t)
    if (t < m.k && blockIdx.x >= m.first[t]) b.t = t;
#pragma unroll
  for (int t = 0; t < kMaxMany; ++t)
    if (t == b.t) b.channel = int64_t(blockIdx.x - m.first[t]) * kChannels + threadIdx.x / 32;
  return b;
}
template <typename V>
__device__ __forceinline__ V pick(const V (&field)[kMaxMany], int t) {
  V v{};
#pragma unroll
  for (int i = 0; i < kMaxMany; ++i)
    if (i == t) v = field[i];
  return v;
}

template <int W, typename Y>
__global__ void __launch_bounds__(cuda::kThreads) fake_quantize_many_forward(Many<Y> m) {
  __shared__ int64_t shared[32];
  const ManyBlock b = many_block(m);
  int count = 0;
  if (b.channel < pick(m.channels, b.t)) {  // no early return: the saturation count is the block's sum
    const int64_t per = pick(m.per_channel, b.t), begin = b.channel * per, end = begin + per;
    const float* x = pick(m.x, b.t);
    Y* y = pick(m.y, b.t);
    int8_t* integers = pick(m.integers, b.t);
    const float lo = pick(m.lo, b.t), hi = pick(m.hi, b.t);
    const cuda::ScaleDivision divide(pick(m.scale, b.t)[b.channel]);
    cuda::with_division(divide.normal, [&](auto normal) {
      for (int64_t i0 = begin + W * (threadIdx.x % 32); i0 < end; i0 += 32 * W * kManyPacks) {
        cuda::Pack<float, W> in[kManyPacks];
#pragma unroll
        for (int u = 0; u < kManyPacks; ++u)
          if (i0 + u * 32 * W < end) in[u] = cuda::load_pack<W>(x + i0 + u * 32 * W);
#pragma unroll
        for (int u = 0; u < kManyPacks; ++u) {
          if (i0 + u * 32 * W >= end) break;
          cuda::Pack<Y, W> out;
          if (integers) {  // (the same for the whole block)
            cuda::Pack<int8_t, W> q;
            for (int j = 0; j < W; ++j) {
              const float v = cuda::fake_quantize_integer<decltype(normal)::value>(in[u].v[j], divide, lo, hi, count);
              q.v[j] = static_cast<int8_t>(v);
              out.v[j] = cuda::from_float<Y>(v * divide.s);
            }
            cuda::store_pack<W>(integers + i0 + u * 32 * W, q);
          } else {
            for (int j = 0; j < W; ++j)
              out.v[j] = cuda::from_float<Y>(
                  cuda::fake_quantize_value<decltype(normal)::value>(in[u].v[j], divide, lo, hi, count));
          }
          cuda::store_pack<W>(y + i0 + u * 32 * W, out);
        }
      }
    });
  }
  unsigned long long* clipped = pick(m.clipped, b.t);
  if (clipped) {  // the same for the whole block
    const int64_t total = cuda::block_sum(int64_t{count}, shared);
    if (threadIdx.x == 0 && total) atomicAdd(clipped, static_cast<unsigned long long>(total));
  }
}

template <int W, typename Y>
__global__ void __launch_bounds__(cuda::kThreads) fake_quantize_many_backward(Many<Y> m) {
  const ManyBlock b = many_block(m);
  const Y* dy = pick(m.dy, b.t);
  if (!dy || b.channel >= pick(m.channels, b.t)) return;  // nothing shared between warps
  const int64_t per = pick(m.per_channel, b.t), begin = b.channel * per, end = begin + per;
  const float* x = pick(m.x, b.t);
  float* dx = pick(m.dx, b.t);
  const bool accumulate = pick(m.accumulate, b.t);
  const float lo = pick(m.lo, b.t), hi = pick(m.hi, b.t);
  const cuda::ScaleDivision divide(pick(m.scale, b.t)[b.channel]);
  double acc = 0;
  cuda::with_division(divide.normal, [&](auto normal) {
    for (int64_t i0 = begin + W * (threadIdx.x % 32); i0 < end; i0 += 32 * W * kManyPacks) {
      cuda::Pack<float, W> in[kManyPacks];
      cuda::Pack<Y, W> up[kManyPacks];
#pragma unroll
      for (int u = 0; u < kManyPacks; ++u)
        if (i0 + u * 32 * W < end)
          in[u] = cuda::load_pack<W>(x + i0 + u * 32 * W), up[u] = cuda::load_pack<W>(dy + i0 + u * 32 * W);
#pragma unroll
      for (int u = 0; u < kManyPacks; ++u) {
        const int64_t i = i0 + u * 32 * W;
        if (i >= end) break;
        float pass[W];
        float part = 0;  // this pack's share of the scale gradient
        for (int j = 0; j < W; ++j)
          pass[j] = cuda::fake_quantize_value_grad<decltype(normal)::value>(in[u].v[j], cuda::to_float(up[u].v[j]),
                                                                            1.0f, divide, lo, hi, part);
        if (dx) cuda::store_grad_pack<W>(dx + i, pass, accumulate);
        acc += part;
      }
    }
  });
  float* ds = pick(m.ds, b.t);
  if (!ds) return;
  acc = cuda::warp_sum(acc);
  if (threadIdx.x % 32 == 0) ds[b.channel] += static_cast<float>(pick(m.grad_scale, b.t) * acc);
}

}  // namespace

std::vector<Var> fake_quantize_many(Graph<float>& g, std::span<const QuantizeInput> inputs) {
  const int k = static_cast<int>(inputs.size());
  if (k == 0 || k > kMaxMany) return {};
  int64_t blocks = 0;
  for (const QuantizeInput& in : inputs) {
    const int64_t n = g.shape(in.x).numel(), channels = g.value(in.q.scale).numel();
    if (g.dtype(in.x) != DType::kF32 || n == 0 || channels < 1 || n % channels != 0 ||
        n / channels > cuda::kQuantizeBlock || !(in.q.qmin < 0 && in.q.qmax > 0))
      return {};
    blocks += (channels + kChannels - 1) / kChannels;
  }
  if (blocks > int64_t{INT32_MAX}) return {};
  const DType out_type = g.activation_dtype();
  std::vector<Var> out;
  std::vector<const void*> pointers;
  int64_t width_elements = 0;  // a divisor of every channel's length
  for (const QuantizeInput& in : inputs) {
    out.push_back(g.emit(g.shape(in.x), {in.x, in.q.scale}, out_type));
    pointers.push_back(g.data(in.x));
    pointers.push_back(g.data(out.back()));
    if (in.q.integers && in.q.qmin >= -128 && in.q.qmax <= 127)
      g.set_integers(out.back(), g.scratch<int8_t>(std::size_t(g.shape(in.x).numel())));
    const int64_t per = g.shape(in.x).numel() / g.value(in.q.scale).numel();
    width_elements = width_elements ? std::gcd(width_elements, per) : per;
  }
  // The tensors in the kernels' table longest channels first: a block's time is its channels' length, and
  // blocks start in table order, so the longest ones start first and the short ones fill in around them (in
  // the order given, a BERT layer's FFN output weight, 3,072 a channel, came last and ran alone at the end:
  // 44 us a layer's six weights on an H200). Each channel is computed alone, so the order changes no value.
  std::vector<QuantizeInput> items(inputs.begin(), inputs.end());
  std::vector<Var> out_sorted;  // out in the table's order
  {
    std::vector<int> order(items.size());
    std::iota(order.begin(), order.end(), 0);
    auto per_channel = [&](int t) { return g.shape(items[t].x).numel() / g.value(items[t].q.scale).numel(); };
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return per_channel(a) > per_channel(b); });
    std::vector<QuantizeInput> sorted_items;
    std::vector<Var> sorted_out;
    for (int t : order) sorted_items.push_back(items[t]), sorted_out.push_back(out[t]);
    items = std::move(sorted_items);
    out_sorted = std::move(sorted_out);
  }
  // The table of the kernels' arguments (outputs, scales, ranges) for element type Y.
  auto table = [items, out = out_sorted](Graph<float>& g, auto tag) {
    using Y = typename decltype(tag)::type;
    Many<Y> m{};
    m.k = static_cast<int>(items.size());
    unsigned first = 0;
    for (int t = 0; t < m.k; ++t) {
      const QuantizeInput& in = items[t];
      const int64_t channels = g.value(in.q.scale).numel();
      m.first[t] = first;
      first += static_cast<unsigned>((channels + kChannels - 1) / kChannels);
      m.channels[t] = channels;
      m.x[t] = g.value(in.x).data();
      m.y[t] = cuda::typed<Y>(g.data(out[t]));
      m.integers[t] = const_cast<int8_t*>(g.integers(out[t]));
      m.scale[t] = g.value(in.q.scale).data();
      m.per_channel[t] = g.shape(in.x).numel() / channels;
      m.lo[t] = static_cast<float>(in.q.qmin), m.hi[t] = static_cast<float>(in.q.qmax);
      m.clipped[t] = reinterpret_cast<unsigned long long*>(in.q.clipped);
      m.grad_scale[t] = in.q.grad_scale;
    }
    m.first[m.k] = first;
    return m;
  };
  const int width = cuda::pack_width(dtype_size(out_type, 4), 4, width_elements, pointers);
  const unsigned grid = static_cast<unsigned>(blocks);
  cuda::with_element_type(out_type, [&](auto tag) {
    using Y = typename decltype(tag)::type;
    auto* kernel = width == 4 ? &fake_quantize_many_forward<4, Y> : &fake_quantize_many_forward<1, Y>;
    kernel<<<grid, cuda::kThreads, 0, cuda::stream(g)>>>(table(g, tag));
    BERT_CUDA_LAUNCHED();
  });
  // One backward for all outputs, run by the first of their closures to run (the latest output: every
  // output's consumers were recorded after it); the others find it done.
  auto done = std::make_shared<bool>(false);
  for (Var y : out)
    g.on_backward(y, [items, out = out_sorted, table, grid, out_type, done](Graph<float>& g) {
      if (*done) return;
      *done = true;
      cuda::with_element_type(out_type, [&](auto tag) {
        using Y = typename decltype(tag)::type;
        Many<Y> m = table(g, tag);
        std::vector<const void*> pointers;
        int64_t width_elements = 0;
        for (int t = 0; t < m.k; ++t) {
          const QuantizeInput& in = items[t];
          m.dy[t] = g.has_grad(out[t]) ? cuda::typed<Y>(g.grad_data(out[t])) : nullptr;
          if (m.dy[t] && g.requires_grad(in.x)) {
            const auto target = g.raw_grad_target(in.x);
            m.dx[t] = static_cast<float*>(target.data), m.accumulate[t] = target.accumulate;
          }
          m.ds[t] = m.dy[t] && g.requires_grad(in.q.scale) ? g.grad(in.q.scale).data() : nullptr;
          for (const void* p :
               {static_cast<const void*>(m.x[t]), static_cast<const void*>(m.dy[t]), static_cast<const void*>(m.dx[t])})
            if (p) pointers.push_back(p);
          width_elements = width_elements ? std::gcd(width_elements, m.per_channel[t]) : m.per_channel[t];
        }
        const int width = cuda::pack_width(sizeof(Y), 4, width_elements, pointers);
        auto* kernel = width == 4 ? &fake_quantize_many_backward<4, Y> : &fake_quantize_many_backward<1, Y>;
        kernel<<<grid, cuda::kThreads, 0, cuda::stream(g)>>>(m);
        BERT_CUDA_LAUNCHED();
      });
    });
  return out;
}

namespace {
// fake_quantize_each's backward kernel over x (n elements of dtype): dx stored or added to (nullptr: none).
void launch_each_backward(Graph<float>& g, DType dtype, const void* x, void* dx, bool accumulate, int64_t n,
                          std::span<const EachGradient> grads) {
  const unsigned blocks =
      static_cast<unsigned>(std::max<int64_t>(1, (n + cuda::kQuantizeBlock - 1) / cuda::kQuantizeBlock));
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    Each<A> e{};
    e.k = static_cast<int>(grads.size());
    bool any_scale = false;
    std::vector<const void*> pointers = {x, dx};
    for (int q = 0; q < e.k; ++q) {
      const EachGradient& d = grads[q];
      e.scale[q] = d.scale, e.lo[q] = d.lo, e.hi[q] = d.hi, e.grad_scale[q] = d.grad_scale;
      e.dy[q] = static_cast<const A*>(d.dy);
      e.ds[q] = d.dy ? d.ds : nullptr;
      any_scale |= e.ds[q] != nullptr;
      if (e.dy[q]) pointers.push_back(e.dy[q]);
    }
    double* partial = any_scale && blocks > 1 ? g.scratch<double>(int64_t(blocks) * e.k) : nullptr;
    const int width = cuda::pack_width(sizeof(A), sizeof(A), n, pointers);
    auto launch = [&]<int K>() {
      auto* kernel = width == 8   ? &fake_quantize_each_backward<8, K, A>
                     : width == 4 ? &fake_quantize_each_backward<4, K, A>
                                  : &fake_quantize_each_backward<1, K, A>;
      kernel<<<blocks, cuda::kThreads, 0, cuda::stream(g)>>>(e, static_cast<A*>(dx), static_cast<const A*>(x), n,
                                                             accumulate, partial, cuda::context(g.device()).arrivals);
    };
    static_assert(kMaxEach == 4);
    if (e.k == 1)
      launch.template operator()<1>();
    else if (e.k == 2)
      launch.template operator()<2>();
    else if (e.k == 3)
      launch.template operator()<3>();
    else
      launch.template operator()<4>();
    BERT_CUDA_LAUNCHED();
  });
}
}  // namespace

// x is read in the activation dtype (an F32 input through a conversion node, as other activation ops).
std::vector<Var> fake_quantize_each(Graph<float>& g, Var x, std::span<const QuantizeOutput> quantizers) {
  const int k = static_cast<int>(quantizers.size());
  std::vector<Var> out;
  if (k == 0) return out;
  x = as_activation(g, x);
  const DType dtype = g.dtype(x);
  if (k > kMaxEach) {  // more than the model asks for: one at a time
    for (const QuantizeOutput& q : quantizers)
      out.push_back(fake_quantize(g, x, q.scale, q.qmin, q.qmax, q.grad_scale, q.clipped));
    return out;
  }
  const int64_t n = g.shape(x).numel();
  std::vector<Var> scales;
  for (const QuantizeOutput& q : quantizers) {
    cuda::fused_launch(g, q, n);  // checks: per tensor, qmin < 0 < qmax
    out.push_back(g.emit(g.shape(x), {x, q.scale}, dtype));
    scales.push_back(q.scale);
  }
  const std::vector<QuantizeOutput> qs(quantizers.begin(), quantizers.end());
  // Fills the quantizers' side of the kernels' arguments (outputs, scales, ranges).
  auto arguments = [qs, out](Graph<float>& g, auto tag) {
    using A = typename decltype(tag)::type;
    Each<A> e{};
    e.k = static_cast<int>(qs.size());
    for (int q = 0; q < e.k; ++q) {
      e.scale[q] = g.value(qs[q].scale).data();
      e.lo[q] = static_cast<float>(qs[q].qmin);
      e.hi[q] = static_cast<float>(qs[q].qmax);
      e.y[q] = cuda::typed<A>(g.data(out[q]));
      e.grad_scale[q] = qs[q].grad_scale;
      e.clipped[q] = reinterpret_cast<unsigned long long*>(qs[q].clipped);
    }
    return e;
  };
  const unsigned blocks =
      static_cast<unsigned>(std::max<int64_t>(1, (n + cuda::kQuantizeBlock - 1) / cuda::kQuantizeBlock));
  if (n > 0) {
    cuda::with_element_type(dtype, [&](auto tag) {
      using A = typename decltype(tag)::type;
      const Each<A> e = arguments(g, tag);
      std::vector<const void*> pointers = {g.data(x)};
      for (Var y : out) pointers.push_back(g.data(y));
      const int width = cuda::pack_width(sizeof(A), sizeof(A), n, pointers);
      auto* kernel = width == 8   ? &fake_quantize_each_forward<8, A>
                     : width == 4 ? &fake_quantize_each_forward<4, A>
                                  : &fake_quantize_each_forward<1, A>;
      kernel<<<blocks, cuda::kThreads, 0, cuda::stream(g)>>>(e, cuda::typed<A>(g.data(x)), n);
      BERT_CUDA_LAUNCHED();
    });
  }
  // One backward for all outputs, run by the first of their closures to run (the latest output that
  // received a gradient); the others find it done.
  auto done = std::make_shared<bool>(false);
  for (Var y : out)
    g.on_backward(y, [x, n, out, qs, scales, done](Graph<float>& g) {
      if (*done || n == 0) return;
      *done = true;
      std::vector<EachGradient> grads;
      for (size_t q = 0; q < out.size(); ++q) {
        const bool has = g.has_grad(out[q]);
        grads.push_back({g.value(scales[q]).data(), static_cast<float>(qs[q].qmin), static_cast<float>(qs[q].qmax),
                         has ? g.grad_data(out[q]) : nullptr,
                         has && g.requires_grad(scales[q]) ? g.grad(scales[q]).data() : nullptr, qs[q].grad_scale});
      }
      const auto dx = g.requires_grad(x) ? g.raw_grad_target(x) : Graph<float>::RawGradTarget{nullptr, false};
      launch_each_backward(g, g.dtype(x), g.data(x), dx.data, dx.accumulate, n, grads);
    });
  return out;
}

void fake_quantize_each_backward(Graph<float>& g, DType dtype, const void* x, void* dx, bool accumulate, int64_t n,
                                 std::span<const EachGradient> grads) {
  BERT_CHECK(!grads.empty() && grads.size() <= size_t(kMaxEach),
             "fake_quantize_each_backward: 1 to " + std::to_string(kMaxEach) + " quantizers");
  if (n > 0) launch_each_backward(g, dtype, x, dx, accumulate, n, grads);
}

}  // namespace bert::ops::cuda_impl
