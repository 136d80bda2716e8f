// AdamW, LAMB and the gradients' global norm on the GPU: the same arithmetic as train/optimizer.cpp, over
// the arena's flat device buffers. Block row y of the grid walks parameter y, so one launch updates
// every parameter with its own decay, learning-rate multiplier and floor. Norms are summed in double
// in a fixed order.
#include <cmath>
#include <vector>

#include "ops/cuda/common.cuh"
#include "train/optimizer_cuda.h"

namespace bert::train::cuda_impl {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = kAdamChunk;  // elements per block along a parameter

unsigned chunks_for(int64_t largest) {
  return static_cast<unsigned>(std::max<int64_t>(1, (largest + kChunk - 1) / kChunk));
}

__device__ __forceinline__ float apply_floor(float w, const Segment& s) {
  return (s.has_minimum && !(w >= s.minimum)) ? s.minimum : w;  // also catches NaN
}

// Optimizer::set_log_space: moments of the gradient with respect to log w, a multiplicative update.
__device__ __forceinline__ void log_space_update(float& w, float g, float& m, float& v, const AdamHyper& h, float lr) {
  const float gl = (g * h.grad_scale) * w;
  m = h.beta1 * m + (1 - h.beta1) * gl;
  v = h.beta2 * v + (1 - h.beta2) * gl * gl;
  w *= expf(-lr * (m * h.bias_correction1) / (sqrtf(v * h.bias_correction2) + h.epsilon));
}

// Chunk `chunk` of a log-space segment, for AdamW and LAMB alike.
__device__ void log_space_block(float* w, const float* g, float* m, float* v, const Segment& s, const AdamHyper& h,
                                int64_t chunk) {
  const int64_t end = min(s.size, (chunk + 1) * kChunk);
  for (int64_t j = chunk * kChunk + threadIdx.x; j < end; j += blockDim.x) {
    const int64_t i = s.offset + j;
    float wi = w[i], mi = m[i], vi = v[i];
    log_space_update(wi, g[i], mi, vi, h, h.lr * s.lr_multiplier);
    w[i] = apply_floor(wi, s), m[i] = mi, v[i] = vi;
  }
}

// The device's decision (UpdateControl) into h; false where it skips the update. No control: h as given.
__device__ __forceinline__ bool take_decision(const UpdateControl* control, AdamHyper& h) {
  if (!control) return true;
  if (!control->apply) return false;
  h.grad_scale = control->grad_scale;
  h.bias_correction1 = control->bias_correction1;
  h.bias_correction2 = control->bias_correction2;
  return true;
}

// One AdamW element: decoupled decay first, as torch.optim.AdamW.
__device__ __forceinline__ void adamw_update(float& w, float g, float& m, float& v, const AdamHyper& h, float lr,
                                             float wd) {
  g *= h.grad_scale;
  m = h.beta1 * m + (1 - h.beta1) * g;
  v = h.beta2 * v + (1 - h.beta2) * g * g;
  w -= lr * (wd * w);
  w -= lr * (m * h.bias_correction1) / (sqrtf(v * h.bias_correction2) + h.epsilon);
}

// Block i updates chunk chunks[i]: 16-byte accesses where the chunk starts and ends on a multiple of 4.
// Where w16 is set, the new values rounded to BF16 are written there too (the arena's BF16 copy).
__global__ void adamw_kernel(float* w, cuda::bf16* w16, const float* g, float* m, float* v, const Segment* segments,
                             const Chunk* chunks, AdamHyper h, const UpdateControl* control) {
  if (!take_decision(control, h)) return;
  const Chunk c = chunks[blockIdx.x];
  const Segment s = segments[c.segment];
  const int64_t begin = s.offset + c.index * kChunk, end = s.offset + min(s.size, (c.index + 1) * kChunk);
  if (s.log_space) {
    log_space_block(w, g, m, v, s, h, c.index);
    if (w16)  // each thread rounds the elements it just wrote
      for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) w16[i] = cuda::from_float<cuda::bf16>(w[i]);
    return;
  }
  const float lr = h.lr * s.lr_multiplier, wd = s.weight_decay;
  if (begin % 4 == 0 && end % 4 == 0) {
    // kPacks packs of 4 a thread an iteration, all loaded before any is stored: more loads in flight
    // (BERT-base's step in BF16 on an H200, ncu: two packs 1.00 ms, four 0.875, eight 0.86).
    constexpr int kPacks = 4;
    for (int64_t i = begin + 4 * threadIdx.x; i < end; i += 4 * kPacks * blockDim.x) {
      cuda::Pack<float, 4> gi[kPacks], wi[kPacks], mi[kPacks], vi[kPacks];
#pragma unroll
      for (int p = 0; p < kPacks; ++p) {
        const int64_t e = i + p * 4 * int64_t(blockDim.x);
        if (e >= end) continue;
        gi[p] = cuda::load_pack<4>(g + e), wi[p] = cuda::load_pack<4>(w + e);
        mi[p] = cuda::load_pack<4>(m + e), vi[p] = cuda::load_pack<4>(v + e);
      }
#pragma unroll
      for (int p = 0; p < kPacks; ++p) {
        const int64_t e = i + p * 4 * int64_t(blockDim.x);
        if (e >= end) continue;
        for (int k = 0; k < 4; ++k) {
          adamw_update(wi[p].v[k], gi[p].v[k], mi[p].v[k], vi[p].v[k], h, lr, wd);
          wi[p].v[k] = apply_floor(wi[p].v[k], s);
        }
        cuda::store_pack<4>(w + e, wi[p]);
        cuda::store_pack<4>(m + e, mi[p]);
        cuda::store_pack<4>(v + e, vi[p]);
        if (w16) {
          cuda::Pack<cuda::bf16, 4> rounded;
          for (int k = 0; k < 4; ++k) rounded.v[k] = cuda::from_float<cuda::bf16>(wi[p].v[k]);
          cuda::store_pack<4>(w16 + e, rounded);
        }
      }
    }
    return;
  }
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float wi = w[i], mi = m[i], vi = v[i];
    adamw_update(wi, g[i], mi, vi, h, lr, wd);
    wi = apply_floor(wi, s);
    m[i] = mi, v[i] = vi, w[i] = wi;
    if (w16) w16[i] = cuda::from_float<cuda::bf16>(wi);
  }
}

