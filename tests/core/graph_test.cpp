// The autograd graph's lifetime and modes: freed after backward, no-grad records nothing, leaf
// gradients accumulate, stale handles are caught, memory is reused across steps.
#include <gtest/gtest.h>

#include <omp.h>

#include <array>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "core/arena.h"
#include "core/graph.h"
#include "core/op_profile.h"
#include "core/readback.h"
#include "core/step_graph.h"
#include "ops/ops.h"
#include "tests/ops/gradcheck.h"

namespace bert {
namespace {

// A small model step: loss = mean(gelu(x W^T + b)) over a parameter arena.
struct TinyModel {
  ParameterArena<float> arena;
  ParamId weight = arena.add("dense.weight", {4, 3});
  ParamId bias = arena.add("dense.bias", {4});
  TinyModel() {
    arena.allocate();
    Rng rng(1);
    for (float& v : arena.values()) v = static_cast<float>(rng.next_normal());
  }
  Var loss(Graph<float>& g, TensorView<float> x) {
    Var y = ops::linear(g, g.constant(x), g.param(arena.get(weight)), g.param(arena.get(bias)));
    return ops::mean(g, ops::gelu(g, y));
  }
};

TEST(Graph, IsFreedAfterBackward) {
  TinyModel model;
  Tensor<float> x = testing::to_float(testing::random_tensor({5, 3}, 2));
  Graph<float> g;
  Var loss = model.loss(g, x.view());
  EXPECT_GT(g.num_nodes(), 0u);
  EXPECT_GT(g.num_backward_closures(), 0u);
  EXPECT_GT(g.workspace().bytes_in_use(), 0u);
  g.backward(loss);
  EXPECT_EQ(g.num_nodes(), 0u);
  EXPECT_EQ(g.num_backward_closures(), 0u);
  EXPECT_EQ(g.workspace().bytes_in_use(), 0u);
  EXPECT_THROW(g.value(loss), InternalError) << "a handle from before backward() is stale";
}

// A node made by emit_transient keeps its value in a transient slot, not the workspace: readable (its views
// too) until the slot is taken again, then refused by name; its gradient is an ordinary one.
TEST(Graph, TransientNodeIsReadableUntilItsSlotIsTakenAgain) {
  Graph<float> g;
  const std::vector<float> host = {1, 2, 3, 4, 5, 6};
  Tensor<float> x_value(Shape{2, 3}, host), grad(Shape{2, 3});
  const Var x = g.leaf(x_value.view(), grad.view());
  const std::size_t before = g.workspace().bytes_in_use();
  const Var t = g.emit_transient(Shape{2, 3}, {x}, DType::kF32, 1);  // t = x, as an op would make it
  EXPECT_EQ(g.workspace().bytes_in_use(), before) << "the value is not in the workspace";
  std::copy(host.begin(), host.end(), g.value(t).data());
  g.on_backward(t, [x, t](Graph<float>& g) {
    const TensorView<float> dt = g.grad(t), dx = g.grad(x);
    for (int64_t i = 0; i < dt.numel(); ++i) dx[i] += dt[i];
  });
  const Var view = ops::reshape(g, t, Shape{3, 2});
  EXPECT_EQ(g.to_host(view), host);
  const Var y = ops::scale(g, t, 2.0);  // reads t: the op made next
  (void)g.transient<float>(0, 6);       // another slot: t stays readable
  EXPECT_EQ(g.to_host(t), host);
  (void)g.transient<float>(1, 6);  // its slot taken again
  EXPECT_THROW(g.value(t), InternalError);
  EXPECT_THROW(g.data(t), InternalError);
  EXPECT_THROW(g.to_host(view), InternalError);
  g.backward(ops::sum(g, y));  // its gradient: 2 each
  for (float v : grad.view()) EXPECT_EQ(v, 2.0f);
}

// Graph::bias_to_sum hands a linear's bias to the reader of its output only where that reader is the only
// one: nothing else made from the output, no view of it, and the bias takes a gradient.
TEST(Graph, BiasToSumGoesToTheOutputsOnlyReader) {
  TinyModel model;
  Graph<float> g;
  Tensor<float> x = testing::to_float(testing::random_tensor({5, 3}, 2));
  const Var bias = g.param(model.arena.get(model.bias));
  auto linear = [&] {
    const Var y = ops::linear(g, g.constant(x.view()), g.param(model.arena.get(model.weight)), bias);
    g.set_bias_of(y, bias);
    return y;
  };
  const Var alone = linear();
  EXPECT_FALSE(g.bias_to_sum(alone).valid()) << "no reader yet";
  ops::gelu(g, alone);
  EXPECT_EQ(g.bias_to_sum(alone).index, bias.index);
  EXPECT_FALSE(g.bias_summed(alone));
  g.set_bias_summed(alone);
  EXPECT_TRUE(g.bias_summed(alone));
  const Var shared = linear();
  ops::gelu(g, shared);
  ops::tanh(g, shared);
  EXPECT_FALSE(g.bias_to_sum(shared).valid()) << "two readers";
  const Var viewed = linear();
  ops::gelu(g, viewed);
  const Var view = ops::reshape(g, viewed, Shape{20});
  EXPECT_FALSE(g.bias_to_sum(viewed).valid()) << "a view writes its gradient too";
  EXPECT_FALSE(g.bias_to_sum(view).valid()) << "the view is no linear's output";
  const Var fixed = ops::linear(g, g.constant(x.view()), g.param(model.arena.get(model.weight)),
                                g.constant(model.arena.get(model.bias).value));
  g.set_bias_of(fixed, g.constant(model.arena.get(model.bias).value));
  ops::gelu(g, fixed);
  EXPECT_FALSE(g.bias_to_sum(fixed).valid()) << "a bias without a gradient";
}

TEST(Graph, NoGradModeRecordsNothingAndRestoresTheMode) {
  TinyModel model;
  Tensor<float> x = testing::to_float(testing::random_tensor({5, 3}, 2));
  Graph<float> g;
  float eval_loss = 0;
  {
    NoGradGuard<float> no_grad(g);
    Var loss = model.loss(g, x.view());
    EXPECT_EQ(g.num_backward_closures(), 0u);
    EXPECT_FALSE(g.requires_grad(loss));
    EXPECT_THROW(g.backward(loss), InternalError);  // nothing to differentiate
    eval_loss = g.value(model.loss(g, x.view()))[0];
  }
  EXPECT_TRUE(g.grad_enabled());
  for (float v : model.arena.grads()) EXPECT_EQ(v, 0.0f);
  Var loss = model.loss(g, x.view());
  EXPECT_EQ(g.value(loss)[0], eval_loss) << "no-grad changes bookkeeping, not values";
  EXPECT_GT(g.num_backward_closures(), 0u);
}

TEST(Graph, LeafGradientsAccumulateAcrossBackwardCalls) {
  TinyModel model;
  Tensor<float> x = testing::to_float(testing::random_tensor({5, 3}, 2));
  Graph<float> g;
  g.backward(model.loss(g, x.view()));
  std::vector<float> once(model.arena.grads().begin(), model.arena.grads().end());
  g.backward(model.loss(g, x.view()));
  auto grads = model.arena.grads();
  bool any_nonzero = false;
  for (int64_t i = 0; i < grads.numel(); ++i) {
    EXPECT_FLOAT_EQ(grads[i], 2 * once[i]);
    any_nonzero |= once[i] != 0.0f;
  }
  EXPECT_TRUE(any_nonzero);
  model.arena.zero_grad();
  for (float v : model.arena.grads()) EXPECT_EQ(v, 0.0f);
}

TEST(Graph, BackwardNeedsAScalarAndConstantsHaveNoGradient) {
  Graph<double> g;
  Tensor<double> x = testing::random_tensor({2, 2}, 3), gx({2, 2});
  Var leaf = g.leaf(x.view(), gx.view());
  Var c = g.constant(x.view());
  Var y = ops::add(g, leaf, c);
  EXPECT_THROW(g.grad(c), InternalError);
  EXPECT_THROW(g.backward(y), InternalError);  // (2, 2) is not a scalar
}

TEST(Graph, SteadyStateStepsDoNotAllocate) {
  TinyModel model;
  Tensor<float> x = testing::to_float(testing::random_tensor({64, 3}, 4));
  Graph<float> g;
  for (int step = 0; step < 2; ++step) g.backward(model.loss(g, x.view()));
  const std::size_t allocations = g.workspace().system_allocations();
  const std::size_t closure_allocations = g.closure_memory().system_allocations();
  for (int step = 0; step < 3; ++step) g.backward(model.loss(g, x.view()));
  EXPECT_EQ(g.workspace().system_allocations(), allocations);
  EXPECT_EQ(g.closure_memory().system_allocations(), closure_allocations);
  EXPECT_GT(closure_allocations, 0u);  // the closures did live there
}

// Once a node's backward closure has run, its gradient buffer goes to the next gradient of the same size:
// a chain of same-shape ops needs a few gradient buffers, not one per node, and gives the same gradient.
TEST(Graph, GradientBuffersAreReusedOnceTheirClosureRan) {
  Tensor<float> x = testing::to_float(testing::random_tensor({256, 64}, 5));
  Tensor<float> gx_reuse({256, 64}), gx_plain({256, 64});
  std::size_t capacity[2] = {0, 0};
  for (bool reuse : {true, false}) {
    Graph<float> g;
    g.set_reuse_gradients(reuse);
    for (int step = 0; step < 2; ++step) {  // the second step runs in the block the first one measured
      Tensor<float>& gx = reuse ? gx_reuse : gx_plain;
      gx.view().fill(0.0f);
      Var v = g.leaf(x.view(), gx.view());
      for (int i = 0; i < 12; ++i) v = ops::gelu(g, ops::scale(g, v, 0.9));
      g.backward(ops::mean(g, v));
    }
    capacity[reuse ? 0 : 1] = g.workspace().capacity();
  }
  EXPECT_EQ(std::vector<float>(gx_reuse.view().begin(), gx_reuse.view().end()),
            std::vector<float>(gx_plain.view().begin(), gx_plain.view().end()));
  // 24 activations either way; 24 gradients without reuse, a handful with it.
  const std::size_t one = 256 * 64 * sizeof(float);
  EXPECT_LT(capacity[0] + 12 * one, capacity[1]) << capacity[0] << " vs " << capacity[1];
}

// Graph::lend: once the forward is past a "layer", its parameters' gradient memory holds the activations
// made after it; the backward fills it with zeros again before the layer's own closures accumulate there.
// The gradients are bit for bit those of the step without lending, the layer above lives in the lent
// memory, the workspace holds less, and an op that takes a lent parameter later is refused.
TEST(Graph, LentGradientMemoryHoldsLaterActivationsAndGivesTheSameGradients) {
  ParameterArena<float> arena;
  const ParamId w1 = arena.add("layer.0.weight", {64, 16}), b1 = arena.add("layer.0.bias", {64});
  const ParamId w2 = arena.add("layer.1.weight", {16, 64}), b2 = arena.add("layer.1.bias", {16});
  arena.allocate();
  Rng rng(11);
  for (float& v : arena.values()) v = static_cast<float>(rng.next_normal() * 0.3);
  Tensor<float> x = testing::to_float(testing::random_tensor({8, 16}, 12));
  auto lent_range = [&] {  // layer 0's gradients (its two parameters, padding included)
    const TensorView<float> grads = arena.grads();
    return std::pair(grads.data() + arena.offset(w1), grads.data() + arena.offset(w2));
  };
  std::vector<float> grads[2];
  std::size_t workspace[2] = {0, 0};
  for (bool lend : {false, true}) {
    Graph<float> g;
    for (int step = 0; step < 2; ++step) {  // the second step runs in the block the first one measured
      arena.zero_grad();
      Var h = ops::gelu(g, ops::linear(g, g.constant(x.view()), g.param(arena.get(w1)), g.param(arena.get(b1))));
      const auto [begin, end] = lent_range();
      if (lend) g.lend(begin, static_cast<std::size_t>(end - begin) * sizeof(float));
      Var y = ops::gelu(g, ops::linear(g, h, g.param(arena.get(w2)), g.param(arena.get(b2))));
      if (lend) {
        const auto* in = static_cast<const float*>(g.data(y));
        EXPECT_TRUE(in >= begin && in < end) << "the layer above lives in the lent gradients";
        EXPECT_GT(g.lent_bytes_in_use(), 0u);
      }
      workspace[lend] = std::max(workspace[lend], g.workspace().bytes_in_use());
      g.backward(ops::mean(g, ops::scale(g, y, 1.5)));
    }
    grads[lend].assign(arena.grads().begin(), arena.grads().end());
  }
  EXPECT_EQ(grads[0], grads[1]);
  EXPECT_LT(workspace[1], workspace[0]);

  // A forward with no backward gives the memory back zero-filled at clear().
  arena.zero_grad();
  {
    Graph<float> g;
    const auto [begin, end] = lent_range();
    g.lend(begin, static_cast<std::size_t>(end - begin) * sizeof(float));
    const Var y = ops::gelu(g, ops::scale(g, g.constant(x.view()), 2.0));
    const auto* in = static_cast<const float*>(g.data(y));
    ASSERT_TRUE(in >= begin && in < end);
    g.clear();
    for (const float* p = begin; p < end; ++p) ASSERT_EQ(*p, 0.0f);
  }
  // Taking a lent parameter after the lend is refused.
  Graph<float> g;
  const auto [begin, end] = lent_range();
  g.lend(begin, static_cast<std::size_t>(end - begin) * sizeof(float));
  try {
    ops::linear(g, g.constant(x.view()), g.param(arena.get(w1)), g.param(arena.get(b1)));
    ADD_FAILURE() << "a lent parameter was taken";
  } catch (const InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("lent"), std::string::npos) << e.what();
  }
}

// A closure that reads the gradient of a node whose own closure already ran (its buffer may hold another
// gradient by then) is refused.
TEST(Graph, AGradientReadAfterItsClosureRanIsRefused) {
  Tensor<float> x = testing::to_float(testing::random_tensor({4}, 6)), gx({4});
  Graph<float> g;
  Var leaf = g.leaf(x.view(), gx.view());
  auto later = std::make_shared<Var>();  // b, made after a: a's closure runs after b's
  Var a = g.emit(Shape{4}, {leaf});
  g.value(a).fill(1.0f);
  g.on_backward(a, [leaf, later](Graph<float>& graph) {
    TensorView<float> wrong = graph.grad(*later);
    TensorView<float> dleaf = graph.grad(leaf);
    for (int64_t i = 0; i < 4; ++i) dleaf[i] += wrong[i];
  });
  Var b = ops::scale(g, a, 2.0);
  *later = b;
  try {
    g.backward(ops::mean(g, b));
    ADD_FAILURE() << "the late read was not refused";
  } catch (const InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("after its own backward closure ran"), std::string::npos) << e.what();
  }
}

