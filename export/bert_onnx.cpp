#include "export/bert_onnx.h"

#include <onnx/checker.h>
#include <onnx/shape_inference/implementation.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <set>

#include "export/onnx_graph.h"
#include "sys/atomic_file.h"
#include "sys/error.h"

namespace bert::exporter {

void ExportOptions::validate() const {
  if (opset != 13 && opset != 17) throw UserError("--opset " + std::to_string(opset) + ": expected 13 or 17");
}

namespace {

constexpr int32_t kFloat = onnx::TensorProto::FLOAT;
constexpr int32_t kInt64 = onnx::TensorProto::INT64;

// Emits the graph module by module, mirroring Bert::forward.
class BertEmitter {
 public:
  BertEmitter(model::Bert& model, const ExportOptions& options, onnx::GraphProto* graph)
      : model_(model), params_(model.parameters()), c_(model.config()), options_(options), g_(graph) {
    for (model::Quantizer* q : model.quantizers()) quantizers_[q->name] = q;
  }

  void emit() {
    g_.input("input_ids", kInt64, {"batch", "sequence"});
    g_.input("attention_mask", kInt64, {"batch", "sequence"});
    g_.input("token_type_ids", kInt64, {"batch", "sequence"});
    if (options_.masked_positions) g_.input("masked_lm_positions", kInt64, {"batch", "predictions"});
    std::string x = embeddings();
    const std::string mask = additive_mask();
    for (int64_t i = 0; i < c_.num_hidden_layers; ++i) x = layer(i, x, mask);
    switch (c_.head) {
      case model::Head::kPretraining:
        prediction_head(x);
        nsp_head(x);
        break;
      case model::Head::kSequenceClassification:
        linear("classifier", pooled(x), /*quantizable=*/false, "logits");
        g_.output("logits", kFloat, {"batch", c_.num_labels()});
        break;
      case model::Head::kTokenClassification:
        linear("classifier", x, /*quantizable=*/false, "logits");
        g_.output("logits", kFloat, {"batch", "sequence", c_.num_labels()});
        break;
      case model::Head::kQuestionAnswering:
        answer_head(x);
        break;
    }
  }

 private:
  // ---- building blocks

  std::string param(const std::string& name) {
    if (!emitted_.count(name)) {
      Parameter<float> p = params_.get(name);
      std::vector<int64_t> dims;
      for (int i = 0; i < p.value.shape().rank(); ++i) dims.push_back(p.value.shape()[i]);
      g_.floats(name, std::vector<float>(p.value.begin(), p.value.end()), dims);
      emitted_.insert(name);
    }
    return name;
  }
  std::string scalar(const std::string& name, float v) {
    if (!emitted_.count(name)) {
      g_.floats(name, {v}, {});
      emitted_.insert(name);
    }
    return name;
  }
  std::string ints(const std::string& name, const std::vector<int64_t>& v) {
    if (!emitted_.count(name)) {
      g_.int64s(name, v, {static_cast<int64_t>(v.size())});
      emitted_.insert(name);
    }
    return name;
  }

  bool quantized(const std::string& quantizer) const {
    auto it = quantizers_.find(quantizer);
    return options_.qdq && it != quantizers_.end() && it->second->mode == model::QuantMode::kQuantize;
  }

  // QuantizeLinear -> DequantizeLinear of an activation with the quantizer's scalar scale, or the
  // tensor itself when the quantizer is off. Each call makes its own pair: one per consumer (rule 10);
  // a quantizer read by several consumers (Q, K and V's) gives each a pair named with its `consumer`,
  // all on the one scale initializer.
  std::string qdq(const std::string& tensor, const std::string& quantizer, const std::string& consumer = "") {
    if (!quantized(quantizer)) return tensor;
    const float s = params_.get(quantizer + ".scale").value[0];
    const std::string scale = scalar(quantizer + ".scale", s);
    if (!emitted_.count(quantizer + ".zero_point")) {
      g_.int8s(quantizer + ".zero_point", {0}, {});
      emitted_.insert(quantizer + ".zero_point");
    }
    const std::string tag = consumer.empty() ? "" : "." + consumer;
    const std::string q =
        g_.node("QuantizeLinear", {tensor, scale, quantizer + ".zero_point"}, quantizer + tag + ".quantize");
    return g_.node("DequantizeLinear", {q, scale, quantizer + ".zero_point"}, quantizer + tag + ".dequantize");
  }

