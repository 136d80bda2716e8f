// Softmax with an additive mask (and softmax_dropout: the dropout and the output's quantizer in the same
// kernels) on a CUDA device, forward and backward side by side like ops/softmax.cpp. One warp per row.
#include "ops/cuda/common.cuh"
#include "ops/cuda/fake_quantize.cuh"
#include "ops/cuda/rows.cuh"
#include "ops/cuda_impl.h"

namespace bert::ops::cuda_impl {

namespace {

template <typename A>
__global__ void softmax_forward(A* y, const A* x, const float* mask, int64_t rows, int64_t k, int64_t rows_per_item) {
  const int64_t r = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const A* in = x + r * k;
  const float* m = mask ? mask + (r / rows_per_item) * k : nullptr;
  A* out = y + r * k;
  float max = -INFINITY;
  for (int64_t j = lane; j < k; j += 32) max = fmaxf(max, cuda::to_float(in[j]) + (m ? m[j] : 0.0f));
  max = cuda::warp_max(max);
  float sum = 0;
  for (int64_t j = lane; j < k; j += 32) {
    const float e = expf(cuda::to_float(in[j]) + (m ? m[j] : 0.0f) - max);
    if constexpr (std::is_same_v<A, float>) out[j] = e;  // kept for the scaling pass below
    sum += e;
  }
  const float inv = 1.0f / cuda::warp_sum(sum);
  for (int64_t j = lane; j < k; j += 32) {
    if constexpr (std::is_same_v<A, float>) {
      out[j] *= inv;
    } else {  // the exponential again: a BF16 output would have rounded it before the scaling
      out[j] = cuda::from_float<A>(expf(cuda::to_float(in[j]) + (m ? m[j] : 0.0f) - max) * inv);
    }
  }
}

template <typename A>
__global__ void softmax_backward(A* dx, const A* dy, const A* y, int64_t rows, int64_t k, bool accumulate) {
  const int64_t r = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const A *yr = y + r * k, *dyr = dy + r * k;
  float dot = 0;
  for (int64_t j = lane; j < k; j += 32) dot += cuda::to_float(dyr[j]) * cuda::to_float(yr[j]);
  dot = cuda::warp_sum(dot);
  for (int64_t j = lane; j < k; j += 32)
    cuda::store_grad(dx, r * k + j, cuda::to_float(yr[j]) * (cuda::to_float(dyr[j]) - dot), accumulate);
}

// Softmax rows held in registers: one warp a row, lane l holding elements (c 32 + l) 4 + w (w < 4) for c < C,
// so a row of k <= 128 C elements (k % 4 == 0) is read once and written once, 4 elements an access.
// Besides the probabilities y the kernel can write a second output `out` (RowOutput): their dropout (draws
// from DropoutDraws, which the backward makes again) and/or their fake quantization (a per-tensor scale),
// with the values of the unfused ops in sequence: the probabilities rounded to A, times the dropout's
// keep scale (or 0), then divided by the scale, rounded half to even and clamped, in float.
// The dropout after the softmax: its draws (core/rng.h's DropoutDraws, from the stream's element `first` on),
// made again by the backward from the same counters instead of keeping a flag per probability.
struct RowDropout {
  bool on;  // false: no dropout
  uint64_t seed, first;
  uint32_t threshold;
  float keep_scale;
};
template <typename A>
struct RowOutput {
  A* out;  // nullptr: softmax alone
  RowDropout drop;
  const float* scale;  // nullptr: no quantizer
  float lo, hi;
  unsigned long long* clipped;  // saturated elements, or nullptr
};
// Rows a warp holds at once in the softmax kernels: short rows several, so that each lane has as many
// loads in flight as for a row of 512.
template <int C>
constexpr int kRowsPerWarp = C >= 4 ? 1 : 4 / C;
template <int C>
unsigned softmax_blocks(int64_t rows) {
  const int64_t per_block = int64_t(kWarpsPerBlock) * kRowsPerWarp<C>;
  return static_cast<unsigned>((rows + per_block - 1) / per_block);
}

// The dropout's multiplier of 4 consecutive elements from element i (1 without dropout): keep_scale or 0.
__device__ __forceinline__ void row_slopes(const RowDropout& d, int64_t i, float (&slope)[4]) {
  bool kept[4] = {true, true, true, true};
  if (d.on) cuda::draw_keeps<4>(kept, d.seed, d.first, i, d.threshold);
  for (int w = 0; w < 4; ++w) slope[w] = d.on ? (kept[w] ? d.keep_scale : 0.0f) : 1.0f;
}

template <int C, typename A, bool kFull>
__global__ void softmax_rows_forward(A* y, const A* x, const float* mask, int64_t rows, int width,
                                     int64_t rows_per_item, RowOutput<A> d) {
  const int k = kFull ? C * 128 : width;  // kFull: rows of 128 C (with_full_rows), no bounds test a pack
  __shared__ int64_t shared[32];
  constexpr int R = kRowsPerWarp<C>;
  const int64_t first_row = (blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32) * R;
  const int lane = threadIdx.x % 32;
  // No early return for rows past the end: the saturation count below is a block's sum.
  float v[R][C][4], max[R], inv[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int64_t r = first_row + i;
    // The item's mask row: a 32-bit division (rows < 2^32, checked on the host), not a 64-bit one.
    const float* m = mask && r < rows ? mask + int64_t(uint32_t(r) / uint32_t(rows_per_item)) * k : nullptr;
    max[i] = -INFINITY;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int j = (c * 32 + lane) * 4;
      if (r < rows && j < k) {
        const cuda::Pack<A, 4> p = cuda::load_pack<4>(x + r * k + j);
        cuda::Pack<float, 4> a{};
        if (m) a = cuda::load_pack<4>(m + j);
        for (int w = 0; w < 4; ++w) max[i] = fmaxf(max[i], v[i][c][w] = cuda::to_float(p.v[w]) + a.v[w]);
      } else {
        for (int w = 0; w < 4; ++w) v[i][c][w] = -INFINITY;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < R; ++i) max[i] = cuda::warp_max(max[i]);
#pragma unroll
  for (int i = 0; i < R; ++i) {
    float sum = 0;
    if (max[i] != -INFINITY)  // a row past the end: nothing to sum (its exponentials would be NaN)
#pragma unroll
      for (int c = 0; c < C; ++c)
        for (int w = 0; w < 4; ++w) sum += v[i][c][w] = expf(v[i][c][w] - max[i]);
    inv[i] = sum;
  }
#pragma unroll
  for (int i = 0; i < R; ++i) inv[i] = 1.0f / cuda::warp_sum(inv[i]);
  int clipped = 0;  // at most 4 R C
  const cuda::ScaleDivision divide(d.scale ? *d.scale : 1.0f);
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int64_t r = first_row + i;
    if (r >= rows) continue;  // (not break: the loops unroll, the arrays stay in registers)
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int j = (c * 32 + lane) * 4;
      if (j >= k) continue;
      cuda::Pack<A, 4> out;
      for (int w = 0; w < 4; ++w) out.v[w] = cuda::from_float<A>(v[i][c][w] * inv[i]);
      cuda::store_pack<4>(y + r * k + j, out);
      if (!d.out) continue;
      float slope[4];
      row_slopes(d.drop, r * k + j, slope);
      cuda::Pack<A, 4> second;
      for (int w = 0; w < 4; ++w) {
        const float e = cuda::to_float(out.v[w]) * slope[w];
        second.v[w] = cuda::from_float<A>(d.scale ? cuda::fake_quantize_value(e, divide, d.lo, d.hi, clipped) : e);
      }
      cuda::store_pack<4>(d.out + r * k + j, second);
    }
  }
  if (d.clipped) {
    const int64_t total = cuda::block_sum(int64_t{clipped}, shared);
    if (threadIdx.x == 0 && total) atomicAdd(d.clipped, static_cast<unsigned long long>(total));
  }
}

// The backward's quantizer (RowOutput's): the scale gradient's destination, summed as
// cuda::add_scale_gradient does.
struct RowQuantizeGrad {
  const float* scale;  // nullptr: no quantizer
  float lo, hi;
  float* ds;  // nullptr: no scale gradient
  double grad_scale;
  double* partial;
  unsigned int* arrivals;
};

// dx = y (g - sum_j g_j y_j) with g = dy, or with dropout after the softmax g = dy keep / (1 - p) for the
// gradient dy of the dropped output; with a quantizer after them g is dy inside its range, 0 outside
// (straight through), and the scale's gradient adds up dy (q - u) as fake_quantize's does. The rows in
// registers as above.
template <int C, typename A, bool kFull>
__global__ void softmax_rows_backward(A* dx, const A* dy, const A* y, RowDropout drop, RowQuantizeGrad q, int64_t rows,
                                      int width, bool accumulate) {
  const int k = kFull ? C * 128 : width;
  constexpr int R = kRowsPerWarp<C>;
  const int64_t first_row = (blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32) * R;
  const int lane = threadIdx.x % 32;
  // No early return for rows past the end: the scale gradient below is a block's sum.
  const cuda::ScaleDivision divide(q.scale ? *q.scale : 1.0f);
  double acc = 0;
  float yv[R][C][4], gv[R][C][4], dot[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int64_t r = first_row + i;
    dot[i] = 0;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int j = (c * 32 + lane) * 4;
      if (r >= rows || j >= k) continue;
      const cuda::Pack<A, 4> py = cuda::load_pack<4>(y + r * k + j), pd = cuda::load_pack<4>(dy + r * k + j);
      float slopes[4];
      row_slopes(drop, r * k + j, slopes);  // the forward's draws again
      float part = 0;                       // this pack's share of the scale gradient
      for (int w = 0; w < 4; ++w) {
        yv[i][c][w] = cuda::to_float(py.v[w]);
        const float d = cuda::to_float(pd.v[w]);
        const float slope = slopes[w];
        gv[i][c][w] = q.scale ? cuda::fake_quantize_value_grad(yv[i][c][w] * slope, d, slope, divide, q.lo, q.hi, part)
                              : d * slope;
        dot[i] += gv[i][c][w] * yv[i][c][w];
      }
      acc += part;
    }
  }
#pragma unroll
  for (int i = 0; i < R; ++i) dot[i] = cuda::warp_sum(dot[i]);
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int64_t r = first_row + i;
    if (r >= rows) continue;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int j = (c * 32 + lane) * 4;
      if (j >= k) continue;
      cuda::Pack<A, 4> out;
      if (accumulate) out = cuda::load_pack<4>(dx + r * k + j);
      for (int w = 0; w < 4; ++w) {
        const float v = yv[i][c][w] * (gv[i][c][w] - dot[i]);
        out.v[w] = cuda::from_float<A>(accumulate ? cuda::to_float(out.v[w]) + v : v);
      }
      cuda::store_pack<4>(dx + r * k + j, out);
    }
  }
  if (q.ds) cuda::add_scale_gradient(acc, q.ds, q.grad_scale, q.partial, q.arrivals);
}

}  // namespace

