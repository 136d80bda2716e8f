#include "model/bert.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <utility>

#include "ops/ops.h"
#include "sys/error.h"

namespace bert::model {

Bert::Bert(const BertConfig& config) : config_(config) {
  config_.validate();
  const int64_t c = config_.hidden_size;
  const double eps = config_.layer_norm_eps;
  const WeightScales w = config_.weight_scales;
  word_embeddings_ = params_.add("bert.embeddings.word_embeddings.weight", {config_.vocab_size, c});
  position_embeddings_ =
      params_.add("bert.embeddings.position_embeddings.weight", {config_.max_position_embeddings, c});
  token_type_embeddings_ = params_.add("bert.embeddings.token_type_embeddings.weight", {config_.type_vocab_size, c});
  embedding_norm_ = LayerNorm::declare(params_, "bert.embeddings.LayerNorm", c, eps);
  layers_.reserve(static_cast<size_t>(config_.num_hidden_layers));
  for (int64_t i = 0; i < config_.num_hidden_layers; ++i) {
    const std::string p = "bert.encoder.layer." + std::to_string(i) + ".";
    Layer l;
    l.first_param = params_.size();
    l.self_input = Quantizer::activation(params_, p + "attention.self.input_quantizer");
    const std::array<Linear, 3> qkv = Linear::declare_side_by_side(
        params_, {p + "attention.self.query", p + "attention.self.key", p + "attention.self.value"}, c, c, w);
    l.query = qkv[0], l.key = qkv[1], l.value = qkv[2];
    l.attention_output = Linear::declare(params_, p + "attention.output.dense", c, c, true, w);
    l.attention_norm = LayerNorm::declare(params_, p + "attention.output.LayerNorm", c, eps);
    l.intermediate = Linear::declare(params_, p + "intermediate.dense", c, config_.intermediate_size, true, w);
    l.output = Linear::declare(params_, p + "output.dense", config_.intermediate_size, c, true, w);
    l.output_norm = LayerNorm::declare(params_, p + "output.LayerNorm", c, eps);
    l.matmul_q = Quantizer::activation(params_, p + "attention.self.matmul_q_input_quantizer");
    l.matmul_k = Quantizer::activation(params_, p + "attention.self.matmul_k_input_quantizer");
    l.matmul_v = Quantizer::activation(params_, p + "attention.self.matmul_v_input_quantizer");
    l.matmul_a = Quantizer::activation(params_, p + "attention.self.matmul_a_input_quantizer");
    l.matmul_a.bound = 1.0;  // the attention probabilities (dropout is off whenever a calibrator observes)
    l.attention_add_input = Quantizer::activation(params_, p + "attention.output.add_input_quantizer");
    l.attention_add_residual = Quantizer::activation(params_, p + "attention.output.add_residual_quantizer");
    l.output_add_input = Quantizer::activation(params_, p + "output.add_input_quantizer");
    l.output_add_residual = Quantizer::activation(params_, p + "output.add_residual_quantizer");
    l.end_param = params_.size();
    layers_.push_back(std::move(l));
  }
  for (Layer& l : layers_)  // layers_ is reserved and Bert immovable: the pointers stay valid
    for (Linear* projection : {&l.query, &l.key, &l.value}) projection->shared_input = &l.self_input;
  if (config_.head == Head::kPretraining || config_.head == Head::kSequenceClassification)
    pooler_ = Linear::declare(params_, "bert.pooler.dense", c, c, true, w);
  if (config_.head == Head::kPretraining) {
    transform_ = Linear::declare(params_, "cls.predictions.transform.dense", c, c, true, w);
    transform_norm_ = LayerNorm::declare(params_, "cls.predictions.transform.LayerNorm", c, eps);
    decoder_bias_ = params_.add("cls.predictions.bias", {config_.vocab_size});
    seq_relationship_ = Linear::declare(params_, "cls.seq_relationship", c, 2, /*quantizable=*/false);
  } else {
    const char* name = config_.head == Head::kQuestionAnswering ? "qa_outputs" : "classifier";
    classifier_ = Linear::declare(params_, name, c, config_.num_labels(), /*quantizable=*/false);
  }
  params_.allocate();
  set_integer_training(true);
}

void Bert::place_on(const Device& device) {
  params_.place_on(device);
  std::vector<Quantizer*> all = quantizers();
  clip_counters_ = DeviceBuffer();
  for (Quantizer* q : all) q->device_clipped = nullptr;
  if (!device.is_cuda()) return;
  clip_counters_ = DeviceBuffer(device, all.size() * sizeof(int64_t));
  device.fill_zero(clip_counters_.data(), clip_counters_.bytes());
  for (size_t i = 0; i < all.size(); ++i) all[i]->device_clipped = clip_counters_.as<int64_t>() + i;
}

void Bert::round_weights_for_inference() { params_.refresh_bf16_copy(); }

void Bert::collect_clip_counts() {
  if (!params_.on_cuda()) return;
  std::vector<Quantizer*> all = quantizers();
  std::vector<int64_t> counts(all.size());
  params_.device().copy_to_host(counts.data(), clip_counters_.data(), clip_counters_.bytes());
  params_.device().fill_zero(clip_counters_.data(), clip_counters_.bytes());
  for (size_t i = 0; i < all.size(); ++i) all[i]->clipped += counts[i];
}

void Bert::initialize(uint64_t seed) {
  Rng rng(seed);
  for (ParamId id = 0; id < params_.size(); ++id) {
    Parameter<float> p = params_.get(id);
    const std::string& name = *p.name;
    if (is_quantizer_scale(name)) {
      p.value.fill(1.0f);  // placeholder until calibrated
    } else if (name.ends_with("LayerNorm.weight")) {
      p.value.fill(1.0f);
    } else if (name.ends_with(".bias")) {
      p.value.fill(0.0f);
    } else {
      for (float& v : p.value) v = static_cast<float>(config_.initializer_range * rng.next_normal());
    }
  }
  Parameter<float> words = params_.get(word_embeddings_);
  std::fill_n(words.value.data() + config_.pad_token_id * config_.hidden_size, config_.hidden_size, 0.0f);
}

bool Bert::is_head_parameter(const std::string& name) const {
  const bool pooler = name.starts_with("bert.pooler.");  // absent from bare encoders and token classifiers
  if (config_.head == Head::kPretraining) return name.starts_with("cls.") || pooler;
  if (config_.head == Head::kQuestionAnswering) return name.starts_with("qa_outputs.");
  return name.starts_with("classifier.") || (pooler && config_.head == Head::kSequenceClassification);
}

bool Bert::decays(ParamId id) const {
  const std::string& name = params_.name(id);
  return !name.ends_with(".bias") && name.find("LayerNorm") == std::string::npos && !is_quantizer_scale(name);
}

std::vector<Quantizer*> Bert::quantizers() {
  std::vector<Quantizer*> all;
  auto linear = [&all](Linear& l) {
    if (!l.quantizable) return;
    if (!l.shared_input) all.push_back(&l.input_quantizer);
    all.push_back(&l.weight_quantizer);
  };
  for (Layer& l : layers_) {
    all.push_back(&l.self_input);
    linear(l.query);
    linear(l.key);
    linear(l.value);
    for (Quantizer* q : {&l.matmul_q, &l.matmul_k, &l.matmul_v, &l.matmul_a}) all.push_back(q);
    linear(l.attention_output);
    all.push_back(&l.attention_add_input);
    all.push_back(&l.attention_add_residual);
    linear(l.intermediate);
    linear(l.output);
    all.push_back(&l.output_add_input);
    all.push_back(&l.output_add_residual);
  }
  if (!pooler_.name.empty()) linear(pooler_);
  if (!transform_.name.empty()) linear(transform_);
  return all;
}

std::string Bert::current_quantizer_name(const std::string& name) {
  for (const char* projection : {".attention.self.query.", ".attention.self.key.", ".attention.self.value."}) {
    const std::string old_suffix = std::string(projection) + "input_quantizer";
    if (name.starts_with("bert.encoder.layer.") && name.ends_with(old_suffix))
      return name.substr(0, name.size() - old_suffix.size()) + ".attention.self.input_quantizer";
  }
  return name;
}

std::vector<Linear*> Bert::quantizable_linears() {
  std::vector<Linear*> all;
  for (Layer& l : layers_)
    for (Linear* linear : {&l.query, &l.key, &l.value, &l.attention_output, &l.intermediate, &l.output})
      all.push_back(linear);
  for (Linear* head : {&pooler_, &transform_})
    if (!head->name.empty() && head->quantizable) all.push_back(head);
  return all;
}

namespace {
// Whether every quantizer quantizes per tensor to [-128, 127] (the integer attention products' condition).
bool per_tensor_int8(std::span<const Quantizer* const> quantizers, const ParameterArena<float>& params) {
  return std::all_of(quantizers.begin(), quantizers.end(), [&](const Quantizer* q) {
    return q->mode == QuantMode::kQuantize && q->qmin == -128 && q->qmax == 127 && params.shape(q->scale).numel() == 1;
  });
}
// The scale a quantizer applies in an integer linear's epilogue (ops::Int8OutputPart): its per-tensor scale
// when it quantizes to [-128, 127], 0 when it is off; false where it cannot run there (calibrating, other
// ranges or scales).
bool epilogue_scale(ParameterArena<float>& params, const Quantizer& q, float& scale) {
  scale = 0.0f;
  if (q.mode == QuantMode::kFloat) return true;
  if (q.mode != QuantMode::kQuantize || q.qmin != -128 || q.qmax != 127 || params.shape(q.scale).numel() != 1)
    return false;
  scale = params.get(q.scale).value.data()[0];
  return scale > 0 && std::isnormal(1.0f / scale);
}
}  // namespace

int64_t Bert::prepare_integer_inference(bool integer_decoder, bool fuse_projections, bool integer_attention) {
  if (integer_decoder && params_.on_cuda())
    throw UserError(
        "an integer MLM decoder runs on the CPU only: on a GPU the decoder stays in the activations' precision "
        "(leave out --int8-decoder)");
  round_weights_for_inference();  // what stays in float (the MLM decoder) reads BF16 weights made once
  int64_t prepared = 0;
  for (Linear* l : quantizable_linears()) prepared += l->prepare_integer(params_);
  for (Layer& l : layers_) {
    const std::array<const Quantizer*, 4> products = {&l.matmul_q, &l.matmul_k, &l.matmul_v, &l.matmul_a};
    l.integer_attention = integer_attention && per_tensor_int8(products, params_);
    const int64_t head_size = config_.head_size();
    if (params_.on_cuda() && head_size != 32 && head_size != 64 && head_size != 128) l.integer_attention = false;
    l.integer_projections.reset();
    l.device_projections.reset();
    l.projection_scales.clear();
    l.projection_bias.clear();
    const bool gpu = params_.on_cuda();
    // The GELU epilogue's table for the output layer's input quantizer (integer_activation_on_gpu), made once.
    l.gelu_table.reset();
    if (float scale = 0.0f; gpu && l.intermediate.device_integer_weights && l.output.device_integer_weights &&
                            epilogue_scale(params_, l.output.input(), scale) && scale > 0)
      l.gelu_table = std::make_shared<const ops::DeviceGeluTable>(params_.device(), scale);
    // Q, K and V read x through their one input quantizer, so they fuse into one integer linear: on a GPU in
    // every layer whose three have device weights, on the CPU in every layer whose three run integer GEMMs
    // and whose attention products run as integers.
    const std::array<Linear*, 3> projections = {&l.query, &l.key, &l.value};
    const bool fuse = fuse_projections && (gpu || l.integer_attention) &&
                      std::all_of(projections.begin(), projections.end(), [gpu](const Linear* p) {
                        return gpu ? p->device_integer_weights != nullptr : p->integer_weights != nullptr;
                      });
    if (!fuse) {
      if (gpu) l.integer_attention = false;  // (its kernel reads the fused projections' integers)
      continue;
    }
    const int64_t c = l.query.in;
    std::vector<int8_t> weights;
    std::vector<float> scales, bias;
    for (Linear* p : projections) {
      const std::vector<int8_t> q = p->quantized_weight(params_);
      weights.insert(weights.end(), q.begin(), q.end());
      const std::vector<float> s = p->weight_scales(params_);
      scales.insert(scales.end(), s.begin(), s.end());
      const TensorView<float> b = params_.get(p->bias).value;
      bias.insert(bias.end(), b.begin(), b.end());
    }
    if (gpu) {
      l.device_projections =
          std::make_shared<const ops::DeviceInt8Weights>(params_.device(), weights.data(), scales, bias, 3 * c, c);
    } else {
      l.integer_projections = std::make_shared<const Int8Weights>(weights.data(), 3 * c, c);
      l.projection_scales = std::move(scales);
      l.projection_bias = std::move(bias);
    }
  }
  integer_decoder_.reset();
  integer_decoder_scales_.clear();
  if (integer_decoder) {
    if (config_.head != Head::kPretraining)
      throw UserError("an integer MLM decoder needs a pretraining model (masked-word head); this one is a task model");
    const int64_t rows = config_.vocab_size, cols = config_.hidden_size;
    const float* w = params_.get(word_embeddings_).value.data();
    std::vector<int8_t> q(rows * cols);
    integer_decoder_scales_.resize(rows);
    for (int64_t r = 0; r < rows; ++r) {
      float largest = 0.0f;
      for (int64_t i = 0; i < cols; ++i) largest = std::max(largest, std::abs(w[r * cols + i]));
      const float scale = largest > 0.0f ? largest / 127.0f : 1.0f;
      integer_decoder_scales_[r] = scale;
      for (int64_t i = 0; i < cols; ++i)
        q[r * cols + i] = static_cast<int8_t>(std::clamp(std::nearbyint(w[r * cols + i] / scale), -127.0f, 127.0f));
    }
    integer_decoder_ = std::make_shared<const Int8Weights>(q.data(), rows, cols);
    ++prepared;
  }
  return prepared;
}

void Bert::set_exact_sums(bool on) {
  exact_sums_ = on;
  for (Linear* l : quantizable_linears()) l->exact_sums = on;
}

void Bert::set_integer_training(bool on) {
  for (Linear* l : quantizable_linears()) l->integer_training = on;
  // The encoder's linears' input quantizers write the integers they multiply.
  for (Layer& l : layers_)
    for (Quantizer* q : {&l.self_input, &l.attention_output.input_quantizer, &l.intermediate.input_quantizer,
                         &l.output.input_quantizer})
      q->integers_read = on;
}

int64_t Bert::integer_attention_layers() const {
  return std::count_if(layers_.begin(), layers_.end(), [](const Layer& l) { return l.integer_attention; });
}

std::string Bert::device_int8_gemm() const {
  for (const Layer& l : layers_)
    for (const Linear* p : {&l.query, &l.key, &l.value, &l.attention_output, &l.intermediate, &l.output})
      if (p->device_integer_weights)
        return p->device_integer_weights->tensor_map() ? "wgmma int8 GEMM with the dequantization in its epilogue"
                                                       : "cuBLASLt int8 tensor-core GEMM";
  return "";
}

int64_t Bert::fused_projection_layers() const {
  return std::count_if(layers_.begin(), layers_.end(), [](const Layer& l) {
    return l.integer_projections != nullptr || l.device_projections != nullptr;
  });
}

void Bert::clear_integer_inference() {
  for (Linear* l : quantizable_linears()) l->clear_integer();
  for (Layer& l : layers_) {
    l.integer_attention = false;
    l.integer_projections.reset();
    l.device_projections.reset();
    l.gelu_table.reset();
  }
  integer_decoder_.reset();
  integer_decoder_scales_.clear();
}

std::vector<Quantizer*> Bert::enabled_quantizers() {
  std::vector<Quantizer*> enabled;
  for (Quantizer* q : quantizers())
    if (q->mode == QuantMode::kQuantize) enabled.push_back(q);
  return enabled;
}

std::vector<std::string> Bert::enabled_quantizer_names() {
  std::vector<std::string> names;
  for (Quantizer* q : enabled_quantizers()) names.push_back(q->name);
  return names;
}

Quantizer* Bert::find_quantizer(std::string_view name) {
  for (Quantizer* q : quantizers())
    if (q->name == name) return q;
  return nullptr;
}

ParamId Bert::quantized_weight(const Quantizer& q) {
  const std::string suffix = "_quantizer";
  BERT_CHECK(q.is_weight && q.name.ends_with(suffix), "'" + q.name + "' is not a weight quantizer");
  return params_.id(q.name.substr(0, q.name.size() - suffix.size()));
}

namespace {
// op(q), the op that makes a quantizer's input, with the quantizer fused into it when `fuse` is on and it
// fake-quantizes (q then points to it; see Quantizer::apply_fused); `quantizer` may be nullptr (none).
template <typename Op>
Var quantized(Graph<float>& g, ParameterArena<float>& params, Quantizer* quantizer, const Shape& shape, bool fuse,
              Op op) {
  return quantizer ? quantizer->apply_fused(g, params, shape, fuse, op) : op(nullptr);
}
}  // namespace

std::vector<Var> Bert::quantize_each(Graph<float>& g, Var x, std::initializer_list<Quantizer*> quantizers) {
  std::vector<Var> out;
  std::vector<ops::QuantizeOutput> fused;
  std::vector<size_t> fused_at;  // where each fused output goes in `out`
  for (Quantizer* q : quantizers) {
    if (q && fuse_quantizers_ && q->mode == QuantMode::kQuantize) {
      fused.push_back(q->fused_output(g, params_, g.shape(x)));
      fused_at.push_back(out.size());
      out.push_back(Var{});
    } else {
      out.push_back(q ? q->apply(g, params_, x) : x);
    }
  }
  const std::vector<Var> quantized = ops::fake_quantize_each(g, x, std::span<const ops::QuantizeOutput>(fused));
  for (size_t i = 0; i < fused.size(); ++i) out[fused_at[i]] = quantized[i];
  return out;
}

ops::Int8AttentionScales Bert::attention_scales(const Layer& l) {
  auto scale_of = [&](const Quantizer& quantizer) { return params_.get(quantizer.scale).value.data()[0]; };
  return {scale_of(l.matmul_q), scale_of(l.matmul_k), scale_of(l.matmul_v), scale_of(l.matmul_a)};
}

Var Bert::attention(Graph<float>& g, Layer& l, Layer* next, Var x, Var mask, int64_t t, bool training, Rng& rng,
                    std::span<const Var> x_read, std::vector<Var>& ffn_inputs, std::span<const Var> weights) {
  const int64_t h = config_.num_attention_heads, d = config_.head_size();
  auto weight = [&](size_t i) { return i < weights.size() ? weights[i] : Var{}; };
  const bool fuse = fuse_quantizers_;
  // x as each quantizer that reads it sees it: the Q, K, V projections' one input quantizer (unless all
  // three run integer GEMMs, which quantize x themselves; one that does not needs it) and the residual.
  const bool projections_quantize =
      l.query.used_input_quantizer(g) || l.key.used_input_quantizer(g) || l.value.used_input_quantizer(g);
  const std::vector<Var> inputs =
      !x_read.empty()
          ? std::vector<Var>(x_read.begin(), x_read.end())
          : quantize_each(g, x, {projections_quantize ? &l.self_input : nullptr, &l.attention_add_residual});
  // The context (B, T, C), through the output projection, the residual add and LayerNorm.
  auto finish = [&](Var context) {
    const Var out = integer_sum(g, l, /*output=*/false, nullptr, training)
                        ? sublayer_integers(g, l.attention_output, context, l.attention_add_input)
                        : l.attention_output.forward_quantized_input(g, params_, context, weight(3));
    std::array<Reader, 2> readers = ffn_readers(g, l);
    readers[1].integers = integer_sum(g, l, /*output=*/true, next, training);  // the FFN's LayerNorm reads it
    ffn_inputs = residual_norm_quantized(g, l.attention_norm, l.attention_add_input, out, inputs[1],
                                         l.attention_add_residual, training, readers);
    if (ffn_inputs.empty())
      ffn_inputs = residual_norm_each(g, l.attention_norm, l.attention_add_input, out, inputs[1], training, rng,
                                      readers);
    return ffn_inputs.empty() ? residual_norm(g, l.attention_norm, l.attention_add_input, out, inputs[1], training, rng)
                              : Var{};
  };
  // Integer attention (inference) quantizes its operands itself (to the same integers the quantizers give).
  if (l.integer_attention && !g.on_cuda() && !g.grad_enabled() && !training) {
    const ops::Int8AttentionScales scales = attention_scales(l);
    const double alpha = 1.0 / std::sqrt(static_cast<double>(d));
    Var context;
    if (l.integer_projections && l.query.runs_integer(g) && l.key.runs_integer(g) && l.value.runs_integer(g)) {
      // x quantized once for the three projections (their one input scale).
      Var qkv =
          ops::int8_linear(g, inputs[0], *l.integer_projections, l.query.input_scale(params_), l.projection_scales,
                           g.constant(TensorView<float>(l.projection_bias.data(), Shape{3 * h * d})));
      context = ops::int8_attention_packed(g, qkv, mask, h, scales, alpha);
    } else {
      context = ops::int8_attention(g, l.query.forward_quantized_input(g, params_, inputs[0]),
                                    l.key.forward_quantized_input(g, params_, inputs[0]),
                                    l.value.forward_quantized_input(g, params_, inputs[0]), mask, h, scales, alpha);
    }
    if (Quantizer* quantizer = l.attention_output.used_input_quantizer(g))
      context = quantizer->apply(g, params_, context);
    return finish(context);
  }
  if (Var context = integer_attention_on_gpu(g, l, inputs[0], mask, t, training); context.valid())
    return finish(context);
  const double inverse_sqrt_d = 1.0 / std::sqrt(static_cast<double>(d));
  // Fused (ops::attention on the projections as they are, (B, T, C)) where asked and covered, unless an
  // attention matmul's quantizer calibrates (its observer needs the unfused ops' tensors). With the
  // matmuls' quantizers on (QAT), Q, K and V are fake-quantized before the fused kernels and the
  // probabilities' quantizer runs inside them, where they have it (BF16).
  const bool fits = ops::fused_attention(g, d, t);
  const std::array<const Quantizer*, 4> matmul_inputs = {&l.matmul_q, &l.matmul_k, &l.matmul_v, &l.matmul_a};
  const bool products_quantized = std::any_of(matmul_inputs.begin(), matmul_inputs.end(),
                                              [](const Quantizer* q) { return q->mode != QuantMode::kFloat; });
  const bool calibrating = std::any_of(matmul_inputs.begin(), matmul_inputs.end(),
                                       [](const Quantizer* q) { return q->mode == QuantMode::kCalibrate; });
  const bool probs_quantized = l.matmul_a.mode == QuantMode::kQuantize;
  const bool fused_here =
      fuse_attention_ && fits && !calibrating &&
      (!probs_quantized || (fuse_quantized_attention_ && ops::fused_quantized_attention(g, d, t)));
  // Inference of a quantized model with exact sums (the products on the integers behind the values).
  const bool exact_products =
      g.on_cuda() && !g.grad_enabled() && !training && exact_sums_ && per_tensor_int8(matmul_inputs, params_);
  const bool chosen = probs_quantized && !fuse_quantized_attention_;  // not told: the caller's choice
  if (g.on_cuda() && fuse_attention_ && !fused_here && !exact_products && !chosen && !told_unfused_attention_) {
    told_unfused_attention_ = true;
    spdlog::info("attention runs unfused on the GPU: {}",
                 !fits ? fmt::format("head size {} and length {} are outside the fused kernels (head size 16, 32, "
                                     "64 or 128, length up to 512)",
                                     d, t)
                 : calibrating ? "the attention matmuls' inputs are calibrated, which needs the unfused ops' tensors"
                               : "the attention probabilities' quantizer runs in the tensor-core fused kernels only "
                                 "(BF16, TF32)");
  }
  const double p = config_.attention_probs_dropout_prob;
  // Float projections into fused attention: one op from x (ops::self_attention: on a GPU the three
  // projections as one batched GEMM each way).
  const std::array<const Linear*, 3> projections = {&l.query, &l.key, &l.value};
  const bool float_projections = l.self_input.mode == QuantMode::kFloat &&
                                 std::all_of(projections.begin(), projections.end(), [&](const Linear* projection) {
                                   return projection->weight_quantizer.mode == QuantMode::kFloat && !projection->runs_integer(g);
                                 });
  Var context;
  if (g.on_cuda() && fuse_attention_ && fits && !products_quantized && float_projections) {
    auto param = [&](ParamId id) { return g.param(params_.get(id)); };
    context = ops::self_attention(g, inputs[0], {param(l.query.weight), param(l.key.weight), param(l.value.weight)},
                                  {param(l.query.bias), param(l.key.bias), param(l.value.bias)}, mask, h,
                                  inverse_sqrt_d, p, training, rng);
  } else {
    // The projections, each through its quantizer where the products' inputs are quantized or calibrated.
    std::vector<Var> fused_qkv = integer_projections_on_gpu(g, l, inputs[0]);
    if (fused_qkv.empty()) fused_qkv = quantized_projections_on_gpu(g, l, inputs[0], weights);
    const bool fused = !fused_qkv.empty();
    const Var q = fused
                      ? fused_qkv[0]
                      : l.matmul_q.apply(g, params_, l.query.forward_quantized_input(g, params_, inputs[0], weight(0)));
    const Var k = fused ? fused_qkv[1]
                        : l.matmul_k.apply(g, params_, l.key.forward_quantized_input(g, params_, inputs[0], weight(1)));
    const Var v = fused
                      ? fused_qkv[2]
                      : l.matmul_v.apply(g, params_, l.value.forward_quantized_input(g, params_, inputs[0], weight(2)));
    // Fused where asked and covered; else the two products read the projections in place (ops::head_scores
    // and head_context: no head permutes) around softmax and dropout, with the probabilities' quantizer
    // fused into them.
    const Shape scores_shape{g.shape(q)[0], h, t, t};
    if (exact_products) {
      // Inference with exact sums: the products on the integers behind the fake-quantized values.
      context = ops::exact_quantized_attention(g, q, k, v, mask, h, attention_scales(l), inverse_sqrt_d,
                                               l.matmul_a.fused_output(g, params_, scores_shape));
    } else if (fused_here) {
      context = probs_quantized ? ops::attention(g, q, k, v, mask, h, inverse_sqrt_d, p, training, rng,
                                                 l.matmul_a.fused_output(g, params_, scores_shape))
                                : ops::attention(g, q, k, v, mask, h, inverse_sqrt_d, p, training, rng);
    } else if (recompute_attention_ && g.grad_enabled() && g.activation_dtype() == DType::kF32 && !products_quantized) {
      // The (B, H, T, T) scores and probabilities not kept until the step ends (ops::recompute: the backward
      // computes them again), one layer's at a time instead of every layer's.
      std::vector<Var> in = {q, k, v};
      if (mask.valid()) in.push_back(mask);
      context = ops::recompute<float>(g, in, rng, [=](Graph<float>& g, std::span<const Var> in, Rng& rng) {
        const Var scores = ops::head_scores(g, in[0], in[1], h, inverse_sqrt_d, /*transient=*/true);
        return ops::head_context(g, ops::softmax_dropout(g, scores, in.size() > 3 ? in[3] : Var{}, p, training, rng),
                                 in[2], h);
      });
    } else if (l.matmul_a.mode == QuantMode::kFloat) {
      // Neither the (B, H, T, T) scores (read by the softmax alone, ops::head_scores) nor the dropped-out
      // probabilities (formed again for the backward, ops::softmax_dropout_context) kept.
      const Var scores = ops::head_scores(g, q, k, h, inverse_sqrt_d, /*transient=*/true);
      context = ops::softmax_dropout_context(g, scores, mask, v, h, p, training, rng);
    } else {
      // (B, H, T, T), read by the softmax alone: not kept (ops::head_scores)
      const Var scores = ops::head_scores(g, q, k, h, inverse_sqrt_d, /*transient=*/true);
      const Var probs = quantized(g, params_, &l.matmul_a, g.shape(scores), fuse, [&](const ops::QuantizeOutput* qa) {
        return qa ? ops::softmax_dropout(g, scores, mask, p, training, rng, *qa)
                  : ops::softmax_dropout(g, scores, mask, p, training, rng);
      });
      context = ops::head_context(g, probs, v, h);
    }
  }
  // (An integer output layer quantizes the context itself: a quantizer applied as an op of its own reads
  // the stored context, as int8_linear does.)
  if (Quantizer* quantizer = l.attention_output.used_input_quantizer(g);
      quantizer && !l.attention_output.runs_integer(g))
    context = quantizer->apply(g, params_, context);
  return finish(context);
}

std::vector<Var> Bert::integer_projections_on_gpu(Graph<float>& g, Layer& l, Var x) {
  if (!g.on_cuda() || !l.device_projections || !l.query.runs_integer(g) || !l.key.runs_integer(g) ||
      !l.value.runs_integer(g))
    return {};
  std::array<ops::Int8OutputPart, 3> parts;
  const std::array<const Quantizer*, 3> products = {&l.matmul_q, &l.matmul_k, &l.matmul_v};
  for (size_t i = 0; i < 3; ++i) {
    parts[i].columns = l.query.out;
    if (!epilogue_scale(params_, *products[i], parts[i].scale)) return {};
  }
  return ops::int8_linear_quantized(g, x, *l.device_projections, l.query.input_scale(params_), /*gelu=*/false, parts,
                                    /*integers=*/false);
}

std::vector<Var> Bert::quantized_projections_on_gpu(Graph<float>& g, Layer& l, Var x, std::span<const Var> weights) {
  if (!g.on_cuda() || !fuse_quantizers_ || weights.size() < 3) return {};
  const std::array<Linear*, 3> projections = {&l.query, &l.key, &l.value};
  const std::array<Quantizer*, 3> products = {&l.matmul_q, &l.matmul_k, &l.matmul_v};
  for (size_t i = 0; i < 3; ++i) {
    const Linear& p = *projections[i];
    if (!weights[i].valid() || p.runs_integer(g) || p.sums_exactly(g, params_) ||
        products[i]->mode != QuantMode::kQuantize || products[i]->channels != 1)
      return {};
  }
  const Shape shape = g.shape(x);
  std::array<ops::QuantizeOutput, 3> quantizers;
  std::array<Var, 3> biases;
  for (size_t i = 0; i < 3; ++i) {
    quantizers[i] = products[i]->fused_output(g, params_, shape);
    biases[i] = g.param(params_.get(projections[i]->bias));
  }
  // The forward products on the integers behind x and the weights (Linear::trains_on_integers).
  ops::ProjectionScales scales;
  const bool integers = std::all_of(projections.begin(), projections.end(),
                                    [&](const Linear* p) { return p->trains_on_integers(g, params_); });
  if (integers) {
    scales.input = g.param(params_.get(l.query.input().scale));
    for (size_t i = 0; i < 3; ++i) scales.weights[i] = g.param(params_.get(projections[i]->weight_quantizer.scale));
  }
  const std::array<Var, 3> out = ops::quantized_projections(g, x, {weights[0], weights[1], weights[2]}, biases,
                                                            quantizers, integers ? &scales : nullptr);
  return {out.begin(), out.end()};
}

Var Bert::integer_attention_on_gpu(Graph<float>& g, Layer& l, Var x, Var mask, int64_t t, bool training) {
  if (!l.integer_attention || !g.on_cuda() || g.grad_enabled() || training || !l.device_projections ||
      !l.query.runs_integer(g) || !l.key.runs_integer(g) || !l.value.runs_integer(g))
    return Var{};
  const int64_t h = config_.num_attention_heads, d = config_.head_size();
  if (!ops::int8_attention_fits(g, d, t)) {
    if (!told_float_attention_)
      spdlog::info(
          "the attention products run fake-quantized in float: length {} with head size {} is outside the "
          "GPU's integer attention (length up to 512)",
          t, d);
    told_float_attention_ = true;
    return Var{};
  }
  const ops::Int8AttentionScales scales = attention_scales(l);
  // Q, K and V as the integers of their quantizers, from one GEMM.
  const std::array<ops::Int8OutputPart, 3> parts = {
      ops::Int8OutputPart{l.query.out, scales.q}, {l.key.out, scales.k}, {l.value.out, scales.v}};
  const std::vector<Var> qkv = ops::int8_linear_quantized(g, x, *l.device_projections, l.query.input_scale(params_),
                                                          /*gelu=*/false, parts, /*integers=*/true);
  // An integer output layer reads the context as its input quantizer's integers, made here.
  float out_scale = 0.0f;
  if (l.attention_output.runs_integer(g) && !epilogue_scale(params_, l.attention_output.input(), out_scale))
    out_scale = 0.0f;
  Var context = ops::int8_attention_integers(g, qkv[0], qkv[1], qkv[2], mask, h, scales,
                                             1.0 / std::sqrt(static_cast<double>(d)), out_scale);
  if (Quantizer* quantizer = l.attention_output.used_input_quantizer(g);
      quantizer && !l.attention_output.runs_integer(g))
    context = quantizer->apply(g, params_, context);
  return context;
}

Var Bert::integer_activation_on_gpu(Graph<float>& g, Layer& l, Var x) {
  // (Unfused quantizers quantize the stored GELU output, which the epilogue does not give in BF16.)
  if (!g.on_cuda() || !fuse_quantizers_ || !l.intermediate.runs_integer(g) || !l.output.runs_integer(g)) return Var{};
  ops::Int8OutputPart part{l.intermediate.out, 0.0f, l.gelu_table.get()};
  if (!epilogue_scale(params_, l.output.input(), part.scale) || part.scale == 0.0f) return Var{};
  return ops::int8_linear_quantized(g, x, *l.intermediate.device_integer_weights, l.intermediate.input_scale(params_),
                                    /*gelu=*/true, std::span<const ops::Int8OutputPart>(&part, 1),
                                    /*integers=*/true)[0];
}

void Bert::zero_gradients() {
  if (!lend_gradients_ || !params_.on_cuda() || layers_.empty()) return params_.zero_grad();
  for (const auto& [first, end] : {std::pair<ParamId, ParamId>{0, layers_.front().first_param},
                                   std::pair<ParamId, ParamId>{layers_.back().end_param, params_.size()}}) {
    const TensorView<float> grads = params_.device_grads(first, end);
    if (grads.numel() > 0)
      params_.device().fill_zero(grads.data(), static_cast<std::size_t>(grads.numel()) * sizeof(float));
  }
}

Var Bert::encode(Graph<float>& g, const BatchView& in, bool training, Rng& rng) {
  const int64_t b = in.batch, t = in.seq_len;
  BERT_CHECK(t <= config_.max_position_embeddings, "sequence length " + std::to_string(t) +
                                                       " > max_position_embeddings " +
                                                       std::to_string(config_.max_position_embeddings));
  BERT_CHECK(static_cast<int64_t>(in.input_ids.size()) == b * t &&
                 static_cast<int64_t>(in.attention_mask.size()) == b * t &&
                 static_cast<int64_t>(in.token_type_ids.size()) == b * t,
             "batch arrays do not match (B, T) = (" + std::to_string(b) + ", " + std::to_string(t) + ")");
  std::vector<Var> x_read;  // x as the next attention block's quantizers read it, where its LayerNorm made them
  Var x = embed(g, in, training, rng, x_read);

  // Additive padding mask (B, T): 0 for real tokens, -10000 for padding (as the original BERT); none where
  // nothing is padded (adding zeros changes no score; the attention kernels skip reading it).
  Var mask;
  if (std::any_of(in.attention_mask.begin(), in.attention_mask.end(), [](auto m) { return m == 0; })) {
    std::vector<float> mask_values(static_cast<size_t>(b * t));
    for (int64_t i = 0; i < b * t; ++i) mask_values[i] = in.attention_mask[i] ? 0.0f : -10000.0f;
    mask = g.input(std::span<const float>(mask_values), Shape{b, t});
  }

  integer_sums_ = 0;
  for (size_t i = 0; i < layers_.size(); ++i) {
    Layer& l = layers_[i];
    std::vector<Var> ffn_inputs;
    // On a GPU, the layer's weights fake-quantized as one op where all six are (QAT): one launch each way
    // instead of six.
    const std::array<Linear*, 6> linears = {&l.query,        &l.key,   &l.value, &l.attention_output,
                                            &l.intermediate, &l.output};
    const std::vector<Var> weights =
        g.on_cuda() && fuse_quantizers_ ? Linear::quantize_weights(g, params_, linears) : std::vector<Var>{};
    auto weight = [&](size_t i) { return i < weights.size() ? weights[i] : Var{}; };
    Layer* next = i + 1 < layers_.size() ? &layers_[i + 1] : nullptr;
    const Var a = attention(g, l, next, x, mask, t, training, rng, x_read, ffn_inputs, weights);
    // The quantizers of the GELU's and the dropout's outputs run inside those ops (when fused).
    const std::vector<Var> inputs =
        !ffn_inputs.empty() ? ffn_inputs
                            : quantize_each(g, a, {l.intermediate.used_input_quantizer(g), &l.output_add_residual});
    Var ff;
    if (l.intermediate.runs_float() && l.output.runs_float()) {  // one op (ops::feed_forward)
      ff = ops::feed_forward(g, inputs[0], g.param(params_.get(l.intermediate.weight)),
                             g.param(params_.get(l.intermediate.bias)), g.param(params_.get(l.output.weight)),
                             g.param(params_.get(l.output.bias)));
    } else {
      // The GELU runs in the intermediate layer's GEMM unless its output quantizer is fused into it.
      const Shape hidden_shape = g.shape(inputs[0]).with_last(l.intermediate.out);
      Var act = integer_activation_on_gpu(g, l, inputs[0]);
      if (!act.valid())
        act = quantized(g, params_, l.output.used_input_quantizer(g), hidden_shape, fuse_quantizers_,
                        [&](const ops::QuantizeOutput* q) {
                          if (!q) return l.intermediate.forward_gelu_quantized_input(g, params_, inputs[0], weight(4));
                          return ops::gelu(g, l.intermediate.forward_quantized_input(g, params_, inputs[0], weight(4)),
                                           *q);
                        });
      ff = integer_sum(g, l, /*output=*/true, next, training)
               ? sublayer_integers(g, l.output, act, l.output_add_input)
               : l.output.forward_quantized_input(g, params_, act, weight(5));
    }
    x_read.clear();
    if (next) {
      std::array<Reader, 2> readers = attention_readers(g, *next);
      readers[1].integers = integer_sum(g, *next, /*output=*/false, nullptr, training);  // its LayerNorm reads it
      x_read = residual_norm_quantized(g, l.output_norm, l.output_add_input, ff, inputs[1], l.output_add_residual,
                                       training, readers);
      if (x_read.empty())
        x_read = residual_norm_each(g, l.output_norm, l.output_add_input, ff, inputs[1], training, rng, readers);
    } else if (g.dtype(ff) == DType::kS8) {  // the last layer's, on integers: the model's output itself
      const std::vector<Var> out = residual_norm_quantized(g, l.output_norm, l.output_add_input, ff, inputs[1],
                                                           l.output_add_residual, training, {});
      BERT_CHECK(out.size() == 1, "the last layer's LayerNorm on integers made no output");
      x = out[0];
      continue;
    }
    x = x_read.empty() ? residual_norm(g, l.output_norm, l.output_add_input, ff, inputs[1], training, rng) : Var{};
    if (lend_gradients_ && params_.on_cuda()) {  // no later op takes this layer's parameters
      const TensorView<float> grads = params_.device_grads(l.first_param, l.end_param);
      const std::size_t bytes = static_cast<std::size_t>(grads.numel()) * sizeof(float);
      if (training && g.grad_enabled())
        g.lend(grads.data(), bytes);  // the backward gives them back zeroed
      else
        params_.device().fill_zero(grads.data(), bytes);  // as zero_gradients() left them out
    }
  }
  return x;
}

Var Bert::embed(Graph<float>& g, const BatchView& in, bool training, Rng& rng, std::vector<Var>& read) {
  const int64_t b = in.batch, t = in.seq_len;
  // Word + position + token type, LayerNorm, dropout.
  std::vector<int32_t> positions(t), types(in.token_type_ids.begin(), in.token_type_ids.end());
  std::iota(positions.begin(), positions.end(), 0);
  const Var word_table = g.param(params_.get(word_embeddings_));
  const Var position_table = g.param(params_.get(position_embeddings_));
  const Var type_table = g.param(params_.get(token_type_embeddings_));
  const Var gamma = g.param(params_.get(embedding_norm_.gamma)), beta = g.param(params_.get(embedding_norm_.beta));
  if (g.on_cuda() && !g.grad_enabled() && !training) {  // (no dropout)
    std::vector<ops::NormOutput> outputs;
    bool shared = false;
    if (fuse_quantizers_ && !layers_.empty()) {
      std::array<Reader, 2> readers = attention_readers(g, layers_[0]);
      readers[1].integers = integer_sum(g, layers_[0], /*output=*/false, nullptr, training);
      if (!readers[0].integers || !norm_outputs(readers, outputs, shared)) outputs.clear();
    }
    std::vector<Var> made =
        ops::embedding_layer_norm_quantized(g, word_table, position_table, type_table, in.input_ids, types,
                                            Shape{b, t}, gamma, beta, embedding_norm_.eps, outputs);
    if (!made.empty() && outputs.empty()) return made[0];
    if (!made.empty()) {
      if (shared) made.push_back(made[0]);
      read = std::move(made);
      return Var{};
    }
  }
  const Var words = ops::gather_rows(g, word_table, in.input_ids, Shape{b, t});
  const Var pos = ops::gather_rows(g, position_table, positions, Shape{t});
  const Var type = ops::gather_rows(g, type_table, types, Shape{b, t});
  const Var x = embedding_norm_.forward(g, params_, ops::add(g, ops::add(g, words, pos), type));
  return ops::dropout(g, x, config_.hidden_dropout_prob, training, rng);
}

bool Bert::norm_outputs(std::span<const Reader> readers, std::vector<ops::NormOutput>& outputs, bool& shared) {
  outputs.assign(std::max<size_t>(readers.size(), 1), ops::NormOutput{});  // none: the output itself
  for (size_t i = 0; i < readers.size(); ++i) {
    if (readers[i].quantizer && !epilogue_scale(params_, *readers[i].quantizer, outputs[i].scale)) return false;
    outputs[i].integers = readers[i].integers;
  }
  shared = outputs.size() == 2 && outputs[0].integers && outputs[1].integers && outputs[0].scale == outputs[1].scale;
  if (shared) outputs.resize(1);
  return true;
}

Var Bert::residual_norm(Graph<float>& g, const LayerNorm& norm, Quantizer& add_input, Var sublayer, Var residual,
                        bool training, Rng& rng) {
  const double p = config_.hidden_dropout_prob;
  if (add_input.mode == QuantMode::kFloat)  // no quantizer between the dropout and the add
    return norm.forward_dropout_sum(g, params_, sublayer, residual, p, training, rng);
  if (add_input.mode == QuantMode::kQuantize && fuse_quantizers_) {
    const ops::QuantizeOutput q = add_input.fused_output(g, params_, g.shape(sublayer));
    return norm.forward_dropout_sum(g, params_, sublayer, residual, p, training, rng, q);
  }
  const Var dropped = add_input.apply(g, params_, ops::dropout(g, sublayer, p, training, rng));
  return norm.forward_sum(g, params_, dropped, residual);
}

std::vector<Var> Bert::residual_norm_each(Graph<float>& g, const LayerNorm& norm, Quantizer& add_input, Var sublayer,
                                          Var residual, bool training, Rng& rng, std::span<const Reader> readers) {
  if (!g.on_cuda() || !fuse_quantizers_ || readers.empty() ||
      (add_input.mode != QuantMode::kFloat && add_input.mode != QuantMode::kQuantize))
    return {};
  std::vector<ops::QuantizeOutput> outputs;
  for (const Reader& r : readers) {
    if (r.integers || !r.quantizer || r.quantizer->mode != QuantMode::kQuantize || r.quantizer->is_weight ||
        r.quantizer->channels != 1)
      return {};
    outputs.push_back(r.quantizer->fused_output(g, params_, g.shape(sublayer)));
  }
  const ops::QuantizeOutput q =
      add_input.mode == QuantMode::kQuantize ? add_input.fused_output(g, params_, g.shape(sublayer)) : ops::QuantizeOutput{};
  return ops::dropout_add_layer_norm_each(g, sublayer, residual, g.param(params_.get(norm.gamma)),
                                          g.param(params_.get(norm.beta)), norm.eps, config_.hidden_dropout_prob,
                                          training, rng, q.scale.valid() ? &q : nullptr,
                                          std::span<const ops::QuantizeOutput>(outputs));
}

std::array<Bert::Reader, 2> Bert::attention_readers(const Graph<float>& g, Layer& l) {
  const bool integers = l.query.runs_integer(g) && l.key.runs_integer(g) && l.value.runs_integer(g);
  const bool quantizes =
      l.query.used_input_quantizer(g) || l.key.used_input_quantizer(g) || l.value.used_input_quantizer(g);
  return {Reader{integers || quantizes ? &l.self_input : nullptr, integers}, Reader{&l.attention_add_residual, false}};
}

std::array<Bert::Reader, 2> Bert::ffn_readers(const Graph<float>& g, Layer& l) {
  const bool integers = l.intermediate.runs_integer(g);
  return {Reader{integers ? &l.intermediate.input() : l.intermediate.used_input_quantizer(g), integers},
          Reader{&l.output_add_residual, false}};
}

std::vector<Var> Bert::residual_norm_quantized(Graph<float>& g, const LayerNorm& norm, Quantizer& add_input,
                                               Var sublayer, Var residual, const Quantizer& residual_quantizer,
                                               bool training, std::span<const Reader> readers) {
  ops::NormInputs inputs;  // integer addends where integer_sum chose them (sublayer_integers, the LayerNorm before)
  if (g.dtype(sublayer) == DType::kS8) epilogue_scale(params_, add_input, inputs.a_scale);
  if (g.dtype(residual) == DType::kS8) epilogue_scale(params_, residual_quantizer, inputs.b_scale);
  // In inference on a GPU, with the quantizers fused as the fake-quantized model fuses them, and an integer
  // layer among the readers (else the float model: its path as it was).
  if (!(inputs.a_scale > 0) &&
      (!g.on_cuda() || g.grad_enabled() || training || !fuse_quantizers_ ||
       std::none_of(readers.begin(), readers.end(), [](const Reader& r) { return r.integers; }) ||
       (add_input.mode != QuantMode::kFloat && add_input.mode != QuantMode::kQuantize)))
    return {};
  std::vector<ops::NormOutput> outputs;
  bool shared = false;
  if (!norm_outputs(readers, outputs, shared)) return {};
  const ops::QuantizeOutput q = add_input.mode == QuantMode::kQuantize && !(inputs.a_scale > 0)
                                    ? add_input.fused_output(g, params_, g.shape(sublayer))
                                    : ops::QuantizeOutput{};
  std::vector<Var> made = ops::add_layer_norm_quantized(g, sublayer, residual, g.param(params_.get(norm.gamma)),
                                                        g.param(params_.get(norm.beta)), norm.eps,
                                                        q.scale.valid() ? &q : nullptr, outputs, inputs);
  if (shared && !made.empty()) made.push_back(made[0]);
  if (inputs.a_scale > 0) ++integer_sums_;
  return made;
}

bool Bert::integer_sum(const Graph<float>& g, Layer& l, bool output, Layer* next, bool training) {
  if (!g.on_cuda() || g.grad_enabled() || training || !fuse_quantizers_ ||
      !ops::add_layer_norm_reads_integers(g, config_.hidden_size))
    return false;
  const Linear& sublayer = output ? l.output : l.attention_output;
  float scale = 0.0f;
  for (const Quantizer* q : {output ? &l.output_add_input : &l.attention_add_input,
                             output ? &l.output_add_residual : &l.attention_add_residual})
    if (!epilogue_scale(params_, *q, scale) || scale == 0.0f) return false;
  if (!sublayer.runs_integer(g)) return false;
  // Its readers: the next integer layer (residual_norm_quantized runs only with one) and the next residual
  // add, each quantizing per tensor; after the last layer, the model's output.
  if (output && !next) return true;
  const std::array<Reader, 2> readers = output ? attention_readers(g, *next) : ffn_readers(g, l);
  if (!readers[0].integers) return false;
  for (const Reader& r : readers)
    if (r.quantizer && !epilogue_scale(params_, *r.quantizer, scale)) return false;
  return true;
}

Var Bert::sublayer_integers(Graph<float>& g, Linear& sublayer, Var x, const Quantizer& add_input) {
  ops::Int8OutputPart part{sublayer.out, 0.0f};
  epilogue_scale(params_, add_input, part.scale);
  return ops::int8_linear_quantized(g, x, *sublayer.device_integer_weights, sublayer.input_scale(params_),
                                    /*gelu=*/false, std::span<const ops::Int8OutputPart>(&part, 1),
                                    /*integers=*/true)[0];
}

ModelOutputs Bert::forward(Graph<float>& g, const BatchView& in, bool training, Rng& rng, MlmOutputs mlm) {
  ModelOutputs out;
  Var hidden = ops::reshape(g, encode(g, in, training, rng), Shape{in.batch * in.seq_len, config_.hidden_size});
  if (config_.head == Head::kPretraining)
    pretraining_head(g, hidden, in, mlm, out);
  else if (config_.head == Head::kQuestionAnswering)
    question_answering_head(g, hidden, in, out);
  else
    classification_head(g, hidden, in, training, rng, out);
  return out;
}

void Bert::pretraining_head(Graph<float>& g, Var hidden, const BatchView& in, MlmOutputs mlm, ModelOutputs& out) {
  const int64_t b = in.batch, t = in.seq_len, p = in.max_predictions;  // the pretraining heads have no dropout

  // MLM head at the real masked positions only.
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = 0; j < p; ++j) {
      const int32_t position = in.masked_positions[i * p + j];
      if (position == 0) break;  // 0 is [CLS]: the list ends
      BERT_CHECK(position < t, "masked position " + std::to_string(position) + " >= sequence length");
      out.mlm_rows.push_back(static_cast<int32_t>(i * t + position));
      out.mlm_targets.push_back(in.masked_ids[i * p + j]);
    }
  const auto m = static_cast<int64_t>(out.mlm_rows.size());
  Var selected = ops::gather_rows(g, hidden, out.mlm_rows, Shape{m});
  Var transformed = transform_norm_.forward(g, params_, transform_.forward_gelu(g, params_, selected));
  const bool cpu_inference = !g.on_cuda() && !g.grad_enabled();
  const Var decoder_weight = g.param(params_.get(word_embeddings_)), decoder_bias = g.param(params_.get(decoder_bias_));
  const bool keep_logits = mlm == MlmOutputs::kLogits || mlm == MlmOutputs::kLogitsAndPredictionsOnDevice;
  const ops::PredictionsTo predictions_to =
      mlm == MlmOutputs::kLossAndPredictions ? ops::PredictionsTo::kHost : ops::PredictionsTo::kDevice;
  if (!keep_logits && (cpu_inference || g.on_cuda())) {  // scored without the logits
    ops::LinearScores scores =
        integer_decoder_ && cpu_inference
            ? ops::int8_linear_dynamic_cross_entropy_scores(g, transformed, *integer_decoder_, integer_decoder_scales_,
                                                            decoder_bias, out.mlm_targets)
            : ops::linear_cross_entropy_scores(g, transformed, decoder_weight, decoder_bias, out.mlm_targets,
                                               cpu_inference ? ops::PredictionsTo::kHost : predictions_to);
    out.mlm_loss = scores.loss;
    out.mlm_predictions = std::move(scores.predictions);
    out.mlm_device_predictions = scores.device_predictions;
    if (cpu_inference && predictions_to == ops::PredictionsTo::kDevice) {  // the CPU's device memory is the graph's
      int32_t* kept = g.scratch<int32_t>(std::max<std::size_t>(out.mlm_predictions.size(), 1));
      std::copy(out.mlm_predictions.begin(), out.mlm_predictions.end(), kept);
      out.mlm_device_predictions = kept;
      out.mlm_predictions.clear();
    }
  } else {
    out.mlm_logits = integer_decoder_ && cpu_inference ? ops::int8_linear_dynamic(g, transformed, *integer_decoder_,
                                                                                  integer_decoder_scales_, decoder_bias)
                                                       : ops::linear(g, transformed, decoder_weight, decoder_bias);
    if (mlm != MlmOutputs::kLogits) {
      ops::LinearScores s = ops::cross_entropy_scores<float>(g, out.mlm_logits, out.mlm_targets, predictions_to);
      out.mlm_loss = s.loss;
      out.mlm_predictions = std::move(s.predictions);
      out.mlm_device_predictions = s.device_predictions;
    } else {
      out.mlm_loss = ops::cross_entropy<float>(g, out.mlm_logits, out.mlm_targets);
    }
  }

