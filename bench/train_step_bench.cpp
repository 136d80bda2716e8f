// train-step-bench: time of one full training step (forward, backward, clipping, AdamW: bert-train's own
// step, train::TrainingStep, with its default options) for FP32 and QAT, and evaluation throughput, for
// BERT presets at sequence length 128 (--seq), with achieved GFLOP/s from an analytic FLOP count and the
// SGEMM ceiling of the machine measured in the same run. Median of timed steps after warm-up (on a GPU, where
// steps run back to back, their mean). Synthetic
// batches with the shard layout (20 masked positions per sequence).
#include <omp.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <set>
#include <sstream>
#include <vector>

#include "core/op_profile.h"
#if BERT_WITH_CUDA
#include "core/cuda/lt_plans.h"
#endif
#include "data/loader.h"
#include "eval/output_reads.h"
#include "eval/quantized.h"
#include "kernels/gemm.h"
#include "model/bert.h"
#include "quant/calibrator.h"
#include "quant/quantize.h"
#include "sys/float_env.h"
#include "sys/openmp_wait.h"
#include "sys/parallel.h"
#include "train/optimizer.h"
#include "train/progress.h"
#include "train/training_step.h"

namespace {

using namespace bert;

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Batch synthetic_batch(int64_t b, int64_t t, int64_t p, int64_t vocab, uint64_t seed) {
  Rng rng(seed);
  Batch batch;
  batch.size = b, batch.seq_len = t, batch.max_predictions = p;
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t j = 0; j < t; ++j) {
      batch.input_ids.push_back(j == 0 ? 2 : static_cast<int32_t>(5 + rng.next_below(vocab - 5)));
      batch.input_mask.push_back(1);
      batch.segment_ids.push_back(j < t / 2 ? 0 : 1);
    }
    for (int64_t k = 0; k < p; ++k) {  // sorted distinct positions in [1, t - 1)
      batch.masked_lm_positions.push_back(static_cast<int32_t>(1 + k * (t - 2) / p));
      batch.masked_lm_ids.push_back(static_cast<int32_t>(5 + rng.next_below(vocab - 5)));
    }
    batch.next_sentence_labels.push_back(static_cast<int8_t>(rng.next_below(2)));
  }
  return batch;
}

// Forward GEMM FLOPs of one sequence (the step costs 3x: forward, and two products per GEMM backward).
double forward_flops(const model::BertConfig& c, double t, double p) {
  const double h = c.hidden_size, i = c.intermediate_size, v = c.vocab_size;
  const double layer = 2 * t * h * h * 4 + 2 * t * h * i * 2 + 2 * t * t * h * 2;
  return c.num_hidden_layers * layer + 2 * p * h * h + 2 * p * h * v + 2 * h * h;
}

// Calibration runs in a graph of its own, freed before the steps (as bert-train's QAT set-up does): the
// steps' GPU memory is then their own, not the calibration forward's (every activation of an unfused
// forward held at once).
void enable_quantization(model::Bert& model, const Batch& batch, const Device& device) {
  Graph<float> g(device);
  quant::CalibrationStatistics stats;
  stats.quantizers = quant::default_quantizers(model, quant::CalibrationOptions().residuals);  // the default set
  for (model::Quantizer* q : stats.quantizers)
    if (!q->is_weight) {
      q->observer = &stats.activations[q->name];
      q->mode = model::QuantMode::kCalibrate;
    }
  {
    NoGradGuard<float> no_grad(g);
    Rng unused(0);
    model.forward(g, batch.view(), false, unused);
    g.clear();
  }
  quant::apply_calibration(model, stats, quant::Method::kMax, 99.99);
}

}  // namespace

