// bert-eval: masked-LM and NSP accuracy (with baselines) of a checkpoint on shards, or the task metrics
// of a fine-tuned one; FP32 vs INT8 comparisons and sensitivity; fill-mask.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <optional>
#include <sstream>

#include "data/loader.h"
#include "eval/fill_mask.h"
#include "eval/metrics.h"
#include "eval/onnx_runtime.h"
#include "eval/predictions.h"
#include "eval/quantized.h"
#include "eval/squad.h"
#include "kernels/gemm.h"
#include "ort/runner.h"
#include "quant/quantize.h"
#include "store/checkpoint.h"
#include "store/model_source.h"
#include "sys/error.h"
#include "sys/openmp_wait.h"
#include "sys/parallel.h"
#include "sys/process.h"
#include "sys/sha256.h"
#include "sys/text_file.h"
#include "tokenizer/load.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/tokenizer_file.h"
#include "tools/enum_option.h"
#include "tools/tool_main.h"

namespace {

using namespace bert;

struct Args {
  std::string checkpoint, tokenizer_path, fill_text, task;
  std::vector<std::string> shards;
  bool mlm = false, nsp = false, json = false;
  int64_t batch_size = 64, max_batches = 0;
  int top_k = 5, threads = 0;
  bool compare = false, sensitivity = false, int8 = false, int8_decoder = false, cuda_graphs = true;
  std::string calibrators = "max,percentile,entropy,mse", plan_path, plan_out;
  std::vector<std::string> calib_shards;
  quant::CalibrationOptions calibration;
  double max_drop = 0.005, flag_drop = 0.005;
  eval::TaskScore rank_by = eval::TaskScore::kAccuracy;  // unless given: eval::default_task_score
  CLI::Option* rank_by_option = nullptr;
  size_t flag_names = 3;
  std::string save_calibrated, onnx_model, ort_script = ort::default_ort_script(), json_out;
  std::string device_spec = "auto";
  Precision precision = Precision::kFp32;
  std::string weights;  // --weights: the weight quantizers' scales for PTQ (empty: the model's)
  std::string qa_data, predictions_out;  // question answering scored as SQuAD scores it
  eval::AnswerOptions answers;
};

void add_options(CLI::App& app, Args& a) {
  app.description(
      "bert-eval: evaluate a checkpoint. --mlm-accuracy / --nsp-accuracy on shards (with the "
      "most-frequent-token and majority-class baselines), or --fill-mask \"text with [MASK]\". A fine-tuned "
      "model (sequence or token classification) on task shards reports accuracy, macro-F1 and per-label F1; a "
      "question-answering one exact match and token F1 of the predicted answer spans.");
  app.footer(
      "Examples:\n"
      "  bert-eval --checkpoint runs/mini --shards heldout/ --mlm-accuracy --nsp-accuracy\n"
      "  bert-eval --checkpoint runs/mini --shards heldout/ --compare        # FP32 vs INT8 (each calibrator)\n"
      "  bert-eval --checkpoint runs/mini --shards heldout/ --sensitivity --plan-out plan.json\n"
      "  bert-eval --checkpoint runs/qat --shards heldout/ --onnx int8.onnx  # an export in ONNX Runtime\n"
      "  bert-eval --checkpoint runs/qat --shards heldout/ --int8            # integer GEMMs: FP32/fake-quant/INT8\n"
      "  bert-eval --checkpoint runs/mini --fill-mask \"the kernel is written in [MASK].\"\n"
      "  bert-eval --checkpoint runs/pos --shards pos/test.hdf5 --compare   # a fine-tuned tagger, FP32 vs INT8\n"
      "Guides: docs/training.md, docs/quantization.md");
  app.add_option("--checkpoint", a.checkpoint,
                 "checkpoint .h5 (from bert-train), its output folder, or a Hugging Face "
                 "model directory (config.json + model.safetensors)")
      ->required();
  app.add_option("--shards", a.shards, "evaluation shards (files or folders)")->expected(1, -1);
  app.add_flag("--mlm-accuracy", a.mlm, "masked-LM accuracy and loss");
  app.add_flag("--nsp-accuracy", a.nsp, "next-sentence-prediction accuracy and loss");
  app.add_option("--fill-mask", a.fill_text, "text with [MASK] tokens to fill");
  app.add_option(
      "--task", a.task,
      "seq-cls | token-cls | qa | seq-reg: the task the model and shards must be (default: the model's head decides)");
  app.add_option("--top-k", a.top_k, "candidates per mask")->check(CLI::Range(1, 100))->capture_default_str();
  app.add_option("--tokenizer", a.tokenizer_path,
                 "tokenizer: SentencePiece .model or WordPiece vocab.txt (default: the one "
                 "beside the checkpoint)");
  app.add_option("--batch-size", a.batch_size, "sequences per batch")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--max-batches", a.max_batches, "stop after this many batches (0: all)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_option("--qa-data", a.qa_data,
                 "question answering: the JSON-lines file --shards (one shard) was made from; each question's answer "
                 "is then chosen from all its windows and scored as SQuAD scores it (exact match and F1 over "
                 "normalised words, the best over its gold answers)");
  app.add_option("--predictions", a.predictions_out,
                 "a task model: write each example's prediction as JSON lines, in the shards' order (\"label\", "
                 "\"target\" and \"logits\"; a regression's \"score\" and \"target\"; the labeled tokens' \"tags\" "
                 "and \"targets\"; a window's \"start\" and \"end\"); with --qa-data each question's answer as "
                 "JSON {\"id\": \"text\"} (the input of SQuAD's evaluate script)");
  app.add_option("--n-best", a.answers.n_best, "with --qa-data: the largest start and end logits paired per window")
      ->check(CLI::Range(int64_t{1}, int64_t{512}))
      ->capture_default_str();
  app.add_option("--max-answer-tokens", a.answers.max_answer_tokens, "with --qa-data: the longest answer, in tokens")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}))
      ->capture_default_str();
  app.add_flag("--compare", a.compare,
               "FP32 vs PTQ (each of --calibrators) vs the checkpoint's QAT state, side by side");
  app.add_flag("--sensitivity", a.sensitivity,
               "per-quantizer sensitivity: MLM accuracy (a task's --rank-by metric; question F1 with --qa-data) "
               "with only it / all but it quantized, and a plan of quantizers to keep in float");
  a.rank_by_option = bert::tools::add_enum_option(
      app, "--rank-by", a.rank_by, bert::eval::kTaskScoreNames,
      "a task model's metric that --sensitivity ranks by and --flag-drop measures: accuracy, macro-f1 (question "
      "answering: token F1) or mcc (Matthews correlation, for labels far from balanced, as GLUE scores CoLA); a "
      "regression's pearson (its default) or spearman, or with groups (a reranker's queries) mrr or ndcg (MRR@10, "
      "NDCG@10)");
  app.add_option("--calibrators", a.calibrators, "PTQ methods for --compare")->capture_default_str();
  bert::tools::add_enum_option(app, "--calibrator", a.calibration.method, bert::quant::kMethodNames,
                               "method for --sensitivity");
  app.add_option("--percentile", a.calibration.percentile, "percentile for the percentile calibrator")
      ->capture_default_str();
  app.add_option("--calib-shards", a.calib_shards,
                 "calibration shards (default: the first --calib-batches batches of --shards, which --compare and "
                 "--sensitivity then leave out of the evaluation)")
      ->expected(1, -1);
  app.add_option("--calib-batches", a.calibration.batches, "calibration batches")->capture_default_str();
  app.add_flag("--quantize-residuals,!--no-quantize-residuals", a.calibration.residuals,
               "quantize both inputs of each residual add (the default: NVIDIA's TensorRT recipe, where the add "
               "fuses with its LayerNorm and the tensor between layers stays INT8); --no-quantize-residuals "
               "leaves them in float");
  app.add_option("--quantize", a.calibration.include,
                 "comma-separated globs of the quantizers to enable (default set otherwise)");
  app.add_option("--keep-float", a.calibration.keep_float_globs, "comma-separated globs of quantizers kept in float");
  app.add_option("--weights", a.weights,
                 "PTQ weight scales: per-channel (one per output channel, the default) or per-tensor (one per "
                 "weight); a quantized checkpoint keeps its own")
      ->check(CLI::IsMember(bert::model::kWeightScalesNames.names()));
  app.add_option("--plan", a.plan_path, "plan file: quantizers kept in float for PTQ");
  app.add_option("--max-drop", a.max_drop,
                 "--sensitivity: largest drop from FP32 the plan may leave (absolute, of the ranked metric)")
      ->capture_default_str();
  app.add_option("--plan-out", a.plan_out, "--sensitivity: write the plan here");
  app.add_option("--flag-drop", a.flag_drop,
                 "--compare: flag a row whose accuracy (--rank-by) is this much below FP32 (absolute; 0.005 = 0.5 "
                 "point) and, "
                 "for a PTQ row, name the activation quantizers behind it (each alone under that calibrator)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--flag-names", a.flag_names, "--compare: how many quantizers a flagged PTQ row names")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  app.add_flag("--int8", a.int8,
               "INT8 inference for a quantized model (QAT, or --save-calibrated): the linear layers run integer "
               "GEMMs, on the CPU (kernel chosen from the CPU: amx, avx512-vnni, avx2, generic; the attention "
               "products too) or a GPU (--device cuda: int8 tensor cores, compute capability 7.5 or later; on an older "
               "GPU left out with a warning). With --shards: scored and timed beside "
               "FP32 and the fake-quantized model, with the share of predictions that agree; with --fill-mask: the "
               "INT8 model fills");
  app.add_flag(
      "--int8-decoder", a.int8_decoder,
      "with --int8 on the CPU, the MLM decoder (tied word embeddings, kept in float by quantization and "
      "export) as integers too: weights per vocabulary row, its input quantized per row at run time. Faster where the "
      "vocabulary is large next to the hidden size; agreement with the fake-quantized model then counts "
      "that quantization too");
  app.add_option("--onnx", a.onnx_model,
                 "also evaluate this ONNX export in ONNX Runtime on --shards (a pretraining model's export made with "
                 "--masked-positions; a task model's export as it is)");
  app.add_option("--ort-script", a.ort_script,
                 "the ONNX Runtime runner: scripts/ort_run.js (Node, npm onnxruntime-node) or scripts/ort_run.py "
                 "(Python, the onnxruntime package)")
      ->capture_default_str();
  app.add_option("--save-calibrated", a.save_calibrated,
                 "post-training quantization: calibrate with --calibrator on --calib-shards (or --shards) and save "
                 "the model with its scales and quantizers enabled as a checkpoint (then evaluate or export it)");
  app.add_flag("!--no-cuda-graphs", a.cuda_graphs,
               "on a GPU, run each batch's kernels op by op instead of recording the batch's forward pass and "
               "launching it as one CUDA graph (the default once two batches of a shape have run: the same "
               "values, with less waiting between kernels)");
  app.add_flag("--json", a.json, "print JSON instead of a table");
  app.add_option("--json-out", a.json_out, "also write the JSON report to this file");
  app.add_option("--threads", a.threads, "threads (0: all cores)")->check(CLI::Range(0, 1024));
  app.add_option("--device", a.device_spec, "where to evaluate: auto (a GPU when one is present), cpu, cuda, cuda:N")
      ->capture_default_str();
  bert::tools::add_enum_option(app, "--precision", a.precision, kPrecisionNames,
                               "fp32; tf32 (GPU: TF32 GEMMs); or bf16 (GPU: BF16 activations and GEMMs; CPU: "
                               "products on BF16-rounded operands with FP32 sums)");
}

