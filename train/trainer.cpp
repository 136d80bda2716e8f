#include "train/trainer.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <utility>

#include "kernels/gemm.h"
#include "ops/ops.h"
#include "store/checkpoint.h"
#include "store/model_source.h"
#include "sys/atomic_file.h"
#include "sys/error.h"
#include "sys/openmp_wait.h"
#include "sys/parallel.h"
#include "sys/sha256.h"
#include "sys/text_file.h"
#include "tokenizer/tokenizer_file.h"
#include "train/checkpoint_writer.h"
#include "train/gradient_reduction.h"
#include "train/nccl_communicator.h"
#include "train/progress.h"
#include "train/qat_setup.h"
#include "train/run_folder.h"
#include "train/training_step.h"

namespace bert::train {

namespace fs = std::filesystem;

namespace {

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
  std::unique_ptr<Device> device = Device::open(device_spec, o.precision);
  if (thread_ranks && world > 1 && device->is_cuda())
    throw UserError("--device " + o.device +
                    ": ranks that are threads of one process train on the CPU; several GPUs take one process each "
                    "(bert-train --nproc N, or mpirun)");
  return device;
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

// One training run: everything it holds, set up in the order the checks need (nothing is written before
// the inputs have been checked), and the loop over its steps. Rank 0 (the lead) evaluates and writes.
class TrainingRun {
 public:
  TrainingRun(const TrainOptions& o, const std::atomic<bool>* stop, Communicator* group);
  bool finished() const { return state_.step >= o_.steps; }
  // A resumed run that --patience had stopped (nothing more to do), agreed on by every rank.
  bool patience_spent() const { return patience_spent_; }
  int64_t step() const { return state_.step; }
  void announce() const;
  TrainResult run_steps();
  // The message of an out-of-memory step: the model, batch, length and precision, the GPU's memory, the
  // allocation that failed (`what`) and what to lower.
  std::string out_of_memory(const std::string& what, int64_t seq_len) const;
  // After the loop: the held-out evaluation of the final model, the summary line, saturated channels.
  void finish(TrainResult& result);

