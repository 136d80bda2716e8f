// Elementwise ops on a CUDA device (add, mul with broadcasting; scale, gelu, tanh, dropout), forward
// and backward side by side like ops/elementwise.cpp. Dropout draws the same counter-based
// random bits as the CPU, so both devices drop the same elements.
#include <cmath>

#include "ops/cuda/column_sums.cuh"
#include "ops/cuda/fake_quantize.cuh"
#include "ops/cuda_impl.h"

namespace bert::ops::cuda_impl {

namespace {

// NumPy broadcasting, padded on the left to rank 4; strides of broadcast axes are 0.
struct Broadcast {
  int64_t dims[4], stride[2][4], operand_dims[2][4];
  bool same_shape;
};

Broadcast plan_broadcast(const Shape& a, const Shape& b, Shape* out) {
  Broadcast p{};
  p.same_shape = a == b;
  const Shape* in[2] = {&a, &b};
  for (int w = 0; w < 2; ++w)
    for (int i = 0; i < 4; ++i) {
      const int axis = i - (4 - in[w]->rank());
      p.operand_dims[w][i] = axis >= 0 ? (*in[w])[axis] : 1;
    }
  for (int i = 0; i < 4; ++i) {
    const int64_t da = p.operand_dims[0][i], db = p.operand_dims[1][i];
    BERT_CHECK(da == db || da == 1 || db == 1, "cannot broadcast " + a.str() + " with " + b.str());
    p.dims[i] = std::max(da, db);
  }
  for (int w = 0; w < 2; ++w) {
    int64_t s = 1;
    for (int i = 3; i >= 0; --i) {
      p.stride[w][i] = (p.operand_dims[w][i] == 1 && p.dims[i] != 1) ? 0 : s;
      s *= p.operand_dims[w][i];
    }
  }
  const int rank = std::max(a.rank(), b.rank());
  *out = a.rank() >= b.rank() ? a : b;
  for (int i = 0; i < rank; ++i) (*out)[i] = p.dims[4 - rank + i];
  return p;
}

// I: the index type, 32-bit whenever the tensor allows (64-bit division costs several times more).
template <typename I>
__device__ __forceinline__ I offset_of(const Broadcast& p, int w, I o) {
  I off = 0;
  for (int i = 3; i >= 0; --i) {
    off += (o % static_cast<I>(p.dims[i])) * static_cast<I>(p.stride[w][i]);
    o /= static_cast<I>(p.dims[i]);
  }
  return off;
}

template <bool kMul, int W, typename A>
__global__ void same_shape_forward(A* y, const A* a, const A* b, int64_t n) {
  BERT_GRID_STRIDE_PACKS(i, n, W) {
    const cuda::Pack<A, W> pa = cuda::load_pack<W>(a + i), pb = cuda::load_pack<W>(b + i);
    cuda::Pack<A, W> out;
    for (int j = 0; j < W; ++j) {
      const float x = cuda::to_float(pa.v[j]), z = cuda::to_float(pb.v[j]);
      out.v[j] = cuda::from_float<A>(kMul ? x * z : x + z);
    }
    cuda::store_pack<W>(y + i, out);
  }
}

template <bool kMul, typename I, typename A>
__global__ void broadcast_forward(A* y, const A* a, const A* b, Broadcast p, int64_t n) {
  BERT_GRID_STRIDE(o, n) {
    const float x = cuda::to_float(a[offset_of<I>(p, 0, static_cast<I>(o))]);
    const float z = cuda::to_float(b[offset_of<I>(p, 1, static_cast<I>(o))]);
    y[o] = cuda::from_float<A>(kMul ? x * z : x + z);
  }
}

// y = a op b where one operand is broadcast along leading axes only and the other has y's shape: element
// e of y takes element e % inner of the repeated operand (position embeddings added to a batch). W elements
// a thread (inner a multiple of W); I the index type, 32-bit where y allows.
template <bool kMul, int W, typename I, typename A>
__global__ void leading_broadcast_forward(A* y, const A* full, const A* repeated, int64_t n, int64_t inner) {
  BERT_GRID_STRIDE_PACKS(e, n, W) {
    const cuda::Pack<A, W> f = cuda::load_pack<W>(full + e);
    const cuda::Pack<A, W> r = cuda::load_pack<W>(repeated + int64_t(I(e) % I(inner)));
    cuda::Pack<A, W> out;
    for (int j = 0; j < W; ++j) {
      const float x = cuda::to_float(f.v[j]), z = cuda::to_float(r.v[j]);
      out.v[j] = cuda::from_float<A>(kMul ? x * z : x + z);
    }
    cuda::store_pack<W>(y + e, out);
  }
}

// d(operand w) += sum over the output elements it feeds of dy (times the other operand for mul).
// One thread per operand element walks its broadcast axes in order: deterministic, no atomics.
template <typename A>
__global__ void broadcast_backward(A* dv, const A* dy, const A* other, Broadcast p, int w, int64_t n, bool accumulate) {
  BERT_GRID_STRIDE(e, n) {
    int64_t coord[4], rest = e;
    for (int i = 3; i >= 0; --i) {
      coord[i] = rest % p.operand_dims[w][i];
      rest /= p.operand_dims[w][i];
    }
    int64_t lo[4], hi[4];
    for (int i = 0; i < 4; ++i) {
      const bool broadcast = p.operand_dims[w][i] == 1 && p.dims[i] != 1;
      lo[i] = broadcast ? 0 : coord[i];
      hi[i] = broadcast ? p.dims[i] : coord[i] + 1;
    }
    float acc = 0;
    for (int64_t i0 = lo[0]; i0 < hi[0]; ++i0)
      for (int64_t i1 = lo[1]; i1 < hi[1]; ++i1)
        for (int64_t i2 = lo[2]; i2 < hi[2]; ++i2)
          for (int64_t i3 = lo[3]; i3 < hi[3]; ++i3) {
            const int64_t o = ((i0 * p.dims[1] + i1) * p.dims[2] + i2) * p.dims[3] + i3;
            acc += other ? cuda::to_float(dy[o]) * cuda::to_float(other[offset_of<int64_t>(p, 1 - w, o)])
                         : cuda::to_float(dy[o]);
          }
    cuda::store_grad(dv, e, acc, accumulate);
  }
}

// dv (inner) (+)= the sum over `rows` of dy (rows, inner): an operand broadcast along leading axes only
// (position embeddings over the batch). Block (32, 8): thread x takes W adjacent columns, thread y every
// 8th row; the 8 lanes' sums are added in lane order (deterministic, no atomics).
template <int W, typename A>
__global__ void leading_sum_backward(A* dv, const A* dy, int64_t rows, int64_t inner, bool accumulate) {
  __shared__ float lanes[8][32 * W];
  const int64_t col = (blockIdx.x * 32 + threadIdx.x) * int64_t(W);
  float acc[W] = {};
  if (col < inner)
    for (int64_t r = threadIdx.y; r < rows; r += 8) {
      const cuda::Pack<A, W> p = cuda::load_pack<W>(dy + r * inner + col);
      for (int j = 0; j < W; ++j) acc[j] += cuda::to_float(p.v[j]);
    }
  for (int j = 0; j < W; ++j) lanes[threadIdx.y][threadIdx.x * W + j] = acc[j];
  __syncthreads();
  if (threadIdx.y != 0 || col >= inner) return;
  for (int y = 1; y < 8; ++y)
    for (int j = 0; j < W; ++j) acc[j] += lanes[y][threadIdx.x * W + j];
  cuda::store_grad_pack<W>(dv + col, acc, accumulate);
}

// The leading axes along which operand w alone is broadcast: rows (their product) and inner (the rest),
// or rows 0 when its broadcast axes are not all leading.
std::pair<int64_t, int64_t> leading_broadcast(const Broadcast& p, int w) {
  int k = 0;
  while (k < 4 && p.operand_dims[w][k] == 1) ++k;
  int64_t rows = 1, inner = 1;
  for (int i = 0; i < 4; ++i) {
    if (i >= k && p.operand_dims[w][i] != p.dims[i]) return {0, 0};
    (i < k ? rows : inner) *= p.dims[i];
  }
  return {rows, inner};
}

// The operand (0 or 1) broadcast along leading axes only while the other has the output's shape, or -1.
int leading_operand(const Broadcast& p) {
  for (int w = 0; w < 2; ++w) {
    bool other_full = true;
    for (int i = 0; i < 4; ++i) other_full = other_full && p.operand_dims[1 - w][i] == p.dims[i];
    if (other_full && leading_broadcast(p, w).first > 1) return w;
  }
  return -1;
}

template <typename A>
__global__ void scale_kernel(A* y, const A* x, float alpha, int64_t n) {
  BERT_GRID_STRIDE(i, n) y[i] = cuda::from_float<A>(alpha * cuda::to_float(x[i]));
}

using cuda::gelu_derivative;
using cuda::gelu_value;

template <int W, typename A>
__global__ void gelu_forward(A* y, const A* x, int64_t n) {
  BERT_GRID_STRIDE_PACKS(i, n, W) {
    cuda::Pack<A, W> p = cuda::load_pack<W>(x + i);
    for (int j = 0; j < W; ++j) p.v[j] = cuda::from_float<A>(gelu_value(cuda::to_float(p.v[j])));
    cuda::store_pack<W>(y + i, p);
  }
}
template <int W, typename A>
__global__ void gelu_backward(A* dx, const A* dy, const A* x, int64_t n, bool accumulate) {
  BERT_GRID_STRIDE_PACKS(i, n, W) {
    const cuda::Pack<A, W> px = cuda::load_pack<W>(x + i), pdy = cuda::load_pack<W>(dy + i);
    cuda::Pack<A, W> out;
    if (accumulate) out = cuda::load_pack<W>(dx + i);
    for (int j = 0; j < W; ++j) {
      const float d = cuda::to_float(pdy.v[j]) * gelu_derivative(cuda::to_float(px.v[j]));
      out.v[j] = cuda::from_float<A>(accumulate ? cuda::to_float(out.v[j]) + d : d);
    }
    cuda::store_pack<W>(dx + i, out);
  }
}
// GELU as the source of a fused fake quantization (ops/cuda/fake_quantize.cuh).
template <typename A>
struct GeluSource {
  const A* x;
  A* dx;
  template <int W>
  __device__ __forceinline__ void load(int64_t i, float (&v)[W]) const {
    const cuda::Pack<A, W> p = cuda::load_pack<W>(x + i);
    for (int j = 0; j < W; ++j) v[j] = gelu_value(cuda::to_float(p.v[j]));
  }
  template <int W>
  __device__ __forceinline__ void load(int64_t i, float (&v)[W], float (&slope)[W]) const {
    const cuda::Pack<A, W> p = cuda::load_pack<W>(x + i);
    for (int j = 0; j < W; ++j) cuda::gelu_value_and_derivative(cuda::to_float(p.v[j]), v[j], slope[j]);
  }
  template <int W>
  __device__ __forceinline__ void store_input_grad(int64_t i, const float (&g)[W], bool accumulate) const {
    if (dx) cuda::store_grad_pack<W>(dx + i, g, accumulate);
  }
};
// The quantized GELU's backward as a source of cuda::column_sums (x, dy and dx: rows `ld` apart): dx as
// fake_quantize_backward over GeluSource writes it (the quantizer's straight-through gradient times GELU's
// slope, the same arithmetic), summed into the bias gradient of the linear that made x, and the scale
// gradient's terms into the thread's share (kScaleShares), so that dx is not read again for the bias.
template <int W, typename A>
struct GeluQuantizedBackwardRows {
  using SumsScaleGradient = void;  // (cuda::kScaleShares)
  const A *x, *dy;
  A* dx;
  int64_t ld;
  const float* scale;  // on the device: the division is made once a thread (setup)
  float lo, hi;
  cuda::ScaleDivision divide;  // setup()
  struct Loaded {
    cuda::Pack<A, W> x, dy;
  };
  __device__ void setup() { divide = cuda::ScaleDivision(*scale); }
  __device__ Loaded read(unsigned, int64_t r, int64_t col) const {
    return {cuda::load_pack<W>(x + r * ld + col), cuda::load_pack<W>(dy + r * ld + col)};
  }
  __device__ cuda::Pack<A, W> value(unsigned, int64_t r, int64_t col, const Loaded& loaded, double& share) const {
    float part = 0;  // this pack's share, as fake_quantize_backward sums it
    cuda::Pack<A, W> out;
    for (int j = 0; j < W; ++j) {
      float v, slope;
      cuda::gelu_value_and_derivative(cuda::to_float(loaded.x.v[j]), v, slope);
      out.v[j] = cuda::from_float<A>(
          cuda::fake_quantize_value_grad(v, cuda::to_float(loaded.dy.v[j]), slope, divide, lo, hi, part));
    }
    cuda::store_pack<W>(dx + r * ld + col, out);
    share += part;
    return out;
  }
};
template <typename A>
__global__ void tanh_forward(A* y, const A* x, int64_t n) {
  BERT_GRID_STRIDE(i, n) y[i] = cuda::from_float<A>(tanhf(cuda::to_float(x[i])));
}
template <typename A>
__global__ void tanh_backward(A* dx, const A* dy, const A* y, int64_t n, bool accumulate) {
  BERT_GRID_STRIDE(i, n) {
    const float t = cuda::to_float(y[i]);
    cuda::store_grad(dx, i, cuda::to_float(dy[i]) * (1.0f - t * t), accumulate);
  }
}

// The draws of core/rng.h's DropoutDraws.
template <int W, typename A>
__global__ void dropout_forward(A* y, uint8_t* keep, const A* x, uint64_t seed, uint64_t first, uint32_t threshold,
                                float keep_scale, int64_t n) {
  BERT_GRID_STRIDE_PACKS(i, n, W) {
    cuda::Pack<A, W> p = cuda::load_pack<W>(x + i);
    cuda::Pack<uint8_t, W> k;
    bool kept[W];
    cuda::draw_keeps<W>(kept, seed, first, i, threshold);
    for (int j = 0; j < W; ++j) {
      k.v[j] = kept[j];
      p.v[j] = cuda::from_float<A>(cuda::to_float(p.v[j]) * (kept[j] ? keep_scale : 0.0f));
    }
    cuda::store_pack<W>(keep + i, k);
    cuda::store_pack<W>(y + i, p);
  }
}
template <int W, typename A>
__global__ void dropout_backward(A* dx, const A* dy, const uint8_t* keep, float keep_scale, int64_t n,
                                 bool accumulate) {
  BERT_GRID_STRIDE_PACKS(i, n, W) {
    const cuda::Pack<A, W> d = cuda::load_pack<W>(dy + i);
    const cuda::Pack<uint8_t, W> k = cuda::load_pack<W>(keep + i);
    cuda::Pack<A, W> out;
    if (accumulate) out = cuda::load_pack<W>(dx + i);
    for (int j = 0; j < W; ++j) {
      const float v = cuda::to_float(d.v[j]) * (k.v[j] ? keep_scale : 0.0f);
      out.v[j] = cuda::from_float<A>(accumulate ? cuda::to_float(out.v[j]) + v : v);
    }
    cuda::store_pack<W>(dx + i, out);
  }
}
// Dropout as the source of a fused fake quantization: the kept elements are drawn again from the
// counter-based RNG in backward instead of being stored.
template <typename A>
struct DropoutSource {
  const A* x;
  A* dx;
  uint64_t seed, first;
  uint32_t threshold;
  float keep_scale;
  template <int W>
  __device__ __forceinline__ void load(int64_t i, float (&v)[W]) const {
    float slope[W];
    load<W>(i, v, slope);
  }
  template <int W>
  __device__ __forceinline__ void load(int64_t i, float (&v)[W], float (&slope)[W]) const {
    const cuda::Pack<A, W> p = cuda::load_pack<W>(x + i);
    bool kept[W];
    cuda::draw_keeps<W>(kept, seed, first, i, threshold);
    for (int j = 0; j < W; ++j) {
      slope[j] = kept[j] ? keep_scale : 0.0f;
      v[j] = cuda::to_float(p.v[j]) * slope[j];
    }
  }
  template <int W>
  __device__ __forceinline__ void store_input_grad(int64_t i, const float (&g)[W], bool accumulate) const {
    if (dx) cuda::store_grad_pack<W>(dx + i, g, accumulate);
  }
};

// Both operands of one dtype (the output's); a BF16/F32 mix is promoted to F32, as PyTorch does.
template <bool kMul>
Var broadcast_op(Graph<float>& g, Var a, Var b) {
  if (g.dtype(a) != g.dtype(b)) a = to_dtype(g, a, DType::kF32), b = to_dtype(g, b, DType::kF32);
  const DType dtype = g.dtype(a);
  Shape out;
  const Broadcast p = plan_broadcast(g.shape(a), g.shape(b), &out);
  Var y = g.emit(out, {a, b}, dtype);
  const int64_t n = out.numel();
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    A *yv = cuda::typed<A>(g.data(y)), *av = cuda::typed<A>(g.data(a)), *bv = cuda::typed<A>(g.data(b));
    if (p.same_shape && !kMul) {
      const bool packed = cuda::packs_of_4(n, {yv, av, bv});
      auto* kernel = packed ? &same_shape_forward<false, 4, A> : &same_shape_forward<false, 1, A>;
      BERT_LAUNCH(kernel, packed ? n / 4 : n, g, yv, av, bv, n);
    } else if (p.same_shape) {
      auto* kernel = &same_shape_forward<true, 1, A>;
      BERT_LAUNCH(kernel, n, g, yv, av, bv, n);
    } else if (const int w = leading_operand(p); w >= 0) {  // a * b = b * a: the order does not matter
      const int64_t inner = leading_broadcast(p, w).second;
      const A* full = w == 0 ? bv : av;
      const A* repeated = w == 0 ? av : bv;
      const bool packed = cuda::packs_of_4(inner, {yv, full, repeated}), small = n < (int64_t{1} << 31);
      auto* kernel = packed ? (small ? &leading_broadcast_forward<kMul, 4, int32_t, A>
                                     : &leading_broadcast_forward<kMul, 4, int64_t, A>)
                            : (small ? &leading_broadcast_forward<kMul, 1, int32_t, A>
                                     : &leading_broadcast_forward<kMul, 1, int64_t, A>);
      BERT_LAUNCH(kernel, packed ? n / 4 : n, g, yv, full, repeated, n, inner);
    } else {
      auto* kernel =
          n < (int64_t{1} << 31) ? &broadcast_forward<kMul, int32_t, A> : &broadcast_forward<kMul, int64_t, A>;
      BERT_LAUNCH(kernel, n, g, yv, av, bv, p, n);
    }
  });
  g.on_backward(y, [a, b, y, p, dtype](Graph<float>& g) {
    cuda::with_element_type(dtype, [&](auto tag) {
      using A = typename decltype(tag)::type;
      const A* dy = cuda::typed<A>(g.grad_data(y));
      const Var operands[2] = {a, b};
      bool passed = false;  // one operand at most takes dy's buffer: two sharing one would alias
      for (int w = 0; w < 2; ++w) {
        if (!g.requires_grad(operands[w])) continue;
        // An add passes dy through to an operand of the output's shape: the first such operand without a
        // gradient yet takes dy's buffer; another one adds dy.
        bool full = true;
        for (int i = 0; i < 4; ++i) full = full && p.operand_dims[w][i] == p.dims[i];
        if (full && !kMul && !passed && g.pass_grad_through(operands[w], y)) {
          passed = true;
          continue;
        }
        const auto dv = g.raw_grad_target(operands[w]);
        A* dvp = cuda::typed<A>(dv.data);
        const int64_t n = g.shape(operands[w]).numel();
        if (full && !kMul) {
          BERT_LAUNCH_PACKED(cuda::scaled_grad_kernel, n, cuda::packs_of_4(n, {dvp, dy}), g, dvp, dy, 1.0f, n,
                             dv.accumulate);
          continue;
        }
        if (const auto [rows, inner] = leading_broadcast(p, w); !kMul && rows > 1 && inner >= 2048) {
          const bool packed = cuda::packs_of_4(inner, {dvp, dy});
          const dim3 grid(unsigned((inner + (packed ? 128 : 32) - 1) / (packed ? 128 : 32)));
          if (packed)
            leading_sum_backward<4, A><<<grid, dim3(32, 8), 0, cuda::stream(g)>>>(dvp, dy, rows, inner, dv.accumulate);
          else
            leading_sum_backward<1, A><<<grid, dim3(32, 8), 0, cuda::stream(g)>>>(dvp, dy, rows, inner, dv.accumulate);
          BERT_CUDA_LAUNCHED();
        } else {
          const A* other = kMul ? cuda::typed<A>(g.data(operands[1 - w])) : nullptr;
          BERT_LAUNCH(broadcast_backward<A>, n, g, dvp, dy, other, p, w, n, dv.accumulate);
        }
      }
    });
  });
  return y;
}

}  // namespace

