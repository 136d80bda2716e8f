// Attention's two products on a CUDA device without moving the heads (ops::head_scores, ops::head_context):
// q, k, v and the context stay in the projections' (B, T, C) layout, head h of item b a (T, D) matrix at
// column h D with leading dimension C, and one batched GEMM (cuBLAS's pointer-array form) takes every
// (b, h) pair. Forward and backward side by side; the CPU's reference is the permutes and batched
// products these replace (ops/attention.cpp).
#include "ops/cuda/common.cuh"
#include "ops/cuda/fake_quantize.cuh"
#include "ops/cuda_impl.h"

namespace bert::ops::cuda_impl {

namespace {

// Where item (b, h)'s matrix of one operand starts: base + b batch_stride + h head_stride elements, rows
// `ld` apart.
struct HeadOperand {
  const void* base;
  int64_t ld, batch_stride, head_stride;
};
// The (B, T, C) layout (C = heads D) and the (B, H, T, T) one.
HeadOperand projection(const void* base, int64_t t, int64_t c, int64_t d) { return {base, c, t * c, d}; }
HeadOperand square(const void* base, int64_t t, int64_t heads) { return {base, t, heads * t * t, t * t}; }

// The three pointer arrays of a batched GEMM: item i = b heads + h.
template <typename A>
__global__ void head_pointers(const A** a, const A** b, A** c, HeadOperand oa, HeadOperand ob, HeadOperand oc,
                              int64_t heads, int64_t items) {
  BERT_GRID_STRIDE(i, items) {
    const int64_t item = i / heads, h = i % heads;
    a[i] = static_cast<const A*>(oa.base) + item * oa.batch_stride + h * oa.head_stride;
    b[i] = static_cast<const A*>(ob.base) + item * ob.batch_stride + h * ob.head_stride;
    c[i] = static_cast<A*>(const_cast<void*>(oc.base)) + item * oc.batch_stride + h * oc.head_stride;
  }
}

// Row-major C_i (m, n) = alpha op(A_i) op(B_i) + beta C_i for every (b, h); cuBLAS is column-major, so it
// computes C_i^T = op(B_i)^T op(A_i)^T on the same memory (as matmul.cu's gemm).
template <typename A>
void head_gemm(Graph<float>& g, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
               HeadOperand a, HeadOperand b, float beta, HeadOperand c, int64_t batch, int64_t heads) {
  const int64_t items = batch * heads;
  const A** pa = g.scratch<const A*>(items);
  const A** pb = g.scratch<const A*>(items);
  A** pc = g.scratch<A*>(items);
  BERT_LAUNCH(head_pointers<A>, items, g, pa, pb, pc, a, b, c, heads, items);
  constexpr cudaDataType_t type = cuda::cuda_data_type<A>();
  BERT_CUBLAS_CHECK(cublasGemmBatchedEx(
      cuda::cublas(g), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, int(n), int(m), int(k),
      &alpha, reinterpret_cast<const void* const*>(pb), type, int(b.ld), reinterpret_cast<const void* const*>(pa), type,
      int(a.ld), &beta, reinterpret_cast<void* const*>(pc), type, int(c.ld), int(items), cuda::compute_type(g, type),
      CUBLAS_GEMM_DEFAULT));
}

struct Geometry {
  int64_t batch, length, channels, heads, head_size;  // B, T, C, H, D
};
Geometry geometry(Graph<float>& g, Var x, int64_t heads, const char* op) {
  const Shape s = g.shape(x);
  BERT_CHECK(s.rank() == 3 && heads > 0 && s[2] % heads == 0,
             std::string(op) + ": " + s.str() + " is not (B, T, C) with C a multiple of " + std::to_string(heads) +
                 " heads");
  return {s[0], s[1], s[2], heads, s[2] / heads};
}

}  // namespace

Var exact_quantized_attention(Graph<float>& g, Var q, Var k, Var v, Var mask, int64_t heads,
                              const Int8AttentionScales& scales, double alpha, const QuantizeOutput& probs_quantizer) {
  const Geometry s = geometry(g, v, heads, "exact_quantized_attention");
  const int64_t t = s.length, c = s.channels, d = s.head_size, n = s.batch * t * c;
  q = as_activation(g, q), k = as_activation(g, k), v = as_activation(g, v);
  const DType dtype = g.dtype(v);
  Var scores = g.emit(Shape{s.batch, heads, t, t}, {q, k}, dtype), probs;
  void* integers[3] = {};
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    const std::array<Var, 3> operands = {q, k, v};
    const std::array<float, 3> operand_scales = {scales.q, scales.k, scales.v};
    for (int i = 0; i < 3; ++i) {
      A* values = g.scratch<A>(n);
      BERT_LAUNCH((cuda::int8_values<A, A>), n, g, values, cuda::typed<A>(g.data(operands[i])), int64_t{1}, n,
                  operand_scales[i], nullptr, int64_t{1});
      integers[i] = values;
    }
    // S_bh (T, T) = (scale_q RN(scale_k alpha)) Q_bh K_bh^T on the integers: exact FP32 sums, one rounding.
    head_gemm<A>(g, false, true, t, t, d, scales.q * static_cast<float>(scales.k * alpha),
                 projection(integers[0], t, c, d), projection(integers[1], t, c, d), 0.0f,
                 square(g.data(scores), t, heads), s.batch, heads);
  });
  Rng unused(0);  // (no dropout)
  probs = softmax_dropout(g, scores, mask, 0.0, unused, probs_quantizer);
  Var context = g.emit(g.shape(v), {probs, v}, dtype);
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    const int64_t count = s.batch * heads * t * t;
    A* p = g.scratch<A>(count);
    BERT_LAUNCH((cuda::int8_values<A, A>), count, g, p, cuda::typed<A>(g.data(probs)), int64_t{1}, count, 0.0f,
                g.value(probs_quantizer.scale).data(), int64_t{1});
    // O_bh (T, D) = (scale_probs scale_v) P_bh V_bh on the integers.
    head_gemm<A>(g, false, false, t, d, t, scales.probs * scales.v, square(p, t, heads),
                 projection(integers[2], t, c, d), 0.0f, projection(g.data(context), t, c, d), s.batch, heads);
  });
  return context;
}

