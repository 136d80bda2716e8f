// bert-smoke: a self-contained check that the core autograd trains a transformer block. It learns a
// synthetic task that needs attention (predict each position's previous token), reports loss and
// throughput, and exits non-zero if the model did not learn. The README's main command runs it until
// the full pipeline (data -> train -> quantize -> export) replaces it.
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cmath>
#include <vector>

#include "core/arena.h"
#include "core/graph.h"
#include "core/ops.h"
#include "core/parallel.h"
#include "train/optimizer.h"

namespace {

using namespace bert;

struct Options {
  int steps = 300;
  int batch = 32;
  int seq = 16;
  int vocab = 24;
  int hidden = 64;
  double lr = 3e-3;
  uint64_t seed = 1;
  int threads = 0;
};

// One post-LayerNorm encoder block (single head) with token and position embeddings and an output
// projection: the shapes and ops BERT uses, at toy size.
struct Block {
  ParameterArena<float> arena;
  ParamId tok, pos, qkv_w, qkv_b, out_w, out_b, ln1_g, ln1_b, ff1_w, ff1_b, ff2_w, ff2_b, ln2_g, ln2_b, head_w, head_b;
  int seq, hidden;

  Block(const Options& o, Rng& rng) : seq(o.seq), hidden(o.hidden) {
    const int64_t h = o.hidden;
    tok = arena.add("embeddings.word", {o.vocab, h});
    pos = arena.add("embeddings.position", {o.seq, h});
    qkv_w = arena.add("attention.qkv.weight", {3 * h, h});
    qkv_b = arena.add("attention.qkv.bias", {3 * h});
    out_w = arena.add("attention.output.weight", {h, h});
    out_b = arena.add("attention.output.bias", {h});
    ln1_g = arena.add("attention.LayerNorm.weight", {h});
    ln1_b = arena.add("attention.LayerNorm.bias", {h});
    ff1_w = arena.add("intermediate.weight", {4 * h, h});
    ff1_b = arena.add("intermediate.bias", {4 * h});
    ff2_w = arena.add("output.weight", {h, 4 * h});
    ff2_b = arena.add("output.bias", {h});
    ln2_g = arena.add("output.LayerNorm.weight", {h});
    ln2_b = arena.add("output.LayerNorm.bias", {h});
    head_w = arena.add("head.weight", {o.vocab, h});
    head_b = arena.add("head.bias", {o.vocab});
    arena.allocate();
    for (ParamId id = 0; id < arena.size(); ++id) {
      Parameter<float> p = arena.get(id);
      const bool is_gain = p.name->ends_with("LayerNorm.weight");
      for (float& v : p.value) v = is_gain ? 1.0f : (p.name->ends_with("bias") ? 0.0f : 0.02f * rng.next_normal());
    }
  }

