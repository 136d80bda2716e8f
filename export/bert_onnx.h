// ONNX export of BERT with its head: FP32, or explicit Q/DQ at exactly the model's enabled quantizers
// (docs/export.md). Inputs input_ids, attention_mask, token_type_ids (int64, dynamic batch and
// sequence); outputs, as Hugging Face's ONNX exports name them: prediction_logits [B, T, V] and
// seq_relationship_logits [B, 2] (pretraining), logits [B, num_labels] (sequence classification) or
// logits [B, T, num_labels] (token classification).
// Node and tensor names follow the model's module names.
#pragma once

#include <onnx/onnx_pb.h>

#include <string>

#include "model/bert.h"
#include "sys/json.h"

namespace bert::exporter {

struct ExportOptions {
  int opset = 17;    // 13 or 17 (17: LayerNorm as one LayerNormalization node)
  bool qdq = false;  // Q/DQ for every enabled quantizer; false: a pure FP32 graph
  // Adds an input masked_lm_positions (int64 [B, P]) and computes prediction_logits [B, P, V] only
  // there, as pretraining and masked-LM evaluation need (pretraining models only).
  bool masked_positions = false;
  Json metadata;  // string-valued entries go to metadata_props (objects are written as JSON)
  void validate() const;
};

onnx::ModelProto export_bert(model::Bert& model, const ExportOptions& options);

// Checks the model with ONNX's checker (full check, with shape inference); UserError with its message.
void check_onnx(const onnx::ModelProto& model);

// Serialises atomically (temporary file, then rename).
void write_onnx(const onnx::ModelProto& model, const std::string& path);
onnx::ModelProto read_onnx(const std::string& path);

}  // namespace bert::exporter
