// Softmax with an additive mask (and softmax_dropout: the dropout in the same kernels) on a CUDA device,
// forward and backward side by side like ops/softmax.cpp. One warp per row.
#include "ops/cuda/common.cuh"
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
// so a row of k <= 128 C elements (k % 4 == 0) is read once and written once, 4 elements an access. With
// dropout (d.dropped set) the kernel also writes dropout(y) and its keep flags (DropoutDraws' draws, the
// unfused dropout's: it rounds y to A first, as that op reads it).
template <typename A>
struct RowDropout {
  A* dropped;  // nullptr: softmax alone
  uint8_t* keep;
  uint64_t seed, first;
  uint32_t threshold;
  float keep_scale;
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

template <int C, typename A>
__global__ void softmax_rows_forward(A* y, const A* x, const float* mask, int64_t rows, int k, int64_t rows_per_item,
                                     RowDropout<A> d) {
  constexpr int R = kRowsPerWarp<C>;
  const int64_t first_row = (blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32) * R;
  const int lane = threadIdx.x % 32;
  if (first_row >= rows) return;
  float v[R][C][4], max[R], inv[R];
  for (int i = 0; i < R; ++i) {
    const int64_t r = first_row + i;
    const float* m = mask ? mask + (r / rows_per_item) * k : nullptr;
    max[i] = -INFINITY;
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
  for (int i = 0; i < R; ++i) max[i] = cuda::warp_max(max[i]);
  for (int i = 0; i < R; ++i) {
    float sum = 0;
    for (int c = 0; c < C; ++c)
      for (int w = 0; w < 4; ++w) sum += v[i][c][w] = expf(v[i][c][w] - max[i]);
    inv[i] = sum;
  }
  for (int i = 0; i < R; ++i) inv[i] = 1.0f / cuda::warp_sum(inv[i]);
  for (int i = 0; i < R; ++i) {
    const int64_t r = first_row + i;
    if (r >= rows) break;
    for (int c = 0; c < C; ++c) {
      const int j = (c * 32 + lane) * 4;
      if (j >= k) break;
      cuda::Pack<A, 4> out;
      for (int w = 0; w < 4; ++w) out.v[w] = cuda::from_float<A>(v[i][c][w] * inv[i]);
      cuda::store_pack<4>(y + r * k + j, out);
      if (d.dropped) {
        bool kept[4];
        cuda::draw_keeps<4>(kept, d.seed, d.first, r * k + j, d.threshold);
        cuda::Pack<A, 4> dropped;
        cuda::Pack<uint8_t, 4> flags;
        for (int w = 0; w < 4; ++w) {
          flags.v[w] = kept[w];
          dropped.v[w] = cuda::from_float<A>(cuda::to_float(out.v[w]) * (kept[w] ? d.keep_scale : 0.0f));
        }
        cuda::store_pack<4>(d.dropped + r * k + j, dropped);
        cuda::store_pack<4>(d.keep + r * k + j, flags);
      }
    }
  }
}
// dx = y (g - sum_j g_j y_j) with g = dy, or with dropout after the softmax g = dy keep / (1 - p) for the
// gradient dy of the dropped output; the rows in registers as above.
template <int C, typename A>
__global__ void softmax_rows_backward(A* dx, const A* dy, const A* y, const uint8_t* keep, float keep_scale,
                                      int64_t rows, int k, bool accumulate) {
  constexpr int R = kRowsPerWarp<C>;
  const int64_t first_row = (blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32) * R;
  const int lane = threadIdx.x % 32;
  if (first_row >= rows) return;
  float yv[R][C][4], gv[R][C][4], dot[R];
  for (int i = 0; i < R; ++i) {
    const int64_t r = first_row + i;
    dot[i] = 0;
    for (int c = 0; c < C; ++c) {
      const int j = (c * 32 + lane) * 4;
      if (r >= rows || j >= k) break;
      const cuda::Pack<A, 4> py = cuda::load_pack<4>(y + r * k + j), pd = cuda::load_pack<4>(dy + r * k + j);
      cuda::Pack<uint8_t, 4> flags{};
      if (keep) flags = cuda::load_pack<4>(keep + r * k + j);
      for (int w = 0; w < 4; ++w) {
        yv[i][c][w] = cuda::to_float(py.v[w]);
        gv[i][c][w] = cuda::to_float(pd.v[w]) * (keep ? (flags.v[w] ? keep_scale : 0.0f) : 1.0f);
        dot[i] += gv[i][c][w] * yv[i][c][w];
      }
    }
  }
  for (int i = 0; i < R; ++i) dot[i] = cuda::warp_sum(dot[i]);
  for (int i = 0; i < R; ++i) {
    const int64_t r = first_row + i;
    if (r >= rows) break;
    for (int c = 0; c < C; ++c) {
      const int j = (c * 32 + lane) * 4;
      if (j >= k) break;
      cuda::Pack<A, 4> out;
      if (accumulate) out = cuda::load_pack<4>(dx + r * k + j);
      for (int w = 0; w < 4; ++w) {
        const float v = yv[i][c][w] * (gv[i][c][w] - dot[i]);
        out.v[w] = cuda::from_float<A>(accumulate ? cuda::to_float(out.v[w]) + v : v);
      }
      cuda::store_pack<4>(dx + r * k + j, out);
    }
  }
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

// softmax's backward into x's gradient from the probabilities y and the gradient of `out` (y itself, or
// y's dropout with the keep flags `keep`).
void softmax_backward_into(Graph<float>& g, Var x, Var out, const void* y, const uint8_t* keep, float keep_scale,
                           int64_t rows, int64_t k, DType dtype) {
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    const auto dx = g.raw_grad_target(x);
    A* dxp = cuda::typed<A>(dx.data);
    const A* dy = cuda::typed<A>(g.grad_data(out));
    const A* yv = static_cast<const A*>(y);
    const bool ran = with_row_chunks(k, {dxp, dy, yv, keep}, [&](auto chunks) {
      constexpr int C = decltype(chunks)::value;
      softmax_rows_backward<C, A><<<softmax_blocks<C>(rows), 32 * kWarpsPerBlock, 0, cuda::stream(g)>>>(
          dxp, dy, yv, keep, keep_scale, rows, int(k), dx.accumulate);
    });
    BERT_CHECK(ran || !keep, "softmax_dropout: the backward's operands are not 16-byte aligned");
    if (!ran)
      softmax_backward<A><<<row_blocks(rows), 32 * kWarpsPerBlock, 0, cuda::stream(g)>>>(dxp, dy, yv, rows, k,
                                                                                        dx.accumulate);
    BERT_CUDA_LAUNCHED();
  });
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
    const bool ran = with_row_chunks(k, {yv, xv, mv}, [&](auto chunks) {
      constexpr int C = decltype(chunks)::value;
      softmax_rows_forward<C, A><<<softmax_blocks<C>(rows), 32 * kWarpsPerBlock, 0, cuda::stream(g)>>>(
          yv, xv, mv, rows, int(k), rows_per_item, RowDropout<A>{});
    });
    if (!ran)
      softmax_forward<A><<<row_blocks(rows), 32 * kWarpsPerBlock, 0, cuda::stream(g)>>>(yv, xv, mv, rows, k,
                                                                                        rows_per_item);
    BERT_CUDA_LAUNCHED();
  });
  g.on_backward(y, [x, y, k, rows, dtype](Graph<float>& g) {
    softmax_backward_into(g, x, y, g.data(y), nullptr, 1.0f, rows, k, dtype);
  });
  return y;
}

