#include "store/checkpoint.h"

#include <algorithm>

#include <spdlog/spdlog.h>

#include "data/hdf5_io.h"
#include "sys/atomic_file.h"
#include "sys/error.h"

namespace bert::store {

namespace hdf5 = data::hdf5;

namespace {

constexpr const char* kFormat = "bert-qat checkpoint 1";

std::vector<hsize_t> dims_of(const Shape& s) {
  std::vector<hsize_t> d;
  for (int i = 0; i < s.rank(); ++i) d.push_back(static_cast<hsize_t>(s[i]));
  return d;
}

int64_t required_int(hid_t file, const char* name, const std::string& path) {
  auto v = hdf5::read_int_attribute(file, name);
  if (!v) throw UserError("checkpoint '" + path + "' lacks attribute '" + name + "' (not a bert-qat checkpoint?)");
  return *v;
}

// A scale of the shared Q/K/V input quantizer absent from a checkpoint of the earlier layout, where Q, K
// and V each had one: the largest of the three (nothing the three covered is clipped), said in the log.
void merge_earlier_layout(hid_t root, const std::string& path, const std::string& scale_name, float* value) {
  const std::string quantizer = scale_name.substr(0, scale_name.size() - std::string(".scale").size());
  if (!quantizer.ends_with(".attention.self.input_quantizer")) return;
  const std::string layer = quantizer.substr(0, quantizer.size() - std::string("input_quantizer").size());
  std::vector<float> scales, buffer;
  const std::vector<hsize_t> one{1};
  for (const char* projection : {"query", "key", "value"}) {
    const std::string name = "model/" + layer + projection + ".input_quantizer.scale";
    if (!hdf5::exists(root, name)) return;
    hdf5::read_dataset(root, name, buffer, path, "checkpoint", &one);
    scales.push_back(buffer[0]);
  }
  *value = *std::max_element(scales.begin(), scales.end());
  spdlog::info(
      "{}: {}'s Q, K and V input scales ({:.6g}, {:.6g}, {:.6g}) merged into one at the largest: they "
      "read one tensor, and TensorRT fuses the three GEMMs only at one scale",
      path, quantizer, scales[0], scales[1], scales[2]);
}

}  // namespace

void snapshot_checkpoint(model::Bert& model, const OptimizerMoments* optimizer, const TrainingState& state,
                         CheckpointSnapshot& s) {
  ParameterArena<float>& params = model.parameters();
  const TensorView<float> values = params.values();
  s.values.assign(values.data(), values.data() + values.numel());
  s.names.clear(), s.shapes.clear(), s.offsets.clear();
  for (ParamId id = 0; id < params.size(); ++id) {
    const Parameter<float> p = params.get(id);
    s.names.push_back(*p.name);
    s.shapes.push_back(p.value.shape());
    s.offsets.push_back(p.value.data() - values.data());
  }
  if (optimizer) {
    s.first.assign(optimizer->first, optimizer->first + values.numel());
    s.second.assign(optimizer->second, optimizer->second + values.numel());
    s.optimizer_name = optimizer->name;
    s.optimizer_steps = optimizer->steps;
  } else {
    s.first.clear(), s.second.clear(), s.optimizer_name.clear();
    s.optimizer_steps = 0;
  }
  s.config = model.config().to_json().dump();
  s.quantizers_enabled = model.enabled_quantizer_names();
  s.state = state;
}

void write_checkpoint(const std::string& path, const CheckpointSnapshot& s) {
  hdf5::Quiet quiet;
  AtomicFile file(path);
  {
    hdf5::Handle h = hdf5::create(file.temp_path(), path);
    const bool moments = !s.optimizer_name.empty();
    for (size_t i = 0; i < s.names.size(); ++i) {
      const std::vector<hsize_t> dims = dims_of(s.shapes[i]);
      const int64_t offset = s.offsets[i];
      hdf5::write_dataset(h.get(), "model/" + s.names[i], s.values.data() + offset, dims, path);
      if (moments) {
        hdf5::write_dataset(h.get(), "optimizer/exp_avg/" + s.names[i], s.first.data() + offset, dims, path);
        hdf5::write_dataset(h.get(), "optimizer/exp_avg_sq/" + s.names[i], s.second.data() + offset, dims, path);
      }
    }
    const TrainingState& state = s.state;
    const hid_t root = h.get();
    hdf5::write_attribute(root, "format", std::string(kFormat));
    hdf5::write_attribute(root, "config", s.config);
    hdf5::write_attribute(root, "step", state.step);
    hdf5::write_attribute(root, "dropout_rng_seed", static_cast<int64_t>(state.dropout_rng.seed));
    hdf5::write_attribute(root, "dropout_rng_counter", static_cast<int64_t>(state.dropout_rng.counter));
    hdf5::write_attribute(root, "loader_epoch", static_cast<int64_t>(state.loader.epoch));
    hdf5::write_attribute(root, "loader_shard", state.loader.shard);
    hdf5::write_attribute(root, "loader_example", state.loader.example);
    hdf5::write_attribute(root, "tokenizer_sha256", state.tokenizer_sha256);
    hdf5::write_attribute(root, "run", state.run.dump());
    Json::Array enabled;
    for (const std::string& name : s.quantizers_enabled) enabled.emplace_back(name);
    hdf5::write_attribute(root, "quantizers_enabled", Json(enabled).dump());
    hdf5::write_attribute(root, "quantization", state.quantization.dump());
    if (moments) {
      hdf5::write_attribute(root, "optimizer", s.optimizer_name);
      hdf5::write_attribute(root, "optimizer_steps", s.optimizer_steps);
    }
    if (H5Fflush(root, H5F_SCOPE_GLOBAL) < 0) throw UserError("cannot write checkpoint '" + path + "' (disk full?)");
  }
  file.commit();
}

void save_checkpoint(const std::string& path, model::Bert& model, const OptimizerMoments* optimizer,
                     const TrainingState& state) {
  CheckpointSnapshot snapshot;
  snapshot_checkpoint(model, optimizer, state, snapshot);
  write_checkpoint(path, snapshot);
}

model::BertConfig read_checkpoint_config(const std::string& path) {
  hdf5::Quiet quiet;
  hdf5::Handle h = hdf5::open_read(path, "checkpoint");
  auto config = hdf5::read_string_attribute(h.get(), "config");
  if (!config) throw UserError("checkpoint '" + path + "' has no model config (not a bert-qat checkpoint?)");
  try {
    return model::BertConfig::from_json(Json::parse(*config));
  } catch (const UserError& e) {
    throw UserError("checkpoint '" + path + "': " + e.what());
  }
}

Json read_checkpoint_run(const std::string& path) {
  hdf5::Quiet quiet;
  hdf5::Handle h = hdf5::open_read(path, "checkpoint");
  try {
    const Json run = Json::parse(hdf5::read_string_attribute(h.get(), "run").value_or("{}"));
    return run.is_object() ? run : Json(Json::Object{});
  } catch (const UserError& e) {
    throw UserError("checkpoint '" + path + "': its run record: " + e.what());
  }
}

TrainingState load_checkpoint(const std::string& path, model::Bert& model, OptimizerMoments* optimizer) {
  hdf5::Quiet quiet;
  hdf5::Handle h = hdf5::open_read(path, "checkpoint");
  const hid_t root = h.get();
  if (hdf5::read_string_attribute(root, "format").value_or("") != kFormat)
    throw UserError("checkpoint '" + path + "' is not a bert-qat checkpoint (format attribute missing or different)");
  ParameterArena<float>& params = model.parameters();
  float* base = params.values().data();
  std::vector<float> buffer;
  auto load_into = [&](const std::string& name, float* dst, const Shape& shape) {
    const std::vector<hsize_t> expected = dims_of(shape);  // checked before anything is allocated
    hdf5::read_dataset(root, name, buffer, path, "checkpoint", &expected);
    std::copy(buffer.begin(), buffer.end(), dst);
  };
  const bool has_optimizer_state = hdf5::exists(root, "optimizer");
  const model::BertConfig source_config = read_checkpoint_config(path);
  const model::Head source_head = source_config.head;
  const Json enabled = Json::parse(hdf5::read_string_attribute(root, "quantizers_enabled").value_or("[]"));
  auto enabled_in_checkpoint = [&](const std::string& quantizer) {
    for (const Json& name : enabled.as_array())
      if (name.as_string() == quantizer) return true;
    return false;
  };
  const bool other_head = source_head != model.config().head;
  if (optimizer && other_head)
    throw UserError("checkpoint '" + path + "' has another head than the model (" +
                    model::head_architecture(source_head) + " vs " + model::head_architecture(model.config().head) +
                    "): it cannot resume this run");
  TrainingState s;
  if (optimizer && !has_optimizer_state)
    throw UserError("checkpoint '" + path +
                    "' holds no optimizer state (a model-only checkpoint cannot resume training)");
  for (ParamId id = 0; id < params.size(); ++id) {
    Parameter<float> p = params.get(id);
    if (model::is_quantizer_scale(*p.name) && !hdf5::exists(root, "model/" + *p.name)) {
      merge_earlier_layout(root, path, *p.name, p.value.data());
      continue;  // an FP32 checkpoint has no scales; the earlier layout's are merged above
    }
    if (model::is_quantizer_scale(*p.name) && source_config.weight_scales != model.config().weight_scales) {
      // Weight scales of the other layout (per-channel against per-tensor): placeholders of disabled
      // quantizers are left as the model has them; an enabled one cannot be converted.
      const std::string quantizer = p.name->substr(0, p.name->size() - std::string(".scale").size());
      const std::vector<hsize_t> dims = hdf5::read_dataset(root, "model/" + *p.name, buffer, path, "checkpoint");
      if (dims != dims_of(p.value.shape())) {
        if (enabled_in_checkpoint(quantizer))
          throw UserError("checkpoint '" + path + "' quantizes weights " +
                          model::weight_scales_name(source_config.weight_scales) + " ('" + quantizer +
                          "' is enabled), and this model asks " +
                          model::weight_scales_name(model.config().weight_scales) +
                          " (--weights): leave --weights out, or quantize an FP32 checkpoint");
        continue;
      }
    }
    if (other_head && model.is_head_parameter(*p.name) &&
        (!model.takes_from(source_head, *p.name) || !hdf5::exists(root, "model/" + *p.name))) {
      s.fresh_parameters.push_back(*p.name);
      continue;
    }
    load_into("model/" + *p.name, p.value.data(), p.value.shape());
    if (optimizer && hdf5::exists(root, "optimizer/exp_avg/" + *p.name)) {
      const int64_t offset = p.value.data() - base;
      load_into("optimizer/exp_avg/" + *p.name, optimizer->first + offset, p.value.shape());
      load_into("optimizer/exp_avg_sq/" + *p.name, optimizer->second + offset, p.value.shape());
    }
  }
  s.step = required_int(root, "step", path);
  s.dropout_rng.seed = static_cast<uint64_t>(required_int(root, "dropout_rng_seed", path));
  s.dropout_rng.counter = static_cast<uint64_t>(required_int(root, "dropout_rng_counter", path));
  s.loader.epoch = static_cast<uint64_t>(required_int(root, "loader_epoch", path));
  s.loader.shard = required_int(root, "loader_shard", path);
  s.loader.example = required_int(root, "loader_example", path);
  s.tokenizer_sha256 = hdf5::read_string_attribute(root, "tokenizer_sha256").value_or("");
  s.run = Json::parse(hdf5::read_string_attribute(root, "run").value_or("{}"));
  s.quantization = Json::parse(hdf5::read_string_attribute(root, "quantization").value_or("null"));
  for (model::Quantizer* q : model.quantizers()) q->mode = model::QuantMode::kFloat;
  for (const Json& name : enabled.as_array()) {
    model::Quantizer* q = model.find_quantizer(model::Bert::current_quantizer_name(name.as_string()));
    if (!q && other_head) continue;  // a quantizer of the other head
    if (!q)
      throw UserError("checkpoint '" + path + "' enables quantizer '" + name.as_string() + "', which this model lacks");
    if (!hdf5::exists(root, "model/" + name.as_string() + ".scale"))
      throw UserError("checkpoint '" + path + "' enables quantizer '" + name.as_string() +
                      "' but holds no scale for it");
    q->mode = model::QuantMode::kQuantize;
  }
  if (optimizer) {
    if (hdf5::read_string_attribute(root, "optimizer").value_or("") != optimizer->name)
      throw UserError("checkpoint '" + path + "' was trained with optimizer '" +
                      hdf5::read_string_attribute(root, "optimizer").value_or("?") + "', not '" + optimizer->name +
                      "'");
    optimizer->steps = required_int(root, "optimizer_steps", path);
  }
  return s;
}

}  // namespace bert::store
