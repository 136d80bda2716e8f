// Where a model comes from, for every tool: a checkpoint .h5 (ours), a run's output folder (its
// checkpoint.h5), or a Hugging Face model directory (config.json + model.safetensors, see hf/).
#pragma once

#include <memory>
#include <string>

#include "model/bert.h"
#include "store/checkpoint.h"

namespace bert::store {

struct ModelSource {
  std::string path;  // the checkpoint file, or the Hugging Face directory
  bool hugging_face = false;
  std::string tokenizer;  // the tokenizer shipped beside it ("" if none): vocab.txt or tokenizer.model
};

// Resolves `path`; throws UserError naming it when it is none of the three.
ModelSource find_model(const std::string& path);

model::BertConfig read_model_config(const ModelSource& source);

// Loads the weights (and, for our checkpoints, the quantizer state) into `model`, built from
// read_model_config. For a Hugging Face directory the state has step 0, the SHA-256 of the
// directory's vocab.txt as tokenizer hash, and the quantization recipe if the export recorded one;
// import warnings (fresh heads, unused tensors) are logged.
TrainingState load_model(const ModelSource& source, model::Bert& model, uint64_t init_seed = 1);

// find_model + read_model_config + load_model.
std::unique_ptr<model::Bert> open_model(const std::string& path, ModelSource* source, TrainingState* state);

}  // namespace bert::store
