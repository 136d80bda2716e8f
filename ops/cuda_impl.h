// The CUDA implementations of the primitive ops (ops/*.cu), one per op of ops/ops.h with the
// same contract, for graphs on a CUDA device. The ops of ops/ops.h dispatch here on their own; call
// these directly only in tests. Compiled only in a CUDA build (BERT_WITH_CUDA).
#pragma once

#include <array>
#include <functional>
#include <initializer_list>
#include <span>
#include <type_traits>
#include <vector>

#include "core/graph.h"
#include "core/rng.h"
#include "ops/ops.h"

namespace bert::ops::cuda_impl {

// In BF16 mixed precision (Graph::activation_dtype() is kBF16) the ops that make activations
// (matmul, linear, gather_rows, fake_quantize, gelu, tanh, softmax, layer_norm, dropout, permute) emit
// BF16 and read an F32 activation input through a conversion node; add, mul and scale keep their
// inputs' dtype (a BF16/F32 mix is promoted to F32, as in PyTorch); losses and sums emit F32. Parameters
// (weights, biases, LayerNorm's gamma and beta, tables, scales, masks) are read as F32 wherever they
// appear, and their gradients are F32. In FP32 and TF32 every node is F32 and nothing is converted.

// x stored as `dtype`: x itself when it already is, else a conversion node whose backward converts the
// gradient back.
Var to_dtype(Graph<float>& g, Var x, DType dtype);
// x in the dtype the graph's activations take.
inline Var as_activation(Graph<float>& g, Var x) { return to_dtype(g, x, g.activation_dtype()); }

Var matmul(Graph<float>& g, Var a, Var b, bool trans_a, bool trans_b, double alpha = 1.0);
Var linear(Graph<float>& g, Var x, Var weight, Var bias);
Var feed_forward(Graph<float>& g, Var x, Var w1, Var b1, Var w2, Var b2);
// ops::quantized_linear (checked by the caller), and its forward product: y (rows, out) = the integers behind
// x (rows, in) and the weight (out, in) at the device scales *scale_x and scales[c], summed exactly on the int8
// tensor cores, then fma(sum, scale_x * scales[c], bias[c]) in A; the weight may come in parts (their rows
// stacked: the Q, K and V projections as one product), each with its scales and bias (null: none). The
// integers are the ones given (Graph::integers, written by the quantizers) where they are, else made from the
// values. False (nothing run) where that GEMM does not (not Hopper, in not a multiple of 16, unaligned
// operands).
Var quantized_linear(Graph<float>& g, Var x, Var weight, Var bias, Var scale_x, Var scale_w);
template <typename A>
struct QuantizedWeights {
  const A* w;           // (rows, in) fake-quantized values
  const float* scales;  // rows values, device
  const float* bias;    // rows values, device, or null
  int64_t rows;
  const int8_t* integers = nullptr;  // w's integers (rows, in), or null
};
template <typename A>
bool quantized_linear_product(Graph<float>& g, const A* x, const int8_t* x_integers, const float* scale_x,
                              std::span<const QuantizedWeights<A>> parts, A* y, int64_t rows, int64_t in);
Var add(Graph<float>& g, Var a, Var b);
Var mul(Graph<float>& g, Var a, Var b);
Var scale(Graph<float>& g, Var x, double alpha);
Var reshape(Graph<float>& g, Var x, Shape shape);
Var permute(Graph<float>& g, Var x, std::initializer_list<int> perm);
Var gather_rows(Graph<float>& g, Var table, std::span<const int32_t> ids, Shape ids_shape);
Var gelu(Graph<float>& g, Var x);
Var tanh(Graph<float>& g, Var x);
Var softmax(Graph<float>& g, Var x, Var mask);
Var softmax_dropout(Graph<float>& g, Var x, Var mask, double p, Rng& rng);  // training, p > 0
// softmax_dropout (training, p > 0) whose output lives in transient slot `slot` (Graph::emit_transient): not
// kept. `again` then forms it there once more, bit for bit, from the probabilities the backward keeps and
// the dropout's draws made again, and returns where. Var{} where the one-kernel softmax does not run.
using DroppedAgain = std::function<void*(Graph<float>&)>;
Var softmax_dropout_again(Graph<float>& g, Var x, Var mask, double p, Rng& rng, int slot, DroppedAgain& again);
Var layer_norm(Graph<float>& g, Var x, Var gamma, Var beta, double eps);
Var add_layer_norm(Graph<float>& g, Var a, Var b, Var gamma, Var beta, double eps);
// Training, p > 0.
Var dropout_add_layer_norm(Graph<float>& g, Var a, Var b, Var gamma, Var beta, double eps, double p, Rng& rng);
Var dropout_add_layer_norm(Graph<float>& g, Var a, Var b, Var gamma, Var beta, double eps, double p, Rng& rng,
                           const QuantizeOutput& q);  // p >= 0
std::vector<Var> dropout_add_layer_norm_each(Graph<float>& g, Var a, Var b, Var gamma, Var beta, double eps, double p,
                                             Rng& rng, const QuantizeOutput* q,
                                             std::span<const QuantizeOutput> outputs);  // p >= 0
Var dropout(Graph<float>& g, Var x, double p, Rng& rng);
std::vector<Var> add_layer_norm_quantized(Graph<float>& g, Var a, Var b, Var gamma, Var beta, double eps,
                                          const QuantizeOutput* q, std::span<const NormOutput> outputs,
                                          const NormInputs& inputs);
std::vector<Var> embedding_layer_norm_quantized(Graph<float>& g, Var words, Var positions, Var types,
                                                std::span<const int32_t> ids, std::span<const int32_t> type_ids,
                                                Shape ids_shape, Var gamma, Var beta, double eps,
                                                std::span<const NormOutput> outputs);
Var distillation_loss(Graph<float>& g, Var student, Var teacher, double temperature);
Var cross_entropy(Graph<float>& g, Var logits, std::span<const int32_t> targets, std::span<const float> weights,
                  int32_t ignore_index);
LinearScores cross_entropy_scores(Graph<float>& g, Var logits, std::span<const int32_t> targets, PredictionsTo to);
LinearScores linear_cross_entropy_scores(Graph<float>& g, Var x, Var weight, Var bias, std::span<const int32_t> targets,
                                         PredictionsTo to);
Var sum(Graph<float>& g, Var x);
Var fake_quantize(Graph<float>& g, Var x, Var scale, int qmin, int qmax, double grad_scale, int64_t* clipped,
                  bool integers = false);
Var gelu(Graph<float>& g, Var x, const QuantizeOutput& q);
Var dropout(Graph<float>& g, Var x, double p, Rng& rng, const QuantizeOutput& q);  // training, p > 0
Var softmax_dropout(Graph<float>& g, Var x, Var mask, double p, Rng& rng, const QuantizeOutput& q);  // p >= 0
std::vector<Var> fake_quantize_each(Graph<float>& g, Var x, std::span<const QuantizeOutput> quantizers);
// fake_quantize_each's backward pass for an op that makes the quantized outputs itself
// (dropout_add_layer_norm_each): dx (n elements of `dtype`, stored or added to) gains the sum of each
// quantizer's straight-through gradient at x, and each scale's gradient is added to its ds; up to 4 quantizers.
struct EachGradient {
  const float* scale;
  float lo, hi;
  const void* dy;  // that output's gradient, or nullptr: none
  float* ds;       // nullptr: no scale gradient
  double grad_scale;
};
void fake_quantize_each_backward(Graph<float>& g, DType dtype, const void* x, void* dx, bool accumulate, int64_t n,
                                 std::span<const EachGradient> grads);
// Empty where the one-launch kernels do not apply (the caller quantizes one by one).
std::vector<Var> fake_quantize_many(Graph<float>& g, std::span<const QuantizeInput> inputs);
// ops::quantized_projections: invalid Vars where the GPU path does not apply (C not a multiple of 8, a
// part of 2^32 elements or more); the caller then runs the ops one by one.
std::array<Var, 3> quantized_projections(Graph<float>& g, Var x, const std::array<Var, 3>& weights,
                                         const std::array<Var, 3>& biases,
                                         const std::array<QuantizeOutput, 3>& quantizers,
                                         const ProjectionScales* integers);
// Fused attention (ops::attention, with the probabilities' quantizer where `probs` is given: the tensor-core
// kernels only), whether its kernels cover a head size and length on g's GPU in g's activation dtype, and
// whether those are the tensor-core kernels (BF16 steps; TF32 steps where their tiles fit shared memory).
Var attention(Graph<float>& g, Var q, Var k, Var v, Var mask, int64_t heads, double alpha, double p, bool training,
              Rng& rng, const QuantizeOutput* probs = nullptr);
bool attention_fits(const Graph<float>& g, int64_t head_size, int64_t length);
bool attention_on_tensor_cores(const Graph<float>& g, int64_t head_size, int64_t length);
// ops::self_attention where attention runs fused (x (B, T, C), C a multiple of 8).
Var self_attention(Graph<float>& g, Var x, const std::array<Var, 3>& weights, const std::array<Var, 3>& biases,
                   Var mask, int64_t heads, double alpha, double p, bool training, Rng& rng);
Var head_scores(Graph<float>& g, Var q, Var k, int64_t heads, double alpha, bool transient);
Var exact_quantized_attention(Graph<float>& g, Var q, Var k, Var v, Var mask, int64_t heads,
                              const Int8AttentionScales& scales, double alpha, const QuantizeOutput& probs_quantizer);
Var head_context(Graph<float>& g, Var probs, Var v, int64_t heads);
Var softmax_dropout_context(Graph<float>& g, Var scores, Var mask, Var v, int64_t heads, double p,
                            Rng& rng);  // training, p > 0
Var exact_quantized_linear(Graph<float>& g, Var x, float scale_x, Var weight, std::span<const float> scale_w, Var bias,
                           bool gelu);  // checked by the caller
// For DeviceInt8Weights on a GPU where the Hopper int8 GEMM runs: writes the weights' TMA descriptor
// (128 bytes) into `map` and returns cuTensorMapEncodeTiled; nullptr where it does not run.
void* int8_weights_tensor_map(const Device& device, const int8_t* weights, int64_t n, int64_t ld, void* map);
// DeviceGeluTable's entries (65,536 int8) for a quantizer at `scale`, made on the device's stream.
void int8_gelu_table(const Device& device, int8_t* table, float scale);
// ops::int8_linear with DeviceInt8Weights and ops::int8_linear_quantized (checked by the caller).
std::vector<Var> int8_linear(Graph<float>& g, Var x, const DeviceInt8Weights& weights, float scale_x, bool gelu,
                             std::span<const Int8OutputPart> parts, bool integers, DeviceInt8Gemm gemm);
// ops::int8_attention_integers (checked by the caller) and whether its kernel covers a head size and length
// on the graph's GPU.
Var int8_attention(Graph<float>& g, Var q, Var k, Var v, Var mask, int64_t heads, const Int8AttentionScales& scales,
                   double alpha, float out_scale);
bool int8_attention_fits(const Graph<float>& g, int64_t head_size, int64_t length);
std::vector<int32_t> row_argmax(const Graph<float>& g, Var x);
double abs_max(Graph<float>& g, Var x);
std::vector<int64_t> abs_histogram(Graph<float>& g, Var x, double range, int bins);

}  // namespace bert::ops::cuda_impl

// Inside a CPU op template: hand a float graph on a CUDA device to the CUDA implementation.
#if BERT_WITH_CUDA
#define BERT_DISPATCH_CUDA(g, call)                 \
  if constexpr (std::is_same_v<T, float>) {         \
    if ((g).on_cuda()) return ops::cuda_impl::call; \
  }
#else
#define BERT_DISPATCH_CUDA(g, call)
#endif
