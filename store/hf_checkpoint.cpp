#include "store/hf_checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include "model/quantizer.h"
#include "store/safetensors.h"
#include "sys/atomic_file.h"
#include "sys/error.h"
#include "sys/text_file.h"

namespace bert::hf {

namespace fs = std::filesystem;

namespace {

constexpr const char* kWeights = "model.safetensors";
constexpr const char* kIndex = "model.safetensors.index.json";
constexpr const char* kQuantizationFile = "quantization.json";
constexpr const char* kQuantizationKey = "bert_qat.quantization";  // safetensors metadata key

Json read_json_file(const std::string& path, const char* what) {
  const std::string text = read_text_file(path, what);
  try {
    return Json::parse(text);
  } catch (const UserError& e) {
    throw UserError(std::string(what) + " '" + path + "': " + e.what());
  }
}

// The name a checkpoint tensor has in our model: "bert." for a bare BertModel, weight/bias for the
// gamma/beta of old (TF-converted) checkpoints.
std::string canonical_name(std::string name, bool bare_model, bool* legacy) {
  if (bare_model && !name.starts_with("cls.") && !name.starts_with("classifier.")) name = "bert." + name;
  if (name.find("LayerNorm") != std::string::npos) {
    if (name.ends_with(".gamma"))
      name.replace(name.size() - 5, 5, "weight"), *legacy = true;
    else if (name.ends_with(".beta"))
      name.replace(name.size() - 4, 4, "bias"), *legacy = true;
  }
  return name;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

std::string list_text(const std::vector<std::string>& names, size_t limit = 6) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < limit; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > limit) s += " and " + std::to_string(names.size() - limit) + " more";
  return s;
}

}  // namespace

bool is_model_dir(const std::string& path) {
  std::error_code ec;
  const fs::path dir(path);
  return fs::is_directory(dir, ec) && fs::is_regular_file(dir / "config.json", ec) &&
         (fs::is_regular_file(dir / kWeights, ec) || fs::is_regular_file(dir / kIndex, ec));
}

model::BertConfig read_config(const std::string& dir) {
  const std::string path = (fs::path(dir) / "config.json").string();
  const Json json = read_json_file(path, "model config");
  auto fail = [&](const std::string& what) { return UserError("model config '" + path + "': " + what); };
  if (!json.is_object()) throw fail("not a JSON object");
  if (const Json* t = json.find("model_type"); t && !(t->is_string() && t->as_string() == "bert"))
    throw fail("model_type " + t->dump() + " is not supported (expected \"bert\")");
  if (const Json* p = json.find("position_embedding_type"); p && !(p->is_string() && p->as_string() == "absolute"))
    throw fail("position_embedding_type " + p->dump() + " is not supported (only \"absolute\")");
  if (const Json* tie = json.find("tie_word_embeddings"); tie && !(tie->is_bool() && tie->as_bool()))
    throw fail("tie_word_embeddings false is not supported (the MLM decoder is the word embeddings)");
  try {
    return model::BertConfig::from_json(json);
  } catch (const UserError& e) {
    throw fail(e.what());
  }
}

