// bert-export: a checkpoint to ONNX (FP32, or explicit Q/DQ for a QAT/PTQ checkpoint), or to a Hugging Face model
// directory.
#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>

#include <filesystem>

#include "core/atomic_file.h"
#include "core/error.h"
#include "core/process.h"
#include "data/sha256.h"
#include "data/wordpiece_tokenizer.h"
#include "export/bert_onnx.h"
#include "export/qdq_rules.h"
#include "export/triton.h"
#include "export/trt_cache.h"
#include "ort/runner.h"
#include "quant/quantize.h"
#include "store/checkpoint.h"
#include "store/hf_checkpoint.h"
#include "store/model_source.h"
#include "tools/tool_main.h"

namespace {

using namespace bert;
namespace fs = std::filesystem;

struct Args {
  std::string checkpoint, output, hf_dir, plan, tokenizer, cache_path, triton_repo, triton_name;
  exporter::ExportOptions options;
  int triton_max_batch = 64;
  std::vector<std::string> calib_shards;
  exporter::CacheOptions cache;
  int64_t calib_batch_size = 32;
  Args() { cache.ort_script = ort::default_ort_script(); }
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
      "Guide: docs/export.md");
  app.add_option("--checkpoint", a.checkpoint, "checkpoint .h5, its run folder, or a Hugging Face model directory")
      ->required();
  app.add_option("--onnx", a.output, "output .onnx file");
  app.add_option("--hf", a.hf_dir,
                 "also (or only) write a Hugging Face model directory: config.json + model.safetensors "
                 "(+ quantization.json with the learned scales of a QAT/PTQ model) + the tokenizer");
  app.add_flag("--qdq", a.options.qdq, "explicit quantization: Q/DQ at every enabled quantizer");
  app.add_flag("--masked-positions", a.options.masked_positions,
               "extra input masked_lm_positions [B, P]: prediction_logits only there ([B, P, V])");
  app.add_option("--opset", a.options.opset, "ONNX opset: 17 (LayerNormalization) or 13")->capture_default_str();
  app.add_option("--triton-repo", a.triton_repo,
                 "also write a Triton Inference Server model repository here "
                 "(<repo>/<name>/1/model.onnx + config.pbtxt, ONNX Runtime backend)");
  app.add_option("--triton-name", a.triton_name,
                 "model name in the Triton repository (default: the --onnx file's stem)");
  app.add_option("--triton-max-batch", a.triton_max_batch, "Triton max_batch_size")->capture_default_str();
  app.add_option("--trt-calib-cache", a.cache_path,
                 "also write TensorRT's calibration cache (implicit INT8 path) for the FP32 graph: every float "
                 "activation tensor, calibrated in ONNX Runtime on --calib-shards");
  app.add_option("--calib-shards", a.calib_shards, "calibration shards for --trt-calib-cache")->expected(1, -1);
  app.add_option("--calibrator", a.cache.calibrator, "max | percentile | entropy | mse")->capture_default_str();
  app.add_option("--percentile", a.cache.percentile, "percentile for --calibrator percentile")->capture_default_str();
  app.add_option("--calib-batches", a.cache.batches, "calibration batches")->capture_default_str();
  app.add_option("--calib-batch-size", a.calib_batch_size, "sequences per calibration batch")->capture_default_str();
  app.add_option("--trt-version", a.cache.trt_version,
                 "TensorRT version in the cache header (major*1000+minor*100+patch)")
      ->capture_default_str();
  app.add_option("--ort-script", a.cache.ort_script, "the ONNX Runtime runner (scripts/ort_run.js)")
      ->capture_default_str();
  app.add_option("--tokenizer", a.tokenizer,
                 "tokenizer to ship with the export (default: the one beside the checkpoint)");
  app.add_option("--plan", a.plan, "sensitivity plan: its quantizers stay in float (no Q/DQ)");
}

