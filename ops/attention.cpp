// Self-attention's core as the ops it is made of (the reference the fused GPU kernels of
// ops/attention.cu are held to), and the dispatch to those kernels.
#include <type_traits>

#include "ops/cuda_impl.h"
#include "ops/ops.h"
#include "sys/error.h"

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

template Var attention<float>(Graph<float>&, Var, Var, Var, Var, int64_t, double, double, bool, Rng&);
template Var attention<double>(Graph<double>&, Var, Var, Var, Var, int64_t, double, double, bool, Rng&);

}  // namespace bert::ops
