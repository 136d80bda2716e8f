// Hugging Face model directories in and out: config.json (BertConfig) with weights in
// model.safetensors, or sharded as model.safetensors.index.json + its shards.
//
// Import maps BertForPreTraining state-dict names onto the model (our parameters carry the same
// names): legacy LayerNorm gamma/beta names are accepted, a bare BertModel's names (embeddings.*,
// encoder.*) get the "bert." prefix, the tied decoder (cls.predictions.decoder.*) is checked against
// what it is tied to. Missing heads (cls.*, bert.pooler.*) are freshly initialised and reported;
// anything else missing, or any wrong shape, is an error naming the tensor.
//
// Export writes what transformers' BertForPreTraining.from_pretrained loads: config.json and
// model.safetensors (F32, metadata format=pt). For a quantized model the learned quantizer scales and
// the names of the enabled quantizers go into the safetensors metadata and a side file
// quantization.json; import restores them, so export -> import is bit exact.
#pragma once

#include <string>
#include <vector>

#include "model/bert.h"
#include "sys/json.h"

namespace bert::hf {

// True if `path` is a directory with config.json and model.safetensors or model.safetensors.index.json.
bool is_model_dir(const std::string& path);

// The model config from DIR/config.json. Throws UserError for settings this engine cannot run
// (relative position embeddings, untied decoder, another activation).
model::BertConfig read_config(const std::string& dir);

struct ImportReport {
  std::vector<std::string> files;  // safetensors files read
  int64_t tensors_loaded = 0;
  std::vector<std::string> dtypes;        // distinct dtypes seen, e.g. "BF16"
  std::vector<std::string> legacy_names;  // gamma/beta names mapped to weight/bias
  std::vector<std::string> initialized;   // model parameters absent from the checkpoint (heads)
  std::vector<std::string> unexpected;    // checkpoint tensors the model has no use for
  std::vector<std::string> warnings;      // human-readable, one line each
  Json quantization;                      // recipe stored by export_model (null if none)
  int quantizers_enabled = 0;             // restored in kQuantize mode with their scales
};

// Loads DIR's weights into `model` (built from read_config(DIR)). Parameters the checkpoint lacks
// are initialised with `init_seed` when they belong to a head, else UserError.
ImportReport import_model(const std::string& dir, model::Bert& model, uint64_t init_seed = 1);

// Writes DIR/config.json, DIR/model.safetensors and, when any quantizer is enabled,
// DIR/quantization.json; each file atomically. `quantization` is the recipe to record (may be null).
void export_model(const std::string& dir, model::Bert& model, const Json& quantization);

}  // namespace bert::hf
