// Self-attention's core as the ops it is made of (the reference the fused GPU kernels of
// ops/attention.cu are held to), and the dispatch to those kernels.
#include <algorithm>
#include <type_traits>

#include "ops/cuda_impl.h"
#include "ops/ops.h"
#include "sys/error.h"

namespace bert::ops {

bool fused_attention(const Graph<float>& g, int64_t head_size, int64_t length) {
#if BERT_WITH_CUDA
  return g.on_cuda() && cuda_impl::attention_fits(g, head_size, length);
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
  Var probs = softmax_dropout(g, head_scores(g, q, k, heads, alpha, /*transient=*/true), mask, p, training,
                              rng);  // (B, H, T, T)
  return head_context(g, probs, v, heads);
}

bool fused_quantized_attention(const Graph<float>& g, int64_t head_size, int64_t length) {
#if BERT_WITH_CUDA
  return g.on_cuda() && cuda_impl::attention_on_tensor_cores(g, head_size, length);
#else
  (void)g, (void)head_size, (void)length;
  return false;
#endif
}

template <typename T>
Var attention(Graph<T>& g, Var q, Var k, Var v, Var mask, int64_t heads, double alpha, double p, bool training,
              Rng& rng, const QuantizeOutput& probs) {
  const Shape s = g.shape(q);
  BERT_CHECK(s.rank() == 3 && heads > 0 && s[2] % heads == 0,
             "attention: q " + s.str() + " is not (B, T, C) with C a multiple of " + std::to_string(heads) + " heads");
  if constexpr (std::is_same_v<T, float>) {
#if BERT_WITH_CUDA
    if (fused_quantized_attention(g, s[2] / heads, s[1]))
      return cuda_impl::attention(g, q, k, v, mask, heads, alpha, p, training, rng, &probs);
#endif
  }
  const Var probabilities =
      softmax_dropout(g, head_scores(g, q, k, heads, alpha, /*transient=*/true), mask, p, training, rng, probs);
  return head_context(g, probabilities, v, heads);
}

template <typename T>
Var self_attention(Graph<T>& g, Var x, const std::array<Var, 3>& weights, const std::array<Var, 3>& biases, Var mask,
                   int64_t heads, double alpha, double p, bool training, Rng& rng) {
  const Shape s = g.shape(x);
  BERT_CHECK(
      s.rank() == 3 && heads > 0 && s[2] % heads == 0,
      "self_attention: x " + s.str() + " is not (B, T, C) with C a multiple of " + std::to_string(heads) + " heads");
  for (int i = 0; i < 3; ++i)
    BERT_CHECK(g.shape(weights[i]) == Shape({s[2], s[2]}) && g.shape(biases[i]) == Shape({s[2]}),
               "self_attention: projection " + std::to_string(i) + " has weight " + g.shape(weights[i]).str() +
                   " and bias " + g.shape(biases[i]).str() +
                   " (expected (C, C) and (C) for C = " + std::to_string(s[2]) + ")");
  if constexpr (std::is_same_v<T, float>) {
#if BERT_WITH_CUDA
    const bool parameters =
        std::all_of(weights.begin(), weights.end(), [&](Var v) { return g.dtype(v) == DType::kF32; }) &&
        std::all_of(biases.begin(), biases.end(), [&](Var v) { return g.dtype(v) == DType::kF32; });
    if (fused_attention(g, s[2] / heads, s[1]) && s[2] % 8 == 0 && parameters)
      return cuda_impl::self_attention(g, x, weights, biases, mask, heads, alpha, p, training, rng);
#endif
  }
  return attention(g, linear(g, x, weights[0], biases[0]), linear(g, x, weights[1], biases[1]),
                   linear(g, x, weights[2], biases[2]), mask, heads, alpha, p, training, rng);
}

template Var attention<float>(Graph<float>&, Var, Var, Var, Var, int64_t, double, double, bool, Rng&);
template Var self_attention<float>(Graph<float>&, Var, const std::array<Var, 3>&, const std::array<Var, 3>&, Var,
                                   int64_t, double, double, bool, Rng&);
template Var self_attention<double>(Graph<double>&, Var, const std::array<Var, 3>&, const std::array<Var, 3>&, Var,
                                    int64_t, double, double, bool, Rng&);
template Var attention<double>(Graph<double>&, Var, Var, Var, Var, int64_t, double, double, bool, Rng&);
template Var attention<float>(Graph<float>&, Var, Var, Var, Var, int64_t, double, double, bool, Rng&,
                              const QuantizeOutput&);
template Var attention<double>(Graph<double>&, Var, Var, Var, Var, int64_t, double, double, bool, Rng&,
                               const QuantizeOutput&);

}  // namespace bert::ops
