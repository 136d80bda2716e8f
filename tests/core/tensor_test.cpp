// Shape, Tensor/TensorView ownership, Workspace reuse, ParameterArena layout, Rng.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>

#include "core/arena.h"
#include "core/device.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "core/workspace.h"
#include "sys/error.h"

namespace bert {
namespace {

TEST(Shape, RankNumelAxesAndPrinting) {
  Shape s{2, 3, 4};
  EXPECT_EQ(s.rank(), 3);
  EXPECT_EQ(s.numel(), 24);
  EXPECT_EQ(s[-1], 4);
  EXPECT_EQ(s.rows(), 6);
  EXPECT_EQ(s.with_last(7), Shape({2, 3, 7}));
  EXPECT_EQ(s.str(), "[2, 3, 4]");
  EXPECT_EQ(Shape{}.numel(), 1);
  EXPECT_THROW(s[3], InternalError);
  EXPECT_THROW((Shape{1, 2, 3, 4, 5}), InternalError);
  EXPECT_THROW((Shape{2, -1}), InternalError);
}

TEST(Tensor, OwnsZeroedStorageAndCopiesOnlyWhenAsked) {
  Tensor<float> t({2, 3});
  for (int64_t i = 0; i < t.numel(); ++i) EXPECT_EQ(t[i], 0.0f);
  t[4] = 5.0f;
  Tensor<float> copy = t.clone();
  copy[4] = 1.0f;
  EXPECT_EQ(t[4], 5.0f) << "clone must be a deep copy";
  static_assert(!std::is_copy_constructible_v<Tensor<float>>, "implicit copies are not allowed");
  EXPECT_THROW(Tensor<float>(Shape{2, 2}, std::vector<float>(3)), InternalError);
}

TEST(TensorView, SharesStorageAndReshapesWithoutCopying) {
  Tensor<float> t({2, 3});
  TensorView<float> v = t.view();
  v[1] = 2.0f;
  EXPECT_EQ(t[1], 2.0f);
  TensorView<float> r = v.reshaped({3, 2});
  EXPECT_EQ(r.data(), t.data());
  EXPECT_THROW(v.reshaped({4, 2}), InternalError);
}

TEST(Device, OpensByNameAndRefusesWhatItCannotDo) {
  EXPECT_FALSE(Device::cpu().is_cuda());
  EXPECT_EQ(Device::open("cpu")->name(), "cpu");
  EXPECT_EQ(Device::open("auto")->is_cuda(), Device::cuda_available());
  EXPECT_THROW(Device::open("gpu"), UserError);
  EXPECT_THROW(Device::open("cuda:x"), UserError);
  EXPECT_THROW(Device::open("cpu", Precision::kTf32), UserError);  // TF32 is a GPU setting
  if (!Device::cuda_available()) {
    EXPECT_THROW(Device::open("cuda"), UserError);
  } else {
    EXPECT_THROW(Device::open("cuda:999"), UserError);
  }
  EXPECT_EQ(parse_precision("tf32"), Precision::kTf32);
  EXPECT_EQ(parse_precision("bf16"), Precision::kBf16);
  // BF16 on the CPU: products on BF16-rounded operands, every tensor FP32 (ops_test's Bf16Products).
  EXPECT_EQ(Device::open("cpu", Precision::kBf16)->precision(), Precision::kBf16);
  EXPECT_FALSE(Device::open("cpu", Precision::kBf16)->is_cuda());
  EXPECT_THROW(parse_precision("fp16"), UserError);
  // Host memory through the CPU device: aligned, zeroed, copied.
  DeviceBuffer b(Device::cpu(), 100);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b.data()) % 256, 0u);
  Device::cpu().fill_zero(b.data(), 100);
  EXPECT_EQ(b.as<char>()[99], 0);
}

TEST(Workspace, AlignsAndStopsAllocatingOnceWarm) {
  Workspace ws;
  for (int cycle = 0; cycle < 3; ++cycle) {
    for (int i = 0; i < 50; ++i) {
      void* p = ws.allocate_bytes(100000 + i);
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % Workspace::kAlignment, 0u);
    }
    ws.reset();
    EXPECT_EQ(ws.bytes_in_use(), 0u);
  }
  const std::size_t allocations = ws.system_allocations();
  for (int i = 0; i < 50; ++i) ws.allocate_bytes(100000 + i);
  ws.reset();
  EXPECT_EQ(ws.system_allocations(), allocations) << "a warm workspace must not allocate for a same-size cycle";
}

