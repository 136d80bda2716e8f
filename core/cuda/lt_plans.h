// cuBLASLt plans: a product's descriptors (operation, epilogue, matrix layouts) and the algorithm the
// heuristic chose for it, kept per shape by the device's context (CudaContext::lt_plans). A training
// step makes the same products every step: creating the descriptors and asking the heuristic in each
// call cost host time while the GPU waited for its next kernel. ops/matmul.cu makes and uses them.
#pragma once

#include <cublasLt.h>

#include <array>
#include <cstdint>
#include <map>

namespace bert {

struct LtPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;  // false: cuBLASLt has no algorithm for this product (the caller does without it)

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

// Plans by what decides them: transposes, sizes, leading dimensions, types, epilogue, batch count and
// strides (pointers and scalars are set per call).
struct LtPlans {
  using Key = std::array<int64_t, 18>;
  std::map<Key, LtPlan> plans;
};

}  // namespace bert
