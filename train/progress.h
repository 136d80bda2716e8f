// A training run's progress: the window of steps since the last progress line (its metrics summed over
// the ranks), the progress line and its metrics.jsonl record, and the held-out evaluation.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/graph.h"
#include "data/loader.h"
#include "eval/metrics.h"
#include "eval/output_reads.h"
#include "eval/quantized.h"
#include "model/bert.h"
#include "train/communicator.h"
#include "train/trainer.h"

namespace bert::train {

// h:mm:ss.
std::string format_duration(double seconds);

// Every rank's values, in rank order (each rank passes its own): a regression's correlations and rankings
// need every score, not sums.
std::vector<double> gather(Communicator& ranks, const std::vector<double>& own);

// The metrics of the steps since the last progress line: MLM/NSP for pretraining, the task's accuracy
// for fine-tuning; their progress line and metrics.jsonl fields.
class ProgressWindow {
 public:
  explicit ProgressWindow(const model::BertConfig& config)
      : pretraining_(config.head == model::Head::kPretraining),
        empty_task_(eval::TaskMetrics::for_head(config)),
        task_(empty_task_) {}
  // A micro-batch's metrics, from values read back by the training step.
  void add(const eval::OutputReads& reads) {
    if (pretraining_)
      reads.add_to(pretraining_metrics_);
    else
      reads.add_to(task_);
  }
  double loss() const {
    return pretraining_ ? pretraining_metrics_.mlm_loss() + pretraining_metrics_.nsp_loss() : task_.loss();
  }
  std::string describe() const {
    return pretraining_ ? fmt::format("loss {:.4f}  MLM acc {:.4f}  NSP acc {:.4f}", loss(),
                                      pretraining_metrics_.mlm_accuracy(), pretraining_metrics_.nsp_accuracy())
                        : fmt::format("loss {:.4f}  {}", loss(), task_.headline());
  }
  void record(Json& line) const {
    line["loss"] = loss();
    if (pretraining_) {
      line["mlm_loss"] = pretraining_metrics_.mlm_loss();
      line["mlm_accuracy"] = pretraining_metrics_.mlm_accuracy();
      line["nsp_loss"] = pretraining_metrics_.nsp_loss();
      line["nsp_accuracy"] = pretraining_metrics_.nsp_accuracy();
    } else {
      if (task_.regression) {
        line["pearson"] = task_.pearson();
        if (!task_.groups.empty()) line["ndcg_at_10"] = task_.ndcg();
      } else {
        line["accuracy"] = task_.accuracy();  // question answering: the exact-match rate
        if (task_.spans) line["token_f1"] = task_.macro_f1();
      }
    }
  }
  // An optimizer step that was applied (skipped steps count only their time).
  void add_step(double grad_norm) {
    grad_norm_sum_ += grad_norm;
    ++steps_;
  }
  void add_time(double seconds) { seconds_ += seconds; }
  // Sums the metrics over the ranks (the step count, time and gradient norm are the same everywhere).
  void reduce(Communicator& ranks) {
    if (ranks.size() == 1) return;
    eval::PretrainingMetrics& p = pretraining_metrics_;
    std::vector<double> v = {double(p.predictions), double(p.mlm_correct), p.mlm_loss_sum,         double(p.sequences),
                             double(p.nsp_correct), p.nsp_loss_sum,        double(task_.examples), task_.loss_sum};
    for (int64_t c : task_.confusion) v.push_back(double(c));
    const size_t spans = v.size();
    for (double c : {double(task_.exact), double(task_.start_correct), double(task_.end_correct), task_.span_f1_sum})
      v.push_back(c);
    ranks.all_reduce_sum(v);
    p.predictions = int64_t(v[0]), p.mlm_correct = int64_t(v[1]), p.mlm_loss_sum = v[2];
    p.sequences = int64_t(v[3]), p.nsp_correct = int64_t(v[4]), p.nsp_loss_sum = v[5];
    task_.examples = int64_t(v[6]), task_.loss_sum = v[7];
    for (size_t i = 0; i < task_.confusion.size(); ++i) task_.confusion[i] = int64_t(v[8 + i]);
    task_.exact = int64_t(v[spans]), task_.start_correct = int64_t(v[spans + 1]);
    task_.end_correct = int64_t(v[spans + 2]), task_.span_f1_sum = v[spans + 3];
    if (task_.regression) {  // (group numbers lie below 2^53: exact as doubles)
      std::vector<double> own;
      for (size_t i = 0; i < task_.scored.size(); ++i)
        own.insert(own.end(), {task_.scored[i].first, task_.scored[i].second,
                               task_.groups.empty() ? -1.0 : double(task_.groups[i])});
      const std::vector<double> all = gather(ranks, own);
      task_.scored.clear(), task_.groups.clear();
      for (size_t i = 0; i + 2 < all.size(); i += 3) {
        task_.scored.emplace_back(static_cast<float>(all[i]), static_cast<float>(all[i + 1]));
        if (all[i + 2] >= 0) task_.groups.push_back(static_cast<int64_t>(all[i + 2]));
      }
    }
  }
  int64_t steps() const { return steps_; }
  double mean_grad_norm() const { return steps_ ? grad_norm_sum_ / steps_ : 0.0; }
  double seconds() const { return seconds_; }
  void reset() {
    pretraining_metrics_ = {};
    task_ = empty_task_;
    seconds_ = grad_norm_sum_ = 0;
    steps_ = 0;
  }

