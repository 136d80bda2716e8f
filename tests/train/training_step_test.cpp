// A training step, and an evaluation batch (eval::BatchEvaluator), on a GPU recorded and launched as one
// CUDA graph (core/step_graph.h) against the same work launched op by op. Skipped without a GPU.
#include <gtest/gtest.h>

#include <array>
#include <memory>
#include <vector>

#include "core/device.h"
#include "core/graph.h"
#include "core/rng.h"
#include "eval/output_reads.h"
#include "model/bert.h"
#include "train/communicator.h"
#include "train/optimizer.h"
#include "train/progress.h"
#include "train/training_step.h"

namespace bert::train {
namespace {

// B sequences of T random tokens, p masked positions each (`short_rows` of them hold one fewer, the rest
// 0-padded as the shards pad them), half of them with a random next sentence.
Batch random_batch(int64_t b, int64_t t, int64_t p, int64_t vocab, uint64_t seed, int64_t short_rows = 0) {
  Rng rng(seed);
  Batch batch;
  batch.size = b, batch.seq_len = t, batch.max_predictions = p;
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t j = 0; j < t; ++j) {
      batch.input_ids.push_back(j == 0 ? 2 : static_cast<int32_t>(5 + rng.next_below(vocab - 5)));
      batch.input_mask.push_back(j < t - i % 3 ? 1 : 0);  // some rows padded
      batch.segment_ids.push_back(j < t / 2 ? 0 : 1);
    }
    const int64_t used = i < short_rows ? p - 1 : p;
    for (int64_t k = 0; k < p; ++k) {
      batch.masked_lm_positions.push_back(k < used ? static_cast<int32_t>(1 + k * (t - 4) / p) : 0);
      batch.masked_lm_ids.push_back(k < used ? static_cast<int32_t>(5 + rng.next_below(vocab - 5)) : 0);
    }
    batch.next_sentence_labels.push_back(static_cast<int8_t>(rng.next_below(2)));
  }
  return batch;
}

// Two layers of 64, a vocabulary of 200.
model::BertConfig small_config() {
  model::BertConfig config;
  config.vocab_size = 200;
  config.hidden_size = 64;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 2;
  config.intermediate_size = 128;
  config.max_position_embeddings = 64;
  return config;
}

// Which of the model's parameters take weight decay, in arena order (the optimizer's list).
std::vector<bool> decays_of(const model::Bert& model) {
  std::vector<bool> decays;
  for (ParamId id = 0; id < model.parameters().size(); ++id) decays.push_back(model.decays(id));
  return decays;
}

struct StepsRun {
  std::vector<double> losses;
  std::vector<float> weights;
  int64_t launches = 0, instantiations = 0;
};

