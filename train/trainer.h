// The training loop: pretraining (MLM + NSP) or fine-tuning (sequence or token classification, from
// task shards) through the loader, AdamW or LAMB with warmup and decay, global-norm clipping, gradient
// accumulation, a progress line, a JSON-lines metrics log, periodic held-out evaluation, atomic
// checkpoints and exact resume.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "eval/metrics.h"
#include "eval/squad.h"
#include "sys/json.h"
#include "train/communicator.h"
#include "train/options.h"

namespace bert::train {

struct TrainResult {
  int64_t steps_done = 0;
  bool stopped_early = false;                    // a stop (a signal, --stop-at, --patience); a checkpoint was written
  std::vector<std::string> saturated_channels;   // QAT: quant::fully_saturated_channels at the end
  double seconds = 0, sequences_per_second = 0;  // sequences of every rank (the global rate)
  int64_t skipped_steps = 0;  // updates dropped for a non-finite loss or gradient (--on-nonfinite skip)
  eval::PretrainingMetrics last_eval;
  eval::TaskMetrics last_task_eval;  // fine-tuning runs
  std::optional<eval::AnswerScores> last_answers;  // question answering with TrainOptions::eval_questions
  std::vector<double> losses;        // per optimizer step, from this run's first step
  // --keep-best: the best held-out evaluation's step and value (over the resumed run's too), 0 without.
  int64_t best_step = 0;
  double best_value = 0;
  // One GPU: steps recorded and launched as CUDA graphs (TrainOptions::cuda_graphs), and how many of them
  // made a new executable graph rather than updating the last one.
  int64_t graph_steps = 0, graph_instantiations = 0;
};

// Runs training. `stop` (e.g. set by a SIGINT handler) is checked every step; when set, a checkpoint
// is written and the run returns with stopped_early.
//
// Data parallelism: with several ranks, each calling train() with the same options — threads of one
// process each with its Communicator of a local_group (`ranks`, the CPU backend), or processes of a job
// (options.process_group: one GPU each, NCCL) — each rank trains on its slice of the global batch
// (batch_size * ranks, as one process with that batch would see it), gradients are averaged over the
// ranks before clipping, the ranks agree on stopping and on skipping a non-finite step, the progress
// metrics are summed over the ranks, and only rank 0 evaluates and writes (checkpoints, metrics, the run
// folder). Every rank starts from the same weights and calibrates on the same batches. Ranks started
// with different options or model configurations are refused before the first step.
TrainResult train(const TrainOptions& options, const std::atomic<bool>* stop = nullptr, Communicator* ranks = nullptr);

}  // namespace bert::train