// The CPU, and the first GPU where there is one.
struct DevicesHere {
  std::unique_ptr<Device> gpu = Device::cuda_available() ? Device::cuda(0) : nullptr;
  std::vector<const Device*> devices =
      gpu ? std::vector<const Device*>{&Device::cpu(), gpu.get()} : std::vector<const Device*>{&Device::cpu()};
};

// Readback: values are those at the point the read was queued (later work on the same memory does not
// reach them), reads beyond the pinned memory still arrive, a second round reuses the memory, and reads
// queued after seal() arrive too.
TEST(Readback, GivesTheValuesAsQueuedOnTheCpuAndOnAGpu) {
  const DevicesHere here;
  for (const Device* device : here.devices) {
    SCOPED_TRACE(device->name());
    const int64_t n = 40000;  // 160 KB: more than the first round's pinned memory
    std::vector<float> first(n), second(n, -1.0f);
    for (int64_t i = 0; i < n; ++i) first[i] = static_cast<float>(i) * 0.5f;
    DeviceBuffer buffer(*device, n * sizeof(float));
    Readback reads(*device);
    for (int round = 0; round < 2; ++round) {
      device->copy_to_device(buffer.data(), first.data(), n * sizeof(float));
      const float* one = reads.read<float>(buffer.as<float>() + 7, 1);
      const float* many = reads.read<float>(buffer.data(), n);
      device->copy_to_device(buffer.data(), second.data(), n * sizeof(float));  // queued after the reads
      reads.wait();
      EXPECT_TRUE(reads.waited());
      EXPECT_EQ(*one, 3.5f) << "round " << round;
      EXPECT_EQ(std::vector<float>(many, many + n), first) << "round " << round;
      reads.clear();
    }
    EXPECT_NO_THROW(reads.wait()) << "nothing queued: returns at once";
    // Sealed (a training step's reads, with the next step queued after them), and a read after the seal:
    // wait() brings both.
    device->copy_to_device(buffer.data(), first.data(), n * sizeof(float));
    const float* before = reads.read<float>(buffer.as<float>() + 9, 1);
    reads.seal();
    device->copy_to_device(buffer.data(), second.data(), n * sizeof(float));
    const float* after = reads.read<float>(buffer.as<float>() + 9, 1);
    device->copy_to_device(buffer.data(), first.data(), n * sizeof(float));
    reads.seal();
    reads.wait();
    EXPECT_EQ(*before, 4.5f);
    EXPECT_EQ(*after, -1.0f);
    reads.clear();
  }
}

