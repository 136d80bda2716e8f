// The row-wise cross-entropy of ops/reduce.cu on logits held in memory with a row stride of their own:
// for ops that make the logits themselves (linear_cross_entropy_scores in ops/matmul.cu reads the MLM
// decoder's GEMM output in its padded layout, in place). cross_entropy and cross_entropy_scores are
// these on a node's own logits.
#pragma once

#include <cstdint>
#include <span>

#include "core/graph.h"

namespace bert::ops::cuda_impl {

// The rows' targets and weights on the device (weights normalised on the host exactly as the CPU's
// cross_entropy does; a row whose target is ignore_index has weight 0 and target 0) and the storage for
// each row's log-sum-exp, which the backward pass reads.
struct CrossEntropyRows {
  int64_t n = 0, c = 0;  // rows, classes
  const int32_t* target = nullptr;
  const float* weight = nullptr;
  float* logsumexp = nullptr;
};
CrossEntropyRows prepare_cross_entropy(Graph<float>& g, std::span<const int32_t> targets,
                                       std::span<const float> weights, int32_t ignore_index, int64_t classes);

// loss[0] = the weighted mean over the rows of logsumexp(z_r) - z_r[target_r], z (n, c) of `dtype` with
// rows ld apart; with `argmax` (device, n) also each row's first largest column.
void cross_entropy_forward(Graph<float>& g, const CrossEntropyRows& rows, DType dtype, const void* z, int64_t ld,
                           int32_t* argmax, float* loss);
// dz (+)= upstream[0] w_r (softmax(z_r) - onehot(target_r)), dz with the same row stride ld as z; where
// ld > c, columns c..ld-1 of each dz row are set to zero (not added to).
void cross_entropy_backward(Graph<float>& g, const CrossEntropyRows& rows, DType dtype, const void* z, int64_t ld,
                            const float* upstream, void* dz, bool accumulate);
// cross_entropy_backward (dz set, not added to; dz may be z itself) with dbias (c) += the column sums of dz
// (a linear layer's bias gradient) from the same pass: each block sums its rows' columns, then the blocks'
// sums are added in a fixed order. The values of cross_entropy_backward then add_column_sums up to the
// order of the sums. false, with nothing done, where the layout does not suit it (rows ld apart not a whole
// number of 16-byte packs): call those two then.
bool cross_entropy_backward_with_column_sums(Graph<float>& g, const CrossEntropyRows& rows, DType dtype, const void* z,
                                             int64_t ld, const float* upstream, void* dz, float* dbias);

}  // namespace bert::ops::cuda_impl
