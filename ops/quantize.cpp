// Fake quantization with the LSQ scale gradient: forward and backward side by side; fake_quantize_each, one
// tensor read by several quantizers. The ops with their output's quantizer fused in are in their own
// families (GELU and dropout: ops/elementwise, permute: ops/shape), on the CPU the two ops in sequence.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "ops/cuda_impl.h"
#include "ops/ops.h"
#include "sys/parallel.h"

namespace bert::ops {

namespace {
// Work is split into blocks of at most kBlock elements that never straddle a channel, independent of
// the thread count, so results (the scale gradient's sum order included) are identical on any number of
// threads and a per-tensor scale still spreads over all cores.
constexpr int64_t kBlock = int64_t{1} << 14;
struct Blocks {
  int64_t per_channel, blocks_per_channel;
  int64_t count(int64_t channels) const { return channels * blocks_per_channel; }
  int64_t channel(int64_t b) const { return b / blocks_per_channel; }
  int64_t begin(int64_t b) const { return channel(b) * per_channel + (b % blocks_per_channel) * kBlock; }
  int64_t end(int64_t b) const { return std::min(begin(b) + kBlock, (channel(b) + 1) * per_channel); }
};

// a where c, else b, chosen by the bits: both are computed whatever c is. A conditional expression lets
// the compiler move the arithmetic of the arm it picks under a branch, which it then may not run for every
// element (floating point can trap), so the loop stays scalar; this keeps the loops below vectorised.
template <typename T>
inline T pick(bool c, T a, T b) {
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  const U mask = U(0) - U(c);
  return std::bit_cast<T>((std::bit_cast<U>(a) & mask) | (std::bit_cast<U>(b) & ~mask));
}

// Backward over elements [begin, end) sharing the scale s: dx gets dy where x / s fell inside [lo, hi]
// (the straight-through estimator; DxMode: kNone, kStore into a fresh buffer, kAdd), and the LSQ scale
// gradient sum dy * (lo, hi, or round(v) - v) is returned. Branch-free (pick) over lanes of kLanes
// accumulators (a single running sum was a serial chain of dependent adds: 6x the forward's time), the
// lanes summed in double every kSubBlock elements: the same order on any thread count.
enum class DxMode { kNone, kStore, kAdd };
constexpr int kLanes = 16;
constexpr int64_t kSubBlock = 256;

template <DxMode kDx, typename T>
double lsq_backward(const T* x, const T* dy, T* dx, int64_t begin, int64_t end, T s, T lo, T hi) {
  double total = 0;
  for (int64_t start = begin; start < end; start += kSubBlock) {
    const int64_t stop = std::min(start + kSubBlock, end);
    T lanes[kLanes] = {};
    auto element = [&](int64_t i, T& lane) {
      const T v = x[i] / s, g = dy[i];
      const bool below = v<lo, above = v> hi;
      lane += g * pick(below, lo, pick(above, hi, std::nearbyint(v) - v));
      const T pass = pick(below | above, T(0), g);
      if constexpr (kDx == DxMode::kStore) dx[i] = pass;
      if constexpr (kDx == DxMode::kAdd) dx[i] += pass;
    };
    int64_t i = start;
    for (; i + kLanes <= stop; i += kLanes)
      for (int j = 0; j < kLanes; ++j) element(i + j, lanes[j]);
    for (int j = 0; i < stop; ++i, ++j) element(i, lanes[j]);
    double sub = 0;
    for (T lane : lanes) sub += double(lane);
    total += sub;
  }
  return total;
}
// Forward over elements [begin, end) sharing the scale s: y = clamp(round(x / s), lo, hi) * s; returns how
// many saturated (x / s beyond [lo, hi], where backward's straight-through mask blocks the gradient).
template <typename T>
int64_t quantize_block(const T* x, T* y, int64_t begin, int64_t end, T s, T lo, T hi) {
  int64_t count = 0;
  for (int64_t i = begin; i < end; ++i) {
    const T v = x[i] / s;  // divide, as QuantizeLinear does: x * (1/s) can round differently
    const bool below = v<lo, above = v> hi;
    count += below | above;
    y[i] = pick(below, lo, pick(above, hi, std::nearbyint(v))) * s;  // NaN stays NaN
  }
  return count;
}
}  // namespace

template <typename T>
Var fake_quantize(Graph<T>& g, Var x, Var scale, int qmin, int qmax, double grad_scale, int64_t* clipped,
                  bool integers) {
  BERT_DISPATCH_CUDA(g, fake_quantize(g, x, scale, qmin, qmax, grad_scale, clipped, integers))
  (void)integers;  // (the CPU writes none)
  const int64_t n = g.value(x).numel();
  const int64_t channels = g.value(scale).numel();
  BERT_CHECK(g.shape(scale).rank() == 1 && channels >= 1 && n % channels == 0,
             "fake_quantize: scale " + g.shape(scale).str() + " does not divide x " + g.shape(x).str());
  BERT_CHECK(qmin < 0 && qmax > 0, "fake_quantize: need qmin < 0 < qmax");
  const int64_t per_channel = n / channels;  // elements sharing one scale
  const Blocks blocks{per_channel, std::max<int64_t>(1, (per_channel + kBlock - 1) / kBlock)};
  const T* sv = g.value(scale).data();
  for (int64_t c = 0; c < channels; ++c)
    BERT_CHECK(sv[c] > T(0) && std::isfinite(double(sv[c])), "fake_quantize: scale must be positive and finite");
  Var y = g.emit(g.shape(x), {x, scale});
  const T* xv = g.value(x).data();
  T* yv = g.value(y).data();
  const T lo = static_cast<T>(qmin), hi = static_cast<T>(qmax);
  const int64_t n_blocks = blocks.count(channels);
  std::vector<int64_t> saturated(static_cast<size_t>(n_blocks), 0);
  parallel_for(n_blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      saturated[b] = quantize_block(xv, yv, blocks.begin(b), blocks.end(b), sv[blocks.channel(b)], lo, hi);
  });
  if (clipped)
    for (int64_t c : saturated) *clipped += c;
  g.on_backward(y, [x, scale, y, qmin, qmax, grad_scale, channels, blocks, n_blocks](Graph<T>& g) {
    const T* xv = g.value(x).data();
    const T* sv = g.value(scale).data();
    const T* dy = g.grad(y).data();
    const bool want_dx = g.requires_grad(x);
    const auto dx = want_dx ? g.grad_target(x) : typename Graph<T>::GradTarget{nullptr, false};
    T* ds = g.requires_grad(scale) ? g.grad(scale).data() : nullptr;
    const T lo = static_cast<T>(qmin), hi = static_cast<T>(qmax);
    std::vector<double> partial(static_cast<size_t>(n_blocks), 0.0);
    parallel_for(n_blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const T s = sv[blocks.channel(b)];
        const int64_t begin = blocks.begin(b), end = blocks.end(b);
        if (!want_dx)
          partial[b] = lsq_backward<DxMode::kNone>(xv, dy, dx.data, begin, end, s, lo, hi);
        else if (dx.accumulate)
          partial[b] = lsq_backward<DxMode::kAdd>(xv, dy, dx.data, begin, end, s, lo, hi);
        else
          partial[b] = lsq_backward<DxMode::kStore>(xv, dy, dx.data, begin, end, s, lo, hi);
      }
    });
    if (!ds) return;
    for (int64_t c = 0; c < channels; ++c) {  // in block order: the same sum on any thread count
      double total = 0;
      for (int64_t b = c * blocks.blocks_per_channel; b < (c + 1) * blocks.blocks_per_channel; ++b) total += partial[b];
      ds[c] += static_cast<T>(grad_scale * total);
    }
  });
  return y;
}