  // ids (B, T) -> mean cross-entropy of predicting targets (B, T) (-1: ignored).
  Var loss(Graph<float>& g, const std::vector<int32_t>& ids, const std::vector<int32_t>& targets, int batch) {
    const int64_t b = batch, t = seq, h = hidden;
    auto p = [&](ParamId id) { return g.param(arena.get(id)); };
    Var x = ops::add(g, ops::gather_rows(g, p(tok), ids, Shape{b, t}), p(pos));  // (B, T, H)
    Var qkv = ops::reshape(g, ops::linear(g, x, p(qkv_w), p(qkv_b)), Shape{b * t, 3 * h});
    // Split the packed projection into Q, K, V: (B*T, 3, H) -> (3, B*T, H), then rows 0/1/2.
    Var parts = ops::reshape(g, ops::permute(g, ops::reshape(g, qkv, Shape{b * t, 3, h}), {1, 0, 2}), Shape{3, b * t * h});
    auto part = [&](int32_t i) {
      std::vector<int32_t> row{i};
      return ops::reshape(g, ops::gather_rows(g, parts, row, Shape{}), Shape{b, t, h});
    };
    Var scores = ops::scale(g, ops::matmul(g, part(0), part(1), false, true), 1.0 / std::sqrt(double(h)));
    Var context = ops::matmul(g, ops::softmax(g, scores), part(2));  // (B, T, H)
    Var attn = ops::layer_norm(g, ops::add(g, ops::linear(g, context, p(out_w), p(out_b)), x), p(ln1_g), p(ln1_b));
    Var ff = ops::linear(g, ops::gelu(g, ops::linear(g, attn, p(ff1_w), p(ff1_b))), p(ff2_w), p(ff2_b));
    Var y = ops::layer_norm(g, ops::add(g, ff, attn), p(ln2_g), p(ln2_b));
    Var logits = ops::reshape(g, ops::linear(g, y, p(head_w), p(head_b)), Shape{b * t, g.shape(p(head_b))[0]});
    return ops::cross_entropy<float>(g, logits, targets);
  }
};

int run(const Options& o) {
  if (o.threads > 0) omp_set_num_threads(o.threads);
  Rng rng(o.seed);
  Block model(o, rng);
  train::OptimizerOptions adam;
  adam.weight_decay = 0;
  adam.epsilon = 1e-8;
  train::Optimizer optimizer(adam, model.arena, std::vector<bool>(model.arena.size(), false));
  Graph<float> g;
  spdlog::info("bert-smoke: 1 encoder block, hidden {}, seq {}, vocab {}, batch {}, {} parameters, {} threads",
               o.hidden, o.seq, o.vocab, o.batch, model.arena.num_elements(), num_threads());
  std::vector<int32_t> ids(o.batch * o.seq), targets(o.batch * o.seq);
  double first_loss = 0, recent = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int step = 1; step <= o.steps; ++step) {
    for (int b = 0; b < o.batch; ++b)
      for (int t = 0; t < o.seq; ++t) {
        ids[b * o.seq + t] = static_cast<int32_t>(rng.next_below(o.vocab));
        targets[b * o.seq + t] = t == 0 ? -1 : ids[b * o.seq + t - 1];
      }
    Var loss = model.loss(g, ids, targets, o.batch);
    const double value = g.value(loss)[0];
    if (!std::isfinite(value)) {
      spdlog::error("loss is {} at step {}", value, step);
      return 1;
    }
    g.backward(loss);
    optimizer.step(o.lr);
    model.arena.zero_grad();
    if (step == 1) first_loss = value;
    recent = step == 1 ? value : 0.9 * recent + 0.1 * value;
    if (step % 50 == 0 || step == o.steps) {
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      spdlog::info("step {:4d}/{}  loss {:.4f}  seq/s {:.0f}", step, o.steps, recent, step * o.batch / secs);
    }
  }
  const double chance = std::log(static_cast<double>(o.vocab));
  spdlog::info("loss {:.4f} -> {:.4f} (chance level ln({}) = {:.4f})", first_loss, recent, o.vocab, chance);
  if (recent > 0.5 * chance) {
    spdlog::error("the model did not learn: final loss {:.4f} is above half the chance level", recent);
    return 1;
  }
  spdlog::info("ok: the block learned to attend to the previous token");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"bert-smoke: train one transformer block on a synthetic attention task through the core "
               "autograd, and fail unless it learns"};
  app.add_option("--steps", o.steps, "training steps")->check(CLI::Range(1, 1000000))->capture_default_str();
  app.add_option("--batch", o.batch, "sequences per step")->check(CLI::Range(1, 1000000))->capture_default_str();
  app.add_option("--seq", o.seq, "sequence length")->check(CLI::Range(2, 512))->capture_default_str();
  app.add_option("--hidden", o.hidden, "hidden size")->check(CLI::Range(4, 4096))->capture_default_str();
  app.add_option("--lr", o.lr, "Adam learning rate")->check(CLI::Range(1e-6, 1.0))->capture_default_str();
  app.add_option("--seed", o.seed, "random seed")->capture_default_str();
  app.add_option("--threads", o.threads, "threads (0: all cores)")->check(CLI::Range(0, 1024));
  CLI11_PARSE(app, argc, argv);
  try {
    return run(o);
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    return 1;
  }
}
