// Elementwise ops (add, mul with broadcasting; scale, gelu, tanh, dropout): forward and backward side
// by side.
#include <array>
#include <cmath>

#include "kernels/vector_math.h"
#include "ops/cuda_impl.h"
#include "ops/ops.h"
#include "sys/parallel.h"

namespace bert::ops {

namespace {

// NumPy broadcasting of two shapes, padded on the left to rank 4. Strides of size-1 axes are 0, so
// one index walk serves both operands.
struct Broadcast {
  Shape out;
  std::array<int64_t, 4> dims{1, 1, 1, 1}, stride_a{}, stride_b{};
  bool same_shape = false;
};

std::array<int64_t, 4> padded_dims(const Shape& s) {
  std::array<int64_t, 4> d{1, 1, 1, 1};
  for (int i = 0; i < s.rank(); ++i) d[4 - s.rank() + i] = s[i];
  return d;
}

std::array<int64_t, 4> broadcast_strides(const std::array<int64_t, 4>& d, const std::array<int64_t, 4>& out) {
  std::array<int64_t, 4> s{};
  int64_t stride = 1;
  for (int i = 3; i >= 0; --i) {
    s[i] = (d[i] == 1 && out[i] != 1) ? 0 : stride;
    stride *= d[i];
  }
  return s;
}

Broadcast plan_broadcast(const Shape& a, const Shape& b) {
  Broadcast p;
  p.same_shape = a == b;
  auto da = padded_dims(a), db = padded_dims(b);
  int rank = std::max(a.rank(), b.rank());
  for (int i = 0; i < 4; ++i) {
    BERT_CHECK(da[i] == db[i] || da[i] == 1 || db[i] == 1, "cannot broadcast " + a.str() + " with " + b.str());
    p.dims[i] = std::max(da[i], db[i]);
  }
  p.out = a.rank() >= b.rank() ? a : b;
  for (int i = 0; i < rank; ++i) p.out[i] = p.dims[4 - rank + i];
  p.stride_a = broadcast_strides(da, p.dims);
  p.stride_b = broadcast_strides(db, p.dims);
  return p;
}

// Calls fn(out_index, a_offset, b_offset) for every output element once; rows of the last axis are split
// over threads (each output element is written by one thread).
template <typename Fn>
void walk(const Broadcast& p, Fn fn) {
  const int64_t rows = p.dims[0] * p.dims[1] * p.dims[2], cols = p.dims[3];
  parallel_for(rows, std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(cols, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t i2 = r % p.dims[2], i1 = r / p.dims[2] % p.dims[1], i0 = r / (p.dims[2] * p.dims[1]);
      const int64_t a = i0 * p.stride_a[0] + i1 * p.stride_a[1] + i2 * p.stride_a[2];
      const int64_t b = i0 * p.stride_b[0] + i1 * p.stride_b[1] + i2 * p.stride_b[2];
      for (int64_t i3 = 0, o = r * cols; i3 < cols; ++i3, ++o) fn(o, a + i3 * p.stride_a[3], b + i3 * p.stride_b[3]);
    }
  });
}

// For a backward pass into one operand (`which`: 0 for a, 1 for b): calls fn(out_index, a_offset,
// b_offset) for every output element, grouped so that all the outputs one element of that operand feeds
// (the element summed over its broadcast axes) are visited by one thread, in increasing output order.
// So `fn` may add into that operand without races, and the sums do not depend on the thread count.
template <typename Fn>
void walk_into_operand(const Broadcast& p, int which, Fn fn) {
  const std::array<int64_t, 4>& own = which == 0 ? p.stride_a : p.stride_b;
  std::array<int64_t, 4> own_dims{}, spread{};  // the operand's extent, and the broadcast axes' (1 elsewhere)
  for (int i = 0; i < 4; ++i) {
    const bool broadcast = own[i] == 0 && p.dims[i] != 1;
    own_dims[i] = broadcast ? 1 : p.dims[i];
    spread[i] = broadcast ? p.dims[i] : 1;
  }
  const int64_t rows = own_dims[0] * own_dims[1] * own_dims[2];
  const int64_t work_per_row = std::max<int64_t>(1, p.out.numel() / std::max<int64_t>(rows, 1));
  parallel_for(rows, std::max<int64_t>(1, kElementwiseGrain / work_per_row), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t j2 = r % own_dims[2], j1 = r / own_dims[2] % own_dims[1], j0 = r / (own_dims[2] * own_dims[1]);
      for (int64_t k0 = 0; k0 < spread[0]; ++k0)
        for (int64_t k1 = 0; k1 < spread[1]; ++k1)
          for (int64_t k2 = 0; k2 < spread[2]; ++k2) {
            const int64_t i0 = j0 + k0, i1 = j1 + k1, i2 = j2 + k2;  // one of each pair is 0
            const int64_t a = i0 * p.stride_a[0] + i1 * p.stride_a[1] + i2 * p.stride_a[2];
            const int64_t b = i0 * p.stride_b[0] + i1 * p.stride_b[1] + i2 * p.stride_b[2];
            const int64_t o = ((i0 * p.dims[1] + i1) * p.dims[2] + i2) * p.dims[3];
            for (int64_t i3 = 0; i3 < p.dims[3]; ++i3) fn(o + i3, a + i3 * p.stride_a[3], b + i3 * p.stride_b[3]);
          }
    }
  });
}

