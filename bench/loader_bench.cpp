// loader-bench: how long a training step waits for its batch from the shard loader (data::ShardLoader, as
// bert-train reads shards), with the next shard read ahead on a thread of its own or each shard read when it
// is reached. A step of --step-ms is simulated between batches (the time the GPU or CPU computes while the
// loader's reads run); the longest wait is the pause at a shard boundary.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "data/loader.h"
#include "sys/error.h"

namespace {

using namespace bert;
using Clock = std::chrono::steady_clock;

struct Waits {
  double mean_us = 0, longest_ms = 0;
  int64_t batches = 0, over_10ms = 0;
};

Waits measure(const data::LoaderOptions& options, int64_t batches, int step_ms) {
  data::ShardLoader loader(options);
  Batch batch;
  Waits w;
  double total = 0;
  for (; w.batches < batches; ++w.batches) {
    const auto start = Clock::now();
    loader.next(batch);
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    total += seconds;
    w.longest_ms = std::max(w.longest_ms, 1e3 * seconds);
    w.over_10ms += seconds > 0.01;
    if (step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(step_ms));
  }
  w.mean_us = 1e6 * total / static_cast<double>(std::max<int64_t>(w.batches, 1));
  return w;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> shards;
  int64_t batch_size = 64, batches = 2500;
  int step_ms = 10;
  CLI::App app{"loader-bench: the wait for each batch from the shard loader, reading ahead or not"};
  app.add_option("--shards", shards, "shard files or folders (as bert-train --train)")->required();
  app.add_option("--batch-size", batch_size, "sequences a batch")->check(CLI::Range(1, 1 << 20));
  app.add_option("--batches", batches, "batches read each way")->check(CLI::Range(1, 10000000));
  app.add_option("--step-ms", step_ms, "simulated step between batches, milliseconds (0: none)")
      ->check(CLI::Range(0, 10000));
  CLI11_PARSE(app, argc, argv);
  try {
    data::LoaderOptions o;
    o.shards = data::expand_shard_paths(shards);
    o.batch_size = batch_size;
    std::printf("%lld batches of %lld, a %d ms step between them, %zu shard file(s)\n", (long long)batches,
                (long long)batch_size, step_ms, o.shards.size());
    std::printf("%-22s %14s %14s %16s\n", "next shard", "mean wait us", "longest ms", "waits > 10 ms");
    for (bool prefetch : {false, true}) {
      o.prefetch = prefetch;
      const Waits w = measure(o, batches, step_ms);
      std::printf("%-22s %14.1f %14.1f %16lld\n", prefetch ? "read ahead" : "read when reached", w.mean_us,
                  w.longest_ms, (long long)w.over_10ms);
    }
    return 0;
  } catch (const UserError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