// A cycle that needed several blocks leaves one block of what it used plus 1/16, at most kMaxHeadroom (the
// headroom is memory held for good: a GPU training step's workspace is gigabytes, what varies between
// batches megabytes). The large cycle's blocks are never touched: only address space.
TEST(Workspace, MergesACyclesBlocksWithBoundedHeadroom) {
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  Workspace small;
  small.allocate_bytes(kMiB);
  small.allocate_bytes(8 * kMiB);  // a second block
  small.reset();
  EXPECT_EQ(small.capacity(), 9 * kMiB + 9 * kMiB / 16);
  Workspace large;
  large.allocate_bytes(64 * kMiB);
  large.allocate_bytes(1024 * kMiB);  // 1/16 of the cycle would be 68 MiB
  large.reset();
  EXPECT_EQ(large.capacity(), 1088 * kMiB + Workspace::kMaxHeadroom);
  const std::size_t allocations = large.system_allocations();
  large.allocate_bytes(1088 * kMiB + Workspace::kMaxHeadroom);  // a cycle up to the headroom: no new block
  large.reset();
  EXPECT_EQ(large.system_allocations(), allocations);
}

TEST(ParameterArena, ParametersAreAlignedViewsIntoTwoFlatBuffers) {
  ParameterArena<float> arena;
  ParamId w = arena.add("layer.weight", {3, 5});
  ParamId b = arena.add("layer.bias", {3});
  EXPECT_THROW(arena.add("layer.bias", {3}), InternalError);
  EXPECT_THROW(arena.get(w), InternalError) << "views exist only after allocate()";
  arena.allocate();
  EXPECT_THROW(arena.add("late", {1}), InternalError);

  Parameter<float> pw = arena.get(w), pb = arena.get("layer.bias");
  EXPECT_EQ(*pw.name, "layer.weight");
  EXPECT_EQ(pw.value.shape(), Shape({3, 5}));
  EXPECT_EQ(pb.value.data(), arena.get(b).value.data());
  const float* base = arena.values().data();
  EXPECT_GE(pw.value.data(), base);
  EXPECT_LE(pb.value.end(), base + arena.values().numel());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(pb.value.data()) % 64, 0u);
  EXPECT_EQ(pb.grad.data() - arena.grads().data(), pb.value.data() - base) << "grad layout mirrors values";
  EXPECT_EQ(arena.num_elements(), 18);
  EXPECT_THROW(arena.get("missing"), UserError);

  pw.grad.fill(2.0f);
  arena.zero_grad();
  for (float v : arena.grads()) EXPECT_EQ(v, 0.0f);
}

TEST(Rng, DeterministicPerSeedAndIndependentOfDrawOrder) {
  Rng a(42), b(42), c(43);
  EXPECT_EQ(a.next_uniform(), b.next_uniform());
  EXPECT_NE(a.next_uniform(), c.next_uniform());
  Rng d(5);
  uint64_t first = d.reserve(10);
  EXPECT_EQ(first, 0u);
  EXPECT_EQ(d.state().counter, 10u);
  // Draw i depends only on (seed, i): reading the block backwards gives the same numbers.
  std::vector<double> forward, backward;
  for (int i = 0; i < 10; ++i) forward.push_back(d.uniform(first + i));
  for (int i = 9; i >= 0; --i) backward.insert(backward.begin(), d.uniform(first + i));
  EXPECT_EQ(forward, backward);
  Rng restored(d.state());
  EXPECT_EQ(restored.next_uniform(), d.next_uniform());
}

TEST(Rng, NormalHasUnitMomentsAndUniformStaysInRange) {
  Rng rng(3);
  const int n = 100000;
  double s = 0, s2 = 0;
  for (int i = 0; i < n; ++i) {
    double x = rng.next_normal();
    s += x;
    s2 += x * x;
    double u = rng.next_uniform();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
  }
  EXPECT_NEAR(s / n, 0.0, 0.02);
  EXPECT_NEAR(s2 / n, 1.0, 0.02);
}

}  // namespace
}  // namespace bert
