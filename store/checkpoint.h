// Checkpoints in HDF5: model parameters under Hugging Face state-dict names (/model/<name>), the
// optimizer's moments (/optimizer/exp_avg/<name>, /optimizer/exp_avg_sq/<name>) and, as root
// attributes, everything a resumed run needs: step, RNG and loader state, config, tokenizer hash and
// the run's options. Written atomically: a failed write leaves the previous checkpoint intact.
#pragma once

#include <string>

#include "core/rng.h"
#include "data/loader.h"
#include "model/bert.h"
#include "sys/json.h"

namespace bert::store {

struct TrainingState {
  int64_t step = 0;
  Rng::State dropout_rng;
  data::ShardLoader::State loader;
  std::string tokenizer_sha256;
  Json run;           // the options the run was started with
  Json quantization;  // the quantization recipe (calibrator, QAT steps, ...); null for FP32
  // Loading into a model with another head (fine-tuning from a pretraining checkpoint): the head
  // parameters the checkpoint lacked, which kept their initialisation.
  std::vector<std::string> fresh_parameters;
};

// An optimizer's state as a checkpoint holds it: its name ("adamw", "lamb"), update count and two
// moment buffers in host memory, laid out like the model's parameter arena.
struct OptimizerMoments {
  std::string name;
  int64_t steps = 0;
  float* first = nullptr;
  float* second = nullptr;
};

// `optimizer` null: a model-only checkpoint (it cannot resume training).
void save_checkpoint(const std::string& path, model::Bert& model, const OptimizerMoments* optimizer,
                     const TrainingState& state);

// The model config a checkpoint was made with (to build the model before loading into it).
model::BertConfig read_checkpoint_config(const std::string& path);
// The options of the run that wrote the checkpoint (TrainingState::run; an empty object when it has none).
Json read_checkpoint_run(const std::string& path);

// Loads every parameter (each must be present with its shape; UserError naming the tensor otherwise)
// and, when `optimizer` is given, the moments into its buffers and its step count (the checkpoint's
// optimizer must have its name). A checkpoint of another head (config
// "architectures") may lack the model's head parameters: those keep their values (initialise the model
// first) and are listed in fresh_parameters; tensors and quantizers of the other head are ignored. The names of the
// quantizers that were enabled are stored too: they come back in kQuantize mode, every other quantizer in kFloat.
// Quantizer scales may be absent (an FP32 checkpoint): they keep their placeholder value.
TrainingState load_checkpoint(const std::string& path, model::Bert& model, OptimizerMoments* optimizer);

}  // namespace bert::store
