// Row-wise normalisations (softmax with an additive mask, LayerNorm): fused forward and backward side
// by side.
#include <algorithm>
#include <cmath>

#include "core/ops.h"
#include "core/ops_cuda.h"
#include "core/parallel.h"
#include "core/vector_math.h"

namespace bert::ops {

namespace {
constexpr int64_t kRowGrain = 16;  // rows per thread below which threading does not pay
}

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
Var layer_norm(Graph<T>& g, Var x, Var gamma, Var beta, double eps) {
  BERT_DISPATCH_CUDA(g, layer_norm(g, x, gamma, beta, eps))
  const Shape& xs = g.shape(x);
  const int64_t c = xs.last(), rows = xs.rows();
  BERT_CHECK(g.shape(gamma) == Shape({c}) && g.shape(beta) == Shape({c}),
             "layer_norm: gamma " + g.shape(gamma).str() + " / beta " + g.shape(beta).str() + " for x " + xs.str());
  Var y = g.emit(xs, {x, gamma, beta});
  // Saved for backward: per-row mean and reciprocal standard deviation, (N).
  T* mean = g.template scratch<T>(rows);
  T* rstd = g.template scratch<T>(rows);
  const T* xv = g.value(x).data();
  const T* gv = g.value(gamma).data();
  const T* bv = g.value(beta).data();
  T* yv = g.value(y).data();
  parallel_for(rows, kRowGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      // The row's sums as vector reductions (a loop of scalar adds would wait on each add in turn).
      const auto in = vec::view(xv + r * c, c);
      const T m = in.sum() / static_cast<T>(c);
      const T var = (in - m).square().sum() / static_cast<T>(c);
      const T rs = T(1) / std::sqrt(var + static_cast<T>(eps));
      mean[r] = m;
      rstd[r] = rs;
      vec::view(yv + r * c, c) = (in - m) * rs * vec::view(gv, c) + vec::view(bv, c);
    }
  });
  g.on_backward(y, [x, gamma, beta, y, mean, rstd, rows, c](Graph<T>& g) {
    // With n = (x - mean) * rstd and dn = dy * gamma:
    //   dx = rstd * (dn - mean(dn) - n * mean(dn * n)),  dgamma = sum_rows dy * n,  dbeta = sum_rows dy.
    const T* xv = g.value(x).data();
    const T* gv = g.value(gamma).data();
    const T* dy = g.grad(y).data();
    // One pass over fixed blocks of rows: dx row by row, and each block's sums of dy * n and dy per
    // channel, added into dgamma and dbeta in block order afterwards (the same sums whatever the thread
    // count). dx is stored, not added, when its buffer is fresh (no zeroing pass first).
    const bool want_x = g.requires_grad(x);
    const auto dx = want_x ? g.grad_target(x) : typename Graph<T>::GradTarget{nullptr, false};
    T* dgamma = g.requires_grad(gamma) ? g.grad(gamma).data() : nullptr;
    T* dbeta = g.requires_grad(beta) ? g.grad(beta).data() : nullptr;
    const bool want_params = dgamma || dbeta;
    constexpr int64_t kRowsPerBlock = 64;
    const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
    T* block_sums = want_params ? g.template scratch<T>(2 * blocks * c) : nullptr;  // [block][dgamma | dbeta]
    parallel_for(blocks, std::max<int64_t>(1, kRowGrain / kRowsPerBlock), [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) {
        T* sum_dyn = want_params ? block_sums + 2 * b * c : nullptr;
        T* sum_dy = want_params ? sum_dyn + c : nullptr;
        if (want_params) std::fill(sum_dyn, sum_dyn + 2 * c, T(0));
        for (int64_t r = b * kRowsPerBlock, end = std::min(rows, (b + 1) * kRowsPerBlock); r < end; ++r) {
          const T* in = xv + r * c;
          const T* dyr = dy + r * c;
          const T m = mean[r], rs = rstd[r];
          if (want_params)
            for (int64_t j = 0; j < c; ++j) {
              sum_dyn[j] += dyr[j] * ((in[j] - m) * rs);
              sum_dy[j] += dyr[j];
            }
          if (!want_x) continue;
          const auto dn = vec::view(dyr, c) * vec::view(gv, c);
          const T mean_dn = dn.sum() / static_cast<T>(c);
          const T mean_dn_n = (dn * (vec::view(in, c) - m) * rs).sum() / static_cast<T>(c);
          T* dxr = dx.data + r * c;
          if (dx.accumulate)
            for (int64_t j = 0; j < c; ++j) dxr[j] += rs * (dyr[j] * gv[j] - mean_dn - (in[j] - m) * rs * mean_dn_n);
          else
            for (int64_t j = 0; j < c; ++j) dxr[j] = rs * (dyr[j] * gv[j] - mean_dn - (in[j] - m) * rs * mean_dn_n);
        }
      }
    });
    if (!want_params) return;
    parallel_for(c, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t b = 0; b < blocks; ++b) {
        const T* sum_dyn = block_sums + 2 * b * c;
        const T* sum_dy = sum_dyn + c;
        for (int64_t j = lo; j < hi; ++j) {
          if (dgamma) dgamma[j] += sum_dyn[j];
          if (dbeta) dbeta[j] += sum_dy[j];
        }
      }
    });
  });
  return y;
}

#define BERT_INSTANTIATE(T)                     \
  template Var softmax<T>(Graph<T>&, Var, Var); \
  template Var layer_norm<T>(Graph<T>&, Var, Var, Var, double);
BERT_INSTANTIATE(float)
BERT_INSTANTIATE(double)
#undef BERT_INSTANTIATE

}  // namespace bert::ops