// The tokenizer shipped with the export: the one given or beside the checkpoint, and the one it was
// trained with. Returns its SHA-256.
std::string check_tokenizer(const std::string& tokenizer, const store::TrainingState& state) {
  if (tokenizer.empty() || !fs::exists(tokenizer))
    throw UserError("--tokenizer: '" + tokenizer + "' does not exist (the tokenizer the model was trained with)");
  const std::string hash = data::sha256_file(tokenizer);
  if (!state.tokenizer_sha256.empty() && hash != state.tokenizer_sha256)
    throw UserError("--tokenizer: '" + tokenizer + "' is not the tokenizer the checkpoint was trained with");
  return hash;
}

void write_hugging_face(const Args& a, model::Bert& model, const store::TrainingState& state, int enabled) {
  const bool wordpiece = data::is_wordpiece_vocab(a.tokenizer);
  hf::export_model(a.hf_dir, model, state.quantization);
  data::copy_tokenizer(a.tokenizer, a.hf_dir);
  spdlog::info("wrote Hugging Face model {} (config.json, model.safetensors{}, {}){}", a.hf_dir,
               enabled ? ", quantization.json" : "", wordpiece ? "vocab.txt" : "tokenizer.model",
               wordpiece ? ""
                         : "; transformers' BertTokenizer reads only WordPiece vocabularies, so load "
                           "tokenizer.model with the sentencepiece package");
}

// Requests that cannot be met by this checkpoint.
void check_onnx_request(const Args& a, int enabled) {
  if (a.options.qdq && enabled == 0)
    throw UserError("--qdq: checkpoint '" + a.checkpoint + "' has no enabled quantizers (train with --qat first)");
  if (!a.cache_path.empty() && a.options.qdq)
    throw UserError(
        "--trt-calib-cache with --qdq: TensorRT ignores calibration for a network with Q/DQ nodes; "
        "write the cache for an FP32 export (without --qdq)");
  if (!a.cache_path.empty() && enabled > 0)
    throw UserError("--trt-calib-cache: checkpoint '" + a.checkpoint + "' has " + std::to_string(enabled) +
                    " enabled quantizers (QAT or PTQ); the implicit path would calibrate the float graph again and "
                    "drop their scales. Deploy it with --qdq (explicit INT8), or write the cache from an FP32 "
                    "checkpoint");
  if (!a.cache_path.empty() && a.calib_shards.empty())
    throw UserError("--trt-calib-cache needs --calib-shards (real batches to calibrate on)");
}

// The export's metadata: the model config, quantization recipe and quantizers, the tokenizer's hash and file.
void describe_in_metadata(exporter::ExportOptions& options, model::Bert& model, const store::TrainingState& state,
                          const std::string& tokenizer_hash, const fs::path& tokenizer_copy) {
  options.metadata["model_config"] = model.config().to_json().dump();
  options.metadata["quantization"] = state.quantization.dump();
  Json::Array enabled_names;
  if (options.qdq)
    for (const std::string& name : model.enabled_quantizer_names()) enabled_names.emplace_back(name);
  options.metadata["quantizers_enabled"] = Json(enabled_names).dump();
  options.metadata["tokenizer_sha256"] = tokenizer_hash;
  options.metadata["tokenizer_file"] = tokenizer_copy.filename().string();
  options.metadata["source_checkpoint_step"] = std::to_string(state.step);
  options.metadata["framework"] = "bert-qat 0.1.0";
}

// --trt-calib-cache: the FP32 graph's activations calibrated in ONNX Runtime, as TensorRT's cache.
void write_trt_cache(Args& a, model::Bert& model) {
  data::LoaderOptions lo;
  lo.shards = data::expand_shard_paths(a.calib_shards);
  lo.batch_size = a.calib_batch_size;
  lo.repeat = false;
  data::ShardLoader loader(lo);
  for (model::Quantizer* q : model.quantizers()) q->mode = model::QuantMode::kFloat;  // the FP32 graph
  exporter::ExportOptions fp32_options;  // the graph written, so the cache covers exactly its tensors
  fp32_options.opset = a.options.opset;
  fp32_options.masked_positions = a.options.masked_positions;
  a.cache.masked_positions = a.options.masked_positions;
  const onnx::ModelProto fp32 = exporter::export_bert(model, fp32_options);
  const PrivateTempDir work("bert-export");  // this run's own exchange files
  a.cache.work_dir = work.path().string();
  const auto amax = exporter::calibrate_tensors(fp32, loader, a.cache);
  exporter::write_trt_cache(a.cache_path, amax, a.cache);
  spdlog::info("wrote TensorRT calibration cache {} ({} tensors of the FP32 graph, {} calibrator, {} batches)",
               a.cache_path, amax.size(), a.cache.calibrator, a.cache.batches);
  if (a.cache.calibrator == "percentile" || a.cache.calibrator == "mse")
    spdlog::info(
        "its header says EntropyCalibration2: TensorRT has no {} calibrator class, so serve the cache "
        "through an IInt8EntropyCalibrator2 whose readCalibrationCache returns this file",
        a.cache.calibrator);
}