 private:
  // A checkpoint of the step just ended, written in the background (CheckpointWriter); `wait`: written
  // before returning (a stop's; the run's last one is waited for in finish()).
  void save(bool wait);
  // --keep-best, after a held-out evaluation: where it beats every one before, the model alone to
  // checkpoint-best.h5 (in the background, as save's) and its record to best.json.
  void keep_if_best(TrainResult& result);
  // A step that went non-finite (`nonfinite` says what): skipped with a warning (--on-nonfinite skip, up
  // to --max-skips in a row), else the run stops with a message naming the last checkpoint.
  void skip_or_stop(const std::string& nonfinite, int64_t& consecutive_skips);
  // What the progress line and the held-out evaluation read and write.
  RunReport report() { return RunReport{o_, model_, active_, *device_, ranks(), metrics_log_}; }
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
  Communicator* ranks_ = nullptr;  // `group`, the NCCL communicator or single_: set first thing in the body
  Communicator& ranks() const { return *ranks_; }
  model::Bert model_;
  std::unique_ptr<Optimizer> optimizer_;
  std::optional<data::ShardLoader> eval_loader_;  // the held-out shards' (--eval), on the lead rank
  Rng dropout_rng_;
  store::TrainingState state_;
  std::vector<model::Quantizer*> active_;
  std::unique_ptr<model::Bert> teacher_;
  std::ofstream metrics_log_;
  int64_t warmup_;
  int64_t last_saved_step_;
  struct Best {
    double value = 0;
    int64_t step = 0;
  };
  std::optional<Best> best_;  // --keep-best, on the lead: the best evaluation so far (on --resume, best.json's)
  bool patience_spent_ = false;
  CheckpointWriter writer_;  // last: destroyed first, so a write in progress ends before the rest goes
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
      model_(config_),
      dropout_rng_(Rng(o.seed).bits(0xD7)),
      warmup_(static_cast<int64_t>(std::llround(o.warmup_fraction * o.steps))),
      last_saved_step_(o.resume ? 0 : -1) {
  // The collectives, in the body: the NCCL communicator of a job of processes (created by all of them
  // together), then the check that every rank was started with the same options and model (nothing is
  // placed on a device or written before the ranks agree).
  if (o.process_group.distributed()) nccl_ = nccl_communicator(o.process_group, *device_);
  ranks_ = group ? group : nccl_ ? nccl_.get() : &single_;
  check_ranks_agree(ranks(), o, config_);
  // On a GPU the arena gets its device mirror now, so the optimizer's moments live there too; values
  // are loaded or initialised on the host and uploaded in start_state.
  model_.place_on(*device_);
  model_.set_fused_attention(o.fused_attention, o.fused_quantized_attention);
  model_.set_recompute_attention(o.recompute_attention);
  model_.set_integer_training(o.integer_qat_products.value_or(
      model::Bert::integer_training_is_faster(o.precision, model_.config().hidden_size)));
  ParameterArena<float>& params = model_.parameters();
  std::vector<bool> decays;
  for (ParamId id = 0; id < params.size(); ++id) decays.push_back(model_.decays(id));
  optimizer_ = std::make_unique<Optimizer>(o.optimizer, params, decays);

  if (!data::check_loader_compatible(loader_, loader_options_.shards.front(), config_.vocab_size,
                                     config_.max_position_embeddings, o.tokenizer_sha256))
    spdlog::warn("training shards carry no tokenizer metadata (made by another tool?): cannot check they match '{}'",
                 o.tokenizer_path);
  if (!o.eval_shards.empty() && lead_)
    eval_loader_.emplace(held_out_loader(o, data::expand_shard_paths(o.eval_shards), loader_));
  // Inputs are checked: only now does anything get written.
  std::error_code ec;
  if (lead_) fs::create_directories(o.output_dir, ec);
  if (ec) throw UserError("cannot create output folder '" + o.output_dir + "': " + ec.message());

  state_ = start_state(RunSetup{o, files_, config_, loader_options_, *device_, lead_},
                       RunPieces{model_, *optimizer_, loader_, dropout_rng_});
  if (o.resume) last_saved_step_ = state_.step;
  // Each rank drops out other units: its own stream, derived from the one the checkpoint keeps (rank 0's),
  // drawn in step with it.
  if (!lead_)
    dropout_rng_ =
        Rng(Rng::State{Rng(dropout_rng_.state().seed).bits(0x5EED + ranks().rank()), dropout_rng_.state().counter});
  active_ = configure_scales(o, model_, *optimizer_, state_);
  if (o.keep_best) {
    check_best_metric(*o.keep_best, config_);
    if (eval_loader_)
      eval::check_groups(task_score_of(*o.keep_best), eval_loader_->grouped(),
                         "--keep-best " + kBestMetricNames.name(*o.keep_best), o.eval_shards.front());
    std::error_code exists;
    if (lead_ && o.resume && fs::is_regular_file(files_.best_record, exists)) {
      const Json record = Json::parse(read_text_file(files_.best_record, "best-model record"));
      const Json *metric = record.find("metric"), *value = record.find("value"), *step = record.find("step");
      if (metric && metric->is_string() && metric->as_string() == kBestMetricNames.name(*o.keep_best) && value &&
          value->is_number() && step && step->is_number())
        best_ = Best{value->as_number(), static_cast<int64_t>(step->as_number())};
      else
        spdlog::warn("--keep-best {}: '{}' records another metric; the best model is chosen again from here",
                     kBestMetricNames.name(*o.keep_best), files_.best_record);
    }
    if (o.patience > 0 && o.resume) {  // stopped by --patience already?
      double spent = lead_ && best_ && state_.step - best_->step >= o.patience * o.eval_every ? 1.0 : 0.0;
      ranks().all_reduce_sum(std::span<double>(&spent, 1));
      patience_spent_ = spent > 0;
      if (patience_spent_ && lead_)
        spdlog::info(
            "nothing to do: the run stopped at step {} after {} evaluations without a better {} than step {}'s "
            "(--patience 0, or a larger one, goes on)",
            state_.step, o.patience, kBestMetricNames.name(*o.keep_best), best_->step);
    }
  }
  teacher_ = make_teacher(o, config_, loader_.seq_len(), *device_);
  if (lead_ && !finished()) {
    metrics_log_.open(files_.metrics, std::ios::app);
    writer_.reserve(model_.parameters().values().numel(), true);  // (the arena, its padding included)
  }
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
      ranks().size() > 1 ? fmt::format(", rank {} of {} (global batch {})", ranks().rank(), ranks().size(),
                                       o_.batch_size * o_.accumulation * ranks().size())
                         : "");
}

void TrainingRun::save(bool wait) {
  last_saved_step_ = state_.step;
  if (!lead_) return;
  state_.loader = loader_.state();
  state_.dropout_rng = dropout_rng_.state();
  model_.parameters().download_values();
  optimizer_->download_moments();
  const store::OptimizerMoments moments = optimizer_->checkpoint_moments();
  store::snapshot_checkpoint(model_, &moments, state_, writer_.next());
  writer_.write(files_.checkpoint, [dir = o_.output_dir, path = files_.checkpoint, step = state_.step,
                                    keep = o_.keep_checkpoints] { keep_numbered_checkpoints(dir, path, step, keep); });
  if (wait) writer_.wait();
}

void TrainingRun::keep_if_best(TrainResult& result) {
  if (!o_.keep_best || !lead_) return;
  const TrainOptions::BestMetric metric = *o_.keep_best;
  const double value = best_metric_value(metric, result, config_.head);
  if (best_ && !beats(metric, value, best_->value)) return;
  const std::string name = kBestMetricNames.name(metric);
  spdlog::info("eval step {}: the best {} so far, {:.4f}{} -> '{}'", state_.step, name, value,
               best_ ? fmt::format(" (was {:.4f} at step {})", best_->value, best_->step) : "", files_.best_checkpoint);
  best_ = Best{value, state_.step};
  model_.parameters().download_values();
  store::snapshot_checkpoint(model_, nullptr, state_, writer_.next());
  Json record;
  record["metric"] = name;
  record["value"] = value;
  record["step"] = state_.step;
  record["checkpoint"] = "checkpoint-best.h5";
  writer_.write(files_.best_checkpoint,
                [path = files_.best_record, text = record.dump(2) + "\n"] { write_text_file(path, text); });
}

std::string TrainingRun::out_of_memory(const std::string& what, int64_t seq_len) const {
  const int64_t gib = int64_t{1} << 30;
  const auto [used, total] = device_->memory_use();
  return fmt::format(
      "step {}: the training step of L{}/H{} ({} parameters) with batch size {}{} at sequence length {} in {} does "
      "not fit on the GPU ({:.1f} of {:.1f} GiB in use after the step was dropped): {}. Lower --batch-size (and raise "
      "--accumulate to keep the global batch), train on shorter sequences{}{}",
      state_.step, config_.num_hidden_layers, config_.hidden_size, model_.parameters().num_elements(), o_.batch_size,
      o_.accumulation > 1 ? fmt::format(" (x{} micro-batches)", o_.accumulation) : "", seq_len,
      precision_name(o_.precision), double(used) / gib, double(total) / gib, what,
      o_.precision == Precision::kBf16 ? "" : ", or use --precision bf16 (activations in half the memory)",
      o_.fused_attention || o_.recompute_attention ? ""
      : o_.precision != Precision::kFp32
          ? ", or --attention fused (the attention scores never reach memory)"
          : ", or --attention recompute (the attention scores computed again in the backward instead of kept)");
}

void TrainingRun::skip_or_stop(const std::string& nonfinite, int64_t& consecutive_skips) {
  const bool skip = o_.on_nonfinite == TrainOptions::OnNonFinite::kSkip;
  const std::string last_saved =
      last_saved_step_ >= 0 ? "at step " + std::to_string(last_saved_step_) : "none written yet";
  if (!skip || ++consecutive_skips > o_.max_consecutive_skips)
    throw UserError(nonfinite + " at step " + std::to_string(state_.step) +
                    (skip ? " (" + std::to_string(o_.max_consecutive_skips) + " steps skipped in a row)" : "") +
                    "; stopped without writing a checkpoint, the last one ('" + files_.checkpoint + "', " + last_saved +
                    ") was left as it was. Try a lower --lr, or --on-nonfinite skip.");
  spdlog::warn("step {}: {}; update skipped ({} in a row, --on-nonfinite skip)", state_.step, nonfinite,
               consecutive_skips);
}

TrainResult TrainingRun::run_steps() {
  TrainResult result;
  ParameterArena<float>& params = model_.parameters();
  Graph<float> g(*device_);
  const std::unique_ptr<GradientReduction> reduction =
      ranks().size() > 1 ? std::make_unique<GradientReduction>(params, ranks(), *device_,
                                                               static_cast<int64_t>(o_.bucket_mb * (1 << 20)))
                         : nullptr;
  Batch batch;
  ProgressWindow window(config_);
  TrainingStep training_step(o_, {model_, *optimizer_, dropout_rng_, ranks(), teacher_.get(), reduction.get(), stop_});
  const auto next_batch = [this](Batch& b) { loader_.next(b); };
  const int64_t first_step = state_.step + 1;
  int64_t consecutive_skips = 0;
  const auto start = std::chrono::steady_clock::now();
  auto last_taken = start;
  bool stop_seen = false;
  // Takes the outcome of the oldest queued step, `step`: the loss, a skip or a stop, then what is due after
  // it (progress, evaluation, checkpoint); true when the run stops there.
  const auto take = [&](int64_t step, double lr) {
    state_.step = step;
    const TrainingStep::Outcome outcome = training_step.finish(window);
    if (outcome.updated) {
      consecutive_skips = 0;
      result.losses.push_back(outcome.loss);
    } else {
      skip_or_stop(outcome.nonfinite, consecutive_skips);
      ++result.skipped_steps;
    }
    const auto now = std::chrono::steady_clock::now();
    window.add_time(std::chrono::duration<double>(now - last_taken).count());
    last_taken = now;
    stop_seen = stop_seen || outcome.stop_requested;
    // (A stop seen while the next step is queued stops after that one.)
    return after_step(first_step, lr, stop_seen && training_step.queued() == 0, start, window, result);
  };
  // On a GPU (one rank) step n + 1 is queued before step n is taken, so the GPU never waits for the host
  // between steps; a step after which something is due (progress line, evaluation, checkpoint, the end) is
  // taken before the next one is queued, so what is saved or evaluated is that step's model.
  const auto due_after = [&](int64_t step) {
    return step == o_.steps || step % o_.log_every == 0 || (o_.eval_every > 0 && step % o_.eval_every == 0) ||
           (o_.save_every > 0 && step % o_.save_every == 0) || (o_.stop_at_step > 0 && step == o_.stop_at_step);
  };
  std::optional<std::pair<int64_t, double>> held;  // the step queued and not taken yet, and its learning rate
  for (int64_t step = first_step; step <= o_.steps; ++step) {
    const double lr = learning_rate(step, o_.steps, warmup_, o_.learning_rate, o_.schedule);
    state_.step = step;  // (what an out-of-memory message names)
    try {
      training_step.queue(g, batch, next_batch, lr, window, step == first_step && lead_);
    } catch (const OutOfDeviceMemory& e) {
      throw OutOfDeviceMemory(out_of_memory(e.what(), batch.seq_len));
    }
    if (held) {
      const auto [held_step, held_lr] = *held;
      held.reset();
      if (take(held_step, held_lr)) break;
    }
    if (!training_step.pipelined() || due_after(step) || stop_seen) {
      if (take(step, lr)) break;
    } else {
      held = {step, lr};
    }
  }
  state_.step = result.steps_done = std::min(state_.step, o_.steps);
  result.graph_steps = training_step.graphs().launches();
  result.graph_instantiations = training_step.graphs().instantiations();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Every rank's sequences: the global rate, as the progress lines give it.
  result.sequences_per_second = static_cast<double>(result.losses.size() * o_.batch_size * o_.accumulation) *
                                static_cast<double>(ranks().size()) / std::max(result.seconds, 1e-9);
  return result;
}

bool TrainingRun::after_step(int64_t first_step, double lr, bool stop_requested,
                             std::chrono::steady_clock::time_point start, ProgressWindow& window, TrainResult& result) {
  const int64_t step = state_.step;
  bool stopping = stop_requested || (o_.stop_at_step > 0 && step == o_.stop_at_step);
  if ((step % o_.log_every == 0 || step == o_.steps || stopping) && window.steps() > 0) {
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    report_progress(report(), step, lr, elapsed, elapsed / (step - first_step + 1), window);
  }
  const bool last = step == o_.steps;
  const bool evaluating = o_.eval_every > 0 && step % o_.eval_every == 0 && !last;
  if (eval_loader_ && evaluating) {
    evaluate_held_out(report(), *eval_loader_, step, result);
    keep_if_best(result);
  }
  // --patience: the lead's count, agreed on by every rank.
  bool patience_spent = false;
  if (o_.patience > 0 && evaluating) {
    double spent = lead_ && best_ && step - best_->step >= o_.patience * o_.eval_every ? 1.0 : 0.0;
    ranks().all_reduce_sum(std::span<double>(&spent, 1));
    patience_spent = spent > 0;
    if (patience_spent && lead_)
      spdlog::info("step {}: no better held-out {} in {} evaluations (the best, {:.4f} at step {}: '{}'); stopping",
                   step, kBestMetricNames.name(*o_.keep_best), o_.patience, best_->value, best_->step,
                   files_.best_checkpoint);
    stopping = stopping || patience_spent;
  }
  // The last checkpoint is waited for in finish(), after the final evaluation; a stop's, here.
  if ((o_.save_every > 0 && step % o_.save_every == 0) || last || stopping) save(stopping);
  if (!stopping) return false;
  if (lead_ && !patience_spent)
    spdlog::warn("stopped at step {}: checkpoint written to '{}'; continue with --resume", step, files_.checkpoint);
  result.stopped_early = true;
  return true;
}

void TrainingRun::finish(TrainResult& result) {
  // The final held-out evaluation runs while the last checkpoint is written.
  if (!result.stopped_early && eval_loader_) {
    evaluate_held_out(report(), *eval_loader_, state_.step, result);
    keep_if_best(result);
  }
  if (best_) result.best_step = best_->step, result.best_value = best_->value;
  const auto waiting = std::chrono::steady_clock::now();
  writer_.wait();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - waiting).count();
  const std::string rate =
      ranks().size() > 1
          ? fmt::format("{:.1f} sequences/s over the whole run and all {} ranks, {:.1f} per rank",
                        result.sequences_per_second, ranks().size(), result.sequences_per_second / ranks().size())
          : fmt::format("{:.1f} sequences/s over the whole run", result.sequences_per_second);
  spdlog::info("done: {} steps in {} ({}); checkpoint '{}'{}", result.losses.size(), format_duration(result.seconds),
               rate, files_.checkpoint, waited >= 0.05 ? fmt::format(" (its writing took {:.1f} s more)", waited) : "");
  if (best_ && lead_)
    spdlog::info("best {} {:.4f} at step {}: '{}'", kBestMetricNames.name(*o_.keep_best), best_->value, best_->step,
                 files_.best_checkpoint);
  if (result.graph_steps > 0)
    spdlog::info("{} of the steps ran as one CUDA graph each ({} graph{} made, the others updated in place)",
                 result.graph_steps, result.graph_instantiations, result.graph_instantiations == 1 ? "" : "s");
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
  if (run.finished() || run.patience_spent()) {
    if (run.finished()) spdlog::info("nothing to do: the checkpoint is at step {} of {}", run.step(), o.steps);
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