// Ten pipelined steps of two micro-batches each, of the shapes below, with or without CUDA graphs.
StepsRun train_steps(Precision precision, bool graphs) {
  const std::unique_ptr<Device> gpu = Device::cuda(0, precision);
  model::BertConfig config = small_config();
  config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.1;
  model::Bert model(config);
  model.initialize(3);
  model.set_fused_attention(precision == Precision::kBf16);
  model.place_on(*gpu);
  Optimizer optimizer({}, model.parameters(), decays_of(model));
  Rng dropout(11);
  SingleProcess single;
  TrainOptions o;
  o.accumulation = 2;
  o.cuda_graphs = graphs;
  TrainingStep step(o, {model, optimizer, dropout, single});
  ProgressWindow window(config);
  Graph<float> g(*gpu);
  // (batch, length, predictions) of each step's two micro-batches: a shape that settles (steps 1-2 op by op,
  // 3-5 recorded: one graph, updated); a larger second micro-batch (step 6, op by op: memory grows); the
  // first shape again (step 7, op by op: it has to settle again); a new, smaller shape (8-9 op by op, 10
  // recorded: a new graph). Each batch drawn afresh, a few rows holding one prediction fewer (the number
  // of predictions, and so the MLM head's work, changes from step to step).
  const std::vector<std::array<std::array<int64_t, 3>, 2>> shapes = {
      {{{8, 32, 5}, {8, 32, 5}}}, {{{8, 32, 5}, {8, 32, 5}}},  {{{8, 32, 5}, {8, 32, 5}}}, {{{8, 32, 5}, {8, 32, 5}}},
      {{{8, 32, 5}, {8, 32, 5}}}, {{{8, 32, 5}, {16, 64, 9}}}, {{{8, 32, 5}, {8, 32, 5}}}, {{{6, 24, 4}, {6, 24, 4}}},
      {{{6, 24, 4}, {6, 24, 4}}}, {{{6, 24, 4}, {6, 24, 4}}}};
  StepsRun run;
  int64_t drawn = 0;
  auto take = [&] {
    const TrainingStep::Outcome outcome = step.finish(window);
    EXPECT_TRUE(outcome.updated) << outcome.nonfinite;
    run.losses.push_back(outcome.loss);
    window.reset();
  };
  for (const auto& micro : shapes) {
    int64_t m = 0;
    Batch batch;
    step.queue(
        g, batch,
        [&](Batch& b) {
          const auto [size, length, predictions] = micro[m++];
          b = random_batch(size, length, predictions, config.vocab_size, 100 + drawn, drawn % 3);
          ++drawn;
        },
        1e-3, window);
    if (step.queued() == 2) take();
  }
  while (step.queued() > 0) take();
  model.parameters().download_values();
  run.weights.assign(model.parameters().values().begin(), model.parameters().values().end());
  run.launches = step.graphs().launches();
  run.instantiations = step.graphs().instantiations();
  return run;
}

TEST(TrainingStepOnTheGpu, RecordedStepsRepeatStepsOpByOpBitForBit) {
  if (!Device::cuda_available())
    GTEST_SKIP() << "no CUDA GPU (or a CPU-only build): runs on a machine with an NVIDIA GPU";
  for (Precision precision : {Precision::kFp32, Precision::kBf16}) {
    SCOPED_TRACE(precision_name(precision));
    const StepsRun op_by_op = train_steps(precision, false);
    const StepsRun recorded = train_steps(precision, true);
    EXPECT_EQ(op_by_op.launches, 0);
    EXPECT_EQ(recorded.launches, 4) << "steps 3-5 and 10";
    EXPECT_EQ(recorded.instantiations, 2) << "steps 3 and 10 (steps 4 and 5 update step 3's graph)";
    ASSERT_EQ(recorded.losses.size(), 10u);
    EXPECT_EQ(recorded.losses, op_by_op.losses);
    EXPECT_EQ(recorded.weights, op_by_op.weights);
  }
}

// In BF16 the first step reads the weights' BF16 copy as every later step does (TrainingStep makes the copy
// current before a step where it is stale) instead of each GEMM rounding its weight into the step's workspace,
// which would then keep that memory for good: the first step of a run takes the workspace a later step of
// the same shape takes.
TEST(TrainingStepOnTheGpu, FirstBf16StepTakesTheWorkspaceOfLaterSteps) {
  if (!Device::cuda_available())
    GTEST_SKIP() << "no CUDA GPU (or a CPU-only build): runs on a machine with an NVIDIA GPU";
  const std::unique_ptr<Device> gpu = Device::cuda(0, Precision::kBf16);
  const model::BertConfig config = small_config();
  model::Bert model(config);
  model.initialize(3);
  model.place_on(*gpu);
  Optimizer optimizer({}, model.parameters(), decays_of(model));
  Rng dropout(11);
  SingleProcess single;
  TrainOptions o;
  o.cuda_graphs = false;
  TrainingStep step(o, {model, optimizer, dropout, single});
  ProgressWindow window(config);
  Batch batch = random_batch(8, 32, 5, config.vocab_size, 7);
  ASSERT_FALSE(model.parameters().bf16_copy_current());
  Graph<float> first(*gpu), later(*gpu);
  EXPECT_TRUE(step.run(
                      first, batch, [](Batch&) {}, 1e-3, window)
                  .updated);
  EXPECT_TRUE(model.parameters().bf16_copy_current());
  EXPECT_TRUE(step.run(
                      later, batch, [](Batch&) {}, 1e-3, window)
                  .updated);
  EXPECT_GT(later.workspace().peak_bytes_in_use(), 0u);
  EXPECT_EQ(first.workspace().peak_bytes_in_use(), later.workspace().peak_bytes_in_use());
}