  // Whether linear() puts its input quantizer's Q/DQ pair on x, or x already went through it (a pair
  // shared by several layers, or placed earlier in the graph).
  enum class Input { kQuantize, kQuantized };

  // y = x W^T + b as MatMul with the weight stored as [in, out], plus Add. With Q/DQ: the input's pair
  // and the weight's per-output-channel pair (axis 1 of [in, out]; a scalar pair when per-tensor); the FP32 weight is clamped to the
  // narrow range [-127 s, 127 s] first, so QuantizeLinear never produces -128.
  std::string linear(const std::string& name, const std::string& x, bool quantizable = true,
                     const std::string& output = "", Input input_mode = Input::kQuantize) {
    Parameter<float> w = params_.get(name + ".weight");
    const int64_t out = w.value.shape()[0], in = w.value.shape()[1];
    const bool qw = quantizable && quantized(name + ".weight_quantizer");
    const TensorView<float> scales =
        qw ? params_.get(name + ".weight_quantizer.scale").value : TensorView<float>();
    const bool per_tensor = qw && scales.numel() == 1;  // WeightScales::kPerTensor
    std::vector<float> transposed(in * out);
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) {
        float v = w.value[o * in + i];
        if (qw) {
          const float s = scales[per_tensor ? 0 : o];
          v = std::min(std::max(v, -127 * s), 127 * s);
        }
        transposed[i * out + o] = v;
      }
    std::string weight = g_.floats(name + ".weight_transposed", transposed, {in, out});
    if (qw && per_tensor) {  // a scalar scale: no axis
      const std::string s = g_.floats(name + ".weight_quantizer.scale", {scales[0]}, {});
      const std::string zp = g_.int8s(name + ".weight_quantizer.zero_point", {0}, {});
      const std::string q = g_.node("QuantizeLinear", {weight, s, zp}, name + ".weight_quantizer.quantize");
      weight = g_.node("DequantizeLinear", {q, s, zp}, name + ".weight_quantizer.dequantize");
    } else if (qw) {
      const std::string s =
          g_.floats(name + ".weight_quantizer.scale", std::vector<float>(scales.begin(), scales.end()), {out});
      const std::string zp = g_.int8s(name + ".weight_quantizer.zero_point", std::vector<int8_t>(out, 0), {out});
      auto axis1 = [](onnx::NodeProto& n) { OnnxGraph::attribute(n, "axis", int64_t{1}); };
      const std::string q = g_.node("QuantizeLinear", {weight, s, zp}, name + ".weight_quantizer.quantize", axis1);
      weight = g_.node("DequantizeLinear", {q, s, zp}, name + ".weight_quantizer.dequantize", axis1);
    }
    const std::string input = quantizable && input_mode == Input::kQuantize ? qdq(x, name + ".input_quantizer") : x;
    const std::string product = g_.node("MatMul", {input, weight}, name + ".matmul");
    return g_.node("Add", {product, param(name + ".bias")}, output.empty() ? name : output);
  }

  std::string layer_norm(const std::string& name, const std::string& x) {
    const float eps = static_cast<float>(c_.layer_norm_eps);
    if (options_.opset >= 17)
      return g_.node("LayerNormalization", {x, param(name + ".weight"), param(name + ".bias")}, name,
                     [eps](onnx::NodeProto& n) {
                       OnnxGraph::attribute(n, "axis", int64_t{-1});
                       OnnxGraph::attribute(n, "epsilon", eps);
                     });
    // Opset 13: (x - mean) / sqrt(var + eps) * gamma + beta, spelled out.
    auto last_axis = [](onnx::NodeProto& n) { OnnxGraph::attribute(n, "axes", std::vector<int64_t>{-1}); };
    const std::string mean = g_.node("ReduceMean", {x}, name + ".mean", last_axis);
    const std::string centred = g_.node("Sub", {x, mean}, name + ".centred");
    const std::string square = g_.node("Mul", {centred, centred}, name + ".square");
    const std::string var = g_.node("ReduceMean", {square}, name + ".variance", last_axis);
    const std::string std =
        g_.node("Sqrt", {g_.node("Add", {var, scalar(name + ".epsilon", eps)}, name + ".variance_eps")}, name + ".std");
    const std::string normed = g_.node("Div", {centred, std}, name + ".normalized");
    return g_.node("Add", {g_.node("Mul", {normed, param(name + ".weight")}, name + ".scaled"), param(name + ".bias")},
                   name);
  }

