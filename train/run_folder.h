// The run folder (--out) and where a run starts: its files, the model config it trains, the state it
// starts from (a resumed checkpoint; fresh or --init-from weights, calibrated for QAT), the metrics log
// kept up to a step on resume, and numbered checkpoints.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/rng.h"
#include "data/loader.h"
#include "model/bert.h"
#include "store/checkpoint.h"
#include "train/optimizer.h"
#include "train/options.h"

namespace bert::train {

// Where a run keeps its files (the tokenizer's copy: tokenizer::copy_tokenizer).
struct RunFiles {
  std::string checkpoint, metrics;
  std::string best_checkpoint, best_record;  // --keep-best: checkpoint-best.h5, best.json
  explicit RunFiles(const TrainOptions& o)
      : checkpoint((std::filesystem::path(o.output_dir) / "checkpoint.h5").string()),
        metrics((std::filesystem::path(o.output_dir) / "metrics.jsonl").string()),
        best_checkpoint((std::filesystem::path(o.output_dir) / "checkpoint-best.h5").string()),
        best_record((std::filesystem::path(o.output_dir) / "best.json").string()) {}
};

// Keeps metrics.jsonl lines up to `step` (used on resume: later lines belong to the interrupted run).
void truncate_metrics(const std::string& path, int64_t step);

// checkpoint.h5 is always the newest; with keep > 1 the last `keep` saves also stay as
// checkpoint-<step>.h5 (hard links where possible, so they cost no space until superseded).
void keep_numbered_checkpoints(const std::string& output_dir, const std::string& latest, int64_t step, int64_t keep);

// The first labels of a list, for messages ("a, b, c, ... (40)").
std::string label_list(const std::vector<std::string>& labels);

// The model config of the run: the checkpoint's on --resume, --init-from's (with this run's dropout), or
// the given one; with the vocabulary of the tokenizer and the head and labels of the training shards.
model::BertConfig resolve_config(const TrainOptions& o, const RunFiles& files, const data::ShardLoader& loader);

// What a run is, as start_state() reads it: its options and files, the model config, the loader's
// options, the device, and whether this process writes the run folder (the lead rank).
struct RunSetup {
  const TrainOptions& options;
  const RunFiles& files;
  const model::BertConfig& config;
  const data::LoaderOptions& loader_options;
  const Device& device;
  bool writes;
};
// What start_state() sets: the weights, the optimizer's moments, the data order and the dropout stream.
struct RunPieces {
  model::Bert& model;
  Optimizer& optimizer;
  data::ShardLoader& loader;
  Rng& dropout_rng;
};

// The state training starts from: the checkpoint's on --resume (weights, moments, data order, dropout
// RNG), else fresh weights or --init-from's, calibrated for QAT; the run folder gets its tokenizer copy,
// config.json and an empty metrics log.
store::TrainingState start_state(const RunSetup& run, const RunPieces& pieces);

}  // namespace bert::train