Var add(Graph<float>& g, Var a, Var b) { return broadcast_op<false>(g, a, b); }
Var mul(Graph<float>& g, Var a, Var b) { return broadcast_op<true>(g, a, b); }

Var scale(Graph<float>& g, Var x, double alpha) {
  const DType dtype = g.dtype(x);
  Var y = g.emit(g.shape(x), {x}, dtype);
  const float s = static_cast<float>(alpha);
  const int64_t n = g.shape(x).numel();
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    BERT_LAUNCH(scale_kernel<A>, n, g, cuda::typed<A>(g.data(y)), cuda::typed<A>(g.data(x)), s, n);
  });
  g.on_backward(y, [x, y, s, n, dtype](Graph<float>& g) {
    cuda::with_element_type(dtype, [&](auto tag) {
      using A = typename decltype(tag)::type;
      const auto dx = g.raw_grad_target(x);
      A* dxp = cuda::typed<A>(dx.data);
      const A* dy = cuda::typed<A>(g.grad_data(y));
      BERT_LAUNCH_PACKED(cuda::scaled_grad_kernel, n, cuda::packs_of_4(n, {dxp, dy}), g, dxp, dy, s, n, dx.accumulate);
    });
  });
  return y;
}

Var gelu(Graph<float>& g, Var x) {
  x = as_activation(g, x);
  const DType dtype = g.dtype(x);
  Var y = g.emit(g.shape(x), {x}, dtype);
  const int64_t n = g.shape(x).numel();
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    A *yv = cuda::typed<A>(g.data(y)), *xv = cuda::typed<A>(g.data(x));
    BERT_LAUNCH_PACKED_WIDE(A, gelu_forward, n, cuda::packs_of_4(n, {yv, xv}), g, yv, xv, n);
  });
  g.on_backward(y, [x, y, n, dtype](Graph<float>& g) {
    cuda::with_element_type(dtype, [&](auto tag) {
      using A = typename decltype(tag)::type;
      const auto dx = g.raw_grad_target(x);
      A* dxp = cuda::typed<A>(dx.data);
      const A *dy = cuda::typed<A>(g.grad_data(y)), *xv = cuda::typed<A>(g.data(x));
      BERT_LAUNCH_PACKED_WIDE(A, gelu_backward, n, cuda::packs_of_4(n, {dxp, dy, xv}), g, dxp, dy, xv, n,
                              dx.accumulate);
    });
  });
  return y;
}

