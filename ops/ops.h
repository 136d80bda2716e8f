// The primitive ops. Each records its output node and, when gradients are wanted, its backward
// beside the forward in the same function (ops/*.cpp). Backward closures accumulate (+=) into
// input gradients. Implemented for T = float (training) and T = double (gradient checks).
//
// Shape letters: B batch, T sequence, H heads, D head size, C channels, V vocabulary, N rows.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <span>
#include <vector>

#include "core/graph.h"
#include "core/rng.h"
#include "kernels/int8_gemm.h"

namespace bert::ops {

// Matrix product of the last two axes: op(a) (.., M, K) x op(b) (.., K, N) -> (.., M, N), where op
// transposes when asked. Either a and b have the same rank and equal leading (batch) axes, or b is 2-D
// and shared by every row of a (then trans_a must be false).
template <typename T>
Var matmul(Graph<T>& g, Var a, Var b, bool trans_a = false, bool trans_b = false);

// alpha * matmul(a, b): on the CPU exactly scale(matmul(a, b), alpha); on a GPU alpha is the GEMM's
// own factor, forward and backward (a pass over the product fewer each way; attention scores).
template <typename T>
Var scaled_matmul(Graph<T>& g, Var a, Var b, double alpha, bool trans_a = false, bool trans_b = false);

// x (.., in) W^T (out, in) + bias (out) -> (.., out). `bias` may be Var{} (none).
template <typename T>
Var linear(Graph<T>& g, Var x, Var weight, Var bias);

// linear(x, weight, bias) in quantization-aware training, where x holds the values of an 8-bit per-tensor fake
// quantizer at scale_x (one F32 value) and weight those of a per-output-channel one at scale_w (out values): the
// quantizers' own scale parameters, read where they are. On a GPU where the Hopper int8 GEMM runs (compute
// capability 9.0, inputs a multiple of 16) the forward recovers the integers behind x and weight (each value is
// an integer times its scale, rounded: dividing gives it back exactly), sums their products exactly on the
// int8 tensor cores and writes fma(sum, scale_x * scale_w[c], bias[c]) in the activations' dtype: linear's
// values up to float rounding (the integer engine's). The backward is linear's on x and weight as they are;
// the straight-through and scale gradients come from the quantizer ops that made them (this op gives the
// scales none). Elsewhere it is linear.
Var quantized_linear(Graph<float>& g, Var x, Var weight, Var bias, Var scale_x, Var scale_w);

// gelu(linear(x, weight, bias)) in one op: the GELU is applied to each block of the product as the GEMM
// finishes it, while the block is in cache, instead of in a pass over memory of its own; when nothing needs
// a gradient it overwrites the product (one tensor, not two). The same values and gradients as the two ops.
template <typename T>
Var linear_gelu(Graph<T>& g, Var x, Var weight, Var bias);

// A transformer's feed-forward block, linear(gelu(linear(x, w1, b1)), w2, b2), in one op. On a GPU the GELU's
// output, the largest activation of a BERT layer, lives only while the op runs (Graph::transient): the
// backward computes it again from the first product, in the pass that applies the GELU's derivative. The
// same values and gradients as the three ops, bit for bit; on the CPU it is those ops (linear_gelu, linear).
template <typename T>
Var feed_forward(Graph<T>& g, Var x, Var w1, Var b1, Var w2, Var b2);

// Activation checkpointing: y = fn(g', inputs', rng) computed on g's sub-graph (Graph::sub_graph), whose
// tensors live only while this op runs: g keeps y and none of what fn made on the way. The backward runs fn
// again on the same inputs with rng as it was (the same dropout draws) and back-propagates y's gradient
// through that. The values and gradients of fn run on g, bit for bit (fn's ops are deterministic), for the
// memory of one call's intermediate tensors instead of every call's, and the time of fn's forward once more.
// Without gradients fn runs on g itself. F32 nodes only (the CPU, or a GPU step in FP32 or TF32).
template <typename T>
using Recomputed = std::function<Var(Graph<T>& g, std::span<const Var> inputs, Rng& rng)>;
template <typename T>
Var recompute(Graph<T>& g, std::span<const Var> inputs, Rng& rng, Recomputed<T> fn);

// INT8 inference: x (.., in) quantized per tensor (round(x / scale_x) clamped to [-128, 127], as
// fake_quantize does) times `weights`, quantized per output channel and packed, summed exactly in int32
// (kernels/int8_gemm.h), then scale_x * scale_w[c] * sum + bias[c] -> (.., out). The values of
// linear(fake_quantize(x), fake_quantize(W), bias) up to the float summation order. CPU only, and
// forward only: the graph must not be recording gradients (NoGradGuard).
Var int8_linear(Graph<float>& g, Var x, const Int8Weights& weights, float scale_x, std::span<const float> scale_w,
                Var bias);
// The fake-quantized model's linear in inference, with exact sums: x holds fake-quantized values (multiples
// of scale_x) and weight fake-quantized ones (row c multiples of scale_w[c]); both are divided back to their
// integers, whose products are summed by float GEMMs (the CPU's FP32 GEMM; on a GPU BF16 tensor cores with
// FP32 sums, the integers being exact in BF16) in slices of up to 1024 inputs (each slice's partial sums stay
// below 2^24: exact), the slices added in int32, then scale_x * scale_w[c] * sum + bias[c] as int8_linear's
// epilogue computes it, and with gelu set GELU as int8_linear_gelu applies it. So the fake-quantized model
// and the integer engine give the same values, bit for bit, where float summation order would otherwise set
// the two apart (and the next quantizer's rounding would amplify that). Forward only (NoGradGuard).
Var exact_quantized_linear(Graph<float>& g, Var x, float scale_x, Var weight, std::span<const float> scale_w, Var bias,
                           bool gelu = false);
// int8_linear then GELU, applied in the integer GEMM to each block of its output (the values of
// gelu(int8_linear(..)), one pass over memory fewer). CPU, forward only.
Var int8_linear_gelu(Graph<float>& g, Var x, const Int8Weights& weights, float scale_x, std::span<const float> scale_w,
                     Var bias);
// An integer linear's constants in a device's memory for INT8 inference on a GPU: the int8 weights (n, k)
// row-major, each row padded with zeros to ld() bytes (a multiple of 16, as the tensor cores' int8 operands
// need), the weight scale of each output channel and the bias (zeros where none is given). Made once when
// the model is prepared for integer inference; the integers int8_linear's Int8Weights packs on the CPU.
class DeviceInt8Weights {
 public:
  // weights row-major (n, k); scales: n values; bias: n values or none.
  DeviceInt8Weights(const Device& device, const int8_t* weights, std::span<const float> scales,
                    std::span<const float> bias, int64_t n, int64_t k);
  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  int64_t ld() const { return ld_; }
  const int8_t* data() const { return buffer_.as<const int8_t>(); }
  const float* scales() const { return scales_.as<const float>(); }  // device, n values
  const float* bias() const { return bias_.as<const float>(); }      // device, n values
  const Device& device() const { return *device_; }
  // The row length of int8 operands of k inputs: k rounded up to a multiple of 16.
  static int64_t row_bytes(int64_t k) { return (k + 15) / 16 * 16; }
  // What the Hopper GEMM (ops/cuda/int8_wgmma.cuh) needs, made once here rather than on every call: the
  // weights' TMA descriptor (a CUtensorMap) and the driver's cuTensorMapEncodeTiled for the activations';
  // nullptr where that GEMM does not run (other GPUs, builds without sm_90a code).
  const void* tensor_map() const { return encode_ ? map_.data() : nullptr; }
  void* encode_tensor_map() const { return encode_; }

