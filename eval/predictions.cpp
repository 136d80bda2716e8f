#include "eval/predictions.h"

#include <fmt/format.h>

#include <cstdlib>

#include "sys/error.h"

namespace bert::eval {

namespace {
// A float as the double its shortest decimal form reads as, so that the JSON holds 2.5253022, not the
// widened 2.5253021717071533.
double shortest(float v) { return std::strtod(fmt::format("{}", v).c_str(), nullptr); }
}  // namespace

void ExamplePredictions::add(const OutputReads& r) {
  const std::vector<float> values = r.head_values();
  const std::vector<int32_t> predicted = r.head_predictions();
  const std::vector<std::string>& names = config_.labels;
  auto name = [&](int32_t id) { return id >= 0 && id < config_.num_labels() ? names[id] : std::to_string(id); };
  if (config_.regression()) {
    for (int64_t i = 0; i < r.head_rows; ++i) {
      Json j;
      j["index"] = sequences_ + i;
      j["score"] = shortest(values[i]);
      if (i < static_cast<int64_t>(r.task_scores.size())) j["target"] = shortest(r.task_scores[i]);
      if (i < static_cast<int64_t>(r.task_groups.size())) j["group"] = r.task_groups[i];
      examples_.push_back(std::move(j));
    }
  } else if (config_.head == model::Head::kSequenceClassification) {
    for (int64_t i = 0; i < r.head_rows; ++i) {
      Json j;
      j["index"] = sequences_ + i;
      j["label"] = name(predicted[i]);
      if (i < static_cast<int64_t>(r.task_targets.size())) j["target"] = name(r.task_targets[i]);
      Json::Array logits;
      for (int64_t c = 0; c < r.head_cols; ++c) logits.emplace_back(shortest(values[i * r.head_cols + c]));
      j["logits"] = logits;
      examples_.push_back(std::move(j));
    }
  } else if (config_.head == model::Head::kTokenClassification) {
    // Rows are the labeled tokens (every real token without labels), b * T + position, in order.
    BERT_CHECK(static_cast<int64_t>(r.task_rows.size()) == r.head_rows && r.seq_len > 0,
               "ExamplePredictions: the token rows were not read");
    std::vector<Json> lines(static_cast<size_t>(r.batch));
    for (int64_t b = 0; b < r.batch; ++b) {
      lines[b]["index"] = sequences_ + b;
      lines[b]["tags"] = Json::Array{};
      lines[b]["targets"] = Json::Array{};
    }
    for (int64_t i = 0; i < r.head_rows; ++i) {
      Json& line = lines.at(static_cast<size_t>(r.task_rows[i] / r.seq_len));
      line["tags"].as_array().emplace_back(name(predicted[i]));
      if (i < static_cast<int64_t>(r.task_targets.size()))
        line["targets"].as_array().emplace_back(name(r.task_targets[i]));
    }
    for (Json& line : lines) examples_.push_back(std::move(line));
  } else if (config_.head == model::Head::kQuestionAnswering) {  // rows: each sequence's start, then its end
    for (int64_t i = 0; 2 * i + 1 < r.head_rows; ++i) {
      Json j;
      j["index"] = sequences_ + i;
      j["start"] = predicted[2 * i];
      j["end"] = predicted[2 * i + 1];
      if (2 * i + 1 < static_cast<int64_t>(r.task_targets.size()))
        j["target_start"] = r.task_targets[2 * i], j["target_end"] = r.task_targets[2 * i + 1];
      examples_.push_back(std::move(j));
    }
  } else {
    throw UserError("--predictions: a pretraining model has no task predictions (fill-mask: --fill-mask)");
  }
  sequences_ += r.batch;
}

std::string ExamplePredictions::jsonl() const {
  std::string text;
  for (const Json& j : examples_) text += j.dump() + "\n";
  return text;
}

}  // namespace bert::eval