ImportReport import_model(const std::string& dir, model::Bert& model, uint64_t init_seed) {
  ImportReport report;
  const fs::path root(dir);
  const model::Head source_head = read_config(dir).head;
  std::error_code ec;
  // The files, and which tensor lives in which.
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  if (fs::is_regular_file(root / kIndex, ec)) {
    const std::string index_path = (root / kIndex).string();
    const Json index = read_json_file(index_path, "safetensors index");
    const Json* map = index.is_object() ? index.find("weight_map") : nullptr;
    if (!map || !map->is_object()) throw UserError("safetensors index '" + index_path + "' has no weight_map object");
    std::set<std::string> shard_names;
    for (const auto& [tensor, file] : map->as_object()) {
      if (!file.is_string() || file.as_string().find('/') != std::string::npos)
        throw UserError("safetensors index '" + index_path + "': tensor '" + tensor + "' maps to " + file.dump() +
                        ", expected a file name in the same directory");
      shard_names.insert(file.as_string());
    }
    for (const std::string& name : shard_names)
      files.push_back(std::make_unique<SafetensorsFile>((root / name).string()));
  } else if (fs::is_regular_file(root / kWeights, ec)) {
    files.push_back(std::make_unique<SafetensorsFile>((root / kWeights).string()));
  } else if (fs::exists(root / "pytorch_model.bin", ec)) {
    throw UserError("'" + dir +
                    "' holds only pytorch_model.bin (a pickle, which is not read): convert it with "
                    "`python3 -c \"import torch, safetensors.torch as s; s.save_file({k: v.contiguous() for k, v in "
                    "torch.load('pytorch_model.bin').items()}, 'model.safetensors', {'format': 'pt'})\"`");
  } else {
    throw UserError("'" + dir + "' has neither " + kWeights + " nor " + kIndex);
  }

  // Every checkpoint tensor under its canonical name.
  struct Source {
    const SafetensorsFile* file;
    const TensorEntry* entry;
  };
  bool bare_model = true;
  for (const auto& f : files)
    for (const TensorEntry& t : f->tensors())
      if (t.name.starts_with("bert.")) bare_model = false;
  std::map<std::string, Source> sources;
  std::set<std::string> dtypes;
  for (const auto& f : files) {
    report.files.push_back(f->path());
    for (const TensorEntry& t : f->tensors()) {
      bool legacy = false;
      const std::string name = canonical_name(t.name, bare_model, &legacy);
      if (legacy) report.legacy_names.push_back(t.name);
      if (!sources.emplace(name, Source{f.get(), &t}).second)
        throw UserError("checkpoint '" + dir + "' holds tensor '" + name + "' twice");
      dtypes.insert(dtype_name(t.dtype));
    }
  }
  report.dtypes.assign(dtypes.begin(), dtypes.end());

  auto load = [&](const std::string& name, const Source& s, TensorView<float> target) {
    std::vector<int64_t> expected;
    for (int i = 0; i < target.shape().rank(); ++i) expected.push_back(target.shape()[i]);
    if (s.entry->shape != expected)
      throw UserError("checkpoint '" + s.file->path() + "': tensor '" + s.entry->name + "' has shape " +
                      shape_text(s.entry->shape) + ", the model (config.json) expects " + shape_text(expected));
    const DType d = s.entry->dtype;
    if (d != DType::kF32 && d != DType::kF16 && d != DType::kBF16 && d != DType::kF64)
      throw UserError("checkpoint '" + s.file->path() + "': tensor '" + s.entry->name + "' has dtype " + dtype_name(d) +
                      ", expected a floating-point type");
    const std::vector<float> values = s.file->read(*s.entry);
    std::copy(values.begin(), values.end(), target.data());
  };

  model.initialize(init_seed);  // what the checkpoint does not hold keeps this (heads only, checked below)
  ParameterArena<float>& params = model.parameters();
  std::set<std::string> used;
  std::vector<std::string> missing;
  for (ParamId id = 0; id < params.size(); ++id) {
    Parameter<float> p = params.get(id);
    const std::string& name = *p.name;
    if (model::is_quantizer_scale(name)) continue;
    auto it = sources.find(name);
    if (!model.takes_from(source_head, name)) it = sources.end();  // starts fresh
    if (it == sources.end() && name == "cls.predictions.bias") it = sources.find("cls.predictions.decoder.bias");
    if (it == sources.end()) {
      (model.is_head_parameter(name) ? report.initialized : missing).push_back(name);
      continue;
    }
    load(name, it->second, p.value);
    used.insert(it->first);
    ++report.tensors_loaded;
  }
  if (!missing.empty())
    throw UserError("checkpoint '" + dir + "' lacks " + std::to_string(missing.size()) +
                    " tensor(s) the encoder needs: " + list_text(missing));

  // The tied decoder: the model's decoder is the word embeddings (and its bias cls.predictions.bias).
  for (const char* tied_name : {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}) {
    auto it = sources.find(tied_name);
    if (it == sources.end() || used.count(tied_name)) continue;
    used.insert(tied_name);
    const bool is_weight = std::string(tied_name).ends_with("weight");
    Parameter<float> tied = params.get(is_weight ? "bert.embeddings.word_embeddings.weight" : "cls.predictions.bias");
    std::vector<float> copy(tied.value.data(), tied.value.data() + tied.value.numel());
    TensorView<float> view(copy.data(), tied.value.shape());
    load(tied_name, it->second, view);
    if (!std::equal(copy.begin(), copy.end(), tied.value.data()))
      report.warnings.push_back(std::string(tied_name) + " differs from the tensor it is tied to (" + *tied.name +
                                "); as in transformers with tie_word_embeddings, the tied tensor is used");
  }
  for (const auto& [name, source] : sources)
    if (!used.count(name) && name != "bert.embeddings.position_ids") report.unexpected.push_back(source.entry->name);
  if (!report.initialized.empty())
    report.warnings.push_back(
        std::to_string(report.initialized.size()) + " head parameter(s) not in the checkpoint " +
        "(a BertModel without pretraining heads, or a model with another head?) were freshly initialised: " +
        list_text(report.initialized));
  if (!report.unexpected.empty())
    report.warnings.push_back(std::to_string(report.unexpected.size()) +
                              " checkpoint tensor(s) were not used: " + list_text(report.unexpected));

  // Quantizer scales written by export_model: safetensors metadata, else the side file.
  Json quantization;
  for (const auto& f : files)
    if (auto it = f->metadata().find(kQuantizationKey); it != f->metadata().end()) {
      try {
        quantization = Json::parse(it->second);
      } catch (const UserError& e) {
        throw UserError("checkpoint '" + f->path() + "': metadata '" + kQuantizationKey + "': " + e.what());
      }
    }
  if (quantization.is_null() && fs::is_regular_file(root / kQuantizationFile, ec))
    quantization = read_json_file((root / kQuantizationFile).string(), "quantization file");
  if (!quantization.is_null()) {
    const std::string where = "quantization record of '" + dir + "'";
    const Json* scales = quantization.is_object() ? quantization.find("scales") : nullptr;
    if (!scales || !scales->is_object()) throw UserError(where + " has no 'scales' object");
    std::map<std::string, model::Quantizer*> by_name;
    for (model::Quantizer* q : model.quantizers()) by_name[q->name] = q;
    std::set<std::string> merged;  // shared quantizers given by the earlier layout's three names
    for (const auto& [name, values] : scales->as_object()) {
      const std::string current = model::Bert::current_quantizer_name(name);
      auto it = by_name.find(current);
      if (it == by_name.end()) throw UserError(where + " names quantizer '" + name + "', which the model lacks");
      model::Quantizer& q = *it->second;
      Parameter<float> scale = params.get(q.scale);
      const Json::Array& list = values.as_array();
      if (static_cast<int64_t>(list.size()) != scale.value.numel())
        throw UserError(where + ": quantizer '" + name + "' has " + std::to_string(list.size()) +
                        " scale(s), expected " + std::to_string(scale.value.numel()) +
                        (q.is_weight ? " (the model's weight scales are " +
                                           model::weight_scales_name(model.config().weight_scales) +
                                           ": leave --weights out, or quantize the FP32 model)"
                                     : ""));
      // Q, K and V of the earlier layout each had a scale: the shared quantizer takes the largest.
      const bool merge = current != name && !merged.insert(current).second;
      for (size_t i = 0; i < list.size(); ++i) {
        const double v = list[i].as_number();
        if (!(v > 0)) throw UserError(where + ": quantizer '" + name + "' has a scale that is not positive");
        float& s = scale.value.data()[i];
        s = merge ? std::max(s, static_cast<float>(v)) : static_cast<float>(v);
      }
      if (merge) continue;
      if (current != name)
        report.warnings.push_back(where + ": Q, K and V input scales of the earlier layout ('" + name +
                                  "', ...) merged into '" + current + "' at the largest");
      q.mode = model::QuantMode::kQuantize;
      ++report.quantizers_enabled;
    }
    if (const Json* recipe = quantization.find("recipe")) report.quantization = *recipe;
  }
  return report;
}

