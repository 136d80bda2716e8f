// Quantization-aware training and distillation set-up: calibrating the quantizers at the start of QAT,
// how their scales train, the teacher, and the objective a micro-batch minimises.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/device.h"
#include "core/graph.h"
#include "data/loader.h"
#include "model/bert.h"
#include "store/checkpoint.h"
#include "train/optimizer.h"
#include "train/options.h"

namespace bert::train {

// QAT's start: calibrate the quantizers on training batches (another seed than the training order) and
// return the recipe the checkpoint records, with each scale's floor.
Json calibrate_for_qat(const TrainOptions& o, model::Bert& model, const data::LoaderOptions& loader_options,
                       const Device& device);

// Quantizers enabled (calibrated now, or restored from a QAT checkpoint): their scales get their own
// learning rate, log-space or LSQ updates, and the floor recorded at calibration.
std::vector<model::Quantizer*> configure_scales(const TrainOptions& o, model::Bert& model, Optimizer& optimizer,
                                                const store::TrainingState& state);

// The teacher for distillation (--teacher, else the --init-from model), every quantizer in float. Its
// size may differ from the student's; its outputs must mean the same: same head and labels, same
// vocabulary and tokenizer, positions for the training sequences.
std::unique_ptr<model::Bert> make_teacher(const TrainOptions& o, const model::BertConfig& student, int64_t seq_len,
                                          const Device& device);

// The training objective of one micro-batch: the model's loss (its per-prediction part weighted by
// `share`, see prediction_share), mixed with the KL to the teacher's outputs when distilling. Also the
// loss the progress log shows (without the KL, comparable with runs that do not distil).
struct Objective {
  Var objective, logged;
};
Objective objective_of(Graph<float>& g, const model::ModelOutputs& out, model::Bert* teacher, const BatchView& b,
                       const TrainOptions& o, double share);

}  // namespace bert::train
