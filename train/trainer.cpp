#include "train/trainer.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "core/atomic_file.h"
#include "core/error.h"
#include "core/gemm.h"
#include "core/openmp_wait.h"
#include "core/ops.h"
#include "core/parallel.h"
#include "core/sha256.h"
#include "core/text_file.h"
#include "store/checkpoint.h"
#include "store/model_source.h"
#include "tokenizer/tokenizer_file.h"
#include "train/gradient_reduction.h"
#include "train/nccl_communicator.h"

namespace bert::train {

namespace fs = std::filesystem;

TrainOptions::OnNonFinite parse_on_nonfinite(const std::string& name) {
  if (name == "stop") return TrainOptions::OnNonFinite::kStop;
  if (name == "skip") return TrainOptions::OnNonFinite::kSkip;
  throw UserError("--on-nonfinite '" + name + "': expected stop or skip");
}

TrainOptions::ScaleTraining parse_scale_training(const std::string& name) {
  if (name == "learned") return TrainOptions::ScaleTraining::kLearned;
  if (name == "lsq") return TrainOptions::ScaleTraining::kLsq;
  if (name == "fixed") return TrainOptions::ScaleTraining::kFixed;
  throw UserError("--scales '" + name + "': expected learned, lsq or fixed");
}

std::string scale_training_name(TrainOptions::ScaleTraining scales) {
  switch (scales) {
    case TrainOptions::ScaleTraining::kLsq:
      return "lsq";
    case TrainOptions::ScaleTraining::kFixed:
      return "fixed";
    default:
      return "learned";
  }
}

void TrainOptions::validate() const {
  auto fail = [](const std::string& msg) { throw UserError(msg); };
  if (train_shards.empty()) fail("--train: no training shards given");
  if (output_dir.empty()) fail("--out: an output folder is required");
  if (steps < 1) fail("--steps " + std::to_string(steps) + ": expected at least 1");
  if (batch_size < 1) fail("--batch-size " + std::to_string(batch_size) + ": expected at least 1");
  if (accumulation < 1) fail("--accumulate " + std::to_string(accumulation) + ": expected at least 1");
  if (!(learning_rate > 0) || !std::isfinite(learning_rate)) fail("--lr: expected a positive finite number");
  if (!(warmup_fraction >= 0 && warmup_fraction < 1)) fail("--warmup: expected a fraction in [0, 1)");
  if (!std::isfinite(clip_norm)) fail("--clip: expected a finite number");
  if (qat) calibration.validate();
  if (weights != model::WeightScales::kPerChannel && !qat)
    fail("--weights " + model::weight_scales_name(weights) + " chooses QAT's weight scales: it goes with --qat");
  if (!(scale_lr_multiplier > 0) || !std::isfinite(scale_lr_multiplier))
    fail("--scale-lr-mult: expected a positive number");
  if (qat && init_from.empty() && !resume) fail("--qat needs --init-from (an FP32 checkpoint to start from)");
  if (!(distill_weight >= 0 && distill_weight <= 1)) fail("--distill: expected a weight in [0, 1]");
  if (!(distill_temperature > 0) || !std::isfinite(distill_temperature))
    fail("--distill-temperature: expected a positive number");
  if (distill_weight > 0 && teacher_path().empty())
    fail("--distill needs a teacher: --teacher, or the --init-from model (give it again with --resume)");
  if (!teacher.empty() && distill_weight <= 0) fail("--teacher '" + teacher + "': only used with --distill W > 0");
  if (log_every < 1) fail("--log-every: expected at least 1");
  if (stop_at_step < 0) fail("--stop-at: expected a step number (0: off)");
  if (!(bucket_mb > 0)) fail("--bucket-mb " + std::to_string(bucket_mb) + ": expected a positive size");
  if (keep_checkpoints < 1) fail("--keep-checkpoints " + std::to_string(keep_checkpoints) + ": expected at least 1");
  if (max_consecutive_skips < 1) fail("--max-skips: expected at least 1");
  parse_precision(precision);
  optimizer.validate();
  config.validate();
}

Json TrainOptions::to_json() const {
  Json j;
  Json::Array train_list, eval_list;
  for (const auto& s : train_shards) train_list.emplace_back(s);
  for (const auto& s : eval_shards) eval_list.emplace_back(s);
  j["train_shards"] = train_list;
  j["eval_shards"] = eval_list;
  j["tokenizer"] = tokenizer_path;
  j["steps"] = steps;
  j["batch_size"] = batch_size;
  j["accumulation"] = accumulation;
  j["learning_rate"] = learning_rate;
  j["warmup_fraction"] = warmup_fraction;
  j["schedule"] = schedule_name(schedule);
  j["optimizer"] = optimizer_name(optimizer.kind);
  j["weight_decay"] = optimizer.weight_decay;
  j["clip_norm"] = clip_norm;
  j["seed"] = seed;
  j["device"] = device;
  j["precision"] = precision;
  j["init_from"] = init_from;
  j["keep_checkpoints"] = keep_checkpoints;
  j["bucket_mb"] = bucket_mb;
  j["on_nonfinite"] = on_nonfinite == OnNonFinite::kSkip ? "skip" : "stop";
  j["task"] = model::head_task_name(config.head);
  j["qat"] = qat;
  if (qat) {
    j["calibrator"] = calibration.method;
    j["weights"] = model::weight_scales_name(weights);
    j["percentile"] = calibration.percentile;
    j["calib_batches"] = calibration.batches;
    j["quantize_residuals"] = calibration.residuals;
    j["plan"] = plan_path;
    j["scale_lr_multiplier"] = scale_lr_multiplier;
    j["scales"] = scale_training_name(scales);
  }
  if (distill_weight > 0) {
    j["distill_weight"] = distill_weight;
    j["distill_temperature"] = distill_temperature;
    j["distill_teacher"] = teacher_path();
  }
  return j;
}

std::vector<std::string> resume_plan(TrainOptions& o, const Json& recorded,
                                     const std::function<bool(const std::string& flag)>& given) {
  using Set = std::function<void(TrainOptions&, const Json&)>;
  struct PlanOption {
    const char* key;   // in TrainOptions::to_json
    const char* flag;  // bert-train's
    bool may_change;   // given anew: applied with a warning (else refused)
    Set set;
  };
  static const PlanOption plan[] = {
      {"steps", "--steps", true, [](TrainOptions& t, const Json& v) { t.steps = v.as_int(); }},
      {"batch_size", "--batch-size", false, [](TrainOptions& t, const Json& v) { t.batch_size = v.as_int(); }},
      {"accumulation", "--accumulate", false, [](TrainOptions& t, const Json& v) { t.accumulation = v.as_int(); }},
      {"learning_rate", "--lr", false, [](TrainOptions& t, const Json& v) { t.learning_rate = v.as_number(); }},
      {"warmup_fraction", "--warmup", false, [](TrainOptions& t, const Json& v) { t.warmup_fraction = v.as_number(); }},
      {"schedule", "--schedule", false,
       [](TrainOptions& t, const Json& v) { t.schedule = parse_schedule(v.as_string()); }},
      {"optimizer", "--optimizer", false,
       [](TrainOptions& t, const Json& v) { t.optimizer.kind = parse_optimizer(v.as_string()); }},
      {"weight_decay", "--weight-decay", false,
       [](TrainOptions& t, const Json& v) { t.optimizer.weight_decay = v.as_number(); }},
      {"clip_norm", "--clip", false, [](TrainOptions& t, const Json& v) { t.clip_norm = v.as_number(); }},
      {"seed", "--seed", false, [](TrainOptions& t, const Json& v) { t.seed = v.as_uint(); }},
      {"precision", "--precision", true, [](TrainOptions& t, const Json& v) { t.precision = v.as_string(); }},
      {"init_from", "--init-from", false, [](TrainOptions& t, const Json& v) { t.init_from = v.as_string(); }},
      {"qat", "--qat", false, [](TrainOptions& t, const Json& v) { t.qat = v.as_bool(); }},
      {"calibrator", "--calibrator", false,
       [](TrainOptions& t, const Json& v) { t.calibration.method = v.as_string(); }},
      {"weights", "--weights", false,
       [](TrainOptions& t, const Json& v) { t.weights = model::parse_weight_scales(v.as_string()); }},
      {"percentile", "--percentile", false,
       [](TrainOptions& t, const Json& v) { t.calibration.percentile = v.as_number(); }},
      {"calib_batches", "--calib-batches", false,
       [](TrainOptions& t, const Json& v) { t.calibration.batches = v.as_int(); }},
      {"quantize_residuals", "--quantize-residuals", false,
       [](TrainOptions& t, const Json& v) { t.calibration.residuals = v.as_bool(); }},
      {"plan", "--plan", false, [](TrainOptions& t, const Json& v) { t.plan_path = v.as_string(); }},
      {"scale_lr_multiplier", "--scale-lr-mult", false,
       [](TrainOptions& t, const Json& v) { t.scale_lr_multiplier = v.as_number(); }},
      {"scales", "--scales", false,
       [](TrainOptions& t, const Json& v) { t.scales = parse_scale_training(v.as_string()); }},
      {"distill_weight", "--distill", false, [](TrainOptions& t, const Json& v) { t.distill_weight = v.as_number(); }},
      {"distill_temperature", "--distill-temperature", false,
       [](TrainOptions& t, const Json& v) { t.distill_temperature = v.as_number(); }},
      {"distill_teacher", "--teacher", false, [](TrainOptions& t, const Json& v) { t.teacher = v.as_string(); }},
  };
  std::vector<std::string> warnings;
  if (!recorded.is_object()) return warnings;
  const Json now = o.to_json();  // the values as given (or defaulted), before any is taken from the record
  for (const PlanOption& p : plan) {
    const Json* was = recorded.find(p.key);
    if (!was) continue;
    if (!given(p.flag)) {
      p.set(o, *was);
      continue;
    }
    const Json* is = now.find(p.key);
    auto text = [](const Json& v) {  // as a person would write it: 0.0003, linear, true
      return v.is_number() ? fmt::format("{}", v.as_number()) : v.is_string() ? v.as_string() : v.dump();
    };
    const std::string old_value = text(*was), new_value = is ? text(*is) : "(not set)";
    // Integers exactly (a 64-bit seed), other numbers by value (1e-3 and 0.001), the rest as written.
    const bool same =
        is && (was->dump() == is->dump() || (was->is_number() && is->is_number() && !was->integer().is_integer &&
                                             was->as_number() == is->as_number()));
    if (same) continue;
    if (!p.may_change)
      throw UserError(std::string(p.flag) + " " + new_value + ": the run being resumed was planned with " + old_value +
                      "; a resumed run keeps its plan (leave " + p.flag + " out, or start a new run in another --out)");
    warnings.push_back(std::string(p.flag) + " changed on resume: " + old_value + " -> " + new_value +
                       (std::string(p.key) == "steps" ? " (warmup and decay now follow the new length)" : ""));
  }
  return warnings;
}

namespace {

std::string format_duration(double seconds) {
  const auto s = static_cast<int64_t>(seconds);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", (long long)(s / 3600), (long long)(s / 60 % 60),
                (long long)(s % 60));
  return buf;
}

// Keeps metrics.jsonl lines up to `step` (used on resume: later lines belong to the interrupted run).
void truncate_metrics(const std::string& path, int64_t step) {
  std::ifstream in(path);
  if (!in) return;
  std::string kept, line;
  while (std::getline(in, line)) {
    try {
      const Json j = Json::parse(line);
      if (const Json* s = j.find("step"); s && s->as_int() <= step) kept += line + "\n";
    } catch (const UserError&) {  // a half-written last line of a killed run
    }
  }
  in.close();
  write_text_file(path, kept);
}

// The first parameter whose gradient (or value) holds a NaN or infinity, or "".
std::string first_nonfinite(ParameterArena<float>& params, bool gradients) {
  for (ParamId id = 0; id < params.size(); ++id) {
    Parameter<float> p = params.get(id);
    const TensorView<float> t = gradients ? p.grad : p.value;
    for (float v : t)
      if (!std::isfinite(v)) return *p.name;
  }
  return "";
}

// For a non-finite loss: the first non-finite weight, or else the largest one (overflowing activations
// come from weights that grew too large).
std::string describe_weights(ParameterArena<float>& params) {
  const std::string bad = first_nonfinite(params, false);
  if (!bad.empty()) return "first non-finite weight: " + bad;
  float largest = 0;
  std::string where;
  for (ParamId id = 0; id < params.size(); ++id)
    for (float v : params.get(id).value)
      if (std::abs(v) > largest) largest = std::abs(v), where = params.name(id);
  char text[64];
  std::snprintf(text, sizeof text, "%.3g", largest);
  return "weights finite, the largest |w| = " + std::string(text) + " in " + where;
}

// checkpoint.h5 is always the newest; with keep > 1 the last `keep` saves also stay as
// checkpoint-<step>.h5 (hard links where possible, so they cost no space until superseded).
void keep_numbered_checkpoints(const std::string& output_dir, const std::string& latest, int64_t step, int64_t keep) {
  if (keep <= 1) return;
  const fs::path dir(output_dir);
  const fs::path numbered = dir / ("checkpoint-" + std::to_string(step) + ".h5");
  std::error_code ec;
  fs::remove(numbered, ec);
  fs::create_hard_link(latest, numbered, ec);
  if (ec) fs::copy_file(latest, numbered, fs::copy_options::overwrite_existing);
  std::vector<std::pair<int64_t, fs::path>> all;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with("checkpoint-") || !name.ends_with(".h5")) continue;
    const std::string number = name.substr(11, name.size() - 14);
    if (number.empty() || number.find_first_not_of("0123456789") != std::string::npos) continue;
    all.emplace_back(std::stoll(number), entry.path());
  }
  std::sort(all.begin(), all.end());
  for (size_t i = 0; i + keep < all.size(); ++i) fs::remove(all[i].second, ec);
}