void export_model(const std::string& dir, model::Bert& model, const Json& quantization) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!fs::is_directory(dir)) throw UserError("cannot create output directory '" + dir + "'");
  const fs::path root(dir);

  Json config = model.config().to_json();
  config["position_embedding_type"] = "absolute";
  config["tie_word_embeddings"] = true;
  config["torch_dtype"] = "float32";

  ParameterArena<float>& params = model.parameters();
  SafetensorsWriter writer;
  writer.set_metadata("format", "pt");  // transformers refuses safetensors files without it
  for (ParamId id = 0; id < params.size(); ++id) {
    if (model::is_quantizer_scale(params.name(id))) continue;
    Parameter<float> p = params.get(id);
    std::vector<int64_t> shape;
    for (int i = 0; i < p.value.shape().rank(); ++i) shape.push_back(p.value.shape()[i]);
    writer.add(*p.name, shape, p.value.data());
  }
  Json::Object scales;
  for (model::Quantizer* q : model.enabled_quantizers()) {
    Parameter<float> scale = params.get(q->scale);
    Json::Array values;
    for (float v : scale.value) values.emplace_back(static_cast<double>(v));  // %.17g: exact round trip
    scales.emplace_back(q->name, Json(std::move(values)));
  }
  const bool quantized = !scales.empty();
  Json record;
  if (quantized) {
    record["format"] = "bert-qat quantization 1";
    record["note"] =
        "Fake-quantization scales (x_q = clamp(round(x / scale))) of the enabled quantizers; weights "
        "are per output channel in [-127, 127], activations per tensor in [-128, 127], zero point 0.";
    record["recipe"] = quantization;
    record["scales"] = Json(std::move(scales));
    writer.set_metadata(kQuantizationKey, record.dump());
  }
  writer.write((root / kWeights).string());
  write_text_file((root / "config.json").string(), config.dump(2) + "\n");
  if (quantized)
    write_text_file((root / kQuantizationFile).string(), record.dump(2) + "\n");
  else
    fs::remove(root / kQuantizationFile, ec);  // a stale one would re-enable quantizers on import
}

}  // namespace bert::hf
