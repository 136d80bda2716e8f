// Self-attention's core as the ops it is made of (the reference the fused GPU kernels of
// core/ops_attention.cu are held to), and the dispatch to those kernels.
#include <type_traits>

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
Var attention(Graph<T>& g, Var q, Var k, Var v, Var mask, double alpha, double p, bool training, Rng& rng) {
  if constexpr (std::is_same_v<T, float>) {
#if BERT_WITH_CUDA
    const Shape s = g.shape(q);
    if (s.rank() == 4 && fused_attention(g, s[3], s[2]))
      return cuda_impl::attention(g, q, k, v, mask, alpha, p, training, rng);
#endif
  }
  Var scores = scaled_matmul(g, q, k, alpha, false, true);  // (B, H, T, T)
  Var probs = dropout(g, softmax(g, scores, mask), p, training, rng);
  return matmul(g, probs, v);
}

template Var attention<float>(Graph<float>&, Var, Var, Var, Var, double, double, bool, Rng&);
template Var attention<double>(Graph<double>&, Var, Var, Var, Var, double, double, bool, Rng&);

}  // namespace bert::ops