// One evaluation: the loaded model and what the steps below share. Each step prints its table (unless
// --json) and fills its part of the report.
struct Evaluation {
  Args& a;
  model::Bert& model;
  const store::TrainingState& state;
  Graph<float>& g;
  bool task_model;
  Json report;
  const eval::QuestionScoring* questions = nullptr;  // --qa-data: each question's answer scored too
  const model::BertConfig& config() const { return model.config(); }
  eval::Ranking ranking() const { return {a.rank_by, questions}; }
  std::string describe_quantization() {
    const int quantized = static_cast<int>(model.enabled_quantizers().size());
    const std::string products = !g.device().is_cuda() && g.device().precision() == Precision::kBf16
                                     ? std::string(", BF16 products (") + gemm_bf16_kernel_name() + ")"
                                     : "";
    return (quantized ? "fake-quantized INT8 (" + std::to_string(quantized) + " quantizers)" : "FP32") + products;
  }
};

void check_shards_fit_the_model(const Evaluation& e, data::ShardLoader& loader, const data::LoaderOptions& lo) {
  const model::BertConfig& config = e.config();
  data::check_loader_compatible(loader, lo.shards.front(), config.vocab_size, config.max_position_embeddings,
                                e.state.tokenizer_sha256);
  const bool spans = config.head == model::Head::kQuestionAnswering;  // start, end: whatever their names
  const bool scores = loader.kind() == data::ShardKind::kSequenceScores;  // one score: whatever its name
  if (scores != config.regression())
    throw UserError("--shards: '" + lo.shards.front() + "' holds " + data::shard_kind_name(loader.kind()) +
                    " examples; the model is " +
                    (config.regression() ? "a regression (make its shards with bert-data task --task seq-reg)"
                                         : "a " + model::head_architecture(config.head) + ", not a regression"));
  if (e.task_model != (loader.kind() != data::ShardKind::kPretraining) ||
      spans != (loader.kind() == data::ShardKind::kSpanLabels) ||
      (e.task_model && !spans && !scores && loader.label_names() != config.labels))
    throw UserError("--shards: '" + lo.shards.front() + "' holds " + data::shard_kind_name(loader.kind()) +
                    " examples" +
                    (e.task_model ? " with " + std::to_string(loader.label_names().size()) + " labels" : "") +
                    "; the model is a " + model::head_architecture(config.head) +
                    (e.task_model ? " with " + std::to_string(config.num_labels()) + " labels" : "") +
                    " (make the shards with the model's labels: bert-data task --labels <its training shard>)");
  if (e.a.compare || e.a.sensitivity)
    eval::check_groups(e.a.rank_by, loader.grouped(), "--rank-by " + eval::kTaskScoreNames.name(e.a.rank_by),
                       lo.shards.front());
}

