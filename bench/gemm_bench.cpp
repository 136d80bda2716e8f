// gemm-bench: GFLOP/s of core's gemm() (the kernel every matmul and linear uses) on a large square
// product (the machine's ceiling) and on BERT-shaped products, beside OpenBLAS's cblas_sgemm in the
// same run when the build found OpenBLAS; then the INT8 linear layer (activation quantization included)
// with each integer kernel this CPU runs, against the FP32 linear (gemm with W^T) on the same shapes;
// then the same shapes with BF16 operands (AMX or vdpbf16ps where the CPU has them) against FP32; then the
// vector kernels (GELU, softmax, cross-entropy's exp sums) of each CPU kernel set.
// Median of timed repetitions after a warm-up.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "core/rng.h"
#include "kernels/gemm.h"
#include "kernels/int8_gemm.h"
#include "kernels/vector_math.h"
#include "sys/openmp_wait.h"
#include "sys/parallel.h"

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

// y = x W^T for x (m, k), W (n, k): FP32 gemm against int8_linear with each kernel, quantization of x included.
void compare_int8(int64_t m, int64_t n, int64_t k, const char* what, int reps, bert::Rng& rng) {
  std::vector<float> x(m * k), w(n * k), y(m * n), scale_w(n, 0.01f), bias(n, 0.0f);
  for (float& v : x) v = static_cast<float>(rng.next_normal());
  for (float& v : w) v = static_cast<float>(rng.next_normal());
  std::vector<int8_t> q_w(n * k);
  for (int64_t i = 0; i < n * k; ++i) q_w[i] = static_cast<int8_t>(std::clamp(w[i] * 40.0f, -127.0f, 127.0f));
  const bert::Int8Weights packed(q_w.data(), n, k);
  std::vector<uint8_t> a(m * bert::int8_row_bytes(k));
  const double flops = 2.0 * m * n * k;
  const double fp32 =
      flops /
      median_seconds(reps,
                     [&] {
                       bert::gemm<float>({false, true, m, n, k}, 1.0f, x.data(), k, w.data(), k, 0.0f, y.data(), n);
                     }) /
      1e9;
  char dims[32];
  std::snprintf(dims, sizeof dims, "%ld x %ld x %ld", long(m), long(n), long(k));
  std::printf("%-34s %20s %12.1f", what, dims, fp32);
  for (bert::Int8Kernel kernel :
       {bert::Int8Kernel::kGeneric, bert::Int8Kernel::kAvx2, bert::Int8Kernel::kAvx512Vnni, bert::Int8Kernel::kAmx}) {
    if (!bert::int8_kernel_supported(kernel)) {
      std::printf(" %18s", "-");
      continue;
    }
    const double ops = flops /
                       median_seconds(reps,
                                      [&] {
                                        bert::quantize_activations(x.data(), m, k, 0.05f, a.data());
                                        bert::int8_linear(m, a.data(), packed, 0.05f, scale_w.data(), bias.data(),
                                                          y.data(), n, kernel);
                                      }) /
                       1e9;
    std::printf(" %10.1f (%4.2fx)", ops, ops / fp32);
  }
  std::printf("\n");
}