int main(int argc, char** argv) {
  bert::wait_passively_unless_chosen(argv);  // first: it may re-execute the program
  bert::apply_denormal_setting();            // as the tools do (BERT_KEEP_DENORMALS=1 keeps them)
  std::string presets = "tiny,mini", batches = "32,128";
  int steps = 5, warmup = 2;
  double warmup_seconds = 0;
  int64_t vocab = 16000, seq = 128;
  std::string json_path, modes = "fp32,qat", device_spec = "cpu", precision = "fp32", eval_outputs = "scores";
  bool profile_ops = false, profile_shapes = false, cuda_graphs = true;
  int scaling_rounds = 0;
  CLI::App app{"train-step-bench: training-step and evaluation speed of BERT presets (FP32 and QAT)"};
  app.add_option("--presets", presets, "comma-separated presets")->capture_default_str();
  app.add_option("--batches", batches, "comma-separated batch sizes")->capture_default_str();
  app.add_option("--steps", steps, "timed steps (the median reported; on a GPU the mean of steps run back to back)")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  app.add_option("--warmup", warmup, "untimed steps first")->check(CLI::Range(0, 1000))->capture_default_str();
  app.add_option("--warmup-seconds", warmup_seconds,
                 "and untimed steps until this many seconds have passed (a GPU reaches its clocks after a "
                 "moment of load; bench/gpu_speed.sh gives both sides the same)")
      ->check(CLI::Range(0.0, 600.0))
      ->capture_default_str();
  app.add_option("--vocab", vocab, "vocabulary size")
      ->check(CLI::Range(int64_t{100}, int64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--seq", seq, "sequence length (masked positions: 20, or 80 from 512 on, as the demo's shards)")
      ->check(CLI::Range(int64_t{8}, int64_t{512}))
      ->capture_default_str();
  app.add_option("--modes", modes,
                 "comma-separated: fp32, fp32-fused (fused attention on a GPU: Bert::set_fused_attention), "
                 "fp32-recompute (the unfused attention's scores and probabilities computed again in the backward: "
                 "Bert::set_recompute_attention), qat, qat-fused (QAT with the fused attention: the probabilities' "
                 "quantizer inside its tensor-core kernels, BF16 and TF32; bert-train --qat's default in BF16; its "
                 "QAT/FP32 ratio against fp32-fused, qat's against fp32, either against the other float mode where "
                 "only that ran), qat-separate (QAT with every quantizer as an op of its own, the baseline of the "
                 "fused quantizers), qat-float and qat-fused-float (qat and qat-fused with the linears' forward "
                 "products as float GEMMs on the fake-quantized values, Bert::set_integer_training; qat and "
                 "qat-fused take bert-train --qat-products auto: Bert::integer_training_is_faster), qat-integer and "
                 "qat-fused-integer (the products on the integers in any precision), int8 (evaluation only, integer "
                 "GEMMs; on a GPU the linear layers), int8-separate "
                 "(int8 with Q, K and V as three integer linears, the baseline of their fused product), int8-decoder "
                 "(int8 with the MLM decoder as integers too, dynamically quantized)")
      ->capture_default_str();
  app.add_option("--json", json_path, "also write one JSON object per measurement to this file (bench/speed.sh)");
  app.add_option("--device", device_spec, "cpu, cuda, cuda:N or auto")->capture_default_str();
  app.add_option("--precision", precision,
                 "fp32; tf32 (GPU: TF32 GEMMs); or bf16 (GPU: BF16 activations and GEMMs; CPU: products on "
                 "BF16-rounded operands with FP32 sums)")
      ->capture_default_str();
  app.add_option("--eval-outputs", eval_outputs,
                 "what the timed evaluation's MLM head gives: scores (its loss and top predictions, as bert-eval "
                 "scores them: on the CPU the decoder's logits are never stored) or logits (the (masked positions, "
                 "vocabulary) logits, then their loss: the baseline)")
      ->check(CLI::IsMember({"scores", "logits"}))
      ->capture_default_str();
  app.add_flag(
      "--profile", profile_ops,
      "after each measurement, as many steps again with every op timed: a table of milliseconds per "
      "step by op (forward, backward) for training and for evaluation; on a GPU the host's time to queue each op "
      "(its launch overhead; the kernels' own times are ncu's), the wait for the GPU in \"(zero, norm, "
      "update)\"");
  app.add_flag("--profile-shapes", profile_shapes, "--profile with one row per op and output shape");
  app.add_flag("!--no-cuda-graphs", cuda_graphs,
               "on a GPU, launch the training step's and the evaluation's kernels op by op, as bert-train and "
               "bert-eval --no-cuda-graphs (default: each step, and each evaluation batch, recorded and launched "
               "as one CUDA graph once two have run)");
  app.add_option("--scaling-rounds", scaling_rounds,
                 "after each measurement, this many rounds of --steps training steps on 1 thread then on all "
                 "threads, alternating (a busy or throttled machine slows both alike): the scaling efficiency, "
                 "(one-thread step / all-thread step) / threads, per round (CPU only; 0: off)")
      ->check(CLI::Range(0, 100))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  profile_ops = profile_ops || profile_shapes;
  const model::MlmOutputs mlm_outputs =
      eval_outputs == "logits" ? model::MlmOutputs::kLogits : model::MlmOutputs::kLossAndPredictions;
  std::set<std::string> wanted_modes;
  std::stringstream mode_list(modes);
  for (std::string m; std::getline(mode_list, m, ',');) {
    if (m != "fp32" && m != "fp32-fused" && m != "fp32-recompute" && m != "qat" && m != "qat-fused" &&
        m != "qat-float" && m != "qat-fused-float" && m != "qat-integer" && m != "qat-fused-integer" &&
        m != "qat-separate" && m != "int8" && m != "int8-separate" && m != "int8-decoder") {
      std::fprintf(
          stderr,
          "error: --modes: unknown mode '%s' (expected fp32, fp32-fused, fp32-recompute, qat, qat-float, qat-integer, "
          "qat-fused, qat-fused-float, qat-fused-integer, qat-separate, int8, int8-separate or int8-decoder)\n",
          m.c_str());
      return 2;
    }
    wanted_modes.insert(m);
  }
  const std::unique_ptr<Device> device = Device::open(device_spec, parse_precision(precision));
  if ((wanted_modes.contains("int8-separate") || wanted_modes.contains("int8-decoder")) && device->is_cuda()) {
    std::fprintf(stderr,
                 "error: --modes int8-separate and int8-decoder are CPU variants; on a GPU --modes int8 runs the "
                 "linear layers as int8 GEMMs\n");
    return 2;
  }
  if (scaling_rounds > 0 && device->is_cuda()) {
    std::fprintf(stderr, "error: --scaling-rounds measures CPU threads; it does not run on a GPU\n");
    return 2;
  }
  std::printf("device: %s\n",
              device->is_cuda() ? device->name().c_str() : ("cpu, " + precision_name(device->precision())).c_str());
  std::FILE* json = json_path.empty() ? nullptr : std::fopen(json_path.c_str(), "w");
  if (!json_path.empty() && !json) {
    std::fprintf(stderr, "error: cannot write --json '%s'\n", json_path.c_str());
    return 1;
  }

  const int64_t t = seq, p = seq >= 512 ? 80 : std::min<int64_t>(20, seq - 2);
  std::printf("sequence length %lld, %lld masked positions\n", (long long)t, (long long)p);
  if (!device->is_cuda()) {  // The SGEMM ceiling through the same kernel path.
    const int64_t n = 2048;
    std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
    std::vector<double> times;
    for (int r = 0; r < 4; ++r) {
      auto start = std::chrono::steady_clock::now();
      gemm<float>({false, false, n, n, n}, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
      if (r > 0) times.push_back(seconds_since(start));
    }
    const double ceiling = 2.0 * n * n * n / median(times) / 1e9;
    std::printf("threads %d (waiting %s); %s kernels; SGEMM 2048^3 ceiling: %.1f GFLOP/s\n", num_threads(),
                openmp_wait_policy().c_str(), cpu_kernels_name(CpuKernels::kAuto), ceiling);
    if (json)
      std::fprintf(json, "{\"kind\": \"sgemm\", \"n\": %lld, \"gflops\": %.3f, \"threads\": %d}\n", (long long)n,
                   ceiling, num_threads());
  }
  std::printf(
      "step FLOPs = 3 x B x [L (8 T H^2 + 4 T H I + 4 T^2 H) + 2 P H^2 + 2 P H V + 2 H^2], T=%lld, P=%lld, V=%lld\n",
      (long long)t, (long long)p, (long long)vocab);
  std::printf("evaluation's MLM head gives: %s\n", eval_outputs == "logits"
                                                       ? "logits (then their loss)"
                                                       : "loss and top predictions (no logits on the CPU)");
  std::printf("%-6s %6s %-12s %12s %10s %10s %12s\n", "preset", "batch", "mode", "step (s)", "seq/s", "GFLOP/s",
              "eval seq/s");

  std::stringstream preset_list(presets);
  for (std::string name; std::getline(preset_list, name, ',');) {
    model::BertConfig config = model::preset(name);
    config.vocab_size = vocab;
    std::stringstream batch_list(batches);
    for (std::string bs; std::getline(batch_list, bs, ',');) {
      const int64_t b = std::stoll(bs);
      const Batch batch = synthetic_batch(b, t, p, vocab, 7);
      const BatchView input = batch.view();
      double fp32_step = 0, fused_step = 0;  // the float steps QAT's are set against
      double fp32_eval = 0;
      for (const std::string mode :
           {"fp32", "fp32-fused", "fp32-recompute", "qat", "qat-float", "qat-integer", "qat-fused", "qat-fused-float",
            "qat-fused-integer", "qat-separate", "int8", "int8-separate", "int8-decoder"}) {
        if (!wanted_modes.contains(mode)) continue;
        const bool qat = mode.starts_with("qat"), int8 = mode.starts_with("int8");
        if (const std::string why = int8 ? eval::integer_inference_left_out(*device) : ""; !why.empty()) {
          std::printf("%-6s %6lld %-12s left out: %s\n", name.c_str(), (long long)b, mode.c_str(), why.c_str());
          continue;
        }
        model::Bert model(config);
        model.initialize(1);
        const bool fused_qat = mode.starts_with("qat-fused");
        model.set_fused_attention(mode == "fp32-fused" || fused_qat);
        model.set_integer_training(mode.ends_with("-integer") ||
                                   (!mode.ends_with("-float") &&
                                    model::Bert::integer_training_is_faster(device->precision(), config.hidden_size)));
        model.set_recompute_attention(mode == "fp32-recompute");
        model.place_on(*device);
        std::vector<bool> decays;
        for (ParamId id = 0; id < model.parameters().size(); ++id) decays.push_back(model.decays(id));
        train::Optimizer optimizer({}, model.parameters(), decays);
        Graph<float> g(*device);
        Rng dropout(3);
        if (int8) {  // evaluation only: integer GEMMs in every quantized linear (max-calibrated scales)
          enable_quantization(model, batch, *device);
          model.prepare_integer_inference(/*integer_decoder=*/mode == "int8-decoder",
                                          /*fuse_projections=*/mode != "int8-separate");
        }
        if (qat) {
          model.set_fused_quantizers(mode != "qat-separate");
          enable_quantization(model, batch, *device);
          model.parameters().upload_values();
          for (model::Quantizer* q : model.enabled_quantizers()) {  // as bert-train's default (--scales learned)
            optimizer.set_log_space(q->scale);
            optimizer.set_minimum(q->scale, quant::kMinimumScale);
          }
        }
        // One step of bert-train (its default options: no accumulation, clipping at norm 1) over the
        // synthetic batch; with a profile, the time outside the graph's ops is timed into it too.
        train::TrainOptions step_options;
        step_options.cuda_graphs = cuda_graphs;
        train::SingleProcess single;
        train::TrainingStep training_step(step_options, {model, optimizer, dropout, single});
        train::ProgressWindow window(config);
        Batch step_batch = batch;
        auto train_step = [&](OpProfile* profile) {
          g.set_profile(profile);
          auto graph_seconds = [&] {
            double total = 0;
            if (profile)
              for (const OpProfile::Entry& e : profile->entries()) total += e.total_s();
            return total;
          };
          const double graph_before = graph_seconds();
          const auto start = std::chrono::steady_clock::now();
          const train::TrainingStep::Outcome outcome = training_step.run(g, step_batch, [](Batch&) {}, 1e-4, window);
          device->synchronize();
          if (profile)
            profile->add("(zero, norm, update)", seconds_since(start) - (graph_seconds() - graph_before));
          if (!outcome.updated)
            throw std::runtime_error("the benchmark's training step went non-finite: " + outcome.nonfinite);
          window.reset();
          g.set_profile(nullptr);
        };
        // Scores as bert-eval's evaluation runs them (eval::BatchEvaluator: on a GPU, recorded and launched as
        // one CUDA graph once two batches have run, unless --no-cuda-graphs); logits op by op.
        std::optional<eval::BatchEvaluator> evaluator;
        if (mlm_outputs != model::MlmOutputs::kLogits) evaluator.emplace(model, g, cuda_graphs);
        auto eval_step = [&](OpProfile* profile) {
          g.set_profile(profile);
          if (evaluator) {
            evaluator->run(input);
          } else {
            NoGradGuard<float> no_grad(g);
            model.forward(g, input, false, dropout, mlm_outputs);
          }
          g.clear();
          device->synchronize();
          g.set_profile(nullptr);
        };
        // Untimed steps: at least --warmup of them, for at least --warmup-seconds.
        auto warm_up = [&](auto&& one_step) {
          const auto begin = std::chrono::steady_clock::now();
          for (int s = 0; s < warmup || seconds_since(begin) < warmup_seconds; ++s) one_step(nullptr);
        };
        std::vector<double> times;
        double host_queue_s = 0;  // the host's time to queue a step (pipelined steps)
        if (!int8) warm_up(train_step);
        if (!int8 && !training_step.pipelined()) {
          for (int s = 0; s < steps; ++s) {
            const auto start = std::chrono::steady_clock::now();
            train_step(nullptr);
            times.push_back(seconds_since(start));
          }
        } else if (!int8) {
          // Timed as bert-train runs its steps on a GPU: step s + 1 queued before step s is taken
          // (TrainingStep::pipelined); the mean over --steps steps, from the first queued to the last done.
          auto take = [&] {
            const train::TrainingStep::Outcome outcome = training_step.finish(window);
            if (!outcome.updated)
              throw std::runtime_error("the benchmark's training step went non-finite: " + outcome.nonfinite);
            window.reset();
          };
          const auto start = std::chrono::steady_clock::now();
          for (int s = 0; s < steps; ++s) {
            const auto queue_start = std::chrono::steady_clock::now();
            training_step.queue(
                g, step_batch, [](Batch&) {}, 1e-4, window);
            host_queue_s += seconds_since(queue_start) / steps;
            if (training_step.queued() == 2) take();
          }
          while (training_step.queued() > 0) take();
          device->synchronize();
          times.push_back(seconds_since(start) / steps);
        }
        const double step = int8 ? 0.0 : median(times);
        // The training step's memory, taken before the evaluation below runs on the same graph (a quantized
        // model's evaluation can take more workspace than its training step: reported apart).
        const std::size_t train_used = device->is_cuda() ? device->memory_use().first : 0;
        const std::size_t train_workspace = g.workspace().peak_bytes_in_use();
        if (mode == "fp32") fp32_step = step;
        if (mode == "fp32-fused") fused_step = step;
        std::vector<double> eval_times;
        warm_up(eval_step);
        double eval_batch_s = 0;  // seconds a batch
        if (evaluator && device->is_cuda()) {
          // On a GPU the batches run back to back as bert-eval runs them: the host queues one while the GPU
          // runs the one before (eval::BatchEvaluator::queue), timed from the first to the last.
          const auto start = std::chrono::steady_clock::now();
          for (int s = 0; s < steps; ++s) evaluator->queue(input);
          evaluator->finish();
          eval_batch_s = seconds_since(start) / steps;
          g.clear();
        } else {
          for (int s = 0; s < steps; ++s) {
            const auto start = std::chrono::steady_clock::now();
            eval_step(nullptr);
            eval_times.push_back(seconds_since(start));
          }
          eval_batch_s = median(eval_times);
        }
        OpProfile train_profile(profile_shapes), eval_profile(profile_shapes);
        if (profile_ops) {
          for (int s = 0; s < steps && !int8; ++s) train_step(&train_profile);
          for (int s = 0; s < steps; ++s) eval_step(&eval_profile);
        }
        const double eval_rate = b / eval_batch_s;
        if (mode == "fp32") fp32_eval = eval_rate;
        if (int8) {  // no training step: evaluation only
          std::printf("%-6s %6lld %-12s %12s %10s %10s %12.1f", name.c_str(), (long long)b, mode.c_str(), "-", "-", "-",
                      eval_rate);
          if (fp32_eval > 0) std::printf("   INT8/FP32 eval %.2fx", eval_rate / fp32_eval);
          std::printf("   Q/K/V fused in %lld of %lld layers, attention as integers in %lld",
                      (long long)model.fused_projection_layers(), (long long)config.num_hidden_layers,
                      (long long)model.integer_attention_layers());
          if (device->is_cuda())
            std::printf(", residual LayerNorms on integers %lld of %lld", (long long)model.integer_residual_norms(),
                        (long long)(2 * config.num_hidden_layers));
          if (json)
            std::fprintf(json,
                         "{\"kind\": \"eval\", \"preset\": \"%s\", \"batch\": %lld, \"mode\": \"%s\", "
                         "\"eval_seq_per_s\": %.3f}\n",
                         name.c_str(), (long long)b, mode.c_str(), eval_rate);
          std::printf("\n");
          if (profile_ops)
            std::printf("\nops of the %s b%lld %s evaluation, %d steps profiled:\n%s\n", name.c_str(), (long long)b,
                        mode.c_str(), steps, eval_profile.table(steps).c_str());
          std::fflush(stdout);
          continue;
        }
        const double gflops = 3 * b * forward_flops(config, t, p) / step / 1e9;
        std::printf("%-6s %6lld %-12s %12.3f %10.1f %10.1f %12.1f", name.c_str(), (long long)b, mode.c_str(), step,
                    b / step, gflops, eval_rate);
        // The float step a QAT step is set against: the one with the same attention where it ran, else the
        // other (bert-train's TF32 defaults pair the QAT step's unfused attention with the fused float step).
        if (const double same = fused_qat ? fused_step : fp32_step; qat && same > 0)
          std::printf("   QAT/FP32 step %.2f", step / same);
        else if (const double other = fused_qat ? fp32_step : fused_step; qat && other > 0)
          std::printf("   QAT/FP32 step %.2f (against %s)", step / other, fused_qat ? "fp32" : "fp32-fused");
        if (json)
          std::fprintf(json,
                       "{\"kind\": \"step\", \"preset\": \"%s\", \"batch\": %lld, \"mode\": \"%s\", \"step_s\": %.6f, "
                       "\"seq_per_s\": %.3f, \"gflops\": %.3f, \"step_gflop\": %.3f, \"eval_seq_per_s\": %.3f}\n",
                       name.c_str(), (long long)b, mode.c_str(), step, b / step, gflops,
                       3 * b * forward_flops(config, t, p) / 1e9, eval_rate);
        if (device->is_cuda()) {
          // After the training steps; the step's workspace (activations, saved tensors, gradients) apart: the
          // rest is the parameters, their gradients, the optimizer's moments, the BF16 copy of the weights and
          // the CUDA context. Where the evaluation then took more, its total too.
          constexpr double kGiB = 1 << 30;
          std::printf("   GPU memory %.2f GiB (step workspace %.2f)", train_used / kGiB, train_workspace / kGiB);
          if (const std::size_t used = device->memory_use().first; used > train_used + (std::size_t{64} << 20))
            std::printf(", %.2f GiB after the evaluation", used / kGiB);
          // (A host a whole step ahead also waits here for room in CUDA's launch queue.)
          if (host_queue_s > 0) std::printf("   host queues a step in %.2f ms", 1e3 * host_queue_s);
          if (training_step.graphs().launches() > 0)
            std::printf(" (recorded: %lld steps as CUDA graphs, %lld made)",
                        (long long)training_step.graphs().launches(),
                        (long long)training_step.graphs().instantiations());
        }
        std::printf("\n");
        if (scaling_rounds > 0) {
          const int threads = num_threads();
          auto median_step = [&](int with_threads) {
            omp_set_num_threads(with_threads);
            std::vector<double> round_times;
            for (int s = 0; s < steps; ++s) {
              const auto start = std::chrono::steady_clock::now();
              train_step(nullptr);
              round_times.push_back(seconds_since(start));
            }
            omp_set_num_threads(threads);
            return median(round_times);
          };
          train_step(nullptr);  // the thread count changes below: one step to settle the pools
          std::vector<double> efficiency, one_rate, all_rate;
          for (int r = 0; r < scaling_rounds; ++r) {
            const double one = median_step(1), all = median_step(threads);
            one_rate.push_back(b / one);
            all_rate.push_back(b / all);
            efficiency.push_back(one / all / threads);
          }
          std::sort(efficiency.begin(), efficiency.end());
          std::printf(
              "  scaling 1 -> %d threads, %d alternating rounds: %.1f -> %.1f seq/s (medians), efficiency %.0f%% "
              "(median; rounds %.0f-%.0f%%)\n",
              threads, scaling_rounds, median(one_rate), median(all_rate), 100 * median(efficiency),
              100 * efficiency.front(), 100 * efficiency.back());
          if (json)
            std::fprintf(json,
                         "{\"kind\": \"scaling\", \"preset\": \"%s\", \"batch\": %lld, \"mode\": \"%s\", "
                         "\"threads\": %d, \"rounds\": %d, \"one_thread_seq_per_s\": %.3f, "
                         "\"all_threads_seq_per_s\": %.3f, \"efficiency\": %.4f, \"efficiency_min\": %.4f, "
                         "\"efficiency_max\": %.4f}\n",
                         name.c_str(), (long long)b, mode.c_str(), threads, scaling_rounds, median(one_rate),
                         median(all_rate), median(efficiency), efficiency.front(), efficiency.back());
        }
        if (profile_ops)
          std::printf("\nops of the %s b%lld %s training step, %d steps profiled:\n%s\nops of its evaluation:\n%s\n",
                      name.c_str(), (long long)b, mode.c_str(), steps, train_profile.table(steps).c_str(),
                      eval_profile.table(steps).c_str());
        std::fflush(stdout);
      }
    }
  }
#if BERT_WITH_CUDA
  if (device->is_cuda()) std::printf("%s\n", summarize_tuning(*device->cuda_context()).describe().c_str());
#endif
  if (json) std::fclose(json);
  return 0;
}