// StepGraph: work recorded from a GPU's stream runs when the recording is launched, memory allocated and
// freed while recording included (the copies through the pinned upload ring and the read-back too); a
// second recording with the same key and no memory moved since updates the graph in place, one with another
// key makes a new graph; an abandoned recording runs nothing and leaves the stream as it was. On the CPU
// nothing is recorded: the work runs as it is queued.
TEST(StepGraph, RunsTheRecordedWorkWhenLaunchedAndUpdatesItForTheSameKey) {
  const DevicesHere here;
  for (const Device* device : here.devices) {
    SCOPED_TRACE(device->name());
    const int64_t n = 3000;
    DeviceBuffer out(*device, n * sizeof(float)), kept(*device, n * sizeof(float));
    device->fill_zero(out.data(), n * sizeof(float));
    Readback reads(*device);
    StepGraph steps;
    // One step: `size` copies of `value` uploaded into a buffer (made while recording, or `kept`), copied
    // into `out`, and `out` read back.
    auto step = [&](float value, int64_t size, bool make_memory) {
      steps.record(*device);
      EXPECT_EQ(steps.recording(), device->is_cuda());
      const std::vector<float> host(static_cast<size_t>(size), value);
      DeviceBuffer made;
      if (make_memory) made = DeviceBuffer(*device, size * sizeof(float));
      void* staging = make_memory ? made.data() : kept.data();
      device->copy_to_device(staging, host.data(), size * sizeof(float));
      device->copy_on_device(out.data(), staging, size * sizeof(float));
      made.reset();  // freed while recording: released after the graph has run
      const float* back = reads.read<float>(out.data(), n);
      steps.launch({size});
      reads.wait();
      std::vector<float> values(back, back + n);
      reads.clear();
      return values;
    };
    const int64_t graphs = device->is_cuda() ? 1 : 0;
    EXPECT_EQ(step(1.0f, n, true), std::vector<float>(n, 1.0f));
    EXPECT_EQ(steps.instantiations(), graphs);
    EXPECT_EQ(step(2.0f, n, false), std::vector<float>(n, 2.0f)) << "the same key, no memory moved: updated";
    EXPECT_EQ(steps.instantiations(), graphs);
    std::vector<float> expected(n, 2.0f);
    std::fill(expected.begin(), expected.begin() + n / 2, 3.0f);
    EXPECT_EQ(step(3.0f, n / 2, false), expected) << "another key: a graph of its own";
    EXPECT_EQ(steps.instantiations(), 2 * graphs);
    EXPECT_EQ(steps.launches(), 3 * graphs);
    // Abandoned: nothing of it runs, and the stream goes on.
    steps.record(*device);
    const std::vector<float> nines(n, 9.0f);
    device->copy_to_device(kept.data(), nines.data(), n * sizeof(float));
    if (device->is_cuda()) device->copy_on_device(out.data(), kept.data(), n * sizeof(float));
    steps.abandon();
    EXPECT_FALSE(steps.recording());
    std::vector<float> now(n);
    device->copy_to_host(now.data(), out.data(), n * sizeof(float));
    EXPECT_EQ(now, expected);
    EXPECT_EQ(steps.launches(), 3 * graphs);
  }
}