 private:
  const Device* device_;
  int64_t n_, k_, ld_;
  DeviceBuffer buffer_, scales_, bias_;
  alignas(64) std::array<std::byte, 128> map_{};
  void* encode_ = nullptr;
};
// The int8 GEMM a GPU's int8_linear runs: the fastest there is (ours on Hopper's wgmma with the
// dequantization in its epilogue, where the build has sm_90a code and the GPU is compute capability 9.0;
// else cuBLASLt's), or cuBLASLt's, whose int32 sums a second kernel dequantizes (the reference).
enum class DeviceInt8Gemm { kFastest, kCublasLt };
// int8_linear and int8_linear_gelu on a GPU (a graph on the weights' CUDA device): x quantized per tensor
// in one pass (as int8_linear quantizes), int8 x int8 products summed in int32 on the tensor cores, then
// fma(sum, scale_x * scale_w[c], bias[c]) (and GELU with gelu set) in the activations' dtype: in FP32 the
// CPU ops' values bit for bit (GELU: the GPU's own, as ops::gelu computes it). x may also hold the
// integers themselves (DType::kS8, at scale_x: int8_linear_quantized's output), which skips the
// quantization. Forward only (NoGradGuard).
Var int8_linear(Graph<float>& g, Var x, const DeviceInt8Weights& weights, float scale_x, bool gelu = false,
                DeviceInt8Gemm gemm = DeviceInt8Gemm::kFastest);
// The lookup table of a GELU epilogue quantized at `scale` on a GPU: for each BF16 value of a linear's output,
// the integer int8_linear_quantized's GELU part gives it (the 64 KiB that part's epilogue reads in BF16,
// cuda::int8_epilogue_table). Made once where a model is prepared for integer inference rather than on every
// forward; a part uses it where its scale is the table's (else the linear makes its own for that call).
class DeviceGeluTable {
 public:
  DeviceGeluTable(const Device& device, float scale);
  float scale() const { return scale_; }
  const int8_t* data() const { return buffer_.as<const int8_t>(); }  // device, 65,536 entries