// On the CPU, per-tensor quantizers read x block by block, each block once for all of them (it stays in
// cache between them), and the backward makes x's gradient in one pass: the values of one fake_quantize
// each, bit for bit (the same blocks, sums in the same order; x's gradient added up in the order their
// backward passes would have run, the last quantizer's first).
template <typename T>
std::vector<Var> fake_quantize_each(Graph<T>& g, Var x, std::span<const QuantizeOutput> quantizers) {
  BERT_DISPATCH_CUDA(g, fake_quantize_each(g, x, quantizers))
  bool per_tensor = quantizers.size() > 1;
  for (const QuantizeOutput& q : quantizers)
    per_tensor = per_tensor && g.shape(q.scale) == Shape({1}) && q.qmin < 0 && q.qmax > 0;
  std::vector<Var> out;
  if (!per_tensor) {
    for (const QuantizeOutput& q : quantizers)
      out.push_back(fake_quantize(g, x, q.scale, q.qmin, q.qmax, q.grad_scale, q.clipped));
    return out;
  }
  const int k = static_cast<int>(quantizers.size());
  const int64_t n = g.value(x).numel();
  const Blocks blocks{n, std::max<int64_t>(1, (n + kBlock - 1) / kBlock)};
  const int64_t n_blocks = blocks.count(1);
  std::vector<QuantizeOutput> qs(quantizers.begin(), quantizers.end());
  for (const QuantizeOutput& q : qs) {
    const T s = g.value(q.scale).data()[0];
    BERT_CHECK(s > T(0) && std::isfinite(double(s)), "fake_quantize: scale must be positive and finite");
    out.push_back(g.emit(g.shape(x), {x, q.scale}));
  }
  std::vector<int64_t> saturated(static_cast<size_t>(n_blocks * k), 0);
  const T* xv = g.value(x).data();
  parallel_for(n_blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int q = 0; q < k; ++q)
        saturated[b * k + q] =
            quantize_block(xv, g.value(out[q]).data(), blocks.begin(b), blocks.end(b), g.value(qs[q].scale).data()[0],
                           static_cast<T>(qs[q].qmin), static_cast<T>(qs[q].qmax));
  });
  for (int q = 0; q < k; ++q)
    if (qs[q].clipped)
      for (int64_t b = 0; b < n_blocks; ++b) *qs[q].clipped += saturated[b * k + q];
  // One backward for all outputs, run by the first of their closures to run; the others find it done.
  auto done = std::make_shared<bool>(false);
  for (Var y : out)
    g.on_backward(y, [x, out, qs, blocks, n_blocks, done](Graph<T>& g) {
      if (*done) return;
      *done = true;
      const int k = static_cast<int>(out.size());
      const T* xv = g.value(x).data();
      const bool want_dx = g.requires_grad(x);
      const auto dx = want_dx ? g.grad_target(x) : typename Graph<T>::GradTarget{nullptr, false};
      std::vector<int> order;  // the quantizers with a gradient, the last one first
      for (int q = k - 1; q >= 0; --q)
        if (g.has_grad(out[q])) order.push_back(q);
      std::vector<double> partial(static_cast<size_t>(n_blocks * k), 0.0);
      parallel_for(n_blocks, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t begin = blocks.begin(b), end = blocks.end(b);
          bool stored = dx.accumulate;  // x's gradient holds a value to add to
          for (int q : order) {
            const T* dy = g.grad(out[q]).data();
            const T s = g.value(qs[q].scale).data()[0];
            const T lo = static_cast<T>(qs[q].qmin), hi = static_cast<T>(qs[q].qmax);
            double& sum = partial[static_cast<size_t>(b * k + q)];
            if (!want_dx)
              sum = lsq_backward<DxMode::kNone>(xv, dy, dx.data, begin, end, s, lo, hi);
            else if (stored)
              sum = lsq_backward<DxMode::kAdd>(xv, dy, dx.data, begin, end, s, lo, hi);
            else
              sum = lsq_backward<DxMode::kStore>(xv, dy, dx.data, begin, end, s, lo, hi);
            stored = true;
          }
        }
      });
      for (int q : order) {
        if (!g.requires_grad(qs[q].scale)) continue;
        double total = 0;  // in block order, as fake_quantize sums
        for (int64_t b = 0; b < n_blocks; ++b) total += partial[static_cast<size_t>(b * k + q)];
        g.grad(qs[q].scale).data()[0] += static_cast<T>(qs[q].grad_scale * total);
      }
    });
  return out;
}

