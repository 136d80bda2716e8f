// bert-train: pretrain BERT (MLM + NSP) or fine-tune it for a task, on HDF5 shards; FP32 or QAT.
#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>

#include <csignal>
#include <filesystem>
#include <memory>
#include <optional>

#include "eval/squad.h"
#include "store/checkpoint.h"
#include "store/model_source.h"
#include "sys/error.h"
#include "sys/openmp_wait.h"
#include "sys/parallel.h"
#include "tokenizer/load.h"
#include "tokenizer/tokenizer.h"
#include "tools/enum_option.h"
#include "tools/tool_main.h"
#include "train/trainer.h"

namespace {

std::atomic<bool> g_stop{false};
std::atomic<int> g_signal{0};

void on_signal(int signal) {
  if (g_stop.exchange(true)) std::_Exit(128 + signal);  // a second Ctrl-C: leave at once
  g_signal = signal;
}

// bert-train --nproc N: this program again, once per GPU, without --nproc; see train/process_group.h.
int launch_ranks(int argc, char** argv, int nproc, const std::string& output_dir) {
  std::vector<std::string> args = {std::filesystem::read_symlink("/proc/self/exe").string()};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--nproc") {
      ++i;
      continue;
    }
    if (a.rfind("--nproc=", 0) != 0) args.push_back(a);
  }
  spdlog::info("starting {} ranks (one process per GPU)", nproc);
  std::string failure;
  const int status = bert::train::launch_local_ranks(args, nproc, &failure);
  if (!failure.empty())
    throw bert::UserError(failure + "; the other ranks were stopped. The last checkpoint in '" + output_dir +
                          "' (if any) is intact: fix the cause and continue with --resume");
  return status;
}

struct Args {
  bert::train::TrainOptions o;
  std::string preset = "tiny", config_path, task, schedule = "linear", optimizer = "adamw", on_nonfinite = "stop",
              scales = "learned", weights = "per-channel", attention = "auto", qat_products = "auto";
  int threads = 0, nproc = 1;
  double dropout = -1;
  std::string eval_qa_data;
  // Loaded by resolve(): the tokenizer, and with --eval-qa-data the held-out questions o.eval_questions names.
  std::unique_ptr<bert::tokenizer::Tokenizer> tokenizer;
  std::optional<bert::data::QuestionWindows> eval_windows;
  std::optional<bert::eval::QuestionScoring> eval_questions;
  Args() { o.device = "auto"; }
};