// --save-calibrated: PTQ scales from `stats`, saved as a checkpoint with its tokenizer beside it.
void save_calibrated(Evaluation& e, const quant::CalibrationStatistics& stats) {
  Args& a = e.a;
  const auto amax =
      quant::apply_calibration(e.model, stats, a.calibration.method, a.calibration.percentile);
  store::TrainingState ptq = e.state;
  Json recipe = quant::describe_calibration(a.calibration, stats.batches, e.model.config().weight_scales);
  recipe["qat"] = false;
  recipe["source_checkpoint"] = a.checkpoint;
  ptq.quantization = recipe;
  // The tokenizer travels with the checkpoint (as bert-train's runs carry theirs), so bert-export and
  // bert-eval find it beside the file without --tokenizer.
  if (!a.tokenizer_path.empty()) {
    tokenizer::copy_tokenizer(a.tokenizer_path, std::filesystem::absolute(a.save_calibrated).parent_path().string());
    if (ptq.tokenizer_sha256.empty()) ptq.tokenizer_sha256 = sha256_file(a.tokenizer_path);
  }
  store::save_checkpoint(a.save_calibrated, e.model, nullptr, ptq);
  spdlog::info("calibrated {} quantizers ({}, {} batches) -> {}", amax.size(), quant::method_name(a.calibration.method), stats.batches,
               a.save_calibrated);
}

