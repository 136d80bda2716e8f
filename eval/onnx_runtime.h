// Evaluating an exported ONNX model in ONNX Runtime (through scripts/ort_run.js and node, out of
// process: this library never links ONNX or protobuf). The model must have been exported with
// --masked-positions. Only accuracies come back (predictions, not logits): losses stay 0.
#pragma once

#include <string>

#include "data/loader.h"
#include "eval/metrics.h"

namespace bert::eval {

// `script` is scripts/ort_run.js; `work_dir` holds the exchanged JSON files.
PretrainingMetrics evaluate_onnx(const std::string& onnx_path, data::ShardLoader& loader, int64_t max_batches,
                                 const std::string& script, const std::string& work_dir);

}  // namespace bert::eval
