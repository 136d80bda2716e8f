// BertConfig: the model's hyper-parameters, with Hugging Face BertConfig's field names so config.json
// files move between the two; named presets from the BERT miniatures to base.
#pragma once

#include <cstdint>
#include <string>

#include "core/json.h"

namespace bert::model {

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

  int64_t head_size() const { return hidden_size / num_attention_heads; }
  // Throws UserError naming the field and the constraint (e.g. hidden not divisible by heads).
  void validate() const;
  Json to_json() const;  // Hugging Face field names, plus "model_type": "bert"
  // Unknown fields are ignored (Hugging Face configs carry many); missing ones keep their defaults.
  static BertConfig from_json(const Json& json);
  static BertConfig load(const std::string& path);  // UserError naming the file
};

// tiny (L2/H128), mini (L4/H256), small (L4/H512), medium (L8/H512), base (L12/H768); heads H/64
// (at least 2), intermediate 4H. Throws UserError listing the presets for an unknown name.
BertConfig preset(const std::string& name);

}  // namespace bert::model
