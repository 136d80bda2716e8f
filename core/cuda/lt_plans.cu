// Tuning cuBLASLt plans (core/cuda/lt_plans.h): the heuristic's candidates run on random operands of a
// product's shapes, the fastest of those with the first candidate's arithmetic and bits kept.
#include "core/cuda/lt_plans.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>

#include "core/cuda/context.h"
#include "sys/error.h"

namespace bert {

namespace {

// Runs of each candidate timed (after one untimed run, whose result is compared), in kRounds rounds that
// take the candidates in turn; a candidate's time is its best round's. One pass candidate after candidate
// favoured the later ones while the GPU's clocks were still rising (a run's first step tunes), and kept
// candidates that one pass had timed faster by chance.
constexpr int kTimedRuns = 8;
constexpr int kRounds = 3;

// *differ += how many of the n 16-bit words of x and y differ (16 bits: D's element types are 2 or 4 bytes).
__global__ void count_differences(const uint16_t* x, const uint16_t* y, std::size_t n, unsigned int* differ) {
  unsigned int local = 0;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    local += x[i] != y[i];
  if (local) atomicAdd(differ, local);
}

// x (an operand's extent) = values in (-1, 1) of its type from a hash of (seed, index): every mantissa
// bit random.
__global__ void random_fill(void* x, LtExtent extent, uint32_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < extent.elements;
       i += std::size_t(gridDim.x) * blockDim.x) {
    uint64_t h = (uint64_t(seed) << 40) ^ i;
    h = (h ^ (h >> 31)) * 0x7FB5D329728EA185ull;
    h = (h ^ (h >> 27)) * 0x81DADEF4BC2DD44Dull;
    h ^= h >> 33;
    const float v = float(int32_t(h)) * 0x1.0p-31f;
    if (extent.element_bytes == 2)
      static_cast<__nv_bfloat16*>(x)[i] = __float2bfloat16_rn(v);
    else
      static_cast<float*>(x)[i] = v;
  }
}

// Device memory that tuning borrows, freed when it ends (cudaMalloc and cudaFree: outside the context's
// allocator, so nothing of a recorded graph's changes).
struct Scratch {
  void* p = nullptr;
  explicit Scratch(std::size_t bytes) {
    if (cudaMalloc(&p, bytes) != cudaSuccess) {
      (void)cudaGetLastError();  // not an error of the run: tuning does without
      p = nullptr;
    }
  }
  ~Scratch() {
    if (p) cudaFree(p);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

// One of an algorithm's configuration attributes (16, 32 or 64 bits: asked first how many).
uint64_t config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attribute) {
  std::size_t bytes = 0;
  BERT_CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(&algo, attribute, nullptr, 0, &bytes));
  BERT_CHECK(bytes <= sizeof(uint64_t), "cuBLASLt: an algorithm attribute of more than 8 bytes");
  uint64_t value = 0;  // little-endian: a narrower attribute fills the low bytes
  BERT_CUBLAS_CHECK(cublasLtMatmulAlgoConfigGetAttribute(&algo, attribute, &value, bytes, &bytes));
  return value;
}

// Whether b sums like a: the same kernel family, inner (instruction) shape, split of K and reduction of the
// splits; what may differ (the tile of D a block makes, their order, the pipeline's depth) does not change
// the order in which any one element's products are added.
bool same_arithmetic(const cublasLtMatmulAlgo_t& a, const cublasLtMatmulAlgo_t& b) {
  for (const auto attribute : {CUBLASLT_ALGO_CONFIG_ID, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID,
                               CUBLASLT_ALGO_CONFIG_SPLITK_NUM, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME})
    if (config(a, attribute) != config(b, attribute)) return false;
  return true;
}

struct Events {
  cudaEvent_t start = nullptr, stop = nullptr;
  Events() {
    BERT_CUDA_CHECK(cudaEventCreate(&start));
    BERT_CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~Events() {
    cudaEventDestroy(stop);
    cudaEventDestroy(start);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
};

}  // namespace

void tune(const CudaContext& c, LtPlan& plan, const LtCall& call) {
  const auto stream = reinterpret_cast<cudaStream_t>(c.stream);
  if (c.capturing) return;  // kept for a later call that runs
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  BERT_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return;
  const auto& candidates = plan.candidates;
  const int count = plan.candidate_count;
  plan.candidate_count = 0;  // tried once, whatever happens
  plan.tuning = {};
  if (count < 2 || call.multiply_adds < kTunedProducts) return;
  const std::size_t a_bytes = call.a.elements * call.a.element_bytes, b_bytes = call.b.elements * call.b.element_bytes,
                    d_bytes = call.d.elements * call.d.element_bytes;
  const bool reads_c = *call.beta != 0.0f;
  Scratch a(a_bytes), b(b_bytes), c_in(reads_c ? d_bytes : 1), first(d_bytes), other(d_bytes),
      differ(sizeof(unsigned int));
  if (!a.p || !b.p || !c_in.p || !first.p || !other.p || !differ.p) return;
  // Operands of random values with every bit of their mantissas in use (the call's own may be special:
  // zeros, repeated rows), the same gaps (zero) between D's columns in both results.
  const unsigned grid = unsigned(c.sm_count) * 4;
  random_fill<<<grid, 256, 0, stream>>>(a.p, call.a, 1);
  random_fill<<<grid, 256, 0, stream>>>(b.p, call.b, 2);
  if (reads_c) random_fill<<<grid, 256, 0, stream>>>(c_in.p, call.d, 3);
  BERT_CUDA_LAUNCHED();
  BERT_CUDA_CHECK(cudaMemsetAsync(first.p, 0, d_bytes, stream));
  BERT_CUDA_CHECK(cudaMemsetAsync(other.p, 0, d_bytes, stream));
  auto lt = reinterpret_cast<cublasLtHandle_t>(c.cublas_lt);
  auto run = [&](const cublasLtMatmulAlgo_t& algo, void* out) {
    return cublasLtMatmul(lt, plan.desc, call.alpha, a.p, plan.a, b.p, plan.b, call.beta, reads_c ? c_in.p : out,
                          plan.d, out, plan.d, &algo, c.cublas_workspace, c.cublas_workspace_bytes, stream);
  };
  Events events;
  auto time_runs = [&](const cublasLtMatmulAlgo_t& algo) {
    BERT_CUDA_CHECK(cudaEventRecord(events.start, stream));
    for (int r = 0; r < kTimedRuns; ++r) BERT_CUBLAS_CHECK(run(algo, other.p));
    BERT_CUDA_CHECK(cudaEventRecord(events.stop, stream));
    BERT_CUDA_CHECK(cudaEventSynchronize(events.stop));
    float ms = 0;
    BERT_CUDA_CHECK(cudaEventElapsedTime(&ms, events.start, events.stop));
    return 1000.0 * ms / kTimedRuns;
  };
  if (run(candidates[0], first.p) != CUBLAS_STATUS_SUCCESS) return;  // the call itself will report it
  const std::size_t words = d_bytes / 2;
  auto& t = plan.tuning;
  int same[LtPlan::kMaxCandidates];  // the candidates that give the first's bits (the first included)
  for (int i = 0; i < count; ++i) {
    if (!same_arithmetic(candidates[0], candidates[i])) continue;
    if (run(candidates[i], other.p) != CUBLAS_STATUS_SUCCESS) continue;  // a candidate that does not run here
    ++t.ran;
    BERT_CUDA_CHECK(cudaMemsetAsync(differ.p, 0, sizeof(unsigned int), stream));
    count_differences<<<grid, 256, 0, stream>>>(static_cast<const uint16_t*>(first.p),
                                                static_cast<const uint16_t*>(other.p), words,
                                                static_cast<unsigned int*>(differ.p));
    BERT_CUDA_LAUNCHED();
    unsigned int differences = 0;
    BERT_CUDA_CHECK(cudaMemcpyAsync(&differences, differ.p, sizeof differences, cudaMemcpyDeviceToHost, stream));
    BERT_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (differences) continue;
    same[t.identical++] = i;
  }
  if (t.identical == 0 || same[0] != 0) return;  // the first did not give its own bits: keep it untuned
  double best[LtPlan::kMaxCandidates];
  std::fill(best, best + t.identical, 1e30);
  for (int round = 0; round < kRounds; ++round)
    for (int k = 0; k < t.identical; ++k) best[k] = std::min(best[k], time_runs(candidates[same[k]]));
  t.first_us = t.chosen_us = best[0];
  for (int k = 1; k < t.identical; ++k)
    if (best[k] < t.chosen_us) t.chosen = same[k], t.chosen_us = best[k];
  plan.algo = candidates[t.chosen];
  t.done = true;
}

GemmTuning summarize_tuning(const CudaContext& c) {
  GemmTuning summary;
  for (const auto& [key, plan] : c.lt_plans->plans) {
    if (!plan.tuning.done) continue;
    ++summary.tuned;
    summary.moved += plan.tuning.chosen != 0;
    summary.first_us += plan.tuning.first_us;
    summary.chosen_us += plan.tuning.chosen_us;
  }
  return summary;
}

std::string GemmTuning::describe() const {
  char text[200];
  std::snprintf(text, sizeof text,
                "GEMM tuning: %d products tuned, %d run a faster algorithm with the same bits; one of each: %.1f us "
                "(cuBLASLt's first choice) -> %.1f us",
                tuned, moved, first_us, chosen_us);
  return text;
}

}  // namespace bert