// Backward closures live in the graph's closure memory: whatever they capture is destroyed exactly once,
// when the graph is cleared (after backward, by clear(), or with the graph), and captures larger than
// a pointer or two survive intact until their closure runs.
TEST(Graph, BackwardClosuresKeepTheirCapturesUntilClearedAndDestroyThemOnce) {
  auto alive = std::make_shared<int>(0);
  std::array<double, 64> big;
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<double>(i);
  Tensor<float> xv({2}), gx({2});
  xv.view().fill(1.0f);
  double seen = 0;
  {
    Graph<float> g;
    for (int round = 0; round < 3; ++round) {
      Var x = g.leaf(xv.view(), gx.view());
      Var y = g.emit(Shape{1}, {x});
      g.on_backward(y, [alive, big, x, &seen](Graph<float>& graph) {
        seen += big[63];
        for (float& v : graph.grad(x)) v += 1.0f;
      });
      EXPECT_EQ(alive.use_count(), 2);
      if (round == 0) {
        g.backward(y);  // runs the closure, then clears
      } else if (round == 1) {
        g.clear();  // never run: destroyed all the same
      } else {
        break;  // destroyed with the graph
      }
      EXPECT_EQ(alive.use_count(), 1);
    }
  }
  EXPECT_EQ(alive.use_count(), 1);
  EXPECT_EQ(seen, 63.0);
  EXPECT_EQ(gx.view()[0], 1.0f);
}

