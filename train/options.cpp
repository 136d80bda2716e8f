#include "train/options.h"

#include <fmt/format.h>

#include <cmath>

#include "core/device.h"
#include "sys/error.h"

namespace bert::train {

TrainOptions::OnNonFinite parse_on_nonfinite(const std::string& name) {
  return kOnNonFiniteNames.parse(name, "--on-nonfinite");
}

TrainOptions::ScaleTraining parse_scale_training(const std::string& name) {
  return kScaleTrainingNames.parse(name, "--scales");
}

std::string scale_training_name(TrainOptions::ScaleTraining scales) { return kScaleTrainingNames.name(scales); }

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
  if (keep_best && eval_shards.empty())
    fail("--keep-best " + kBestMetricNames.name(*keep_best) + " needs --eval: the held-out shards it ranks by");
  if (patience < 0) fail("--patience " + std::to_string(patience) + ": expected a number of evaluations (0: off)");
  if (patience > 0 && !keep_best)
    fail("--patience counts the evaluations that do not beat the best: give --keep-best METRIC with it");
  if (patience > 0 && eval_every <= 0) fail("--patience needs evaluations during the run: --eval-every N > 0");
  if (keep_best == BestMetric::kQuestionF1 && !eval_questions)
    fail("--keep-best question-f1 needs --eval-qa-data: the questions behind the held-out shard");
  if (max_consecutive_skips < 1) fail("--max-skips: expected at least 1");
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
  j["precision"] = precision_name(precision);
  j["init_from"] = init_from;
  j["keep_checkpoints"] = keep_checkpoints;
  j["bucket_mb"] = bucket_mb;
  j["on_nonfinite"] = on_nonfinite == OnNonFinite::kSkip ? "skip" : "stop";
  j["task"] = config.task();
  j["qat"] = qat;
  if (qat) {
    j["calibrator"] = quant::method_name(calibration.method);
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
      {"precision", "--precision", true, [](TrainOptions& t, const Json& v) { t.precision = parse_precision(v.as_string()); }},
      {"init_from", "--init-from", false, [](TrainOptions& t, const Json& v) { t.init_from = v.as_string(); }},
      {"qat", "--qat", false, [](TrainOptions& t, const Json& v) { t.qat = v.as_bool(); }},
      {"calibrator", "--calibrator", false,
       [](TrainOptions& t, const Json& v) { t.calibration.method = quant::parse_method(v.as_string()); }},
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

}  // namespace bert::train
