// cuBLASLt plans: a product's descriptors (operation, epilogue, matrix layouts) and the algorithm chosen
// for it, kept per shape by the device's context (CudaContext::lt_plans). A training step makes the same
// products every step: creating the descriptors and asking the heuristic in each call cost host time
// while the GPU waited for its next kernel. ops/matmul.cu makes and uses them.
//
// The algorithm: cuBLASLt's heuristic ranks candidates without running them, and its first is often not
// the fastest (one H200, BERT-base's products at batch 64: up to 19% slower than another candidate). So
// the first time a product of at least kTunedProducts multiply-adds runs outside a CUDA graph recording,
// tune() runs the candidates on random operands of its shapes and keeps the fastest of those that do the
// same arithmetic as the first: the same kernel family, inner shape and split of K (tiles and their order
// over D may differ), and, checked, the first's result bit for bit. Tuning changes no value, so runs stay
// reproducible (a resumed run repeats the uninterrupted one, a recorded step the step op by op). Products
// first met while a step is recorded, and smaller ones, keep the heuristic's first.
#pragma once

#include <cublasLt.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

namespace bert {

struct CudaContext;  // core/cuda/context.h

// What tune() found for a plan: which candidate runs (0: the heuristic's first), how many gave the first's
// bits (itself included) of how many ran, and one run's time with the first and with the chosen (us).
struct LtTuning {
  bool done = false;
  int chosen = 0, identical = 0, ran = 0;
  double first_us = 0, chosen_us = 0;
};

struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;  // false: cuBLASLt has no algorithm for this product (the caller does without it)
  // The heuristic's candidates, best first (algo is the first), until tune() has run them (count 0 after).
  static constexpr int kMaxCandidates = 8;
  std::array<cublasLtMatmulAlgo_t, kMaxCandidates> candidates{};
  int candidate_count = 0;
  LtTuning tuning;

  LtPlan() = default;
  LtPlan(const LtPlan&) = delete;
  LtPlan& operator=(const LtPlan&) = delete;
  ~LtPlan() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

// Plans by what decides them: transposes, sizes, leading dimensions, types, epilogue, batch count,
// strides and the epilogue auxiliary matrix's leading dimension (pointers and scalars are set per call).
struct LtPlans {
  using Key = std::array<int64_t, 19>;
  std::map<Key, LtPlan> plans;
  bool tune = true;  // false: plans made from now on keep the heuristic's first candidate
};

// An operand of a product as tune() makes one: elements from its first to its last (strides and leading
// dimensions included), of 2 (BF16) or 4 bytes (FP32).
struct LtExtent {
  std::size_t elements;
  int element_bytes;
};
// One call of a plan's product, D = alpha op(A) op(B) + beta C (plus the epilogue the plan's descriptor
// holds, its pointers already set): its size, scalars and operands' extents.
struct LtCall {
  double multiply_adds;  // m n k, times the batch
  const float* alpha;
  const float* beta;
  LtExtent a, b, d;
};

// Products smaller than this keep the heuristic's choice (their time is small, and on few elements two
// orders of summation give the same bits by chance more often).
constexpr double kTunedProducts = double(1 << 27);

// Chooses plan.algo from plan.candidates as the note above says, on random operands of the call's shapes
// in scratch memory (nothing of the call's is read or written). Waits for the stream. Where scratch memory
// cannot be had it keeps the first candidate; while the stream is being recorded it waits for a later call.
void tune(const CudaContext& c, LtPlan& plan, const LtCall& call);

// What tuning did across a context's plans: products tuned, how many of them run another algorithm than
// the heuristic's first (with the same bits), and one run of each at the heuristic's choice and at the one
// kept (microseconds); describe() gives it as one line.
struct GemmTuning {
  int tuned = 0, moved = 0;
  double first_us = 0, chosen_us = 0;
  std::string describe() const;
};
GemmTuning summarize_tuning(const CudaContext& c);

}  // namespace bert