model::Head head_of(data::ShardKind kind) {
  switch (kind) {
    case data::ShardKind::kSequenceLabels:
      return model::Head::kSequenceClassification;
    case data::ShardKind::kTokenLabels:
      return model::Head::kTokenClassification;
    default:
      return model::Head::kPretraining;
  }
}

std::string label_list(const std::vector<std::string>& labels) {
  std::string s;
  for (size_t i = 0; i < labels.size() && i < 8; ++i) s += (i ? ", " : "") + labels[i];
  return s + (labels.size() > 8 ? ", ... (" + std::to_string(labels.size()) + ")" : "");
}

// Gives `config` the head and labels of the training data. A model that already has that head must
// have the same labels (in the same order); a model with another head gets the new one.
void adopt_task(model::BertConfig& config, model::Head head, const std::vector<std::string>& labels,
                const std::string& source) {
  if (config.head == head) {
    if (head != model::Head::kPretraining && config.labels != labels)
      throw UserError(source + " classifies into [" + label_list(config.labels) + "], the training shards into [" +
                      label_list(labels) + "]: a head mismatch (fine-tune from the encoder of a pretraining model, " +
                      "or make the shards with the model's labels)");
    return;
  }
  if (head == model::Head::kPretraining)
    throw UserError(source + " is a " + model::head_architecture(config.head) +
                    "; pretraining shards need a BertForPreTraining model");
  config.head = head;
  config.labels = labels;
}

