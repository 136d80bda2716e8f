// One optimizer step of training: the forward and backward passes over its micro-batches (on several
// ranks, gradients averaged in buckets during the last backward pass), the gradients' global norm, and
// the update with clipping folded into it. What bert-train runs each step and what train-step-bench
// times. The run around it (train/trainer.cpp) decides what a non-finite step means.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/batch.h"
#include "core/graph.h"
#include "core/readback.h"
#include "core/rng.h"
#include "core/step_graph.h"
#include "eval/output_reads.h"
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
  // With one micro-batch a step on one rank, the model's forward keeps activations in the gradients of the
  // layers it is past (model::Bert::set_lend_gradients): the gradients are zeroed before each step's one
  // forward pass, which is all the lending asks.
  TrainingStep(const TrainOptions& o, Parts parts) : o_(o), p_(parts) {
    p_.model.set_lend_gradients(o.accumulation == 1 && p_.ranks.size() == 1);
  }

  struct Outcome {
    double loss = 0;        // the logged loss (mean over micro-batches and ranks)
    std::string nonfinite;  // what went non-finite on any rank (loss or gradient norm); empty when nothing did
    bool stop_requested = false;
    double grad_norm = 0;  // before clipping
    bool updated = false;  // the optimizer stepped (nothing went non-finite)
  };
  // Zeroes the gradients, runs o.accumulation micro-batches (each filled by next_batch: the first into
  // `batch`, each later one into a copy of the one before it; the progress window gets each one's metrics) and, when the loss and the gradient norm are finite, the
  // update at learning rate lr. A non-finite step leaves the weights and moments as they were (and the
  // gradients as the passes made them, for the caller's message). Every micro-batch runs even after a
  // non-finite loss, so each rank does the same work. `log_buckets`: log the gradient buckets (first step).
  // On several GPU ranks the host waits for the device once a step: the losses and predictions are read
  // back after the backward pass and the gradient norm have been queued, then the update is queued. On
  // one GPU the update is queued with the rest (see queue()), and run() waits for the step's end.
  Outcome run(Graph<float>& g, Batch& batch, const std::function<void(Batch&)>& next_batch, double lr,
              ProgressWindow& window, bool log_buckets = false);

  // run() in two halves, so that the next step can be queued before this one's outcome is known. Where
  // pipelined() (one rank on a GPU), queue() queues the whole step, the update included, with the decision
  // to update or skip it and the clipping left to the GPU (Optimizer::queue_step): the host never waits
  // inside a step, and while the GPU runs step n the host queues step n + 1, then finish()es step n (its
  // losses, metrics and norm; the window gets them then). At most two steps are queued at once. Elsewhere
  // queue() runs the step as run() does and finish() returns its outcome. A non-finite step is skipped on
  // the GPU as run() skips it; when its message is made the next step may have run already, and the
  // weights or gradients it names are then that step's.
  bool pipelined() const;
  void queue(Graph<float>& g, Batch& batch, const std::function<void(Batch&)>& next_batch, double lr,
             ProgressWindow& window, bool log_buckets = false);
  Outcome finish(ProgressWindow& window);  // the oldest queued step's
  std::size_t queued() const { return queued_.size(); }
  // The pipelined steps recorded and launched as CUDA graphs (TrainOptions::cuda_graphs), and how many of
  // them made a new executable graph (the first, and each of a new shape).
  const StepGraph& graphs() const { return graph_; }

 private:
  // What one micro-batch's forward pass queued for reading back, and what the host kept of its batch.
  struct MicroBatchReads {
    const float* logged = nullptr;     // the logged loss
    const float* objective = nullptr;  // distillation: the objective (else the logged loss)
    eval::OutputReads outputs;         // the losses and predictions the metrics need
  };
  MicroBatchReads queue_reads(Readback& rb, const Graph<float>& g, const model::ModelOutputs& out, Var objective,
                              Var logged, const BatchView& b);
  // After the wait: adds a micro-batch's loss and metrics, or notes what went non-finite.
  void take_reads(const MicroBatchReads& r, Outcome& outcome, ProgressWindow& window);

  // A queued step: its reads, or (not pipelined) its outcome already known.
  struct Queued {
    std::unique_ptr<Readback> reads;
    std::vector<MicroBatchReads> pending;
    const double* sum_of_squares = nullptr;  // pipelined: the gradients' sum of squares, read back
    bool finished = false;
    Outcome outcome;
  };
  // A micro-batch's forward pass: the model on `batch`, the objective and the reads queued into rb (pending
  // gets them). scaled: the objective divided by the number of micro-batches.
  struct Losses {
    Var objective, logged, scaled;
  };
  Losses forward_pass(Graph<float>& g, const Batch& batch, Readback& rb, std::vector<MicroBatchReads>& pending);
  // Whether a pipelined step is recorded as a CUDA graph, given the shapes (batch, length, predictions) of its
  // micro-batches: with TrainOptions::cuda_graphs, as StepGraph::schedule says; never while `g` times its ops
  // (Graph::set_profile).
  bool record_this_step(const Graph<float>& g, const std::vector<int64_t>& shapes);
  // The whole step with the host deciding on the update (one wait a step): run()'s path where not pipelined.
  Outcome run_synchronous(Queued& q, Graph<float>& g, Batch& batch, const std::function<void(Batch&)>& next_batch,
                          double lr, ProgressWindow& window, bool log_buckets);
  // What a non-finite gradient norm says: the first parameter with a non-finite gradient.
  std::string nonfinite_norm(double norm);

  const TrainOptions& o_;
  Parts p_;
  std::deque<Queued> queued_;
  std::vector<std::unique_ptr<Readback>> spare_reads_;  // on the graph's device, reused
  StepGraph graph_;                                     // pipelined steps as CUDA graphs (record_this_step)
  std::vector<Batch> later_batches_;                    // micro-batches after the first (pipelined steps)
};

}  // namespace bert::train