Var tanh(Graph<float>& g, Var x) {
  x = as_activation(g, x);
  const DType dtype = g.dtype(x);
  Var y = g.emit(g.shape(x), {x}, dtype);
  const int64_t n = g.shape(x).numel();
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    BERT_LAUNCH(tanh_forward<A>, n, g, cuda::typed<A>(g.data(y)), cuda::typed<A>(g.data(x)), n);
  });
  g.on_backward(y, [x, y, n, dtype](Graph<float>& g) {
    cuda::with_element_type(dtype, [&](auto tag) {
      using A = typename decltype(tag)::type;
      const auto dx = g.raw_grad_target(x);
      BERT_LAUNCH(tanh_backward<A>, n, g, cuda::typed<A>(dx.data), cuda::typed<A>(g.grad_data(y)),
                  cuda::typed<A>(g.data(y)), n, dx.accumulate);
    });
  });
  return y;
}

Var dropout(Graph<float>& g, Var x, double p, Rng& rng) {
  x = as_activation(g, x);
  const DType dtype = g.dtype(x);
  const int64_t n = g.shape(x).numel();
  const uint64_t first = DropoutDraws::reserve(rng, static_cast<uint64_t>(n));
  const uint32_t threshold = DropoutDraws::threshold(p);
  const float keep_scale = static_cast<float>(1.0 / (1.0 - p));
  uint8_t* keep = g.scratch<uint8_t>(n);
  Var y = g.emit(g.shape(x), {x}, dtype);
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    A *yv = cuda::typed<A>(g.data(y)), *xv = cuda::typed<A>(g.data(x));
    // keep is 8-byte aligned for packs of up to 8: the workspace aligns every allocation to 64 bytes.
    const bool packed = cuda::packs_of_4(n, {yv, xv}) && reinterpret_cast<uintptr_t>(keep) % 8 == 0;
    BERT_LAUNCH_PACKED_WIDE(A, dropout_forward, n, packed, g, yv, keep, xv, rng.state().seed, first, threshold,
                            keep_scale, n);
  });
  g.on_backward(y, [x, y, n, keep, keep_scale, dtype](Graph<float>& g) {
    cuda::with_element_type(dtype, [&](auto tag) {
      using A = typename decltype(tag)::type;
      const auto dx = g.raw_grad_target(x);
      A* dxp = cuda::typed<A>(dx.data);
      const A* dy = cuda::typed<A>(g.grad_data(y));
      const bool packed = cuda::packs_of_4(n, {dxp, dy}) && reinterpret_cast<uintptr_t>(keep) % 8 == 0;
      BERT_LAUNCH_PACKED_WIDE(A, dropout_backward, n, packed, g, dxp, dy, keep, keep_scale, n, dx.accumulate);
    });
  });
  return y;
}

