#include "eval/metrics.h"

#include <algorithm>

#include "core/ops.h"

namespace bert::eval {

void PretrainingMetrics::add(const Graph<float>& g, const model::PretrainingOutputs& out,
                             const model::BertBatch& batch) {
  const int64_t m = static_cast<int64_t>(out.mlm_targets.size());
  if (m > 0) {
    const std::vector<int32_t> predicted = ops::row_argmax(g, out.mlm_logits);
    for (int64_t i = 0; i < m; ++i) {
      mlm_correct += predicted[i] == out.mlm_targets[i];
      ++target_counts[out.mlm_targets[i]];
    }
    predictions += m;
    mlm_loss_sum += double(g.item(out.mlm_loss)) * m;
  }
  if (!batch.next_sentence_labels.empty()) {
    const std::vector<int32_t> predicted = ops::row_argmax(g, out.nsp_logits);
    for (int64_t i = 0; i < batch.batch; ++i) {
      nsp_correct += predicted[i] == batch.next_sentence_labels[i];
      nsp_random_next += batch.next_sentence_labels[i];
    }
    sequences += batch.batch;
    nsp_loss_sum += double(g.item(out.nsp_loss)) * batch.batch;
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

PretrainingMetrics evaluate(model::BertForPreTraining& model, data::ShardLoader& loader, int64_t max_batches,
                            Graph<float>& g) {
  NoGradGuard<float> no_grad(g);
  PretrainingMetrics metrics;
  data::Batch batch;
  Rng unused(0);  // dropout is off in evaluation and draws nothing
  for (int64_t n = 0; (max_batches <= 0 || n < max_batches) && loader.next(batch); ++n) {
    const model::BertBatch b = quant::as_model_batch(batch);
    model::PretrainingOutputs out = model.forward(g, b, /*training=*/false, unused);
    metrics.add(g, out, b);
    g.clear();
  }
  return metrics;
}

}  // namespace bert::eval