// --compare: FP32, each PTQ calibrator and the checkpoint's own quantization, side by side.
void compare(Evaluation& e, const quant::CalibrationStatistics& stats, const eval::LoaderFactory& make_loader) {
  const Args& a = e.a;
  std::vector<quant::Method> methods;
  std::stringstream list(a.calibrators);
  for (std::string m; std::getline(list, m, ',');) methods.push_back(quant::parse_method(m));
  const auto results = eval::compare_modes(e.model, stats, methods, a.calibration.percentile, make_loader,
                                           a.max_batches, e.g, e.questions);
  Json::Array rows;
  const eval::TaskMetrics task_kind = eval::TaskMetrics::for_head(e.config());  // for the column names
  // Classification: a Matthews correlation column.
  const bool labels = e.task_model && !task_kind.spans && !task_kind.regression;
  if (!a.json && e.task_model)
    std::printf("%-16s %11s %10s%s %10s%s\n", "mode", task_kind.accuracy_name(), task_kind.f1_name(),
                labels ? fmt::format(" {:>10}", "MCC").c_str() : "", "loss",
                e.questions ? "   question EM   question F1" : "");
  else if (!a.json)
    std::printf("%-16s %10s %10s %10s %10s\n", "mode", "MLM acc", "MLM loss", "NSP acc", "NSP loss");
  for (const auto& r : results) {
    if (!a.json && e.task_model)
      std::printf(
          "%-16s %11.4f %10.4f%s %10.4f%s\n", r.mode.c_str(), r.task.first(), r.task.second(),
          labels ? fmt::format(" {:10.4f}", r.task.mcc()).c_str() : "", r.task.loss(),
          r.answers ? fmt::format(" {:13.4f} {:13.4f}", r.answers->exact_match(), r.answers->f1()).c_str() : "");
    else if (!a.json)
      std::printf("%-16s %10.4f %10.4f %10.4f %10.4f\n", r.mode.c_str(), r.metrics.mlm_accuracy(), r.metrics.mlm_loss(),
                  r.metrics.nsp_accuracy(), r.metrics.nsp_loss());
    Json row = e.task_model ? r.task.to_json(e.config().labels) : r.metrics.to_json();
    row["mode"] = r.mode;
    if (r.answers) row["answers"] = r.answers->to_json();
    rows.push_back(row);
  }
  if (!a.json && task_kind.regression && !results.empty())
    std::printf(
        "(%lld sequences; loss: mean squared error; baseline: the mean score, MSE %.4f; calibration: %lld "
        "batches)\n",
        (long long)results[0].task.examples, results[0].task.baseline_mse(), (long long)stats.batches);
  else if (!a.json && e.task_model && !results.empty())
    std::printf("(%lld %s; baseline: majority %s %.4f; calibration: %lld batches)\n",
                (long long)results[0].task.examples,
                e.config().head == model::Head::kTokenClassification ? "tokens" : "sequences",
                task_kind.spans ? "span" : "label", results[0].task.majority_accuracy(), (long long)stats.batches);
  else if (!a.json && !results.empty())
    std::printf(
        "(%lld predictions; baselines: most-frequent-token %.4f, NSP majority %.4f; calibration: %lld "
        "batches)\n",
        (long long)results[0].metrics.predictions, results[0].metrics.most_frequent_token_accuracy(),
        results[0].metrics.nsp_majority_accuracy(), (long long)stats.batches);
  // Rows that lose more than --flag-drop (of eval::ranking_metric: question F1 where questions are scored,
  // else --rank-by): flagged, and a PTQ row's loss traced to its activation quantizers.
  auto accuracy = [&](const eval::ModeResult& r) {
    if (r.answers) return r.answers->f1();
    return e.task_model ? eval::task_score(r.task, a.rank_by) : r.metrics.mlm_accuracy();
  };
  const double fp32 = results.empty() ? 0.0 : accuracy(results[0]);
  for (size_t i = 1; i < results.size(); ++i) {
    const double drop = fp32 - accuracy(results[i]);
    if (!(drop > a.flag_drop)) continue;
    rows[i]["flagged"] = true;
    const std::string& mode = results[i].mode;
    if (!a.json)
      std::printf("! %s loses %.2f points against FP32 (more than --flag-drop %.2f)%s\n", mode.c_str(), 100 * drop,
                  100 * a.flag_drop, mode.starts_with("ptq-") ? "; each activation quantizer alone under it:" : "");
    if (!mode.starts_with("ptq-")) continue;
    const quant::Method method = quant::parse_method(mode.substr(4));
    spdlog::info("{}: scoring each activation quantizer alone to find the loss", mode);
    Json::Array named;
    for (const eval::SensitivityRow& q :
         eval::harmful_activation_quantizers(e.model, stats, method, a.calibration.percentile, make_loader,
                                             a.max_batches, a.flag_names, e.g, e.ranking())) {
      if (!a.json)
        std::printf("    %-64s %10.4f (%+.2f points)\n", q.name.c_str(), q.only_this, 100 * (q.only_this - fp32));
      Json j;
      j["name"] = q.name;
      j["only_this"] = q.only_this;
      named.push_back(j);
    }
    rows[i]["responsible"] = named;
  }
  e.report["compare"] = rows;
}

// --sensitivity: accuracy with each quantizer alone and with all but it, and a plan (--plan-out).
void sensitivity(Evaluation& e, const quant::CalibrationStatistics& stats, const eval::LoaderFactory& make_loader) {
  const Args& a = e.a;
  const auto r = eval::sensitivity(
      e.model, stats, a.calibration.method, a.calibration.percentile, make_loader, a.max_batches, a.max_drop, e.g,
      [](const std::string& name) { spdlog::info("sensitivity: {}", name); }, e.ranking());
  if (!a.json) {
    std::printf("FP32 %s %.4f; all %zu quantizers (%s) %.4f\n", r.metric.c_str(), r.fp32, r.rows.size(),
                quant::method_name(a.calibration.method).c_str(), r.all_quantized);
    std::printf("%-64s %10s %12s\n", "quantizer (most sensitive first)", "only this", "all but this");
    for (const auto& row : r.rows)
      std::printf("%-64s %10.4f %12.4f\n", row.name.c_str(), row.only_this, row.all_but_this);
    std::printf("plan: keep %zu in float -> %s %.4f (FP32 %.4f, allowed drop %.4f)\n", r.keep_float.size(),
                r.metric.c_str(), r.planned, r.fp32, a.max_drop);
  }
  e.report["sensitivity"] = r.to_json();
  if (!a.plan_out.empty()) {
    Json details;
    details["calibrator"] = quant::method_name(a.calibration.method);
    details["metric"] = r.metric;
    details["max_drop"] = a.max_drop;
    details["fp32"] = r.fp32;
    details["planned"] = r.planned;
    quant::write_plan(a.plan_out, r.keep_float, details);
    if (!a.json) std::printf("plan written to %s\n", a.plan_out.c_str());
  }
}

// --qa-data: the questions of the one shard, windowed again as the shard was and checked against it.
data::QuestionWindows question_windows(const Evaluation& e, const std::vector<std::string>& shards,
                                       const tokenizer::Tokenizer& tokenizer) {
  if (shards.size() != 1)
    throw UserError("--qa-data: give the one shard made from '" + e.a.qa_data + "' as --shards (found " +
                    std::to_string(shards.size()) + ")");
  return eval::windows_of_shard(e.a.qa_data, shards.front(), tokenizer, "--qa-data");
}