// Gradients of a small chain over the arena, computed with a given number of threads.
std::vector<float> chain_gradients(int threads, bool with_gemm) {
  omp_set_num_threads(threads);
  ParameterArena<float> arena;
  ParamId w = arena.add("w", {256, 128}), gamma = arena.add("g", {256}), beta = arena.add("b", {256});
  arena.allocate();
  Rng init(5);
  for (float& v : arena.values()) v = static_cast<float>(0.1 * init.next_normal());
  Tensor<float> x = testing::to_float(testing::random_tensor({512, 256}, 6));
  Graph<float> g;
  Rng dropout_rng(8);
  Var h = g.constant(x.view());
  if (with_gemm) h = ops::linear(g, g.constant(x.view().reshaped({1024, 128})), g.param(arena.get(w)), Var{});
  h = ops::layer_norm(g, ops::gelu(g, h), g.param(arena.get(gamma)), g.param(arena.get(beta)));
  h = ops::dropout(g, ops::softmax(g, h), 0.1, true, dropout_rng);
  g.backward(ops::sum(g, ops::mul(g, h, h)));
  return std::vector<float>(arena.grads().begin(), arena.grads().end());
}

// Our own kernels split work so that each output is computed by one thread in a fixed order:
// results are bit-identical whatever the thread count.
TEST(Threads, OwnKernelsGiveIdenticalResultsOnOneAndTwoThreads) {
  const int saved = omp_get_max_threads();
  std::vector<float> one = chain_gradients(1, false), two = chain_gradients(2, false);
  omp_set_num_threads(saved);
  EXPECT_EQ(one, two);
}

