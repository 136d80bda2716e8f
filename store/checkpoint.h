// Checkpoints in HDF5: model parameters under Hugging Face state-dict names (/model/<name>), the
// optimizer's moments (/optimizer/exp_avg/<name>, /optimizer/exp_avg_sq/<name>) and, as root
// attributes, everything a resumed run needs: step, RNG and loader state, config, tokenizer hash and
// the run's options. Written atomically: a failed write leaves the previous checkpoint intact.
#pragma once

#include <string>
#include <vector>

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

// Everything a checkpoint file holds, copied out of the model and the optimizer, so that the file can be
// written from it on another thread while they change (train::CheckpointWriter).
struct CheckpointSnapshot {
  std::vector<std::string> names;  // the parameters', in the arena's order
  std::vector<Shape> shapes;
  std::vector<int64_t> offsets;      // of each parameter in `values` (and in the moments)
  std::vector<float> values;         // the whole arena
  std::vector<float> first, second;  // the optimizer's moments, laid out as `values`; empty: model only
  std::string optimizer_name;        // empty: model only
  int64_t optimizer_steps = 0;
  std::string config;  // the model config, JSON
  std::vector<std::string> quantizers_enabled;
  TrainingState state;
};
// The snapshot of `model` (its host values) and `optimizer` (null: a model-only checkpoint, which cannot
// resume training) with `state`, into `into`, whose buffers are reused: a run that takes one snapshot after
// another allocates (and the kernel maps) the gigabytes of BERT-base's once.
void snapshot_checkpoint(model::Bert& model, const OptimizerMoments* optimizer, const TrainingState& state,
                         CheckpointSnapshot& into);
// Writes `snapshot` to `path` atomically (a temporary file, flushed to disk, then renamed over `path`): a
// failed write (UserError naming the path) leaves the previous file as it was.
void write_checkpoint(const std::string& path, const CheckpointSnapshot& snapshot);
// write_checkpoint(path, snapshot_checkpoint(model, optimizer, state)).
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
