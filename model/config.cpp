#include "model/config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "sys/error.h"
#include "sys/text_file.h"

namespace bert::model {

std::string head_architecture(Head head) {
  switch (head) {
    case Head::kSequenceClassification:
      return "BertForSequenceClassification";
    case Head::kTokenClassification:
      return "BertForTokenClassification";
    case Head::kQuestionAnswering:
      return "BertForQuestionAnswering";
    default:
      return "BertForPreTraining";
  }
}

std::string head_task_name(Head head) { return kHeadTaskNames.name(head); }

std::string parse_task(const std::string& name) {
  if (name != "seq-cls" && name != "token-cls" && name != "qa" && name != "seq-reg")
    throw UserError("--task '" + name + "': expected seq-cls, token-cls, qa or seq-reg");
  return name;
}

std::string weight_scales_name(WeightScales w) { return kWeightScalesNames.name(w); }

WeightScales parse_weight_scales(const std::string& name, const std::string& what) {
  return kWeightScalesNames.parse(name, what);
}

void BertConfig::validate() const {
  auto need = [](bool ok, const std::string& what) {
    if (!ok) throw UserError("invalid model config: " + what);
  };
  need(vocab_size >= 8, "vocab_size " + std::to_string(vocab_size) + " must be at least 8");
  need(hidden_size >= 2, "hidden_size " + std::to_string(hidden_size) + " must be at least 2");
  need(num_hidden_layers >= 1, "num_hidden_layers must be at least 1");
  need(num_attention_heads >= 1, "num_attention_heads must be at least 1");
  need(hidden_size % num_attention_heads == 0, "hidden_size " + std::to_string(hidden_size) +
                                                   " is not divisible by num_attention_heads " +
                                                   std::to_string(num_attention_heads));
  need(intermediate_size >= 1, "intermediate_size must be at least 1");
  need(max_position_embeddings >= 2, "max_position_embeddings must be at least 2");
  need(type_vocab_size >= 2, "type_vocab_size must be at least 2 (segments A and B)");
  need(hidden_act == "gelu", "hidden_act '" + hidden_act + "' is not supported (only 'gelu', the erf form)");
  need(layer_norm_eps > 0 && std::isfinite(layer_norm_eps), "layer_norm_eps must be positive");
  need(hidden_dropout_prob >= 0 && hidden_dropout_prob < 1, "hidden_dropout_prob must be in [0, 1)");
  need(attention_probs_dropout_prob >= 0 && attention_probs_dropout_prob < 1,
       "attention_probs_dropout_prob must be in [0, 1)");
  need(initializer_range > 0 && std::isfinite(initializer_range), "initializer_range must be positive");
  need(pad_token_id >= 0 && pad_token_id < vocab_size, "pad_token_id must lie inside the vocabulary");
  if (head == Head::kSequenceClassification)
    need(num_labels() >= 1, "a BertForSequenceClassification needs at least 1 label (1: a regression)");
  else if (head != Head::kPretraining)
    need(num_labels() >= 2, head_architecture(head) + " needs at least 2 labels");
  if (head == Head::kQuestionAnswering)
    need(num_labels() == 2,
         "a BertForQuestionAnswering has 2 outputs (start, end), not " + std::to_string(num_labels()) + " labels");
  need(classifier_dropout < 1, "classifier_dropout must be below 1");
}

Json BertConfig::to_json() const {
  Json j;
  j["model_type"] = "bert";
  j["architectures"] = Json::Array{Json(head_architecture(head))};
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["intermediate_size"] = intermediate_size;
  j["max_position_embeddings"] = max_position_embeddings;
  j["type_vocab_size"] = type_vocab_size;
  j["hidden_act"] = hidden_act;
  j["layer_norm_eps"] = layer_norm_eps;
  j["hidden_dropout_prob"] = hidden_dropout_prob;
  j["attention_probs_dropout_prob"] = attention_probs_dropout_prob;
  j["initializer_range"] = initializer_range;
  j["pad_token_id"] = pad_token_id;
  if (head != Head::kPretraining) {
    Json id2label, label2id;
    for (size_t i = 0; i < labels.size(); ++i) {
      id2label[std::to_string(i)] = labels[i];
      label2id[labels[i]] = static_cast<int64_t>(i);
    }
    j["id2label"] = id2label;
    j["label2id"] = label2id;
    if (regression()) j["problem_type"] = "regression";
    if (classifier_dropout >= 0) j["classifier_dropout"] = classifier_dropout;
  }
  if (weight_scales != WeightScales::kPerChannel) j["weight_quantization"] = weight_scales_name(weight_scales);
  return j;
}

BertConfig BertConfig::from_json(const Json& j) {
  if (!j.is_object()) throw UserError("model config must be a JSON object");
  BertConfig c;
  auto integer = [&](const char* key, int64_t& field) {
    if (const Json* v = j.find(key)) {
      if (!v->is_number()) throw UserError(std::string("model config field '") + key + "' must be a number");
      try {
        field = v->as_int();
      } catch (const UserError&) {
        throw UserError(std::string("model config field '") + key + "' must be an integer");
      }
    }
  };
  auto real = [&](const char* key, double& field) {
    if (const Json* v = j.find(key)) {
      if (!v->is_number()) throw UserError(std::string("model config field '") + key + "' must be a number");
      field = v->as_number();
    }
  };
  integer("vocab_size", c.vocab_size);
  integer("hidden_size", c.hidden_size);
  integer("num_hidden_layers", c.num_hidden_layers);
  integer("num_attention_heads", c.num_attention_heads);
  integer("intermediate_size", c.intermediate_size);
  integer("max_position_embeddings", c.max_position_embeddings);
  integer("type_vocab_size", c.type_vocab_size);
  integer("pad_token_id", c.pad_token_id);
  if (const Json* v = j.find("hidden_act")) {
    if (!v->is_string()) throw UserError("model config field 'hidden_act' must be a string");
    c.hidden_act = v->as_string();
  }
  real("layer_norm_eps", c.layer_norm_eps);
  real("hidden_dropout_prob", c.hidden_dropout_prob);
  real("attention_probs_dropout_prob", c.attention_probs_dropout_prob);
  real("initializer_range", c.initializer_range);
  if (const Json* v = j.find("classifier_dropout"); v && !v->is_null())
    real("classifier_dropout", c.classifier_dropout);
  if (const Json* v = j.find("weight_quantization")) {
    if (!v->is_string()) throw UserError("model config field 'weight_quantization' must be a string");
    c.weight_scales = parse_weight_scales(v->as_string(), "model config field 'weight_quantization'");
  }
  if (const Json* a = j.find("architectures"); a && a->is_array() && !a->as_array().empty()) {
    const std::string name = a->as_array().front().is_string() ? a->as_array().front().as_string() : "";
    if (name == "BertForSequenceClassification")
      c.head = Head::kSequenceClassification;
    else if (name == "BertForTokenClassification")
      c.head = Head::kTokenClassification;
    else if (name == "BertForQuestionAnswering")
      c.head = Head::kQuestionAnswering;
    else if (name != "BertForPreTraining" && name != "BertForMaskedLM" && name != "BertModel" &&
             name != "BertLMHeadModel")
      throw UserError("architecture '" + name +
                      "' is not supported (BertForPreTraining, BertForMaskedLM, BertModel, "
                      "BertForSequenceClassification, BertForTokenClassification or BertForQuestionAnswering)");
  }
  if (c.head == Head::kQuestionAnswering && !j.find("id2label")) {
    c.labels = {"start", "end"};  // Hugging Face's default num_labels, 2
  } else if (c.head != Head::kPretraining) {
    const Json* id2label = j.find("id2label");
    if (!id2label || !id2label->is_object())
      throw UserError("model config of a " + head_architecture(c.head) + " needs 'id2label'");
    c.labels.assign(id2label->as_object().size(), "");
    for (const auto& [key, value] : id2label->as_object()) {
      size_t used = 0;
      int64_t id = -1;
      try {
        id = std::stoll(key, &used);
      } catch (const std::exception&) {
      }
      if (used != key.size() || id < 0 || id >= c.num_labels() || !value.is_string() || !c.labels[id].empty())
        throw UserError("model config: id2label must map 0.." + std::to_string(c.num_labels() - 1) +
                        " to label names (found key '" + key + "')");
      c.labels[id] = value.as_string();
    }
  }
  if (const Json* v = j.find("problem_type"); v && !v->is_null() && c.head == Head::kSequenceClassification) {
    const std::string type = v->is_string() ? v->as_string() : "";
    if (type == "regression" && c.num_labels() != 1)
      throw UserError("model config: a regression with " + std::to_string(c.num_labels()) +
                      " outputs is not supported (one score per sequence)");
    if (type == "single_label_classification" && c.num_labels() == 1)
      throw UserError("model config: a single-label classification needs at least 2 labels (1 is a regression)");
    if (type != "regression" && type != "single_label_classification")
      throw UserError("model config: problem_type '" + type +
                      "' is not supported (single_label_classification, or regression with one output)");
  }
  c.validate();
  return c;
}

BertConfig BertConfig::load(const std::string& path) {
  const std::string text = read_text_file(path, "model config");
  try {
    return from_json(Json::parse(text));
  } catch (const UserError& e) {
    throw UserError("model config '" + path + "': " + e.what());
  }
}

BertConfig preset(const std::string& name) {
  struct Size {
    const char* name;
    int64_t layers, hidden;
  };
  static const Size sizes[] = {{"tiny", 2, 128},   {"mini", 4, 256},  {"small", 4, 512},
                               {"medium", 8, 512}, {"base", 12, 768}, {"large", 24, 1024}};
  for (const Size& s : sizes) {
    if (name != s.name) continue;
    BertConfig c;
    c.num_hidden_layers = s.layers;
    c.hidden_size = s.hidden;
    c.num_attention_heads = std::max<int64_t>(2, s.hidden / 64);
    c.intermediate_size = 4 * s.hidden;
    return c;
  }
  throw UserError("unknown model preset '" + name + "': expected tiny, mini, small, medium, base or large");
}

}  // namespace bert::model
