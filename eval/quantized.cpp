#include "eval/quantized.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>

#include "eval/output_reads.h"
#include "kernels/int8_gemm.h"
#include "ops/ops.h"
#include "sys/error.h"

namespace bert::eval {

namespace {

struct SavedModes {
  std::vector<std::pair<model::Quantizer*, model::QuantMode>> modes;
  std::vector<float> scales;
  explicit SavedModes(model::Bert& m) {
    for (model::Quantizer* q : m.quantizers()) modes.emplace_back(q, q->mode);
    for (model::Quantizer* q : m.quantizers())
      for (float s : m.parameters().get(q->scale).value) scales.push_back(s);
  }
  void restore(model::Bert& m) const {
    for (auto [q, mode] : modes) q->mode = mode;
    size_t i = 0;
    for (model::Quantizer* q : m.quantizers())
      for (float& s : m.parameters().get(q->scale).value) s = scales[i++];
    m.parameters().upload_values();  // the restored scales, on a GPU
  }
};

double score_of(model::Bert& model, const LoaderFactory& make, int64_t max_batches, Graph<float>& g,
                const Ranking& ranking) {
  data::ShardLoader loader = make();
  return ranking_score(model, loader, max_batches, g, ranking);
}

ModeResult score(const std::string& mode, model::Bert& model, const LoaderFactory& make, int64_t max_batches,
                 Graph<float>& g, const QuestionScoring* questions) {
  data::ShardLoader loader = make();
  ModeResult r{mode, {}, {}, {}};
  if (model.config().head == model::Head::kPretraining) {
    r.metrics = evaluate(model, loader, max_batches, g);
  } else if (questions) {
    AnswerEvaluation a = evaluate_answers(model, loader, *questions, max_batches, g);
    r.task = std::move(a.windows);
    r.answers = std::move(a.answers);
  } else {
    r.task = evaluate_task(model, loader, max_batches, g);
  }
  return r;
}

}  // namespace

double task_score(const TaskMetrics& metrics, TaskScore score) {
  switch (score) {
    case TaskScore::kMacroF1:
      return metrics.macro_f1();
    case TaskScore::kMcc:
      return metrics.mcc();
    case TaskScore::kPearson:
      return metrics.pearson();
    case TaskScore::kSpearman:
      return metrics.spearman();
    case TaskScore::kMrr:
      return metrics.mrr();
    case TaskScore::kNdcg:
      return metrics.ndcg();
    case TaskScore::kAccuracy:
      break;
  }
  return metrics.accuracy();
}

TaskScore default_task_score(const model::BertConfig& config) {
  return config.regression() ? TaskScore::kPearson : TaskScore::kAccuracy;
}

void check_ranking(const model::BertConfig& config, TaskScore score, bool questions) {
  const model::Head head = config.head;
  const std::string flag = "--rank-by " + kTaskScoreNames.name(score);
  const bool correlation = score == TaskScore::kPearson || score == TaskScore::kSpearman || ranks_groups(score);
  if (config.regression() && !correlation)
    throw UserError(flag +
                    ": a regression (one score per sequence) is ranked by its Pearson or Spearman "
                    "correlation, or its groups' MRR or NDCG (--rank-by pearson, spearman, mrr, ndcg)");
  if (correlation && !config.regression())
    throw UserError(flag + ": for a regression (a " + model::head_architecture(head) + " with " +
                    std::to_string(config.num_labels()) + " labels classifies)");
  if (score == TaskScore::kAccuracy || correlation) return;
  if (head == model::Head::kPretraining)
    throw UserError(flag + ": a pretraining model is ranked by its MLM accuracy (--rank-by accuracy)");
  if (head == model::Head::kQuestionAnswering && questions)
    throw UserError(flag + ": with --qa-data the ranking is the questions' F1, as SQuAD scores them");
  if (head == model::Head::kQuestionAnswering && score == TaskScore::kMcc)
    throw UserError(flag +
                    ": question answering has no Matthews correlation (accuracy ranks by exact match, "
                    "macro-f1 by token F1)");
}

void check_groups(TaskScore score, bool grouped, const std::string& flag, const std::string& shard) {
  if (ranks_groups(score) && !grouped)
    throw UserError(flag + ": ranks each group's examples (a query's passages), but '" + shard +
                    "' has no groups (make the seq-reg shards with bert-data's --group-field)");
}

double ranking_score(model::Bert& model, data::ShardLoader& loader, int64_t max_batches, Graph<float>& g,
                     const Ranking& ranking) {
  const model::Head head = model.config().head;
  if (head == model::Head::kPretraining) return evaluate(model, loader, max_batches, g).mlm_accuracy();
  if (ranking.questions && head == model::Head::kQuestionAnswering)
    return evaluate_answers(model, loader, *ranking.questions, max_batches, g).answers.f1();
  return task_score(evaluate_task(model, loader, max_batches, g), ranking.score);
}

std::string ranking_metric(const model::Bert& model, const Ranking& ranking) {
  const model::Head head = model.config().head;
  if (head == model::Head::kPretraining) return "MLM accuracy";
  if (ranking.questions && head == model::Head::kQuestionAnswering) return "question F1";
  switch (ranking.score) {
    case TaskScore::kMacroF1:
      return head == model::Head::kQuestionAnswering ? "task token F1" : "task macro-F1";
    case TaskScore::kMcc:
      return "task MCC";
    case TaskScore::kPearson:
      return "task Pearson";
    case TaskScore::kSpearman:
      return "task Spearman";
    case TaskScore::kMrr:
      return "task MRR@10";
    case TaskScore::kNdcg:
      return "task NDCG@10";
    case TaskScore::kAccuracy:
      break;
  }
  return "task accuracy";
}

std::vector<ModeResult> compare_modes(model::Bert& model, const quant::CalibrationStatistics& stats,
                                      const std::vector<quant::Method>& methods, double percentile,
                                      const LoaderFactory& make, int64_t max_batches, Graph<float>& g,
                                      const QuestionScoring* questions) {
  const SavedModes saved(model);
  const bool came_quantized = std::any_of(saved.modes.begin(), saved.modes.end(),
                                          [](const auto& p) { return p.second == model::QuantMode::kQuantize; });
  std::vector<ModeResult> results;
  quant::disable_all(model);
  results.push_back(score("fp32", model, make, max_batches, g, questions));
  for (quant::Method m : methods) {
    quant::apply_calibration(model, stats, m, percentile);
    results.push_back(score("ptq-" + quant::method_name(m), model, make, max_batches, g, questions));
    saved.restore(model);
    quant::disable_all(model);
  }
  saved.restore(model);
  if (came_quantized) results.push_back(score("qat", model, make, max_batches, g, questions));
  return results;
}

SensitivityReport sensitivity(model::Bert& model, const quant::CalibrationStatistics& stats, quant::Method method,
                              double percentile, const LoaderFactory& make, int64_t max_batches, double max_drop,
                              Graph<float>& g, const std::function<void(const std::string&)>& progress,
                              const Ranking& ranking) {
  const SavedModes saved(model);
  SensitivityReport report;
  report.metric = ranking_metric(model, ranking);
  quant::disable_all(model);
  report.fp32 = score_of(model, make, max_batches, g, ranking);
  quant::apply_calibration(model, stats, method, percentile);  // scales for every chosen quantizer
  const std::vector<model::Quantizer*>& chosen = stats.quantizers;
  auto set_all = [&](model::QuantMode mode) {
    for (model::Quantizer* q : chosen) q->mode = mode;
  };
  report.all_quantized = score_of(model, make, max_batches, g, ranking);
  for (model::Quantizer* q : chosen) {
    SensitivityRow row{q->name};
    set_all(model::QuantMode::kFloat);
    q->mode = model::QuantMode::kQuantize;
    row.only_this = score_of(model, make, max_batches, g, ranking);
    set_all(model::QuantMode::kQuantize);
    q->mode = model::QuantMode::kFloat;
    row.all_but_this = score_of(model, make, max_batches, g, ranking);
    report.rows.push_back(row);
    if (progress) progress(q->name);
  }
  std::stable_sort(report.rows.begin(), report.rows.end(),
                   [](const SensitivityRow& a, const SensitivityRow& b) { return a.only_this < b.only_this; });

  // Greedy plan: keep in float, one at a time, the quantizer whose removal recovered the most.
  std::vector<SensitivityRow> by_gain = report.rows;
  std::stable_sort(by_gain.begin(), by_gain.end(),
                   [](const SensitivityRow& a, const SensitivityRow& b) { return a.all_but_this > b.all_but_this; });
  set_all(model::QuantMode::kQuantize);
  report.planned = report.all_quantized;
  for (const SensitivityRow& row : by_gain) {
    if (report.fp32 - report.planned <= max_drop) break;
    report.keep_float.push_back(row.name);
    for (model::Quantizer* q : chosen)
      if (q->name == row.name) q->mode = model::QuantMode::kFloat;
    report.planned = score_of(model, make, max_batches, g, ranking);
  }
  saved.restore(model);
  return report;
}

std::vector<SensitivityRow> harmful_activation_quantizers(model::Bert& model, const quant::CalibrationStatistics& stats,
                                                          quant::Method method, double percentile,
                                                          const LoaderFactory& make, int64_t max_batches, size_t top,
                                                          Graph<float>& g, const Ranking& ranking) {
  const SavedModes saved(model);
  quant::apply_calibration(model, stats, method, percentile);
  std::vector<SensitivityRow> rows;
  for (model::Quantizer* q : stats.quantizers) {
    if (q->is_weight) continue;
    for (model::Quantizer* other : stats.quantizers) other->mode = model::QuantMode::kFloat;
    q->mode = model::QuantMode::kQuantize;
    rows.push_back({q->name, score_of(model, make, max_batches, g, ranking), 0.0});
  }
  std::stable_sort(rows.begin(), rows.end(),
                   [](const SensitivityRow& a, const SensitivityRow& b) { return a.only_this < b.only_this; });
  if (rows.size() > top) rows.resize(top);
  saved.restore(model);
  return rows;
}

Json SensitivityReport::to_json() const {
  Json::Array row_list, kept;
  for (const SensitivityRow& row : rows) {
    Json j;
    j["name"] = row.name;
    j["only_this"] = row.only_this;
    j["all_but_this"] = row.all_but_this;
    row_list.push_back(j);
  }
  for (const std::string& name : keep_float) kept.emplace_back(name);
  Json s;
  s["metric"] = metric;
  s["fp32"] = fp32;
  s["all_quantized"] = all_quantized;
  s["rows"] = row_list;
  s["keep_float"] = kept;
  s["planned"] = planned;
  return s;
}

namespace {

TimedMode timed_pass(const std::string& mode, model::Bert& model, data::ShardLoader loader, int64_t max_batches,
                     Graph<float>& g, bool cuda_graphs, const QuestionScoring* questions) {
  TimedMode r;
  r.mode = mode;
  const bool task = model.config().head != model::Head::kPretraining;
  if (task) r.task = TaskMetrics::for_head(model.config());
  // Question answering: the head's logits kept, the answers chosen after the timed passes.
  std::vector<float> answer_logits;
  int64_t answer_length = 0;
  Batch batch;
  // As evaluate() scores, pipelined: the MLM loss and top predictions, without the decoder's logits.
  BatchEvaluator evaluator(model, g, cuda_graphs);
  auto take = [&](const OutputReads& out) {
    if (!task && out.mlm_predicted)
      r.predictions.insert(r.predictions.end(), out.mlm_predicted, out.mlm_predicted + out.mlm_targets.size());
    for (int32_t p : out.head_predictions()) r.predictions.push_back(p);
    if (task)
      out.add_to(r.task);
    else
      out.add_to(r.metrics);
    if (task && questions) {
      const std::vector<float> values = out.head_values();
      answer_logits.insert(answer_logits.end(), values.begin(), values.end());
      answer_length = out.head_cols;
    }
  };
  // The first batch is scored alone and not timed: it grows the workspace and wakes the threads, which
  // would otherwise count against whichever mode runs first.
  auto timed_from = std::chrono::steady_clock::now();
  for (int64_t n = 0; (max_batches <= 0 || n < max_batches) && loader.next(batch); ++n) {
    const BatchView b = batch.view();
    if (n == 0) {
      take(evaluator.run(b));
      r.warmup_sequences = b.batch;
      timed_from = std::chrono::steady_clock::now();
      continue;
    }
    if (const OutputReads* out = evaluator.queue(b)) take(*out);
    r.sequences += b.batch;
  }
  if (const OutputReads* out = evaluator.finish()) take(*out);
  g.clear();
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - timed_from).count();
  if (task && questions) {
    AnswerCollector answers(*questions);
    if (answer_length > 0) answers.add(answer_logits, answer_length);
    r.answers = answers.finish();
  }
  return r;
}

}  // namespace

