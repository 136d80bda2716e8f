// BERT as in the original paper and Hugging Face transformers: embeddings, N post-LN encoder layers and
// one head (config.head):
// - pretraining (BertForPreTraining): pooler + NSP head, MLM head (transform + decoder tied to the word
//   embeddings + bias) evaluated only at the masked positions;
// - sequence classification (BertForSequenceClassification): pooler on [CLS], dropout, classifier;
// - token classification (BertForTokenClassification): dropout, classifier on each token.
// Parameters live in one arena under Hugging Face names (bert.encoder.layer.0.attention.self.query.weight,
// classifier.weight, ...); the tied decoder has no parameter of its own. Task classifiers stay in float
// (as in NVIDIA's QDQBERT): only the encoder and pooler are quantizable.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/arena.h"
#include "core/batch.h"
#include "core/graph.h"
#include "core/rng.h"
#include "model/config.h"
#include "model/layers.h"

namespace bert::model {

// What forward() returns. Pretraining fills the mlm_/nsp_ fields, task heads logits/targets/rows.
struct ModelOutputs {
  Var mlm_logits;                    // (M, V) at the M real masked positions, row-major over (b, j)
  Var nsp_logits;                    // (B, 2)
  Var mlm_loss, nsp_loss;            // scalars; nsp_loss needs next_sentence_labels
  std::vector<int32_t> mlm_targets;  // (M)
  std::vector<int32_t> mlm_rows;     // (M) b * T + position, the rows of the sequence output used
  // (M) the top-scoring token at each masked position, with MlmOutputs::kLossAndPredictions (mlm_logits is then
  // null on a GPU and where the CPU evaluates without gradients: the logits were never made).
  std::vector<int32_t> mlm_predictions;
  // The same (M) left on the graph's device with MlmOutputs::kLossAndPredictionsOnDevice or
  // kLogitsAndPredictionsOnDevice (valid until the graph is cleared; mlm_predictions is then empty).
  const int32_t* mlm_device_predictions = nullptr;
  // Task heads. Sequence classification: logits (B, num_labels), targets (B). Token classification:
  // logits (N, num_labels) at the N labeled tokens (every real token when the batch has no labels),
  // rows b * T + position of each, targets (N). Question answering: logits (2 B, T), each sequence's start
  // logits then its end logits over its positions; targets (2 B), the answer's start and end positions;
  // rows b * T. Sequence regression (one label): logits (B, 1), each sequence's score, and `scores` (B), the
  // target scores (targets empty).
  Var logits;
  std::vector<int32_t> targets, rows;
  std::vector<float> scores;
  // The training objective: MLM + NSP, the task's mean cross-entropy, or a regression's mean squared error;
  // null without labels.
  Var loss;
};

// What the MLM head gives: its logits (M, V) (fill-mask, distillation, comparisons with an export), or only what
// evaluation and training score: its loss and each position's top prediction (ModelOutputs::mlm_predictions).
// The latter never makes the (M, V) logits as a node, most of a small model's traffic in the head: on a GPU the
// decoder's GEMM output is scored where it lies, with gradients (ops::linear_cross_entropy_scores); where the
// CPU evaluates without gradients the product is made tile by tile and each tile reduced in cache; a CPU that
// trains reads the predictions off the logits.
// kLossAndPredictionsOnDevice: as kLossAndPredictions, the predictions left on the device for the caller to
// read later (core/readback.h): a training step that reads its metrics after queuing its backward pass.
// kLogitsAndPredictionsOnDevice: the logits too (a training step that distils from them).
enum class MlmOutputs { kLogits, kLossAndPredictions, kLossAndPredictionsOnDevice, kLogitsAndPredictionsOnDevice };

class Bert {
 public:
  explicit Bert(const BertConfig& config);  // parameters declared and allocated (zero)
  Bert(const Bert&) = delete;
  Bert& operator=(const Bert&) = delete;