 private:
  double seconds_ = 0, grad_norm_sum_ = 0;
  int64_t steps_ = 0;
  bool pretraining_;
  eval::TaskMetrics empty_task_;  // the head's metrics, nothing added
  eval::PretrainingMetrics pretraining_metrics_;
  eval::TaskMetrics task_;
};

// What a run's progress report and held-out evaluation read and write: its options, model, enabled
// quantizers, device, ranks and metrics log.
struct RunReport {
  const TrainOptions& options;
  model::Bert& model;
  const std::vector<model::Quantizer*>& active;
  const Device& device;
  Communicator& ranks;
  std::ofstream& metrics_log;
};

// The progress line and its metrics.jsonl record for the window that ends at `step`; then the window
// starts over. `seconds_per_step`: the run's average so far, for the ETA.
void report_progress(const RunReport& run, int64_t step, double lr, double elapsed, double seconds_per_step,
                     ProgressWindow& window);

// The loader of the held-out shards (--eval: in order, one pass, batches of --batch-size), checked against
// the training shards: the same kind and labels (UserError naming --eval otherwise). A run makes it once,
// before its first step, so its evaluations read the held-out shards from memory (a shard of 65,536
// examples is 0.2 s of reading) and a wrong --eval fails at the start.
data::ShardLoader held_out_loader(const TrainOptions& o, const std::vector<std::string>& eval_paths,
                                  const data::ShardLoader& train_loader);
// Held-out evaluation (pretraining or task metrics) into `result` from the start of `eval_loader` (--eval-batches
// batches of it, or all), logged and appended to metrics.jsonl.
void evaluate_held_out(const RunReport& run, data::ShardLoader& eval_loader, int64_t step, TrainResult& result);

// --keep-best: UserError naming the flag where `metric` does not apply to `head` (a pretraining model has
// accuracy and loss; question answering no Matthews correlation; question-f1 is question answering's).
void check_best_metric(TrainOptions::BestMetric metric, const model::BertConfig& config);
// The task score a metric of a task model's held-out evaluation is (accuracy for loss and question-f1,
// which are not task scores).
eval::TaskScore task_score_of(TrainOptions::BestMetric metric);
// The metric's value in the held-out evaluation `result` last made, and whether `value` beats `best`
// (higher is better, the loss lower).
double best_metric_value(TrainOptions::BestMetric metric, const TrainResult& result, model::Head head);
bool beats(TrainOptions::BestMetric metric, double value, double best);

}  // namespace bert::train