// The GEMM splits its work (blocks of C, parts of k: hence summation order) by thread count: runs are
// bit-identical at a fixed thread count and agree to float rounding across thread counts.
TEST(Threads, GemmChainIsReproducibleAndCloseAcrossThreadCounts) {
  const int saved = omp_get_max_threads();
  std::vector<float> two_a = chain_gradients(2, true), two_b = chain_gradients(2, true);
  std::vector<float> one = chain_gradients(1, true);
  omp_set_num_threads(saved);
  EXPECT_EQ(two_a, two_b);
  ASSERT_EQ(one.size(), two_a.size());
  float max_abs = 0;
  for (float v : one) max_abs = std::max(max_abs, std::abs(v));
  for (size_t i = 0; i < one.size(); ++i) EXPECT_NEAR(one[i], two_a[i], 1e-4f * max_abs) << i;
}

// Broadcast add and mul (a stretched over leading axes, one over the last axis) and the embedding
// gather with repeated ids, at sizes where their loops are split over threads: the value and every
// gradient of loss = sum(((a + b) * c) * w) + sum(gather(table, ids) * v), with `threads` threads.
struct SplitOps {
  std::vector<float> values, grads;
  std::vector<float> a, b, c, table, w, v;
  std::vector<int32_t> ids;
};
constexpr int64_t kI = 32, kJ = 64, kK = 96, kRows = 50, kCols = 40, kIds = 4096;

SplitOps split_ops(int threads) {
  omp_set_num_threads(threads);
  SplitOps r;
  ParameterArena<float> arena;
  ParamId a = arena.add("a", {kI, kJ, kK}), b = arena.add("b", {kJ, kK}), c = arena.add("c", {kI, kJ, 1}),
          table = arena.add("table", {kRows, kCols});
  arena.allocate();
  Rng init(11);
  for (float& x : arena.values()) x = static_cast<float>(init.next_normal());
  r.values.assign(arena.values().begin(), arena.values().end());
  auto copy = [](TensorView<float> t) { return std::vector<float>(t.begin(), t.end()); };
  r.a = copy(arena.get(a).value), r.b = copy(arena.get(b).value), r.c = copy(arena.get(c).value);
  r.table = copy(arena.get(table).value);
  Tensor<float> w = testing::to_float(testing::random_tensor({kI, kJ, kK}, 12));
  Tensor<float> v = testing::to_float(testing::random_tensor({kIds, kCols}, 13));
  r.w = copy(w.view()), r.v = copy(v.view());
  for (int64_t i = 0; i < kIds; ++i) r.ids.push_back(static_cast<int32_t>((i * 7919) % kRows));
  Graph<float> g;
  Var y = ops::mul(g, ops::add(g, g.param(arena.get(a)), g.param(arena.get(b))), g.param(arena.get(c)));
  Var e = ops::gather_rows(g, g.param(arena.get(table)), r.ids, Shape{kIds});
  g.backward(ops::add(g, ops::sum(g, ops::mul(g, y, g.constant(w.view()))),
                      ops::sum(g, ops::mul(g, e, g.constant(v.view())))));
  r.grads.assign(arena.grads().begin(), arena.grads().end());
  return r;
}

