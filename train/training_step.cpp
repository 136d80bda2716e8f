#include "train/training_step.h"

#include <spdlog/spdlog.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "core/ops.h"
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
// tokens). 1 for one rank and for sequence classification (one prediction per sequence).
double prediction_share(Communicator& ranks, const model::ModelOutputs& out, model::Head head) {
  if (ranks.size() == 1 || head == model::Head::kSequenceClassification) return 1.0;
  const double own =
      static_cast<double>(head == model::Head::kPretraining ? out.mlm_targets.size() : out.targets.size());
  std::vector<double> total = {own};
  ranks.all_reduce_sum(total);
  return total[0] > 0 ? own * ranks.size() / total[0] : 1.0;
}

}  // namespace

TrainingStep::Outcome TrainingStep::run(Graph<float>& g, Batch& batch, const std::function<void(Batch&)>& next_batch,
                                        double lr, ProgressWindow& window, bool log_buckets) const {
  Outcome r;
  model::Bert& model = p_.model;
  ParameterArena<float>& params = model.parameters();
  const model::BertConfig& config = model.config();
  params.zero_grad();
  for (int64_t micro = 0; micro < o_.accumulation; ++micro) {
    next_batch(batch);
    const BatchView b = batch.view();
    // The progress window's MLM accuracy takes the predictions from the loss's own pass over the logits.
    const model::ModelOutputs out =
        model.forward(g, b, /*training=*/true, p_.dropout_rng, model::MlmOutputs::kLossAndPredictions);
    const auto [objective, logged] =
        objective_of(g, out, p_.teacher, b, o_, prediction_share(p_.ranks, out, config.head));
    // The progress log shows MLM + NSP or the task loss (comparable with runs without distillation); the
    // objective must be finite too.
    const double loss = g.item(logged);
    if ((!std::isfinite(loss) || (p_.teacher && !std::isfinite(g.item(objective)))) && r.nonfinite.empty()) {
      std::string parts;
      if (config.head == model::Head::kPretraining)
        parts = " (MLM " + std::to_string(g.item(out.mlm_loss)) + ", NSP " + std::to_string(g.item(out.nsp_loss)) + ")";
      params.download_values();
      r.nonfinite = "loss is " + std::to_string(loss) + parts + ", " + describe_weights(params);
    }
    if (r.nonfinite.empty()) {
      r.loss += loss / o_.accumulation;
      window.add(g, out, b);
    }
    const Var scaled = o_.accumulation == 1 ? objective : ops::scale(g, objective, 1.0 / o_.accumulation);
    if (!p_.reduction || micro + 1 < o_.accumulation) {
      g.backward(scaled);
      continue;
    }
    // Several ranks, the step's last micro-batch. They agree first: any rank's non-finite loss drops the
    // step everywhere, any rank's stop stops all; the logged loss is averaged. Then its backward pass,
    // whose gradients are averaged in buckets while it runs.
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
  if (!p_.reduction) r.stop_requested = p_.stop && p_.stop->load();
  if (!r.nonfinite.empty()) return r;
  r.grad_norm = gradient_norm(params);
  if (!std::isfinite(r.grad_norm)) {
    params.download_grads();
    r.nonfinite = "gradient norm is " + std::to_string(r.grad_norm) +
                  ", first non-finite gradient: " + first_nonfinite(params, true);
    return r;
  }
  p_.optimizer.step(lr, clip_factor(r.grad_norm, o_.clip_norm));  // scales are kept positive by their minimum
  window.add_step(r.grad_norm);
  r.updated = true;
  return r;
}

}  // namespace bert::train
