#include "eval/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>

#include "eval/output_reads.h"
#include "eval/predictions.h"

namespace bert::eval {

void PretrainingMetrics::add(std::span<const int32_t> mlm_predicted, std::span<const int32_t> mlm_targets,
                             double mlm_loss, std::span<const int32_t> nsp_predicted,
                             std::span<const int8_t> nsp_labels, double nsp_loss) {
  const auto m = static_cast<int64_t>(mlm_targets.size());
  if (m > 0) {
    for (int64_t i = 0; i < m; ++i) {
      mlm_correct += mlm_predicted[i] == mlm_targets[i];
      ++target_counts[mlm_targets[i]];
    }
    predictions += m;
    mlm_loss_sum += mlm_loss * m;
  }
  const auto b = static_cast<int64_t>(nsp_labels.size());
  if (b > 0) {
    for (int64_t i = 0; i < b; ++i) {
      nsp_correct += nsp_predicted[i] == nsp_labels[i];
      nsp_random_next += nsp_labels[i];
    }
    sequences += b;
    nsp_loss_sum += nsp_loss * b;
  }
}

void PretrainingMetrics::merge(const PretrainingMetrics& o) {
  predictions += o.predictions;
  mlm_correct += o.mlm_correct;
  mlm_loss_sum += o.mlm_loss_sum;
  sequences += o.sequences;
  nsp_correct += o.nsp_correct;
  nsp_random_next += o.nsp_random_next;
  nsp_loss_sum += o.nsp_loss_sum;
  for (auto [token, count] : o.target_counts) target_counts[token] += count;
}

int32_t PretrainingMetrics::most_frequent_token() const {
  int32_t best = -1;
  int64_t count = -1;
  for (auto [token, c] : target_counts)
    if (c > count || (c == count && token < best)) best = token, count = c;
  return best;
}

double PretrainingMetrics::most_frequent_token_accuracy() const {
  if (predictions == 0) return 0.0;
  int64_t best = 0;
  for (auto [token, c] : target_counts) best = std::max(best, c);
  return double(best) / predictions;
}

double PretrainingMetrics::nsp_majority_accuracy() const {
  if (sequences == 0) return 0.0;
  return double(std::max(nsp_random_next, sequences - nsp_random_next)) / sequences;
}

Json PretrainingMetrics::to_json() const {
  Json j;
  j["mlm_accuracy"] = mlm_accuracy();
  j["mlm_loss"] = mlm_loss();
  j["mlm_predictions"] = predictions;
  j["mlm_baseline_most_frequent_token_accuracy"] = most_frequent_token_accuracy();
  j["nsp_accuracy"] = nsp_accuracy();
  j["nsp_loss"] = nsp_loss();
  j["nsp_sequences"] = sequences;
  j["nsp_baseline_majority_accuracy"] = nsp_majority_accuracy();
  return j;
}

TaskMetrics TaskMetrics::for_head(const model::BertConfig& config) {
  TaskMetrics m(config.num_labels(), config.head == model::Head::kQuestionAnswering);
  m.regression = config.regression();
  return m;
}

namespace {
// The overlap F1 of a predicted and a target span of positions (both inclusive); a span at [CLS] (0, no
// answer) scores only an exact prediction.
double span_f1(int32_t start, int32_t end, int32_t target_start, int32_t target_end) {
  if (target_start == 0 || start == 0) return start == target_start && end == target_end ? 1.0 : 0.0;
  const int32_t overlap = std::min(end, target_end) - std::max(start, target_start) + 1;
  if (end < start || overlap <= 0) return 0.0;
  const double precision = double(overlap) / (end - start + 1),
               recall = double(overlap) / (target_end - target_start + 1);
  return 2 * precision * recall / (precision + recall);
}
}  // namespace

void TaskMetrics::add(std::span<const int32_t> predicted, std::span<const int32_t> targets, double loss) {
  const auto n = static_cast<int64_t>(targets.size());
  if (n == 0) return;
  if (spans) {
    BERT_CHECK(n % 2 == 0 && predicted.size() == targets.size(), "TaskMetrics: spans come as (start, end) pairs");
    for (int64_t i = 0; i < n; i += 2) {
      const bool start = predicted[i] == targets[i], end = predicted[i + 1] == targets[i + 1];
      start_correct += start, end_correct += end, exact += start && end;
      span_f1_sum += span_f1(predicted[i], predicted[i + 1], targets[i], targets[i + 1]);
      ++target_spans[{targets[i], targets[i + 1]}];
    }
    examples += n / 2;
    loss_sum += loss * (n / 2);
    return;
  }
  for (int64_t i = 0; i < n; ++i) ++confusion[targets[i] * num_labels + predicted[i]];
  examples += n;
  loss_sum += loss * n;
}

void TaskMetrics::add_scores(std::span<const float> predicted, std::span<const float> targets, double loss,
                             std::span<const int64_t> example_groups) {
  BERT_CHECK(regression && predicted.size() == targets.size(), "TaskMetrics: a score per target");
  BERT_CHECK(example_groups.empty() ? groups.empty()
                                    : example_groups.size() == targets.size() && groups.size() == scored.size(),
             "TaskMetrics: every scored example has a group, or none does");
  groups.insert(groups.end(), example_groups.begin(), example_groups.end());
  for (size_t i = 0; i < targets.size(); ++i) scored.emplace_back(predicted[i], targets[i]);
  examples += static_cast<int64_t>(targets.size());
  loss_sum += loss * static_cast<double>(targets.size());
}

namespace {
// Pearson's correlation of the pairs' first and second values (0 where either is constant).
double correlation(std::span<const std::pair<double, double>> v) {
  if (v.size() < 2) return 0.0;
  double mx = 0, my = 0;
  for (const auto& [x, y] : v) mx += x, my += y;
  mx /= double(v.size()), my /= double(v.size());
  double sxy = 0, sxx = 0, syy = 0;
  for (const auto& [x, y] : v) sxy += (x - mx) * (y - my), sxx += (x - mx) * (x - mx), syy += (y - my) * (y - my);
  return sxx > 0 && syy > 0 ? sxy / std::sqrt(sxx * syy) : 0.0;
}
// Each value's rank among `values` from 1, ties given their mean rank.
std::vector<double> ranks(const std::vector<float>& values) {
  std::vector<size_t> order(values.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return values[a] < values[b]; });
  std::vector<double> rank(values.size());
  for (size_t i = 0; i < order.size();) {
    size_t j = i;
    while (j + 1 < order.size() && values[order[j + 1]] == values[order[i]]) ++j;
    for (size_t k = i; k <= j; ++k) rank[order[k]] = (double(i) + double(j)) / 2 + 1;
    i = j + 1;
  }
  return rank;
}
}  // namespace

