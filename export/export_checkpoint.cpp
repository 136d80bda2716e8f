#include "export/export_checkpoint.h"

#include <spdlog/spdlog.h>

#include <cstdio>
#include <filesystem>

#include "data/loader.h"
#include "export/qdq_rules.h"
#include "export/triton.h"
#include "quant/quantize.h"
#include "store/checkpoint.h"
#include "store/hf_checkpoint.h"
#include "store/model_source.h"
#include "sys/atomic_file.h"
#include "sys/error.h"
#include "sys/process.h"
#include "sys/sha256.h"
#include "sys/text_file.h"
#include "tokenizer/tokenizer_file.h"

namespace bert::exporter {

namespace fs = std::filesystem;

namespace {

// The tokenizer shipped with the export: the one given or beside the checkpoint, and the one it was
// trained with. Returns its SHA-256.
std::string check_tokenizer(const std::string& tokenizer, const store::TrainingState& state) {
  if (tokenizer.empty() || !fs::exists(tokenizer))
    throw UserError("--tokenizer: '" + tokenizer + "' does not exist (the tokenizer the model was trained with)");
  const std::string hash = sha256_file(tokenizer);
  if (!state.tokenizer_sha256.empty() && hash != state.tokenizer_sha256)
    throw UserError("--tokenizer: '" + tokenizer + "' is not the tokenizer the checkpoint was trained with");
  return hash;
}

void write_hugging_face(const ExportRequest& a, model::Bert& model, const store::TrainingState& state, int enabled) {
  const bool wordpiece = tokenizer::is_wordpiece_vocab(a.tokenizer);
  hf::export_model(a.hf_dir, model, state.quantization);
  tokenizer::copy_tokenizer(a.tokenizer, a.hf_dir);
  spdlog::info("wrote Hugging Face model {} (config.json, model.safetensors{}, {}){}", a.hf_dir,
               enabled ? ", quantization.json" : "", wordpiece ? "vocab.txt" : "tokenizer.model",
               wordpiece ? ""
                         : "; transformers' BertTokenizer reads only WordPiece vocabularies, so load "
                           "tokenizer.model with the sentencepiece package");
}

// Requests that cannot be met by this checkpoint.
void check_onnx_request(const ExportRequest& a, int enabled) {
  if (a.options.qdq && enabled == 0)
    throw UserError("--qdq: checkpoint '" + a.checkpoint + "' has no enabled quantizers (train with --qat first)");
  if (!a.trt_cache_path.empty() && a.options.qdq)
    throw UserError(
        "--trt-calib-cache with --qdq: TensorRT ignores calibration for a network with Q/DQ nodes; "
        "write the cache for an FP32 export (without --qdq)");
  if (!a.trt_cache_path.empty() && enabled > 0)
    throw UserError("--trt-calib-cache: checkpoint '" + a.checkpoint + "' has " + std::to_string(enabled) +
                    " enabled quantizers (QAT or PTQ); the implicit path would calibrate the float graph again and "
                    "drop their scales. Deploy it with --qdq (explicit INT8), or write the cache from an FP32 "
                    "checkpoint");
  if (!a.trt_cache_path.empty() && a.calib_shards.empty())
    throw UserError("--trt-calib-cache needs --calib-shards (real batches to calibrate on)");
}

// The export's metadata: the model config, quantization recipe and quantizers, the tokenizer's hash and file.
void describe_in_metadata(ExportOptions& options, model::Bert& model, const store::TrainingState& state,
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
void write_calibration_cache(ExportRequest& a, model::Bert& model) {
  data::LoaderOptions lo;
  lo.shards = data::expand_shard_paths(a.calib_shards);
  lo.batch_size = a.calib_batch_size;
  lo.repeat = false;
  data::ShardLoader loader(lo);
  for (model::Quantizer* q : model.quantizers()) q->mode = model::QuantMode::kFloat;  // the FP32 graph
  ExportOptions fp32_options;  // the graph written, so the cache covers exactly its tensors
  fp32_options.opset = a.options.opset;
  fp32_options.masked_positions = a.options.masked_positions;
  a.cache.masked_positions = a.options.masked_positions;
  const onnx::ModelProto fp32 = export_bert(model, fp32_options);
  const PrivateTempDir work("bert-export");  // this run's own exchange files
  a.cache.work_dir = work.path().string();
  const auto amax = calibrate_tensors(fp32, loader, a.cache);
  write_trt_cache(a.trt_cache_path, amax, a.cache);
  spdlog::info("wrote TensorRT calibration cache {} ({} tensors of the FP32 graph, {} calibrator, {} batches)",
               a.trt_cache_path, amax.size(), a.cache.calibrator, a.cache.batches);
  if (a.cache.calibrator == "percentile" || a.cache.calibrator == "mse")
    spdlog::info(
        "its header says EntropyCalibration2: TensorRT has no {} calibrator class, so serve the cache "
        "through an IInt8EntropyCalibrator2 whose readCalibrationCache returns this file",
        a.cache.calibrator);
}

}  // namespace

void export_checkpoint(ExportRequest a) {
  if (a.onnx_path.empty() && a.hf_dir.empty()) throw UserError("nothing to do: give --onnx FILE and/or --hf DIR");
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
    if (a.onnx_path.empty()) return;
  }
  check_onnx_request(a, enabled);
  // The tokenizer travels with the export: copied beside it, its hash in the metadata.
  const fs::path output_path(a.onnx_path);
  if (output_path.has_parent_path()) fs::create_directories(output_path.parent_path());
  const bool wordpiece = tokenizer::is_wordpiece_vocab(a.tokenizer);
  const fs::path tokenizer_copy =
      output_path.parent_path() / (output_path.stem().string() + (wordpiece ? ".vocab.txt" : ".tokenizer.model"));
  describe_in_metadata(a.options, model, state, tokenizer_hash, tokenizer_copy);
  const onnx::ModelProto m = export_bert(model, a.options);

