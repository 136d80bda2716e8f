// Pretraining metrics: masked-LM accuracy and loss over the real (non-padding) predictions, NSP
// accuracy and loss over all sequences, and the baselines printed beside them (the most-frequent-token
// accuracy and the NSP majority class), plus evaluation over shards. Task metrics (classification of
// sequences or tokens): accuracy, loss, per-label F1 and their macro average, Matthews correlation, and the
// majority-label baseline.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/graph.h"
#include "data/loader.h"
#include "model/bert.h"
#include "sys/json.h"

namespace bert::eval {

struct PretrainingMetrics {
  int64_t predictions = 0, mlm_correct = 0;
  double mlm_loss_sum = 0;
  int64_t sequences = 0, nsp_correct = 0, nsp_random_next = 0;
  double nsp_loss_sum = 0;
  std::unordered_map<int32_t, int64_t> target_counts;  // for the most-frequent-token baseline

  // Adds one forward pass's values, read back (eval::OutputReads::add_to): each masked position's
  // prediction and target, their mean loss, each sequence's NSP prediction and label (none: no NSP), their
  // mean loss.
  void add(std::span<const int32_t> mlm_predicted, std::span<const int32_t> mlm_targets, double mlm_loss,
           std::span<const int32_t> nsp_predicted, std::span<const int8_t> nsp_labels, double nsp_loss);
  void merge(const PretrainingMetrics& other);

  double mlm_accuracy() const { return predictions ? double(mlm_correct) / predictions : 0.0; }
  double mlm_loss() const { return predictions ? mlm_loss_sum / predictions : 0.0; }
  double nsp_accuracy() const { return sequences ? double(nsp_correct) / sequences : 0.0; }
  double nsp_loss() const { return sequences ? nsp_loss_sum / sequences : 0.0; }
  // Accuracy of always predicting the most frequent target token of this set.
  double most_frequent_token_accuracy() const;
  int32_t most_frequent_token() const;
  // Accuracy of always predicting the more common NSP label.
  double nsp_majority_accuracy() const;
  Json to_json() const;
};

// For sequence classification each sequence is one example, for token classification each labeled token.
// Question answering (`spans`): each sequence (a question with a window of its context) is one example; the
// prediction is its most likely start and its most likely end position, each over all positions (what the
// argmax of an export's start_logits and end_logits gives), scored against the answer's span: exact match
// (both ends right), token F1 (the overlap of the two spans in tokens; a span at [CLS], no answer in the
// window, scores 1 only when predicted exactly), and each end's accuracy. These are per sequence and in
// tokens, not SQuAD's per-question F1 over normalised words of the best span across windows.
// Sequence regression (`regression`): each sequence's predicted score against its target: Pearson and
// Spearman correlation (GLUE's STS-B metrics), the loss the mean squared error, the baseline the mean
// squared error of always predicting the targets' mean (their variance); with groups (queries whose passages
// are ranked by their scores: a cross-encoder reranker's evaluation) also MRR@10 and NDCG@10.
struct TaskMetrics {
  int64_t num_labels = 0;
  std::vector<int64_t> confusion;  // (num_labels, num_labels): [target * num_labels + predicted]
  int64_t examples = 0;
  double loss_sum = 0;
  bool spans = false;  // question answering: predictions and targets are (start, end) pairs
  int64_t exact = 0, start_correct = 0, end_correct = 0;
  double span_f1_sum = 0;
  std::map<std::pair<int32_t, int32_t>, int64_t> target_spans;  // for the majority baseline
  bool regression = false;
  std::vector<std::pair<float, float>> scored;  // regression: each example's (predicted, target) score
  std::vector<int64_t> groups;                  // regression: each scored example's group, or empty

