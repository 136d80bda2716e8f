#include "train/training_step.h"

#include <spdlog/spdlog.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstdio>
#include <vector>

#include "ops/ops.h"
#include "train/qat_setup.h"

namespace bert::train {

namespace {

// The first parameter whose gradient (or value) holds a NaN or infinity, or "".
std::string first_nonfinite(ParameterArena<float>& params, bool gradients) {
  for (ParamId id = 0; id < params.size(); ++id) {
    Parameter<float> p = params.get(id);
    const TensorView<float> t = gradients ? p.grad : p.value;
    for (float v : t)
      if (!std::isfinite(v)) return *p.name;
  }
  return "";
}

// For a non-finite loss: the first non-finite weight, or else the largest one (overflowing activations
// come from weights that grew too large).
std::string describe_weights(ParameterArena<float>& params) {
  const std::string bad = first_nonfinite(params, false);
  if (!bad.empty()) return "first non-finite weight: " + bad;
  float largest = 0;
  std::string where;
  for (ParamId id = 0; id < params.size(); ++id)
    for (float v : params.get(id).value)
      if (std::abs(v) > largest) largest = std::abs(v), where = params.name(id);
  char text[64];
  std::snprintf(text, sizeof text, "%.3g", largest);
  return "weights finite, the largest |w| = " + std::string(text) + " in " + where;
}

// This rank's share of the micro-batch's predictions over all ranks, times the number of ranks: the
// factor that turns its mean over its own predictions (masked tokens, labeled tokens) into its part of
// the mean over the global batch's. Averaging the ranks' gradients then gives the gradient of the
// global mean, as one process with the global batch computes it (ranks hold different numbers of masked
// tokens). 1 for one rank, for sequence classification (one prediction per sequence) and for question
// answering (two: the answer's start and end).
double prediction_share(Communicator& ranks, const model::ModelOutputs& out, model::Head head) {
  if (ranks.size() == 1 || head == model::Head::kSequenceClassification || head == model::Head::kQuestionAnswering)
    return 1.0;
  const double own =
      static_cast<double>(head == model::Head::kPretraining ? out.mlm_targets.size() : out.targets.size());
  std::vector<double> total = {own};
  ranks.all_reduce_sum(total);
  return total[0] > 0 ? own * ranks.size() / total[0] : 1.0;
}

}  // namespace

TrainingStep::MicroBatchReads TrainingStep::queue_reads(Readback& rb, const Graph<float>& g,
                                                        const model::ModelOutputs& out, Var objective, Var logged,
                                                        const BatchView& b) {
  MicroBatchReads r;
  r.logged = rb.read<float>(g.data(logged), 1);  // losses are F32 nodes
  r.objective = objective.index == logged.index ? r.logged : rb.read<float>(g.data(objective), 1);
  r.outputs = eval::OutputReads::queue(rb, g, out, b, p_.model.config().head);
  return r;
}

void TrainingStep::take_reads(const MicroBatchReads& r, Outcome& outcome, ProgressWindow& window) {
  const double loss = *r.logged;
  if ((!std::isfinite(loss) || !std::isfinite(*r.objective)) && outcome.nonfinite.empty()) {
    std::string parts;
    const eval::OutputReads& o = r.outputs;
    if (o.mlm_loss || o.nsp_loss)
      parts = " (MLM " + std::to_string(o.mlm_loss ? *o.mlm_loss : 0.0f) + ", NSP " +
              std::to_string(o.nsp_loss ? *o.nsp_loss : 0.0f) + ")";
    ParameterArena<float>& params = p_.model.parameters();
    params.download_values();
    outcome.nonfinite = "loss is " + std::to_string(loss) + parts + ", " + describe_weights(params);
  }
  if (!outcome.nonfinite.empty()) return;
  outcome.loss += loss / o_.accumulation;
  window.add(r.outputs);
}

TrainingStep::Losses TrainingStep::forward_pass(Graph<float>& g, const Batch& batch, Readback& rb,
                                                std::vector<MicroBatchReads>& pending) {
  const BatchView b = batch.view();
  // The predictions come from the loss's own pass over the logits and stay on the device until read back;
  // the logits are kept as a node only for a teacher to distil into.
  const model::ModelOutputs out = p_.model.forward(
      g, b, /*training=*/true, p_.dropout_rng,
      p_.teacher ? model::MlmOutputs::kLogitsAndPredictionsOnDevice : model::MlmOutputs::kLossAndPredictionsOnDevice);
  const auto [objective, logged] =
      objective_of(g, out, p_.teacher, b, o_, prediction_share(p_.ranks, out, p_.model.config().head));
  pending.push_back(queue_reads(rb, g, out, objective, logged, b));
  return {objective, logged, o_.accumulation == 1 ? objective : ops::scale(g, objective, 1.0 / o_.accumulation)};
}

bool TrainingStep::record_this_step(const Graph<float>& g, const std::vector<int64_t>& shapes) {
  if (!o_.cuda_graphs || g.profiling()) return false;  // (a profile times each op: waits)
  std::string stopped;
  const bool record = graph_.schedule(shapes, stopped);
  if (!stopped.empty()) spdlog::info("training steps run op by op from here: {}", stopped);
  return record;
}

bool TrainingStep::pipelined() const {
  return p_.model.parameters().on_cuda() && !p_.reduction && p_.ranks.size() == 1;
}

TrainingStep::Outcome TrainingStep::run(Graph<float>& g, Batch& batch, const std::function<void(Batch&)>& next_batch,
                                        double lr, ProgressWindow& window, bool log_buckets) {
  BERT_CHECK(queued_.empty(), "TrainingStep::run with steps queued: finish() them first");
  queue(g, batch, next_batch, lr, window, log_buckets);
  return finish(window);
}

void TrainingStep::queue(Graph<float>& g, Batch& batch, const std::function<void(Batch&)>& next_batch, double lr,
                         ProgressWindow& window, bool log_buckets) {
  BERT_CHECK(queued_.size() < 2, "TrainingStep::queue: two steps are queued already");
  // The weights' BF16 copy made current where it is stale (the first step; every step under LAMB, which does
  // not keep it; a teacher's, which no optimizer updates), so that no GEMM rounds its weight into the step's
  // workspace: that memory would stay the workspace's for good (ParameterArena::refresh_bf16_copy).
  p_.model.parameters().refresh_bf16_copy();
  if (p_.teacher) p_.teacher->parameters().refresh_bf16_copy();
  Queued& q = queued_.emplace_back();
  if (spare_reads_.empty()) {
    q.reads = std::make_unique<Readback>(g.device());
  } else {
    q.reads = std::move(spare_reads_.back());
    spare_reads_.pop_back();
  }
  if (!pipelined()) {
    q.outcome = run_synchronous(q, g, batch, next_batch, lr, window, log_buckets);
    q.finished = true;
    return;
  }
  // The micro-batches first: their shapes decide whether the step is recorded as one CUDA graph (a later
  // one is the one before it filled again, as when the caller's batch is filled again).
  next_batch(batch);
  std::vector<const Batch*> micro_batches = {&batch};
  for (int64_t micro = 1; micro < o_.accumulation; ++micro) {
    if (later_batches_.size() < static_cast<size_t>(micro)) later_batches_.emplace_back();
    Batch& b = later_batches_[micro - 1];
    b = *micro_batches.back();
    next_batch(b);
    micro_batches.push_back(&b);
  }
  std::vector<int64_t> shapes;
  for (const Batch* b : micro_batches) shapes.insert(shapes.end(), {b->size, b->seq_len, b->max_predictions});
  struct Abandon {  // a recording that throws is abandoned
    StepGraph& graph;
    ~Abandon() { graph.abandon(); }
  } abandon{graph_};
  if (record_this_step(g, shapes)) graph_.record(g.device());
  p_.model.zero_gradients();
  for (const Batch* micro_batch : micro_batches) {
    const Losses l = forward_pass(g, *micro_batch, *q.reads, q.pending);
    // The GPU skips the update where a loss is not finite, as the host would.
    const std::array<const float*, 2> losses = {static_cast<const float*>(g.data(l.logged)),
                                                static_cast<const float*>(g.data(l.objective))};  // F32 scalars
    p_.optimizer.flag_nonfinite(
        std::span<const float* const>(losses.data(), l.objective.index == l.logged.index ? 1 : 2));
    g.backward(l.scaled);
  }
  q.sum_of_squares = p_.optimizer.queue_step(lr, o_.clip_norm, *q.reads);
  graph_.launch(shapes);
  q.reads->seal();  // finish() waits for this step's reads, not for the step queued after it
}

TrainingStep::Outcome TrainingStep::finish(ProgressWindow& window) {
  BERT_CHECK(!queued_.empty(), "TrainingStep::finish: no step is queued");
  Queued q = std::move(queued_.front());
  queued_.pop_front();
  Outcome r;
  if (q.finished) {
    r = q.outcome;
  } else {
    q.reads->wait();
    for (const MicroBatchReads& m : q.pending) take_reads(m, r, window);
    r.stop_requested = p_.stop && p_.stop->load();
    r.grad_norm = std::sqrt(*q.sum_of_squares);
    // As the GPU decided (cuda_impl::UpdateControl): no update after a non-finite loss or norm.
    if (r.nonfinite.empty() && !std::isfinite(r.grad_norm)) r.nonfinite = nonfinite_norm(r.grad_norm);
    r.updated = r.nonfinite.empty();
    if (!r.updated) r.grad_norm = 0;
    p_.optimizer.queued_step_taken(r.updated);
    if (r.updated) window.add_step(r.grad_norm);
  }
  q.reads->clear();
  spare_reads_.push_back(std::move(q.reads));
  return r;
}

std::string TrainingStep::nonfinite_norm(double norm) {
  ParameterArena<float>& params = p_.model.parameters();
  params.download_grads();
  return "gradient norm is " + std::to_string(norm) + ", first non-finite gradient: " + first_nonfinite(params, true);
}

TrainingStep::Outcome TrainingStep::run_synchronous(Queued& q, Graph<float>& g, Batch& batch,
                                                    const std::function<void(Batch&)>& next_batch, double lr,
                                                    ProgressWindow& window, bool log_buckets) {
  Outcome r;
  Readback& rb = *q.reads;
  std::vector<MicroBatchReads>& pending = q.pending;
  ParameterArena<float>& params = p_.model.parameters();
  // Reads what the wait has brought back: the loss and metrics of each micro-batch queued so far.
  auto take_pending = [&] {
    rb.wait();
    for (const MicroBatchReads& m : pending) take_reads(m, r, window);
    pending.clear();
  };
  p_.model.zero_gradients();
  for (int64_t micro = 0; micro < o_.accumulation; ++micro) {
    next_batch(batch);
    const Var scaled = forward_pass(g, batch, rb, pending).scaled;
    if (!p_.reduction || micro + 1 < o_.accumulation) {
      g.backward(scaled);
      continue;
    }
    // Several ranks, the step's last micro-batch. They agree first: any rank's non-finite loss drops the
    // step everywhere, any rank's stop stops all; the logged loss is averaged. Then its backward pass,
    // whose gradients are averaged in buckets while it runs.
    take_pending();
    r.stop_requested = p_.stop && p_.stop->load();
    std::vector<double> agreed = {r.nonfinite.empty() ? 0.0 : 1.0, r.stop_requested ? 1.0 : 0.0, r.loss};
    p_.ranks.all_reduce_sum(agreed);
    if (agreed[0] > 0 && r.nonfinite.empty()) r.nonfinite = "a non-finite loss on another rank";
    r.stop_requested = agreed[1] > 0;
    r.loss = agreed[2] / p_.ranks.size();
    p_.reduction->expect(g);
    g.backward(scaled, [&](TensorView<float> grad) { p_.reduction->on_final(grad); });
    p_.reduction->finish();
    if (log_buckets)
      spdlog::info(
          "gradients averaged over {} ranks in {} buckets of about {:g} MiB; {} started during the backward pass",
          p_.ranks.size(), p_.reduction->num_buckets(), o_.bucket_mb, p_.reduction->started_early());
  }
  // One wait for the losses, the metrics and the gradient norm, once all of the passes are queued.
  const double* sum_of_squares = gradient_sum_of_squares(params, rb);
  take_pending();
  if (!p_.reduction) r.stop_requested = p_.stop && p_.stop->load();
  r.grad_norm = std::sqrt(*sum_of_squares);
  if (!r.nonfinite.empty()) {
    r.grad_norm = 0;
    return r;
  }
  if (!std::isfinite(r.grad_norm)) {
    r.nonfinite = nonfinite_norm(r.grad_norm);
    return r;
  }
  p_.optimizer.step(lr, clip_factor(r.grad_norm, o_.clip_norm));  // scales are kept positive by their minimum
  window.add_step(r.grad_norm);
  r.updated = true;
  return r;
}

}  // namespace bert::train