TEST(Threads, BroadcastAndGatherGradientsAreExactAndIndependentOfThreadCount) {
  const int saved = omp_get_max_threads();
  const SplitOps one = split_ops(1), four = split_ops(4);
  omp_set_num_threads(saved);
  EXPECT_EQ(one.grads, four.grads);  // each gradient element summed by one thread, in a fixed order

  // The same gradients from plain loops, in double.
  std::vector<double> da(kI * kJ * kK), db(kJ * kK, 0.0), dc(kI * kJ, 0.0), dtable(kRows * kCols, 0.0);
  for (int64_t i = 0; i < kI; ++i)
    for (int64_t j = 0; j < kJ; ++j)
      for (int64_t k = 0; k < kK; ++k) {
        const int64_t o = (i * kJ + j) * kK + k;
        da[o] = double(four.w[o]) * four.c[i * kJ + j];
        db[j * kK + k] += da[o];
        dc[i * kJ + j] += double(four.w[o]) * (double(four.a[o]) + four.b[j * kK + k]);
      }
  for (int64_t n = 0; n < kIds; ++n)
    for (int64_t col = 0; col < kCols; ++col) dtable[four.ids[n] * kCols + col] += four.v[n * kCols + col];
  ParameterArena<float> layout;  // the same arena, for each parameter's offset into the flat gradients
  const ParamId a = layout.add("a", {kI, kJ, kK}), b = layout.add("b", {kJ, kK}), c = layout.add("c", {kI, kJ, 1}),
                table = layout.add("table", {kRows, kCols});
  layout.allocate();
  auto expect_near_all = [&](ParamId id, const std::vector<double>& want, const char* what) {
    double worst = 0;
    for (size_t i = 0; i < want.size(); ++i)
      worst = std::max(worst, std::abs(four.grads[layout.offset(id) + i] - want[i]) / (1.0 + std::abs(want[i])));
    EXPECT_LT(worst, 1e-5) << what;
  };
  expect_near_all(a, da, "da");
  expect_near_all(b, db, "db (summed over the leading axis)");
  expect_near_all(c, dc, "dc (summed over the last axis)");
  expect_near_all(table, dtable, "dtable (repeated ids)");
}

}  // namespace
}  // namespace bert