std::string integer_inference_left_out(const Device& device) {
  const auto [major, minor] = device.compute_capability();
  if (!device.is_cuda() || Device::int8_tensor_cores(major, minor)) return "";
  return device.hardware_name() + " (compute capability " + std::to_string(major) + "." + std::to_string(minor) +
         ") has no int8 tensor cores (7.5 or later): INT8 inference is left out there; the fake-quantized model "
         "gives its predictions (the same up to float summation order), and --device cpu runs the integer engine";
}

IntegerComparison compare_integer(model::Bert& model, const LoaderFactory& make, int64_t max_batches, Graph<float>& g,
                                  bool integer_decoder, bool cuda_graphs, const QuestionScoring* questions) {
  const std::vector<model::Quantizer*> enabled = model.enabled_quantizers();
  if (enabled.empty())
    throw UserError("INT8 inference needs a quantized model (a QAT checkpoint, or one saved with --save-calibrated)");
  IntegerComparison c;
  c.kernel = int8_kernel_name(Int8Kernel::kAuto);  // on a GPU: named once its layers are prepared (below)
  for (model::Quantizer* q : enabled) q->mode = model::QuantMode::kFloat;
  c.modes.push_back(timed_pass("fp32", model, make(), max_batches, g, cuda_graphs, questions));
  for (model::Quantizer* q : enabled) q->mode = model::QuantMode::kQuantize;
  c.modes.push_back(timed_pass("fake-quant", model, make(), max_batches, g, cuda_graphs, questions));
  c.left_out = integer_inference_left_out(g.device());
  if (!c.left_out.empty()) {
    c.kernel.clear();
    return c;
  }
  c.integer_layers = model.prepare_integer_inference(integer_decoder);
  if (g.on_cuda()) c.kernel = model.device_int8_gemm();
  c.integer_decoder = model.integer_decoder();
  c.integer_attention_layers = model.integer_attention_layers();
  if (c.integer_layers == 0 || (c.integer_decoder && c.integer_layers == 1)) {
    model.clear_integer_inference();
    throw UserError("no linear layer has both its input and weight quantizers enabled: nothing runs as INT8");
  }
  try {
    c.modes.push_back(timed_pass("int8", model, make(), max_batches, g, cuda_graphs, questions));
    c.integer_residual_norms = model.integer_residual_norms();
  } catch (...) {
    model.clear_integer_inference();
    throw;
  }
  model.clear_integer_inference();
  if (model.config().regression()) {  // each sequence's score: how far INT8 moves it
    const auto &fake = c.modes[1].task.scored, &integer = c.modes[2].task.scored;
    c.scores = true;
    c.compared = static_cast<int64_t>(std::min(fake.size(), integer.size()));
    double sum = 0;
    for (int64_t i = 0; i < c.compared; ++i) {
      const double d = std::fabs(double(fake[i].first) - integer[i].first);
      c.max_score_difference = std::max(c.max_score_difference, d), sum += d;
    }
    c.mean_score_difference = c.compared ? sum / double(c.compared) : 0.0;
    return c;
  }
  const std::vector<int32_t>&fake = c.modes[1].predictions, &integer = c.modes[2].predictions;
  c.compared = static_cast<int64_t>(std::min(fake.size(), integer.size()));
  for (int64_t i = 0; i < c.compared; ++i) c.agreeing += fake[i] == integer[i];
  return c;
}