// LAMB pass 1: moments, and per block the sums of w^2 and u^2 (u the Adam update plus decay).
__global__ void lamb_moments(float* w, const float* g, float* m, float* v, const Segment* segments, AdamHyper h,
                             double* partial_w, double* partial_u, const UpdateControl* control) {
  __shared__ double shared[32];
  if (!take_decision(control, h)) return;
  const Segment s = segments[blockIdx.y];
  const int64_t end = min(s.size, (int64_t(blockIdx.x) + 1) * kChunk);
  if (s.log_space) return log_space_block(w, g, m, v, s, h, blockIdx.x);  // no trust ratio; lamb_apply skips it
  double w2 = 0, u2 = 0;
  for (int64_t j = blockIdx.x * kChunk + threadIdx.x; j < end; j += blockDim.x) {
    const int64_t i = s.offset + j;
    const float gi = g[i] * h.grad_scale;
    const float mi = h.beta1 * m[i] + (1 - h.beta1) * gi;
    const float vi = h.beta2 * v[i] + (1 - h.beta2) * gi * gi;
    m[i] = mi, v[i] = vi;
    const float u = (mi * h.bias_correction1) / (sqrtf(vi * h.bias_correction2) + h.epsilon) + s.weight_decay * w[i];
    w2 += double(w[i]) * w[i];
    u2 += double(u) * u;
  }
  w2 = cuda::block_sum(w2, shared);
  u2 = cuda::block_sum(u2, shared);
  if (threadIdx.x == 0) {
    partial_w[blockIdx.y * gridDim.x + blockIdx.x] = w2;
    partial_u[blockIdx.y * gridDim.x + blockIdx.x] = u2;
  }
}

// LAMB pass 2: the trust ratio |w| / |u| of each parameter (partials summed in order), then the update.
__global__ void lamb_apply(float* w, const float* m, const float* v, const Segment* segments, AdamHyper h,
                           const double* partial_w, const double* partial_u, const UpdateControl* control) {
  if (!take_decision(control, h)) return;
  const Segment s = segments[blockIdx.y];
  if (s.log_space) return;  // done in lamb_moments
  double w2 = 0, u2 = 0;
  for (unsigned b = 0; b < gridDim.x; ++b) {
    w2 += partial_w[blockIdx.y * gridDim.x + b];
    u2 += partial_u[blockIdx.y * gridDim.x + b];
  }
  const double trust = (w2 > 0 && u2 > 0) ? sqrt(w2 / u2) : 1.0;
  const float scale = static_cast<float>(double(h.lr) * s.lr_multiplier * trust);
  const int64_t end = min(s.size, (int64_t(blockIdx.x) + 1) * kChunk);
  for (int64_t j = blockIdx.x * kChunk + threadIdx.x; j < end; j += blockDim.x) {
    const int64_t i = s.offset + j;
    const float wi = w[i];
    w[i] = apply_floor(wi - scale * ((m[i] * h.bias_correction1) / (sqrtf(v[i] * h.bias_correction2) + h.epsilon) +
                                     s.weight_decay * wi),
                       s);
  }
}