// A task model's metrics on the shards: accuracy, macro-F1, loss and per-label F1; for question answering
// with --qa-data also SQuAD's exact match and F1 over the questions.
void task_metrics(Evaluation& e, data::ShardLoader& loader, const std::vector<std::string>& shards) {
  const model::BertConfig& config = e.config();
  const size_t shard_count = shards.size();
  eval::TaskMetrics t;
  std::optional<eval::AnswerScores> answers;
  if (e.questions) {
    eval::AnswerEvaluation r =
        eval::evaluate_answers(e.model, loader, *e.questions, e.a.max_batches, e.g, e.a.cuda_graphs);
    t = std::move(r.windows);
    answers = std::move(r.answers);
    e.report["answers"] = answers->to_json();
    if (!e.a.predictions_out.empty()) {
      write_text_file(e.a.predictions_out, answers->predictions_json().dump(2) + "\n");
      spdlog::info("{} answers -> {}", answers->predictions.size(), e.a.predictions_out);
    }
  } else if (!e.a.predictions_out.empty()) {
    eval::ExamplePredictions predictions(config);
    t = eval::evaluate_task(e.model, loader, e.a.max_batches, e.g, e.a.cuda_graphs, &predictions);
    write_text_file(e.a.predictions_out, predictions.jsonl());
    spdlog::info("{} predictions -> {}", predictions.examples().size(), e.a.predictions_out);
  } else {
    t = eval::evaluate_task(e.model, loader, e.a.max_batches, e.g, e.a.cuda_graphs);
  }
  e.report["task"] = config.task();
  e.report["metrics"] = t.to_json(config.labels);
  if (e.a.json) return;
  const bool tokens = config.head == model::Head::kTokenClassification;
  std::printf("%s %s (step %lld) on %zu shard(s), %s\n", model::head_architecture(config.head).c_str(),
              e.a.checkpoint.c_str(), (long long)e.state.step, shard_count, e.describe_quantization().c_str());
  if (t.regression) {
    std::printf("%-22s %10.4f   over %lld sequences\n", "Pearson correlation", t.pearson(), (long long)t.examples);
    std::printf("%-22s %10.4f\n", "Spearman correlation", t.spearman());
    std::printf("%-22s %10.4f   (baseline: the mean score, %.4f)\n", "mean squared error", t.loss(), t.baseline_mse());
    if (!t.groups.empty())
      std::printf("%-22s %10.4f   over %lld groups with a relevant example (a target above 0)\n%-22s %10.4f\n",
                  "MRR@10", t.mrr(), (long long)t.ranked_groups(), "NDCG@10", t.ndcg());
    return;
  }
  std::printf("%-22s %10.4f   (baseline: majority %s %.4f) over %lld %s\n", t.accuracy_name(), t.accuracy(),
              t.spans ? "span" : "label", t.majority_accuracy(), (long long)t.examples,
              tokens ? "labeled tokens" : "sequences");
  std::printf("%-22s %10.4f\n", t.f1_name(), t.macro_f1());
  if (!t.spans) std::printf("%-22s %10.4f\n", "Matthews correlation", t.mcc());
  std::printf("%-22s %10.4f\n", "loss", t.loss());
  if (t.spans) {  // each end's accuracy instead of per-label F1
    const Json j = t.to_json(config.labels);
    std::printf("%-22s %10.4f\n%-22s %10.4f\n", "start accuracy", j.find("start_accuracy")->as_number(), "end accuracy",
                j.find("end_accuracy")->as_number());
    if (!answers) {
      std::printf("(per window and in tokens; --qa-data scores each question's answer text as SQuAD does)\n");
      return;
    }
    std::printf(
        "questions (SQuAD's scoring of the answer texts; %lld questions%s):\n", (long long)answers->questions,
        answers->unscored ? (", " + std::to_string(answers->unscored) + " not scored: --max-batches").c_str() : "");
    std::printf("%-22s %10.4f\n%-22s %10.4f\n", "exact match", answers->exact_match(), "F1", answers->f1());
    if (answers->unanswerable)
      std::printf("  answerable %lld: exact match %.4f, F1 %.4f; unanswerable %lld\n", (long long)answers->answerable,
                  answers->answerable ? answers->answerable_exact_sum / answers->answerable : 0.0,
                  answers->answerable ? answers->answerable_f1_sum / answers->answerable : 0.0,
                  (long long)answers->unanswerable);
    return;
  }
  std::printf("%-22s %10s %10s\n", "label", "F1", "support");
  for (int64_t l = 0; l < config.num_labels(); ++l) {
    int64_t support = 0;
    for (int64_t o = 0; o < config.num_labels(); ++o) support += t.confusion[l * config.num_labels() + o];
    std::printf("%-22s %10.4f %10lld\n", config.labels[l].c_str(), t.f1(l), (long long)support);
  }
}

// A pretraining model's MLM/NSP metrics with their baselines.
void print_pretraining_metrics(Evaluation& e, const eval::PretrainingMetrics& m, size_t shard_count) {
  e.report["metrics"] = m.to_json();
  if (e.a.json) return;
  std::printf("checkpoint %s (step %lld) on %zu shard(s), %s\n", e.a.checkpoint.c_str(), (long long)e.state.step,
              shard_count, e.describe_quantization().c_str());
  std::printf("%-22s %10s %12s %12s\n", "metric", "value", "baseline", "count");
  if (e.a.mlm) {
    std::printf("%-22s %10.4f %12.4f %12lld   (baseline: most frequent token)\n", "MLM accuracy", m.mlm_accuracy(),
                m.most_frequent_token_accuracy(), (long long)m.predictions);
    std::printf("%-22s %10.4f %12s %12lld\n", "MLM loss", m.mlm_loss(), "", (long long)m.predictions);
  }
  if (e.a.nsp) {
    std::printf("%-22s %10.4f %12.4f %12lld   (baseline: majority class)\n", "NSP accuracy", m.nsp_accuracy(),
                m.nsp_majority_accuracy(), (long long)m.sequences);
    std::printf("%-22s %10.4f %12s %12lld\n", "NSP loss", m.nsp_loss(), "", (long long)m.sequences);
  }
}