// The run's data, model and optimization.
void add_training_options(CLI::App& app, Args& a) {
  app.description(
      "bert-train: pretrain BERT with masked-LM and next-sentence prediction on HDF5 shards "
      "(NVIDIA's layout, e.g. from `bert-data shards`), or fine-tune it for sequence or token classification or "
      "extractive question answering on "
      "task shards (`bert-data task`), in FP32 or with quantization-aware training. Writes OUT/config.json, the "
      "tokenizer (OUT/tokenizer.model or "
      "OUT/vocab.txt), "
      "OUT/checkpoint.h5 and OUT/metrics.jsonl. Ctrl-C writes a checkpoint; --resume continues.");
  app.footer(
      "Examples:\n"
      "  bert-train --train shards/ --eval heldout/ --tokenizer spm.model --preset mini --out runs/mini \\\n"
      "             --steps 10000 --batch-size 128 --lr 1e-3 --warmup 0.1\n"
      "  bert-train --init-from runs/mini/checkpoint.h5 --qat --train shards/ --out runs/mini-qat --steps 1000 --lr "
      "1e-4\n"
      "  bert-train --init-from runs/mini --train genre/train.hdf5 --eval genre/dev.hdf5 --out runs/genre \\\n"
      "             --steps 600 --batch-size 32 --lr 5e-5      # fine-tune: the head comes from the task shards\n"
      "The same command with --resume continues an interrupted run exactly.\n"
      "Guide: docs/training.md (GPUs: --device cuda --precision bf16; CPUs with AMX or AVX512_BF16: "
      "--precision bf16)");
  app.add_option("--train", a.o.train_shards, "training shards (files or folders)")->required()->expected(1, -1);
  app.add_option("--eval", a.o.eval_shards,
                 "held-out shards for periodic evaluation (opened and checked before the first step, kept in memory)")
      ->expected(1, -1);
  app.add_option("--eval-qa-data", a.eval_qa_data,
                 "question answering: the JSON-lines file the one --eval shard was made from; each held-out "
                 "evaluation then also scores every question's answer as SQuAD does (exact match, F1)");
  app.add_option("--tokenizer", a.o.tokenizer_path,
                 "tokenizer the shards were made with: SentencePiece .model or WordPiece vocab.txt "
                 "(default: OUT's copy on --resume, else the one beside --init-from)");
  app.add_option("--out", a.o.output_dir, "output folder")->required();
  app.add_option("--preset", a.preset,
                 "model size: tiny (L2/H128), mini (L4/H256), small (L4/H512), medium (L8/H512), base (L12/H768), "
                 "large (L24/H1024)")
      ->capture_default_str();
  app.add_option("--config", a.config_path, "model config.json (Hugging Face BertConfig fields), instead of --preset");
  app.add_option("--dropout", a.dropout, "hidden and attention dropout (default: the config's, 0.1)")
      ->check(CLI::Range(0.0, 0.99));
  app.add_option(
      "--task", a.task,
      "seq-cls | token-cls | qa | seq-reg: what the run fine-tunes (default: whatever the training shards hold; "
      "given, it must agree with them)");
  app.add_option("--steps", a.o.steps, "optimizer steps")->capture_default_str();
  app.add_option("--batch-size", a.o.batch_size, "sequences per micro-batch")->capture_default_str();
  app.add_option("--accumulate", a.o.accumulation, "micro-batches per optimizer step")->capture_default_str();
  app.add_option("--lr", a.o.learning_rate, "peak learning rate")->capture_default_str();
  app.add_option("--warmup", a.o.warmup_fraction, "fraction of steps for linear warmup")->capture_default_str();
  app.add_option("--schedule", a.schedule, "decay after warmup: linear | poly")->capture_default_str();
  app.add_option("--optimizer", a.optimizer, "adamw | lamb")->capture_default_str();
  app.add_option("--weight-decay", a.o.optimizer.weight_decay, "decoupled weight decay (not on biases and LayerNorm)")
      ->capture_default_str();
  app.add_option("--clip", a.o.clip_norm, "global gradient-norm clipping (0: off)")->capture_default_str();
  app.add_option("--seed", a.o.seed, "seed for initialisation, data order and dropout")->capture_default_str();
  app.add_option("--log-every", a.o.log_every, "steps between progress lines")->capture_default_str();
  app.add_option("--eval-every", a.o.eval_every, "steps between evaluations (0: only at the end)")
      ->capture_default_str();
  app.add_option("--eval-batches", a.o.eval_batches, "batches per evaluation (0: all)")->capture_default_str();
  app.add_option("--save-every", a.o.save_every,
                 "steps between checkpoints (0: only at the end); each is written on a thread of its own while "
                 "training goes on")
      ->capture_default_str();
}