Var gelu(Graph<float>& g, Var x, const QuantizeOutput& q) {
  x = as_activation(g, x);
  const DType dtype = g.dtype(x);
  const int64_t n = g.shape(x).numel();
  cuda::QuantizeLaunch launch = cuda::fused_launch(g, q, n);
  Var y = g.emit(g.shape(x), {x, q.scale}, dtype);
  cuda::add_integers(g, q, y, launch);
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    A *yv = cuda::typed<A>(g.data(y)), *xv = cuda::typed<A>(g.data(x));
    cuda::launch_fake_quantize_forward(g, launch, yv, GeluSource<A>{xv, nullptr},
                                       cuda::pack_width(sizeof(A), sizeof(A), n, {yv, xv}));
  });
  const Var scale = q.scale;
  g.on_backward(y, [x, y, scale, n, dtype, launch](Graph<float>& g) {
    const cuda::FusedBackward b = cuda::fused_backward(g, launch, x, scale);
    // Where x is a linear's output read by nothing else (the feed-forward block's first product), that
    // linear's bias gradient is summed here from the dx this pass writes (Graph::bias_to_sum).
    const Var bias = b.dx.data && !b.dx.accumulate ? g.bias_to_sum(x) : Var{};
    cuda::with_element_type(dtype, [&](auto tag) {
      using A = typename decltype(tag)::type;
      A *dx = cuda::typed<A>(b.dx.data), *dy = cuda::typed<A>(g.grad_data(y)), *xv = cuda::typed<A>(g.data(x));
      if (bias.valid()) {
        const int64_t cols = g.shape(x).last(), rows = n / cols;
        const auto address =
            reinterpret_cast<uintptr_t>(dx) | reinterpret_cast<uintptr_t>(dy) | reinterpret_cast<uintptr_t>(xv);
        auto fits = [&](int64_t w) { return cols % w == 0 && address % (w * sizeof(A)) == 0; };
        cuda::launch_column_sums(
            g, rows, cols, g.grad(bias).data(), 1, 0, fits,
            [&]<int W>() {
              return GeluQuantizedBackwardRows<W, A>{xv, dy, dx, cols, b.launch.scale, b.launch.lo, b.launch.hi};
            },
            cuda::ScaleShares{b.launch.scale_grad, b.launch.grad_scale});
        g.set_bias_summed(x);
        return;
      }
      cuda::launch_fake_quantize_backward(g, b.launch, dy, GeluSource<A>{xv, dx},
                                          cuda::pack_width(sizeof(A), sizeof(A), n, {dx, dy, xv}), b.dx.accumulate);
    });
  });
  return y;
}