// Where a run keeps its files (the tokenizer's copy: tokenizer::copy_tokenizer).
struct RunFiles {
  std::string checkpoint, metrics;
  explicit RunFiles(const TrainOptions& o)
      : checkpoint((fs::path(o.output_dir) / "checkpoint.h5").string()),
        metrics((fs::path(o.output_dir) / "metrics.jsonl").string()) {}
};

// The model config of the run: the checkpoint's on --resume, --init-from's (with this run's dropout), or
// the given one; with the vocabulary of the tokenizer and the head and labels of the training shards.
model::BertConfig resolve_config(const TrainOptions& o, const RunFiles& files, const data::ShardLoader& loader) {
  model::BertConfig config = o.config;
  if (config.vocab_size != o.tokenizer_vocab_size) {
    spdlog::info("vocab_size set to the tokenizer's {} (config had {})", o.tokenizer_vocab_size, config.vocab_size);
    config.vocab_size = o.tokenizer_vocab_size;
  }
  if (o.resume) {
    if (!fs::exists(files.checkpoint))
      throw UserError("--resume: no checkpoint at '" + files.checkpoint + "' to resume from");
    config = store::read_checkpoint_config(files.checkpoint);
  } else if (!o.init_from.empty()) {
    config = store::read_model_config(store::find_model(o.init_from));
    config.hidden_dropout_prob = o.config.hidden_dropout_prob;
    config.attention_probs_dropout_prob = o.config.attention_probs_dropout_prob;
    if (o.qat) config.weight_scales = o.weights;  // the layout QAT's weight quantizers take
    if (config.vocab_size != o.tokenizer_vocab_size)
      throw UserError("--init-from '" + o.init_from + "' has vocab_size " + std::to_string(config.vocab_size) +
                      ", the tokenizer " + std::to_string(o.tokenizer_vocab_size));
  }
  const model::Head head = head_of(loader.kind());
  if (o.task && *o.task != head)
    throw UserError("--task " + model::head_task_name(*o.task) + ": the training shards are " +
                    data::shard_kind_name(loader.kind()) + " shards ('" +
                    data::expand_shard_paths(o.train_shards).front() + "')");
  adopt_task(config, head, loader.label_names(),
             o.resume              ? "the checkpoint"
             : o.init_from.empty() ? "the model"
                                   : "--init-from '" + o.init_from + "'");
  return config;
}

// QAT's start: calibrate the quantizers on training batches (another seed than the training order) and
// return the recipe the checkpoint records, with each scale's floor.
Json calibrate_for_qat(const TrainOptions& o, model::Bert& model, const data::LoaderOptions& loader_options,
                       const Device& device) {
  quant::CalibrationOptions calibration = o.calibration;
  if (!o.plan_path.empty()) calibration.keep_float = quant::read_plan(o.plan_path, model);
  data::LoaderOptions co = loader_options;
  co.repeat = false;
  co.seed = o.seed + 1;
  co.rank = 0;  // every rank calibrates on the same batches: the same scales everywhere
  co.world_size = 1;
  data::ShardLoader calibration_loader(co);
  Graph<float> calibration_graph(device);
  const auto amax = quant::calibrate(model, calibration_loader, calibration, calibration_graph);
  model.parameters().upload_values();  // the calibrated scales
  spdlog::info("calibrated {} quantizers ({} calibrator, {} batches; {} kept in float)", amax.size(),
               calibration.method, calibration.batches, calibration.keep_float.size());
  Json recipe = quant::describe_calibration(calibration, calibration.batches, model.config().weight_scales);
  recipe["qat"] = true;
  recipe["init_from"] = o.init_from;
  recipe["qat_steps"] = o.steps;
  recipe["learning_rate"] = o.learning_rate;
  recipe["scale_lr_multiplier"] = o.scale_lr_multiplier;
  recipe["scales"] = scale_training_name(o.scales);
  recipe["scale_floors"] = quant::scale_floors(model);
  if (o.distill_weight > 0) {
    recipe["distill_weight"] = o.distill_weight;
    recipe["distill_temperature"] = o.distill_temperature;
  }
  return recipe;
}

// The state training starts from: the checkpoint's on --resume (weights, moments, data order, dropout
// RNG), else fresh weights or --init-from's, calibrated for QAT; the run folder gets its tokenizer copy,
// config.json and an empty metrics log.
store::TrainingState start_state(const TrainOptions& o, const RunFiles& files, const model::BertConfig& config,
                                 model::Bert& model, Optimizer& optimizer, data::ShardLoader& loader,
                                 const data::LoaderOptions& loader_options, Rng& dropout_rng, const Device& device,
                                 bool writes) {
  ParameterArena<float>& params = model.parameters();
  store::TrainingState state;
  state.tokenizer_sha256 = o.tokenizer_sha256;
  state.run = o.to_json();
  if (o.resume) {
    store::OptimizerMoments moments = optimizer.checkpoint_moments();
    store::TrainingState loaded = store::load_checkpoint(files.checkpoint, model, &moments);
    optimizer.set_steps(moments.steps);
    params.upload_values();
    optimizer.upload_moments();
    if (!loaded.tokenizer_sha256.empty() && loaded.tokenizer_sha256 != o.tokenizer_sha256)
      throw UserError("--resume: the checkpoint was trained with another tokenizer than '" + o.tokenizer_path + "'");
    state.step = loaded.step;
    loader.restore(loaded.loader);
    dropout_rng = Rng(loaded.dropout_rng);
    state.quantization = loaded.quantization;
    if (writes) truncate_metrics(files.metrics, state.step);
    spdlog::info("resuming from '{}' at step {}", files.checkpoint, state.step);
    return state;
  }
  if (o.init_from.empty()) {
    model.initialize(o.seed);
  } else {
    model.initialize(o.seed);  // a head the checkpoint lacks keeps this
    const store::TrainingState init = store::load_model(store::find_model(o.init_from), model, o.seed);
    if (!init.tokenizer_sha256.empty() && init.tokenizer_sha256 != o.tokenizer_sha256)
      throw UserError("--init-from '" + o.init_from + "' was trained with another tokenizer than '" + o.tokenizer_path +
                      "'");
    spdlog::info("weights from '{}' (step {})", o.init_from, init.step);
    if (!init.fresh_parameters.empty())
      spdlog::info("fine-tuning for {} with {} labels: new head {}", model::head_architecture(config.head),
                   config.num_labels(), label_list(init.fresh_parameters));
  }
  params.upload_values();
  if (o.qat) state.quantization = calibrate_for_qat(o, model, loader_options, device);
  if (!writes) return state;
  tokenizer::copy_tokenizer(o.tokenizer_path, o.output_dir);
  write_text_file((fs::path(o.output_dir) / "config.json").string(), config.to_json().dump(2) + "\n");
  std::ofstream(files.metrics, std::ios::trunc).close();
  return state;
}