constexpr int kNormBlocks = 1024;
__global__ void sum_squares_partial(double* partial, const float* g, int64_t n) {
  __shared__ double shared[32];
  double acc = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(blockDim.x) * gridDim.x)
    acc += double(g[i]) * g[i];
  acc = cuda::block_sum(acc, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}
// The decision on a queued update, from the gradients' sum of squares: as TrainingStep decides on the host
// (clip_factor, Optimizer::step's bias corrections), one thread.
__device__ void decide_update(UpdateControl* c, double sum_of_squares, UpdateRule rule) {
  const double norm = sqrt(sum_of_squares);
  const bool finite = isfinite(norm);
  c->apply = c->nonfinite == 0 && finite;
  c->nonfinite = 0;
  c->grad_scale = (rule.max_norm > 0 && finite && norm > rule.max_norm) ? float(rule.max_norm / norm) : 1.0f;
  if (!c->apply) return;
  const double t = double(++c->steps);
  c->bias_correction1 = float(1.0 / (1.0 - pow(rule.beta1, t)));
  c->bias_correction2 = float(1.0 / (1.0 - pow(rule.beta2, t)));
}

__global__ void sum_partials(double* out, const double* partial, int n, UpdateControl* decide, UpdateRule rule) {
  __shared__ double shared[32];
  double acc = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) acc += partial[i];
  acc = cuda::block_sum(acc, shared);
  if (threadIdx.x != 0) return;
  out[0] = acc;
  if (decide) decide_update(decide, acc, rule);
}

struct Flagged {
  const float* values[kMaxFlagged];
};
__global__ void flag_nonfinite_kernel(Flagged f, int n, UpdateControl* control) {
  for (int i = 0; i < n; ++i)
    if (!isfinite(*f.values[i])) control->nonfinite = 1;
}
}  // namespace

void flag_nonfinite(const Device& device, const float* const* values, int n, UpdateControl* control) {
  BERT_CHECK(n >= 0 && n <= kMaxFlagged, "flag_nonfinite takes up to 4 values");
  if (n == 0) return;
  Flagged f{};
  for (int i = 0; i < n; ++i) f.values[i] = values[i];
  flag_nonfinite_kernel<<<1, 1, 0, cuda::stream(device)>>>(f, n, control);
  BERT_CUDA_LAUNCHED();
}

void adamw_step(const Device& device, float* w, void* w16, const float* g, float* m, float* v, const Segment* segments,
                const Chunk* chunks, int n_chunks, AdamHyper h, const UpdateControl* control) {
  adamw_kernel<<<unsigned(n_chunks), kThreads, 0, cuda::stream(device)>>>(w, static_cast<cuda::bf16*>(w16), g, m, v,
                                                                          segments, chunks, h, control);
  BERT_CUDA_LAUNCHED();
}

int64_t lamb_partials(int n_segments, int64_t largest) { return 2 * int64_t(chunks_for(largest)) * n_segments; }

void lamb_step(const Device& device, float* w, const float* g, float* m, float* v, const Segment* segments,
               int n_segments, int64_t largest, AdamHyper h, double* partials, const UpdateControl* control) {
  const dim3 grid(chunks_for(largest), unsigned(n_segments));
  double* partial_w = partials;
  double* partial_u = partial_w + grid.x * grid.y;
  lamb_moments<<<grid, kThreads, 0, cuda::stream(device)>>>(w, g, m, v, segments, h, partial_w, partial_u, control);
  BERT_CUDA_LAUNCHED();
  lamb_apply<<<grid, kThreads, 0, cuda::stream(device)>>>(w, m, v, segments, h, partial_w, partial_u, control);
  BERT_CUDA_LAUNCHED();
}

const double* queue_sum_of_squares(const Device& device, const float* g, int64_t n, UpdateControl* decide,
                                   UpdateRule rule) {
  const CudaContext& c = cuda::context(device);
  static_assert(kNormBlocks + 1 <= CudaContext::kReduceScratch);
  sum_squares_partial<<<kNormBlocks, kThreads, 0, c.stream>>>(c.reduce_scratch, g, n);
  BERT_CUDA_LAUNCHED();
  sum_partials<<<1, 1024, 0, c.stream>>>(c.reduce_scratch + kNormBlocks, c.reduce_scratch, kNormBlocks, decide, rule);
  BERT_CUDA_LAUNCHED();
  return c.reduce_scratch + kNormBlocks;
}

}  // namespace bert::train::cuda_impl
