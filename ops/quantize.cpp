// Fake quantization with the LSQ scale gradient: forward and backward side by side. The ops with their
// output's quantizer fused in are in their own families (GELU and dropout: ops/elementwise, permute:
// ops/shape), on the CPU the two ops in sequence.
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
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
}  // namespace

template <typename T>
Var fake_quantize(Graph<T>& g, Var x, Var scale, int qmin, int qmax, double grad_scale, int64_t* clipped) {
  BERT_DISPATCH_CUDA(g, fake_quantize(g, x, scale, qmin, qmax, grad_scale, clipped))
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
    for (int64_t b = b0; b < b1; ++b) {
      const T s = sv[blocks.channel(b)];
      const T* x = xv;
      T* y = yv;
      const int64_t begin = blocks.begin(b), end = blocks.end(b);  // locals: the loop vectorises
      int64_t count = 0;
      for (int64_t i = begin; i < end; ++i) {
        const T v = x[i] / s;  // divide, as QuantizeLinear does: x * (1/s) can round differently
        // Counted where backward's straight-through mask blocks the gradient (v beyond [qmin, qmax]).
        const bool below = v<lo, above = v> hi;
        count += below | above;
        y[i] = pick(below, lo, pick(above, hi, std::nearbyint(v))) * s;  // NaN stays NaN
      }
      saturated[b] = count;
    }
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

template <typename T>
std::vector<Var> fake_quantize_each(Graph<T>& g, Var x, std::span<const QuantizeOutput> quantizers) {
  BERT_DISPATCH_CUDA(g, fake_quantize_each(g, x, quantizers))
  std::vector<Var> out;
  for (const QuantizeOutput& q : quantizers)
    out.push_back(fake_quantize(g, x, q.scale, q.qmin, q.qmax, q.grad_scale, q.clipped));
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
                                         const std::array<QuantizeOutput, 3>& quantizers) {
  const Shape s = g.shape(x);
  BERT_CHECK(s.rank() >= 2, "quantized_projections: x " + s.str() + " is not (B, T, C)");
  for (int i = 0; i < 3; ++i)
    BERT_CHECK(g.shape(weights[i]) == Shape({s[-1], s[-1]}) && g.shape(biases[i]) == Shape({s[-1]}),
               "quantized_projections: projection " + std::to_string(i) + " has weight " + g.shape(weights[i]).str() +
                   " and bias " + g.shape(biases[i]).str() +
                   " (expected (C, C) and (C) for C = " + std::to_string(s[-1]) + ")");
  if constexpr (std::is_same_v<T, float>) {
#if BERT_WITH_CUDA
    if (g.on_cuda())
      if (std::array<Var, 3> out = cuda_impl::quantized_projections(g, x, weights, biases, quantizers); out[0].valid())
        return out;
#endif
  }
  std::array<Var, 3> out;
  for (int i = 0; i < 3; ++i) {
    const QuantizeOutput& q = quantizers[i];
    out[i] = fake_quantize(g, linear(g, x, weights[i], biases[i]), q.scale, q.qmin, q.qmax, q.grad_scale, q.clipped);
  }
  return out;
}

#define BERT_INSTANTIATE_QUANTIZE(T)                                                                \
  template Var fake_quantize<T>(Graph<T>&, Var, Var, int, int, double, int64_t*);                   \
  template std::vector<Var> fake_quantize_each<T>(Graph<T>&, Var, std::span<const QuantizeOutput>); \
  template std::vector<Var> fake_quantize_many<T>(Graph<T>&, std::span<const QuantizeInput>);       \
  template std::array<Var, 3> quantized_projections<T>(                                             \
      Graph<T>&, Var, const std::array<Var, 3>&, const std::array<Var, 3>&, const std::array<QuantizeOutput, 3>&);
BERT_INSTANTIATE_QUANTIZE(float)
BERT_INSTANTIATE_QUANTIZE(double)
#undef BERT_INSTANTIATE_QUANTIZE

}  // namespace bert::ops