// Quantizers enabled (calibrated now, or restored from a QAT checkpoint): their scales get their own
// learning rate, log-space or LSQ updates, and the floor recorded at calibration.
std::vector<model::Quantizer*> configure_scales(const TrainOptions& o, model::Bert& model, Optimizer& optimizer,
                                                const store::TrainingState& state) {
  const std::vector<model::Quantizer*> active = model.enabled_quantizers();
  const Json* floors = state.quantization.is_object() ? state.quantization.find("scale_floors") : nullptr;
  for (model::Quantizer* q : active) {
    // A multiplier of 0 freezes the scales (their gradients are still computed, and ignored).
    optimizer.set_lr_multiplier(q->scale,
                                o.scales == TrainOptions::ScaleTraining::kFixed ? 0.0 : o.scale_lr_multiplier);
    optimizer.set_log_space(q->scale, o.scales == TrainOptions::ScaleTraining::kLearned);
    // Older checkpoints recorded no floor: the absolute minimum.
    const Json* floor = floors && floors->is_object() ? floors->find(q->name) : nullptr;
    optimizer.set_minimum(q->scale,
                          floor && floor->is_number() ? static_cast<float>(floor->as_number()) : quant::kMinimumScale);
  }
  if (!active.empty())
    spdlog::info("quantization-aware training with {} quantizers enabled, scales {}", active.size(),
                 scale_training_name(o.scales));
  return active;
}

// The teacher for distillation (--teacher, else the --init-from model), every quantizer in float. Its
// size may differ from the student's; its outputs must mean the same: same head and labels, same
// vocabulary and tokenizer, positions for the training sequences.
std::unique_ptr<model::Bert> make_teacher(const TrainOptions& o, const model::BertConfig& student, int64_t seq_len,
                                          const Device& device) {
  if (o.distill_weight <= 0) return nullptr;
  const std::string& path = o.teacher_path();
  const store::ModelSource source = store::find_model(path);
  const model::BertConfig config = store::read_model_config(source);
  const std::string named = "--distill: the teacher '" + path + "' ";
  if (config.head != student.head)
    throw UserError(named + "has another head (" + model::head_architecture(config.head) + ", the student " +
                    model::head_architecture(student.head) + "); distil from a model fine-tuned for this task");
  if (config.labels != student.labels)
    throw UserError(named + "has other labels (" + std::to_string(config.num_labels()) + ": " +
                    label_list(config.labels) + "; the student " + std::to_string(student.num_labels()) + ": " +
                    label_list(student.labels) + ")");
  if (config.vocab_size != student.vocab_size || config.type_vocab_size != student.type_vocab_size)
    throw UserError(named + "has a vocabulary of " + std::to_string(config.vocab_size) + " (" +
                    std::to_string(config.type_vocab_size) + " segments), the student " +
                    std::to_string(student.vocab_size) + " (" + std::to_string(student.type_vocab_size) +
                    "): teacher and student must share the tokenizer");
  if (config.max_position_embeddings < seq_len)
    throw UserError(named + "has " + std::to_string(config.max_position_embeddings) +
                    " positions, fewer than the training sequences' " + std::to_string(seq_len));
  auto teacher = std::make_unique<model::Bert>(config);
  teacher->place_on(device);
  const store::TrainingState state = store::load_model(source, *teacher, o.seed);
  if (!state.tokenizer_sha256.empty() && state.tokenizer_sha256 != o.tokenizer_sha256)
    throw UserError(named + "was trained with another tokenizer than '" + o.tokenizer_path + "'");
  if (!state.fresh_parameters.empty())
    throw UserError(named + "lacks trained weights for " + label_list(state.fresh_parameters) +
                    ": distil from a model fine-tuned for this task");
  quant::disable_all(*teacher);
  teacher->parameters().upload_values();
  spdlog::info("distilling from '{}' (L{}/H{}, {:.2f}M parameters; weight {:g}, temperature {:g})", path,
               config.num_hidden_layers, config.hidden_size, teacher->parameters().num_elements() / 1e6,
               o.distill_weight, o.distill_temperature);
  return teacher;
}

// This rank's share of the micro-batch's predictions over all ranks, times the number of ranks: the
// factor that turns its mean over its own predictions (masked tokens, labeled tokens) into its part of
// the mean over the global batch's. Averaging the ranks' gradients then gives the gradient of the
// global mean, as one process with the global batch computes it (ranks hold different numbers of masked
// tokens). 1 for one rank and for sequence classification (one prediction per sequence).
double prediction_share(Communicator& ranks, const model::ModelOutputs& out, model::Head head) {
  if (ranks.size() == 1 || head == model::Head::kSequenceClassification) return 1.0;
  const double own =
      static_cast<double>(head == model::Head::kPretraining ? out.mlm_targets.size() : out.targets.size());
  std::vector<double> total = {own};
  ranks.all_reduce_sum(total);
  return total[0] > 0 ? own * ranks.size() / total[0] : 1.0;
}

// The training objective of one micro-batch: the model's loss (its per-prediction part weighted by
// `share`, see prediction_share), mixed with the KL to the teacher's outputs when distilling. Also the
// loss the progress log shows (without the KL, comparable with runs that do not distil).
struct Objective {
  Var objective, logged;
};
Objective objective_of(Graph<float>& g, const model::ModelOutputs& out, model::Bert* teacher, const BatchView& b,
                       const TrainOptions& o, double share) {
  const bool pretraining = out.mlm_logits.valid();
  auto weighted = [&](Var v) { return share == 1.0 ? v : ops::scale(g, v, share); };
  const Var loss = pretraining && share != 1.0 ? ops::add(g, weighted(out.mlm_loss), out.nsp_loss) : weighted(out.loss);
  if (!teacher) return {loss, loss};
  model::ModelOutputs taught;
  {
    NoGradGuard<float> no_grad(g);
    Rng unused(0);  // no dropout in the teacher
    taught = teacher->forward(g, b, /*training=*/false, unused);
  }
  const double t = o.distill_temperature, w = o.distill_weight;
  Var kd = teacher->config().head == model::Head::kPretraining
               ? ops::add(g, weighted(ops::distillation_loss(g, out.mlm_logits, taught.mlm_logits, t)),
                          ops::distillation_loss(g, out.nsp_logits, taught.nsp_logits, t))
               : weighted(ops::distillation_loss(g, out.logits, taught.logits, t));
  return {ops::add(g, ops::scale(g, loss, 1.0 - w), ops::scale(g, kd, w)), loss};
}