Var softmax_dropout(Graph<float>& g, Var x, Var mask, double p, Rng& rng) {
  const Shape xs = g.shape(x);
  const int64_t k = xs.last(), rows = xs.rows(), n = xs.numel();
  int64_t rows_per_item = 0;
  const float* mv = softmax_mask(g, x, mask, rows_per_item);
  x = as_activation(g, x);
  // Rows the register kernels do not hold (longer than 1024, not a multiple of 4) take the two ops.
  if (!with_row_chunks(k, {g.data(x), mv}, [](auto) {})) return dropout(g, softmax(g, x, mask), p, rng);
  const DType dtype = g.dtype(x);
  Var y = g.emit(xs, {x}, dtype);
  // The probabilities themselves are saved for the backward, beside the keep flags (workspace
  // allocations, 64-byte aligned like y).
  uint8_t* keep = g.scratch<uint8_t>(n);
  const float keep_scale = static_cast<float>(1.0 / (1.0 - p));
  void* probs = nullptr;
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    A* pv = g.scratch<A>(n);
    probs = pv;
    const RowDropout<A> d{cuda::typed<A>(g.data(y)), keep, rng.state().seed,
                          DropoutDraws::reserve(rng, static_cast<uint64_t>(n)), DropoutDraws::threshold(p), keep_scale};
    with_row_chunks(k, {}, [&](auto chunks) {
      constexpr int C = decltype(chunks)::value;
      softmax_rows_forward<C, A><<<softmax_blocks<C>(rows), 32 * kWarpsPerBlock, 0, cuda::stream(g)>>>(
          pv, cuda::typed<A>(g.data(x)), mv, rows, int(k), rows_per_item, d);
    });
    BERT_CUDA_LAUNCHED();
  });
  g.on_backward(y, [x, y, probs, keep, keep_scale, k, rows, dtype](Graph<float>& g) {
    softmax_backward_into(g, x, y, probs, keep, keep_scale, rows, k, dtype);
  });
  return y;
}

}  // namespace bert::ops::cuda_impl
