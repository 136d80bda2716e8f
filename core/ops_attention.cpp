// Self-attention's core as the ops it is made of (the reference the fused GPU kernels of
// core/ops_attention.cu are held to), and the dispatch to those kernels; its two products per head
// (core/ops_attention_heads.cu on a GPU).
#include <type_traits>

#include "core/error.h"
#include "core/ops.h"
#include "core/ops_cuda.h"

namespace bert::ops {

bool fused_attention(const Graph<float>& g, int64_t head_size, int64_t length) {
#if BERT_WITH_CUDA
  return g.on_cuda() && cuda_impl::attention_fits(head_size, length, g.activation_dtype());
#else
  (void)g, (void)head_size, (void)length;
  return false;
#endif
}

template <typename T>
Var attention(Graph<T>& g, Var q, Var k, Var v, Var mask, int64_t heads, double alpha, double p, bool training,
              Rng& rng) {
  const Shape s = g.shape(q);
  BERT_CHECK(s.rank() == 3 && heads > 0 && s[2] % heads == 0,
             "attention: q " + s.str() + " is not (B, T, C) with C a multiple of " + std::to_string(heads) + " heads");
  const int64_t t = s[1], d = s[2] / heads;
  if constexpr (std::is_same_v<T, float>) {
#if BERT_WITH_CUDA
    if (fused_attention(g, d, t)) return cuda_impl::attention(g, q, k, v, mask, heads, alpha, p, training, rng);
#endif
  }
  (void)t, (void)d;
  Var probs = softmax_dropout(g, head_scores(g, q, k, heads, alpha), mask, p, training, rng);  // (B, H, T, T)
  return head_context(g, probs, v, heads);
}

namespace {
// (B, T, C) -> (B, H, T, D)
Var split_heads(auto& g, Var x, int64_t heads) {
  const Shape s = g.shape(x);
  BERT_CHECK(s.rank() == 3 && heads > 0 && s[2] % heads == 0,
             "attention heads: " + s.str() + " is not (B, T, C) with C a multiple of " + std::to_string(heads) +
                 " heads");
  return permute(g, reshape(g, x, Shape{s[0], s[1], heads, s[2] / heads}), {0, 2, 1, 3});
}
}  // namespace

template <typename T>
Var head_scores(Graph<T>& g, Var q, Var k, int64_t heads, double alpha) {
  BERT_DISPATCH_CUDA(g, head_scores(g, q, k, heads, alpha))
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

template Var attention<float>(Graph<float>&, Var, Var, Var, Var, int64_t, double, double, bool, Rng&);
template Var attention<double>(Graph<double>&, Var, Var, Var, Var, int64_t, double, double, bool, Rng&);
template Var head_scores<float>(Graph<float>&, Var, Var, int64_t, double);
template Var head_scores<double>(Graph<double>&, Var, Var, int64_t, double);
template Var head_context<float>(Graph<float>&, Var, Var, int64_t);
template Var head_context<double>(Graph<double>&, Var, Var, int64_t);

}  // namespace bert::ops