// The metrics of the steps since the last progress line: MLM/NSP for pretraining, the task's accuracy
// for fine-tuning; their progress line and metrics.jsonl fields.
class ProgressWindow {
 public:
  explicit ProgressWindow(const model::BertConfig& config)
      : pretraining_(config.head == model::Head::kPretraining), labels_(config.num_labels()), task_(labels_) {}
  void add(const Graph<float>& g, const model::ModelOutputs& out, const BatchView& b) {
    if (pretraining_)
      pretraining_metrics_.add(g, out, b);
    else
      task_.add(g, out);
  }
  double loss() const {
    return pretraining_ ? pretraining_metrics_.mlm_loss() + pretraining_metrics_.nsp_loss() : task_.loss();
  }
  std::string describe() const {
    return pretraining_ ? fmt::format("loss {:.4f}  MLM acc {:.4f}  NSP acc {:.4f}", loss(),
                                      pretraining_metrics_.mlm_accuracy(), pretraining_metrics_.nsp_accuracy())
                        : fmt::format("loss {:.4f}  acc {:.4f}", loss(), task_.accuracy());
  }
  void record(Json& line) const {
    line["loss"] = loss();
    if (pretraining_) {
      line["mlm_loss"] = pretraining_metrics_.mlm_loss();
      line["mlm_accuracy"] = pretraining_metrics_.mlm_accuracy();
      line["nsp_loss"] = pretraining_metrics_.nsp_loss();
      line["nsp_accuracy"] = pretraining_metrics_.nsp_accuracy();
    } else {
      line["accuracy"] = task_.accuracy();
    }
  }
  // An optimizer step that was applied (skipped steps count only their time).
  void add_step(double grad_norm) {
    grad_norm_sum_ += grad_norm;
    ++steps_;
  }
  void add_time(double seconds) { seconds_ += seconds; }
  // Sums the metrics over the ranks (the step count, time and gradient norm are the same everywhere).
  void reduce(Communicator& ranks) {
    if (ranks.size() == 1) return;
    eval::PretrainingMetrics& p = pretraining_metrics_;
    std::vector<double> v = {double(p.predictions), double(p.mlm_correct), p.mlm_loss_sum,         double(p.sequences),
                             double(p.nsp_correct), p.nsp_loss_sum,        double(task_.examples), task_.loss_sum};
    for (int64_t c : task_.confusion) v.push_back(double(c));
    ranks.all_reduce_sum(v);
    p.predictions = int64_t(v[0]), p.mlm_correct = int64_t(v[1]), p.mlm_loss_sum = v[2];
    p.sequences = int64_t(v[3]), p.nsp_correct = int64_t(v[4]), p.nsp_loss_sum = v[5];
    task_.examples = int64_t(v[6]), task_.loss_sum = v[7];
    for (size_t i = 0; i < task_.confusion.size(); ++i) task_.confusion[i] = int64_t(v[8 + i]);
  }
  int64_t steps() const { return steps_; }
  double mean_grad_norm() const { return steps_ ? grad_norm_sum_ / steps_ : 0.0; }
  double seconds() const { return seconds_; }
  void reset() {
    pretraining_metrics_ = {};
    task_ = eval::TaskMetrics(labels_);
    seconds_ = grad_norm_sum_ = 0;
    steps_ = 0;
  }

 private:
  double seconds_ = 0, grad_norm_sum_ = 0;
  int64_t steps_ = 0;
  bool pretraining_;
  int64_t labels_;
  eval::PretrainingMetrics pretraining_metrics_;
  eval::TaskMetrics task_;
};

// The progress line and its metrics.jsonl record for the window that ends at `step`; then the window
// starts over. `seconds_per_step`: the run's average so far, for the ETA.
void report_progress(const TrainOptions& o, int64_t step, double lr, double elapsed, double seconds_per_step,
                     ProgressWindow& window, model::Bert& model, const std::vector<model::Quantizer*>& active,
                     const Device& device, Communicator& ranks, std::ofstream& metrics_log) {
  window.reduce(ranks);
  if (ranks.rank() != 0) {  // rank 0 reports; the others start their window over
    for (model::Quantizer* q : active) q->reset_counts();
    window.reset();
    return;
  }
  const double seq_per_s = window.steps() * o.batch_size * o.accumulation * ranks.size() / window.seconds();
  std::string memory;
  if (device.is_cuda()) {
    const auto [used, total] = device.memory_use();
    memory = fmt::format("  GPU mem {:.1f}/{:.0f} GiB", used / double(1 << 30), total / double(1 << 30));
  }
  spdlog::info("step {:>6}/{}  {}  lr {:.2e}  |g| {:.2f}  {:.0f} seq/s{}  ETA {}{}", step, o.steps, window.describe(),
               lr, window.mean_grad_norm(), seq_per_s, ranks.size() > 1 ? " (all ranks)" : "",
               format_duration(seconds_per_step * (o.steps - step)), memory);
  Json line;
  line["step"] = step;
  window.record(line);
  line["learning_rate"] = lr;
  line["grad_norm"] = window.mean_grad_norm();
  line["sequences_per_second"] = seq_per_s;
  line["elapsed_seconds"] = elapsed;
  if (!active.empty()) {
    // Clipping per quantizer over the window: the share of values that saturated.
    Json clip;
    double worst = 0;
    std::string worst_name;
    model.collect_clip_counts();
    for (model::Quantizer* q : active) {
      const double fraction = q->seen ? double(q->clipped) / q->seen : 0.0;
      clip[q->name] = fraction;
      if (fraction >= worst) worst = fraction, worst_name = q->name;
      q->reset_counts();
    }
    line["clip_fraction"] = clip;
    spdlog::info("  clipping: at most {:.4f}% of values, at {}", 100 * worst, worst_name);
  }
  metrics_log << line.dump() << "\n" << std::flush;
  window.reset();
}

// Held-out evaluation (pretraining or task metrics) into `result`, logged and appended to metrics.jsonl.
void evaluate_held_out(const TrainOptions& o, const std::vector<std::string>& eval_paths, model::Bert& model,
                       const data::ShardLoader& train_loader, const Device& device, int64_t step,
                       std::ofstream& metrics_log, TrainResult& result) {
  if (eval_paths.empty()) return;
  data::LoaderOptions eo;
  eo.shards = eval_paths;
  eo.batch_size = o.batch_size;
  eo.shuffle = false;
  eo.repeat = false;
  data::ShardLoader eval_loader(eo);
  if (eval_loader.kind() != train_loader.kind() || eval_loader.label_names() != train_loader.label_names())
    throw UserError("--eval: the evaluation shards ('" + eval_paths.front() + "') are " +
                    data::shard_kind_name(eval_loader.kind()) + " shards with other labels than the training ones");
  Graph<float> eval_graph(device);
  const model::BertConfig& config = model.config();
  Json line;
  line["step"] = step;
  if (config.head == model::Head::kPretraining) {
    result.last_eval = eval::evaluate(model, eval_loader, o.eval_batches, eval_graph);
    const auto& m = result.last_eval;
    spdlog::info(
        "eval step {}: MLM acc {:.4f} (most-frequent-token {:.4f}), MLM loss {:.4f}, NSP acc {:.4f} "
        "(majority {:.4f}) over {} predictions",
        step, m.mlm_accuracy(), m.most_frequent_token_accuracy(), m.mlm_loss(), m.nsp_accuracy(),
        m.nsp_majority_accuracy(), m.predictions);
    line["eval"] = m.to_json();
  } else {
    result.last_task_eval = eval::evaluate_task(model, eval_loader, o.eval_batches, eval_graph);
    const auto& m = result.last_task_eval;
    spdlog::info("eval step {}: accuracy {:.4f} (majority label {:.4f}), macro-F1 {:.4f}, loss {:.4f} over {} {}", step,
                 m.accuracy(), m.majority_accuracy(), m.macro_f1(), m.loss(), m.examples,
                 config.head == model::Head::kTokenClassification ? "tokens" : "sequences");
    line["eval"] = m.to_json(config.labels);
  }
  metrics_log << line.dump() << "\n" << std::flush;
}

