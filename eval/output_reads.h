// OutputReads: what the metrics of a forward pass need from its outputs (the losses, the top MLM
// predictions, the NSP or task head's logits), queued on a Readback instead of read at once. The host then
// waits once, after the pass is queued whole (a training step with its backward pass and update, an
// evaluation batch recorded as one CUDA graph: core/step_graph.h), and adds the values to the metrics.
// BatchEvaluator: evaluation batch by batch that way.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/batch.h"
#include "core/graph.h"
#include "core/readback.h"
#include "core/rng.h"
#include "core/step_graph.h"
#include "eval/metrics.h"
#include "model/bert.h"

namespace bert::eval {

struct OutputReads {
  // Queues the reads of `out`, the outputs of the model (with head `head`) on batch `b`; the MLM predictions
  // must be on the device (model::MlmOutputs::kLossAndPredictionsOnDevice or kLogitsAndPredictionsOnDevice).
  static OutputReads queue(Readback& rb, const Graph<float>& g, const model::ModelOutputs& out, const BatchView& b,
                           model::Head head);

  // After the Readback's wait():
  // The head's prediction for each row of its logits (NSP: each sequence; tasks: each example).
  std::vector<int32_t> head_predictions() const;
  // The head's logits as floats (BF16 widened), (head_rows, head_cols).
  std::vector<float> head_values() const;
  // Adds the pass's losses and predictions to the metrics.
  void add_to(PretrainingMetrics& metrics) const;
  void add_to(TaskMetrics& metrics) const;

  const float *mlm_loss = nullptr, *nsp_loss = nullptr, *task_loss = nullptr;  // null: no such loss
  const int32_t* mlm_predicted = nullptr;                                      // one per MLM target
  const void* head_logits = nullptr;  // NSP logits (B, 2), or the task head's (N, labels); null: none
  DType head_dtype = DType::kF32;
  int64_t head_rows = 0, head_cols = 0;
  std::vector<int32_t> mlm_targets, task_targets;
  std::vector<float> task_scores;    // a regression's target scores
  std::vector<int64_t> task_groups;  // and their groups (or none)
  // The task head's rows (model::ModelOutputs::rows: b * T + position), the batch's sequences and length.
  std::vector<int32_t> task_rows;
  int64_t batch = 0, seq_len = 0;
  std::vector<int8_t> nsp_labels;
};

// Batches through the model without gradients or dropout, pipelined: queue() queues a batch's forward
// pass and the reads of its outputs, then waits for the batch queued before it and returns its reads, so
// that the host queues batch n + 1 while the device runs batch n. On a GPU with `cuda_graphs`, a batch of
// the shapes of the two before it (StepGraph::schedule) is recorded and launched as one CUDA graph: the
// same values as op by op, with less waiting between kernels where they are short.
class BatchEvaluator {
 public:
  BatchEvaluator(model::Bert& model, Graph<float>& g, bool cuda_graphs);
  // The reads of the batch queued before `b` (nullptr for the first), valid until the next queue() or
  // finish(). The graph is cleared before each batch (the device's work stays queued in order).
  const OutputReads* queue(const BatchView& b);
  // The reads of the last batch queued, or nullptr when none is waiting.
  const OutputReads* finish();
  // One batch alone: queue() then finish() (nothing may be waiting).
  const OutputReads& run(const BatchView& b);
  const StepGraph& graphs() const { return graph_; }

 private:
  struct Slot {
    std::unique_ptr<Readback> reads;
    OutputReads outputs;
    bool waiting = false;  // queued, not yet returned
  };
  model::Bert& model_;
  Graph<float>& g_;
  bool cuda_graphs_;
  Rng unused_{0};  // dropout is off in evaluation and draws nothing
  std::array<Slot, 2> slots_;
  int next_ = 0;  // the slot the next batch takes
  StepGraph graph_;
};

}  // namespace bert::eval