namespace {

// The mask (B, K) of softmax's x as floats on the device (nullptr for none), and the rows of one batch item.
const float* softmax_mask(Graph<float>& g, Var x, Var mask, int64_t& rows_per_item) {
  const Shape xs = g.shape(x);
  rows_per_item = xs.rows();
  if (!mask.valid()) return nullptr;
  const Shape ms = g.shape(mask);
  BERT_CHECK(!g.requires_grad(mask), "softmax: the mask is a constant; its gradient is not supported");
  BERT_CHECK(xs.rank() >= 2 && ms == Shape({xs[0], xs.last()}),
             "softmax: mask " + ms.str() + " must be (B, K) for x " + xs.str());
  rows_per_item = xs.rows() / xs[0];
  return g.value(mask).data();
}

// The dropped-out probabilities formed again from the saved ones (softmax_dropout_again): each times its
// factor from the redrawn draws, rounded to A, as softmax_rows_forward computes its second output.
template <typename A>
__global__ void dropped_probabilities(A* out, const A* probs, RowDropout drop, int64_t n) {
  BERT_GRID_STRIDE_PACKS(i, n, 4) {
    const cuda::Pack<A, 4> p = cuda::load_pack<4>(probs + i);
    float slope[4];
    row_slopes(drop, i, slope);
    cuda::Pack<A, 4> y;
    for (int w = 0; w < 4; ++w) y.v[w] = cuda::from_float<A>(cuda::to_float(p.v[w]) * slope[w]);
    cuda::store_pack<4>(out + i, y);
  }
}

// softmax's backward into x's gradient from the probabilities y and the gradient of `out` (y itself, or
// y's dropout `drop`, and/or its fake quantization q).
void softmax_backward_into(Graph<float>& g, Var x, Var out, const void* y, const RowDropout& drop, RowQuantizeGrad q,
                           int64_t rows, int64_t k, DType dtype) {
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    const auto dx = g.raw_grad_target(x);
    A* dxp = cuda::typed<A>(dx.data);
    const A* dy = cuda::typed<A>(g.grad_data(out));
    const A* yv = static_cast<const A*>(y);
    const bool ran = with_row_chunks(k, {dxp, dy, yv}, [&](auto chunks) {
      constexpr int C = decltype(chunks)::value;
      const unsigned blocks = softmax_blocks<C>(rows);
      if (q.ds && blocks > 1) q.partial = g.scratch<double>(blocks);
      with_full_rows<C>(k, [&](auto full) {
        softmax_rows_backward<C, A, decltype(full)::value>
            <<<blocks, 32 * kWarpsPerBlock, 0, cuda::stream(g)>>>(dxp, dy, yv, drop, q, rows, int(k), dx.accumulate);
      });
    });
    BERT_CHECK(ran || (!drop.on && !q.scale), "softmax_dropout: the backward's operands are not 16-byte aligned");
    if (!ran)
      softmax_backward<A><<<row_blocks(rows), 32 * kWarpsPerBlock, 0, cuda::stream(g)>>>(dxp, dy, yv, rows, k,
                                                                                        dx.accumulate);
    BERT_CUDA_LAUNCHED();
  });
}