double TaskMetrics::pearson() const {
  const std::vector<std::pair<double, double>> v(scored.begin(), scored.end());
  return correlation(v);
}

double TaskMetrics::spearman() const {
  std::vector<float> predicted, target;
  for (const auto& [p, t] : scored) predicted.push_back(p), target.push_back(t);
  const std::vector<double> rp = ranks(predicted), rt = ranks(target);
  std::vector<std::pair<double, double>> v;
  for (size_t i = 0; i < rp.size(); ++i) v.emplace_back(rp[i], rt[i]);
  return correlation(v);
}

double TaskMetrics::baseline_mse() const {
  if (scored.empty()) return 0.0;
  double mean = 0, squares = 0;
  for (const auto& [p, t] : scored) mean += t;
  mean /= double(scored.size());
  for (const auto& [p, t] : scored) squares += (t - mean) * (t - mean);
  return squares / double(scored.size());
}

namespace {
// Each group's (predicted, target) scores, in the order they came.
std::map<int64_t, std::vector<std::pair<float, float>>> by_group(const TaskMetrics& m) {
  std::map<int64_t, std::vector<std::pair<float, float>>> groups;
  for (size_t i = 0; i < m.groups.size() && i < m.scored.size(); ++i) groups[m.groups[i]].push_back(m.scored[i]);
  return groups;
}
// A group's targets in the order of its predicted scores, highest first (stable: ties keep their order).
std::vector<double> ranked_targets(std::vector<std::pair<float, float>> group) {
  std::stable_sort(group.begin(), group.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<double> targets;
  for (const auto& [predicted, target] : group) targets.push_back(target);
  return targets;
}
}  // namespace

double TaskMetrics::mrr(int k) const {
  double sum = 0;
  int64_t counted = 0;
  for (const auto& [id, group] : by_group(*this)) {
    const std::vector<double> targets = ranked_targets(group);
    if (std::none_of(targets.begin(), targets.end(), [](double t) { return t > 0; })) continue;
    ++counted;
    for (size_t r = 0; r < targets.size() && r < static_cast<size_t>(k); ++r)
      if (targets[r] > 0) {
        sum += 1.0 / double(r + 1);
        break;
      }
  }
  return counted ? sum / double(counted) : 0.0;
}

double TaskMetrics::ndcg(int k) const {
  double sum = 0;
  int64_t counted = 0;
  for (const auto& [id, group] : by_group(*this)) {
    const std::vector<double> targets = ranked_targets(group);
    std::vector<double> ideal = targets;
    std::sort(ideal.begin(), ideal.end(), std::greater<>());
    double dcg = 0, best = 0;
    for (size_t r = 0; r < targets.size() && r < static_cast<size_t>(k); ++r) {
      dcg += std::max(targets[r], 0.0) / std::log2(double(r + 2));
      best += std::max(ideal[r], 0.0) / std::log2(double(r + 2));
    }
    if (!(best > 0)) continue;
    sum += dcg / best, ++counted;
  }
  return counted ? sum / double(counted) : 0.0;
}

int64_t TaskMetrics::ranked_groups() const {
  int64_t counted = 0;
  for (const auto& [id, group] : by_group(*this))
    counted += std::any_of(group.begin(), group.end(), [](const auto& p) { return p.second > 0; });
  return counted;
}

std::string TaskMetrics::headline() const {
  if (regression) return fmt::format("Pearson {:.4f}", pearson());
  return fmt::format("{} {:.4f}", spans ? "EM" : "acc", accuracy());
}

void TaskMetrics::merge(const TaskMetrics& o) {
  if (num_labels == 0) *this = TaskMetrics(o.num_labels, o.spans), regression = o.regression;
  scored.insert(scored.end(), o.scored.begin(), o.scored.end());
  groups.insert(groups.end(), o.groups.begin(), o.groups.end());
  for (size_t i = 0; i < confusion.size(); ++i) confusion[i] += o.confusion[i];
  examples += o.examples;
  loss_sum += o.loss_sum;
  exact += o.exact, start_correct += o.start_correct, end_correct += o.end_correct;
  span_f1_sum += o.span_f1_sum;
  for (const auto& [span, count] : o.target_spans) target_spans[span] += count;
}

double TaskMetrics::accuracy() const {
  if (spans) return examples ? double(exact) / examples : 0.0;
  int64_t correct = 0;
  for (int64_t l = 0; l < num_labels; ++l) correct += confusion[l * num_labels + l];
  return examples ? double(correct) / examples : 0.0;
}

double TaskMetrics::f1(int64_t label) const {
  int64_t targets = 0, predicted = 0;
  for (int64_t o = 0; o < num_labels; ++o) {
    targets += confusion[label * num_labels + o];
    predicted += confusion[o * num_labels + label];
  }
  const int64_t hits = confusion[label * num_labels + label];
  return targets + predicted ? 2.0 * hits / (targets + predicted) : 0.0;  // 2PR/(P+R) in counts
}

double TaskMetrics::macro_f1() const {
  if (spans) return examples ? span_f1_sum / examples : 0.0;
  double sum = 0;
  int64_t present = 0;
  for (int64_t l = 0; l < num_labels; ++l) {
    int64_t seen = 0;
    for (int64_t o = 0; o < num_labels; ++o) seen += confusion[l * num_labels + o] + confusion[o * num_labels + l];
    if (seen == 0) continue;
    sum += f1(l);
    ++present;
  }
  return present ? sum / present : 0.0;
}

double TaskMetrics::mcc() const {
  if (spans || examples == 0) return 0.0;
  // (c s - sum_k p_k t_k) / sqrt((s^2 - sum_k p_k^2) (s^2 - sum_k t_k^2)), c the correct predictions, s all
  // of them, t_k and p_k how often label k is the target and the prediction. In doubles: s^2 reaches 2^63
  // at 3e9 examples.
  double correct = 0, s = 0, pt = 0, pp = 0, tt = 0;
  for (int64_t k = 0; k < num_labels; ++k) {
    double t = 0, p = 0;
    for (int64_t o = 0; o < num_labels; ++o) {
      t += double(confusion[k * num_labels + o]);
      p += double(confusion[o * num_labels + k]);
    }
    correct += double(confusion[k * num_labels + k]);
    s += t, pt += p * t, pp += p * p, tt += t * t;
  }
  const double denominator = (s * s - pp) * (s * s - tt);
  return denominator > 0 ? (correct * s - pt) / std::sqrt(denominator) : 0.0;
}

double TaskMetrics::majority_accuracy() const {
  int64_t best = 0;
  for (const auto& [span, count] : target_spans) best = std::max(best, count);
  for (int64_t l = 0; l < num_labels; ++l) {
    int64_t count = 0;
    for (int64_t o = 0; o < num_labels; ++o) count += confusion[l * num_labels + o];
    best = std::max(best, count);
  }
  return examples ? double(best) / examples : 0.0;
}

Json TaskMetrics::to_json(const std::vector<std::string>& label_names) const {
  Json j;
  if (regression) {
    j["pearson"] = pearson();
    j["spearman"] = spearman();
    j["mse"] = loss();
    j["examples"] = examples;
    j["baseline_mean_mse"] = baseline_mse();
    if (!groups.empty()) {
      j["mrr_at_10"] = mrr();
      j["ndcg_at_10"] = ndcg();
      j["ranked_groups"] = ranked_groups();
    }
    return j;
  }
  if (spans) {
    j["exact_match"] = accuracy();
    j["token_f1"] = macro_f1();
    j["start_accuracy"] = examples ? double(start_correct) / examples : 0.0;
    j["end_accuracy"] = examples ? double(end_correct) / examples : 0.0;
    j["loss"] = loss();
    j["examples"] = examples;
    j["baseline_majority_accuracy"] = majority_accuracy();
    return j;
  }
  j["accuracy"] = accuracy();
  j["macro_f1"] = macro_f1();
  j["mcc"] = mcc();
  j["loss"] = loss();
  j["examples"] = examples;
  j["baseline_majority_accuracy"] = majority_accuracy();
  Json per_label;
  for (int64_t l = 0; l < num_labels; ++l) {
    int64_t support = 0;
    for (int64_t o = 0; o < num_labels; ++o) support += confusion[l * num_labels + o];
    Json entry;
    entry["f1"] = f1(l);
    entry["support"] = support;
    per_label[l < static_cast<int64_t>(label_names.size()) ? label_names[l] : std::to_string(l)] = entry;
  }
  j["per_label"] = per_label;
  return j;
}

namespace {
template <typename Metrics>
Metrics evaluate_into(Metrics metrics, model::Bert& model, data::ShardLoader& loader, int64_t max_batches,
                      Graph<float>& g, bool cuda_graphs, ExamplePredictions* predictions = nullptr) {
  BatchEvaluator evaluator(model, g, cuda_graphs);
  Batch batch;
  auto take = [&](const OutputReads& r) {
    r.add_to(metrics);
    if (predictions) predictions->add(r);
  };
  for (int64_t n = 0; (max_batches <= 0 || n < max_batches) && loader.next(batch); ++n)
    if (const OutputReads* r = evaluator.queue(batch.view())) take(*r);
  if (const OutputReads* r = evaluator.finish()) take(*r);
  g.clear();
  return metrics;
}
}  // namespace

TaskMetrics evaluate_task(model::Bert& model, data::ShardLoader& loader, int64_t max_batches, Graph<float>& g,
                          bool cuda_graphs, ExamplePredictions* predictions) {
  return evaluate_into(TaskMetrics::for_head(model.config()), model, loader, max_batches, g, cuda_graphs, predictions);
}

PretrainingMetrics evaluate(model::Bert& model, data::ShardLoader& loader, int64_t max_batches, Graph<float>& g,
                            bool cuda_graphs) {
  return evaluate_into(PretrainingMetrics{}, model, loader, max_batches, g, cuda_graphs);
}

}  // namespace bert::eval
