// Running exported ONNX models in ONNX Runtime, out of process (scripts/ort_run.js under node): this
// library never links ONNX or protobuf. Used to score exports (evaluate_onnx) and to calibrate the
// FP32 graph's tensors for TensorRT's calibration cache.
#pragma once

#include <string>
#include <vector>

#include "core/json.h"
#include "data/loader.h"
#include "eval/metrics.h"

namespace bert::eval {

// The ONNX Runtime runner to use when none is given: $BERT_ORT_SCRIPT, else scripts/ort_run.js (Node) or,
// where there is no node but a python3, scripts/ort_run.py, in the checkout the running program was
// built or unpacked in (found from its own path), else under the current folder.
std::string default_ort_script();

// Up to max_batches (<= 0: all) batches of the loader.
std::vector<data::Batch> take_batches(data::ShardLoader& loader, int64_t max_batches);

// The int64 feeds of the exported graph's inputs, one object per batch (masked_lm_positions when the
// export was made with --masked-positions).
Json batch_feeds(const std::vector<data::Batch>& batches, bool masked_positions);

// Runs `model` on the feeds with `mode` ("" for raw outputs, "--argmax" or "--histograms"; see the
// script; a script ending in .py runs under python3, any other under node) and returns its parsed JSON. UserError with
// ONNX Runtime's message when it fails.
Json run_onnx_runtime(const std::string& script, const std::string& mode, const std::string& model, const Json& feeds,
                      const std::string& work_dir);

// Accuracy and F1 of a task model's export (output logits) on task shards (argmax only: the loss stays 0).
TaskMetrics evaluate_onnx_task(const std::string& onnx_path, data::ShardLoader& loader, int64_t num_labels,
                               int64_t max_batches, const std::string& script, const std::string& work_dir);

// MLM and NSP accuracy of an export made with --masked-positions (argmax only: losses stay 0).
PretrainingMetrics evaluate_onnx(const std::string& onnx_path, data::ShardLoader& loader, int64_t max_batches,
                                 const std::string& script, const std::string& work_dir);

}  // namespace bert::eval