  const BertConfig& config() const { return config_; }
  ParameterArena<float>& parameters() { return params_; }
  const ParameterArena<float>& parameters() const { return params_; }
  // BERT's initialisation: weights and embeddings normal(0, initializer_range), biases 0,
  // LayerNorm 1 and 0, the padding token's embedding 0.
  void initialize(uint64_t seed);
  // Puts the parameters (and the quantizers' saturation counters) on `device` for training or
  // evaluation there; the host copy stays the one initialize() and checkpoints use (see
  // ParameterArena). The device must outlive the model.
  void place_on(const Device& device);
  // On a GPU in BF16, for inference: the weights rounded to BF16 once (the arena's BF16 copy, from the
  // device's values: ParameterArena::refresh_bf16_copy), which the GEMMs then read instead of rounding each
  // weight at each use. Training's optimizer keeps that copy itself (train::TrainingStep refreshes it before
  // a step where it is stale); anything that changes the values makes it stale (it is then not used).
  // Nothing to do while the copy is current (bert-eval --int8 asks twice: after place_on and in
  // prepare_integer_inference).
  void round_weights_for_inference();
  // On a GPU, adds the saturation counts gathered on the device to each quantizer's `clipped` (one
  // copy for all quantizers); nothing to do on the CPU, where they are counted directly.
  void collect_clip_counts();
  // Weight decay applies to weights and embeddings, not to biases, LayerNorm parameters and
  // quantizer scales.
  bool decays(ParamId id) const;
  // Parameters of this model's head that a checkpoint of another head (or a bare encoder) lacks: they
  // keep their initialisation when such a checkpoint is loaded (fine-tuning from pretraining).
  bool is_head_parameter(const std::string& name) const;
  // Whether parameter `name` is taken from a checkpoint of a model with head `source`: all of them but
  // the classifier of another head (its labels are not this model's).
  bool takes_from(Head source, const std::string& name) const {
    return source == config_.head || !name.starts_with("classifier.");
  }
  // Every quantizer, in forward order: per layer the one input quantizer of Q, K and V, their weight
  // quantizers, the four attention-matmul input quantizers (matmul_q/k/v/a), the attention-output and
  // FFN linears' input and weight quantizers and the four residual-add input quantizers; then the
  // pooler and the MLM transform (those the head has). All start in kFloat.
  std::vector<Quantizer*> quantizers();
  // The name a quantizer of the earlier layout, where Q, K and V each had an input quantizer
  // ("<layer>.attention.self.{query,key,value}.input_quantizer"), now has: their shared one
  // ("<layer>.attention.self.input_quantizer"). Any other name comes back unchanged.
  static std::string current_quantizer_name(const std::string& name);
  // The quantizers in kQuantize mode (the model's INT8 points), in the same order, and their names.
  std::vector<Quantizer*> enabled_quantizers();
  std::vector<std::string> enabled_quantizer_names();
  // The quantizer of that name, or nullptr.
  Quantizer* find_quantizer(std::string_view name);
  // The weight a weight quantizer quantizes: "<layer>.weight" for "<layer>.weight_quantizer".
  ParamId quantized_weight(const Quantizer& weight_quantizer);