Var dropout(Graph<float>& g, Var x, double p, Rng& rng, const QuantizeOutput& q) {
  x = as_activation(g, x);
  const DType dtype = g.dtype(x);
  const int64_t n = g.shape(x).numel();
  const cuda::QuantizeLaunch launch = cuda::fused_launch(g, q, n);
  const uint64_t first = DropoutDraws::reserve(rng, static_cast<uint64_t>(n));
  const uint64_t seed = rng.state().seed;
  const uint32_t threshold = DropoutDraws::threshold(p);
  const float keep_scale = static_cast<float>(1.0 / (1.0 - p));
  Var y = g.emit(g.shape(x), {x, q.scale}, dtype);
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    A *yv = cuda::typed<A>(g.data(y)), *xv = cuda::typed<A>(g.data(x));
    cuda::launch_fake_quantize_forward(g, launch, yv, DropoutSource<A>{xv, nullptr, seed, first, threshold, keep_scale},
                                       cuda::pack_width(sizeof(A), sizeof(A), n, {yv, xv}));
  });
  const Var scale = q.scale;
  g.on_backward(y, [x, y, scale, n, dtype, launch, seed, first, threshold, keep_scale](Graph<float>& g) {
    const cuda::FusedBackward b = cuda::fused_backward(g, launch, x, scale);
    cuda::with_element_type(dtype, [&](auto tag) {
      using A = typename decltype(tag)::type;
      A *dx = cuda::typed<A>(b.dx.data), *dy = cuda::typed<A>(g.grad_data(y)), *xv = cuda::typed<A>(g.data(x));
      cuda::launch_fake_quantize_backward(g, b.launch, dy, DropoutSource<A>{xv, dx, seed, first, threshold, keep_scale},
                                          cuda::pack_width(sizeof(A), sizeof(A), n, {dx, dy, xv}), b.dx.accumulate);
    });
  });
  return y;
}

}  // namespace bert::ops::cuda_impl