// Steps whose forward keeps activations in the gradients of the layers it is past (model::Bert::
// set_lend_gradients, on by default for a step of one micro-batch) give the steps without it bit for bit, in
// less workspace: FP32 and BF16, with and without QAT (the quantizers' scales are parameters of the layers
// whose gradients are lent), padded rows and dropout, recorded as CUDA graphs from the third step.
TEST(TrainingStepOnTheGpu, LentGradientsGiveTheSameStepsInLessMemory) {
  if (!Device::cuda_available())
    GTEST_SKIP() << "no CUDA GPU (or a CPU-only build): runs on a machine with an NVIDIA GPU";
  for (Precision precision : {Precision::kFp32, Precision::kBf16})
    for (bool qat : {false, true}) {
      SCOPED_TRACE(std::string(precision_name(precision)) + (qat ? " QAT" : ""));
      StepsRun run[2];
      std::size_t workspace[2] = {0, 0};
      for (bool lend : {false, true}) {
        const std::unique_ptr<Device> gpu = Device::cuda(0, precision);
        model::BertConfig config = small_config();
        config.num_hidden_layers = 3;
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.1;
        model::Bert model(config);
        model.initialize(5);
        model.set_fused_attention(precision == Precision::kBf16);
        if (qat)
          for (model::Quantizer* q : model.quantizers()) {
            q->mode = model::QuantMode::kQuantize;
            model.parameters().get(q->scale).value.fill(q->is_weight ? 0.002f : 0.05f);
          }
        model.place_on(*gpu);
        Optimizer optimizer({}, model.parameters(), decays_of(model));
        Rng dropout(13);
        SingleProcess single;
        TrainOptions o;
        TrainingStep step(o, {model, optimizer, dropout, single});
        model.set_lend_gradients(lend);
        ProgressWindow window(config);
        Graph<float> g(*gpu);
        for (int i = 0; i < 6; ++i) {
          Batch batch;
          step.queue(
              g, batch, [&](Batch& b) { b = random_batch(8, 32, 5, config.vocab_size, 300 + i, i % 3); }, 1e-3,
              window);
          if (step.queued() == 2) run[lend].losses.push_back(step.finish(window).loss);
        }
        while (step.queued() > 0) run[lend].losses.push_back(step.finish(window).loss);
        model.parameters().download_values();
        run[lend].weights.assign(model.parameters().values().begin(), model.parameters().values().end());
        workspace[lend] = g.workspace().peak_bytes_in_use();
        EXPECT_EQ(step.graphs().launches(), 4) << "steps 3-6 recorded";
      }
      ASSERT_EQ(run[1].losses.size(), 6u);
      EXPECT_EQ(run[1].losses, run[0].losses);
      EXPECT_EQ(run[1].weights, run[0].weights);
      EXPECT_LT(workspace[1], workspace[0]);
    }
}

// What an evaluation batch read back: MLM loss and predictions, NSP loss and predictions.
struct BatchRead {
  float mlm_loss = 0, nsp_loss = 0;
  std::vector<int32_t> mlm, nsp;
  bool operator==(const BatchRead&) const = default;
};

struct EvaluationRun {
  std::vector<BatchRead> batches;
  int64_t launches = 0, instantiations = 0;
};

