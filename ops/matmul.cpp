// matmul and linear: forward and backward side by side, on kernels/gemm.
#include <algorithm>
#include <string>
#include <vector>

#include "kernels/gemm.h"
#include "kernels/vector_math.h"
#include "ops/cuda_impl.h"
#include "ops/ops.h"
#include "sys/parallel.h"

namespace bert::ops {

namespace {

// Whether this graph's products take BF16 operands: a CPU device in BF16 precision (Device::open("cpu",
// Precision::kBf16)) rounds both operands of every product to BF16 and sums in FP32; every tensor stays FP32.
template <typename T>
bool bf16_products(const Graph<T>& g) {
  return g.device().precision() == Precision::kBf16;
}

// How a matmul maps onto `batch` GEMMs of (M, K) x (K, N).
struct MatmulPlan {
  int64_t batch = 1, m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0;            // row strides of a and b as stored
  int64_t stride_a = 0, stride_b = 0;  // elements between batch items (0: shared)
  Shape out;
};

MatmulPlan plan_matmul(const Shape& a, const Shape& b, bool trans_a, bool trans_b) {
  BERT_CHECK(a.rank() >= 2 && b.rank() >= 2, "matmul needs rank >= 2, got " + a.str() + " x " + b.str());
  MatmulPlan p;
  p.lda = a[-1];
  p.ldb = b[-1];
  p.k = trans_b ? b[-1] : b[-2];
  p.n = trans_b ? b[-2] : b[-1];
  if (b.rank() == 2 && a.rank() > 2) {  // b shared by every row of a: fold a's leading axes into M
    BERT_CHECK(!trans_a, "matmul with a shared 2-D b cannot transpose a");
    p.m = a.rows();
    BERT_CHECK(a[-1] == p.k, "matmul inner sizes differ: " + a.str() + " x " + b.str());
    p.out = a.with_last(p.n);
    return p;
  }
  BERT_CHECK(a.rank() == b.rank(), "matmul ranks differ: " + a.str() + " x " + b.str());
  for (int i = 0; i < a.rank() - 2; ++i)
    BERT_CHECK(a[i] == b[i], "matmul batch axes differ: " + a.str() + " x " + b.str());
  p.m = trans_a ? a[-1] : a[-2];
  int64_t ka = trans_a ? a[-2] : a[-1];
  BERT_CHECK(ka == p.k, "matmul inner sizes differ: " + a.str() + " x " + b.str());
  p.batch = a.numel() / (a[-1] * a[-2]);
  p.stride_a = a[-1] * a[-2];
  p.stride_b = b[-1] * b[-2];
  p.out = a;
  p.out[-2] = p.m;
  p.out[-1] = p.n;
  return p;
}

// Runs fn(item) for every batch item; items in parallel, each GEMM then single-threaded (Eigen does
// not nest threads inside a parallel region).
template <typename Fn>
void for_each_item(int64_t batch, Fn fn) {
  if (batch == 1) {
    fn(0);
    return;
  }
  parallel_for(batch, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) fn(i);
  });
}

// C = alpha op(A) op(B): the scale rides in the GEMMs, forward and backward (no pass of its own).
template <typename T>
Var matmul(Graph<T>& g, Var a, Var b, bool trans_a, bool trans_b, T alpha) {
  const MatmulPlan p = plan_matmul(g.shape(a), g.shape(b), trans_a, trans_b);
  Var c = g.emit(p.out, {a, b});
  const int64_t stride_c = p.m * p.n;
  const bool bf16 = bf16_products(g);
  {
    const T* av = g.value(a).data();
    const T* bv = g.value(b).data();
    T* cv = g.value(c).data();
    for_each_item(p.batch, [&](int64_t i) {
      gemm<T>({trans_a, trans_b, p.m, p.n, p.k, bf16}, alpha, av + i * p.stride_a, p.lda, bv + i * p.stride_b, p.ldb,
              T(0), cv + i * stride_c, p.n);
    });
  }
  g.on_backward(c, [a, b, c, p, trans_a, trans_b, stride_c, alpha, bf16](Graph<T>& g) {
    const T* dc = g.grad(c).data();
    const T* av = g.value(a).data();
    const T* bv = g.value(b).data();
    // Every batch item writes its own slice of dA and dB whole: a fresh gradient is stored (beta 0).
    if (g.requires_grad(a)) {
      const auto da = g.grad_target(a);
      const T beta = da.accumulate ? T(1) : T(0);
      for_each_item(p.batch, [&](int64_t i) {
        const T* dci = dc + i * stride_c;
        const T* bi = bv + i * p.stride_b;
        T* dai = da.data + i * p.stride_a;
        if (!trans_a)  // dA (M, K) += dC (M, N) op(B)^T
          gemm<T>({false, !trans_b, p.m, p.k, p.n, bf16}, alpha, dci, p.n, bi, p.ldb, beta, dai, p.lda);
        else  // dA (K, M) += op(B) (K, N) dC^T
          gemm<T>({trans_b, true, p.k, p.m, p.n, bf16}, alpha, bi, p.ldb, dci, p.n, beta, dai, p.lda);
      });
    }
    if (g.requires_grad(b)) {
      const auto db = g.grad_target(b);
      const T beta = db.accumulate ? T(1) : T(0);
      for_each_item(p.batch, [&](int64_t i) {
        const T* dci = dc + i * stride_c;
        const T* ai = av + i * p.stride_a;
        T* dbi = db.data + i * p.stride_b;
        if (!trans_b)  // dB (K, N) += op(A)^T (K, M) dC
          gemm<T>({!trans_a, false, p.k, p.n, p.m, bf16}, alpha, ai, p.lda, dci, p.n, beta, dbi, p.ldb);
        else  // dB (N, K) += dC^T (N, M) op(A)
          gemm<T>({true, trans_a, p.n, p.k, p.m, bf16}, alpha, dci, p.n, ai, p.lda, beta, dbi, p.ldb);
      });
    }
  });
  return c;
}

}  // namespace

