// bert-export: a checkpoint to ONNX (FP32, or explicit Q/DQ for a QAT/PTQ checkpoint).
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include <filesystem>

#include "core/error.h"
#include "export/bert_onnx.h"
#include "quant/quantize.h"
#include "tools/tool_main.h"
#include "train/checkpoint.h"

int main(int argc, char** argv) {
  using namespace bert;
  std::string checkpoint, output;
  exporter::ExportOptions options;
  CLI::App app{"bert-export: write a checkpoint as ONNX with inputs input_ids, attention_mask, token_type_ids "
               "(int64, dynamic batch and sequence) and outputs prediction_logits, seq_relationship_logits. "
               "--qdq adds QuantizeLinear/DequantizeLinear at the checkpoint's enabled quantizers (INT8, "
               "symmetric, per-channel weights) for TensorRT's explicit INT8 path. The file is checked by the "
               "ONNX checker before it is put in place."};
  app.add_option("--checkpoint", checkpoint, "checkpoint .h5 (or its folder)")->required();
  app.add_option("--onnx", output, "output .onnx file")->required();
  app.add_flag("--qdq", options.qdq, "explicit quantization: Q/DQ at every enabled quantizer");
  app.add_option("--opset", options.opset, "ONNX opset: 17 (LayerNormalization) or 13")->capture_default_str();
  std::string plan;
  app.add_option("--plan", plan, "sensitivity plan: its quantizers stay in float (no Q/DQ)");
  CLI11_PARSE(app, argc, argv);
  return tools::run_tool([&] {
    namespace fs = std::filesystem;
    if (fs::is_directory(checkpoint)) checkpoint = (fs::path(checkpoint) / "checkpoint.h5").string();
    model::BertForPreTraining model(train::read_checkpoint_config(checkpoint));
    const train::TrainingState state = train::load_checkpoint(checkpoint, model, nullptr);
    if (!plan.empty())
      for (const std::string& name : quant::read_plan(plan, model))
        for (model::Quantizer* q : model.quantizers())
          if (q->name == name) q->mode = model::QuantMode::kFloat;
    int enabled = 0;
    for (model::Quantizer* q : model.quantizers()) enabled += q->mode == model::QuantMode::kQuantize;
    if (options.qdq && enabled == 0)
      throw UserError("--qdq: checkpoint '" + checkpoint + "' has no enabled quantizers (train with --qat first)");
    options.metadata["model_config"] = model.config().to_json().dump();
    options.metadata["quantization"] = state.quantization.dump();
    options.metadata["tokenizer_sha256"] = state.tokenizer_sha256;
    options.metadata["framework"] = "bert-qat 0.1.0";
    onnx::ModelProto m = exporter::export_bert(model, options);
    exporter::check_onnx(m);
    exporter::write_onnx(m, output);
    spdlog::info("wrote {} ({} nodes, {} initializers, opset {}, {}{})", output, m.graph().node_size(),
                 m.graph().initializer_size(), options.opset, options.qdq ? "Q/DQ, " : "FP32",
                 options.qdq ? std::to_string(enabled) + " quantizers" : "");
    return 0;
  });
}
