// bert-export: a checkpoint to ONNX (FP32, or explicit Q/DQ for a QAT/PTQ checkpoint), or to a Hugging Face model
// directory.
#include <CLI/CLI.hpp>

#include "export/export_checkpoint.h"
#include "ort/runner.h"
#include "sys/error.h"
#include "sys/openmp_wait.h"
#include "tools/tool_main.h"

namespace {

using namespace bert;

struct Args {
  exporter::ExportRequest request;
  std::string report;  // --report: an ONNX file to report on instead of exporting
  Args() { request.cache.ort_script = ort::default_ort_script(); }
};

void add_options(CLI::App& app, Args& a) {
  app.description(
      "bert-export: write a checkpoint as ONNX with inputs input_ids, attention_mask, token_type_ids "
      "(int64, dynamic batch and sequence) and outputs prediction_logits, seq_relationship_logits. "
      "--qdq adds QuantizeLinear/DequantizeLinear at the checkpoint's enabled quantizers (INT8, "
      "symmetric, per-channel weights) for TensorRT's explicit INT8 path. The file is checked by the "
      "ONNX checker before it is put in place.");
  app.footer(
      "Examples:\n"
      "  bert-export --checkpoint runs/mini --onnx fp32.onnx\n"
      "  bert-export --checkpoint runs/qat --onnx int8.onnx --qdq --masked-positions\n"
      "  bert-export --checkpoint runs/mini --onnx fp32.onnx --trt-calib-cache fp32.cache --calib-shards shards/\n"
      "  bert-export --checkpoint runs/qat --onnx int8.onnx --qdq --triton-repo triton/\n"
      "  bert-export --checkpoint runs/qat --hf bert-qat-int8                # a Hugging Face directory\n"
      "  bert-export --report int8.onnx     # what TensorRT can run in INT8 (any exporter's Q/DQ BERT)\n"
      "Guide: docs/export.md");
  app.add_option("--checkpoint", a.request.checkpoint,
                 "checkpoint .h5, its run folder, or a Hugging Face model directory (needed unless --report)");
  app.add_option("--report", a.report,
                 "print the fusion report of this Q/DQ ONNX file (any exporter's BERT encoder) and export nothing: "
                 "per encoder layer, which GEMMs and attention matmuls TensorRT can run in INT8, whether Q, K and "
                 "V share one input scale, whether its fused INT8 attention pattern is complete, and where a "
                 "missing Q/DQ leaves FP16 with reformat kernels. A --qdq export prints the same for its file")
      ->check(CLI::ExistingFile);
  app.add_option("--report-json", a.request.report_json, "also write the fusion report as JSON to this file");
  app.add_option("--onnx", a.request.onnx_path, "output .onnx file");
  app.add_option("--hf", a.request.hf_dir,
                 "also (or only) write a Hugging Face model directory: config.json + model.safetensors "
                 "(+ quantization.json with the learned scales of a QAT/PTQ model) + the tokenizer");
  app.add_flag("--qdq", a.request.options.qdq, "explicit quantization: Q/DQ at every enabled quantizer");
  app.add_flag("--masked-positions", a.request.options.masked_positions,
               "extra input masked_lm_positions [B, P]: prediction_logits only there ([B, P, V])");
  app.add_option("--opset", a.request.options.opset, "ONNX opset: 17 (LayerNormalization) or 13")
      ->capture_default_str();
  app.add_option("--triton-repo", a.request.triton_repo,
                 "also write a Triton Inference Server model repository here "
                 "(<repo>/<name>/1/model.onnx + config.pbtxt, ONNX Runtime backend)");
  app.add_option("--triton-name", a.request.triton_name,
                 "model name in the Triton repository (default: the --onnx file's stem)");
  app.add_option("--triton-max-batch", a.request.triton_max_batch, "Triton max_batch_size")->capture_default_str();
  app.add_option("--trt-calib-cache", a.request.trt_cache_path,
                 "also write TensorRT's calibration cache (implicit INT8 path) for the FP32 graph: every float "
                 "activation tensor, calibrated in ONNX Runtime on --calib-shards");
  app.add_option("--calib-shards", a.request.calib_shards, "calibration shards for --trt-calib-cache")->expected(1, -1);
  app.add_option("--calibrator", a.request.cache.calibrator,
                 "--trt-calib-cache's calibrator: max | percentile | entropy | mse. max (TensorRT's "
                 "MinMaxCalibration) is NVIDIA's advice for NLP models and holds on BERT; entropy (TensorRT's "
                 "default for CNNs) can clip BERT's rare large activations. Softmax and tanh outputs (known "
                 "range) keep their whole range, amax 1, under every method")
      ->capture_default_str();
  app.add_option("--percentile", a.request.cache.percentile, "percentile for --calibrator percentile")
      ->capture_default_str();
  app.add_option("--calib-batches", a.request.cache.batches, "calibration batches")->capture_default_str();
  app.add_option("--calib-batch-size", a.request.calib_batch_size, "sequences per calibration batch")
      ->capture_default_str();
  app.add_option("--trt-version", a.request.cache.trt_version,
                 "TensorRT version in the cache header (major*1000+minor*100+patch)")
      ->capture_default_str();
  app.add_option("--ort-script", a.request.cache.ort_script, "the ONNX Runtime runner (scripts/ort_run.js)")
      ->capture_default_str();
  app.add_option("--tokenizer", a.request.tokenizer,
                 "tokenizer to ship with the export (default: the one beside the checkpoint)");
  app.add_option("--plan", a.request.plan, "sensitivity plan: its quantizers stay in float (no Q/DQ)");
}

int run(Args& a) {
  if (!a.report.empty()) {
    if (!a.request.checkpoint.empty() || !a.request.onnx_path.empty())
      throw UserError("--report reads an ONNX file and exports nothing: not with --checkpoint or --onnx");
    exporter::write_fusion_report(exporter::fusion_report(exporter::read_onnx(a.report), a.report),
                                  a.request.report_json);
    return 0;
  }
  if (a.request.checkpoint.empty()) throw UserError("--checkpoint is required (or --report MODEL.onnx)");
  exporter::export_checkpoint(a.request);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bert::wait_passively_unless_chosen(argv);  // first: it may re-execute the program
  Args args;
  CLI::App app;
  add_options(app, args);
  CLI11_PARSE(app, argc, argv);
  return bert::tools::run_tool([&] { return run(args); });
}
