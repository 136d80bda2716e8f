// The TensorRT/ONNX Runtime rules for explicit-quantization models
// (docs/export.md), checked on a ModelProto: what bert-export verifies before it
// puts a file in place, and what tests assert on every export.
#pragma once

#include <onnx/onnx_pb.h>

#include <string>
#include <vector>

namespace bert::exporter {

struct RuleViolation {
  int rule = 0;      // the rule's number in docs/export.md
  std::string node;  // the offending node (or tensor)
  std::string message;
};

// Every violation of hard rules 1-8 and 10 (rule 9, rounding, is the runtimes' semantics), plus the
// narrow-range check that keeps QuantizeLinear from producing -128 on weights.
std::vector<RuleViolation> check_qdq_rules(const onnx::ModelProto& model);

std::string describe(const std::vector<RuleViolation>& violations);

// The values of a FLOAT, INT8 or UINT8 initializer (raw_data or the typed field), as doubles; empty for
// another type.
std::vector<double> initializer_values(const onnx::TensorProto& t);

}  // namespace bert::exporter
