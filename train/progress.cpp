#include "train/progress.h"

#include <spdlog/spdlog.h>

#include "eval/quantized.h"
#include "eval/squad.h"

namespace bert::train {

std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(seconds);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", (long long)(s / 3600), (long long)(s / 60 % 60),
                (long long)(s % 60));
  return buf;
}

// The progress line and its metrics.jsonl record for the window that ends at `step`; then the window
// starts over. `seconds_per_step`: the run's average so far, for the ETA.
void report_progress(const RunReport& run, int64_t step, double lr, double elapsed, double seconds_per_step,
                     ProgressWindow& window) {
  const TrainOptions& o = run.options;
  Communicator& ranks = run.ranks;
  model::Bert& model = run.model;
  const std::vector<model::Quantizer*>& active = run.active;
  const Device& device = run.device;
  std::ofstream& metrics_log = run.metrics_log;
  window.reduce(ranks);
  if (ranks.rank() != 0) {  // rank 0 reports; the others start their window over
    for (model::Quantizer* q : active) q->reset_counts();
    window.reset();
    return;
  }
  const double seq_per_s = window.steps() * o.batch_size * o.accumulation * ranks.size() / window.seconds();
  std::string memory;
  if (device.is_cuda()) {
    const auto [used, total] = device.memory_use();
    memory = fmt::format("  GPU mem {:.1f}/{:.0f} GiB", used / double(1 << 30), total / double(1 << 30));
  }
  spdlog::info("step {:>6}/{}  {}  lr {:.2e}  |g| {:.2f}  {:.0f} seq/s{}  ETA {}{}", step, o.steps, window.describe(),
               lr, window.mean_grad_norm(), seq_per_s, ranks.size() > 1 ? " (all ranks)" : "",
               format_duration(seconds_per_step * (o.steps - step)), memory);
  Json line;
  line["step"] = step;
  window.record(line);
  line["learning_rate"] = lr;
  line["grad_norm"] = window.mean_grad_norm();
  line["sequences_per_second"] = seq_per_s;
  line["elapsed_seconds"] = elapsed;
  if (!active.empty()) {
    // Clipping per quantizer over the window: the share of values that saturated.
    Json clip;
    double worst = 0;
    std::string worst_name;
    model.collect_clip_counts();
    for (model::Quantizer* q : active) {
      const double fraction = q->seen ? double(q->clipped) / q->seen : 0.0;
      clip[q->name] = fraction;
      if (fraction >= worst) worst = fraction, worst_name = q->name;
      q->reset_counts();
    }
    line["clip_fraction"] = clip;
    spdlog::info("  clipping: at most {:.4f}% of values, at {}", 100 * worst, worst_name);
  }
  metrics_log << line.dump() << "\n" << std::flush;
  window.reset();
}

// Held-out evaluation (pretraining or task metrics) into `result`, logged and appended to metrics.jsonl.
data::ShardLoader held_out_loader(const TrainOptions& o, const std::vector<std::string>& eval_paths,
                                  const data::ShardLoader& train_loader) {
  data::LoaderOptions eo;
  eo.shards = eval_paths;
  eo.batch_size = o.batch_size;
  eo.shuffle = false;
  eo.repeat = false;
  data::ShardLoader eval_loader(eo);
  if (eval_loader.kind() != train_loader.kind() || eval_loader.label_names() != train_loader.label_names())
    throw UserError("--eval: the evaluation shards ('" + eval_paths.front() + "') are " +
                    data::shard_kind_name(eval_loader.kind()) + " shards with other labels than the training ones");
  return eval_loader;
}

std::vector<double> gather(Communicator& ranks, const std::vector<double>& own) {
  std::vector<double> counts(static_cast<size_t>(ranks.size()), 0.0);
  counts[static_cast<size_t>(ranks.rank())] = static_cast<double>(own.size());
  ranks.all_reduce_sum(counts);
  size_t offset = 0, total = 0;
  for (int r = 0; r < ranks.size(); ++r) (r < ranks.rank() ? offset : total) += static_cast<size_t>(counts[r]);
  total += offset;
  std::vector<double> all(total, 0.0);  // each rank fills its own slots; the sum is every rank's
  std::copy(own.begin(), own.end(), all.begin() + static_cast<std::ptrdiff_t>(offset));
  ranks.all_reduce_sum(all);
  return all;
}

void check_best_metric(TrainOptions::BestMetric metric, const model::BertConfig& config) {
  using Metric = TrainOptions::BestMetric;
  const model::Head head = config.head;
  const std::string flag = "--keep-best " + kBestMetricNames.name(metric);
  const bool correlation =
      metric == Metric::kPearson || metric == Metric::kSpearman || metric == Metric::kMrr || metric == Metric::kNdcg;
  if (config.regression() && !correlation && metric != Metric::kLoss)
    throw UserError(flag +
                    ": a regression is ranked by its Pearson or Spearman correlation, its groups' MRR or NDCG, "
                    "or its loss");
  if (correlation && !config.regression())
    throw UserError(flag + ": for a regression (a " + model::head_architecture(head) + " with one score)");
  if (head == model::Head::kPretraining && metric != Metric::kAccuracy && metric != Metric::kLoss)
    throw UserError(flag + ": a pretraining run is ranked by its MLM accuracy or its loss");
  if (head == model::Head::kQuestionAnswering && metric == Metric::kMcc)
    throw UserError(flag + ": question answering has no Matthews correlation");
  if (head != model::Head::kQuestionAnswering && metric == Metric::kQuestionF1)
    throw UserError(flag + ": for question answering (a " + model::head_architecture(head) + " has no questions)");
}