// out[i] = f(x[i]) over n elements, threaded when large.
template <typename T, typename F>
void map_unary(int64_t n, T* out, const T* x, F f) {
  parallel_for(n, kElementwiseGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) out[i] = f(x[i]);
  });
}

}  // namespace

template <typename T>
Var add(Graph<T>& g, Var a, Var b) {
  BERT_DISPATCH_CUDA(g, add(g, a, b))
  const Broadcast p = plan_broadcast(g.shape(a), g.shape(b));
  Var y = g.emit(p.out, {a, b});
  const T* av = g.value(a).data();
  const T* bv = g.value(b).data();
  T* yv = g.value(y).data();
  if (p.same_shape) {
    parallel_for(p.out.numel(), kElementwiseGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) yv[i] = av[i] + bv[i];
    });
  } else {
    walk(p, [&](int64_t o, int64_t ia, int64_t ib) { yv[o] = av[ia] + bv[ib]; });
  }
  g.on_backward(y, [a, b, y, p](Graph<T>& g) {
    const T* dy = g.grad(y).data();
    bool passed = false;  // one operand at most takes dy's buffer: two sharing one would alias
    for (auto [v, which] : {std::pair{a, 0}, std::pair{b, 1}}) {
      if (!g.requires_grad(v)) continue;
      const int stride_of =
          which;  // a plain variable: lambdas may not capture structured bindings before C++20 in clang 14
      if (p.same_shape) {
        // The residual adds: the first operand without a gradient yet takes dy as it is (no copy).
        if (!passed && g.pass_grad_through(v, y)) {
          passed = true;
          continue;
        }
        const auto dv = g.grad_target(v);
        parallel_for(p.out.numel(), kElementwiseGrain, [&](int64_t lo, int64_t hi) {
          if (dv.accumulate)
            for (int64_t i = lo; i < hi; ++i) dv.data[i] += dy[i];
          else
            std::copy(dy + lo, dy + hi, dv.data + lo);
        });
      } else {  // sum over the broadcast axes
        T* dv = g.grad(v).data();
        walk_into_operand(p, stride_of,
                          [&](int64_t o, int64_t ia, int64_t ib) { dv[stride_of == 0 ? ia : ib] += dy[o]; });
      }
    }
  });
  return y;
}

template <typename T>
Var mul(Graph<T>& g, Var a, Var b) {
  BERT_DISPATCH_CUDA(g, mul(g, a, b))
  const Broadcast p = plan_broadcast(g.shape(a), g.shape(b));
  Var y = g.emit(p.out, {a, b});
  const T* av = g.value(a).data();
  const T* bv = g.value(b).data();
  T* yv = g.value(y).data();
  walk(p, [&](int64_t o, int64_t ia, int64_t ib) { yv[o] = av[ia] * bv[ib]; });
  g.on_backward(y, [a, b, y, p](Graph<T>& g) {
    const T* dy = g.grad(y).data();
    const T* av = g.value(a).data();
    const T* bv = g.value(b).data();
    if (g.requires_grad(a)) {  // da += dy * b, summed over a's broadcast axes
      T* da = g.grad(a).data();
      walk_into_operand(p, 0, [&](int64_t o, int64_t ia, int64_t ib) { da[ia] += dy[o] * bv[ib]; });
    }
    if (g.requires_grad(b)) {
      T* db = g.grad(b).data();
      walk_into_operand(p, 1, [&](int64_t o, int64_t ia, int64_t ib) { db[ib] += dy[o] * av[ia]; });
    }
  });
  return y;
}