// Nine evaluation batches of the shapes below through a small model: with CUDA graphs and pipelined (each
// batch queued before the one before it is read back), or op by op one batch at a time; float,
// fake-quantized (every quantizer on) or INT8 (the quantized model's integer GEMMs and attention).
enum class Numerics { kFloat, kFakeQuant, kInt8 };
EvaluationRun evaluate_batches(Precision precision, Numerics numerics, bool graphs) {
  const std::unique_ptr<Device> gpu = Device::cuda(0, precision);
  model::BertConfig config = small_config();
  model::Bert model(config);
  model.initialize(3);
  model.set_fused_attention(precision == Precision::kBf16);
  if (numerics != Numerics::kFloat)
    for (model::Quantizer* q : model.quantizers()) {
      q->mode = model::QuantMode::kQuantize;
      model.parameters().get(q->scale).value.fill(q->is_weight ? 0.0005f : 0.02f);
    }
  model.place_on(*gpu);
  if (numerics == Numerics::kInt8) {
    EXPECT_GT(model.prepare_integer_inference(false), 0);
  }
  Graph<float> g(*gpu);
  eval::BatchEvaluator evaluator(model, g, graphs);
  // (batch, length, predictions): a shape that settles (batches 1-2 op by op, 3-4 recorded: one graph,
  // updated), a larger one (op by op), the first again (op by op twice, then recorded), a last, shorter batch.
  const std::vector<std::array<int64_t, 3>> shapes = {{8, 32, 5}, {8, 32, 5}, {8, 32, 5}, {8, 32, 5}, {16, 64, 9},
                                                      {8, 32, 5}, {8, 32, 5}, {8, 32, 5}, {3, 32, 5}};
  EvaluationRun run;
  auto take = [&](const eval::OutputReads& r) {
    BatchRead read;
    read.mlm_loss = *r.mlm_loss, read.nsp_loss = *r.nsp_loss;
    read.mlm.assign(r.mlm_predicted, r.mlm_predicted + r.mlm_targets.size());
    read.nsp = r.head_predictions();
    EXPECT_EQ(read.nsp.size(), r.nsp_labels.size());
    run.batches.push_back(read);
  };
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto [size, length, predictions] = shapes[i];
    const Batch batch = random_batch(size, length, predictions, config.vocab_size, 200 + i, i % 3);
    if (!graphs) {
      take(evaluator.run(batch.view()));
    } else if (const eval::OutputReads* r = evaluator.queue(batch.view())) {
      take(*r);
    }
  }
  if (const eval::OutputReads* r = evaluator.finish()) take(*r);
  run.launches = evaluator.graphs().launches();
  run.instantiations = evaluator.graphs().instantiations();
  return run;
}

TEST(BatchEvaluatorOnTheGpu, RecordedPipelinedBatchesReadWhatBatchesOpByOpRead) {
  if (!Device::cuda_available())
    GTEST_SKIP() << "no CUDA GPU (or a CPU-only build): runs on a machine with an NVIDIA GPU";
  for (Precision precision : {Precision::kFp32, Precision::kBf16})
    for (Numerics numerics : {Numerics::kFloat, Numerics::kFakeQuant, Numerics::kInt8}) {
      SCOPED_TRACE(std::string(precision_name(precision)) + ", numerics " + std::to_string(int(numerics)));
      const EvaluationRun op_by_op = evaluate_batches(precision, numerics, false);
      const EvaluationRun recorded = evaluate_batches(precision, numerics, true);
      EXPECT_EQ(op_by_op.launches, 0);
      EXPECT_EQ(recorded.launches, 3) << "batches 3, 4 and 8";
      EXPECT_EQ(recorded.instantiations, 2) << "batches 3 and 8 (batch 4 updates batch 3's graph)";
      ASSERT_EQ(recorded.batches.size(), 9u);
      EXPECT_TRUE(recorded.batches == op_by_op.batches);
      for (size_t i = 0; i < recorded.batches.size(); ++i) {
        EXPECT_EQ(recorded.batches[i].mlm_loss, op_by_op.batches[i].mlm_loss) << "batch " << i;
        EXPECT_EQ(recorded.batches[i].mlm, op_by_op.batches[i].mlm) << "batch " << i;
      }
    }
}

}  // namespace
}  // namespace bert::train