  // INT8 inference on the model's device: each linear layer whose input and weight quantizers are enabled
  // gets its weight as int8 (Linear::prepare_integer) and runs integer GEMMs whenever the graph records no
  // gradients (evaluation). With integer_attention (the default) the attention products Q K^T and probs V
  // run as integer products too where their four quantizers are enabled per tensor to [-128, 127]
  // (integer_attention_layers()): on the CPU ops::int8_attention; on a GPU, where Q, K and V are one integer
  // linear (fuse_projections) and the head size is 32, 64 or 128, ops::int8_attention_integers on the
  // integers that linear writes (sequences past its length limit, 512: the fake-quantized products, with
  // one info line); off, they stay fake-quantized in float. Softmax, GELU and LayerNorm stay in float.
  // Returns the number of integer linear layers. Call again after the weights or scales change; clear to go
  // back to the float path.
  // With integer_decoder, the MLM decoder too (it has no quantizers: the fake-quantized model and the
  // export keep it in float): the tied word embeddings quantized per row (symmetric, each row's largest
  // magnitude at 127) and its input per row at run time (dynamic quantization). Faster where the
  // vocabulary is large next to the hidden size; its logits then differ from the fake-quantized model's
  // by that quantization (counted as layers: +1). CPU only (UserError on a GPU).
  // With fuse_projections (the default), a layer whose Q, K and V projections run integer GEMMs (they read x
  // at their one input scale) runs them as one integer linear into Q, K, V side by side
  // (x quantized once; ops::int8_attention_packed), the same values; off, the baseline it is tested against.
  // On a GPU the fused projections also apply the attention products' input quantizers in their epilogue
  // (ops::int8_linear_quantized: Q, K, V fake-quantized, one GEMM, no quantize passes), and the FFN's
  // intermediate layer applies GELU and the output layer's input quantizer there, writing the integers the
  // output layer reads: the same values as the layers one by one.
  int64_t prepare_integer_inference(bool integer_decoder = false, bool fuse_projections = true,
                                    bool integer_attention = true);
  void clear_integer_inference();
  bool integer_decoder() const { return integer_decoder_ != nullptr; }
  // The encoder layers whose attention products run as integers (prepare_integer_inference: those whose
  // Q, K, V and probs quantizers are all enabled).
  int64_t integer_attention_layers() const;
  // The layers among those whose Q, K, V projections run as one integer linear.
  int64_t fused_projection_layers() const;
  // The residual LayerNorms of the last forward that read their addends as integers (on a GPU, after
  // prepare_integer_inference: the sublayer's output and the residual as their quantizers' int8 integers,
  // two a layer where every quantizer around the adds is enabled per tensor).
  int64_t integer_residual_norms() const { return integer_sums_; }
  // The int8 GEMM the integer layers run on a GPU (after prepare_integer_inference there): ours on Hopper's
  // wgmma, or cuBLASLt's (ops::DeviceInt8Gemm); "" where none runs on a GPU.
  std::string device_int8_gemm() const;

  // Whether a quantizer that follows a GELU, a dropout or a permute runs inside that op, and the
  // quantizers reading one activation run as one op (on a GPU fewer passes over memory; the same values). On by
  // default; off runs every quantizer as an op of its own (the baseline the fusion is measured and tested against).
  void set_fused_quantizers(bool on) { fuse_quantizers_ = on; }
  // The fake-quantized linears' exact sums in inference (Linear::exact_sums; on by default), and on a GPU
  // the attention products' (ops::exact_quantized_attention, where their four quantizers are per tensor
  // to [-128, 127]): off, they sum the fake-quantized floats as training does (the baseline the exact sums
  // are tested against).
  void set_exact_sums(bool on);
  // In quantization-aware training on a GPU, the quantized linears' forward products on the integers behind
  // their fake-quantized inputs and weights (Linear::integer_training, ops::quantized_linear: on Hopper the
  // int8 tensor cores, exact sums; on by default); off, float GEMMs on the fake-quantized values.
  void set_integer_training(bool on);
  // On a GPU, self-attention as one fused op each way (ops::attention) where its kernels cover the head
  // size and length: the (B, H, T, T) scores and probabilities never reach memory. In QAT the probabilities'
  // quantizer runs inside the tensor-core kernels (BF16, TF32; Q, K and V are fake-quantized before them)
  // unless with_quantizer is false; calibrating the attention matmuls' quantizers, or their QAT in FP32,
  // runs the unfused ops. Off unless set; where it cannot run fused the log says why, once.
  void set_fused_attention(bool on, bool with_quantizer = true) {
    fuse_attention_ = on;
    fuse_quantized_attention_ = with_quantizer;
  }
  // Where the attention runs unfused in a step with F32 activations (FP32, TF32, the CPU): its (B, H, T, T)
  // scores and probabilities computed again in the backward instead of kept until the step ends
  // (ops::recompute), for one more pass of the attention's forward. Off unless set (bert-train --attention
  // recompute).
  void set_recompute_attention(bool on) { recompute_attention_ = on; }
  // On a GPU, in a training forward: once the forward is past an encoder layer, that layer's parameter
  // gradients hold the activations of the layers above it until the backward reaches the layer (Graph::lend),
  // so the step's memory peak does not hold both; the backward starts them from zero. The same values bit
  // for bit. Only for a step whose gradients are zeroed (zero_gradients) before its one forward pass: not
  // with micro-batches accumulating into the gradients (TrainingStep sets it). Off unless set.
  void set_lend_gradients(bool on) { lend_gradients_ = on; }
  // Zeroes the parameters' gradients where training runs, before a step's forward pass. With lending on a
  // GPU (set_lend_gradients) the encoder layers' gradients are left out: every forward then zeroes them
  // itself (a training forward lends them and its backward fills them with zeros; any other forward fills
  // them), one pass over them instead of two.
  void zero_gradients();
  // Whether the fused kernels are the faster choice in a precision (bert-train --attention auto): in BF16
  // and TF32 (tensor cores, the tiles in registers); in FP32 the unfused ops' cuBLAS products are faster.
  // With the probabilities' quantizer (QAT) in BF16 only: TF32's QAT step runs faster unfused (its fused
  // forward makes the scores twice, to normalise the probabilities before the quantizer).
  static bool fused_attention_is_faster(Precision p) { return p == Precision::kBf16 || p == Precision::kTf32; }
  static bool fused_quantized_attention_is_faster(Precision p) { return p == Precision::kBf16; }
  // Whether QAT's integer forward products (set_integer_training) are the faster choice for a model of this
  // hidden size (bert-train --qat-products auto): in FP32 and TF32, and in BF16 from BERT-base's 768 (its QAT
  // step 2-3% faster on an H100 and an H200; BERT-large b32 level; BERT-mini's 256, 1% slower: its products
  // are too small to gain).
  static bool integer_training_is_faster(Precision p, int64_t hidden_size) {
    return p != Precision::kBf16 || hidden_size >= 768;
  }

