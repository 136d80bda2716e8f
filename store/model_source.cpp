#include "store/model_source.h"

#include <spdlog/spdlog.h>

#include <filesystem>

#include "store/hf_checkpoint.h"
#include "sys/error.h"
#include "sys/sha256.h"
#include "tokenizer/tokenizer_file.h"

namespace bert::store {

namespace fs = std::filesystem;

ModelSource find_model(const std::string& path) {
  std::error_code ec;
  ModelSource s;
  if (hf::is_model_dir(path)) {
    s.path = path;
    s.hugging_face = true;
  } else if (fs::is_directory(path, ec)) {
    s.path = (fs::path(path) / "checkpoint.h5").string();
    if (!fs::is_regular_file(s.path, ec))
      throw UserError("'" + path +
                      "' is neither a run folder (no checkpoint.h5) nor a Hugging Face model directory "
                      "(config.json with model.safetensors or model.safetensors.index.json)");
  } else if (fs::is_regular_file(path, ec)) {
    s.path = path;
  } else {
    throw UserError("model '" + path +
                    "' does not exist (expected a checkpoint .h5, a run folder or a Hugging Face model directory)");
  }
  const fs::path dir = s.hugging_face ? fs::path(s.path) : fs::path(s.path).parent_path();
  s.tokenizer = tokenizer::tokenizer_file_in(dir.string());
  return s;
}

model::BertConfig read_model_config(const ModelSource& source) {
  return source.hugging_face ? hf::read_config(source.path) : read_checkpoint_config(source.path);
}

TrainingState load_model(const ModelSource& source, model::Bert& model, uint64_t init_seed) {
  if (!source.hugging_face) return load_checkpoint(source.path, model, nullptr);
  const hf::ImportReport report = hf::import_model(source.path, model, init_seed);
  std::string dtypes;
  for (const std::string& d : report.dtypes) dtypes += (dtypes.empty() ? "" : "/") + d;
  spdlog::info(
      "imported {} tensors ({}) from Hugging Face checkpoint '{}' ({} file(s)){}", report.tensors_loaded, dtypes,
      source.path, report.files.size(),
      report.legacy_names.empty() ? "" : fmt::format("; {} legacy gamma/beta names", report.legacy_names.size()));
  for (const std::string& w : report.warnings) spdlog::warn("{}", w);
  if (report.quantizers_enabled > 0)
    spdlog::info("{} quantizers restored with their learned scales", report.quantizers_enabled);
  TrainingState state;
  if (source.tokenizer.ends_with("vocab.txt")) state.tokenizer_sha256 = sha256_file(source.tokenizer);
  state.quantization = report.quantization;
  return state;
}

std::unique_ptr<model::Bert> open_model(const std::string& path, ModelSource* source, TrainingState* state) {
  ModelSource s = find_model(path);
  auto model = std::make_unique<model::Bert>(read_model_config(s));
  TrainingState loaded = load_model(s, *model);
  if (source) *source = s;
  if (state) *state = std::move(loaded);
  return model;
}

}  // namespace bert::store
