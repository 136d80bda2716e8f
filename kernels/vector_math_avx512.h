// The single-precision kernels of kernels/vector_math.h compiled for AVX-512 inside a build for any x86-64,
// for its run-time choice (kernels/cpu_kernels.h). Call only where cpu_kernels_supported(CpuKernels::kAvx512).
// Same contracts as the build's kernels there (and the same tests against std::exp / std::erf).
#pragma once

#include <cstdint>

namespace bert::vec_avx512 {

void exp_shifted(const float* x, float shift, float* out, int64_t n);
float sum_exp_shifted(const float* x, float shift, int64_t n);
float max_of(const float* x, int64_t n);
float max_of_numbers(const float* x, int64_t n);
int64_t index_of(const float* x, int64_t n, float value);
void add_scaled_exp_shifted(const float* x, float shift, float scale, float* out, int64_t n);
void softmax(const float* x, const float* add, float* y, int64_t n);
void gelu(const float* x, float* y, int64_t n);
void gelu_backward(const float* x, const float* dy, float* dx, int64_t n, bool accumulate);

}  // namespace bert::vec_avx512
