// The options of a training run (bert-train's flags as a struct), their checks, their record in the
// checkpoint, and --resume's rule that a resumed run keeps the plan it was started with.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "model/config.h"
#include "quant/quantize.h"
#include "sys/json.h"
#include "train/optimizer.h"
#include "train/process_group.h"

namespace bert::eval {
struct QuestionScoring;
}

namespace bert::train {

struct TrainOptions {
  std::vector<std::string> train_shards;  // files or folders
  std::vector<std::string> eval_shards;   // optional held-out shards
  // Question answering: the held-out shard's questions (eval/squad.h), owned by the caller; each held-out
  // evaluation then also scores every question's answer as SQuAD does. Null: per window only.
  const eval::QuestionScoring* eval_questions = nullptr;
  std::string output_dir;                 // config.json, tokenizer.model, checkpoint.h5, metrics.jsonl
  // The tokenizer the shards were made with: its file (copied into output_dir), vocabulary size and
  // SHA-256. Filled by the caller (e.g. from tokenizer::load_tokenizer), so this library never links the
  // tokenizer implementation.
  std::string tokenizer_path;
  int64_t tokenizer_vocab_size = 0;
  std::string tokenizer_sha256;
  model::BertConfig config;
  // What the run trains: the training shards decide (pretraining shards: MLM + NSP; task shards: their
  // head and labels); when set, it must agree with them. Fine-tuning starts from --init-from (any head,
  // or a Hugging Face directory): the encoder is loaded, a head it lacks is initialised.
  std::optional<std::string> task;  // "seq-cls", "token-cls", "qa" or "seq-reg" (model::parse_task)

  // Where training runs: auto (a GPU when one is present), cpu, cuda or cuda:N; and the precision (fp32,
  // tf32 or bf16 on a GPU; fp32 or bf16 on the CPU: BF16 products, FP32 tensors; Precision in core/device.h).
  std::string device = "cpu";
  Precision precision = Precision::kFp32;
  bool fused_attention = false;  // on a GPU: Bert::set_fused_attention (--attention fused; auto in BF16, TF32)
  bool fused_quantized_attention = true;  // with it, QAT's too (--attention auto: in BF16 only)
  bool recompute_attention = false;  // Bert::set_recompute_attention (--attention recompute in FP32, TF32)
  // QAT on a GPU: the quantized linears' forward products on the integers behind their fake-quantized operands
  // (Bert::set_integer_training; --qat-products integer), else float GEMMs (float); unset (auto): where
  // Bert::integer_training_is_faster.
  std::optional<bool> integer_qat_products;
  // On one GPU, each step recorded and launched as one CUDA graph once its shape has settled
  // (core/step_graph.h; --no-cuda-graphs: op by op).
  bool cuda_graphs = true;
  // The job this process is one rank of (process_group_from_environment; a group of one by default).
  // With several ranks each takes the GPU of its local rank and they exchange through NCCL.
  ProcessGroup process_group;
  // Several ranks: gradients are averaged in buckets of about this many MiB, each started as soon as
  // the backward pass has finished writing it.
  double bucket_mb = 16;

  int64_t steps = 2000;
  int64_t batch_size = 128;
  int64_t accumulation = 1;  // micro-batches per optimizer step (batch_size each)
  double learning_rate = 1e-3;
  double warmup_fraction = 0.1;
  Schedule schedule = Schedule::kLinear;
  OptimizerOptions optimizer;
  double clip_norm = 1.0;  // <= 0: no clipping
  uint64_t seed = 1;       // initialisation, data order and dropout all derive from it

  int64_t log_every = 10;
  int64_t eval_every = 500;   // <= 0: only at the end
  int64_t eval_batches = 20;  // <= 0: the whole evaluation set
  int64_t save_every = 500;   // <= 0: only at the end
  // Quantization-aware training: start from init_from's weights, calibrate the quantizers on training
  // batches (calibration.method) to initialise the scales, then train weights and LSQ scales together.
  std::string init_from;  // checkpoint whose weights start the run (optimizer starts fresh)
  bool qat = false;
  quant::CalibrationOptions calibration;
  model::WeightScales weights = model::WeightScales::kPerChannel;  // the weight quantizers' scales (--weights)
  std::string plan_path;                                           // sensitivity plan: quantizers kept in float
  double scale_lr_multiplier = 1.0;                                // scales learn at learning_rate * this
  // How the quantizer scales train: kLearned (default) learns log-scale (Optimizer::set_log_space), so
  // each step moves a scale by a fraction of itself; kLsq is LSQ's update on the scale itself (small
  // weight scales can collapse under Adam); kFixed keeps the calibrated scales (NVIDIA's QAT recipe:
  // only the weights train).
  enum class ScaleTraining { kLearned, kLsq, kFixed };
  ScaleTraining scales = ScaleTraining::kLearned;
  // Knowledge distillation from a teacher (in float, no dropout): the loss is (1 - w) (MLM + NSP) +
  // w (KL on the MLM logits at the masked positions + KL on the NSP logits), each KL at this
  // temperature (ops::distillation_loss); for a task, (1 - w) CE + w KL on the task logits; for a regression
  // (1 - w) MSE + w the mean squared error to the teacher's scores (no temperature). 0: off.
  double distill_weight = 0.0;
  double distill_temperature = 2.0;
  // The teacher: any model with the same head, labels and tokenizer (e.g. a larger fine-tuned one);
  // "" = the init_from model.
  std::string teacher;
  const std::string& teacher_path() const { return teacher.empty() ? init_from : teacher; }