 private:
  float scale_;
  DeviceBuffer buffer_;
};
// A part of a GPU integer linear's output columns, quantized in the GEMM's epilogue by the input quantizer of
// the op that reads it (per tensor, at `scale`, to [-128, 127]; scale 0: the values as int8_linear gives them).
struct Int8OutputPart {
  int64_t columns = 0;
  float scale = 0.0f;
  const DeviceGeluTable* gelu_table = nullptr;  // (optional) made at `scale`, for a GELU part in BF16
};
// int8_linear on a GPU whose output columns are cut into parts (their columns add up to weights.n()), one
// node each (.., columns), each quantized in the GEMM's epilogue as its consumer's quantizer would: the
// linear's output rounded to the activations' dtype (the value the fake-quantized model stores), with gelu
// set GELU of it in FP32, then round(v / scale) half to even, clamped to [-128, 127]. With `integers` the
// parts are int8 (DType::kS8, every part quantized: the input of an int8_linear at that scale), else the
// fake quantizer's values q * scale in the activations' dtype. The quantize passes of the consumers (and
// of a following int8_linear) are never made: Q, K and V from one GEMM with the attention products' input
// quantizers, the FFN's GELU with the output layer's. Forward only (NoGradGuard).
std::vector<Var> int8_linear_quantized(Graph<float>& g, Var x, const DeviceInt8Weights& weights, float scale_x,
                                       bool gelu, std::span<const Int8OutputPart> parts, bool integers,
                                       DeviceInt8Gemm gemm = DeviceInt8Gemm::kFastest);

// INT8 inference of a product of two activations, batched over the leading axes (attention's products
// one at a time: int8_attention below is held to them): a (.., M, K) and b (.., K, N), or b (.., N, K) with trans_b,
// each quantized per tensor as fake_quantize does (round(v / scale) to even, clamped to [-128, 127]), multiplied
// exactly in int32, then alpha * scale_a * scale_b * sum. The values of alpha * matmul(fake_quantize(a),
// fake_quantize(b)) up to the float summation order. CPU, forward only.
Var int8_matmul(Graph<float>& g, Var a, Var b, float scale_a, float scale_b, double alpha, bool trans_b);
// The per-tensor scales of integer self-attention's four quantized operands.
struct Int8AttentionScales {
  float q = 0, k = 0, v = 0, probs = 0;
};
// INT8 self-attention for inference: q, k, v (B, T, H * D) as the projections give them, each head's
// Q K^T and probs V as integer products. The values of int8_matmul(Q, K^T, scales q, k, alpha), softmax
// with the additive mask (B, T) (may be Var{}), then int8_matmul(probs, V, scales probs, v) on the heads
// (B, H, T, D), put back as (B, T, H * D); bit for bit, without the permutes or any (B, H, T, T) tensor
// in memory: each (sequence, head) is one task in cache. CPU, forward only.
Var int8_attention(Graph<float>& g, Var q, Var k, Var v, Var mask, int64_t heads, const Int8AttentionScales& scales,
                   double alpha);
// The same with Q, K and V side by side in one (B, T, 3 x H x D) tensor (the three projections as one
// integer linear), bit for bit.
Var int8_attention_packed(Graph<float>& g, Var qkv, Var mask, int64_t heads, const Int8AttentionScales& scales,
                          double alpha);
// INT8 self-attention on a GPU from the integers of Q, K and V (DType::kS8, (B, T, H x D) each, as
// int8_linear_quantized's integer parts give them at scales.q, .k, .v): each head's Q K^T and probs V as
// int8 tensor-core products with exact int32 sums, the scores and the softmax in FP32. The values of
// int8_attention on the fake-quantized Q, K and V, with the scores and each probability rounded to the
// activations' dtype before use, as the fake-quantized model stores them (in FP32: int8_attention's, up to
// expf and the softmax's summation order), without any (B, H, T, T) tensor in memory. The context (B, T,
// H x D) in the activations' dtype, or with out_scale > 0 its integers (kS8) at that scale, as the next
// layer's input quantizer gives them from the stored context. Forward only; covered head sizes and lengths:
// int8_attention_fits (else the fake-quantized products run).
Var int8_attention_integers(Graph<float>& g, Var q, Var k, Var v, Var mask, int64_t heads,
                            const Int8AttentionScales& scales, double alpha, float out_scale = 0.0f);
// Whether int8_attention_integers runs on g's device for a head size and length: head size 32, 64 or
// 128, length up to 512 (keys and values of a head in shared memory), a GPU of compute capability 8.0 or later.
bool int8_attention_fits(const Graph<float>& g, int64_t head_size, int64_t length);
// The same with dynamic quantization of x: each row at its own scale, its largest magnitude at 127
// (a layer with no calibrated input scale). CPU, forward only.
Var int8_linear_dynamic(Graph<float>& g, Var x, const Int8Weights& weights, std::span<const float> scale_w, Var bias);

// A vocabulary-wide linear layer scored against targets without its (rows, out) output as a node: the mean
// cross-entropy of softmax(x W^T + bias) against targets (as cross_entropy gives it, up to the float summation
// order) and each row's largest column (as row_argmax gives it). x (rows, in), weight (out, in), bias (out) or
// Var{}, a target in [0, out) per row.
// On the CPU: evaluation only (no gradient: NoGradGuard), the product made tile by tile and each tile reduced
// while in cache (kernels/output_tiles.h) instead of stored and read back twice; predictions on the host.
// On a GPU: with gradients (of x, weight and bias), the GEMM's output scored in place, without the copies
// linear makes for an odd output width; the same values as linear then cross_entropy_scores, bit for bit.
struct LinearScores {
  Var loss;                          // scalar
  std::vector<int32_t> predictions;  // (rows), unless left on the device:
  // cross_entropy_scores(..., PredictionsTo::kDevice): (rows) in the graph's memory (its device's), until it
  // is cleared, for a caller that reads them later (core/readback.h); `predictions` is then empty.
  const int32_t* device_predictions = nullptr;
};
// Where an op that scores rows leaves its predictions: read on the host (waiting for the device), or on
// the device for the caller to read later.
enum class PredictionsTo { kHost, kDevice };
LinearScores linear_cross_entropy_scores(Graph<float>& g, Var x, Var weight, Var bias, std::span<const int32_t> targets,
                                         PredictionsTo to = PredictionsTo::kHost);
// The same for int8_linear_dynamic's product (x quantized per row at run time): its values, never stored.
LinearScores int8_linear_dynamic_cross_entropy_scores(Graph<float>& g, Var x, const Int8Weights& weights,
                                                      std::span<const float> scale_w, Var bias,
                                                      std::span<const int32_t> targets);

// Elementwise with NumPy broadcasting (axes aligned from the right, size-1 axes stretch).
template <typename T>
Var add(Graph<T>& g, Var a, Var b);
template <typename T>
Var mul(Graph<T>& g, Var a, Var b);
// alpha * x for a constant alpha.
template <typename T>
Var scale(Graph<T>& g, Var x, double alpha);

// The same elements under a new shape (no copy: the output aliases x's storage).
template <typename T>
Var reshape(Graph<T>& g, Var x, Shape shape);
// Output axis i is input axis perm[i] (copies). E.g. (B, T, H, D) -> (B, H, T, D) is {0, 2, 1, 3}.
template <typename T>
Var permute(Graph<T>& g, Var x, std::initializer_list<int> perm);
template <typename T>
Var transpose(Graph<T>& g, Var x, int axis0, int axis1);

// Rows of a 2-D table picked by ids: table (V, C), ids with shape ids_shape -> ids_shape + (C).
// Embedding lookup, and selecting positions (masked tokens, [CLS]) from a (N, C) activation. Backward
// scatters into the table (repeated ids add up). Ids must lie in [0, V).
template <typename T>
Var gather_rows(Graph<T>& g, Var table, std::span<const int32_t> ids, Shape ids_shape);

// GELU, exact erf form as BERT uses: 0.5 x (1 + erf(x / sqrt(2))).
template <typename T>
Var gelu(Graph<T>& g, Var x);
// Registers y = gelu(x)'s backward (CPU), for an op that computes y itself (gelu, linear_gelu).
template <typename T>
void on_gelu_backward(Graph<T>& g, Var x, Var y);
template <typename T>
Var tanh(Graph<T>& g, Var x);

// Softmax over the last axis of x (B, .., K), after adding mask (B, K) to every row of batch item b.
// `mask` may be Var{} (none); it is a constant (an additive padding mask), never differentiated.
template <typename T>
Var softmax(Graph<T>& g, Var x, Var mask = Var{});
// dropout(softmax(x, mask), p, training, rng): the same values, draws and gradients. On a GPU one kernel
// each way (rows of up to 1024, a multiple of 4), which saves the probabilities once instead of writing
// and reading them between two ops; the backward draws the dropout again (no keep flags kept).
template <typename T>
Var softmax_dropout(Graph<T>& g, Var x, Var mask, double p, bool training, Rng& rng);

// Self-attention's core for the projections q, k, v (B, T, C) split into `heads` heads of D = C / heads
// and an additive padding mask (B, T) (or Var{}): per head matmul(dropout(softmax(alpha q k^T, mask), p),
// v), the heads joined again -> (B, T, C). On the CPU exactly those ops in sequence (reshape, permute to
// (B, H, T, D), scaled_matmul, softmax, dropout, matmul, permute back). On a GPU, where fused_attention()
// says so, one fused kernel each way (ops/attention.cu) that reads and writes the (B, T, C) layout
// (no permutes): the (B, H, T, T) scores and probabilities never reach memory, and the dropout draws are
// the unfused dropout's (the Rng reserves B H T T), so both give the same values up to summation order.
template <typename T>
Var attention(Graph<T>& g, Var q, Var k, Var v, Var mask, int64_t heads, double alpha, double p, bool training,
              Rng& rng);
// Whether attention() runs fused on g: a GPU graph, head size 16, 32, 64 or 128, length up to 512.
bool fused_attention(const Graph<float>& g, int64_t head_size, int64_t length);
// attention() on the three projections of one input: q, k, v = linear(x, weights[i], biases[i]) for x
// (B, T, C), weights (C, C) and biases (C) (F32: parameters), the same values and gradients. On the CPU
// and wherever attention() would not run fused, exactly those ops. Where it runs fused on a GPU, the
// projections go side by side into one (B, T, 3C) tensor that the fused kernels read in place, as one batched
// GEMM (and their weight gradients as another, their bias gradients as one column sum) where the three
// weights, biases and gradients lie equally spaced in memory, as a ParameterArena lays out parameters
// declared alike one after another; x's gradient is one GEMM with the weights stacked: fewer, larger
// products than three linears.
template <typename T>
Var self_attention(Graph<T>& g, Var x, const std::array<Var, 3>& weights, const std::array<Var, 3>& biases, Var mask,
                   int64_t heads, double alpha, double p, bool training, Rng& rng);
// Attention's two products with the heads left where the projections put them: for q, k, v (B, T, C)
// with C = heads D, head_scores = alpha q_h k_h^T per head, (B, H, T, T), and head_context = probs_h v_h
// per head written back as (B, T, C). The values of permuting to (B, H, T, D), scaled_matmul or matmul,
// and permuting back, which the CPU runs; on a GPU batched GEMMs read and write (B, T, C) in place
// (ops/attention_heads.cu), so no permute moves the heads. `transient`: the scores are for the softmax
// made next and nothing else; on a GPU they then live in the graph's transient memory (Graph::emit_transient),
// not kept until the step ends (softmax's backward reads its probabilities, not the scores). The CPU keeps them.
template <typename T>
Var head_scores(Graph<T>& g, Var q, Var k, int64_t heads, double alpha, bool transient = false);
template <typename T>
Var head_context(Graph<T>& g, Var probs, Var v, int64_t heads);
// head_context(g, softmax_dropout(g, scores, mask, p, training, rng), v, heads). On a GPU in training with
// p > 0 the dropped-out probabilities, the products' operand, are not kept until the backward (the softmax
// keeps the probabilities): they live in the graph's transient memory, and the backward forms them again
// from the kept probabilities and the dropout's draws made again before V's gradient reads them. The same
// values and gradients, bit for bit, for one (B, H, T, T) tensor less a layer. The CPU runs the two ops.
template <typename T>
Var softmax_dropout_context(Graph<T>& g, Var scores, Var mask, Var v, int64_t heads, double p, bool training, Rng& rng);

// LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * gamma + beta; gamma, beta (C).
template <typename T>
Var layer_norm(Graph<T>& g, Var x, Var gamma, Var beta, double eps = 1e-12);
// layer_norm(add(a, b)) for a and b of one shape (a residual connection): each row's sum formed as it is
// normalised, not stored unless a gradient needs it (one pass over memory fewer). The same values and
// gradients as the two ops.
template <typename T>
Var add_layer_norm(Graph<T>& g, Var a, Var b, Var gamma, Var beta, double eps = 1e-12);
// add_layer_norm(dropout(a, p, training, rng), b, ...): a sublayer's output, dropped out, added to the
// residual and normalised (BERT's every sublayer). The same values, gradients and dropout draws as the two
// ops; on a GPU one kernel each way: the dropped a is never stored and the backward redraws its mask.
template <typename T>
Var dropout_add_layer_norm(Graph<T>& g, Var a, Var b, Var gamma, Var beta, double eps, double p, bool training,
                           Rng& rng);

// Inverted dropout: zeroes each element with probability p and scales the rest by 1 / (1 - p).
// Identity when !training or p == 0. The mask comes from `rng` and is recomputed, not stored.
template <typename T>
Var dropout(Graph<T>& g, Var x, double p, bool training, Rng& rng);

// Mean cross-entropy of logits (N, C) against integer targets (N): rows whose target equals
// ignore_index are skipped; optional per-row weights (N) give sum_i w_i CE_i / sum_i w_i. With no
// active rows the loss is 0. Returns a scalar.
template <typename T>
Var cross_entropy(Graph<T>& g, Var logits, std::span<const int32_t> targets, std::span<const T> weights = {},
                  int32_t ignore_index = -1);
// cross_entropy (every row active, equal weights) and row_argmax of the same logits: on a GPU from one
// read of each row (the two ops read a vocabulary-wide (N, C) three times), the predictions read on the host
// or left on the device (`to`).
template <typename T>
LinearScores cross_entropy_scores(Graph<T>& g, Var logits, std::span<const int32_t> targets,
                                  PredictionsTo to = PredictionsTo::kHost);

// Knowledge distillation: temperature^2 x the mean over rows of KL(softmax(teacher / temperature) ||
// softmax(student / temperature)), for (N, C) logits. Only the student takes a gradient: the teacher is
// a constant or the output of a no-grad forward. temperature^2 keeps the gradient's size independent of
// the temperature (Hinton et al.).
template <typename T>
Var distillation_loss(Graph<T>& g, Var student, Var teacher, double temperature);

// Mean squared error, mean_i (p_i - t_i)^2, of predictions against targets holding as many values (a
// regression's loss, Hugging Face's MSELoss; distillation of a regression). Only the predictions take a
// gradient: the targets are a constant or the output of a no-grad forward. Returns a scalar.
template <typename T>
Var mean_squared_error(Graph<T>& g, Var predictions, Var targets);

// The index of the largest value in each row of x (.., C) (the first on ties), read on the host. A
// query, not recorded in the graph.
template <typename T>
std::vector<int32_t> row_argmax(const Graph<T>& g, Var x);

// Calibration statistics of |x|, read on the host (queries, not recorded in the graph): the largest
// |x| (infinity when any element is NaN or infinite), and how many elements fall in each of `bins`
// equal bins over [0, range): element -> min(bins - 1, int(|x| * (bins / range))) in double arithmetic.
// On a GPU the counting happens there; only the counts cross to the host.
template <typename T>
double abs_max(Graph<T>& g, Var x);
template <typename T>
std::vector<int64_t> abs_histogram(Graph<T>& g, Var x, double range, int bins);

// Sum and mean of all elements -> scalar.
template <typename T>
Var sum(Graph<T>& g, Var x);
template <typename T>
Var mean(Graph<T>& g, Var x);

}  // namespace bert::ops