template <typename T>
std::vector<Var> fake_quantize_many(Graph<T>& g, std::span<const QuantizeInput> inputs) {
  if constexpr (std::is_same_v<T, float>) {
#if BERT_WITH_CUDA
    if (g.on_cuda())
      if (std::vector<Var> out = cuda_impl::fake_quantize_many(g, inputs); !out.empty()) return out;
#endif
  }
  std::vector<Var> out;
  for (const QuantizeInput& in : inputs)
    out.push_back(fake_quantize(g, in.x, in.q.scale, in.q.qmin, in.q.qmax, in.q.grad_scale, in.q.clipped));
  return out;
}

template <typename T>
std::array<Var, 3> quantized_projections(Graph<T>& g, Var x, const std::array<Var, 3>& weights,
                                         const std::array<Var, 3>& biases,
                                         const std::array<QuantizeOutput, 3>& quantizers,
                                         const ProjectionScales* integers) {
  const Shape s = g.shape(x);
  BERT_CHECK(s.rank() >= 2, "quantized_projections: x " + s.str() + " is not (B, T, C)");
  for (int i = 0; i < 3; ++i)
    BERT_CHECK(g.shape(weights[i]) == Shape({s[-1], s[-1]}) && g.shape(biases[i]) == Shape({s[-1]}),
               "quantized_projections: projection " + std::to_string(i) + " has weight " + g.shape(weights[i]).str() +
                   " and bias " + g.shape(biases[i]).str() +
                   " (expected (C, C) and (C) for C = " + std::to_string(s[-1]) + ")");
  if (integers) {
    BERT_CHECK(g.shape(integers->input).numel() == 1,
               "quantized_projections: one input scale expected, " + g.shape(integers->input).str() + " given");
    for (int i = 0; i < 3; ++i)
      BERT_CHECK(g.shape(integers->weights[i]).numel() == s[-1],
                 "quantized_projections: weight " + std::to_string(i) + " has scales " +
                     g.shape(integers->weights[i]).str() + " (one per output channel expected)");
  }
  if constexpr (std::is_same_v<T, float>) {
#if BERT_WITH_CUDA
    if (g.on_cuda())
      if (std::array<Var, 3> out = cuda_impl::quantized_projections(g, x, weights, biases, quantizers, integers);
          out[0].valid())
        return out;
#endif
  }
  std::array<Var, 3> out;
  for (int i = 0; i < 3; ++i) {
    const QuantizeOutput& q = quantizers[i];
    Var y;
    if constexpr (std::is_same_v<T, float>)
      if (integers) y = quantized_linear(g, x, weights[i], biases[i], integers->input, integers->weights[i]);
    if (!y.valid()) y = linear(g, x, weights[i], biases[i]);
    out[i] = fake_quantize(g, y, q.scale, q.qmin, q.qmax, q.grad_scale, q.clipped);
  }
  return out;
}

#define BERT_INSTANTIATE_QUANTIZE(T)                                                                \
  template Var fake_quantize<T>(Graph<T>&, Var, Var, int, int, double, int64_t*, bool);             \
  template std::vector<Var> fake_quantize_each<T>(Graph<T>&, Var, std::span<const QuantizeOutput>); \
  template std::vector<Var> fake_quantize_many<T>(Graph<T>&, std::span<const QuantizeInput>);       \
  template std::array<Var, 3> quantized_projections<T>(Graph<T>&, Var, const std::array<Var, 3>&,   \
                                                       const std::array<Var, 3>&,                   \
                                                       const std::array<QuantizeOutput, 3>&, const ProjectionScales*);
BERT_INSTANTIATE_QUANTIZE(float)
BERT_INSTANTIATE_QUANTIZE(double)
#undef BERT_INSTANTIATE_QUANTIZE

}  // namespace bert::ops