eval::TaskScore task_score_of(TrainOptions::BestMetric metric) {
  using Metric = TrainOptions::BestMetric;
  switch (metric) {
    case Metric::kMacroF1:
      return eval::TaskScore::kMacroF1;
    case Metric::kMcc:
      return eval::TaskScore::kMcc;
    case Metric::kPearson:
      return eval::TaskScore::kPearson;
    case Metric::kSpearman:
      return eval::TaskScore::kSpearman;
    case Metric::kMrr:
      return eval::TaskScore::kMrr;
    case Metric::kNdcg:
      return eval::TaskScore::kNdcg;
    case Metric::kAccuracy:
    case Metric::kLoss:
    case Metric::kQuestionF1:
      break;
  }
  return eval::TaskScore::kAccuracy;
}

double best_metric_value(TrainOptions::BestMetric metric, const TrainResult& result, model::Head head) {
  using Metric = TrainOptions::BestMetric;
  if (head == model::Head::kPretraining) {
    const eval::PretrainingMetrics& m = result.last_eval;
    return metric == Metric::kLoss ? m.mlm_loss() + m.nsp_loss() : m.mlm_accuracy();
  }
  const eval::TaskMetrics& m = result.last_task_eval;
  if (metric == Metric::kLoss) return m.loss();
  if (metric == Metric::kQuestionF1) return result.last_answers ? result.last_answers->f1() : 0.0;
  return eval::task_score(m, task_score_of(metric));
}

bool beats(TrainOptions::BestMetric metric, double value, double best) {
  return metric == TrainOptions::BestMetric::kLoss ? value < best : value > best;
}

void evaluate_held_out(const RunReport& run, data::ShardLoader& eval_loader, int64_t step, TrainResult& result) {
  const TrainOptions& o = run.options;
  model::Bert& model = run.model;
  const Device& device = run.device;
  std::ofstream& metrics_log = run.metrics_log;
  eval_loader.restore({});  // from the start (the shard still in memory is not read again)
  Graph<float> eval_graph(device);
  const model::BertConfig& config = model.config();
  Json line;
  line["step"] = step;
  if (config.head == model::Head::kPretraining) {
    result.last_eval = eval::evaluate(model, eval_loader, o.eval_batches, eval_graph, o.cuda_graphs);
    const auto& m = result.last_eval;
    spdlog::info(
        "eval step {}: MLM acc {:.4f} (most-frequent-token {:.4f}), MLM loss {:.4f}, NSP acc {:.4f} "
        "(majority {:.4f}) over {} predictions",
        step, m.mlm_accuracy(), m.most_frequent_token_accuracy(), m.mlm_loss(), m.nsp_accuracy(),
        m.nsp_majority_accuracy(), m.predictions);
    line["eval"] = m.to_json();
  } else {
    if (o.eval_questions) {
      eval::AnswerEvaluation r =
          eval::evaluate_answers(model, eval_loader, *o.eval_questions, o.eval_batches, eval_graph, o.cuda_graphs);
      result.last_task_eval = std::move(r.windows);
      result.last_answers = std::move(r.answers);
    } else {
      result.last_task_eval = eval::evaluate_task(model, eval_loader, o.eval_batches, eval_graph, o.cuda_graphs);
    }
    const auto& m = result.last_task_eval;
    if (m.regression)
      spdlog::info(
          "eval step {}: Pearson {:.4f}, Spearman {:.4f}, MSE {:.4f} (the mean score: {:.4f}) over {} sequences{}",
          step, m.pearson(), m.spearman(), m.loss(), m.baseline_mse(), m.examples,
          m.groups.empty()
              ? ""
              : fmt::format("; MRR@10 {:.4f}, NDCG@10 {:.4f} over {} groups", m.mrr(), m.ndcg(), m.ranked_groups()));
    else
      spdlog::info("eval step {}: {} {:.4f} (majority {} {:.4f}), {} {:.4f}{}, loss {:.4f} over {} {}", step,
                   m.accuracy_name(), m.accuracy(), m.spans ? "span" : "label", m.majority_accuracy(), m.f1_name(),
                   m.macro_f1(), m.spans ? "" : fmt::format(", MCC {:.4f}", m.mcc()), m.loss(), m.examples,
                   config.head == model::Head::kTokenClassification ? "tokens" : "sequences");
    line["eval"] = m.to_json(config.labels);
    if (o.eval_questions) {
      const eval::AnswerScores& a = *result.last_answers;
      spdlog::info("eval step {}: questions: exact match {:.4f}, F1 {:.4f} over {}{}", step, a.exact_match(), a.f1(),
                   a.questions, a.unscored ? fmt::format(" ({} not reached: --eval-batches)", a.unscored) : "");
      line["eval"]["answers"] = a.to_json();
    }
  }
  metrics_log << line.dump() << "\n" << std::flush;
}

}  // namespace bert::train