namespace bert {
namespace {

// Two layers and a weight tied between the first and the last (as BERT ties the word embeddings to the
// decoder): backward reports each gradient buffer once, the last layer's before the first's, the tied
// one after both of its uses, and every buffer already holds its final value when reported.
TEST(Graph, BackwardReportsEachLeafGradientOnceWhenNothingWritesItAnyMore) {
  ParameterArena<float> arena;
  const ParamId tied = arena.add("tied", {3, 3}), first = arena.add("first", {3, 3}), last = arena.add("last", {3, 3});
  arena.allocate();
  Rng rng(3);
  for (float& v : arena.values()) v = static_cast<float>(rng.next_normal());
  Tensor<float> x = testing::to_float(testing::random_tensor({4, 3}, 5));
  auto step = [&](Graph<float>& g) {
    Var h = ops::linear(g, g.constant(x.view()), g.param(arena.get(tied)), Var{});
    h = ops::tanh(g, ops::linear(g, h, g.param(arena.get(first)), Var{}));
    h = ops::tanh(g, ops::linear(g, h, g.param(arena.get(last)), Var{}));
    return ops::mean(g, ops::linear(g, h, g.param(arena.get(tied)), Var{}));  // the tied weight again
  };
  Graph<float> g;
  Var loss = step(g);
  EXPECT_EQ(g.leaf_gradients().size(), 3u) << "the tied weight's two leaves share one buffer";
  std::vector<std::string> order;
  std::vector<std::vector<float>> at_report;
  g.backward(loss, [&](TensorView<float> grad) {
    for (ParamId id : {tied, first, last})
      if (arena.get(id).grad.data() == grad.data()) order.push_back(arena.name(id));
    at_report.emplace_back(grad.begin(), grad.end());
  });
  EXPECT_EQ(order, (std::vector<std::string>{"last", "first", "tied"}));
  for (size_t i = 0; i < order.size(); ++i) {
    const TensorView<float> final_grad = arena.get(order[i]).grad;
    EXPECT_EQ(at_report[i], std::vector<float>(final_grad.begin(), final_grad.end())) << order[i];
  }
}

// An op that takes a known time: 30 ms of forward after making its output, 15 ms in its backward.
Var slow_identity(Graph<float>& g, Var x) {
  Var y = g.emit(g.shape(x), {x});
  std::copy_n(g.value(x).data(), g.value(x).numel(), g.value(y).data());
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  g.on_backward(y, [x, y](Graph<float>& g) {
    std::this_thread::sleep_for(std::chrono::milliseconds(15));
    const float* dy = g.grad(y).data();
    float* dx = g.grad(x).data();
    for (int64_t i = 0; i < g.value(y).numel(); ++i) dx[i] += dy[i];
  });
  return y;
}

TEST(OpProfile, TimesEachOpsForwardAndBackwardUnderItsName) {
  TinyModel model;
  Tensor<float> x = testing::to_float(testing::random_tensor({5, 3}, 2));
  Graph<float> g;
  OpProfile profile;
  g.set_profile(&profile);
  for (int step = 0; step < 2; ++step) {
    Var y = ops::linear(g, g.constant(x.view()), g.param(model.arena.get(model.weight)),
                        g.param(model.arena.get(model.bias)));
    Var loss = ops::mean(g, ops::gelu(g, slow_identity(g, y)));
    g.backward(loss);
  }
  g.set_profile(nullptr);
  std::map<std::string, OpProfile::Entry> by_op;
  for (const OpProfile::Entry& e : profile.entries()) by_op[e.op] = e;
  for (const char* op : {"linear", "slow_identity", "gelu", "sum"}) {  // mean is a scaled sum
    ASSERT_TRUE(by_op.contains(op)) << op << " missing from\n" << profile.table(2);
    EXPECT_EQ(by_op[op].forward_calls, 2) << op;
    EXPECT_EQ(by_op[op].backward_calls, 2) << op;
  }
  // The sleeps land on the op that slept, in its own column, and nowhere else.
  EXPECT_GE(by_op["slow_identity"].forward_s, 0.060);
  EXPECT_GE(by_op["slow_identity"].backward_s, 0.030);
  EXPECT_LT(by_op["slow_identity"].backward_s, by_op["slow_identity"].forward_s);
  for (const char* op : {"linear", "gelu", "sum", "scale"}) {
    EXPECT_LT(by_op[op].forward_s, 0.010) << op;
    EXPECT_LT(by_op[op].backward_s, 0.010) << op;
  }
  EXPECT_EQ(profile.entries().front().op, "slow_identity");
  EXPECT_NE(profile.table(2).find("slow_identity"), std::string::npos);
  // Detached: nothing more is recorded.
  Var loss = model.loss(g, x.view());
  g.backward(loss);
  for (const OpProfile::Entry& e : profile.entries()) {
    EXPECT_EQ(e.forward_calls, by_op[e.op].forward_calls) << e.op;
    EXPECT_EQ(e.backward_calls, by_op[e.op].backward_calls) << e.op;
  }
}

TEST(OpProfile, ByShapeTellsTheCallsOfAnOpApart) {
  Graph<float> g;
  OpProfile profile(true);
  g.set_profile(&profile);
  Tensor<float> small = testing::to_float(testing::random_tensor({2, 3}, 1));
  Tensor<float> large = testing::to_float(testing::random_tensor({4, 5}, 2));
  ops::gelu(g, g.constant(small.view()));
  slow_identity(g, g.constant(large.view()));
  ops::gelu(g, g.constant(large.view()));
  g.clear();
  std::map<std::string, OpProfile::Entry> by_op;
  for (const OpProfile::Entry& e : profile.entries()) by_op[e.op] = e;
  ASSERT_EQ(by_op.size(), 3u) << profile.table(1);
  EXPECT_EQ(by_op["gelu [2, 3]"].forward_calls, 1);
  EXPECT_EQ(by_op["gelu [4, 5]"].forward_calls, 1);
  EXPECT_GE(by_op["slow_identity [4, 5]"].forward_s, 0.030);
  EXPECT_LT(by_op["gelu [4, 5]"].forward_s, 0.010);  // clear() closed the last op's time
}

TEST(OpProfile, NamesOpsByFunctionAndMarksFusedQuantizers) {
  EXPECT_EQ(OpProfile::op_name("bert::Var bert::ops::gelu(bert::Graph<T>&, bert::Var) [with T = float]"), "gelu");
  EXPECT_EQ(OpProfile::op_name("bert::Var bert::ops::gelu(bert::Graph<T>&, bert::Var, const bert::ops::"
                               "QuantizeOutput&) [with T = float]"),
            "gelu+quantize");
  EXPECT_EQ(OpProfile::op_name("Var slow(Graph<float>&, Var)"), "slow");
  EXPECT_EQ(OpProfile::op_name("Var bert::(anonymous namespace)::slow(Graph<float> &, Var)"), "slow");
  EXPECT_EQ(OpProfile::op_name("(optimizer step)"), "(optimizer step)");
}

}  // namespace
}  // namespace bert