  // Final hidden states (B, T, C).
  Var encode(Graph<float>& g, const BatchView& batch, bool training, Rng& dropout_rng);
  // Encoder and head, and the losses when the batch carries their labels.
  ModelOutputs forward(Graph<float>& g, const BatchView& batch, bool training, Rng& dropout_rng,
                       MlmOutputs mlm = MlmOutputs::kLogits);

 private:
  struct Layer {
    Linear query, key, value, attention_output;
    LayerNorm attention_norm;
    Linear intermediate, output;
    LayerNorm output_norm;
    // The one input quantizer of Q, K and V (attention.self.input_quantizer): they read the same tensor,
    // and TensorRT fuses the three GEMMs only when that tensor has one scale.
    Quantizer self_input;
    // Inputs of Q K^T and of probs V (QDQBERT's names), and both inputs of each residual add.
    Quantizer matmul_q, matmul_k, matmul_v, matmul_a;
    Quantizer attention_add_input, attention_add_residual, output_add_input, output_add_residual;
    // Self-attention as integer products in inference (ops::int8_attention on the CPU,
    // ops::int8_attention_integers on a GPU): set by prepare_integer_inference where the four matmul
    // quantizers are enabled (per tensor, [-128, 127]) and, on a GPU, the projections are one integer linear.
    bool integer_attention = false;
    // Q, K, V as one integer linear (3C, C), where integer attention runs and the three input scales are
    // one: weights, per-channel scales and biases side by side (prepare_integer_inference).
    std::shared_ptr<const Int8Weights> integer_projections;
    std::vector<float> projection_scales, projection_bias;
    // The same on a GPU (where the attention products stay in float): Q, K, V as one integer linear.
    std::shared_ptr<const ops::DeviceInt8Weights> device_projections;
    // On a GPU, the FFN's GELU epilogue table at the output layer's input scale (ops::DeviceGeluTable).
    std::shared_ptr<const ops::DeviceGeluTable> gelu_table;
    ParamId first_param = 0, end_param = 0;  // the layer's parameters, [first, end) in the arena
  };
  // Q, K and V of x by the GPU's fused integer projections with the attention products' input quantizers
  // applied in its epilogue, where they run in g (else empty: the projections one by one).
  std::vector<Var> integer_projections_on_gpu(Graph<float>& g, Layer& layer, Var x);
  // Q, K and V of x (already through the projections' input quantizer) with the attention products' input
  // quantizers, by ops::quantized_projections (on a GPU one GEMM each way for the three), where the
  // weights are fake-quantized in g (`weights`, Linear::quantize_weights) and those quantizers quantize per
  // tensor (QAT); else empty: the projections one by one.
  std::vector<Var> quantized_projections_on_gpu(Graph<float>& g, Layer& layer, Var x, std::span<const Var> weights);
  // The per-tensor scales of the attention products' four quantizers (integer or exact products).
  ops::Int8AttentionScales attention_scales(const Layer& layer);
  // The context of integer attention on a GPU (ops::int8_attention_integers on the integers the fused
  // projections write), as the output layer reads it; Var{} where it does not run (the float path then).
  Var integer_attention_on_gpu(Graph<float>& g, Layer& layer, Var x, Var mask, int64_t t, bool training);
  // The FFN's activation as the integers of the output layer's input quantizer, made by the intermediate
  // layer's GEMM with GELU and that quantizer in its epilogue, where both layers run integer GEMMs on a GPU
  // (else Var{}).
  Var integer_activation_on_gpu(Graph<float>& g, Layer& layer, Var x);
  // x through each quantizer (nullptr: none), one output each: those that fake-quantize in one op
  // (ops::fake_quantize_each) when fusion is on.
  std::vector<Var> quantize_each(Graph<float>& g, Var x, std::initializer_list<Quantizer*> quantizers);
  // BERT's embeddings through their LayerNorm and dropout. In inference on a GPU one kernel
  // (ops::embedding_layer_norm_quantized); where the first layer's readers run there as in
  // residual_norm_quantized, its output as they read it goes to `read` (the first layer's x_read) and the
  // returned Var is invalid.
  Var embed(Graph<float>& g, const BatchView& batch, bool training, Rng& rng, std::vector<Var>& read);
  // The linear layers that carry quantizers, in forward order.
  std::vector<Linear*> quantizable_linears();
  // The attention block of x, through its residual add and LayerNorm. x_read: x as the block's two
  // quantizers read it (the projections' input, the residual), where the previous LayerNorm made them
  // (x then unused; else empty). Where its LayerNorm can make the FFN's inputs as their quantizers read
  // them (residual_norm_quantized), those go to ffn_inputs and the returned Var is invalid.
  // weights: the layer's six weights fake-quantized ahead (Q, K, V, attention output, intermediate, output:
  // Linear::quantize_weights), or empty.
  // next: the layer after it (nullptr: the last).
  Var attention(Graph<float>& g, Layer& layer, Layer* next, Var x, Var mask, int64_t t, bool training, Rng& rng,
                std::span<const Var> x_read, std::vector<Var>& ffn_inputs, std::span<const Var> weights);
  // norm(add_input(dropout(sublayer)) + residual): a sublayer's residual connection, in one op where the
  // add's input quantizer is off or fake-quantizes with fusion on.
  Var residual_norm(Graph<float>& g, const LayerNorm& norm, Quantizer& add_input, Var sublayer, Var residual,
                    bool training, Rng& rng);
  // A reader of a LayerNorm's output: its quantizer (nullptr: none) and whether an integer layer reads the
  // integers themselves.
  struct Reader {
    Quantizer* quantizer = nullptr;
    bool integers = false;
  };
  // The readers of the attention block's input (Q, K and V's input quantizer, the residual's) and of the
  // FFN's (the intermediate layer's, the residual's) in g.
  std::array<Reader, 2> attention_readers(const Graph<float>& g, Layer& layer);
  std::array<Reader, 2> ffn_readers(const Graph<float>& g, Layer& layer);
  // The outputs of a LayerNorm that `readers` read (ops::NormOutput, both readers' integers at one scale: one),
  // and whether that one stands for both; false where a reader's quantizer cannot run in its kernel.
  bool norm_outputs(std::span<const Reader> readers, std::vector<ops::NormOutput>& outputs, bool& shared);
  // residual_norm's output as each reader reads it (quantize_each of it, or the integers), made in the
  // LayerNorm's kernel without the output itself (ops::add_layer_norm_quantized), in GPU integer
  // inference where every reader's quantizer can run there; else empty. An int8 sublayer or residual (the
  // integers of add_input or of residual_quantizer, integer_sum chose them) is read as such; readers
  // empty (the last layer's, integer_sum): the output itself, one Var. Both readers' integers at one
  // scale: one tensor, given twice.
  std::vector<Var> residual_norm_quantized(Graph<float>& g, const LayerNorm& norm, Quantizer& add_input, Var sublayer,
                                           Var residual, const Quantizer& residual_quantizer, bool training,
                                           std::span<const Reader> readers);
  // residual_norm's output as each reader's quantizer fake-quantizes it (those of `readers`, in order), made
  // by the LayerNorm's forward kernel (ops::dropout_add_layer_norm_each), on a GPU with fusion on where every
  // reader fake-quantizes per tensor (QAT) and the add's input quantizer is off or fake-quantizes; else empty.
  std::vector<Var> residual_norm_each(Graph<float>& g, const LayerNorm& norm, Quantizer& add_input, Var sublayer,
                                      Var residual, bool training, Rng& rng, std::span<const Reader> readers);
  // Whether a residual LayerNorm reads its addends as integers (GPU integer inference): the sublayer's output
  // as its add-input quantizer's integers, made in the sublayer's GEMM (sublayer_integers), and the
  // residual as its quantizer's, made by the LayerNorm before (its second reader's integers): an INT8
  // residual stream, half the bytes of BF16, the same values. Where the sublayer runs an integer GEMM, both
  // add quantizers and every reader's quantize per tensor to [-128, 127], and the rows fit
  // (ops::add_layer_norm_reads_integers). The attention block's LayerNorm, or with `output` the FFN's, whose
  // readers are `next`'s attention block (nullptr after the last layer: the model's output).
  bool integer_sum(const Graph<float>& g, Layer& layer, bool output, Layer* next, bool training);
  // A sublayer's output as the integers of the add's input quantizer (its GEMM's epilogue quantizes it).
  Var sublayer_integers(Graph<float>& g, Linear& sublayer, Var x, const Quantizer& add_input);
  void pretraining_head(Graph<float>& g, Var hidden, const BatchView& batch, MlmOutputs mlm, ModelOutputs& out);
  void classification_head(Graph<float>& g, Var hidden, const BatchView& batch, bool training, Rng& rng,
                           ModelOutputs& out);
  void question_answering_head(Graph<float>& g, Var hidden, const BatchView& batch, ModelOutputs& out);