  bool resume = false;       // continue from output_dir/checkpoint.h5
  int64_t stop_at_step = 0;  // > 0: stop after this step with a checkpoint, as if interrupted
  // Checkpoints kept: 1 keeps only checkpoint.h5; K > 1 also keeps checkpoint-<step>.h5 for the last K
  // saves (hard links to the same data where the file system allows).
  int64_t keep_checkpoints = 1;
  // Keep the model of the best held-out evaluation by this metric (--keep-best; needs eval_shards):
  // output_dir/checkpoint-best.h5 (the model alone, the run folder's config and tokenizer beside it) and
  // best.json (the metric, its value and the step), written when an evaluation beats every one before it
  // (the loss: lower). kAccuracy: MLM accuracy, a task's accuracy or a window's exact match; kMacroF1: a
  // task's macro-F1 (question answering: token F1); kMcc: a classification's Matthews correlation;
  // kLoss: the held-out loss; kQuestionF1: the questions' F1 (eval_questions).
  // kPearson, kSpearman: a regression's correlations.
  enum class BestMetric { kAccuracy, kMacroF1, kMcc, kLoss, kQuestionF1, kPearson, kSpearman, kMrr, kNdcg };
  std::optional<BestMetric> keep_best;
  // Early stopping (--patience N, with keep_best and eval_every): the run stops, with a checkpoint, after N
  // held-out evaluations in a row that do not beat the best (counted from the best's step, so a resumed run
  // stops where an uninterrupted one does). 0: off.
  int64_t patience = 0;
  // A non-finite loss or gradient: "stop" (UserError naming the step and the tensor; the last
  // checkpoint stays as it was) or "skip" (drop that step's update and go on; after
  // max_consecutive_skips skipped steps in a row the run stops as with "stop").
  enum class OnNonFinite { kStop, kSkip };
  OnNonFinite on_nonfinite = OnNonFinite::kStop;
  int64_t max_consecutive_skips = 10;

  void validate() const;  // UserError naming the flag
  Json to_json() const;
};

inline constexpr EnumNames<TrainOptions::OnNonFinite, 2> kOnNonFiniteNames{
    {{{TrainOptions::OnNonFinite::kStop, "stop"}, {TrainOptions::OnNonFinite::kSkip, "skip"}}}};
inline constexpr EnumNames<TrainOptions::BestMetric, 9> kBestMetricNames{
    {{{TrainOptions::BestMetric::kAccuracy, "accuracy"},
      {TrainOptions::BestMetric::kMacroF1, "macro-f1"},
      {TrainOptions::BestMetric::kMcc, "mcc"},
      {TrainOptions::BestMetric::kLoss, "loss"},
      {TrainOptions::BestMetric::kQuestionF1, "question-f1"},
      {TrainOptions::BestMetric::kPearson, "pearson"},
      {TrainOptions::BestMetric::kSpearman, "spearman"},
      {TrainOptions::BestMetric::kMrr, "mrr"},
      {TrainOptions::BestMetric::kNdcg, "ndcg"}}}};
inline constexpr EnumNames<TrainOptions::ScaleTraining, 3> kScaleTrainingNames{
    {{{TrainOptions::ScaleTraining::kLearned, "learned"},
      {TrainOptions::ScaleTraining::kLsq, "lsq"},
      {TrainOptions::ScaleTraining::kFixed, "fixed"}}}};
// "stop" | "skip" (UserError naming --on-nonfinite otherwise).
TrainOptions::OnNonFinite parse_on_nonfinite(const std::string& name);
// "learned" | "lsq" | "fixed" (UserError naming --scales otherwise), and back.
TrainOptions::ScaleTraining parse_scale_training(const std::string& name);
std::string scale_training_name(TrainOptions::ScaleTraining scales);

// --resume keeps the run's plan: each option of the plan (the schedule, the optimizer, the batch, the
// seed, precision, QAT and distillation settings) is taken from the run's record (the checkpoint's
// TrainingState::run) unless `given(flag)` says the command line gave it again. Given with another value,
// --steps and --precision are applied (a longer or shorter run, whose warmup and decay then follow the new
// length; other arithmetic) with a warning naming the old and the new value, returned; any other is
// refused (UserError naming the flag and both values). Options absent from the record are left as given.
std::vector<std::string> resume_plan(TrainOptions& o, const Json& recorded,
                                     const std::function<bool(const std::string& flag)>& given);

}  // namespace bert::train
