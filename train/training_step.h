// One optimizer step of training: the forward and backward passes over its micro-batches (on several
// ranks, gradients averaged in buckets during the last backward pass), the gradients' global norm, and
// the update with clipping folded into it. What bert-train runs each step and what train-step-bench
// times. The run around it (train/trainer.cpp) decides what a non-finite step means.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/batch.h"
#include "core/graph.h"
#include "core/readback.h"
#include "core/rng.h"
#include "model/bert.h"
#include "train/communicator.h"
#include "train/gradient_reduction.h"
#include "train/optimizer.h"
#include "train/options.h"
#include "train/progress.h"

namespace bert::train {

class TrainingStep {
 public:
  // What a step works on; the caller owns each of them.
  struct Parts {
    model::Bert& model;
    Optimizer& optimizer;
    Rng& dropout_rng;
    Communicator& ranks;
    model::Bert* teacher = nullptr;           // distillation's, or none
    GradientReduction* reduction = nullptr;   // several ranks: averages the gradients
    const std::atomic<bool>* stop = nullptr;  // checked once a step (and agreed on by the ranks)
  };
  // Reads o.accumulation, o.clip_norm and the objective's options (distillation); o must outlive the step.
  TrainingStep(const TrainOptions& o, Parts parts) : o_(o), p_(parts) {}

  struct Outcome {
    double loss = 0;        // the logged loss (mean over micro-batches and ranks)
    std::string nonfinite;  // what went non-finite on any rank (loss or gradient norm); empty when nothing did
    bool stop_requested = false;
    double grad_norm = 0;  // before clipping
    bool updated = false;  // the optimizer stepped (nothing went non-finite)
  };
  // Zeroes the gradients, runs o.accumulation micro-batches (each filled into `batch` by next_batch; the
  // progress window gets each one's metrics) and, when the loss and the gradient norm are finite, the
  // update at learning rate lr. A non-finite step leaves the weights and moments as they were (and the
  // gradients as the passes made them, for the caller's message). Every micro-batch runs even after a
  // non-finite loss, so each rank does the same work. `log_buckets`: log the gradient buckets (first step).
  // On a GPU the host waits for the device once a step (one rank): the losses and predictions are read
  // back after the backward pass and the gradient norm have been queued, then the update is queued.
  Outcome run(Graph<float>& g, Batch& batch, const std::function<void(Batch&)>& next_batch, double lr,
              ProgressWindow& window, bool log_buckets = false);

 private:
  // What one micro-batch's forward pass queued for reading back, and what the host kept of its batch.
  struct MicroBatchReads {
    const float* logged = nullptr;     // the logged loss
    const float* objective = nullptr;  // distillation: the objective (else the logged loss)
    const float *mlm_loss = nullptr, *nsp_loss = nullptr, *task_loss = nullptr;
    const int32_t* mlm_predicted = nullptr;
    const void* head_logits = nullptr;  // NSP logits (B, 2), or the task head's (N, labels)
    DType head_dtype = DType::kF32;
    int64_t head_rows = 0, head_cols = 0;
    std::vector<int32_t> mlm_targets, task_targets;
    std::vector<int8_t> nsp_labels;
  };
  MicroBatchReads queue_reads(const Graph<float>& g, const model::ModelOutputs& out, Var objective, Var logged,
                              const BatchView& b);
  // After the wait: adds a micro-batch's loss and metrics, or notes what went non-finite.
  void take_reads(const MicroBatchReads& r, Outcome& outcome, ProgressWindow& window);

  const TrainOptions& o_;
  Parts p_;
  std::unique_ptr<Readback> reads_;  // on the graph's device, made at the first step
  std::vector<MicroBatchReads> pending_;
};

}  // namespace bert::train
