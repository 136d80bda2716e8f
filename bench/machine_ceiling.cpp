// machine-ceiling: how far this machine lets any program scale with threads, measured without our
// kernels. (1) Peak FMA rate: every thread runs independent chains of fused multiply-adds on registers
// only (no memory), as wide as the CPU has (AVX-512, else AVX2); the aggregate over t threads divided by
// t x the one-thread rate is the compute-bound scaling bound (all-core clocks, shared cores of a virtual
// machine). (2) Memory: a triad a = b + s c over arrays larger than the last-level cache, the
// bandwidth-bound one. (3) Pairs: thread 0 pinned to CPU 0 and thread 1 to CPU j, both running FMAs:
// where their rate falls to about half, CPU j shares CPU 0's core (a hyperthread the guest is not told of).
#include <immintrin.h>
#include <omp.h>
#include <sched.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "kernels/cpu_kernels.h"

namespace {

using Clock = std::chrono::steady_clock;

// Floating-point operations done by one call of an fma_chains function.
constexpr int kChains = 12;  // independent accumulators: > latency (4) x ports (2)

__attribute__((target("avx512f"))) double fma_chains_avx512(int64_t iterations) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(float(i));
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t it = 0; it < iterations; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  alignas(64) float out[16];
  __m512 sum = acc[0];
  for (int i = 1; i < kChains; ++i) sum = _mm512_add_ps(sum, acc[i]);
  _mm512_store_ps(out, sum);
  volatile float keep = out[0];  // the chains must be computed
  (void)keep;
  return 2.0 * 16 * kChains * double(iterations);
}

__attribute__((target("avx2,fma"))) double fma_chains_avx2(int64_t iterations) {
  __m256 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(float(i));
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t it = 0; it < iterations; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  alignas(32) float out[8];
  __m256 sum = acc[0];
  for (int i = 1; i < kChains; ++i) sum = _mm256_add_ps(sum, acc[i]);
  _mm256_store_ps(out, sum);
  volatile float keep = out[0];
  (void)keep;
  return 2.0 * 8 * kChains * double(iterations);
}

bool has_avx512() { return bert::cpu_kernels_supported(bert::CpuKernels::kAvx512); }

double fma_chains(int64_t iterations) {
  return has_avx512() ? fma_chains_avx512(iterations) : fma_chains_avx2(iterations);
}

// Aggregate GFLOP/s of `threads` threads running FMA chains at once (each pinned where `cpus` says so).
double fma_rate(int threads, int64_t iterations, const std::vector<int>& cpus = {}) {
  double seconds = 0.0, flops = 0.0;
#pragma omp parallel num_threads(threads) reduction(max : seconds) reduction(+ : flops)
  {
    const int me = omp_get_thread_num();
    if (!cpus.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpus[me], &set);
      sched_setaffinity(0, sizeof set, &set);
    }
    fma_chains(iterations / 10);  // warm-up: clocks settle, the thread is placed
#pragma omp barrier
    const auto start = Clock::now();
    flops = fma_chains(iterations);
    seconds = std::chrono::duration<double>(Clock::now() - start).count();
  }
  return flops / seconds / 1e9;
}

// Aggregate GB/s of a = b + s c (12 bytes per element: two reads, one write) over n elements per array,
// split over `threads` threads (each touches its own part first, so its pages are its own).
double triad_rate(int threads, int64_t n, int reps) {
  float* a = static_cast<float*>(std::aligned_alloc(64, n * 4));
  float* b = static_cast<float*>(std::aligned_alloc(64, n * 4));
  float* c = static_cast<float*>(std::aligned_alloc(64, n * 4));
  double best = 1e30;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) a[i] = 0.0f, b[i] = 1.0f, c[i] = 2.0f;
    for (int r = 0; r < reps; ++r) {
#pragma omp barrier
      const auto start = Clock::now();
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i) a[i] = b[i] + 0.5f * c[i];
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
#pragma omp critical
      best = std::min(best, seconds);  // after the for's own barrier: every thread saw the whole pass
    }
  }
  volatile float keep = a[n / 2];
  (void)keep;
  std::free(a), std::free(b), std::free(c);
  return 12.0 * double(n) / best / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  int max_threads = omp_get_max_threads();
  double fma_seconds = 0.3;
  int64_t triad_mib = 512;
  bool pairs = true;
  CLI::App app{"machine-ceiling: the thread-scaling bound this machine puts on compute- and memory-bound code"};
  app.add_option("--threads", max_threads, "largest thread count (1, 2, 4, ... up to it)")->check(CLI::Range(1, 1024));
  app.add_option("--fma-seconds", fma_seconds, "about how long each FMA measurement runs")
      ->check(CLI::Range(0.01, 60.0));
  app.add_option("--triad-mib", triad_mib, "size of each triad array in MiB (above the last-level cache)")
      ->check(CLI::Range(1, 65536));
  app.add_flag("!--no-pairs", pairs, "skip the scan of CPU pairs for shared cores");
  CLI11_PARSE(app, argc, argv);

  std::vector<int> counts;
  for (int t = 1; t < max_threads; t *= 2) counts.push_back(t);
  counts.push_back(max_threads);

  // Iterations for about fma_seconds on one thread, from a short timed run.
  const auto probe_start = Clock::now();
  const double probe_flops = fma_chains(1 << 20);
  const double probe_rate = probe_flops / std::chrono::duration<double>(Clock::now() - probe_start).count();
  const int64_t iterations = std::max<int64_t>(
      1 << 20, int64_t(fma_seconds * probe_rate / (probe_flops / double(1 << 20))));

  std::printf("FMA chains on registers (%s), aggregate GFLOP/s and scaling efficiency:\n%8s %12s %12s %12s\n",
              has_avx512() ? "AVX-512" : "AVX2", "threads", "GFLOP/s", "per thread", "efficiency");
  double fma_one = 0.0;
  for (int t : counts) {
    const double rate = fma_rate(t, iterations);
    if (t == 1) fma_one = rate;
    std::printf("%8d %12.1f %12.1f %11.0f%%\n", t, rate, rate / t, 100.0 * rate / (t * fma_one));
  }

  const int64_t n = triad_mib * (int64_t(1) << 20) / 4;
  std::printf("\nTriad a = b + s c over 3 x %ld MiB, aggregate GB/s and scaling efficiency:\n%8s %12s %12s %12s\n",
              long(triad_mib), "threads", "GB/s", "per thread", "efficiency");
  double triad_one = 0.0;
  for (int t : counts) {
    const double rate = triad_rate(t, n, 5);
    if (t == 1) triad_one = rate;
    std::printf("%8d %12.1f %12.1f %11.0f%%\n", t, rate, rate / t, 100.0 * rate / (t * triad_one));
  }

  if (pairs && max_threads > 1) {
    std::printf("\nTwo threads on CPU 0 and CPU j, FMA GFLOP/s per thread (one alone: %.1f):\n%8s %12s\n", fma_one,
                "j", "per thread");
    for (int j = 1; j < max_threads; ++j)
      std::printf("%8d %12.1f\n", j, fma_rate(2, iterations, {0, j}) / 2);
  }
  return 0;
}