template <typename T>
Var scale(Graph<T>& g, Var x, double alpha) {
  BERT_DISPATCH_CUDA(g, scale(g, x, alpha))
  Var y = g.emit(g.shape(x), {x});
  const T s = static_cast<T>(alpha);
  map_unary(g.value(x).numel(), g.value(y).data(), g.value(x).data(), [s](T v) { return s * v; });
  g.on_backward(y, [x, y, s](Graph<T>& g) {
    const auto dx = g.grad_target(x);
    const T* dy = g.grad(y).data();
    parallel_for(g.value(y).numel(), kElementwiseGrain, [&](int64_t lo, int64_t hi) {
      if (dx.accumulate)
        for (int64_t i = lo; i < hi; ++i) dx.data[i] += s * dy[i];
      else
        for (int64_t i = lo; i < hi; ++i) dx.data[i] = s * dy[i];
    });
  });
  return y;
}

template <typename T>
Var gelu(Graph<T>& g, Var x) {
  BERT_DISPATCH_CUDA(g, gelu(g, x))
  Var y = g.emit(g.shape(x), {x});
  const T* xv = g.value(x).data();
  T* yv = g.value(y).data();
  parallel_for(g.value(x).numel(), kElementwiseGrain,
               [&](int64_t lo, int64_t hi) { vec::gelu(xv + lo, yv + lo, hi - lo); });
  on_gelu_backward(g, x, y);
  return y;
}

template <typename T>
void on_gelu_backward(Graph<T>& g, Var x, Var y) {
  g.on_backward(y, [x, y](Graph<T>& g) {
    // d/dx [x Phi(x)] = Phi(x) + x phi(x), Phi the normal CDF and phi its density.
    const T* xv = g.value(x).data();
    const T* dy = g.grad(y).data();
    const auto dx = g.grad_target(x);
    parallel_for(g.value(x).numel(), kElementwiseGrain, [&](int64_t lo, int64_t hi) {
      vec::gelu_backward(xv + lo, dy + lo, dx.data + lo, hi - lo, dx.accumulate);
    });
  });
}

template <typename T>
Var tanh(Graph<T>& g, Var x) {
  BERT_DISPATCH_CUDA(g, tanh(g, x))
  Var y = g.emit(g.shape(x), {x});
  map_unary(g.value(x).numel(), g.value(y).data(), g.value(x).data(), [](T v) { return std::tanh(v); });
  g.on_backward(y, [x, y](Graph<T>& g) {
    const T* yv = g.value(y).data();
    const T* dy = g.grad(y).data();
    const auto dx = g.grad_target(x);
    parallel_for(g.value(y).numel(), kElementwiseGrain, [&](int64_t lo, int64_t hi) {
      if (dx.accumulate)
        for (int64_t i = lo; i < hi; ++i) dx.data[i] += dy[i] * (T(1) - yv[i] * yv[i]);
      else
        for (int64_t i = lo; i < hi; ++i) dx.data[i] = dy[i] * (T(1) - yv[i] * yv[i]);
    });
  });
  return y;
}

