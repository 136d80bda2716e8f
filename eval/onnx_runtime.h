// Scoring exported ONNX models in ONNX Runtime (through ort/runner.h): MLM/NSP accuracy of a
// pretraining export, accuracy and F1 of a task export, on the same shards as the engine.
#pragma once

#include <string>

#include "data/loader.h"
#include "eval/metrics.h"
#include "eval/squad.h"

namespace bert::eval {

// Accuracy and F1 of a task model's export (output logits; question answering: start_logits and end_logits)
// on task shards (argmax only: the loss stays 0), as TaskMetrics::for_head(config) counts them; with
// `questions`, also each question's answer chosen from the export's logits and scored into `answers`.
TaskMetrics evaluate_onnx_task(const std::string& onnx_path, data::ShardLoader& loader, const model::BertConfig& config,
                               int64_t max_batches, const std::string& script, const std::string& work_dir,
                               const QuestionScoring* questions = nullptr, AnswerScores* answers = nullptr);

// MLM and NSP accuracy of an export made with --masked-positions (argmax only: losses stay 0).
PretrainingMetrics evaluate_onnx(const std::string& onnx_path, data::ShardLoader& loader, int64_t max_batches,
                                 const std::string& script, const std::string& work_dir);

}  // namespace bert::eval