  // GELU, erf form: 0.5 x (1 + erf(x / sqrt(2))).
  std::string gelu(const std::string& name, const std::string& x) {
    const std::string e = g_.node(
        "Erf", {g_.node("Mul", {x, scalar("gelu.inv_sqrt2", 0.70710678118654752f)}, name + ".scaled")}, name + ".erf");
    const std::string one_plus = g_.node("Add", {e, scalar("gelu.one", 1.0f)}, name + ".one_plus_erf");
    return g_.node("Mul", {g_.node("Mul", {x, scalar("gelu.half", 0.5f)}, name + ".half_x"), one_plus}, name);
  }

  // ---- modules

  std::string embeddings() {
    const std::string p = "bert.embeddings.";
    const std::string words =
        g_.node("Gather", {param(p + "word_embeddings.weight"), "input_ids"}, p + "word_embeddings");
    // Positions 0..T-1 from the input's runtime length.
    const std::string shape = g_.node("Shape", {"input_ids"}, p + "input_shape");
    const std::string length =
        g_.node("Gather", {shape, g_.int64s(p + "sequence_axis", {1}, {})}, p + "sequence_length");
    const std::string positions =
        g_.node("Range", {g_.int64s(p + "zero", {0}, {}), length, g_.int64s(p + "one", {1}, {})}, p + "position_ids");
    const std::string pos =
        g_.node("Gather", {param(p + "position_embeddings.weight"), positions}, p + "position_embeddings");
    const std::string types =
        g_.node("Gather", {param(p + "token_type_embeddings.weight"), "token_type_ids"}, p + "token_type_embeddings");
    const std::string sum =
        g_.node("Add", {g_.node("Add", {words, pos}, p + "words_plus_positions"), types}, p + "sum");
    return layer_norm(p + "LayerNorm", sum);
  }

  // (1 - mask) * -10000 as [B, 1, 1, T], added to every head's scores.
  std::string additive_mask() {
    const std::string p = "bert.attention_mask.";
    const std::string f = g_.node("Cast", {"attention_mask"}, p + "float",
                                  [](onnx::NodeProto& n) { OnnxGraph::attribute(n, "to", int64_t{kFloat}); });
    const std::string inverted = g_.node("Sub", {scalar(p + "one", 1.0f), f}, p + "inverted");
    const std::string additive = g_.node("Mul", {inverted, scalar(p + "large_negative", -10000.0f)}, p + "additive");
    return g_.node("Unsqueeze", {additive, ints(p + "axes", {1, 2})}, p + "broadcast");
  }

