// Fake quantization with the LSQ scale gradient: forward and backward side by side.
#include <cmath>

#include "core/ops.h"
#include "core/parallel.h"

namespace bert::ops {

template <typename T>
Var fake_quantize(Graph<T>& g, Var x, Var scale, int qmin, int qmax, double grad_scale, int64_t* clipped) {
  const int64_t n = g.value(x).numel();
  const int64_t channels = g.value(scale).numel();
  BERT_CHECK(g.shape(scale).rank() == 1 && channels >= 1 && n % channels == 0,
             "fake_quantize: scale " + g.shape(scale).str() + " does not divide x " + g.shape(x).str());
  BERT_CHECK(qmin < 0 && qmax > 0, "fake_quantize: need qmin < 0 < qmax");
  const int64_t per_channel = n / channels;  // elements sharing one scale
  const T* sv = g.value(scale).data();
  for (int64_t c = 0; c < channels; ++c)
    BERT_CHECK(sv[c] > T(0) && std::isfinite(double(sv[c])), "fake_quantize: scale must be positive and finite");
  Var y = g.emit(g.shape(x), {x, scale});
  const T* xv = g.value(x).data();
  T* yv = g.value(y).data();
  const T lo = static_cast<T>(qmin), hi = static_cast<T>(qmax);
  std::vector<int64_t> saturated(static_cast<size_t>(channels), 0);
  parallel_for(channels, std::max<int64_t>(1, (int64_t{1} << 14) / per_channel), [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const T s = sv[c];
      int64_t count = 0;
      for (int64_t i = c * per_channel; i < (c + 1) * per_channel; ++i) {
        const T q = std::nearbyint(xv[i] / s);  // divide, as QuantizeLinear does: x * (1/s) can round differently
        count += (q < lo) | (q > hi);
        yv[i] = std::min(std::max(q, lo), hi) * s;
      }
      saturated[c] = count;
    }
  });
  if (clipped) {
    *clipped = 0;
    for (int64_t c : saturated) *clipped += c;
  }
  g.on_backward(y, [x, scale, y, qmin, qmax, grad_scale, per_channel, channels](Graph<T>& g) {
    const T* xv = g.value(x).data();
    const T* sv = g.value(scale).data();
    const T* dy = g.grad(y).data();
    T* dx = g.requires_grad(x) ? g.grad(x).data() : nullptr;
    T* ds = g.requires_grad(scale) ? g.grad(scale).data() : nullptr;
    const T lo = static_cast<T>(qmin), hi = static_cast<T>(qmax);
    parallel_for(channels, std::max<int64_t>(1, (int64_t{1} << 14) / per_channel), [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const T s = sv[c];
        double scale_grad = 0;
        for (int64_t i = c * per_channel; i < (c + 1) * per_channel; ++i) {
          const T v = xv[i] / s;
          if (v < lo) {
            scale_grad += double(dy[i]) * lo;
          } else if (v > hi) {
            scale_grad += double(dy[i]) * hi;
          } else {
            if (dx) dx[i] += dy[i];
            scale_grad += double(dy[i]) * (std::nearbyint(v) - v);
          }
        }
        if (ds) ds[c] += static_cast<T>(grad_scale * scale_grad);
      }
    });
  });
  return y;
}

template Var fake_quantize<float>(Graph<float>&, Var, Var, int, int, double, int64_t*);
template Var fake_quantize<double>(Graph<double>&, Var, Var, int, int, double, int64_t*);

}  // namespace bert::ops