// Where training starts from, and quantization-aware training.
void add_quantization_options(CLI::App& app, Args& a) {
  app.add_option("--init-from", a.o.init_from,
                 "start from these weights (fine-tuning, QAT): a checkpoint, a run folder, or a "
                 "Hugging Face model directory (config.json + model.safetensors, sharded or not)");
  app.add_flag("--qat", a.o.qat,
               "quantization-aware training: calibrate the quantizers, then train weights and LSQ scales");
  bert::tools::add_enum_option(app, "--calibrator", a.o.calibration.method, bert::quant::kMethodNames,
                               "QAT scale initialisation: max | percentile | entropy | mse");
  app.add_option("--percentile", a.o.calibration.percentile, "percentile for --calibrator percentile")
      ->capture_default_str();
  app.add_option("--calib-batches", a.o.calibration.batches, "calibration batches")->capture_default_str();
  app.add_flag("--quantize-residuals,!--no-quantize-residuals", a.o.calibration.residuals,
               "quantize both inputs of each residual add (the default: NVIDIA's TensorRT recipe, where the add "
               "fuses with its LayerNorm and the tensor between layers stays INT8); --no-quantize-residuals "
               "leaves them in float");
  app.add_option("--plan", a.o.plan_path, "sensitivity plan (from bert-eval --sensitivity): quantizers kept in float");
  app.add_option("--quantize", a.o.calibration.include,
                 "comma-separated globs of the quantizers to enable (default: every Linear's input and weight, the "
                 "attention matmul inputs and both inputs of each residual add), e.g. '*.weight_quantizer,*matmul_*'");
  app.add_option("--keep-float", a.o.calibration.keep_float_globs, "comma-separated globs of quantizers kept in float");
  app.add_option("--weights", a.weights,
                 "QAT weight scales: per-channel (one per output channel) or per-tensor (one per weight; TensorRT "
                 "runs both in INT8)")
      ->check(CLI::IsMember(bert::model::kWeightScalesNames.names()))
      ->capture_default_str();
  app.add_option("--scale-lr-mult", a.o.scale_lr_multiplier, "learning-rate multiplier for quantizer scales")
      ->capture_default_str();
  app.add_option("--scales", a.scales,
                 "how QAT trains the quantizer scales: learned (their logarithm, so each step moves a scale by a "
                 "fraction of itself), lsq (LSQ's update on the scale itself; small weight scales can collapse "
                 "under Adam) or fixed (the calibrated scales stay; only the weights train)")
      ->capture_default_str();
  app.add_option(
         "--distill", a.o.distill_weight,
         "knowledge distillation from the teacher (--teacher, else the --init-from model): the weight w in "
         "[0, 1] of the KL to its outputs (MLM and NSP, or the task's logits; a regression: the squared error to "
         "its scores), the loss being (1 - w) L + w KL (0: off)")
      ->capture_default_str();
  app.add_option("--teacher", a.o.teacher,
                 "the model distilled from (checkpoint, run folder or Hugging Face directory), e.g. a larger model "
                 "fine-tuned on the task; same head, labels and tokenizer as the student (default: --init-from)");
  app.add_option("--distill-temperature", a.o.distill_temperature, "softmax temperature of the distillation KL")
      ->capture_default_str();
}

