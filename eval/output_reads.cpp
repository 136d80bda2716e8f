#include "eval/output_reads.h"

#include <spdlog/spdlog.h>

#include <bit>
#include <span>
#include <string>

namespace bert::eval {

OutputReads OutputReads::queue(Readback& rb, const Graph<float>& g, const model::ModelOutputs& out, const BatchView& b,
                               model::Head head) {
  OutputReads r;
  r.batch = b.batch, r.seq_len = b.seq_len;
  auto scalar = [&](Var v) { return rb.read<float>(g.data(v), 1); };  // losses are F32 nodes
  const bool pretraining = head == model::Head::kPretraining;
  if (pretraining) {
    r.mlm_targets = out.mlm_targets;
    if (!r.mlm_targets.empty()) {
      BERT_CHECK(out.mlm_device_predictions, "OutputReads: the MLM predictions are not on the device");
      r.mlm_loss = scalar(out.mlm_loss);
      r.mlm_predicted = rb.read<int32_t>(out.mlm_device_predictions, r.mlm_targets.size());
    }
    r.nsp_labels.assign(b.next_sentence_labels.begin(), b.next_sentence_labels.end());
    if (!r.nsp_labels.empty()) r.nsp_loss = scalar(out.nsp_loss);
  } else {
    r.task_targets = out.targets;
    r.task_scores = out.scores;
    r.task_groups.assign(b.groups.begin(), b.groups.end());
    r.task_rows = out.rows;
    if (!r.task_targets.empty() || !r.task_scores.empty()) r.task_loss = scalar(out.loss);
  }
  // The head's logits even without labels: their predictions are compared between runs (compare_integer).
  const Var logits = pretraining ? out.nsp_logits : out.logits;
  if (logits.valid()) {
    const Shape s = g.shape(logits);
    r.head_rows = s.rows(), r.head_cols = s.last(), r.head_dtype = g.dtype(logits);
    r.head_logits = rb.read_bytes(g.data(logits), s.numel() * dtype_size(r.head_dtype, sizeof(float)));
  }
  return r;
}

std::vector<float> OutputReads::head_values() const {
  std::vector<float> out(static_cast<size_t>(head_rows * head_cols));
  for (size_t i = 0; head_logits && i < out.size(); ++i)
    out[i] = head_dtype == DType::kF32
                 ? static_cast<const float*>(head_logits)[i]
                 : std::bit_cast<float>(uint32_t(static_cast<const uint16_t*>(head_logits)[i]) << 16);
  return out;
}

std::vector<int32_t> OutputReads::head_predictions() const {
  if (!head_logits) return {};
  // The first largest value of each row, as ops::row_argmax (BF16 widened to float).
  auto at = [&](int64_t i) {
    if (head_dtype == DType::kF32) return static_cast<const float*>(head_logits)[i];
    return std::bit_cast<float>(uint32_t(static_cast<const uint16_t*>(head_logits)[i]) << 16);
  };
  std::vector<int32_t> out(static_cast<size_t>(head_rows), 0);
  for (int64_t r = 0; r < head_rows; ++r) {
    float best = at(r * head_cols);
    for (int64_t c = 1; c < head_cols; ++c)
      if (at(r * head_cols + c) > best) best = at(r * head_cols + c), out[r] = static_cast<int32_t>(c);
  }
  return out;
}

void OutputReads::add_to(PretrainingMetrics& metrics) const {
  metrics.add(std::span<const int32_t>(mlm_predicted, mlm_predicted ? mlm_targets.size() : 0), mlm_targets,
              mlm_loss ? *mlm_loss : 0.0, head_predictions(), nsp_labels, nsp_loss ? *nsp_loss : 0.0);
}

void OutputReads::add_to(TaskMetrics& metrics) const {
  if (metrics.regression)
    return metrics.add_scores(head_values(), task_scores, task_loss ? *task_loss : 0.0, task_groups);
  metrics.add(head_predictions(), task_targets, task_loss ? *task_loss : 0.0);
}

BatchEvaluator::BatchEvaluator(model::Bert& model, Graph<float>& g, bool cuda_graphs)
    : model_(model), g_(g), cuda_graphs_(cuda_graphs) {
  for (Slot& slot : slots_) slot.reads = std::make_unique<Readback>(g.device());
}

const OutputReads* BatchEvaluator::queue(const BatchView& b) {
  NoGradGuard<float> no_grad(g_);
  Slot &slot = slots_[next_], &previous = slots_[1 - next_];
  BERT_CHECK(!slot.waiting, "BatchEvaluator::queue: two batches are waiting already");
  slot.reads->clear();
  g_.clear();
  const std::vector<int64_t> key = {b.batch, b.seq_len, b.max_predictions};
  std::string stopped;
  if (cuda_graphs_ && !g_.profiling() && graph_.schedule(key, stopped)) graph_.record(g_.device());
  if (!stopped.empty()) spdlog::info("evaluation batches run op by op from here: {}", stopped);
  try {
    // Only the loss and the top predictions: the decoder's logits are never stored.
    const model::ModelOutputs out =
        model_.forward(g_, b, /*training=*/false, unused_, model::MlmOutputs::kLossAndPredictionsOnDevice);
    slot.outputs = OutputReads::queue(*slot.reads, g_, out, b, model_.config().head);
  } catch (...) {
    graph_.abandon();
    throw;
  }
  graph_.launch(key);
  slot.reads->seal();  // (after the launch: an event recorded while recording would belong to the graph)
  slot.waiting = true;
  next_ = 1 - next_;
  if (!previous.waiting) return nullptr;
  previous.reads->wait();
  previous.waiting = false;
  return &previous.outputs;
}

const OutputReads* BatchEvaluator::finish() {
  Slot& last = slots_[1 - next_];
  if (!last.waiting) return nullptr;
  last.reads->wait();
  last.waiting = false;
  return &last.outputs;
}

const OutputReads& BatchEvaluator::run(const BatchView& b) {
  BERT_CHECK(!slots_[1 - next_].waiting, "BatchEvaluator::run with a batch waiting: finish() it first");
  queue(b);
  return *finish();
}

}  // namespace bert::eval