// The end of a step: gradients clipped and the optimizer stepped, unless the passes or the gradient norm
// went non-finite: then the update is skipped (--on-nonfinite skip, up to --max-skips in a row) or the
// run stops with a message naming what went wrong and the last checkpoint (left as it was). True when
// the parameters were updated.
bool update_or_skip(const TrainOptions& o, ParameterArena<float>& params, Optimizer& optimizer, double lr, int64_t step,
                    std::string nonfinite, int64_t& consecutive_skips, const std::string& last_saved,
                    const std::string& checkpoint, ProgressWindow& window) {
  double grad_norm = 0;
  if (nonfinite.empty()) {
    grad_norm = clip_grad_norm(params, o.clip_norm);
    if (!std::isfinite(grad_norm)) {
      params.download_grads();
      nonfinite = "gradient norm is " + std::to_string(grad_norm) +
                  ", first non-finite gradient: " + first_nonfinite(params, true);
    }
  }
  if (nonfinite.empty()) {
    consecutive_skips = 0;
    optimizer.step(lr);  // scales are kept positive by their minimum
    window.add_step(grad_norm);
    return true;
  }
  const bool skip = o.on_nonfinite == TrainOptions::OnNonFinite::kSkip;
  if (!skip || ++consecutive_skips > o.max_consecutive_skips)
    throw UserError(nonfinite + " at step " + std::to_string(step) +
                    (skip ? " (" + std::to_string(o.max_consecutive_skips) + " steps skipped in a row)" : "") +
                    "; stopped without writing a checkpoint, the last one ('" + checkpoint + "', " + last_saved +
                    ") was left as it was. Try a lower --lr, or --on-nonfinite skip.");
  spdlog::warn("step {}: {}; update skipped ({} in a row, --on-nonfinite skip)", step, nonfinite, consecutive_skips);
  params.zero_grad();
  return false;
}

// The device this rank trains on: --device, or in a job of several processes the GPU of its local rank.
std::unique_ptr<Device> open_training_device(const TrainOptions& o, const ProcessGroup& job, bool thread_ranks,
                                             int world) {
  std::string device_spec = o.device;
  if (job.distributed()) {  // each process takes the GPU of its local rank
    if (o.device == "cpu")
      throw UserError("--device cpu: a job of " + std::to_string(world) +
                      " processes trains on GPUs (NCCL); on the CPU, train in one process (it uses every core)");
    if (o.device != "auto" && o.device != "cuda")
      throw UserError("--device " + o.device +
                      ": in a job of several processes each rank takes the GPU of its local "
                      "rank; use --device cuda (and CUDA_VISIBLE_DEVICES to choose the GPUs)");
    device_spec = "cuda:" + std::to_string(job.local_rank);
  }
  std::unique_ptr<Device> device = Device::open(device_spec, parse_precision(o.precision));
  if (thread_ranks && world > 1 && device->is_cuda())
    throw UserError("--device " + o.device +
                    ": ranks that are threads of one process train on the CPU; several GPUs take one process each "
                    "(bert-train --nproc N, or mpirun)");
  return device;
}

// The forward and backward passes of one step over its micro-batches, on every rank: gradients land in
// the arena (averaged over the ranks in buckets during the last micro-batch's backward pass). Every
// micro-batch runs even after a non-finite loss (the step is then dropped as a whole), so each step does
// the same work: what data-parallel ranks must agree on.
struct StepPasses {
  const TrainOptions& o;
  model::Bert& model;
  model::Bert* teacher;  // distillation's, or nullptr
  data::ShardLoader& loader;
  Rng& dropout_rng;
  Communicator& ranks;
  GradientReduction* reduction;  // nullptr for one rank
  ProgressWindow& window;
  const std::atomic<bool>* stop;

  struct Outcome {
    double loss = 0;        // the logged loss of the step (mean over micro-batches and ranks)
    std::string nonfinite;  // what went non-finite on any rank, for the message; empty when nothing did
    bool stop_requested = false;
  };
  Outcome run(Graph<float>& g, Batch& batch, bool log_buckets) const;
};

StepPasses::Outcome StepPasses::run(Graph<float>& g, Batch& batch, bool log_buckets) const {
  Outcome r;
  const model::BertConfig& config = model.config();
  for (int64_t micro = 0; micro < o.accumulation; ++micro) {
    loader.next(batch);
    const BatchView b = batch.view();
    const model::ModelOutputs out = model.forward(g, b, /*training=*/true, dropout_rng);
    const auto [objective, logged] = objective_of(g, out, teacher, b, o, prediction_share(ranks, out, config.head));
    // The progress log shows MLM + NSP or the task loss (comparable with runs without distillation); the
    // objective must be finite too.
    const double loss = g.item(logged);
    if ((!std::isfinite(loss) || (teacher && !std::isfinite(g.item(objective)))) && r.nonfinite.empty()) {
      std::string parts;
      if (config.head == model::Head::kPretraining)
        parts = " (MLM " + std::to_string(g.item(out.mlm_loss)) + ", NSP " + std::to_string(g.item(out.nsp_loss)) + ")";
      model.parameters().download_values();
      r.nonfinite = "loss is " + std::to_string(loss) + parts + ", " + describe_weights(model.parameters());
    }
    if (r.nonfinite.empty()) {
      r.loss += loss / o.accumulation;
      window.add(g, out, b);
    }
    const Var scaled = o.accumulation == 1 ? objective : ops::scale(g, objective, 1.0 / o.accumulation);
    if (!reduction || micro + 1 < o.accumulation) {
      g.backward(scaled);
      continue;
    }
    // Several ranks, the step's last micro-batch. They agree first: any rank's non-finite loss drops the
    // step everywhere, any rank's stop stops all; the logged loss is averaged. Then its backward pass,
    // whose gradients are averaged in buckets while it runs.
    r.stop_requested = stop && stop->load();
    std::vector<double> agreed = {r.nonfinite.empty() ? 0.0 : 1.0, r.stop_requested ? 1.0 : 0.0, r.loss};
    ranks.all_reduce_sum(agreed);
    if (agreed[0] > 0 && r.nonfinite.empty()) r.nonfinite = "a non-finite loss on another rank";
    r.stop_requested = agreed[1] > 0;
    r.loss = agreed[2] / ranks.size();
    reduction->expect(g);
    g.backward(scaled, [&](TensorView<float> grad) { reduction->on_final(grad); });
    reduction->finish();
    if (log_buckets)
      spdlog::info(
          "gradients averaged over {} ranks in {} buckets of about {:g} MiB; {} started during the backward pass",
          ranks.size(), reduction->num_buckets(), o.bucket_mb, reduction->started_early());
  }
  if (!reduction) r.stop_requested = stop && stop->load();
  return r;
}