// Resuming, checkpoints, failures, devices and processes.
void add_run_options(CLI::App& app, Args& a) {
  app.add_flag("--resume", a.o.resume, "continue from OUT/checkpoint.h5 exactly where it stopped");
  app.add_option("--stop-at", a.o.stop_at_step,
                 "stop after this step with a checkpoint (a time-boxed run; --resume continues)");
  app.add_option(
         "--keep-checkpoints", a.o.keep_checkpoints,
         "checkpoints kept: 1 keeps checkpoint.h5 only; K > 1 also keeps checkpoint-<step>.h5 of the last K saves")
      ->capture_default_str();
  app.add_option_function<std::string>(
         "--keep-best",
         [&a](const std::string& metric) {
           a.o.keep_best = bert::train::kBestMetricNames.parse(metric, "--keep-best");
         },
         "keep the model of the best held-out evaluation (--eval) by this metric: accuracy (MLM accuracy, a task's "
         "accuracy, per-window exact match), macro-f1, mcc (Matthews correlation), loss (the lowest), question-f1 "
         "(--eval-qa-data), a regression's pearson or spearman, or with groups its mrr or ndcg (MRR@10, NDCG@10): "
         "OUT/checkpoint-best.h5 and OUT/best.json (metric, "
         "value, step), kept over --resume")
      ->check(CLI::IsMember(bert::train::kBestMetricNames.names()));
  app.add_option("--patience", a.o.patience,
                 "with --keep-best: stop (with a checkpoint) after this many held-out evaluations in a row that do "
                 "not beat the best (0: off)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--on-nonfinite", a.on_nonfinite,
                 "a NaN/Inf loss or gradient: stop (the last checkpoint stays intact) or skip the step's update")
      ->capture_default_str();
  app.add_option("--max-skips", a.o.max_consecutive_skips,
                 "with --on-nonfinite skip: stop after this many skipped steps in a row")
      ->capture_default_str();
  app.add_option("--threads", a.threads, "threads (0: all cores)")->check(CLI::Range(0, 1024));
  app.add_option("--nproc", a.nproc,
                 "GPUs of this machine to train on: one process each, gradients averaged through NCCL, global batch "
                 "N x --batch-size (several machines: start one process per GPU with mpirun or srun instead)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--bucket-mb", a.o.bucket_mb,
                 "several GPUs: gradients are averaged in buckets of this many MiB, each sent while the backward "
                 "pass goes on")
      ->capture_default_str();
  app.add_option("--device", a.o.device, "where to train: auto (a GPU when one is present), cpu, cuda, cuda:N")
      ->capture_default_str();
  bert::tools::add_enum_option(app, "--precision", a.o.precision, bert::kPrecisionNames,
                 "fp32; tf32 (GPU: TF32 tensor cores for the GEMMs, FP32 tensors); or bf16 (GPU: mixed precision, "
                 "BF16 activations and GEMMs; CPU: every product on BF16-rounded operands with FP32 sums, on "
                 "AMX tiles (Intel Xeon 4th gen+) or vdpbf16ps (AVX512_BF16) where the CPU has them, FP32 "
                 "tensors); weights, optimizer, losses and quantizer scales stay FP32");
  app.add_option("--attention", a.attention,
                 "self-attention on a GPU: fused (one kernel each way: the (batch, heads, length, length) scores "
                 "never reach memory; head size 16/32/64/128, length up to 512; QAT's probabilities quantized "
                 "inside the kernels in BF16 and TF32), unfused (separate ops, their scores and probabilities kept "
                 "for the backward), recompute (FP32 and TF32: the separate ops, the backward computing the scores "
                 "and probabilities again instead of keeping them: much less memory than unfused, a few percent "
                 "slower; in BF16 as fused), or auto: fused in BF16 and TF32 (there the faster and smaller; TF32's "
                 "QAT step unfused, there the faster), unfused in FP32 (there the faster)")
      ->check(CLI::IsMember({"auto", "fused", "unfused", "recompute"}))
      ->capture_default_str();
  app.add_option("--qat-products", a.qat_products,
                 "QAT on a GPU: integer (each quantized linear's forward product sums the integers behind its "
                 "fake-quantized input and weight exactly, on the int8 tensor cores of an H100 or H200, as the "
                 "INT8 engine does; the backward as before), float (float GEMMs on the fake-quantized values, "
                 "as on other GPUs and the CPU), or auto: integer in FP32 and TF32, and in BF16 from hidden "
                 "size 768 (BERT-base; there the faster), else float")
      ->check(CLI::IsMember({"auto", "integer", "float"}))
      ->capture_default_str();
  app.add_flag("!--no-cuda-graphs", a.o.cuda_graphs,
               "on one GPU, launch each step's kernels op by op instead of recording the step and launching it "
               "as one CUDA graph (the default once two steps of a shape have run: the GPU then waits less "
               "between kernels)");
}

void add_options(CLI::App& app, Args& a) {
  add_training_options(app, a);
  add_quantization_options(app, a);
  add_run_options(app, a);
}

