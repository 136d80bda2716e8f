#include "eval/onnx_runtime.h"

#include "ort/runner.h"

namespace bert::eval {

PretrainingMetrics evaluate_onnx(const std::string& onnx_path, data::ShardLoader& loader, int64_t max_batches,
                                 const std::string& script, const std::string& work_dir) {
  const std::vector<Batch> batches = ort::take_batches(loader, max_batches);
  const Json results = ort::run_onnx_runtime(script, "--argmax", onnx_path, ort::batch_feeds(batches, true), work_dir);
  PretrainingMetrics m;
  for (size_t b = 0; b < batches.size(); ++b) {
    const Batch& bt = batches[b];
    const Json& r = results.as_array().at(b);
    const Json* mlm_output = r.find("prediction_logits");
    if (!mlm_output || mlm_output->find("dims")->as_array().size() != 2)
      throw UserError("'" + onnx_path + "' does not take masked_lm_positions: export it with --masked-positions");
    const auto& mlm = mlm_output->find("data")->as_array();
    const auto& nsp = r.find("seq_relationship_logits")->find("data")->as_array();
    for (int64_t i = 0; i < bt.size; ++i) {
      for (int64_t j = 0; j < bt.max_predictions; ++j) {
        const int64_t k = i * bt.max_predictions + j;
        if (bt.masked_lm_positions[k] == 0) break;
        m.mlm_correct += mlm.at(k).as_int() == bt.masked_lm_ids[k];
        ++m.target_counts[bt.masked_lm_ids[k]];
        ++m.predictions;
      }
      m.nsp_correct += nsp.at(i).as_int() == bt.next_sentence_labels[i];
      m.nsp_random_next += bt.next_sentence_labels[i];
      ++m.sequences;
    }
  }
  return m;
}

TaskMetrics evaluate_onnx_task(const std::string& onnx_path, data::ShardLoader& loader, const model::BertConfig& config,
                               int64_t max_batches, const std::string& script, const std::string& work_dir) {
  const std::vector<Batch> batches = ort::take_batches(loader, max_batches);
  const Json results = ort::run_onnx_runtime(script, "--argmax", onnx_path, ort::batch_feeds(batches, false), work_dir);
  const bool per_token = loader.kind() == data::ShardKind::kTokenLabels;
  const int64_t num_labels = config.num_labels();
  TaskMetrics m = TaskMetrics::for_head(config);
  for (size_t b = 0; b < batches.size(); ++b) {
    const Batch& bt = batches[b];
    if (m.spans) {  // each sequence's most likely start and end: the argmax of start_logits and end_logits
      const Json &r = results.as_array().at(b), *start = r.find("start_logits"), *end = r.find("end_logits");
      if (!start || !end || start->find("dims")->as_array().size() != 1 || end->find("dims")->as_array().size() != 1)
        throw UserError("'" + onnx_path +
                        "' has no [B, T] outputs 'start_logits' and 'end_logits': not an export of a "
                        "question-answering model");
      std::vector<int32_t> predicted;
      for (int64_t i = 0; i < bt.size; ++i)
        for (const Json* output : {start, end})
          predicted.push_back(static_cast<int32_t>(output->find("data")->as_array().at(i).as_int()));
      m.add(predicted, std::span<const int32_t>(bt.labels.data(), 2 * bt.size), 0.0);
      continue;
    }
    const Json* output = results.as_array().at(b).find("logits");
    if (!output || output->find("dims")->as_array().size() != (per_token ? 2u : 1u))
      throw UserError("'" + onnx_path + "' has no " + (per_token ? "[B, T, labels]" : "[B, labels]") +
                      " output 'logits': not an export of a " + (per_token ? "token" : "sequence") +
                      "-classification model");
    const auto& predicted = output->find("data")->as_array();
    for (size_t i = 0; i < bt.labels.size(); ++i) {
      if (bt.labels[i] == kIgnoredLabel) continue;
      const int64_t p = predicted.at(i).as_int();
      if (p < 0 || p >= num_labels) throw UserError("'" + onnx_path + "' predicts label " + std::to_string(p));
      ++m.confusion[bt.labels[i] * num_labels + p];
      ++m.examples;
    }
  }
  return m;
}

}  // namespace bert::eval
