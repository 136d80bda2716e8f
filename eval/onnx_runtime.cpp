#include "eval/onnx_runtime.h"

#include <optional>

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
                               int64_t max_batches, const std::string& script, const std::string& work_dir,
                               const QuestionScoring* questions, AnswerScores* answers) {
  const std::vector<Batch> batches = ort::take_batches(loader, max_batches);
  TaskMetrics m = TaskMetrics::for_head(config);
  // Questions to score need the logits themselves; otherwise the runner sends back their argmax only.
  const bool raw = (m.spans && questions) || m.regression;  // a regression's scores are its logits
  const Json results =
      ort::run_onnx_runtime(script, raw ? "" : "--argmax", onnx_path, ort::batch_feeds(batches, false), work_dir);
  const bool per_token = loader.kind() == data::ShardKind::kTokenLabels;
  const int64_t num_labels = config.num_labels();
  std::optional<AnswerCollector> collector;
  if (m.spans && questions) {
    QuestionScoring from_the_start = *questions;  // this pass reads the shard from its first batch
    from_the_start.first_window = 0;
    collector.emplace(from_the_start);
  }
  for (size_t b = 0; b < batches.size(); ++b) {
    const Batch& bt = batches[b];
    if (m.spans) {  // each sequence's most likely start and end: the argmax of start_logits and end_logits
      const Json &r = results.as_array().at(b), *start = r.find("start_logits"), *end = r.find("end_logits");
      const size_t rank = raw ? 2 : 1;
      if (!start || !end || start->find("dims")->as_array().size() != rank ||
          end->find("dims")->as_array().size() != rank)
        throw UserError("'" + onnx_path +
                        "' has no [B, T] outputs 'start_logits' and 'end_logits': not an export of a "
                        "question-answering model");
      std::vector<int32_t> predicted;
      std::vector<float> rows;  // (2 B, T): each sequence's start logits, then its end logits
      for (int64_t i = 0; i < bt.size; ++i)
        for (const Json* output : {start, end}) {
          const Json::Array& data = output->find("data")->as_array();
          if (!raw) {
            predicted.push_back(static_cast<int32_t>(data.at(i).as_int()));
            continue;
          }
          int32_t best = 0;  // the first largest, as the runner's --argmax and OutputReads
          for (int64_t j = 0; j < bt.seq_len; ++j) {
            rows.push_back(static_cast<float>(data.at(i * bt.seq_len + j).as_number()));
            if (rows.back() > rows[rows.size() - 1 - j + best]) best = static_cast<int32_t>(j);
          }
          predicted.push_back(best);
        }
      m.add(predicted, std::span<const int32_t>(bt.labels.data(), 2 * bt.size), 0.0);
      if (collector) collector->add(rows, bt.seq_len);
      continue;
    }
    const Json* output = results.as_array().at(b).find("logits");
    if (m.regression) {  // (B, 1): each sequence's score
      if (!output || output->find("dims")->as_array().size() != 2 ||
          output->find("dims")->as_array().at(1).as_int() != 1)
        throw UserError("'" + onnx_path + "' has no [B, 1] output 'logits': not an export of a regression model");
      const auto& data = output->find("data")->as_array();
      std::vector<float> scores;
      for (int64_t i = 0; i < bt.size; ++i) scores.push_back(static_cast<float>(data.at(i).as_number()));
      double squares = 0;
      for (int64_t i = 0; i < bt.size; ++i) squares += double(scores[i] - bt.scores[i]) * (scores[i] - bt.scores[i]);
      m.add_scores(scores, bt.scores, bt.size ? squares / double(bt.size) : 0.0, bt.groups);
      continue;
    }
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
  if (collector && answers) *answers = collector->finish();
  return m;
}

}  // namespace bert::eval