  TaskMetrics() = default;
  explicit TaskMetrics(int64_t num_labels, bool spans = false)
      : num_labels(num_labels), confusion(static_cast<size_t>(num_labels * num_labels), 0), spans(spans) {}
  // The metrics of a model with this head (spans for question answering).
  static TaskMetrics for_head(const model::BertConfig& config);
  // Adds one forward pass's values, read back (eval::OutputReads::add_to): each example's prediction and
  // target (question answering: start then end, per sequence), their mean loss.
  void add(std::span<const int32_t> predicted, std::span<const int32_t> targets, double loss);
  // Regression: each sequence's predicted and target score, their mean squared error, and each one's group
  // (empty: none; examples come with groups always or never).
  void add_scores(std::span<const float> predicted, std::span<const float> targets, double loss,
                  std::span<const int64_t> groups = {});
  void merge(const TaskMetrics& other);

  double accuracy() const;  // question answering: the exact-match rate
  double loss() const { return examples ? loss_sum / examples : 0.0; }
  // F1 of one label (0 when it neither occurs nor is predicted), and the unweighted mean over the
  // labels that occur among the targets or the predictions. Question answering: macro_f1() is the mean
  // token F1 of the spans.
  double f1(int64_t label) const;
  double macro_f1() const;
  // Matthews correlation coefficient over the confusion matrix (GLUE's CoLA metric; for more than two
  // labels the multiclass form scikit-learn's matthews_corrcoef computes): 1 for perfect predictions, 0 for
  // chance or a constant prediction, -1 at worst. Not for question answering (0).
  double mcc() const;
  double majority_accuracy() const;  // always predicting the most frequent target label (or span)
  // Regression: Pearson's correlation of the predicted and target scores, Spearman's (Pearson's of their
  // ranks, ties given their mean rank, as scipy.stats.spearmanr), 0 where either side is constant; the
  // targets' variance (the mean squared error of predicting their mean).
  double pearson() const;
  double spearman() const;
  double baseline_mse() const;
  // Regression with groups: each group's examples ranked by their predicted scores, highest first (ties in
  // the order they came), and scored against their targets (relevant: a target above 0). MRR@k: the mean
  // over the groups with a relevant example of 1 / the rank of the first one in the top k (0 below it);
  // NDCG@k: the mean over the groups with a relevant example of DCG@k / the ideal DCG@k, gains the targets
  // (negative ones 0), discounts log2(rank + 1), as trec_eval's ndcg_cut. ranked_groups(): those groups.
  double mrr(int k = 10) const;
  double ndcg(int k = 10) const;
  int64_t ranked_groups() const;
  // The two columns of tables, and their names: accuracy and macro-F1, for question answering exact match
  // and token F1, for a regression Pearson and Spearman.
  double first() const { return regression ? pearson() : accuracy(); }
  double second() const { return regression ? spearman() : macro_f1(); }
  const char* accuracy_name() const { return regression ? "Pearson" : spans ? "exact match" : "accuracy"; }
  const char* f1_name() const { return regression ? "Spearman" : spans ? "token F1" : "macro-F1"; }
  Json to_json(const std::vector<std::string>& label_names) const;
  // The headline, for progress lines: "acc 0.9000", "EM 0.7000" or "Pearson 0.8700".
  std::string headline() const;
};

// Evaluates without gradients or dropout over the loader's batches (at most max_batches; <= 0 = all). On a
// GPU, batches of repeating shapes run as one CUDA graph each unless !cuda_graphs (core/step_graph.h; the
// same values as op by op).
// With `predictions`, each example's prediction is added to it too (eval/predictions.h).
class ExamplePredictions;
TaskMetrics evaluate_task(model::Bert& model, data::ShardLoader& loader, int64_t max_batches, Graph<float>& g,
                          bool cuda_graphs = true, ExamplePredictions* predictions = nullptr);
PretrainingMetrics evaluate(model::Bert& model, data::ShardLoader& loader, int64_t max_batches, Graph<float>& g,
                            bool cuda_graphs = true);

}  // namespace bert::eval