// --onnx: the export scored in ONNX Runtime on the same shards, in this run's own exchange folder.
void onnx_metrics(Evaluation& e, const data::LoaderOptions& lo) {
  const Args& a = e.a;
  if (!e.model.enabled_quantizers().empty() && !ort::integer_kernels_exact())
    spdlog::warn(
        "this CPU has no VNNI: ONNX Runtime's integer kernels for a Q/DQ export can saturate 16-bit "
        "pair sums (vpmaddubsw), so its scores can differ slightly from the engine's (TensorRT and CPUs "
        "with AVX-512 VNNI or AVX-VNNI compute them exactly; BERT_ORT_OPTIMIZATION=disabled runs the "
        "export's own float Q/DQ arithmetic instead)");
  data::ShardLoader onnx_loader(lo);
  const PrivateTempDir work("bert-eval");
  if (e.task_model) {
    eval::AnswerScores answers;
    const eval::TaskMetrics o = eval::evaluate_onnx_task(a.onnx_model, onnx_loader, e.config(), a.max_batches,
                                                         a.ort_script, work.path().string(), e.questions, &answers);
    e.report["onnx"] = o.to_json(e.config().labels);
    if (e.questions) e.report["onnx"]["answers"] = answers.to_json();
    if (!a.json)
      std::printf("ONNX Runtime (%s): %s %.4f, %s %.4f over %lld %s\n", a.onnx_model.c_str(), o.accuracy_name(),
                  o.first(), o.f1_name(), o.second(), (long long)o.examples,
                  e.config().head == model::Head::kTokenClassification ? "labeled tokens" : "sequences");
    if (!a.json && e.questions)
      std::printf("ONNX Runtime (%s): questions exact match %.4f, F1 %.4f over %lld questions\n", a.onnx_model.c_str(),
                  answers.exact_match(), answers.f1(), (long long)answers.questions);
  } else {
    const eval::PretrainingMetrics o =
        eval::evaluate_onnx(a.onnx_model, onnx_loader, a.max_batches, a.ort_script, work.path().string());
    e.report["onnx"] = o.to_json();
    if (!a.json)
      std::printf("ONNX Runtime (%s): MLM accuracy %.4f over %lld predictions, NSP accuracy %.4f\n",
                  a.onnx_model.c_str(), o.mlm_accuracy(), (long long)o.predictions, o.nsp_accuracy());
  }
}

// --int8: FP32, fake-quantized and integer inference side by side, timed, with their agreement.
void integer_metrics(Evaluation& e, const eval::LoaderFactory& make_loader) {
  const eval::IntegerComparison c =
      eval::compare_integer(e.model, make_loader, e.a.max_batches, e.g, e.a.int8_decoder, e.a.cuda_graphs, e.questions);
  e.report["int8"] = c.to_json(e.config().labels);
  if (!c.left_out.empty()) spdlog::warn("--int8: {}", c.left_out);
  if (e.a.json) return;
  const std::string where = e.g.on_cuda() ? e.g.device().name() : std::to_string(num_threads()) + " threads";
  if (c.left_out.empty())
    std::printf(
        "checkpoint %s (step %lld): %lld linear layers as INT8%s, and the attention products of %lld layers%s "
        "(%s kernel, %s)\n",
        e.a.checkpoint.c_str(), (long long)e.state.step, (long long)c.integer_layers,
        c.integer_decoder ? ", the MLM decoder among them (dynamic per-row input scales)" : "",
        (long long)c.integer_attention_layers,
        c.integer_residual_norms
            ? (", " + std::to_string(c.integer_residual_norms) + " residual LayerNorms on int8 addends").c_str()
            : "",
        c.kernel.c_str(), where.c_str());
  else
    std::printf("checkpoint %s (step %lld): FP32 and fake-quantized on %s, INT8 left out (no int8 tensor cores)\n",
                e.a.checkpoint.c_str(), (long long)e.state.step, where.c_str());
  if (e.task_model)
    std::printf("%-12s %11s %10s %12s %10s%s\n", "mode", eval::TaskMetrics::for_head(e.config()).accuracy_name(),
                eval::TaskMetrics::for_head(e.config()).f1_name(), "sequences/s", "vs FP32",
                e.questions ? "   question EM   question F1" : "");
  else
    std::printf("%-12s %10s %10s %12s %10s\n", "mode", "MLM acc", "NSP acc", "sequences/s", "vs FP32");
  const double fp32 = c.modes.front().sequences_per_second();
  for (const eval::TimedMode& m : c.modes)
    std::printf("%-12s %11.4f %10.4f %12.1f %9.2fx%s\n", m.mode.c_str(),
                e.task_model ? m.task.first() : m.metrics.mlm_accuracy(),
                e.task_model ? m.task.second() : m.metrics.nsp_accuracy(), m.sequences_per_second(),
                fp32 > 0 ? m.sequences_per_second() / fp32 : 0.0,
                m.answers ? fmt::format(" {:13.4f} {:13.4f}", m.answers->exact_match(), m.answers->f1()).c_str() : "");
  if (!c.left_out.empty()) return;
  const eval::TimedMode& first = c.modes.front();
  if (c.scores && c.max_score_difference == 0) {
    std::printf("INT8 gives the fake-quantized model's scores exactly over %lld sequences\n", (long long)c.compared);
    return;
  }
  if (c.scores) {
    std::printf(
        "INT8's scores differ from the fake-quantized model's by at most %.4g (mean %.4g) over %lld sequences (each "
        "mode's first batch scored, not timed)\n",
        c.max_score_difference, c.mean_score_difference, (long long)c.compared);
    return;
  }
  std::printf(
      "INT8 agrees with the fake-quantized model on %.4f of %lld predictions (%lld sequences; each mode's first batch "
      "scored, not timed)\n",
      c.agreement(), (long long)c.compared, (long long)(first.sequences + first.warmup_sequences));
}