// The vector kernels over 16M floats (an FFN activation of mini at batch 128), split over the threads as
// the ops split them: billions of elements per second with each CPU kernel set.
void compare_vector_kernels(int reps, bert::Rng& rng) {
  const int64_t n = int64_t(1) << 24, attention_row = 128, vocabulary_row = 16000;
  std::vector<float> x(n), y(n), dy(n), dx(n, 0.0f);
  for (float& v : x) v = static_cast<float>(2 * rng.next_normal());
  for (float& v : dy) v = static_cast<float>(rng.next_normal());
  std::vector<float> row_sums(n / vocabulary_row);
  std::printf("\nVector kernels over %ld floats, billions of elements per second:\n%-44s %12s %12s\n", long(n),
              "kernel", "build", "avx512");
  struct Kernel {
    const char* what;
    void (*run)(const float* x, const float* dy, float* y, float* dx, float* sums, int64_t lo, int64_t hi,
                bert::CpuKernels set);
    int64_t grain;  // elements per unit of work: a row where the kernel works on rows
  };
  const Kernel kernels[] = {
      {"GELU",
       [](const float* x, const float*, float* y, float*, float*, int64_t lo, int64_t hi, bert::CpuKernels set) {
         bert::vec::gelu(x + lo, y + lo, hi - lo, set);
       },
       1},
      {"GELU backward (dx += dy GELU'(x))",
       [](const float* x, const float* dy, float*, float* dx, float*, int64_t lo, int64_t hi, bert::CpuKernels set) {
         bert::vec::gelu_backward(x + lo, dy + lo, dx + lo, hi - lo, /*accumulate=*/true, set);
       },
       1},
      {"softmax, rows of 128 (attention)",
       [](const float* x, const float*, float* y, float*, float*, int64_t lo, int64_t hi, bert::CpuKernels set) {
         for (int64_t r = lo; r < hi; r += attention_row)
           bert::vec::softmax(x + r, static_cast<const float*>(nullptr), y + r, attention_row, set);
       },
       attention_row},
      {"max + sum exp, rows of 16000 (cross-entropy)",
       [](const float* x, const float*, float*, float*, float* sums, int64_t lo, int64_t hi, bert::CpuKernels set) {
         for (int64_t r = lo; r + vocabulary_row <= hi; r += vocabulary_row) {
           const float max = bert::vec::max_of(x + r, vocabulary_row, set);
           sums[r / vocabulary_row] = bert::vec::sum_exp_shifted(x + r, max, vocabulary_row, set);
         }
       },
       vocabulary_row},
  };
  for (const Kernel& k : kernels) {
    std::printf("%-44s", k.what);
    for (bert::CpuKernels set : {bert::CpuKernels::kBuild, bert::CpuKernels::kAvx512}) {  // no vector set for AVX2
      if (!bert::cpu_kernels_supported(set)) {
        std::printf(" %12s", "-");
        continue;
      }
      const int64_t units = n / k.grain;
      const double seconds = median_seconds(reps, [&] {
        bert::parallel_for(units, 64, [&](int64_t lo, int64_t hi) {
          k.run(x.data(), dy.data(), y.data(), dx.data(), row_sums.data(), lo * k.grain, hi * k.grain, set);
        });
      });
      std::printf(" %12.2f", double(units * k.grain) / seconds / 1e9);
    }
    std::printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  bert::wait_passively_unless_chosen(argv);  // first: it may re-execute the program
  int reps = 7;
  CLI::App app{"gemm-bench: SGEMM GFLOP/s of core's gemm() (Eigen) vs OpenBLAS, same run"};
  app.add_option("--reps", reps, "timed repetitions per shape (median reported)")->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);

  struct Shape {
    int64_t m, n, k;
    const char* what;
    bool trans_a = false, trans_b = false;  // as the model's products: x W^T (forward), dY^T x (weight grad)
  };
  const Shape shapes[] = {
      {2048, 2048, 2048, "square (ceiling)"},
      {4096, 768, 256, "BERT-shaped"},
      {16384, 512, 128, "BERT-shaped"},
      {4096, 128, 128, "tiny: B32 x T128, H128 projection"},
      {4096, 512, 128, "tiny: FFN up"},
      {4096, 128, 512, "tiny: FFN down"},
      {4096, 256, 256, "mini: projection"},
      {4096, 1024, 256, "mini: FFN up"},
      {4096, 256, 256, "mini: projection x W^T", false, true},
      {4096, 1024, 256, "mini: FFN up x W^T", false, true},
      {4096, 256, 1024, "mini: FFN down x W^T", false, true},
      {256, 256, 4096, "mini: projection dY^T x", true, false},
      {1024, 256, 4096, "mini: FFN up dY^T x", true, false},
      {2560, 16000, 256, "mini: MLM decoder x W^T", false, true},
  };
  // Every one-thread kernel set gemm() can run: Eigen for the build's target, ours for AVX2 + FMA and for
  // AVX-512 (picked at run time where the CPU has them; kAuto runs the widest).
  const bert::CpuKernels sets[] = {bert::CpuKernels::kBuild, bert::CpuKernels::kAvx2, bert::CpuKernels::kAvx512};
  std::printf("threads: %d; gemm() runs the '%s' kernel\n%-34s %20s %12s %12s %12s %12s %8s\n", bert::num_threads(),
              bert::cpu_kernels_name(bert::CpuKernels::kAuto), "shape", "M x N x K", "build GF/s", "avx2 GF/s",
              "avx512 GF/s", "openblas", "ratio");
  bert::Rng rng(1);
  for (const Shape& s : shapes) {
    std::vector<float> a(s.m * s.k), b(s.k * s.n), c(s.m * s.n);
    for (float& v : a) v = static_cast<float>(rng.next_normal());
    for (float& v : b) v = static_cast<float>(rng.next_normal());
    const int64_t lda = s.trans_a ? s.m : s.k, ldb = s.trans_b ? s.k : s.n;
    const double flops = 2.0 * s.m * s.n * s.k;
    auto gflops = [&](bert::CpuKernels kernel) {
      return flops /
             median_seconds(reps,
                            [&] {
                              bert::gemm<float>({s.trans_a, s.trans_b, s.m, s.n, s.k}, 1.0f, a.data(), lda, b.data(),
                                                ldb, 0.0f, c.data(), s.n, kernel);
                            }) /
             1e9;
    };
    char dims[32];
    std::snprintf(dims, sizeof dims, "%ld x %ld x %ld", long(s.m), long(s.n), long(s.k));
    std::printf("%-34s %20s", s.what, dims);
    double best = 0.0;
    for (bert::CpuKernels set : sets) {
      if (!bert::cpu_kernels_supported(set)) {
        std::printf(" %12s", "-");
        continue;
      }
      const double rate = gflops(set);
      best = std::max(best, rate);
      std::printf(" %12.1f", rate);
    }
#ifdef BERT_BENCH_WITH_OPENBLAS
    const double blas = flops /
                        median_seconds(reps,
                                       [&] {
                                         cblas_sgemm(CblasRowMajor, s.trans_a ? CblasTrans : CblasNoTrans,
                                                     s.trans_b ? CblasTrans : CblasNoTrans, s.m, s.n, s.k, 1.0f,
                                                     a.data(), lda, b.data(), ldb, 0.0f, c.data(), s.n);
                                       }) /
                        1e9;
    std::printf(" %12.1f %8.2f\n", blas, best / blas);
#else
    std::printf(" %12s %8s\n", "n/a", "-");
#endif
  }
  std::printf("\nBF16 operands, FP32 sums (%s), GFLOP/s and ratio to FP32 (both the '%s' set):\n%-34s %20s %12s %18s\n",
              bert::gemm_bf16_kernel_name(),
              bert::cpu_kernels_name(bert::CpuKernels::kAuto), "shape", "M x N x K", "fp32 GF/s", "bf16 GF/s");
  for (const Shape& s : shapes) {
    std::vector<float> a(s.m * s.k), b(s.k * s.n), c(s.m * s.n);
    for (float& v : a) v = static_cast<float>(rng.next_normal());
    for (float& v : b) v = static_cast<float>(rng.next_normal());
    const int64_t lda = s.trans_a ? s.m : s.k, ldb = s.trans_b ? s.k : s.n;
    auto gflops = [&](bool bf16) {
      return 2.0 * s.m * s.n * s.k /
             median_seconds(reps,
                            [&] {
                              bert::gemm<float>({s.trans_a, s.trans_b, s.m, s.n, s.k, bf16}, 1.0f, a.data(), lda,
                                                b.data(), ldb, 0.0f, c.data(), s.n);
                            }) /
             1e9;
    };
    char dims[32];
    std::snprintf(dims, sizeof dims, "%ld x %ld x %ld", long(s.m), long(s.n), long(s.k));
    const double fp32 = gflops(false), bf16 = gflops(true);
    std::printf("%-34s %20s %12.1f %10.1f (%4.2fx)\n", s.what, dims, fp32, bf16, bf16 / fp32);
  }
  std::printf(
      "\nINT8 linear (y = x W^T, quantization of x included), GOP/s and ratio to FP32:\n"
      "%-34s %20s %12s %18s %18s %18s %18s\n",
      "shape", "M x N x K", "fp32 GF/s", "generic", "avx2", "avx512-vnni", "amx");
  compare_int8(4096, 128, 128, "tiny: B32 x T128, H128 projection", reps, rng);
  compare_int8(4096, 512, 128, "tiny: FFN up", reps, rng);
  compare_int8(4096, 256, 256, "mini: projection", reps, rng);
  compare_int8(4096, 1024, 256, "mini: FFN up", reps, rng);
  compare_int8(4096, 256, 1024, "mini: FFN down", reps, rng);
  compare_int8(4096, 768, 768, "base: B32 x T128 projection", reps, rng);
  compare_int8(4096, 3072, 768, "base: FFN up", reps, rng);
  compare_int8(4096, 768, 3072, "base: FFN down", reps, rng);
  compare_vector_kernels(reps, rng);
  return 0;
}