  BertConfig config_;
  ParameterArena<float> params_;
  ParamId word_embeddings_ = -1, position_embeddings_ = -1, token_type_embeddings_ = -1;
  LayerNorm embedding_norm_;
  std::vector<Layer> layers_;
  // Heads: each declared only when config.head uses it (the others keep name "" and id -1).
  Linear pooler_;  // pretraining and sequence classification
  Linear transform_;
  LayerNorm transform_norm_;
  ParamId decoder_bias_ = -1;  // cls.predictions.bias; the decoder weight is the word embeddings
  Linear seq_relationship_;
  Linear classifier_;           // task heads (question answering: qa_outputs)
  DeviceBuffer clip_counters_;  // one int64 per quantizer, on the GPU
  // The MLM decoder as int8 (prepare_integer_inference(true)), with each vocabulary row's scale; null: float.
  std::shared_ptr<const Int8Weights> integer_decoder_;
  std::vector<float> integer_decoder_scales_;
  bool fuse_quantizers_ = true;
  bool fuse_attention_ = false;
  bool fuse_quantized_attention_ = true;  // with fuse_attention_: the probabilities' quantizer inside the kernels
  bool recompute_attention_ = false;
  bool lend_gradients_ = false;
  bool told_unfused_attention_ = false;  // the log line saying why attention runs unfused, once
  bool exact_sums_ = true;               // set_exact_sums
  bool told_float_attention_ = false;    // the log line saying why integer attention runs in float, once
  int64_t integer_sums_ = 0;             // integer_residual_norms() (counted by residual_norm_quantized)
};

}  // namespace bert::model