// Everything that reads --shards.
void evaluate_shards(Evaluation& e) {
  Args& a = e.a;
  data::LoaderOptions lo;
  lo.shards = data::expand_shard_paths(a.shards);
  lo.batch_size = a.batch_size;
  lo.shuffle = false;
  lo.repeat = false;
  data::ShardLoader loader(lo);
  check_shards_fit_the_model(e, loader, lo);
  // --qa-data: the questions behind the shard, for scoring each one's answer in every pass below.
  std::unique_ptr<tokenizer::Tokenizer> qa_tokenizer;
  std::optional<data::QuestionWindows> qa_windows;
  std::optional<eval::QuestionScoring> questions;
  if (!a.qa_data.empty()) {
    qa_tokenizer = tokenizer::load_tokenizer(a.tokenizer_path);
    qa_windows = question_windows(e, lo.shards, *qa_tokenizer);
    questions.emplace(eval::QuestionScoring{*qa_windows, qa_tokenizer.get(), a.answers, 0});
    e.questions = &*questions;
  }
  // Without --calib-shards, calibration reads the first --calib-batches batches of --shards, and the
  // comparisons score only the batches after them: a calibrator never sees the data it is scored on.
  const int64_t held_for_calibration =
      a.calib_shards.empty() && (a.compare || a.sensitivity) ? a.calibration.batches : 0;
  if (held_for_calibration > 0)
    spdlog::info(
        "calibrating on the first {} batches of --shards and scoring the rest (--calib-shards to calibrate on "
        "other data)",
        held_for_calibration);
  if (questions) {
    questions->first_window = held_for_calibration * lo.batch_size;  // the passes that skip those batches
    if (held_for_calibration > 0)
      spdlog::info("--qa-data: the questions with windows in those batches are not scored in the comparison");
  }
  auto make_loader = [lo, held_for_calibration] {
    data::ShardLoader l(lo);
    Batch skipped;
    for (int64_t i = 0; i < held_for_calibration; ++i)
      if (!l.next(skipped))
        throw UserError("--shards: only " + std::to_string(i) +
                        " batches, all needed for calibration (--calib-batches " +
                        std::to_string(held_for_calibration) + "); give --calib-shards, or fewer --calib-batches");
    return l;
  };
  auto calibration_statistics = [&] {
    data::LoaderOptions co = lo;
    co.shards = a.calib_shards.empty() ? lo.shards : data::expand_shard_paths(a.calib_shards);
    data::ShardLoader calibration_loader(co);
    if (!a.plan_path.empty()) a.calibration.keep_float = quant::read_plan(a.plan_path, e.model);
    return quant::collect_statistics(e.model, calibration_loader, a.calibration, e.g);
  };
  if (!a.save_calibrated.empty()) save_calibrated(e, calibration_statistics());
  if (a.compare || a.sensitivity) {
    // Calibrating changes quantizer modes; remember the checkpoint's (QAT) state to compare with it.
    std::vector<std::pair<model::Quantizer*, model::QuantMode>> modes;
    for (model::Quantizer* q : e.model.quantizers()) modes.emplace_back(q, q->mode);
    const quant::CalibrationStatistics stats = calibration_statistics();
    for (auto [q, mode] : modes) q->mode = mode;
    if (a.compare) compare(e, stats, make_loader);
    if (a.sensitivity) sensitivity(e, stats, make_loader);
  } else if (a.int8) {
    integer_metrics(e, make_loader);
  } else if (e.task_model) {
    if (questions) questions->first_window = 0;
    task_metrics(e, loader, lo.shards);
  }
  const bool pretraining = !a.compare && !a.sensitivity && !a.int8 && !e.task_model;
  eval::PretrainingMetrics m;
  if (pretraining) m = eval::evaluate(e.model, loader, a.max_batches, e.g, a.cuda_graphs);
  if (!a.onnx_model.empty()) onnx_metrics(e, lo);
  if (pretraining) print_pretraining_metrics(e, m, lo.shards.size());
  e.report["shards"] = static_cast<int64_t>(lo.shards.size());
}

// --fill-mask: the top-k candidates for each [MASK] of the text.
void fill_mask(Evaluation& e) {
  const Args& a = e.a;
  std::unique_ptr<tokenizer::Tokenizer> tokenizer = tokenizer::load_tokenizer(a.tokenizer_path);
  if (!e.state.tokenizer_sha256.empty() && tokenizer->file_sha256() != e.state.tokenizer_sha256)
    throw UserError("tokenizer '" + a.tokenizer_path + "' is not the one the checkpoint was trained with");
  const std::string int8_left_out = a.int8 ? eval::integer_inference_left_out(e.g.device()) : "";
  if (!int8_left_out.empty()) spdlog::warn("--int8: {}", int8_left_out);
  if (a.int8 && int8_left_out.empty()) {
    const int64_t layers = e.model.prepare_integer_inference(a.int8_decoder);
    if (layers == int64_t{a.int8_decoder})
      throw UserError("--int8: no linear layer of '" + a.checkpoint + "' has both quantizers enabled");
    e.report["fill_mask_int8_layers"] = layers;
  }
  Json::Array masks;
  for (const eval::MaskPrediction& p : eval::fill_mask(e.model, *tokenizer, a.fill_text, a.top_k, e.g)) {
    Json::Array candidates;
    if (!a.json) std::printf("[MASK] at position %d:\n", p.position);
    for (const auto& [piece, prob] : p.candidates) {
      if (!a.json) std::printf("  %-20s %.4f\n", piece.c_str(), prob);
      Json c;
      c["token"] = piece;
      c["probability"] = prob;
      candidates.push_back(c);
    }
    Json mj;
    mj["position"] = p.position;
    mj["candidates"] = candidates;
    masks.push_back(mj);
  }
  e.report["fill_mask"] = masks;
}

