// The optimizer's CUDA kernels (train/optimizer.cu): AdamW and LAMB over the flat parameter buffers
// on the GPU, one launch for all parameters, and the gradients' global norm. Used by train/optimizer.cpp in
// a CUDA build only.
#pragma once

#include <cstdint>

#include "core/device.h"

namespace bert::train::cuda_impl {

// One parameter of the flat buffers: where it is and how it is updated.
struct Segment {
  int64_t offset = 0, size = 0;
  float weight_decay = 0, lr_multiplier = 1;
  float minimum = 0;  // values are clamped to at least this after the update when has_minimum
  int has_minimum = 0;
  int log_space = 0;  // Adam on log w, multiplicative update (Optimizer::set_log_space)
};

// Elements of one segment a block of the AdamW kernel updates, and that block's work: chunk `index` of
// segment `segment`. The table of chunks lists every segment's chunks, so no block idles.
constexpr int64_t kAdamChunk = 8192;
struct Chunk {
  int32_t segment = 0, index = 0;
};

struct AdamHyper {
  float lr, beta1, beta2, bias_correction1, bias_correction2, epsilon;
  float grad_scale;  // each gradient is multiplied by it as it is read (global-norm clipping)
};

// An update the GPU decides on by itself, so the host queues it without waiting for the step's losses and
// norm (Optimizer::queue_step). Lives in device memory: flag_nonfinite marks the step's losses,
// queue_sum_of_squares decides once the gradients' norm is known, the update kernels read the decision.
struct UpdateControl {
  int nonfinite = 0;  // set by flag_nonfinite when a loss is NaN or infinite; cleared by the decision
  int apply = 0;      // the decision: 1 updates, 0 skips (a non-finite loss or gradient norm)
  float grad_scale = 1, bias_correction1 = 1, bias_correction2 = 1;  // as AdamHyper's, for this update
  long long steps = 0;  // updates applied so far (Optimizer::steps), counted by the decisions
};
// What the decision needs besides the norm: clipping's maximum norm (<= 0: none) and Adam's betas.
struct UpdateRule {
  double max_norm = 0, beta1 = 0.9, beta2 = 0.999;
};
// Sets control->nonfinite where any of the device scalars values[0..n) is NaN or infinite (n <= 4).
constexpr int kMaxFlagged = 4;
void flag_nonfinite(const Device& device, const float* const* values, int n, UpdateControl* control);

// segments: device array of n_segments; largest: the largest segment's size; chunks: device array of
// n_chunks, every segment's kAdamChunk-element chunks (AdamW's blocks). w16: nullptr, or BF16 storage
// beside w (same offsets) that receives the new values rounded to nearest.
// control: nullptr (h as given), or the device's decision, which replaces h's grad_scale and bias corrections
// and skips the update where it says so.
void adamw_step(const Device& device, float* w, void* w16, const float* g, float* m, float* v, const Segment* segments,
                const Chunk* chunks, int n_chunks, AdamHyper h, const UpdateControl* control = nullptr);
// partials: 2 x ceil(largest / kAdamChunk) x n_segments doubles of scratch (lamb_partials).
void lamb_step(const Device& device, float* w, const float* g, float* m, float* v, const Segment* segments,
               int n_segments, int64_t largest, AdamHyper h, double* partials, const UpdateControl* control = nullptr);
int64_t lamb_partials(int n_segments, int64_t largest);
// The sum of squares of g (n elements), summed in double in a fixed order, left in device memory (valid
// until the next kernel that uses the context's reduction scratch): the address returned. With `decide`,
// the same kernel then decides the update there (UpdateControl) by `rule`.
const double* queue_sum_of_squares(const Device& device, const float* g, int64_t n, UpdateControl* decide = nullptr,
                                   UpdateRule rule = {});

}  // namespace bert::train::cuda_impl
