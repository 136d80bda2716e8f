// Pretraining metrics: masked-LM accuracy and loss over the real (non-padding) predictions, NSP
// accuracy and loss over all sequences, and the baselines printed beside them (the most-frequent-token
// accuracy and the NSP majority class), plus evaluation over shards.
#pragma once

#include <cstdint>
#include <unordered_map>

#include "core/graph.h"
#include "core/json.h"
#include "data/loader.h"
#include "model/bert.h"
#include "quant/model_batch.h"

namespace bert::eval {

struct PretrainingMetrics {
  int64_t predictions = 0, mlm_correct = 0;
  double mlm_loss_sum = 0;
  int64_t sequences = 0, nsp_correct = 0, nsp_random_next = 0;
  double nsp_loss_sum = 0;
  std::unordered_map<int32_t, int64_t> target_counts;  // for the most-frequent-token baseline

  // Adds one forward pass's outputs (values read from the graph; call before backward()).
  void add(const Graph<float>& g, const model::PretrainingOutputs& out, const model::BertBatch& batch);
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

// Evaluates without gradients or dropout over the loader's batches (at most max_batches; <= 0 = all).
PretrainingMetrics evaluate(model::BertForPreTraining& model, data::ShardLoader& loader, int64_t max_batches,
                            Graph<float>& g);

}  // namespace bert::eval