template <typename T>
Var scaled_matmul(Graph<T>& g, Var a, Var b, double alpha, bool trans_a, bool trans_b) {
  BERT_DISPATCH_CUDA(g, matmul(g, a, b, trans_a, trans_b, alpha))
  return matmul(g, a, b, trans_a, trans_b, static_cast<T>(alpha));
}

template <typename T>
Var matmul(Graph<T>& g, Var a, Var b, bool trans_a, bool trans_b) {
  BERT_DISPATCH_CUDA(g, matmul(g, a, b, trans_a, trans_b))
  return matmul(g, a, b, trans_a, trans_b, T(1));
}

namespace {

// The shapes of linear(x, weight, bias), checked: rows of x, inputs, outputs.
struct LinearDims {
  int64_t rows = 0, in = 0, out = 0;
};

template <typename T>
LinearDims linear_dims(Graph<T>& g, Var x, Var weight, Var bias, const char* op) {
  const Shape& xs = g.shape(x);
  const Shape& ws = g.shape(weight);
  BERT_CHECK(ws.rank() == 2 && xs.rank() >= 1 && xs[-1] == ws[1],
             std::string(op) + ": x " + xs.str() + " does not fit weight " + ws.str());
  if (bias.valid()) BERT_CHECK(g.shape(bias) == Shape({ws[0]}), std::string(op) + " bias " + g.shape(bias).str());
  return {xs.rows(), ws[1], ws[0]};
}

// y = x W^T + bias, the bias added in the GEMM's store of y (no pass of its own).
template <typename T>
void linear_product(Graph<T>& g, Var x, Var weight, Var bias, LinearDims d, T* y, const GemmFinish* finish = nullptr) {
  gemm<T>({false, true, d.rows, d.out, d.in, bf16_products(g)}, T(1), g.value(x).data(), d.in, g.value(weight).data(),
          d.in, T(0), y, d.out, CpuKernels::kAuto, bias.valid() ? g.value(bias).data() : nullptr, finish);
}

// Back-propagates y = linear(x, weight, bias)'s gradient.
template <typename T>
void linear_backward(Graph<T>& g, Var x, Var weight, Var bias, Var y, LinearDims d) {
  const int64_t rows = d.rows, in = d.in, out = d.out;
  const T* dy = g.grad(y).data();
  if (g.requires_grad(x)) {  // dx (N, in) += dy (N, out) W (out, in); a fresh dx is stored (beta 0)
    const auto dx = g.grad_target(x);
    gemm<T>({false, false, rows, in, out, bf16_products(g)}, T(1), dy, out, g.value(weight).data(), in,
            dx.accumulate ? T(1) : T(0), dx.data, in);
  }
  if (g.requires_grad(weight)) {  // dW (out, in) += dy^T (out, N) x (N, in)
    const auto dw = g.grad_target(weight);
    gemm<T>({true, false, out, in, rows, bf16_products(g)}, T(1), dy, out, g.value(x).data(), in,
            dw.accumulate ? T(1) : T(0), dw.data, in);
  }
  if (bias.valid() && g.requires_grad(bias)) {
    // Threads split the columns (each sums all rows of its own): the same sums whatever the thread count.
    T* db = g.grad(bias).data();
    parallel_for(out, 16, [&](int64_t lo, int64_t hi) {
      std::vector<T> sum(hi - lo, T(0));
      for (int64_t r = 0; r < rows; ++r) {
        const T* row = dy + r * out + lo;
        for (int64_t c = 0; c < hi - lo; ++c) sum[c] += row[c];
      }
      for (int64_t c = 0; c < hi - lo; ++c) db[lo + c] += sum[c];
    });
  }
}

}  // namespace

