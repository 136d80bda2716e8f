#include "train/qat_setup.h"

#include <spdlog/spdlog.h>

#include "ops/ops.h"
#include "store/model_source.h"
#include "sys/error.h"
#include "train/run_folder.h"

namespace bert::train {

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
               quant::method_name(calibration.method), calibration.batches, calibration.keep_float.size());
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
  // (Question answering's start and end, and a regression's one score: whatever their names.)
  if (config.labels != student.labels && config.head != model::Head::kQuestionAnswering &&
      !(config.regression() && student.regression()))
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
  spdlog::info("distilling from '{}' (L{}/H{}, {:.2f}M parameters; weight {:g}, {})", path, config.num_hidden_layers,
               config.hidden_size, teacher->parameters().num_elements() / 1e6, o.distill_weight,
               config.regression() ? std::string("the mean squared error to its scores")
                                   : fmt::format("temperature {:g}", o.distill_temperature));
  return teacher;
}

Objective objective_of(Graph<float>& g, const model::ModelOutputs& out, model::Bert* teacher, const BatchView& b,
                       const TrainOptions& o, double share) {
  const bool pretraining = out.mlm_loss.valid();
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
           : teacher->config().regression()  // a score has no distribution: the student matches the teacher's
               ? weighted(ops::mean_squared_error(g, out.logits, taught.logits))
               : weighted(ops::distillation_loss(g, out.logits, taught.logits, t));
  return {ops::add(g, ops::scale(g, loss, 1.0 - w), ops::scale(g, kd, w)), loss};
}

}  // namespace bert::train