  std::string layer(int64_t i, const std::string& x, const std::string& mask) {
    const std::string p = "bert.encoder.layer." + std::to_string(i) + ".";
    const int64_t h = c_.num_attention_heads, d = c_.head_size();
    const std::string heads_shape = ints("bert.encoder.heads_shape", {0, 0, h, d});
    // Q, K and V read x through one quantizer: a Q/DQ pair each (rule 10) on one scale initializer, so
    // TensorRT can fuse the three GEMMs into one.
    auto heads = [&](const std::string& proj, std::vector<int64_t> perm) {
      const std::string input = qdq(x, p + "attention.self.input_quantizer", proj);
      const std::string y = linear(p + "attention.self." + proj, input, true, "", Input::kQuantized);
      const std::string r = g_.node("Reshape", {y, heads_shape}, p + "attention.self." + proj + ".heads");
      return g_.node("Transpose", {r}, p + "attention.self." + proj + ".transposed",
                     [perm](onnx::NodeProto& n) { OnnxGraph::attribute(n, "perm", perm); });
    };
    const std::string q = qdq(heads("query", {0, 2, 1, 3}), p + "attention.self.matmul_q_input_quantizer");
    const std::string kt = qdq(heads("key", {0, 2, 3, 1}), p + "attention.self.matmul_k_input_quantizer");  // K^T
    const std::string v = qdq(heads("value", {0, 2, 1, 3}), p + "attention.self.matmul_v_input_quantizer");
    const std::string scores = g_.node("MatMul", {q, kt}, p + "attention.self.scores");
    const std::string scaled =
        g_.node("Mul", {scores, scalar("bert.encoder.attention_scale", 1.0f / std::sqrt(float(d)))},
                p + "attention.self.scaled_scores");
    const std::string masked = g_.node("Add", {scaled, mask}, p + "attention.self.masked_scores");
    const std::string probs = g_.node("Softmax", {masked}, p + "attention.self.probs",
                                      [](onnx::NodeProto& n) { OnnxGraph::attribute(n, "axis", int64_t{-1}); });
    // The output projection's input pair sits right after P V (before the heads are merged: the same
    // values), where TensorRT's fused INT8 attention expects a Q/DQ.
    const std::string context = qdq(
        g_.node("MatMul", {qdq(probs, p + "attention.self.matmul_a_input_quantizer"), v}, p + "attention.self.context"),
        p + "attention.output.dense.input_quantizer");
    const std::string merged = g_.node("Reshape",
                                       {g_.node("Transpose", {context}, p + "attention.self.context_transposed",
                                                [](onnx::NodeProto& n) {
                                                  OnnxGraph::attribute(n, "perm", std::vector<int64_t>{0, 2, 1, 3});
                                                }),
                                        ints("bert.encoder.merge_shape", {0, 0, h * d})},
                                       p + "attention.self.context_merged");
    const std::string out = linear(p + "attention.output.dense", merged, true, "", Input::kQuantized);
    const std::string residual = g_.node(
        "Add",
        {qdq(out, p + "attention.output.add_input_quantizer"), qdq(x, p + "attention.output.add_residual_quantizer")},
        p + "attention.output.residual");
    const std::string a = layer_norm(p + "attention.output.LayerNorm", residual);
    const std::string inter = gelu(p + "intermediate.gelu", linear(p + "intermediate.dense", a));
    const std::string ff = linear(p + "output.dense", inter);
    const std::string res2 =
        g_.node("Add", {qdq(ff, p + "output.add_input_quantizer"), qdq(a, p + "output.add_residual_quantizer")},
                p + "output.residual");
    return layer_norm(p + "output.LayerNorm", res2);
  }

  void prediction_head(std::string x) {
    const std::string p = "cls.predictions.";
    if (options_.masked_positions) {  // [B, T, C] -> [B, P, C] at the given positions
      const std::string index =
          g_.node("Unsqueeze", {"masked_lm_positions", ints(p + "last_axis", {-1})}, p + "position_index");
      x = g_.node("GatherND", {x, index}, p + "masked_states",
                  [](onnx::NodeProto& n) { OnnxGraph::attribute(n, "batch_dims", int64_t{1}); });
    }
    const std::string t =
        layer_norm(p + "transform.LayerNorm", gelu(p + "transform.gelu", linear(p + "transform.dense", x)));
    // The decoder is tied to the word embeddings [V, C]: Gemm with transB on the flattened hidden states
    // reuses that initializer instead of storing a transposed copy.
    const std::string flat = g_.node("Reshape", {t, ints(p + "flat_shape", {-1, c_.hidden_size})}, p + "flat");
    const std::string logits =
        g_.node("Gemm", {flat, param("bert.embeddings.word_embeddings.weight"), param(p + "bias")}, p + "decoder",
                [](onnx::NodeProto& n) { OnnxGraph::attribute(n, "transB", int64_t{1}); });
    const std::string shape =
        g_.node("Concat",
                {g_.node("Shape", {options_.masked_positions ? "masked_lm_positions" : "input_ids"}, p + "input_shape"),
                 ints(p + "vocab", {c_.vocab_size})},
                p + "logits_shape", [](onnx::NodeProto& n) { OnnxGraph::attribute(n, "axis", int64_t{0}); });
    g_.node("Reshape", {logits, shape}, "prediction_logits");
    g_.output("prediction_logits", kFloat,
              {"batch", options_.masked_positions ? "predictions" : "sequence", c_.vocab_size});
  }