// Refuses a job whose ranks were started differently (another command line, model configuration or
// tokenizer): they would train different models and average their gradients.
void check_ranks_agree(Communicator& ranks, const TrainOptions& o, const model::BertConfig& config) {
  if (ranks.size() == 1) return;
  const std::string text = o.to_json().dump() + config.to_json().dump() + o.tokenizer_sha256;
  const uint64_t hash = std::stoull(sha256_hex(text).substr(0, 15), nullptr, 16);  // 60 bits
  // Three 20-bit pieces: their sums over the ranks are exact in doubles. The ranks agree when every
  // rank's piece times the number of ranks equals the sum; otherwise at least one rank sees that.
  const std::vector<double> own = {double(hash & 0xFFFFF), double((hash >> 20) & 0xFFFFF),
                                   double((hash >> 40) & 0xFFFFF)};
  std::vector<double> sums = own;
  ranks.all_reduce_sum(sums);
  std::vector<double> differ = {0.0};
  for (size_t i = 0; i < own.size(); ++i)
    if (sums[i] != own[i] * ranks.size()) differ[0] = 1.0;
  ranks.all_reduce_sum(differ);
  if (differ[0] > 0)
    throw UserError("the " + std::to_string(ranks.size()) +
                    " ranks were started with different options, model configurations or tokenizers: every rank "
                    "needs the same command line and files");
}

data::LoaderOptions training_loader_options(const TrainOptions& o, int rank, int world) {
  data::LoaderOptions options;
  options.shards = data::expand_shard_paths(o.train_shards);
  options.batch_size = o.batch_size;
  options.seed = o.seed;
  options.rank = rank;
  options.world_size = world;
  return options;
}

// This process's place among the ranks, once the options have been checked.
struct RankPlace {
  int rank = 0, world = 1;
};
RankPlace checked_place(const TrainOptions& o, Communicator* group) {
  o.validate();
  const ProcessGroup& job = o.process_group;
  if (group && job.distributed())
    throw UserError("train(): a local group of threads and a job of processes at once (" + job.launcher + ")");
  if (o.tokenizer_path.empty() || o.tokenizer_vocab_size <= 0 || o.tokenizer_sha256.empty())
    throw UserError("--tokenizer: a tokenizer is required (the one the shards were made with)");
  return group ? RankPlace{group->rank(), group->size()} : RankPlace{job.rank, job.size};
}

const model::BertConfig& agreed_config(Communicator& ranks, const TrainOptions& o, const model::BertConfig& config) {
  check_ranks_agree(ranks, o, config);
  return config;
}

// One training run: everything it holds, set up in the order the checks need (nothing is written before
// the inputs have been checked), and the loop over its steps. Rank 0 (the lead) evaluates and writes.
class TrainingRun {
 public:
  TrainingRun(const TrainOptions& o, const std::atomic<bool>* stop, Communicator* group);
  bool finished() const { return state_.step >= o_.steps; }
  int64_t step() const { return state_.step; }
  void announce() const;
  TrainResult run_steps();
  // After the loop: the held-out evaluation of the final model, the summary line, saturated channels.
  void finish(TrainResult& result);

 private:
  void save();
  // The progress line, held-out evaluation, checkpoint and stop that are due after `step`; true to stop.
  bool after_step(int64_t first_step, double lr, bool stop_requested, std::chrono::steady_clock::time_point start,
                  ProgressWindow& window, TrainResult& result);

  const TrainOptions& o_;
  const std::atomic<bool>* stop_;
  RankPlace place_;
  bool lead_;
  RunFiles files_;
  data::LoaderOptions loader_options_;
  data::ShardLoader loader_;
  model::BertConfig config_;
  std::unique_ptr<Device> device_;
  SingleProcess single_;
  std::unique_ptr<Communicator> nccl_;
  Communicator& ranks_;
  model::Bert model_;
  std::unique_ptr<Optimizer> optimizer_;
  std::vector<std::string> eval_paths_;
  Rng dropout_rng_;
  store::TrainingState state_;
  std::vector<model::Quantizer*> active_;
  std::unique_ptr<model::Bert> teacher_;
  std::ofstream metrics_log_;
  int64_t warmup_;
  int64_t last_saved_step_;
};

TrainingRun::TrainingRun(const TrainOptions& o, const std::atomic<bool>* stop, Communicator* group)
    : o_(o),
      stop_(stop),
      place_(checked_place(o, group)),
      lead_(place_.rank == 0),
      files_(o),
      loader_options_(training_loader_options(o, place_.rank, place_.world)),
      loader_(loader_options_),
      config_(resolve_config(o, files_, loader_)),
      device_(open_training_device(o, o.process_group, group != nullptr, place_.world)),
      nccl_(o.process_group.distributed() ? nccl_communicator(o.process_group, *device_) : nullptr),
      ranks_(group   ? *group
             : nccl_ ? *nccl_
                     : static_cast<Communicator&>(single_)),
      model_(agreed_config(ranks_, o, config_)),
      dropout_rng_(Rng(o.seed).bits(0xD7)),
      warmup_(static_cast<int64_t>(std::llround(o.warmup_fraction * o.steps))),
      last_saved_step_(o.resume ? 0 : -1) {
  // On a GPU the arena gets its device mirror now, so the optimizer's moments live there too; values
  // are loaded or initialised on the host and uploaded in start_state.
  model_.place_on(*device_);
  model_.set_fused_attention(o.fused_attention);
  ParameterArena<float>& params = model_.parameters();
  std::vector<bool> decays;
  for (ParamId id = 0; id < params.size(); ++id) decays.push_back(model_.decays(id));
  optimizer_ = std::make_unique<Optimizer>(o.optimizer, params, decays);

  if (!data::check_loader_compatible(loader_, loader_options_.shards.front(), config_.vocab_size,
                                     config_.max_position_embeddings, o.tokenizer_sha256))
    spdlog::warn("training shards carry no tokenizer metadata (made by another tool?): cannot check they match '{}'",
                 o.tokenizer_path);
  if (!o.eval_shards.empty()) eval_paths_ = data::expand_shard_paths(o.eval_shards);
  // Inputs are checked: only now does anything get written.
  std::error_code ec;
  if (lead_) fs::create_directories(o.output_dir, ec);
  if (ec) throw UserError("cannot create output folder '" + o.output_dir + "': " + ec.message());

  state_ =
      start_state(o, files_, config_, model_, *optimizer_, loader_, loader_options_, dropout_rng_, *device_, lead_);
  if (o.resume) last_saved_step_ = state_.step;
  // Each rank drops out other units: its own stream, derived from the one the checkpoint keeps (rank 0's),
  // drawn in step with it.
  if (!lead_)
    dropout_rng_ =
        Rng(Rng::State{Rng(dropout_rng_.state().seed).bits(0x5EED + ranks_.rank()), dropout_rng_.state().counter});
  active_ = configure_scales(o, model_, *optimizer_, state_);
  teacher_ = make_teacher(o, config_, loader_.seq_len(), *device_);
  if (lead_ && !finished()) metrics_log_.open(files_.metrics, std::ios::app);
}

