// Evaluating quantized models: FP32 vs PTQ (each calibrator) vs the checkpoint's own quantization (QAT)
// side by side, and per-quantizer sensitivity with a plan of quantizers to keep in float.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "eval/metrics.h"
#include "eval/squad.h"
#include "quant/quantize.h"

namespace bert::eval {

// Makes a fresh, non-repeating loader over the evaluation shards (each evaluation starts over).
using LoaderFactory = std::function<data::ShardLoader()>;

struct ModeResult {
  std::string mode;            // "fp32", "ptq-max", "ptq-percentile", ..., "qat"
  PretrainingMetrics metrics;  // pretraining models
  TaskMetrics task;            // task models (sequence or token classification, question answering)
  std::optional<AnswerScores> answers;  // question answering with questions to score
};

// Which of a task's metrics the comparisons rank by (bert-eval --rank-by): its accuracy, its macro-F1
// (question answering: the windows' token F1) or, for classification, its Matthews correlation (GLUE's
// CoLA metric, for labels far from balanced).
// A regression ranks by its Pearson or Spearman correlation (GLUE's STS-B metrics), or, where its examples
// come in groups (a reranker's queries and their passages), by the groups' MRR@10 or NDCG@10.
enum class TaskScore { kAccuracy, kMacroF1, kMcc, kPearson, kSpearman, kMrr, kNdcg };
inline constexpr EnumNames<TaskScore, 7> kTaskScoreNames{{{{TaskScore::kAccuracy, "accuracy"},
                                                           {TaskScore::kMacroF1, "macro-f1"},
                                                           {TaskScore::kMcc, "mcc", "Matthews correlation"},
                                                           {TaskScore::kPearson, "pearson", "Pearson correlation"},
                                                           {TaskScore::kSpearman, "spearman", "Spearman correlation"},
                                                           {TaskScore::kMrr, "mrr", "MRR@10 over the groups"},
                                                           {TaskScore::kNdcg, "ndcg", "NDCG@10 over the groups"}}}};
double task_score(const TaskMetrics& metrics, TaskScore score);
// What a model ranks by unless told: Pearson for a regression, else accuracy.
TaskScore default_task_score(const model::BertConfig& config);
struct Ranking {
  TaskScore score = TaskScore::kAccuracy;  // task models; a pretraining model ranks by MLM accuracy
  // Question answering: the questions' F1 as SQuAD scores it, best span over each question's windows
  // (`score` then unused).
  const QuestionScoring* questions = nullptr;
};
// Whether `score` ranks a regression's groups (MRR@10, NDCG@10): it needs shards with groups.
inline bool ranks_groups(TaskScore score) { return score == TaskScore::kMrr || score == TaskScore::kNdcg; }
// UserError naming --rank-by where `score` does not apply: a pretraining model ranks by MLM accuracy only,
// question answering has no Matthews correlation, and with questions scored (`questions`) it ranks by
// their F1; a regression ranks by Pearson, Spearman, MRR or NDCG only, and only a regression by those.
void check_ranking(const model::BertConfig& config, TaskScore score, bool questions);
// UserError naming `flag` and `shard` where `score` ranks groups (ranks_groups) and the shards have none.
void check_groups(TaskScore score, bool grouped, const std::string& flag, const std::string& shard);
// What sensitivity() and harmful_activation_quantizers() rank by.
double ranking_score(model::Bert& model, data::ShardLoader& loader, int64_t max_batches, Graph<float>& g,
                     const Ranking& ranking = {});
// Its name, for reports and plans: "MLM accuracy", "task accuracy", "task macro-F1", "task MCC", "task Pearson",
// "task Spearman", "task MRR@10", "task NDCG@10", "question F1".
std::string ranking_metric(const model::Bert& model, const Ranking& ranking = {});

// FP32 first, then PTQ with each method from one calibration pass (statistics), then, when the model
// came with quantizers enabled (a QAT checkpoint), that state; with `questions` (question answering) each
// mode's answers scored too. Leaves the model as it came.
std::vector<ModeResult> compare_modes(model::Bert& model, const quant::CalibrationStatistics& stats,
                                      const std::vector<quant::Method>& methods, double percentile,
                                      const LoaderFactory& eval_loader, int64_t max_batches, Graph<float>& g,
                                      const QuestionScoring* questions = nullptr);

struct SensitivityRow {
  std::string name;
  double only_this = 0;     // ranking_score with only this quantizer enabled
  double all_but_this = 0;  // ranking_score with every chosen quantizer but this one
};

struct SensitivityReport {
  std::string metric;  // ranking_metric: what every number below is
  double fp32 = 0, all_quantized = 0;
  std::vector<SensitivityRow> rows;     // most sensitive first (largest drop with only it enabled)
  std::vector<std::string> keep_float;  // the plan: kept in float to stay within max_drop of FP32
  double planned = 0;                   // ranking_score with the plan applied
  Json to_json() const;
};

// For each quantizer of the calibration set: ranking_score (by default accuracy, or question F1) with
// only it, and with all but it, enabled (scales from `method`). The plan greedily keeps in float the quantizer
// whose removal recovers the most, until the all-quantized score is within max_drop (absolute) of FP32's.
SensitivityReport sensitivity(model::Bert& model, const quant::CalibrationStatistics& stats, quant::Method method,
                              double percentile, const LoaderFactory& eval_loader, int64_t max_batches, double max_drop,
                              Graph<float>& g, const std::function<void(const std::string&)>& progress = {},
                              const Ranking& ranking = {});

// The quantizers behind a PTQ row's loss: each chosen activation quantizer enabled alone with its
// `method` scale (everything else in float), lowest ranking_score first, the first `top` of them (only_this
// filled; all_but_this left 0). Weight quantizers are left out: they take max |w| under every method, so
// a loss one calibrator has and another has not is in the activations. Leaves the model as it came.
std::vector<SensitivityRow> harmful_activation_quantizers(model::Bert& model, const quant::CalibrationStatistics& stats,
                                                          quant::Method method, double percentile,
                                                          const LoaderFactory& eval_loader, int64_t max_batches,
                                                          size_t top, Graph<float>& g, const Ranking& ranking = {});

// One pass over the evaluation shards in one mode, timed, with every prediction kept (MLM rows then NSP,
// or the task's rows) for comparing modes prediction by prediction.
struct TimedMode {
  std::string mode;  // "fp32", "fake-quant", "int8"
  PretrainingMetrics metrics;
  TaskMetrics task;
  std::optional<AnswerScores> answers;  // question answering with questions to score
  int64_t warmup_sequences = 0;         // the first batch: scored, not timed
  int64_t sequences = 0;         // timed
  double seconds = 0;
  std::vector<int32_t> predictions;
  double sequences_per_second() const { return seconds > 0 ? sequences / seconds : 0.0; }
};

// A quantized model (quantizers enabled: a QAT checkpoint or a saved calibration) evaluated on g's device
// (CPU or GPU) three ways: FP32 (quantizers off; on a GPU in the device's precision), fake-quantized (the
// float simulation QAT trains), and INT8 with integer GEMMs (Bert::prepare_integer_inference; with
// integer_decoder, on the CPU, the MLM decoder too, dynamically quantized). Leaves the model as it came.
struct IntegerComparison {
  std::vector<TimedMode> modes;  // fp32, fake-quant, int8
  std::string kernel;            // the integer kernel this CPU or GPU ran
  int64_t integer_layers = 0;
  bool integer_decoder = false;          // the MLM decoder ran integer GEMMs too
  int64_t integer_attention_layers = 0;  // encoder layers whose attention products ran as integers
  int64_t integer_residual_norms = 0;    // residual LayerNorms that read int8 addends (on a GPU)
  int64_t agreeing = 0, compared = 0;    // int8 predictions equal to the fake-quantized model's
  // A regression: the largest and the mean |int8 - fake-quantized| score difference over `compared`
  // sequences (agreeing then unused).
  double max_score_difference = 0, mean_score_difference = 0;
  bool scores = false;
  // Why the int8 pass did not run (a GPU without int8 tensor cores: modes then holds fp32 and fake-quant),
  // or empty.
  std::string left_out;
  double agreement() const { return compared ? double(agreeing) / compared : 0.0; }
  Json to_json(const std::vector<std::string>& label_names) const;
};
// Why INT8 inference cannot run on `device` (a GPU without int8 tensor cores), or empty where it can.
std::string integer_inference_left_out(const Device& device);
IntegerComparison compare_integer(model::Bert& model, const LoaderFactory& eval_loader, int64_t max_batches,
                                  Graph<float>& g, bool integer_decoder = false, bool cuda_graphs = true,
                                  const QuestionScoring* questions = nullptr);

// The model's size: every parameter (quantizer scales aside) in FP32, and deployed with the weights of
// the enabled weight quantizers stored as INT8.
struct ModelSize {
  int64_t parameters = 0, int8_weight_parameters = 0;
  double fp32_megabytes() const { return parameters * 4 / 1e6; }
  double deployed_megabytes() const {
    return ((parameters - int8_weight_parameters) * 4 + int8_weight_parameters) / 1e6;
  }
  Json to_json() const;
};
ModelSize model_size(model::Bert& model);

}  // namespace bert::eval