namespace bert::ops {

// Fake quantization (symmetric, zero point 0): q(x) = clamp(nearbyint(x / s), qmin, qmax) * s, with
// nearbyint rounding halves to even exactly as ONNX/TensorRT QuantizeLinear does. `scale` is (1)
// per-tensor, or (R) with one scale per row of x viewed as (R, numel / R): per output channel for a
// (out, in) weight. Backward (LSQ, Esser et al. 2020):
//   dx = dy where qmin <= x / s <= qmax, else 0 (straight-through estimator);
//   ds = grad_scale * sum dy * (round(x/s) - x/s inside, qmin below, qmax above).
// Scales must be positive. If `clipped` is given, the number of elements that saturated is ADDED to
// it: a host counter for a CPU graph, a counter in device memory for a GPU graph (so counting never
// waits for the GPU). `integers`: as QuantizeOutput::integers (per tensor).
template <typename T>
Var fake_quantize(Graph<T>& g, Var x, Var scale, int qmin, int qmax, double grad_scale = 1.0,
                  int64_t* clipped = nullptr, bool integers = false);

// A per-tensor fake quantization of an op's output, fused into the op (the arguments of fake_quantize).
struct QuantizeOutput {
  Var scale;  // (1)
  int qmin = -128, qmax = 127;
  double grad_scale = 1.0;
  int64_t* clipped = nullptr;
  // On a GPU, where the range fits int8: also write the integers behind the values (Graph::integers), for a
  // reader that multiplies them (ops::quantized_linear then need not divide them back out). Ops that write
  // none ignore it.
  bool integers = false;
};
// fake_quantize(op(x), q...) for the elementwise ops that most often feed a quantizer. On a GPU each is
// one pass over memory each way: the op's unquantized output is never stored, and backward recomputes
// it from x. On the CPU, the two ops in sequence.
template <typename T>
Var gelu(Graph<T>& g, Var x, const QuantizeOutput& q);
template <typename T>
Var dropout(Graph<T>& g, Var x, double p, bool training, Rng& rng, const QuantizeOutput& q);
// fake_quantize(softmax_dropout(x, mask, p, training, rng), q...): the attention probabilities as the
// products read them. On a GPU one kernel each way (rows as softmax_dropout's): the probabilities saved, the
// dropout's draws and the quantizer's input made again in the backward. On the CPU, the ops in sequence.
template <typename T>
Var softmax_dropout(Graph<T>& g, Var x, Var mask, double p, bool training, Rng& rng, const QuantizeOutput& q);
// attention() with the probabilities' quantizer (QAT): per head matmul(fake_quantize(dropout(softmax(alpha
// q k^T, mask), p), probs...), v), the quantizer per tensor, its scale taking the LSQ gradient. On the CPU
// the ops in sequence (head_scores, softmax_dropout with the quantizer, head_context). On a GPU, where
// fused_quantized_attention() says so, the fused kernels with the quantizer inside: the probabilities are
// exactly normalised before it (a first pass over the keys finds each row's log-sum-exp), and the forward
// also keeps the context of what the quantizer passes (its gradient's straight-through part), from which
// the backward's row sums come. The same values as the ops up to summation order.
template <typename T>
Var attention(Graph<T>& g, Var q, Var k, Var v, Var mask, int64_t heads, double alpha, double p, bool training,
              Rng& rng, const QuantizeOutput& probs);
// Whether that runs fused: where attention() runs on the tensor-core kernels (BF16 steps, and TF32 steps
// where their tiles fit the GPU's shared memory; the FP32 kernels have no quantizer, the ops in sequence run
// there).
bool fused_quantized_attention(const Graph<float>& g, int64_t head_size, int64_t length);
// Attention's products on fake-quantized operands as inference with exact sums makes them, on a GPU
// (forward only): q, k, v (B, T, H x D) fake-quantized at scales.q, .k, .v (per tensor, to [-128, 127]);
// their integers (round(x / scale), exact in the activations' dtype) multiplied by batched GEMMs whose FP32
// sums are exact, each scaled once: the scores (scale_q RN(scale_k alpha)) Q_h K_h^T rounded to the
// activations' dtype, softmax_dropout's softmax with the additive mask and the probabilities' quantizer,
// then the context (scale_probs scale_v) P_h V_h on the probabilities' integers. head_scores, softmax and
// head_context on the fake-quantized values, without the rounding of q * scale to BF16 that moves BF16
// scores by a step; the values of int8_attention_integers (up to the softmax's summation order), by other
// kernels.
Var exact_quantized_attention(Graph<float>& g, Var q, Var k, Var v, Var mask, int64_t heads,
                              const Int8AttentionScales& scales, double alpha, const QuantizeOutput& probs_quantizer);
// add_layer_norm(fake_quantize(dropout(a, p, training, rng), q...), b, ...): a sublayer's output with the
// residual add's input quantizer. On a GPU one kernel each way, as dropout_add_layer_norm's (the backward
// reads a again for the quantizer's mask and scale gradient). On the CPU, the ops in sequence.
template <typename T>
Var dropout_add_layer_norm(Graph<T>& g, Var a, Var b, Var gamma, Var beta, double eps, double p, bool training,
                           Rng& rng, const QuantizeOutput& q);
// fake_quantize_each(dropout_add_layer_norm(a, b, ..., q), outputs): a residual LayerNorm whose output only
// quantizers read (QAT: the next layer's input quantizer and the residual add's), one output each (one or
// two, per tensor); q may be null (the dropped a not quantized). On a GPU, where the row kernels apply, the
// forward is one kernel: the LayerNorm writes its output (which the quantizers' backward reads) and the
// quantized outputs from the row in registers, one pass over memory fewer than the two ops; the backward is
// the two ops' (fake_quantize_each's into the output's gradient, then the LayerNorm's). The same values and
// gradients as the ops in sequence. Elsewhere, and on the CPU, the ops in sequence.
template <typename T>
std::vector<Var> dropout_add_layer_norm_each(Graph<T>& g, Var a, Var b, Var gamma, Var beta, double eps, double p,
                                             bool training, Rng& rng, const QuantizeOutput* q,
                                             std::span<const QuantizeOutput> outputs);
// One output of add_layer_norm_quantized: the LayerNorm's output quantized per tensor at `scale` to
// [-128, 127] (0: the value itself), as int8 with `integers` (DType::kS8), else q * scale.
struct NormOutput {
  float scale = 0.0f;
  bool integers = false;
};
// Inference on a GPU: add_layer_norm(fake_quantize(a, q...), b) (q may be null: a as it is) whose output
// only quantizers read: the output rounded to the activations' dtype (as stored), then quantized by each
// of `outputs` (one or two) in the same kernel: the values fake_quantize_each of the stored output gives,
// or their integers for an integer layer (int8_linear reads them), one node each, the output itself never
// stored. Empty where the row kernels do not apply (rows wider than 1,024 or not a multiple of 4,
// operands not 16-byte aligned): the caller then runs the ops one by one. Forward only (NoGradGuard).
// With `inputs`, an addend may come as the integers of its quantizer (DType::kS8 at a scale > 0: an INT8
// model's residual stream, an integer linear's output and a LayerNorm's integer output), standing for the
// values it fake-quantizes to, q * scale rounded to the activations' dtype: the same output as those values in
// that dtype, with half the bytes of BF16 read. a given as integers takes no q (quantized already). Integer
// addends where the row kernels do not apply: an error (add_layer_norm_reads_integers says where they do).
struct NormInputs {
  float a_scale = 0.0f, b_scale = 0.0f;  // 0: that addend in the activations' dtype
};
std::vector<Var> add_layer_norm_quantized(Graph<float>& g, Var a, Var b, Var gamma, Var beta, double eps,
                                          const QuantizeOutput* q, std::span<const NormOutput> outputs,
                                          const NormInputs& inputs = {});
// Inference on a GPU: BERT's embeddings and their LayerNorm in one kernel, the gathered rows and their sums
// never stored: layer_norm(add(add(gather_rows(words, ids), gather_rows(positions, 0 .. T - 1)),
// gather_rows(types, type_ids))) with ids and type_ids of `ids_shape` ((T) or (B, T)), each gathered row and
// each sum rounded to the activations' dtype as those ops store them, its output made as
// add_layer_norm_quantized's `outputs` (none: the output itself, in the activations' dtype). The same values
// as those ops one by one. Empty where the kernel does not apply (tables not F32, rows not a multiple of 128
// up to 1,024 wide, operands not 16-byte aligned): the caller then runs the ops. Forward only (NoGradGuard).
std::vector<Var> embedding_layer_norm_quantized(Graph<float>& g, Var words, Var positions, Var types,
                                                std::span<const int32_t> ids, std::span<const int32_t> type_ids,
                                                Shape ids_shape, Var gamma, Var beta, double eps,
                                                std::span<const NormOutput> outputs);
// Whether add_layer_norm_quantized takes integer addends for rows of `width` in g (a GPU; widths a multiple
// of 4 up to 1,024; those of BERT's presets compiled for them).
bool add_layer_norm_reads_integers(const Graph<float>& g, int64_t width);
// Several tensors each fake-quantized by its own quantizer (a layer's weights, per output channel): one
// output per tensor, in order, the values and gradients of one fake_quantize each. On a GPU one kernel each
// way for all of them where every tensor is F32 and each channel fits a block (a weight's row up to 4,096:
// each fake_quantize alone is a few microseconds, mostly starting and finishing); else, and on the CPU,
// one fake_quantize each.
struct QuantizeInput {
  Var x;
  QuantizeOutput q;
};
template <typename T>
std::vector<Var> fake_quantize_many(Graph<T>& g, std::span<const QuantizeInput> inputs);
// Self-attention's Q, K and V with their quantizers (QAT): y_i = fake_quantize(linear(x, weights[i],
// biases[i]), quantizers[i]) for x (B, T, C), weights (C, C) (the weights' quantized values) and biases (C),
// each quantizer per tensor; the same values and gradients as those ops. On a GPU the three products run as
// self_attention()'s do (one batched GEMM each way where the weights and their gradients lie equally spaced,
// x's gradient one GEMM with the weights stacked, the bias gradients one column sum) into one (B, T, 3C)
// tensor, which each quantizer reads in place: fewer, larger products than three linears. On the CPU, and
// where C is not a multiple of 8, the ops one by one. With `integers` (x holding its input quantizer's values at
// integers->input, weight i its quantizer's at integers->weights[i], per output channel) the forward products
// sum the integers behind them, as quantized_linear does, as one product of the stacked weights.
struct ProjectionScales {
  Var input;
  std::array<Var, 3> weights;
};
template <typename T>
std::array<Var, 3> quantized_projections(Graph<T>& g, Var x, const std::array<Var, 3>& weights,
                                         const std::array<Var, 3>& biases,
                                         const std::array<QuantizeOutput, 3>& quantizers,
                                         const ProjectionScales* integers = nullptr);
// x fake-quantized by each of several per-tensor quantizers (one output per quantizer, in order): x is
// read once forward and its gradient written once backward however many quantizers read it (the input of
// the Q, K and V projections and of a residual add); on the CPU block by block, bit for bit the values of
// one fake_quantize each (BERT-mini b32 BF16 on two cores: its eight pairs 14.1 -> 13.0 ms a step).
template <typename T>
std::vector<Var> fake_quantize_each(Graph<T>& g, Var x, std::span<const QuantizeOutput> quantizers);

}  // namespace bert::ops