void TrainingRun::announce() const {
  const bool pretraining = config_.head == model::Head::kPretraining;
  spdlog::info(
      "training BERT L{}/H{}/A{}{} ({:.2f}M parameters, vocab {}) for {} steps of {} x {} sequences of {} tokens, "
      "{} lr {:g} (warmup {}, {} decay), on {}{}",
      config_.num_hidden_layers, config_.hidden_size, config_.num_attention_heads,
      pretraining ? "" : fmt::format(" {} ({} labels)", model::head_architecture(config_.head), config_.num_labels()),
      model_.parameters().num_elements() / 1e6, config_.vocab_size, o_.steps, o_.batch_size, o_.accumulation,
      loader_.seq_len(), optimizer_name(o_.optimizer.kind), o_.learning_rate, warmup_, schedule_name(o_.schedule),
      device_->is_cuda() ? device_->name()
                         : fmt::format("the CPU ({} threads, waiting {}, {} kernels{})", num_threads(),
                                       openmp_wait_policy(), cpu_kernels_name(CpuKernels::kAuto),
                                       device_->precision() != Precision::kBf16
                                           ? std::string()
                                           : fmt::format(", BF16 products: {}", gemm_bf16_kernel_name())),
      ranks_.size() > 1 ? fmt::format(", rank {} of {} (global batch {})", ranks_.rank(), ranks_.size(),
                                      o_.batch_size * o_.accumulation * ranks_.size())
                        : "");
}

void TrainingRun::save() {
  last_saved_step_ = state_.step;
  if (!lead_) return;
  state_.loader = loader_.state();
  state_.dropout_rng = dropout_rng_.state();
  model_.parameters().download_values();
  optimizer_->download_moments();
  const store::OptimizerMoments moments = optimizer_->checkpoint_moments();
  store::save_checkpoint(files_.checkpoint, model_, &moments, state_);
  keep_numbered_checkpoints(o_.output_dir, files_.checkpoint, state_.step, o_.keep_checkpoints);
}

TrainResult TrainingRun::run_steps() {
  TrainResult result;
  ParameterArena<float>& params = model_.parameters();
  Graph<float> g(*device_);
  const std::unique_ptr<GradientReduction> reduction =
      ranks_.size() > 1 ? std::make_unique<GradientReduction>(params, ranks_, *device_,
                                                              static_cast<int64_t>(o_.bucket_mb * (1 << 20)))
                        : nullptr;
  Batch batch;
  ProgressWindow window(config_);
  const StepPasses step_passes{o_,     model_,          teacher_.get(), loader_, dropout_rng_,
                               ranks_, reduction.get(), window,         stop_};
  const int64_t first_step = state_.step + 1;
  int64_t consecutive_skips = 0;
  const auto start = std::chrono::steady_clock::now();
  for (state_.step = first_step; state_.step <= o_.steps; ++state_.step) {
    const auto step_start = std::chrono::steady_clock::now();
    params.zero_grad();
    const StepPasses::Outcome passes = step_passes.run(g, batch, state_.step == first_step && lead_);
    const double lr = learning_rate(state_.step, o_.steps, warmup_, o_.learning_rate, o_.schedule);
    if (update_or_skip(o_, params, *optimizer_, lr, state_.step, passes.nonfinite, consecutive_skips,
                       last_saved_step_ >= 0 ? "at step " + std::to_string(last_saved_step_) : "none written yet",
                       files_.checkpoint, window)) {
      result.losses.push_back(passes.loss);
    } else {
      ++result.skipped_steps;
    }
    window.add_time(std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count());
    if (after_step(first_step, lr, passes.stop_requested, start, window, result)) break;
  }
  state_.step = result.steps_done = std::min(state_.step, o_.steps);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Every rank's sequences: the global rate, as the progress lines give it.
  result.sequences_per_second = static_cast<double>(result.losses.size() * o_.batch_size * o_.accumulation) *
                                static_cast<double>(ranks_.size()) / std::max(result.seconds, 1e-9);
  return result;
}

bool TrainingRun::after_step(int64_t first_step, double lr, bool stop_requested,
                             std::chrono::steady_clock::time_point start, ProgressWindow& window, TrainResult& result) {
  const int64_t step = state_.step;
  const bool stopping = stop_requested || (o_.stop_at_step > 0 && step == o_.stop_at_step);
  if ((step % o_.log_every == 0 || step == o_.steps || stopping) && window.steps() > 0) {
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    report_progress(o_, step, lr, elapsed, elapsed / (step - first_step + 1), window, model_, active_, *device_, ranks_,
                    metrics_log_);
  }
  const bool last = step == o_.steps;
  if (lead_ && o_.eval_every > 0 && step % o_.eval_every == 0 && !last)
    evaluate_held_out(o_, eval_paths_, model_, loader_, *device_, step, metrics_log_, result);
  if ((o_.save_every > 0 && step % o_.save_every == 0) || last || stopping) save();
  if (!stopping) return false;
  if (lead_)
    spdlog::warn("stopped at step {}: checkpoint written to '{}'; continue with --resume", step, files_.checkpoint);
  result.stopped_early = true;
  return true;
}

void TrainingRun::finish(TrainResult& result) {
  if (!result.stopped_early && lead_)
    evaluate_held_out(o_, eval_paths_, model_, loader_, *device_, state_.step, metrics_log_, result);
  const std::string rate =
      ranks_.size() > 1
          ? fmt::format("{:.1f} sequences/s over the whole run and all {} ranks, {:.1f} per rank",
                        result.sequences_per_second, ranks_.size(), result.sequences_per_second / ranks_.size())
          : fmt::format("{:.1f} sequences/s over the whole run", result.sequences_per_second);
  spdlog::info("done: {} steps in {} ({}); checkpoint '{}'", result.losses.size(), format_duration(result.seconds),
               rate, files_.checkpoint);
  if (active_.empty()) return;
  // The last save left the values on the host.
  result.saturated_channels = quant::fully_saturated_channels(model_);
  if (!result.saturated_channels.empty())
    spdlog::warn(
        "{} weight channel(s) fully saturated (every weight beyond its scale's range: the channel "
        "outputs its bias alone and learns no more), first {}; try --scales learned or fixed",
        result.saturated_channels.size(), result.saturated_channels.front());
}

}  // namespace

TrainResult train(const TrainOptions& o, const std::atomic<bool>* stop, Communicator* group) {
  TrainingRun run(o, stop, group);
  if (run.finished()) {
    spdlog::info("nothing to do: the checkpoint is at step {} of {}", run.step(), o.steps);
    TrainResult done;
    done.steps_done = run.step();
    return done;
  }
  run.announce();
  TrainResult result = run.run_steps();
  run.finish(result);
  return result;
}

}  // namespace bert::train