// The options given as words turned into the trainer's, the model config and the tokenizer: the given
// one, else the copy in the output folder (--resume), else the one shipped with --init-from (a Hugging
// Face directory's vocab.txt).
void resolve(Args& a, const CLI::App& app) {
  using namespace bert;
  train::TrainOptions& o = a.o;
  o.scales = train::parse_scale_training(a.scales);
  o.weights = model::parse_weight_scales(a.weights);
  o.fused_attention = a.attention == "fused" ||
                      (a.attention == "auto" && bert::model::Bert::fused_attention_is_faster(o.precision)) ||
                      (a.attention == "recompute" && o.precision == bert::Precision::kBf16);
  o.fused_quantized_attention =
      a.attention != "auto" || bert::model::Bert::fused_quantized_attention_is_faster(o.precision);
  o.recompute_attention = a.attention == "recompute" && !o.fused_attention;
  if (a.qat_products != "auto") o.integer_qat_products = a.qat_products == "integer";
  o.schedule = train::parse_schedule(a.schedule);
  o.optimizer.kind = train::parse_optimizer(a.optimizer);
  o.on_nonfinite = train::parse_on_nonfinite(a.on_nonfinite);
  // --resume: the run's plan comes from its record; flags given again must agree (or, --steps, extend it).
  const std::string checkpoint = (std::filesystem::path(o.output_dir) / "checkpoint.h5").string();
  if (o.resume && std::filesystem::exists(checkpoint))
    for (const std::string& w : train::resume_plan(o, store::read_checkpoint_run(checkpoint),
                                                   [&](const std::string& flag) { return app.count(flag) > 0; }))
      spdlog::warn("{}", w);
  if (!a.task.empty()) o.task = model::parse_task(a.task);
  o.config = a.config_path.empty() ? model::preset(a.preset) : model::BertConfig::load(a.config_path);
  if (a.dropout >= 0) o.config.hidden_dropout_prob = o.config.attention_probs_dropout_prob = a.dropout;
  namespace fs = std::filesystem;
  for (const char* name : {"vocab.txt", "tokenizer.model"}) {
    const fs::path copy = fs::path(o.output_dir) / name;
    if (o.tokenizer_path.empty() && o.resume && fs::exists(copy)) o.tokenizer_path = copy.string();
  }
  if (o.tokenizer_path.empty() && !o.init_from.empty()) o.tokenizer_path = store::find_model(o.init_from).tokenizer;
  if (o.tokenizer_path.empty())
    throw UserError("--tokenizer: a tokenizer is required (the one the shards were made with)");
  a.tokenizer = tokenizer::load_tokenizer(o.tokenizer_path);
  o.tokenizer_vocab_size = a.tokenizer->vocab_size();
  o.tokenizer_sha256 = a.tokenizer->file_sha256();
  if (!a.eval_qa_data.empty()) {  // the held-out questions, windowed again and checked against the shard
    const std::vector<std::string> eval_paths = data::expand_shard_paths(o.eval_shards);
    if (eval_paths.size() != 1)
      throw UserError("--eval-qa-data: give the one shard made from '" + a.eval_qa_data + "' as --eval (found " +
                      std::to_string(eval_paths.size()) + ")");
    a.eval_windows = eval::windows_of_shard(a.eval_qa_data, eval_paths.front(), *a.tokenizer, "--eval-qa-data");
    a.eval_questions.emplace(eval::QuestionScoring{*a.eval_windows, a.tokenizer.get()});
    o.eval_questions = &*a.eval_questions;
  }
}

int run(Args& a, const CLI::App& app, int argc, char** argv) {
  using namespace bert;
  train::TrainOptions& o = a.o;
  o.process_group = train::process_group_from_environment(o.output_dir);
  if (a.nproc > 1) {
    if (o.process_group.distributed())
      throw UserError("--nproc " + std::to_string(a.nproc) + " in a process that is already one rank of a job (" +
                      o.process_group.launcher + ")");
    if (o.device != "auto" && o.device != "cuda")
      throw UserError("--nproc " + std::to_string(a.nproc) + " with --device " + o.device +
                      ": the ranks train on GPUs, one each (--device cuda; CUDA_VISIBLE_DEVICES chooses the GPUs)");
    return launch_ranks(argc, argv, a.nproc, o.output_dir);
  }
  if (o.process_group.distributed() && o.process_group.rank != 0) {
    // Rank 0 reports progress; the others speak up for warnings and errors only.
    spdlog::set_pattern("[%Y-%m-%d %H:%M:%S.%e] [rank " + std::to_string(o.process_group.rank) + "] [%l] %v");
    spdlog::set_level(spdlog::level::warn);
  }
  if (a.threads > 0) omp_set_num_threads(a.threads);
  resolve(a, app);
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  train::TrainResult r = train::train(o, &g_stop);
  // Stopped by a signal: the shell's 128 + N; a planned stop (--stop-at) is a success.
  if (r.stopped_early && g_signal.load() != 0) return 128 + g_signal.load();
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
  return bert::tools::run_tool([&] { return run(args, app, argc, argv); });
}
