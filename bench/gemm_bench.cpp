// gemm-bench: GFLOP/s of core's gemm() (the kernel every matmul and linear uses) on a large square
// product (the machine's ceiling) and on BERT-shaped products, beside OpenBLAS's cblas_sgemm in the
// same run when the build found OpenBLAS. Median of timed repetitions after a warm-up.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "core/gemm.h"
#include "core/parallel.h"
#include "core/rng.h"

#ifdef BERT_BENCH_WITH_OPENBLAS
#include <cblas.h>
#endif

namespace {

template <typename F>
double median_seconds(int reps, F&& f) {
  f();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto start = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 7;
  CLI::App app{"gemm-bench: SGEMM GFLOP/s of core's gemm() (Eigen) vs OpenBLAS, same run"};
  app.add_option("--reps", reps, "timed repetitions per shape (median reported)")->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);

  struct Shape {
    int64_t m, n, k;
    const char* what;
  };
  const Shape shapes[] = {
      {2048, 2048, 2048, "square (ceiling)"}, {4096, 768, 256, "BERT-shaped"},
      {16384, 512, 128, "BERT-shaped"},       {4096, 128, 128, "tiny: B32 x T128, H128 projection"},
      {4096, 512, 128, "tiny: FFN up"},       {4096, 128, 512, "tiny: FFN down"},
      {4096, 256, 256, "mini: projection"},   {4096, 1024, 256, "mini: FFN up"},
  };
  std::printf("threads: %d\n%-34s %20s %12s %12s %8s\n", bert::num_threads(), "shape", "M x N x K", "ours GF/s",
              "openblas", "ratio");
  bert::Rng rng(1);
  for (const Shape& s : shapes) {
    std::vector<float> a(s.m * s.k), b(s.k * s.n), c(s.m * s.n);
    for (float& v : a) v = static_cast<float>(rng.next_normal());
    for (float& v : b) v = static_cast<float>(rng.next_normal());
    const double flops = 2.0 * s.m * s.n * s.k;
    const double ours =
        flops /
        median_seconds(
            reps,
            [&] {
              bert::gemm<float>({false, false, s.m, s.n, s.k}, 1.0f, a.data(), s.k, b.data(), s.n, 0.0f, c.data(), s.n);
            }) /
        1e9;
    char dims[32];
    std::snprintf(dims, sizeof dims, "%ld x %ld x %ld", long(s.m), long(s.n), long(s.k));
#ifdef BERT_BENCH_WITH_OPENBLAS
    const double blas = flops /
                        median_seconds(reps,
                                       [&] {
                                         cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s.m, s.n, s.k, 1.0f,
                                                     a.data(), s.k, b.data(), s.n, 0.0f, c.data(), s.n);
                                       }) /
                        1e9;
    std::printf("%-34s %20s %12.1f %12.1f %8.2f\n", s.what, dims, ours, blas, ours / blas);
#else
    std::printf("%-34s %20s %12.1f %12s %8s\n", s.what, dims, ours, "n/a", "-");
#endif
  }
  return 0;
}