// Flags that contradict each other or the model, before anything is loaded onto a device.
void check_requests(const Args& a) {
  if (a.fill_text.empty() && a.shards.empty())
    throw UserError("nothing to do: give --shards (with --mlm-accuracy/--nsp-accuracy) or --fill-mask");
  if ((a.mlm || a.nsp) && a.shards.empty()) throw UserError("--mlm-accuracy / --nsp-accuracy need --shards");
  if ((a.compare || a.sensitivity) && a.shards.empty()) throw UserError("--compare / --sensitivity need --shards");
  if (a.int8 && (a.compare || a.sensitivity))
    throw UserError("--int8 runs the checkpoint's own quantization: not with --compare / --sensitivity");
  if (a.int8_decoder && !a.int8) throw UserError("--int8-decoder goes with --int8");
  if (!a.weights.empty() && !a.compare && !a.sensitivity && a.save_calibrated.empty())
    throw UserError("--weights " + a.weights +
                    " chooses the weight scales of post-training quantization: give it with --compare, --sensitivity "
                    "or --save-calibrated");
  if (!a.save_calibrated.empty() && a.shards.empty())
    throw UserError(
        "--save-calibrated needs --shards (evaluated after calibrating; calibration reads --calib-shards if given)");
}

int run(Args& a) {
  if (a.threads > 0) omp_set_num_threads(a.threads);
  const store::ModelSource source = store::find_model(a.checkpoint);
  a.checkpoint = source.path;
  if (a.tokenizer_path.empty()) a.tokenizer_path = source.tokenizer;
  check_requests(a);
  // The device first: the model's device memory must be freed before the device goes.
  const std::unique_ptr<Device> device = Device::open(a.device_spec, a.precision);
  model::BertConfig config = store::read_model_config(source);
  if (!a.weights.empty()) config.weight_scales = model::parse_weight_scales(a.weights);
  const bool task_model = config.head != model::Head::kPretraining;
  if (!a.task.empty() && model::parse_task(a.task) != config.task())
    throw UserError("--task " + a.task + ": '" + a.checkpoint + "' is a " + model::head_architecture(config.head) +
                    (config.regression() ? " regression (seq-reg)" : " (" + config.task() + ")"));
  if (task_model && (a.mlm || a.nsp || !a.fill_text.empty()))
    throw UserError("'" + a.checkpoint + "' is a " + model::head_architecture(config.head) +
                    ": it has no MLM/NSP head (--mlm-accuracy, --nsp-accuracy, --fill-mask); evaluate it on task "
                    "shards (--shards) for its task metrics");
  if (!a.shards.empty() && !a.mlm && !a.nsp && !task_model) a.mlm = a.nsp = true;
  if (!a.qa_data.empty() && config.head != model::Head::kQuestionAnswering)
    throw UserError("--qa-data: '" + a.checkpoint + "' is a " + model::head_architecture(config.head) +
                    ", not a question-answering model");
  if (!a.qa_data.empty() && a.shards.empty()) throw UserError("--qa-data needs --shards: the shard made from it");
  if (a.rank_by_option->count() && !a.compare && !a.sensitivity)
    throw UserError("--rank-by " + eval::kTaskScoreNames.name(a.rank_by) + " goes with --sensitivity or --compare");
  if (!a.rank_by_option->count()) a.rank_by = eval::default_task_score(config);
  eval::check_ranking(config, a.rank_by, !a.qa_data.empty());
  if (!a.predictions_out.empty() && !task_model)
    throw UserError("--predictions: '" + a.checkpoint +
                    "' is a pretraining model; a task model's predictions are "
                    "written (fill-mask: --fill-mask)");
  if (!a.predictions_out.empty() && (a.compare || a.sensitivity || a.int8))
    throw UserError(
        "--predictions writes the evaluation of the model as it is: leave out --compare, --sensitivity "
        "and --int8");
  if (!a.predictions_out.empty() && a.shards.empty()) throw UserError("--predictions needs --shards");
  model::Bert model(config);
  const store::TrainingState state = store::load_model(source, model);
  if (a.int8 && a.save_calibrated.empty() && model.enabled_quantizers().empty())
    throw UserError("--int8: '" + a.checkpoint +
                    "' has no enabled quantizers (an FP32 model): give a QAT checkpoint or one saved with "
                    "--save-calibrated");
  model.place_on(*device);
  model.round_weights_for_inference();
  // Self-attention fused where that is the faster (BF16 and TF32 on a GPU, with the probabilities' quantizer
  // in BF16; a float model's, not the integer engine's).
  model.set_fused_attention(device->is_cuda() && model::Bert::fused_attention_is_faster(a.precision),
                            model::Bert::fused_quantized_attention_is_faster(a.precision));
  Graph<float> g(*device);
  Evaluation e{a, model, state, g, task_model, Json{}};
  e.report["checkpoint"] = a.checkpoint;
  e.report["step"] = state.step;
  e.report["quantizers_enabled"] = static_cast<int64_t>(model.enabled_quantizers().size());
  e.report["model"] = eval::model_size(model).to_json();
  if (!a.shards.empty()) evaluate_shards(e);
  if (!a.fill_text.empty()) fill_mask(e);
  if (a.json) std::printf("%s\n", e.report.dump(2).c_str());
  if (!a.json_out.empty()) write_text_file(a.json_out, e.report.dump(2) + "\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bert::wait_passively_unless_chosen(argv);  // first: it may re-execute the program
  Args args;
  CLI::App app;
  add_options(app, args);
  bert::tools::add_list_devices_flag(app);
  CLI11_PARSE(app, argc, argv);
  // With --json, stdout carries the JSON alone (for `| jq`): progress and errors go to stderr.
  if (args.json) spdlog::set_default_logger(spdlog::stderr_color_st("bert-eval"));
  return bert::tools::run_tool([&] { return run(args); });
}