  // tanh(pooler(hidden state of [CLS])): [B, C].
  std::string pooled(const std::string& x) {
    const std::string cls =
        g_.node("Gather", {x, g_.int64s("bert.pooler.first_token", {0}, {})}, "bert.pooler.first_token_state",
                [](onnx::NodeProto& n) { OnnxGraph::attribute(n, "axis", int64_t{1}); });
    return g_.node("Tanh", {linear("bert.pooler.dense", cls)}, "bert.pooler.activation");
  }

  // BertForQuestionAnswering's outputs: qa_outputs on every token, its two columns as start_logits and
  // end_logits (batch, sequence), Hugging Face's names.
  void answer_head(const std::string& x) {
    const std::string logits = linear("qa_outputs", x, /*quantizable=*/false, "qa_logits");
    for (const auto& [column, output] : {std::pair{int64_t{0}, "start_logits"}, std::pair{int64_t{1}, "end_logits"}}) {
      const std::string index = std::string(output) + ".column";
      if (!emitted_.count(index)) {
        g_.int64s(index, {column}, {});
        emitted_.insert(index);
      }
      g_.node("Gather", {logits, index}, output,
              [](onnx::NodeProto& n) { OnnxGraph::attribute(n, "axis", int64_t{2}); });
      g_.output(output, kFloat, {"batch", "sequence"});
    }
  }

  void nsp_head(const std::string& x) {
    linear("cls.seq_relationship", pooled(x), /*quantizable=*/false, "seq_relationship_logits");
    g_.output("seq_relationship_logits", kFloat, {"batch", 2});
  }

  model::Bert& model_;
  ParameterArena<float>& params_;
  const model::BertConfig& c_;
  const ExportOptions& options_;
  OnnxGraph g_;
  std::map<std::string, model::Quantizer*> quantizers_;
  std::set<std::string> emitted_;
};

}  // namespace

onnx::ModelProto export_bert(model::Bert& model, const ExportOptions& options) {
  options.validate();
  if (options.masked_positions && model.config().head != model::Head::kPretraining)
    throw UserError("--masked-positions: a " + model::head_architecture(model.config().head) +
                    " has no masked-LM head (its output is logits)");
  onnx::ModelProto m;
  m.set_ir_version(options.opset >= 17 ? 8 : 7);
  m.set_producer_name("bert-qat");
  m.set_producer_version("0.1.0");
  m.set_model_version(1);
  onnx::OperatorSetIdProto* opset = m.add_opset_import();
  opset->set_domain("");
  opset->set_version(options.opset);
  onnx::GraphProto* graph = m.mutable_graph();
  graph->set_name(options.qdq ? "bert_for_pretraining_qdq" : "bert_for_pretraining");
  BertEmitter(model, options, graph).emit();
  if (options.metadata.is_object()) {
    for (const auto& [key, value] : options.metadata.as_object()) {
      onnx::StringStringEntryProto* e = m.add_metadata_props();
      e->set_key(key);
      e->set_value(value.is_string() ? value.as_string() : value.dump());
    }
  }
  return m;
}

void check_onnx(const onnx::ModelProto& model) {
  onnx::ModelProto copy = model;
  try {
    onnx::checker::check_model(copy);
    onnx::shape_inference::InferShapes(copy, onnx::OpSchemaRegistry::Instance(),
                                       {/*check_type=*/true, /*error_mode=*/1});
  } catch (const std::exception& e) {
    throw UserError(std::string("the ONNX checker rejected the model: ") + e.what());
  }
}

void write_onnx(const onnx::ModelProto& model, const std::string& path) {
  AtomicFile file(path);
  {
    std::ofstream out(file.temp_path(), std::ios::binary);
    if (!out) throw UserError("cannot create '" + file.temp_path() + "' (" + std::strerror(errno) + ")");
    if (!model.SerializeToOstream(&out) || !out.flush())
      throw UserError("cannot write '" + path + "' (disk full?); any previous file was left unchanged");
  }
  file.commit();
}

onnx::ModelProto read_onnx(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UserError("cannot read ONNX model '" + path + "'");
  onnx::ModelProto m;
  if (!m.ParseFromIstream(&in)) throw UserError("'" + path + "' is not an ONNX model (protobuf parse failed)");
  return m;
}

}  // namespace bert::exporter
