// Which parts of a Q/DQ ONNX BERT TensorRT can run in INT8, read from the graph before any engine is
// built (docs/export.md, "Fusion report"). The rules are TensorRT's documented ones for explicit
// quantization: a GEMM or batched matmul runs in INT8 when both its inputs come from DequantizeLinear
// (through shape-only ops); Q, K and V fuse into one GEMM only when their input has one scale; the fused
// INT8 multi-head attention needs Q/DQ on both inputs of Q K^T, after the softmax and after P V, head
// size 16, 32 or 64 and sequences up to 512; a residual add whose inputs are both quantized fuses with its
// LayerNorm and keeps the tensor between layers in INT8. Anything else runs in FP16 with reformat kernels
// between it and its INT8 neighbours.
#pragma once

#include <onnx/onnx_pb.h>

#include <cstdint>
#include <string>
#include <vector>

#include "sys/json.h"

namespace bert::exporter {

// One product of an encoder layer: a weight GEMM (Q, K, V, attention output, FFN in, FFN out) or an
// attention matmul (Q K^T, P V).
struct ProductCheck {
  std::string role;     // "Q", "K", "V", "Q K^T", "P V", "attention output", "FFN in", "FFN out"
  std::string node;     // the MatMul's (or Gemm's) name
  bool int8 = false;    // both inputs read DequantizeLinear outputs
  std::string missing;  // when not: which input lacks its Q/DQ
};

struct LayerFusion {
  int index = 0;
  std::vector<ProductCheck> products;                      // in the order of ProductCheck::role above
  bool qkv_one_scale = false;                              // Q, K, V read one tensor through Q/DQ of one scale
  int64_t head_size = 0;                                   // 0: unknown (shape inference could not tell)
  bool probs_quantized = false;                            // Q/DQ between the softmax and P V
  bool context_quantized = false;                          // Q/DQ right after P V
  bool attention_fusable = false;                          // the fused INT8 attention's whole pattern and limits
  int residual_inputs = 0, residual_inputs_quantized = 0;  // inputs of the two residual adds
  // Every GEMM and both attention matmuls run in INT8, and Q, K, V share one scale.
  bool int8_ready() const;
};

struct FusionReport {
  std::string model;  // the file (or description) the report is about
  std::vector<LayerFusion> layers;
  int64_t max_length = 0;             // rows of the position embeddings (0: not found)
  std::vector<std::string> findings;  // one line each: what stays in FP16 and why
  // Every layer INT8-ready with its attention fusable (residual inputs are reported, not required).
  bool clean() const;
  std::string text() const;  // a table per layer, the findings and a verdict
  Json to_json() const;
};

// The report for a Q/DQ ONNX BERT encoder (any exporter's). UserError naming `what` when the graph has
// no Softmax-attention encoder layers (not a BERT encoder) or no QuantizeLinear/DequantizeLinear (an FP32
// graph: nothing runs in INT8).
FusionReport fusion_report(const onnx::ModelProto& model, const std::string& what);

}  // namespace bert::exporter