  // Write to a temporary file, check what was written, and only then put it in place.
  AtomicFile file(a.onnx_path);
  write_onnx(m, file.temp_path());
  const onnx::ModelProto written = read_onnx(file.temp_path());
  check_onnx(written);
  if (a.options.qdq) {
    const auto violations = check_qdq_rules(written);
    if (!violations.empty())
      throw UserError("the Q/DQ export breaks TensorRT's rules; nothing was written:\n" + describe(violations));
  }
  if (!a.trt_cache_path.empty()) write_calibration_cache(a, model);
  if (!a.triton_repo.empty()) {
    const std::string name = a.triton_name.empty() ? output_path.stem().string() : a.triton_name;
    const std::string folder = write_triton_repository(written, a.triton_repo, name, a.triton_max_batch);
    const std::string copy = tokenizer::copy_tokenizer(a.tokenizer, folder);
    spdlog::info("wrote Triton model repository {} (config.pbtxt, 1/model.onnx, {})", folder,
                 fs::path(copy).filename().string());
  }
  tokenizer::copy_tokenizer(a.tokenizer, tokenizer_copy.parent_path().string(), tokenizer_copy.filename().string());
  file.commit();
  spdlog::info("wrote {} ({} nodes, {} initializers, opset {}, {}{}); checker{} passed; tokenizer copied to {}",
               a.onnx_path, m.graph().node_size(), m.graph().initializer_size(), a.options.opset,
               a.options.qdq ? "Q/DQ, " : "FP32", a.options.qdq ? std::to_string(enabled) + " quantizers" : "",
               a.options.qdq ? " and TensorRT rules" : "", tokenizer_copy.string());
  if (a.options.qdq) write_fusion_report(fusion_report(written, a.onnx_path), a.report_json);
}

void write_fusion_report(const FusionReport& report, const std::string& json_path) {
  std::fputs(report.text().c_str(), stdout);
  std::fflush(stdout);
  if (!json_path.empty()) {
    write_text_file(json_path, report.to_json().dump(2) + "\n");
    spdlog::info("wrote the fusion report {}", json_path);
  }
}

}  // namespace bert::exporter