Json IntegerComparison::to_json(const std::vector<std::string>& label_names) const {
  Json j;
  j["kernel"] = kernel;
  j["integer_layers"] = integer_layers;
  j["integer_decoder"] = integer_decoder;
  j["integer_attention_layers"] = integer_attention_layers;
  j["integer_residual_norms"] = integer_residual_norms;
  if (scores) {
    j["max_score_difference_from_fake_quant"] = max_score_difference;
    j["mean_score_difference_from_fake_quant"] = mean_score_difference;
    j["scores_compared"] = compared;
  } else {
    j["agreement_with_fake_quant"] = agreement();
    j["predictions_compared"] = compared;
  }
  if (!left_out.empty()) j["int8_left_out"] = left_out;
  Json::Array rows;
  for (const TimedMode& m : modes) {
    Json row = m.task.num_labels ? m.task.to_json(label_names) : m.metrics.to_json();
    row["mode"] = m.mode;
    row["sequences_timed"] = m.sequences;
    row["sequences_warmup"] = m.warmup_sequences;
    row["seconds"] = m.seconds;
    row["sequences_per_second"] = m.sequences_per_second();
    if (m.answers) row["answers"] = m.answers->to_json();
    rows.push_back(row);
  }
  j["modes"] = rows;
  return j;
}

ModelSize model_size(model::Bert& model) {
  ModelSize size;
  ParameterArena<float>& arena = model.parameters();
  for (ParamId id = 0; id < arena.size(); ++id)
    if (!model::is_quantizer_scale(arena.name(id))) size.parameters += arena.shape(id).numel();
  for (model::Quantizer* q : model.enabled_quantizers())
    if (q->is_weight) size.int8_weight_parameters += arena.shape(model.quantized_weight(*q)).numel();
  return size;
}

Json ModelSize::to_json() const {
  Json j;
  j["parameters"] = parameters;
  j["int8_weight_parameters"] = int8_weight_parameters;
  j["fp32_megabytes"] = fp32_megabytes();
  j["deployed_megabytes"] = deployed_megabytes();
  return j;
}

}  // namespace bert::eval