Var head_scores(Graph<float>& g, Var q, Var k, int64_t heads, double alpha_d, bool transient) {
  const Geometry s = geometry(g, q, heads, "head_scores");
  BERT_CHECK(g.shape(k) == g.shape(q), "head_scores: k " + g.shape(k).str() + " differs from q " + g.shape(q).str());
  q = as_activation(g, q);
  k = as_activation(g, k);
  const DType dtype = g.dtype(q);
  const float alpha = static_cast<float>(alpha_d);
  const int64_t t = s.length, c = s.channels, d = s.head_size;
  // Transient scores take slot 0 (ops::feed_forward's GELU output: never in use during attention).
  const Shape shape{s.batch, heads, t, t};
  Var scores = transient ? g.emit_transient(shape, {q, k}, dtype, 0) : g.emit(shape, {q, k}, dtype);
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    // S_bh (T, T) = alpha Q_bh K_bh^T
    head_gemm<A>(g, false, true, t, t, d, alpha, projection(g.data(q), t, c, d), projection(g.data(k), t, c, d), 0.0f,
                 square(g.data(scores), t, heads), s.batch, heads);
  });
  g.on_backward(scores, [q, k, scores, s, alpha, dtype](Graph<float>& g) {
    const int64_t t = s.length, c = s.channels, d = s.head_size;
    cuda::with_element_type(dtype, [&](auto tag) {
      using A = typename decltype(tag)::type;
      const HeadOperand ds = square(g.grad_data(scores), t, s.heads);
      if (g.requires_grad(q)) {  // dQ_bh (T, D) (+)= alpha dS_bh K_bh
        const auto dq = g.raw_grad_target(q);
        head_gemm<A>(g, false, false, t, d, t, alpha, ds, projection(g.data(k), t, c, d), dq.accumulate ? 1.0f : 0.0f,
                     projection(dq.data, t, c, d), s.batch, s.heads);
      }
      if (g.requires_grad(k)) {  // dK_bh (T, D) (+)= alpha dS_bh^T Q_bh
        const auto dk = g.raw_grad_target(k);
        head_gemm<A>(g, true, false, t, d, t, alpha, ds, projection(g.data(q), t, c, d), dk.accumulate ? 1.0f : 0.0f,
                     projection(dk.data, t, c, d), s.batch, s.heads);
      }
    });
  });
  return scores;
}