template <typename T>
Var dropout(Graph<T>& g, Var x, double p, bool training, Rng& rng) {
  BERT_CHECK(p >= 0.0 && p < 1.0, "dropout probability " + std::to_string(p) + " outside [0, 1)");
  if (!training || p == 0.0) return x;
  BERT_DISPATCH_CUDA(g, dropout(g, x, p, rng))
  const int64_t n = g.value(x).numel();
  const uint64_t first = DropoutDraws::reserve(rng, static_cast<uint64_t>(n));
  const uint64_t seed = rng.state().seed;
  // The draws of core/rng.h's DropoutDraws. The mask is kept (one byte per element) for backward.
  const uint32_t threshold = DropoutDraws::threshold(p);
  const T keep_scale = static_cast<T>(1.0 / (1.0 - p));
  uint8_t* keep = g.template scratch<uint8_t>(n);
  Var y = g.emit(g.shape(x), {x});
  const T* xv = g.value(x).data();
  T* yv = g.value(y).data();
  parallel_for(n, kElementwiseGrain, [&](int64_t lo, int64_t hi) {
    // Two branch-free passes over local copies (byte stores may alias anything, which would stop
    // the compiler from vectorising; the hash needs 64-bit multiplies: AVX-512DQ). `first` is a
    // multiple of four, so whole groups of four share a hash.
    const uint64_t base = first, s = seed;
    const uint32_t below = threshold;
    uint8_t* k = keep;
    const T* in = xv;
    T* out = yv;
    const T scale = keep_scale;
    int64_t i = lo;
    for (; i < hi && i % 4 != 0; ++i) k[i] = DropoutDraws::kept(s, base + static_cast<uint64_t>(i), below);
    for (; i + 4 <= hi; i += 4) {
      const uint32_t m = DropoutDraws::kept4(s, (base + static_cast<uint64_t>(i)) / 4, below);
      for (int l = 0; l < 4; ++l) k[i + l] = (m >> l) & 1u;
    }
    for (; i < hi; ++i) k[i] = DropoutDraws::kept(s, base + static_cast<uint64_t>(i), below);
    for (i = lo; i < hi; ++i) out[i] = in[i] * (k[i] ? scale : T(0));
  });
  g.on_backward(y, [x, y, n, keep, keep_scale](Graph<T>& g) {
    const T* dy = g.grad(y).data();
    const auto dx = g.grad_target(x);
    parallel_for(n, kElementwiseGrain, [&](int64_t lo, int64_t hi) {
      // Locals: read through the closure, the pointers could alias the stores and the loops stayed scalar.
      const T* g = dy;
      const uint8_t* k = keep;
      T* d = dx.data;
      const T scale = keep_scale;
      if (dx.accumulate)
        for (int64_t i = lo; i < hi; ++i) d[i] += g[i] * (k[i] ? scale : T(0));
      else
        for (int64_t i = lo; i < hi; ++i) d[i] = g[i] * (k[i] ? scale : T(0));
    });
  });
  return y;
}

// With the output's quantizer fused in: on the CPU the two ops in sequence (the GPU fuses them).
template <typename T>
Var gelu(Graph<T>& g, Var x, const QuantizeOutput& q) {
  BERT_DISPATCH_CUDA(g, gelu(g, x, q))
  return fake_quantize(g, gelu(g, x), q.scale, q.qmin, q.qmax, q.grad_scale, q.clipped, q.integers);
}

template <typename T>
Var dropout(Graph<T>& g, Var x, double p, bool training, Rng& rng, const QuantizeOutput& q) {
  BERT_CHECK(p >= 0.0 && p < 1.0, "dropout probability " + std::to_string(p) + " outside [0, 1)");
  if (training && p > 0) {
    BERT_DISPATCH_CUDA(g, dropout(g, x, p, rng, q))
  }
  return fake_quantize(g, dropout(g, x, p, training, rng), q.scale, q.qmin, q.qmax, q.grad_scale, q.clipped);
}

#define BERT_INSTANTIATE(T)                                    \
  template Var add<T>(Graph<T>&, Var, Var);                    \
  template Var mul<T>(Graph<T>&, Var, Var);                    \
  template Var scale<T>(Graph<T>&, Var, double);               \
  template Var gelu<T>(Graph<T>&, Var);                        \
  template void on_gelu_backward<T>(Graph<T>&, Var, Var);      \
  template Var tanh<T>(Graph<T>&, Var);                        \
  template Var dropout<T>(Graph<T>&, Var, double, bool, Rng&); \
  template Var gelu<T>(Graph<T>&, Var, const QuantizeOutput&); \
  template Var dropout<T>(Graph<T>&, Var, double, bool, Rng&, const QuantizeOutput&);
BERT_INSTANTIATE(float)
BERT_INSTANTIATE(double)
#undef BERT_INSTANTIATE

}  // namespace bert::ops