template <typename T>
Var linear(Graph<T>& g, Var x, Var weight, Var bias) {
  BERT_DISPATCH_CUDA(g, linear(g, x, weight, bias))
  const LinearDims d = linear_dims(g, x, weight, bias, "linear");
  const Shape shape = g.shape(x).with_last(d.out);
  Var y = bias.valid() ? g.emit(shape, {x, weight, bias}) : g.emit(shape, {x, weight});
  linear_product(g, x, weight, bias, d, g.value(y).data());
  g.on_backward(y, [x, weight, bias, y, d](Graph<T>& g) { linear_backward(g, x, weight, bias, y, d); });
  return y;
}

Var quantized_linear(Graph<float>& g, Var x, Var weight, Var bias, Var scale_x, Var scale_w) {
  const LinearDims d = linear_dims(g, x, weight, bias, "quantized_linear");
  BERT_CHECK(g.shape(scale_x).numel() == 1 && g.shape(scale_w).numel() == d.out && g.dtype(scale_x) == DType::kF32 &&
                 g.dtype(scale_w) == DType::kF32,
             "quantized_linear: one F32 input scale and " + std::to_string(d.out) + " F32 weight scales expected, " +
                 g.shape(scale_x).str() + " and " + g.shape(scale_w).str() + " given");
#if BERT_WITH_CUDA
  if (g.on_cuda()) {
    if (bias.valid()) BERT_CHECK(g.dtype(bias) == DType::kF32, "quantized_linear: a BF16 bias is not supported");
    return cuda_impl::quantized_linear(g, x, weight, bias, scale_x, scale_w);
  }
#endif
  return linear(g, x, weight, bias);
}

template <typename T>
Var linear_gelu(Graph<T>& g, Var x, Var weight, Var bias) {
  if (g.on_cuda()) return gelu(g, linear(g, x, weight, bias));
  const LinearDims d = linear_dims(g, x, weight, bias, "linear_gelu");
  const Shape shape = g.shape(x).with_last(d.out);
  Var pre = bias.valid() ? g.emit(shape, {x, weight, bias}) : g.emit(shape, {x, weight});
  T* pre_values = g.value(pre).data();
  if (!g.requires_grad(pre)) {  // nothing needs the product itself: the GELU overwrites it
    const GemmFinish in_place = [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
      for (int64_t r = r0; r < r1; ++r) vec::gelu(pre_values + r * d.out + c0, pre_values + r * d.out + c0, c1 - c0);
    };
    linear_product(g, x, weight, bias, d, pre_values, &in_place);
    return pre;
  }
  Var y = g.emit(shape, {pre});
  T* y_values = g.value(y).data();
  const GemmFinish apply_gelu = [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    for (int64_t r = r0; r < r1; ++r) vec::gelu(pre_values + r * d.out + c0, y_values + r * d.out + c0, c1 - c0);
  };
  linear_product(g, x, weight, bias, d, pre_values, &apply_gelu);
  g.on_backward(pre, [x, weight, bias, pre, d](Graph<T>& g) { linear_backward(g, x, weight, bias, pre, d); });
  on_gelu_backward(g, pre, y);
  return y;
}

template <typename T>
Var feed_forward(Graph<T>& g, Var x, Var w1, Var b1, Var w2, Var b2) {
  BERT_DISPATCH_CUDA(g, feed_forward(g, x, w1, b1, w2, b2))
  return linear(g, linear_gelu(g, x, w1, b1), w2, b2);
}

#define BERT_INSTANTIATE(T)                                               \
  template Var matmul<T>(Graph<T>&, Var, Var, bool, bool);                \
  template Var scaled_matmul<T>(Graph<T>&, Var, Var, double, bool, bool); \
  template Var linear<T>(Graph<T>&, Var, Var, Var);                       \
  template Var linear_gelu<T>(Graph<T>&, Var, Var, Var);                  \
  template Var feed_forward<T>(Graph<T>&, Var, Var, Var, Var, Var);
BERT_INSTANTIATE(float)
BERT_INSTANTIATE(double)
#undef BERT_INSTANTIATE

}  // namespace bert::ops