// The softmax of x with its dropout (p > 0) and/or its output's quantizer (q) in the same kernels: the
// probabilities are saved for the backward (a workspace allocation, 64-byte aligned like the output); the
// dropout's draws are made again there (no keep flags kept). Nullptr where the register kernels do not hold
// the rows.
// With `again` set (dropout, no quantizer), the output goes to transient slot `slot` (Graph::emit_transient)
// and `again` forms it there once more from the saved probabilities, for a reader's backward.
Var softmax_output(Graph<float>& g, Var x, Var mask, double p, Rng* rng, const QuantizeOutput* q,
                   DroppedAgain* again = nullptr, int slot = 0) {
  const Shape xs = g.shape(x);
  const int64_t k = xs.last(), rows = xs.rows(), n = xs.numel();
  int64_t rows_per_item = 0;
  const float* mv = softmax_mask(g, x, mask, rows_per_item);
  x = as_activation(g, x);
  if (!with_row_chunks(k, {g.data(x), mv}, [](auto) {}) || rows > int64_t{UINT32_MAX}) return Var{};
  const DType dtype = g.dtype(x);
  Var y = q       ? g.emit(xs, {x, q->scale}, dtype)
          : again ? g.emit_transient(xs, {x}, dtype, slot)
                  : g.emit(xs, {x}, dtype);
  const RowDropout drop{p > 0, p > 0 ? rng->state().seed : 0,
                        p > 0 ? DropoutDraws::reserve(*rng, static_cast<uint64_t>(n)) : 0,
                        p > 0 ? DropoutDraws::threshold(p) : 0u, static_cast<float>(1.0 / (1.0 - p))};
  const cuda::QuantizeLaunch quantize = q ? cuda::fused_launch(g, *q, n) : cuda::QuantizeLaunch{};
  void* probs = nullptr;
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    A* pv = g.scratch<A>(n);
    probs = pv;
    const RowOutput<A> d{cuda::typed<A>(g.data(y)),
                         drop,
                         q ? quantize.scale : nullptr,
                         quantize.lo,
                         quantize.hi,
                         reinterpret_cast<unsigned long long*>(quantize.clipped)};
    with_row_chunks(k, {}, [&](auto chunks) {
      constexpr int C = decltype(chunks)::value;
      with_full_rows<C>(k, [&](auto full) {
        softmax_rows_forward<C, A, decltype(full)::value>
            <<<softmax_blocks<C>(rows), 32 * kWarpsPerBlock, 0, cuda::stream(g)>>>(pv, cuda::typed<A>(g.data(x)), mv,
                                                                                   rows, int(k), rows_per_item, d);
      });
    });
    BERT_CUDA_LAUNCHED();
    if (again)
      *again = [probs = pv, drop, n, slot](Graph<float>& g) -> void* {
        A* out = g.transient<A>(slot, n);
        const int64_t packs = n / 4;
        const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((packs + 255) / 256, 65535));
        dropped_probabilities<A><<<blocks, 256, 0, cuda::stream(g)>>>(out, probs, drop, n);
        BERT_CUDA_LAUNCHED();
        return out;
      };
  });
  const Var scale = q ? q->scale : Var{};
  g.on_backward(y, [x, y, scale, quantize, probs, drop, k, rows, dtype](Graph<float>& g) {
    RowQuantizeGrad back{};
    if (scale.valid()) {
      back = {quantize.scale,
              quantize.lo,
              quantize.hi,
              nullptr,
              quantize.grad_scale,
              nullptr,
              cuda::context(g.device()).arrivals};
      if (g.requires_grad(scale)) back.ds = g.grad(scale).data();
    }
    softmax_backward_into(g, x, y, probs, drop, back, rows, k, dtype);
  });
  return y;
}

}  // namespace