namespace {
// head_context; with `again` set, probs is not kept (softmax_dropout_again) and the backward forms it again
// for V's gradient.
Var head_context_of(Graph<float>& g, Var probs, Var v, int64_t heads, DroppedAgain again) {
  const Geometry s = geometry(g, v, heads, "head_context");
  const int64_t t = s.length, c = s.channels, d = s.head_size;
  BERT_CHECK(g.shape(probs) == Shape({s.batch, heads, t, t}),
             "head_context: probs " + g.shape(probs).str() + " for v " + g.shape(v).str() + " and " +
                 std::to_string(heads) + " heads");
  probs = as_activation(g, probs);
  v = as_activation(g, v);
  const DType dtype = g.dtype(v);
  Var context = g.emit(g.shape(v), {probs, v}, dtype);
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    // O_bh (T, D) = P_bh V_bh
    head_gemm<A>(g, false, false, t, d, t, 1.0f, square(g.data(probs), t, heads), projection(g.data(v), t, c, d), 0.0f,
                 projection(g.data(context), t, c, d), s.batch, heads);
  });
  g.on_backward(context, [probs, v, context, s, dtype, again](Graph<float>& g) {
    const int64_t t = s.length, c = s.channels, d = s.head_size;
    cuda::with_element_type(dtype, [&](auto tag) {
      using A = typename decltype(tag)::type;
      const HeadOperand dout = projection(g.grad_data(context), t, c, d);
      if (g.requires_grad(probs)) {  // dP_bh (T, T) (+)= dO_bh V_bh^T
        const auto dp = g.raw_grad_target(probs);
        head_gemm<A>(g, false, true, t, t, d, 1.0f, dout, projection(g.data(v), t, c, d), dp.accumulate ? 1.0f : 0.0f,
                     square(dp.data, t, s.heads), s.batch, s.heads);
      }
      if (g.requires_grad(v)) {  // dV_bh (T, D) (+)= P_bh^T dO_bh
        const auto dv = g.raw_grad_target(v);
        const void* p = again ? again(g) : g.data(probs);
        head_gemm<A>(g, true, false, t, d, t, 1.0f, square(p, t, s.heads), dout, dv.accumulate ? 1.0f : 0.0f,
                     projection(dv.data, t, c, d), s.batch, s.heads);
      }
    });
  });
  return context;
}
}  // namespace

Var head_context(Graph<float>& g, Var probs, Var v, int64_t heads) {
  return head_context_of(g, probs, v, heads, nullptr);
}

// The dropped-out probabilities in transient slot 1 (the scores, which the softmax reads, hold slot 0; the
// feed-forward block's slot 1 is free while attention runs), formed again for dV's product.
Var softmax_dropout_context(Graph<float>& g, Var scores, Var mask, Var v, int64_t heads, double p, Rng& rng) {
  DroppedAgain again;
  const Var probs = softmax_dropout_again(g, scores, mask, p, rng, 1, again);
  if (!probs.valid()) return head_context(g, softmax_dropout(g, scores, mask, p, rng), v, heads);
  return head_context_of(g, probs, v, heads, std::move(again));
}

}  // namespace bert::ops::cuda_impl
