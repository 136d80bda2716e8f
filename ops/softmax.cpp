// Softmax with an additive mask (and softmax_dropout, with or without its output's quantizer, which the CPU
// composes): forward and backward side by side; the GPU twin is ops/softmax.cu.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/vector_math.h"
#include "ops/cuda_impl.h"
#include "ops/ops.h"
#include "sys/parallel.h"

namespace bert::ops {

namespace {
constexpr int64_t kRowGrain = 16;  // rows per thread below which threading does not pay
}  // namespace

template <typename T>
Var softmax(Graph<T>& g, Var x, Var mask) {
  BERT_DISPATCH_CUDA(g, softmax(g, x, mask))
  const Shape& xs = g.shape(x);
  const int64_t k = xs.last(), rows = xs.rows();
  const T* mv = nullptr;
  int64_t rows_per_item = rows;
  if (mask.valid()) {
    const Shape& ms = g.shape(mask);
    BERT_CHECK(!g.requires_grad(mask), "softmax: the mask is a constant; its gradient is not supported");
    BERT_CHECK(xs.rank() >= 2 && ms == Shape({xs[0], k}),
               "softmax: mask " + ms.str() + " must be (B, K) for x " + xs.str());
    rows_per_item = rows / xs[0];
    mv = g.value(mask).data();
  }
  Var y = g.emit(xs, {x});
  const T* xv = g.value(x).data();
  T* yv = g.value(y).data();
  parallel_for(rows, kRowGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const T* in = xv + r * k;
      const T* m = mv ? mv + (r / rows_per_item) * k : nullptr;
      vec::softmax(in, m, yv + r * k, k);
    }
  });
  g.on_backward(y, [x, y, k, rows](Graph<T>& g) {
    // dx = y * (dy - sum_j dy_j y_j), row by row.
    const T* yv = g.value(y).data();
    const T* dy = g.grad(y).data();
    const auto dx = g.grad_target(x);
    parallel_for(rows, kRowGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const T* yr = yv + r * k;
        const T* dyr = dy + r * k;
        const T dot = (vec::view(dyr, k) * vec::view(yr, k)).sum();
        if (dx.accumulate)
          vec::view(dx.data + r * k, k) += vec::view(yr, k) * (vec::view(dyr, k) - dot);
        else
          vec::view(dx.data + r * k, k) = vec::view(yr, k) * (vec::view(dyr, k) - dot);
      }
    });
  });
  return y;
}

template <typename T>
Var softmax_dropout(Graph<T>& g, Var x, Var mask, double p, bool training, Rng& rng) {
  BERT_CHECK(p >= 0.0 && p < 1.0, "dropout probability " + std::to_string(p) + " outside [0, 1)");
  if (training && p > 0.0) {
    BERT_DISPATCH_CUDA(g, softmax_dropout(g, x, mask, p, rng))
  }
  return dropout(g, softmax(g, x, mask), p, training, rng);
}

// With the output's quantizer fused in: on the CPU the ops in sequence (the GPU fuses them).
template <typename T>
Var softmax_dropout(Graph<T>& g, Var x, Var mask, double p, bool training, Rng& rng, const QuantizeOutput& q) {
  BERT_CHECK(p >= 0.0 && p < 1.0, "dropout probability " + std::to_string(p) + " outside [0, 1)");
  BERT_DISPATCH_CUDA(g, softmax_dropout(g, x, mask, training ? p : 0.0, rng, q))
  return fake_quantize(g, softmax_dropout(g, x, mask, p, training, rng), q.scale, q.qmin, q.qmax, q.grad_scale,
                       q.clipped);
}

#define BERT_INSTANTIATE(T)                                                 \
  template Var softmax<T>(Graph<T>&, Var, Var);                             \
  template Var softmax_dropout<T>(Graph<T>&, Var, Var, double, bool, Rng&); \
  template Var softmax_dropout<T>(Graph<T>&, Var, Var, double, bool, Rng&, const QuantizeOutput&);
BERT_INSTANTIATE(float)
BERT_INSTANTIATE(double)
#undef BERT_INSTANTIATE

}  // namespace bert::ops
