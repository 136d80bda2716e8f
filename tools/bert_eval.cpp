// bert-eval: masked-LM and NSP accuracy (with baselines) of a checkpoint on shards, or the task metrics
// of a fine-tuned one; FP32 vs INT8 comparisons and sensitivity; fill-mask.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/atomic_file.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/process.h"
#include "core/text_file.h"
#include "data/loader.h"
#include "data/sha256.h"
#include "data/tokenizer.h"
#include "data/wordpiece_tokenizer.h"
#include "eval/fill_mask.h"
#include "eval/metrics.h"
#include "eval/onnx_runtime.h"
#include "eval/quantized.h"
#include "quant/quantize.h"
#include "tools/tool_main.h"
#include "train/checkpoint.h"
#include "train/model_source.h"

int main(int argc, char** argv) {
  using namespace bert;
  std::string checkpoint, tokenizer_path, fill_text;
  std::vector<std::string> shards;
  bool mlm = false, nsp = false, json = false;
  int64_t batch_size = 64, max_batches = 0;
  int top_k = 5, threads = 0;
  bool compare = false, sensitivity = false;
  std::string calibrators = "max,percentile,entropy,mse", plan_path, plan_out;
  std::vector<std::string> calib_shards;
  quant::CalibrationOptions calibration;
  double max_drop = 0.005;
  std::string save_calibrated, onnx_model, ort_script = eval::default_ort_script();
  CLI::App app{
      "bert-eval: evaluate a checkpoint. --mlm-accuracy / --nsp-accuracy on shards (with the "
      "most-frequent-token and majority-class baselines), or --fill-mask \"text with [MASK]\". A fine-tuned "
      "model (sequence or token classification) on task shards reports accuracy, macro-F1 and per-label F1."};
  app.footer(
      "Examples:\n"
      "  bert-eval --checkpoint runs/mini --shards heldout/ --mlm-accuracy --nsp-accuracy\n"
      "  bert-eval --checkpoint runs/mini --shards heldout/ --compare        # FP32 vs INT8 (each calibrator)\n"
      "  bert-eval --checkpoint runs/mini --shards heldout/ --sensitivity --plan-out plan.json\n"
      "  bert-eval --checkpoint runs/qat --shards heldout/ --onnx int8.onnx  # an export in ONNX Runtime\n"
      "  bert-eval --checkpoint runs/mini --fill-mask \"the kernel is written in [MASK].\"\n"
      "  bert-eval --checkpoint runs/pos --shards pos/test.hdf5 --compare   # a fine-tuned tagger, FP32 vs INT8\n"
      "Guides: docs/training.md, docs/quantization.md");
  app.add_option("--checkpoint", checkpoint,
                 "checkpoint .h5 (from bert-train), its output folder, or a Hugging Face "
                 "model directory (config.json + model.safetensors)")
      ->required();
  app.add_option("--shards", shards, "evaluation shards (files or folders)")->expected(1, -1);
  app.add_flag("--mlm-accuracy", mlm, "masked-LM accuracy and loss");
  app.add_flag("--nsp-accuracy", nsp, "next-sentence-prediction accuracy and loss");
  app.add_option("--fill-mask", fill_text, "text with [MASK] tokens to fill");
  std::string task;
  app.add_option("--task", task,
                 "seq-cls | token-cls: the task the model and shards must be (default: the model's head decides)");
  app.add_option("--top-k", top_k, "candidates per mask")->check(CLI::Range(1, 100))->capture_default_str();
  app.add_option("--tokenizer", tokenizer_path,
                 "tokenizer: SentencePiece .model or WordPiece vocab.txt (default: the one "
                 "beside the checkpoint)");
  app.add_option("--batch-size", batch_size, "sequences per batch")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--max-batches", max_batches, "stop after this many batches (0: all)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_flag("--compare", compare, "FP32 vs PTQ (each of --calibrators) vs the checkpoint's QAT state, side by side");
  app.add_flag("--sensitivity", sensitivity,
               "per-quantizer sensitivity (MLM accuracy with only it / all but it quantized)");
  app.add_option("--calibrators", calibrators, "PTQ methods for --compare")->capture_default_str();
  app.add_option("--calibrator", calibration.method, "method for --sensitivity")->capture_default_str();
  app.add_option("--percentile", calibration.percentile, "percentile for the percentile calibrator")
      ->capture_default_str();
  app.add_option("--calib-shards", calib_shards,
                 "calibration shards (default: the first --calib-batches batches of --shards, which --compare and "
                 "--sensitivity then leave out of the evaluation)")
      ->expected(1, -1);
  app.add_option("--calib-batches", calibration.batches, "calibration batches")->capture_default_str();
  app.add_flag("--quantize-residuals", calibration.residuals, "also quantize both inputs of each residual add");
  app.add_option("--quantize", calibration.include,
                 "comma-separated globs of the quantizers to enable (default set otherwise)");
  app.add_option("--keep-float", calibration.keep_float_globs, "comma-separated globs of quantizers kept in float");
  app.add_option("--plan", plan_path, "plan file: quantizers kept in float for PTQ");
  app.add_option("--max-drop", max_drop, "--sensitivity: largest MLM accuracy drop the plan may leave (absolute)")
      ->capture_default_str();
  app.add_option("--plan-out", plan_out, "--sensitivity: write the plan here");
  app.add_option("--onnx", onnx_model,
                 "also evaluate this ONNX export in ONNX Runtime on --shards (a pretraining model's export made with "
                 "--masked-positions; a task model's export as it is)");
  app.add_option("--ort-script", ort_script,
                 "the ONNX Runtime runner: scripts/ort_run.js (Node, npm onnxruntime-node) or scripts/ort_run.py "
                 "(Python, the onnxruntime package)")
      ->capture_default_str();
  app.add_option("--save-calibrated", save_calibrated,
                 "post-training quantization: calibrate with --calibrator on --calib-shards (or --shards) and save "
                 "the model with its scales and quantizers enabled as a checkpoint (then evaluate or export it)");
  app.add_flag("--json", json, "print JSON instead of a table");
  std::string json_out;
  app.add_option("--json-out", json_out, "also write the JSON report to this file");
  app.add_option("--threads", threads, "threads (0: all cores)")->check(CLI::Range(0, 1024));
  std::string device_spec = "auto", precision = "fp32";
  app.add_option("--device", device_spec, "where to evaluate: auto (a GPU when one is present), cpu, cuda, cuda:N")
      ->capture_default_str();
  app.add_option("--precision", precision,
                 "precision on a GPU: fp32, tf32 (TF32 GEMMs) or bf16 (BF16 activations and GEMMs)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  // With --json, stdout carries the JSON alone (for `| jq`): progress and errors go to stderr.
  if (json) spdlog::set_default_logger(spdlog::stderr_color_st("bert-eval"));

  return tools::run_tool([&] {
    if (threads > 0) omp_set_num_threads(threads);
    namespace fs = std::filesystem;
    const train::ModelSource source = train::find_model(checkpoint);
    checkpoint = source.path;
    if (tokenizer_path.empty()) tokenizer_path = source.tokenizer;
    if (fill_text.empty() && shards.empty())
      throw UserError("nothing to do: give --shards (with --mlm-accuracy/--nsp-accuracy) or --fill-mask");
    if ((mlm || nsp) && shards.empty()) throw UserError("--mlm-accuracy / --nsp-accuracy need --shards");
    if ((compare || sensitivity) && shards.empty()) throw UserError("--compare / --sensitivity need --shards");
    if (!save_calibrated.empty() && shards.empty())
      throw UserError(
          "--save-calibrated needs --shards (evaluated after calibrating; calibration reads --calib-shards if given)");
    // The device first: the model's device memory must be freed before the device goes.
    const std::unique_ptr<Device> device = Device::open(device_spec, parse_precision(precision));
    const model::BertConfig config = train::read_model_config(source);
    const bool task_model = config.head != model::Head::kPretraining;
    if (!task.empty() && model::parse_task(task) != config.head)
      throw UserError("--task " + task + ": '" + checkpoint + "' is a " + model::head_architecture(config.head));
    if (task_model && (mlm || nsp || !fill_text.empty()))
      throw UserError("'" + checkpoint + "' is a " + model::head_architecture(config.head) +
                      ": it has no MLM/NSP head (--mlm-accuracy, --nsp-accuracy, --fill-mask); evaluate it on task "
                      "shards (--shards) for its task metrics");
    if (!shards.empty() && !mlm && !nsp && !task_model) mlm = nsp = true;
    model::Bert model(config);
    const train::TrainingState state = train::load_model(source, model);
    model.place_on(*device);
    Graph<float> g(*device);
    Json report;
    report["checkpoint"] = checkpoint;
    report["step"] = state.step;
    { report["quantizers_enabled"] = static_cast<int64_t>(model.enabled_quantizers().size()); }
    {  // Sizes: all parameters in FP32, and with the enabled weight quantizers' weights stored as INT8.
      int64_t parameters = 0, int8_weights = 0;
      ParameterArena<float>& arena = model.parameters();
      for (ParamId id = 0; id < arena.size(); ++id)
        if (!model::is_quantizer_scale(arena.name(id))) parameters += arena.shape(id).numel();
      for (model::Quantizer* q : model.enabled_quantizers())
        if (q->is_weight) int8_weights += arena.shape(model.quantized_weight(*q)).numel();
      Json size;
      size["parameters"] = parameters;
      size["int8_weight_parameters"] = int8_weights;
      size["fp32_megabytes"] = parameters * 4 / 1e6;
      size["deployed_megabytes"] = ((parameters - int8_weights) * 4 + int8_weights) / 1e6;
      report["model"] = size;
    }

    if (!shards.empty()) {
      data::LoaderOptions lo;
      lo.shards = data::expand_shard_paths(shards);
      lo.batch_size = batch_size;
      lo.shuffle = false;
      lo.repeat = false;
      data::ShardLoader loader(lo);
      data::check_loader_compatible(loader, lo.shards.front(), model.config().vocab_size,
                                    model.config().max_position_embeddings, state.tokenizer_sha256);
      if (task_model != (loader.kind() != data::ShardKind::kPretraining) ||
          (task_model && loader.label_names() != config.labels))
        throw UserError("--shards: '" + lo.shards.front() + "' holds " + data::shard_kind_name(loader.kind()) +
                        " examples" +
                        (task_model ? " with " + std::to_string(loader.label_names().size()) + " labels" : "") +
                        "; the model is a " + model::head_architecture(config.head) +
                        (task_model ? " with " + std::to_string(config.num_labels()) + " labels" : "") +
                        " (make the shards with the model's labels: bert-data task --labels <its training shard>)");
      // Without --calib-shards, calibration reads the first --calib-batches batches of --shards, and the
      // comparisons score only the batches after them: a calibrator never sees the data it is scored on.
      const int64_t held_for_calibration = calib_shards.empty() && (compare || sensitivity) ? calibration.batches : 0;
      if (held_for_calibration > 0)
        spdlog::info(
            "calibrating on the first {} batches of --shards and scoring the rest (--calib-shards to "
            "calibrate on other data)",
            held_for_calibration);
      auto make_loader = [lo, held_for_calibration] {
        data::ShardLoader l(lo);
        data::Batch skipped;
        for (int64_t i = 0; i < held_for_calibration; ++i)
          if (!l.next(skipped))
            throw UserError("--shards: only " + std::to_string(i) +
                            " batches, all needed for calibration "
                            "(--calib-batches " +
                            std::to_string(held_for_calibration) +
                            "); give --calib-shards, or "
                            "fewer --calib-batches");
        return l;
      };
      auto calibration_statistics = [&] {
        data::LoaderOptions co = lo;
        co.shards = calib_shards.empty() ? lo.shards : data::expand_shard_paths(calib_shards);
        data::ShardLoader calibration_loader(co);
        if (!plan_path.empty()) calibration.keep_float = quant::read_plan(plan_path, model);
        return quant::collect_statistics(model, calibration_loader, calibration, g);
      };
      if (!save_calibrated.empty()) {
        const quant::CalibrationStatistics stats = calibration_statistics();
        const auto amax =
            quant::apply_calibration(model, stats, quant::parse_method(calibration.method), calibration.percentile);
        train::TrainingState ptq = state;
        Json recipe = quant::describe_calibration(calibration, stats.batches);
        recipe["qat"] = false;
        recipe["source_checkpoint"] = checkpoint;
        ptq.quantization = recipe;
        // The tokenizer travels with the checkpoint (as bert-train's runs carry theirs), so bert-export
        // and bert-eval find it beside the file without --tokenizer.
        if (!tokenizer_path.empty()) {
          data::copy_tokenizer(tokenizer_path, std::filesystem::absolute(save_calibrated).parent_path().string());
          if (ptq.tokenizer_sha256.empty()) ptq.tokenizer_sha256 = data::sha256_file(tokenizer_path);
        }
        train::save_checkpoint(save_calibrated, model, nullptr, ptq);
        spdlog::info("calibrated {} quantizers ({}, {} batches) -> {}", amax.size(), calibration.method, stats.batches,
                     save_calibrated);
      }
      if (compare || sensitivity) {
        // Calibrating changes quantizer modes; remember the checkpoint's (QAT) state to compare with it.
        std::vector<std::pair<model::Quantizer*, model::QuantMode>> modes;
        for (model::Quantizer* q : model.quantizers()) modes.emplace_back(q, q->mode);
        const quant::CalibrationStatistics stats = calibration_statistics();
        for (auto [q, mode] : modes) q->mode = mode;
        if (compare) {
          std::vector<quant::Method> methods;
          std::stringstream list(calibrators);
          for (std::string m; std::getline(list, m, ',');) methods.push_back(quant::parse_method(m));
          const auto results =
              eval::compare_modes(model, stats, methods, calibration.percentile, make_loader, max_batches, g);
          Json::Array rows;
          if (!json && task_model)
            std::printf("%-16s %10s %10s %10s\n", "mode", "accuracy", "macro-F1", "loss");
          else if (!json)
            std::printf("%-16s %10s %10s %10s %10s\n", "mode", "MLM acc", "MLM loss", "NSP acc", "NSP loss");
          for (const auto& r : results) {
            if (!json && task_model)
              std::printf("%-16s %10.4f %10.4f %10.4f\n", r.mode.c_str(), r.task.accuracy(), r.task.macro_f1(),
                          r.task.loss());
            else if (!json)
              std::printf("%-16s %10.4f %10.4f %10.4f %10.4f\n", r.mode.c_str(), r.metrics.mlm_accuracy(),
                          r.metrics.mlm_loss(), r.metrics.nsp_accuracy(), r.metrics.nsp_loss());
            Json row = task_model ? r.task.to_json(config.labels) : r.metrics.to_json();
            row["mode"] = r.mode;
            rows.push_back(row);
          }
          if (!json && task_model && !results.empty())
            std::printf("(%lld %s; baseline: majority label %.4f; calibration: %lld batches)\n",
                        (long long)results[0].task.examples,
                        config.head == model::Head::kTokenClassification ? "tokens" : "sequences",
                        results[0].task.majority_accuracy(), (long long)stats.batches);
          else if (!json && !results.empty())
            std::printf(
                "(%lld predictions; baselines: most-frequent-token %.4f, NSP majority %.4f; calibration: %lld "
                "batches)\n",
                (long long)results[0].metrics.predictions, results[0].metrics.most_frequent_token_accuracy(),
                results[0].metrics.nsp_majority_accuracy(), (long long)stats.batches);
          report["compare"] = rows;
        }
        if (sensitivity) {
          const auto r = eval::sensitivity(model, stats, quant::parse_method(calibration.method),
                                           calibration.percentile, make_loader, max_batches, max_drop, g,
                                           [](const std::string& name) { spdlog::info("sensitivity: {}", name); });
          Json::Array rows;
          if (!json) {
            std::printf("FP32 %s accuracy %.4f; all %zu quantizers (%s) %.4f\n", task_model ? "task" : "MLM", r.fp32,
                        r.rows.size(), calibration.method.c_str(), r.all_quantized);
            std::printf("%-64s %10s %12s\n", "quantizer (most sensitive first)", "only this", "all but this");
          }
          for (const auto& row : r.rows) {
            if (!json) std::printf("%-64s %10.4f %12.4f\n", row.name.c_str(), row.only_this, row.all_but_this);
            Json j;
            j["name"] = row.name;
            j["only_this"] = row.only_this;
            j["all_but_this"] = row.all_but_this;
            rows.push_back(j);
          }
          Json::Array kept;
          for (const auto& n : r.keep_float) kept.emplace_back(n);
          if (!json)
            std::printf("plan: keep %zu in float -> accuracy %.4f (FP32 %.4f, allowed drop %.4f)\n",
                        r.keep_float.size(), r.planned, r.fp32, max_drop);
          Json s;
          s["fp32"] = r.fp32;
          s["all_quantized"] = r.all_quantized;
          s["rows"] = rows;
          s["keep_float"] = kept;
          s["planned"] = r.planned;
          report["sensitivity"] = s;
          if (!plan_out.empty()) {
            Json details;
            details["calibrator"] = calibration.method;
            details["max_mlm_accuracy_drop"] = max_drop;
            details["fp32_mlm_accuracy"] = r.fp32;
            details["planned_mlm_accuracy"] = r.planned;
            quant::write_plan(plan_out, r.keep_float, details);
            if (!json) std::printf("plan written to %s\n", plan_out.c_str());
          }
        }
      }
      if (task_model && !compare && !sensitivity) {
        const eval::TaskMetrics t = eval::evaluate_task(model, loader, max_batches, g);
        report["task"] = model::head_task_name(config.head);
        report["metrics"] = t.to_json(config.labels);
        if (!json) {
          const int quantized = static_cast<int>(model.enabled_quantizers().size());
          const bool tokens = config.head == model::Head::kTokenClassification;
          std::printf(
              "%s %s (step %lld) on %zu shard(s), %s\n", model::head_architecture(config.head).c_str(),
              checkpoint.c_str(), (long long)state.step, lo.shards.size(),
              quantized ? ("fake-quantized INT8 (" + std::to_string(quantized) + " quantizers)").c_str() : "FP32");
          std::printf("%-22s %10.4f   (baseline: majority label %.4f) over %lld %s\n", "accuracy", t.accuracy(),
                      t.majority_accuracy(), (long long)t.examples, tokens ? "labeled tokens" : "sequences");
          std::printf("%-22s %10.4f\n%-22s %10.4f\n", "macro-F1", t.macro_f1(), "loss", t.loss());
          std::printf("%-22s %10s %10s\n", "label", "F1", "support");
          for (int64_t l = 0; l < config.num_labels(); ++l) {
            int64_t support = 0;
            for (int64_t o = 0; o < config.num_labels(); ++o) support += t.confusion[l * config.num_labels() + o];
            std::printf("%-22s %10.4f %10lld\n", config.labels[l].c_str(), t.f1(l), (long long)support);
          }
        }
      }
      const eval::PretrainingMetrics m = compare || sensitivity || task_model
                                             ? eval::PretrainingMetrics{}
                                             : eval::evaluate(model, loader, max_batches, g);
      if (!onnx_model.empty() && task_model) {
        data::ShardLoader onnx_loader(lo);
        const PrivateTempDir work("bert-eval");
        const eval::TaskMetrics o = eval::evaluate_onnx_task(onnx_model, onnx_loader, config.num_labels(), max_batches,
                                                             ort_script, work.path().string());
        report["onnx"] = o.to_json(config.labels);
        if (!json)
          std::printf("ONNX Runtime (%s): accuracy %.4f, macro-F1 %.4f over %lld %s\n", onnx_model.c_str(),
                      o.accuracy(), o.macro_f1(), (long long)o.examples,
                      config.head == model::Head::kTokenClassification ? "labeled tokens" : "sequences");
      } else if (!onnx_model.empty()) {
        data::ShardLoader onnx_loader(lo);
        const PrivateTempDir work("bert-eval");  // this run's own exchange files
        const eval::PretrainingMetrics o =
            eval::evaluate_onnx(onnx_model, onnx_loader, max_batches, ort_script, work.path().string());
        report["onnx"] = o.to_json();
        if (!json)
          std::printf("ONNX Runtime (%s): MLM accuracy %.4f over %lld predictions, NSP accuracy %.4f\n",
                      onnx_model.c_str(), o.mlm_accuracy(), (long long)o.predictions, o.nsp_accuracy());
      }
      report["shards"] = static_cast<int64_t>(lo.shards.size());
      if (!compare && !sensitivity && !task_model) report["metrics"] = m.to_json();
      if (!json && !compare && !sensitivity && !task_model) {
        const int quantized = static_cast<int>(model.enabled_quantizers().size());
        std::printf(
            "checkpoint %s (step %lld) on %zu shard(s), %s\n", checkpoint.c_str(), (long long)state.step,
            lo.shards.size(),
            quantized ? ("fake-quantized INT8 (" + std::to_string(quantized) + " quantizers)").c_str() : "FP32");
        std::printf("%-22s %10s %12s %12s\n", "metric", "value", "baseline", "count");
        if (mlm) {
          std::printf("%-22s %10.4f %12.4f %12lld   (baseline: most frequent token)\n", "MLM accuracy",
                      m.mlm_accuracy(), m.most_frequent_token_accuracy(), (long long)m.predictions);
          std::printf("%-22s %10.4f %12s %12lld\n", "MLM loss", m.mlm_loss(), "", (long long)m.predictions);
        }
        if (nsp) {
          std::printf("%-22s %10.4f %12.4f %12lld   (baseline: majority class)\n", "NSP accuracy", m.nsp_accuracy(),
                      m.nsp_majority_accuracy(), (long long)m.sequences);
          std::printf("%-22s %10.4f %12s %12lld\n", "NSP loss", m.nsp_loss(), "", (long long)m.sequences);
        }
      }
    }
    if (!fill_text.empty()) {
      std::unique_ptr<data::Tokenizer> tokenizer = data::load_tokenizer(tokenizer_path);
      if (!state.tokenizer_sha256.empty() && tokenizer->file_sha256() != state.tokenizer_sha256)
        throw UserError("tokenizer '" + tokenizer_path + "' is not the one the checkpoint was trained with");
      Json::Array masks;
      for (const eval::MaskPrediction& p : eval::fill_mask(model, *tokenizer, fill_text, top_k, g)) {
        Json::Array candidates;
        if (!json) std::printf("[MASK] at position %d:\n", p.position);
        for (const auto& [piece, prob] : p.candidates) {
          if (!json) std::printf("  %-20s %.4f\n", piece.c_str(), prob);
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
      report["fill_mask"] = masks;
    }
    if (json) std::printf("%s\n", report.dump(2).c_str());
    if (!json_out.empty()) {
      write_text_file(json_out, report.dump(2) + "\n");
    }
    return 0;
  });
}