  // NSP head on [CLS].
  std::vector<int32_t> cls_rows(b);
  for (int64_t i = 0; i < b; ++i) cls_rows[i] = static_cast<int32_t>(i * t);
  Var pooled = ops::tanh(g, pooler_.forward(g, params_, ops::gather_rows(g, hidden, cls_rows, Shape{b})));
  out.nsp_logits = seq_relationship_.forward(g, params_, pooled);
  if (!in.next_sentence_labels.empty()) {
    std::vector<int32_t> labels(in.next_sentence_labels.begin(), in.next_sentence_labels.end());
    out.nsp_loss = ops::cross_entropy<float>(g, out.nsp_logits, labels);
    out.loss = ops::add(g, out.mlm_loss, out.nsp_loss);
  }
}

void Bert::classification_head(Graph<float>& g, Var hidden, const BatchView& in, bool training, Rng& rng,
                               ModelOutputs& out) {
  const int64_t b = in.batch, t = in.seq_len;
  const int64_t num_labels = config_.num_labels();
  const bool per_token = config_.head == Head::kTokenClassification;
  const bool labeled = !in.labels.empty();
  if (config_.regression() ? labeled : !in.scores.empty())
    throw UserError(config_.regression() ? "a regression model takes scores (seq-reg shards), not class labels"
                                         : "a " + head_architecture(config_.head) +
                                               " takes class labels, not scores (seq-reg shards are for a regression)");
  BERT_CHECK(in.scores.empty() || static_cast<int64_t>(in.scores.size()) == b,
             "scores do not match the batch (" + std::to_string(in.scores.size()) + " for " + std::to_string(b) +
                 " sequences)");
  BERT_CHECK(!labeled || static_cast<int64_t>(in.labels.size()) == (per_token ? b * t : b),
             "labels do not match the batch (" + std::to_string(in.labels.size()) + " for a " +
                 head_architecture(config_.head) + " batch of " + std::to_string(b) + " x " + std::to_string(t) + ")");
  auto check_label = [&](int32_t label) {
    if (label < 0 || label >= num_labels)
      throw UserError("label " + std::to_string(label) + " is outside the model's " + std::to_string(num_labels) +
                      " labels (data made for another label set?)");
  };
  Var features;
  if (per_token) {
    // Only the rows that carry a label go through the classifier (the same loss as Hugging Face's
    // ignore_index, without computing logits that are thrown away); every real token without labels.
    for (int64_t r = 0; r < b * t; ++r) {
      const bool use = labeled ? in.labels[r] != kIgnoredLabel : in.attention_mask[r] != 0;
      if (!use) continue;
      out.rows.push_back(static_cast<int32_t>(r));
      if (labeled) {
        check_label(in.labels[r]);
        out.targets.push_back(in.labels[r]);
      }
    }
    if (out.rows.empty())
      throw UserError("a token-classification batch without any labeled token (every label is -100)");
    features = ops::gather_rows(g, hidden, out.rows, Shape{static_cast<int64_t>(out.rows.size())});
  } else {
    for (int64_t i = 0; i < b; ++i) out.rows.push_back(static_cast<int32_t>(i * t));
    if (labeled)
      for (int32_t label : in.labels) check_label(label), out.targets.push_back(label);
    features = ops::tanh(g, pooler_.forward(g, params_, ops::gather_rows(g, hidden, out.rows, Shape{b})));
  }
  features = ops::dropout(g, features, config_.head_dropout(), training, rng);
  out.logits = classifier_.forward(g, params_, features);
  if (labeled) out.loss = ops::cross_entropy<float>(g, out.logits, out.targets);
  if (!in.scores.empty()) {
    out.scores.assign(in.scores.begin(), in.scores.end());
    out.loss = ops::mean_squared_error(g, out.logits, g.input(std::span<const float>(out.scores), Shape{b, 1}));
  }
}