int run(Args& a) {
  if (a.output.empty() && a.hf_dir.empty()) throw UserError("nothing to do: give --onnx FILE and/or --hf DIR");
  const store::ModelSource source = store::find_model(a.checkpoint);
  a.checkpoint = source.path;
  model::Bert model(store::read_model_config(source));
  const store::TrainingState state = store::load_model(source, model);
  if (!a.plan.empty())
    for (const std::string& name : quant::read_plan(a.plan, model))
      model.find_quantizer(name)->mode = model::QuantMode::kFloat;
  const int enabled = static_cast<int>(model.enabled_quantizers().size());
  if (a.tokenizer.empty()) a.tokenizer = source.tokenizer;
  const std::string tokenizer_hash = check_tokenizer(a.tokenizer, state);
  if (!a.hf_dir.empty()) {
    write_hugging_face(a, model, state, enabled);
    if (a.output.empty()) return 0;
  }
  check_onnx_request(a, enabled);
  // The tokenizer travels with the export: copied beside it, its hash in the metadata.
  const fs::path output_path(a.output);
  if (output_path.has_parent_path()) fs::create_directories(output_path.parent_path());
  const bool wordpiece = data::is_wordpiece_vocab(a.tokenizer);
  const fs::path tokenizer_copy =
      output_path.parent_path() / (output_path.stem().string() + (wordpiece ? ".vocab.txt" : ".tokenizer.model"));
  describe_in_metadata(a.options, model, state, tokenizer_hash, tokenizer_copy);
  const onnx::ModelProto m = exporter::export_bert(model, a.options);

  // Write to a temporary file, check what was written, and only then put it in place.
  AtomicFile file(a.output);
  exporter::write_onnx(m, file.temp_path());
  const onnx::ModelProto written = exporter::read_onnx(file.temp_path());
  exporter::check_onnx(written);
  if (a.options.qdq) {
    const auto violations = exporter::check_qdq_rules(written);
    if (!violations.empty())
      throw UserError("the Q/DQ export breaks TensorRT's rules; nothing was written:\n" +
                      exporter::describe(violations));
  }
  if (!a.cache_path.empty()) write_trt_cache(a, model);
  if (!a.triton_repo.empty()) {
    const std::string name = a.triton_name.empty() ? output_path.stem().string() : a.triton_name;
    const std::string folder = exporter::write_triton_repository(written, a.triton_repo, name, a.triton_max_batch);
    const std::string copy = data::copy_tokenizer(a.tokenizer, folder);
    spdlog::info("wrote Triton model repository {} (config.pbtxt, 1/model.onnx, {})", folder,
                 fs::path(copy).filename().string());
  }
  data::copy_tokenizer(a.tokenizer, tokenizer_copy.parent_path().string(), tokenizer_copy.filename().string());
  file.commit();
  spdlog::info("wrote {} ({} nodes, {} initializers, opset {}, {}{}); checker{} passed; tokenizer copied to {}",
               a.output, m.graph().node_size(), m.graph().initializer_size(), a.options.opset,
               a.options.qdq ? "Q/DQ, " : "FP32", a.options.qdq ? std::to_string(enabled) + " quantizers" : "",
               a.options.qdq ? " and TensorRT rules" : "", tokenizer_copy.string());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  CLI::App app;
  add_options(app, args);
  CLI11_PARSE(app, argc, argv);
  return bert::tools::run_tool([&] { return run(args); });
}
