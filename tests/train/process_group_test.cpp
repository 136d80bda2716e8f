// Jobs of several processes: the rank read from each launcher's environment, the rendezvous file, the
// --nproc launcher (every rank started with its own variables, a failed rank ending the job and named,
// a stop passed through), and NCCL between two GPUs (skipped without them).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "core/device.h"
#include "core/rng.h"
#include "ops/ops.h"
#include "tests/common/expect_user_error.h"
#include "tests/common/temp_dir.h"
#include "train/gradient_reduction.h"
#include "train/nccl_communicator.h"
#include "train/process_group.h"

namespace bert::train {
namespace {

// Sets environment variables for a scope and removes them (and the launchers' others) after.
class ScopedEnvironment {
 public:
  explicit ScopedEnvironment(std::initializer_list<std::pair<const char*, const char*>> values) {
    clear();
    for (auto [name, value] : values) setenv(name, value, 1);
  }
  ~ScopedEnvironment() { clear(); }

 private:
  static void clear() {
    for (const char* name :
         {"BERT_RANK", "BERT_WORLD_SIZE", "BERT_LOCAL_RANK", "BERT_RENDEZVOUS", "OMPI_COMM_WORLD_RANK",
          "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid",
          "OMPI_MCA_orte_ess_jobid", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_STEP_ID"})
      unsetenv(name);
  }
};

TEST(ProcessGroup, ReadsEachLaunchersEnvironment) {
  {
    ScopedEnvironment env({});
    const ProcessGroup none = process_group_from_environment("/runs/a");
    EXPECT_FALSE(none.distributed());
    EXPECT_EQ(none.rank, 0);
  }
  {
    ScopedEnvironment env({{"BERT_RANK", "1"}, {"BERT_WORLD_SIZE", "2"}, {"BERT_RENDEZVOUS", "/tmp/r"}});
    const ProcessGroup g = process_group_from_environment("/runs/a");
    EXPECT_TRUE(g.distributed());
    EXPECT_EQ(g.rank, 1);
    EXPECT_EQ(g.size, 2);
    EXPECT_EQ(g.local_rank, 1);
    EXPECT_EQ(g.rendezvous, "/tmp/r");
  }
  {
    ScopedEnvironment env({{"OMPI_COMM_WORLD_RANK", "3"},
                           {"OMPI_COMM_WORLD_SIZE", "4"},
                           {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                           {"PMIX_NAMESPACE", "prterun-node@1"}});
    const ProcessGroup g = process_group_from_environment("/runs/a");
    EXPECT_EQ(g.launcher, "Open MPI");
    EXPECT_EQ(g.rank, 3);
    EXPECT_EQ(g.local_rank, 1);
    EXPECT_EQ(g.rendezvous, "/runs/a/.rendezvous-prterun-node_1");
  }
  {
    ScopedEnvironment env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_JOB_ID", "77"}});
    const ProcessGroup g = process_group_from_environment("/runs/a");
    EXPECT_EQ(g.launcher, "Slurm");
    EXPECT_EQ(g.size, 8);
    EXPECT_EQ(g.rendezvous, "/runs/a/.rendezvous-77.0");
  }
  {
    ScopedEnvironment env({{"BERT_RANK", "x1"}, {"BERT_WORLD_SIZE", "2"}});
    testing::expect_user_error([] { process_group_from_environment("/r"); }, "BERT_RANK='x1'");
  }
  {
    ScopedEnvironment env({{"BERT_RANK", "2"}, {"BERT_WORLD_SIZE", "2"}, {"BERT_RENDEZVOUS", "/tmp/r"}});
    testing::expect_user_error([] { process_group_from_environment("/r"); }, "must be below the size");
  }
  {
    ScopedEnvironment env({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
    testing::expect_user_error([] { process_group_from_environment("/r"); }, "BERT_RENDEZVOUS");
  }
}

TEST(ProcessGroup, RendezvousFileIsPublishedWholeAndAwaited) {
  testing::TempDir dir;
  const std::string path = dir.file("sub/rendezvous");
  const std::vector<char> id = {'a', 'b', '\0', 'c'};
  std::thread rank0([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    publish_rendezvous(path, id);
  });
  EXPECT_EQ(await_rendezvous(path, id.size(), std::chrono::seconds(10)), id);
  rank0.join();
  testing::expect_user_error([&] { await_rendezvous(dir.file("never"), 4, std::chrono::milliseconds(100)); },
                             "never': is rank 0 running");
}

TEST(ProcessGroup, LauncherStartsEveryRankWithItsVariables) {
  testing::TempDir dir;
  const std::string script = "echo \"$BERT_RANK $BERT_LOCAL_RANK $BERT_WORLD_SIZE $BERT_RENDEZVOUS\" > '" +
                             dir.path().string() + "'/rank$BERT_RANK";
  std::string failure;
  EXPECT_EQ(launch_local_ranks({"/bin/sh", "-c", script}, 3, &failure), 0);
  EXPECT_EQ(failure, "");
  std::string rendezvous;
  for (int r = 0; r < 3; ++r) {
    std::ifstream in(dir.file("rank" + std::to_string(r)));
    int rank = -1, local = -1, size = -1;
    std::string file;
    in >> rank >> local >> size >> file;
    EXPECT_EQ(rank, r);
    EXPECT_EQ(local, r);
    EXPECT_EQ(size, 3);
    EXPECT_FALSE(file.empty());
    if (r == 0) rendezvous = file;
    EXPECT_EQ(file, rendezvous) << "every rank meets at the same file";
  }
}

TEST(ProcessGroup, AFailedRankEndsTheJobAndIsNamed) {
  // Rank 1 fails at once; rank 0 would run for a minute (as if waiting for rank 1 in a collective).
  const auto start = std::chrono::steady_clock::now();
  std::string failure;
  const int status =
      launch_local_ranks({"/bin/sh", "-c", "if [ \"$BERT_RANK\" = 1 ]; then exit 3; fi; exec sleep 60"}, 2, &failure);
  EXPECT_EQ(status, 3);
  EXPECT_EQ(failure, "rank 1 of 2 exited with status 3");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));

  // A rank that ignores SIGTERM (stuck) is killed after the grace period. Rank 0 dies once rank 1 is
  // deaf to SIGTERM.
  testing::TempDir dir;
  const std::string ready = dir.file("ready");
  const auto stuck_start = std::chrono::steady_clock::now();
  failure.clear();
  launch_local_ranks({"/bin/sh", "-c",
                      "if [ \"$BERT_RANK\" = 0 ]; then while [ ! -f '" + ready +
                          "' ]; do sleep 0.01; done; kill -9 $$; fi; trap '' TERM; touch '" + ready +
                          "'; i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done"},
                     2, &failure, std::chrono::milliseconds(300));
  EXPECT_EQ(failure, "rank 0 of 2 was killed by signal 9 (Killed)");
  const auto took = std::chrono::steady_clock::now() - stuck_start;
  EXPECT_GE(took, std::chrono::milliseconds(300)) << "the grace period";
  EXPECT_LT(took, std::chrono::seconds(20));
}

TEST(ProcessGroup, RanksThatStopOnASignalAreNotAFailure) {
  std::string failure;
  EXPECT_EQ(launch_local_ranks({"/bin/sh", "-c", "exit 130"}, 2, &failure), 130);
  EXPECT_EQ(failure, "");
  EXPECT_EQ(launch_local_ranks({"/nonexistent/program"}, 1, &failure), 127);
  EXPECT_EQ(failure, "rank 0 of 1 exited with status 127");
}

// Two ranks (threads), each a three-layer model on its own inputs, buckets of one layer each: the
// last layers' buckets start during the backward pass, and afterwards every rank holds the mean of the
// two ranks' gradients.
TEST(GradientReduction, BucketsStartDuringBackwardAndEndAsTheMean) {
  struct Rank {
    ParameterArena<float> arena;
    std::vector<ParamId> layers;
    Rank() {
      for (int i = 0; i < 3; ++i) layers.push_back(arena.add("layer" + std::to_string(i), {8, 8}));
      arena.allocate();
      Rng rng(7);  // the same weights on both ranks
      for (float& v : arena.values()) v = static_cast<float>(rng.next_normal() * 0.5);
    }
    void backward(Graph<float>& g, int rank, GradientReduction* reduction) {
      std::vector<float> x(4 * 8);
      Rng rng(100 + rank);  // each rank its own batch
      for (float& v : x) v = static_cast<float>(rng.next_normal());
      Var h = g.input(x, Shape{4, 8});
      for (ParamId id : layers) h = ops::tanh(g, ops::linear(g, h, g.param(arena.get(id)), Var{}));
      Var loss = ops::mean(g, h);
      if (!reduction) return g.backward(loss);
      reduction->expect(g);
      g.backward(loss, [&](TensorView<float> grad) { reduction->on_final(grad); });
      reduction->finish();
    }
  };
  // Each rank's own gradient, then the reduced ones.
  std::vector<std::vector<float>> own(2);
  for (int r = 0; r < 2; ++r) {
    Rank alone;
    Graph<float> g;
    alone.backward(g, r, nullptr);
    own[r].assign(alone.arena.grads().begin(), alone.arena.grads().end());
  }
  // Notes, at each bucket's start, which layer it is and whether the first layer's gradient was still
  // untouched (the backward pass had not reached it).
  struct Recording final : Communicator {
    Communicator& inner;
    const float* first_layer_grad;
    std::vector<std::pair<int64_t, bool>> starts;
    Recording(Communicator& c, const float* first) : inner(c), first_layer_grad(first) {}
    int rank() const override { return inner.rank(); }
    int size() const override { return inner.size(); }
    void all_reduce_sum(std::span<float> v) override { inner.all_reduce_sum(v); }
    void all_reduce_sum(std::span<double> v) override { inner.all_reduce_sum(v); }
    void all_reduce_mean(const Device& d, float* data, int64_t n) override { inner.all_reduce_mean(d, data, n); }
    void start_mean(const Device& d, float* data, int64_t n) override {
      starts.emplace_back((data - first_layer_grad) / 64,
                          std::all_of(first_layer_grad, first_layer_grad + 64, [](float v) { return v == 0; }));
      inner.start_mean(d, data, n);
    }
  };
  auto group = local_group(2);
  std::vector<std::vector<float>> reduced(2);
  std::vector<std::vector<std::pair<int64_t, bool>>> starts(2);
  std::vector<int64_t> buckets(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      Rank rank;
      Recording recording(*group[r], rank.arena.get(rank.layers[0]).grad.data());
      GradientReduction reduction(rank.arena, recording, Device::cpu(), 8 * 8 * sizeof(float));
      Graph<float> g;
      rank.backward(g, r, &reduction);
      reduced[r].assign(rank.arena.grads().begin(), rank.arena.grads().end());
      starts[r] = recording.starts;
      buckets[r] = reduction.num_buckets();
    });
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(buckets[0], 3);
  // Layers 2 and 1 start while layer 0's gradient is still to be computed; layer 0 last.
  EXPECT_EQ(starts[0], (std::vector<std::pair<int64_t, bool>>{{2, true}, {1, true}, {0, false}}));
  EXPECT_EQ(starts[1], starts[0]);
  ASSERT_EQ(reduced[0].size(), own[0].size());
  for (size_t i = 0; i < own[0].size(); ++i) {
    EXPECT_FLOAT_EQ(reduced[0][i], (own[0][i] + own[1][i]) / 2) << i;
    EXPECT_EQ(reduced[1][i], reduced[0][i]);
  }
}

TEST(NcclCommunicator, RefusesWithoutAGpu) {
  ProcessGroup group;
  group.size = 2;
  group.rendezvous = "/tmp/unused";
  testing::expect_user_error([&] { nccl_communicator(group, Device::cpu()); }, "processes needs GPUs");
}

// Two ranks as two threads of this process, one GPU each: the gradient mean on the device and the sums
// of host values, as the trainer uses them.
TEST(NcclCommunicator, TwoGpusAverageDeviceValuesAndSumHostValues) {
  if (!Device::cuda_available()) GTEST_SKIP() << "no GPU";
  std::unique_ptr<Device> second;
  try {
    second = Device::cuda(1);
  } catch (const UserError&) {
    GTEST_SKIP() << "one GPU only: the NCCL test needs two";
  }
  if (!nccl_available()) GTEST_SKIP() << "NCCL cannot be loaded (LD_LIBRARY_PATH or BERT_NCCL_LIBRARY)";
  std::unique_ptr<Device> first = Device::cuda(0);
  testing::TempDir dir;
  const int64_t n = 1000003;  // odd, large enough for several NCCL chunks
  std::vector<std::vector<float>> means(2);
  std::vector<std::vector<double>> sums(2);
  std::vector<std::string> errors(2);
  auto rank_body = [&](int rank, const Device& device) {
    try {
      ProcessGroup group;
      group.rank = group.local_rank = rank;
      group.size = 2;
      group.rendezvous = dir.file("rendezvous");
      const std::unique_ptr<Communicator> comm = nccl_communicator(group, device);
      std::vector<float> values(n);
      for (int64_t i = 0; i < n; ++i) values[i] = float(i % 97) * (rank == 0 ? 1.0f : 3.0f);
      DeviceBuffer buffer(device, n * sizeof(float));
      device.copy_to_device(buffer.data(), values.data(), n * sizeof(float));
      comm->all_reduce_mean(device, static_cast<float*>(buffer.data()), n);
      means[rank].resize(n);
      device.copy_to_host(means[rank].data(), buffer.data(), n * sizeof(float));
      sums[rank] = {1.5 + rank, 1e15 * (rank + 1)};
      comm->all_reduce_sum(sums[rank]);
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
  };
  std::thread t0([&] { rank_body(0, *first); });
  std::thread t1([&] { rank_body(1, *second); });
  t0.join();
  t1.join();
  ASSERT_EQ(errors, (std::vector<std::string>{"", ""}));
  for (int rank = 0; rank < 2; ++rank) {
    for (int64_t i = 0; i < n; i += 1009)
      ASSERT_EQ(means[rank][i], float(i % 97) * 2.0f) << "rank " << rank << " " << i;
    EXPECT_EQ(sums[rank], (std::vector<double>{4.0, 3e15}));
  }
  EXPECT_FALSE(std::filesystem::exists(dir.file("rendezvous"))) << "rank 0 removes the file once all have joined";
}

}  // namespace
}  // namespace bert::train
