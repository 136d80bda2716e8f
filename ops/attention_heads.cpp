// Attention's two products per head on the projections in place (head_scores, head_context): on the CPU
// the permutes and products they are made of; the GPU twin (ops/attention_heads.cu) runs batched GEMMs.
#include <string>

#include "ops/cuda_impl.h"
#include "ops/ops.h"

namespace bert::ops {

namespace {
// (B, T, C) -> (B, H, T, D)
Var split_heads(auto& g, Var x, int64_t heads) {
  const Shape s = g.shape(x);
  BERT_CHECK(
      s.rank() == 3 && heads > 0 && s[2] % heads == 0,
      "attention heads: " + s.str() + " is not (B, T, C) with C a multiple of " + std::to_string(heads) + " heads");
  return permute(g, reshape(g, x, Shape{s[0], s[1], heads, s[2] / heads}), {0, 2, 1, 3});
}
}  // namespace

template <typename T>
Var head_scores(Graph<T>& g, Var q, Var k, int64_t heads, double alpha, bool transient) {
  BERT_DISPATCH_CUDA(g, head_scores(g, q, k, heads, alpha, transient))
  (void)transient;
  BERT_CHECK(g.shape(k) == g.shape(q), "head_scores: k " + g.shape(k).str() + " differs from q " + g.shape(q).str());
  return scaled_matmul(g, split_heads(g, q, heads), split_heads(g, k, heads), alpha, false, true);
}

template <typename T>
Var head_context(Graph<T>& g, Var probs, Var v, int64_t heads) {
  BERT_DISPATCH_CUDA(g, head_context(g, probs, v, heads))
  const Shape s = g.shape(v);
  Var context = matmul(g, probs, split_heads(g, v, heads));  // (B, H, T, D)
  return reshape(g, permute(g, context, {0, 2, 1, 3}), s);
}

template <typename T>
Var softmax_dropout_context(Graph<T>& g, Var scores, Var mask, Var v, int64_t heads, double p, bool training,
                            Rng& rng) {
  if (training && p > 0 && g.grad_enabled()) {
    BERT_DISPATCH_CUDA(g, softmax_dropout_context(g, scores, mask, v, heads, p, rng))
  }
  return head_context(g, softmax_dropout(g, scores, mask, p, training, rng), v, heads);
}

Var exact_quantized_attention(Graph<float>& g, Var q, Var k, Var v, Var mask, int64_t heads,
                              const Int8AttentionScales& scales, double alpha, const QuantizeOutput& probs_quantizer) {
  const std::string op = "exact_quantized_attention";
  BERT_CHECK(g.on_cuda(), op + ": runs on a CUDA device");
  BERT_CHECK(!g.grad_enabled(), op + " has no gradient: run it under NoGradGuard (inference only)");
  BERT_CHECK(g.shape(k) == g.shape(q) && g.shape(v) == g.shape(q), op + ": q, k, v must be one (B, T, C) shape, got " +
                                                                       g.shape(q).str() + ", " + g.shape(k).str() +
                                                                       ", " + g.shape(v).str());
  BERT_CHECK(scales.q > 0 && scales.k > 0 && scales.v > 0 && scales.probs > 0 && probs_quantizer.scale.valid() &&
                 probs_quantizer.qmin == -128 && probs_quantizer.qmax == 127,
             op + ": positive scales and a probabilities' quantizer to [-128, 127]");
#if BERT_WITH_CUDA
  return cuda_impl::exact_quantized_attention(g, q, k, v, mask, heads, scales, alpha, probs_quantizer);
#else
  (void)mask, (void)heads, (void)alpha;
  throw InternalError(op + ": this build has no CUDA support");
#endif
}

template Var head_scores<float>(Graph<float>&, Var, Var, int64_t, double, bool);
template Var head_scores<double>(Graph<double>&, Var, Var, int64_t, double, bool);
template Var head_context<float>(Graph<float>&, Var, Var, int64_t);
template Var head_context<double>(Graph<double>&, Var, Var, int64_t);
template Var softmax_dropout_context<float>(Graph<float>&, Var, Var, Var, int64_t, double, bool, Rng&);
template Var softmax_dropout_context<double>(Graph<double>&, Var, Var, Var, int64_t, double, bool, Rng&);

}  // namespace bert::ops