Var softmax(Graph<float>& g, Var x, Var mask) {
  const Shape xs = g.shape(x);
  const int64_t k = xs.last(), rows = xs.rows();
  int64_t rows_per_item = 0;
  const float* mv = softmax_mask(g, x, mask, rows_per_item);
  x = as_activation(g, x);
  const DType dtype = g.dtype(x);
  Var y = g.emit(xs, {x}, dtype);
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    A* yv = cuda::typed<A>(g.data(y));
    const A* xv = cuda::typed<A>(g.data(x));
    const bool ran = rows <= int64_t{UINT32_MAX} && with_row_chunks(k, {yv, xv, mv}, [&](auto chunks) {
                       constexpr int C = decltype(chunks)::value;
                       with_full_rows<C>(k, [&](auto full) {
                         softmax_rows_forward<C, A, decltype(full)::value>
                             <<<softmax_blocks<C>(rows), 32 * kWarpsPerBlock, 0, cuda::stream(g)>>>(
                                 yv, xv, mv, rows, int(k), rows_per_item, RowOutput<A>{});
                       });
                     });
    if (!ran)
      softmax_forward<A>
          <<<row_blocks(rows), 32 * kWarpsPerBlock, 0, cuda::stream(g)>>>(yv, xv, mv, rows, k, rows_per_item);
    BERT_CUDA_LAUNCHED();
  });
  g.on_backward(y, [x, y, k, rows, dtype](Graph<float>& g) {
    softmax_backward_into(g, x, y, g.data(y), RowDropout{}, RowQuantizeGrad{}, rows, k, dtype);
  });
  return y;
}

// Rows the register kernels do not hold (longer than 1024, not a multiple of 4) take the ops in sequence.
Var softmax_dropout(Graph<float>& g, Var x, Var mask, double p, Rng& rng) {
  const Var y = softmax_output(g, x, mask, p, &rng, nullptr);
  return y.valid() ? y : dropout(g, softmax(g, x, mask), p, rng);
}

Var softmax_dropout_again(Graph<float>& g, Var x, Var mask, double p, Rng& rng, int slot, DroppedAgain& again) {
  return softmax_output(g, x, mask, p, &rng, nullptr, &again, slot);
}

Var softmax_dropout(Graph<float>& g, Var x, Var mask, double p, Rng& rng, const QuantizeOutput& q) {
  const Var y = softmax_output(g, x, mask, p, &rng, &q);
  if (y.valid()) return y;
  const Var probs = softmax(g, x, mask);
  return p > 0 ? dropout(g, probs, p, rng, q)
               : fake_quantize(g, probs, q.scale, q.qmin, q.qmax, q.grad_scale, q.clipped);
}

}  // namespace bert::ops::cuda_impl
