// BertConfig: the model's hyper-parameters, with Hugging Face BertConfig's field names so config.json
// files move between the two; named presets from the BERT miniatures to base.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sys/enum_names.h"
#include "sys/json.h"

namespace bert::model {

// The head on top of the encoder, with its Hugging Face class name (config.json "architectures"):
// kPretraining = BertForPreTraining (MLM + NSP; BertForMaskedLM and BertModel load as this too),
// kSequenceClassification = BertForSequenceClassification (pooler + dropout + classifier on [CLS]; with one
// label a regression, Hugging Face's problem_type "regression": one score per sequence, mean squared error),
// kTokenClassification = BertForTokenClassification (dropout + classifier on every token, no pooler),
// kQuestionAnswering = BertForQuestionAnswering (qa_outputs on every token: the answer's start and end
// logits; no pooler, no dropout before it).
enum class Head { kPretraining, kSequenceClassification, kTokenClassification, kQuestionAnswering };
std::string head_architecture(Head head);  // the Hugging Face class name
inline constexpr EnumNames<Head, 4> kHeadTaskNames{{{{Head::kPretraining, "pretraining"},
                                                     {Head::kSequenceClassification, "seq-cls"},
                                                     {Head::kTokenClassification, "token-cls"},
                                                     {Head::kQuestionAnswering, "qa"}}}};
std::string head_task_name(Head head);  // "pretraining", "seq-cls", "token-cls", "qa"
// A task given to --task, by the names of bert-data task's shards: "seq-cls" | "token-cls" | "qa" | "seq-reg"
// (a regression); UserError naming --task otherwise.
std::string parse_task(const std::string& name);

// How many scales a weight quantizer has: one per output channel (the default; TensorRT's and
// pytorch-quantization's default for weights) or one for the whole weight (config.json
// "weight_quantization": "per-tensor"). It fixes the shape of every "<linear>.weight_quantizer.scale".
enum class WeightScales { kPerChannel, kPerTensor };
inline constexpr EnumNames<WeightScales, 2> kWeightScalesNames{
    {{{WeightScales::kPerChannel, "per-channel", "one scale per output channel"},
      {WeightScales::kPerTensor, "per-tensor", "one scale per weight"}}}};
std::string weight_scales_name(WeightScales w);  // "per-channel" | "per-tensor"
// "per-channel" | "per-tensor"; UserError naming `what` (a flag or a config field) otherwise.
WeightScales parse_weight_scales(const std::string& name, const std::string& what = "--weights");

struct BertConfig {
  int64_t vocab_size = 16000;
  int64_t hidden_size = 128;
  int64_t num_hidden_layers = 2;
  int64_t num_attention_heads = 2;
  int64_t intermediate_size = 512;
  int64_t max_position_embeddings = 512;
  int64_t type_vocab_size = 2;
  std::string hidden_act = "gelu";  // exact erf GELU (the only activation supported)
  double layer_norm_eps = 1e-12;
  double hidden_dropout_prob = 0.1;
  double attention_probs_dropout_prob = 0.1;
  double initializer_range = 0.02;
  int64_t pad_token_id = 0;
  Head head = Head::kPretraining;
  // Task heads: the name of each label (Hugging Face id2label; num_labels is its size). Question
  // answering: its two outputs, "start" and "end".
  std::vector<std::string> labels;
  // Dropout before a task head's classifier; < 0: hidden_dropout_prob (Hugging Face's null).
  double classifier_dropout = -1;
  // Weight quantizers' scale layout (not a Hugging Face field; written only when per-tensor).
  WeightScales weight_scales = WeightScales::kPerChannel;

  int64_t num_labels() const { return static_cast<int64_t>(labels.size()); }
  // A sequence regression: a BertForSequenceClassification with one output (STS-B, a cross-encoder).
  bool regression() const { return head == Head::kSequenceClassification && num_labels() == 1; }
  // What the model does, by the names of its task shards: head_task_name, or "seq-reg" for a regression.
  std::string task() const { return regression() ? "seq-reg" : head_task_name(head); }
  double head_dropout() const { return classifier_dropout >= 0 ? classifier_dropout : hidden_dropout_prob; }
  int64_t head_size() const { return hidden_size / num_attention_heads; }
  // Throws UserError naming the field and the constraint (e.g. hidden not divisible by heads).
  void validate() const;
  // Hugging Face field names, plus "model_type": "bert", "architectures" and, for task heads,
  // id2label/label2id (and "problem_type": "regression" for a regression).
  Json to_json() const;
  // Unknown fields are ignored (Hugging Face configs carry many); missing ones keep their defaults. An
  // architecture this engine has no head for (e.g. BertForMultipleChoice) is a UserError, as are a
  // problem_type other than single-label classification and one-output regression.
  static BertConfig from_json(const Json& json);
  static BertConfig load(const std::string& path);  // UserError naming the file
};

// tiny (L2/H128), mini (L4/H256), small (L4/H512), medium (L8/H512), base (L12/H768); heads H/64
// (at least 2), intermediate 4H. Throws UserError listing the presets for an unknown name.
BertConfig preset(const std::string& name);

}  // namespace bert::model