void Bert::question_answering_head(Graph<float>& g, Var hidden, const BatchView& in, ModelOutputs& out) {
  const int64_t b = in.batch, t = in.seq_len;
  const bool labeled = !in.labels.empty();
  BERT_CHECK(!labeled || static_cast<int64_t>(in.labels.size()) == 2 * b,
             "labels do not match the batch (" + std::to_string(in.labels.size()) +
                 " for a question-answering batch of " + std::to_string(b) + ": a start and an end each)");
  for (int64_t i = 0; i < b; ++i) out.rows.push_back(static_cast<int32_t>(i * t));
  for (int32_t position : in.labels) {
    if (position < 0 || position >= t)
      throw UserError("answer position " + std::to_string(position) + " is outside the sequence of " +
                      std::to_string(t) + " tokens");
    out.targets.push_back(position);
  }
  // Every token's start and end logits (B T, 2), then each sequence's start row and end row: (2 B, T),
  // whose cross-entropy over the positions is Hugging Face's (start loss + end loss) / 2.
  Var logits = classifier_.forward(g, params_, hidden);
  logits = ops::transpose(g, ops::reshape(g, logits, Shape{b, t, 2}), 1, 2);
  out.logits = ops::reshape(g, logits, Shape{2 * b, t});
  if (labeled) out.loss = ops::cross_entropy<float>(g, out.logits, out.targets);
}

}  // namespace bert::model
