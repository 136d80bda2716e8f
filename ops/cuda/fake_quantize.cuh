// The fake-quantization kernels on a CUDA device, over a *source*: what produces the values being
// quantized. The plain op (ops/quantize.cu) reads them from a tensor; an elementwise op with its
// output's quantizer fused in (GELU, dropout, permute: ops/elementwise.cu, ops/shape.cu) computes them
// in registers, so the op's unquantized output is never stored, and backward recomputes it from the op's
// input for the straight-through mask and the LSQ scale gradient. One pass over memory each way instead
// of two.
//
// A source is an elementwise op (each output element made from one input element) given as a small
// struct with device methods over W consecutive elements of the output, starting at element i:
//   template <int W> void load(int64_t i, float (&v)[W]) const;   // the values before quantization
//   template <int W> void load(int64_t i, float (&v)[W], float (&slope)[W]) const;  // and dv/dx
//   template <int W> void store_input_grad(int64_t i, const float (&dx)[W], bool accumulate) const;
// The second load computes each value and its derivative together (GELU's erf once); store_input_grad
// writes or adds the gradient of the elements' inputs (nothing when the input takes none).
//
// Rounding divides by the scale (ScaleDivision) and rounds half to even (rintf), exactly as QuantizeLinear
// and the CPU op do. The scale gradient is summed in fixed blocks of kQuantizeBlock elements, in double, in
// a fixed order, so a fused op and the two ops in sequence give the same sum whenever their values agree.
#pragma once

#include <cfloat>
#include <type_traits>

#include "ops/cuda/common.cuh"
#include "ops/ops.h"

namespace bert::cuda {

// x / s for a quantizer's scale s, rounded as the IEEE division (to nearest, ties to even) that
// QuantizeLinear and the CPU op use, in three FMA-pipe instructions instead of the division's subroutine:
// q = x r with r = RN(1 / s), then q + (x - q s) r, the remainder exact in an FMA. With r within half an
// ulp of 1 / s and q within an ulp of x / s, that sum rounds to RN(x / s) (Markstein's theorem; the
// CudaOps tests hold it against the CPU's division at every rounding boundary). Infinite quotients pass
// through; a scale whose reciprocal is not a normal float divides.
struct ScaleDivision {
  float s = 1.0f, r = 1.0f;
  bool normal = true;         // r is a normal float
  ScaleDivision() = default;  // by 1 (a kernel argument's placeholder, set on the device)
  __device__ explicit ScaleDivision(float scale)
      : s(scale), r(1.0f / scale), normal(fabsf(r) >= FLT_MIN && fabsf(r) <= FLT_MAX) {}
  // The same division where the reciprocal r = RN(1 / s) was made elsewhere (the host's IEEE division gives
  // the same) and is known to be a normal float (the caller checks): no branch, for kernels that divide
  // many values by scales they pick per value (an integer GEMM's epilogue).
  __device__ __forceinline__ static float normal_quotient(float x, float s, float r) {
    const float q = x * r;
    const float u = fmaf(fmaf(-q, s, x), r, q);
    return isinf(q) ? q : u;
  }
  __device__ __forceinline__ float operator()(float x) const {
    if (!normal) return x / s;  // the same for every thread
    const float q = x * r;
    const float u = fmaf(fmaf(-q, s, x), r, q);
    return isinf(q) ? q : u;
  }
};

// The int8 integer of a quotient u = v / scale: rounded half to even and clamped to [-128, 127], as
// QuantizeLinear, fake quantization and the CPU's integer engine make it; exact as a float (and in BF16).
// int8_of divides too (ScaleDivision).
__device__ __forceinline__ float int8_round(float u) { return fminf(fmaxf(rintf(u), -128.0f), 127.0f); }
__device__ __forceinline__ float int8_of(float v, const ScaleDivision& divide) { return int8_round(divide(v)); }

// The integers of two quotients, u0 in the low byte: int8_round's (half to even, clamped to [-128, 127]) for
// every number but NaN (0 here; no finite sum, scale and bias make one), in three instructions (cvt.rni twice,
// one saturating pack) where int8_round and a conversion take four a value. (Doing without conversions, BF16
// rounding and rounding to integers on the bits, took more instructions and was slower.)
__device__ __forceinline__ uint16_t int8_pair(float u0, float u1) {
  uint32_t packed;
  asm("cvt.pack.sat.s8.s32.b32 %0, %1, %2, 0;\n" : "=r"(packed) : "r"(__float2int_rn(u1)), "r"(__float2int_rn(u0)));
  return static_cast<uint16_t>(packed);
}
// Four, u0 in the lowest byte: two saturating packs, the second taking the first's two bytes above its own.
__device__ __forceinline__ uint32_t int8_quad(float u0, float u1, float u2, float u3) {
  uint32_t high, packed;
  asm("cvt.pack.sat.s8.s32.b32 %0, %1, %2, 0;\n" : "=r"(high) : "r"(__float2int_rn(u3)), "r"(__float2int_rn(u2)));
  asm("cvt.pack.sat.s8.s32.b32 %0, %1, %2, %3;\n"
      : "=r"(packed)
      : "r"(__float2int_rn(u1)), "r"(__float2int_rn(u0)), "r"(high));
  return packed;
}

// q (rows, k) = int8_of each element of x as a value of Q (exact): row r at scales[r % scale_rows] where
// `scales` (device memory) is given, else at `scale` (one row of a single device scale: scale_rows 1).
template <typename Q, typename A>
__global__ void int8_values(Q* q, const A* x, int64_t rows, int64_t k, float scale, const float* scales,
                            int64_t scale_rows) {
  BERT_GRID_STRIDE(i, rows * k) {
    const ScaleDivision divide(scales ? scales[(i / k) % scale_rows] : scale);
    q[i] = from_float<Q>(int8_of(to_float(x[i]), divide));
  }
}

// The quotient v / divide.s; kNormal: divide.normal is known to hold (with_division tested it once, outside
// the caller's loops), so no per-value branch to the IEEE division, which a loop over values otherwise
// carries (compiled as a convergence region around each value).
template <bool kNormal>
__device__ __forceinline__ float quotient(float v, const ScaleDivision& divide) {
  if constexpr (kNormal)
    return ScaleDivision::normal_quotient(v, divide.s, divide.r);
  else
    return divide(v);
}
// f(std::true_type{}) where `normal` (every division f makes has a normal reciprocal), else
// f(std::false_type{}): f's loops compiled twice, the test made once.
template <typename F>
__device__ __forceinline__ void with_division(bool normal, F&& f) {
  if (normal)
    f(std::true_type{});
  else
    f(std::false_type{});
}

// The fake quantization of one value v: divided by the scale, rounded half to even, clamped to [lo, hi]
// and scaled back; `clipped` counts it where it saturates.
template <bool kNormal = false>
__device__ __forceinline__ float fake_quantize_value(float v, const ScaleDivision& divide, float lo, float hi,
                                                     int& clipped) {
  const float u = quotient<kNormal>(v, divide);
  clipped += (u < lo) | (u > hi);
  return fminf(fmaxf(rintf(u), lo), hi) * divide.s;
}
// The integer behind fake_quantize_value (which is it times divide.s), counted the same way.
template <bool kNormal = false>
__device__ __forceinline__ float fake_quantize_integer(float v, const ScaleDivision& divide, float lo, float hi,
                                                       int& clipped) {
  const float u = quotient<kNormal>(v, divide);
  clipped += (u < lo) | (u > hi);
  return fminf(fmaxf(rintf(u), lo), hi);
}
// Its backward for the gradient d of the quantized value, v's derivative `slope` in its input: the
// input's gradient (straight through inside the range, 0 outside), and `part` gains the scale's
// gradient term (LSQ: the rounding error inside the range, the bound outside).
template <bool kNormal = false>
__device__ __forceinline__ float fake_quantize_value_grad(float v, float d, float slope, const ScaleDivision& divide,
                                                          float lo, float hi, float& part) {
  const float u = quotient<kNormal>(v, divide);
  part += d * (u < lo ? lo : u > hi ? hi : rintf(u) - u);
  return !(u < lo) && !(u > hi) ? d * slope : 0.0f;
}

// Elements per thread block, never straddling a channel: small enough that a per-tensor scale spreads
// over thousands of blocks (the GPU needs them to hide memory latency).
constexpr int64_t kQuantizeBlock = int64_t{1} << 12;

// A source that reads a tensor of type X (an activation, or an F32 weight) and adds the gradient to dx:
// element i at index(i) of both. Contiguous: index(i) = i (TensorSource). Columns: `cols` columns of a
// row-major matrix whose rows lie `ld` elements apart (one part of a wider tensor, read in place), element i
// of the (rows, cols) part at (i / cols) ld + i % cols (ColumnsSource); a pack of W never crosses a row
// (cols % W == 0, which pack_width checks when given cols as the channel length), and the part holds fewer
// than 2^32 elements.
struct Contiguous {
  __device__ __forceinline__ int64_t operator()(int64_t i) const { return i; }
};
struct Columns {
  uint32_t cols;
  int64_t ld;
  __device__ __forceinline__ int64_t operator()(int64_t i) const {
    const uint32_t row = uint32_t(i) / cols;
    return int64_t(row) * ld + (uint32_t(i) - row * cols);
  }
};
template <typename X, typename Index>
struct IndexedSource {
  const X* x;
  X* dx;  // nullptr: x takes no gradient
  Index index{};
  template <int W>
  __device__ __forceinline__ void load(int64_t i, float (&v)[W]) const {
    const Pack<X, W> p = load_pack<W>(x + index(i));
    for (int j = 0; j < W; ++j) v[j] = to_float(p.v[j]);
  }
  template <int W>
  __device__ __forceinline__ void load(int64_t i, float (&v)[W], float (&slope)[W]) const {
    load<W>(i, v);
    for (int j = 0; j < W; ++j) slope[j] = 1.0f;
  }
  template <int W>
  __device__ __forceinline__ void store_input_grad(int64_t i, const float (&g)[W], bool accumulate) const {
    if (dx) store_grad_pack<W>(dx + index(i), g, accumulate);
  }
};
template <typename X>
using TensorSource = IndexedSource<X, Contiguous>;
template <typename X>
using ColumnsSource = IndexedSource<X, Columns>;

// Adds a thread block's share `acc` (each thread's part) of a scale's gradient, times grad_scale, to
// ds[row]: directly when the row is one block (shares == 1); else the block stores its share in
// partial[row shares + share], and the last block of the grid to finish adds every row's shares up in
// share order (a fixed tree: the result does not depend on which block finished last) and resets the
// arrival counter. Every thread of every block calls it; rows x shares is the grid's size.
__device__ inline void add_share(double acc, float* ds, double grad_scale, double* partial, unsigned int* arrivals,
                                 unsigned row, unsigned rows, unsigned share, unsigned shares) {
  __shared__ double shared[32];
  __shared__ bool last;
  acc = block_sum(acc, shared);
  if (shares == 1) {  // the scale's only block
    if (threadIdx.x == 0) ds[row] += static_cast<float>(grad_scale * acc);
    return;
  }
  if (threadIdx.x == 0) {
    partial[row * shares + share] = acc;
    __threadfence();  // the share is visible everywhere before this block counts as arrived
    last = atomicAdd(arrivals, 1u) == rows * shares - 1;
  }
  __syncthreads();
  if (!last) return;
  for (unsigned r = 0; r < rows; ++r) {
    double total = 0;
    for (unsigned b = threadIdx.x; b < shares; b += blockDim.x) total += __ldcg(partial + r * shares + b);
    total = block_sum(total, shared);
    if (threadIdx.x == 0) ds[r] += static_cast<float>(grad_scale * total);
  }
  if (threadIdx.x == 0) *arrivals = 0;
}
// A grid row's blocks share the scale of that row, ds[blockIdx.y] (a per-channel quantizer's channels).
__device__ inline void add_scale_gradient(double acc, float* ds, double grad_scale, double* partial,
                                          unsigned int* arrivals) {
  add_share(acc, ds, grad_scale, partial, arrivals, blockIdx.y, gridDim.y, blockIdx.x, gridDim.x);
}
// Every block of the grid shares one scale, ds[0] (a fused op's per-tensor quantizer on a 2-D grid);
// partial holds gridDim.x gridDim.y doubles.
__device__ inline void add_grid_scale_gradient(double acc, float* ds, double grad_scale, double* partial,
                                               unsigned int* arrivals) {
  add_share(acc, ds, grad_scale, partial, arrivals, 0, 1, blockIdx.y * gridDim.x + blockIdx.x, gridDim.x * gridDim.y);
}

// One block's elements [begin, end) of fake_quantize_forward, W consecutive ones a thread at a time; the
// block's saturation count added to *clipped (where set).
template <int W, typename Y, typename Source>
__device__ __forceinline__ void fake_quantize_forward_block(Y* y, const Source& source, float scale, int64_t begin,
                                                            int64_t end, float lo, float hi,
                                                            unsigned long long* clipped, int8_t* integers = nullptr) {
  __shared__ int64_t shared[32];
  const ScaleDivision divide(scale);
  int count = 0;  // at most kQuantizeBlock
  with_division(divide.normal, [&](auto normal) {
    for (int64_t i = begin + W * threadIdx.x; i < end; i += W * int64_t(blockDim.x)) {
      float v[W];
      source.template load<W>(i, v);
      Pack<Y, W> out;
      if (integers) {  // (the same for every thread)
        Pack<int8_t, W> q;
        for (int j = 0; j < W; ++j) {
          const float u = fake_quantize_integer<decltype(normal)::value>(v[j], divide, lo, hi, count);
          q.v[j] = static_cast<int8_t>(u);
          out.v[j] = from_float<Y>(u * divide.s);
        }
        store_pack<W>(integers + i, q);
      } else {
        for (int j = 0; j < W; ++j)
          out.v[j] = from_float<Y>(fake_quantize_value<decltype(normal)::value>(v[j], divide, lo, hi, count));
      }
      store_pack<W>(y + i, out);
    }
  });
  if (clipped) {
    const int64_t total = block_sum(int64_t{count}, shared);
    if (threadIdx.x == 0 && total) atomicAdd(clipped, static_cast<unsigned long long>(total));
  }
}
// One block's elements [begin, end) of fake_quantize_backward: the input's gradient stored through the
// source; returns this thread's share of the scale gradient.
template <int W, typename Y, typename Source>
__device__ __forceinline__ double fake_quantize_backward_block(const Source& source, const Y* dy, float scale,
                                                               int64_t begin, int64_t end, float lo, float hi,
                                                               bool accumulate) {
  const ScaleDivision divide(scale);
  double acc = 0;
  with_division(divide.normal, [&](auto normal) {
    for (int64_t i = begin + W * threadIdx.x; i < end; i += W * int64_t(blockDim.x)) {
      float v[W], slope[W], pass[W];
      source.template load<W>(i, v, slope);
      const Pack<Y, W> up = load_pack<W>(dy + i);
      float part = 0;  // this pack's share of the scale gradient
      for (int j = 0; j < W; ++j)
        pass[j] =
            fake_quantize_value_grad<decltype(normal)::value>(v[j], to_float(up.v[j]), slope[j], divide, lo, hi, part);
      source.template store_input_grad<W>(i, pass, accumulate);
      acc += part;
    }
  });
  return acc;
}

// Grid (blocks_per_channel, channels): block (b, c) handles channel c's elements [b kQuantizeBlock,
// (b + 1) kQuantizeBlock), each thread W consecutive elements at a time.
template <int W, typename Y, typename Source>
__global__ void fake_quantize_forward(Y* y, Source source, const float* scale, int64_t per_channel, float lo, float hi,
                                      unsigned long long* clipped, int8_t* integers) {
  const int64_t c = blockIdx.y;
  const int64_t begin = c * per_channel + blockIdx.x * kQuantizeBlock;
  const int64_t end = min(begin + kQuantizeBlock, (c + 1) * per_channel);
  fake_quantize_forward_block<W>(y, source, scale[c], begin, end, lo, hi, clipped, integers);
}

// Also sums the scale gradient: each block's share in double, added up by add_scale_gradient.
template <int W, typename Y, typename Source>
__global__ void fake_quantize_backward(Source source, const Y* dy, const float* scale, int64_t per_channel, float lo,
                                       float hi, bool accumulate, float* ds, double grad_scale, double* partial,
                                       unsigned int* arrivals) {
  const int64_t c = blockIdx.y;
  const int64_t begin = c * per_channel + blockIdx.x * kQuantizeBlock;
  const int64_t end = min(begin + kQuantizeBlock, (c + 1) * per_channel);
  const double acc = fake_quantize_backward_block<W>(source, dy, scale[c], begin, end, lo, hi, accumulate);
  if (ds) add_scale_gradient(acc, ds, grad_scale, partial, arrivals);
}

// Per-tensor quantizers of equally long parts in one launch (grid (blocks of a part, 1, parts)): part z's
// blocks are those of its own fake_quantize_forward / _backward launch over its n elements, so the values,
// saturation counts and scale gradients (each part's shares added in order, with its own arrival counter)
// are the same bits. QAT's Q, K and V quantizers over the three parts of the (N, 3C) projections.
constexpr int kMostParts = 3;
template <typename Y, typename Source>
struct QuantizeParts {
  int64_t n = 0;  // elements of each part
  float lo[kMostParts] = {}, hi[kMostParts] = {};
  Y* y[kMostParts] = {};         // forward: the quantized values
  const Y* dy[kMostParts] = {};  // backward: their gradients
  Source source[kMostParts] = {};
  const float* scale[kMostParts] = {};
  unsigned long long* clipped[kMostParts] = {};
  float* ds[kMostParts] = {};  // backward: nullptr where that scale takes no gradient
  double grad_scale[kMostParts] = {};
  double* partial[kMostParts] = {};
};
template <int W, typename Y, typename Source>
__global__ void fake_quantize_parts_forward(QuantizeParts<Y, Source> q) {
  const unsigned part = blockIdx.z;
  const int64_t begin = blockIdx.x * kQuantizeBlock, end = min(begin + kQuantizeBlock, q.n);
  fake_quantize_forward_block<W>(q.y[part], q.source[part], *q.scale[part], begin, end, q.lo[part], q.hi[part],
                                 q.clipped[part]);
}
template <int W, typename Y, typename Source>
__global__ void fake_quantize_parts_backward(QuantizeParts<Y, Source> q, bool accumulate, unsigned int* arrivals) {
  const unsigned part = blockIdx.z;
  const int64_t begin = blockIdx.x * kQuantizeBlock, end = min(begin + kQuantizeBlock, q.n);
  const double acc = fake_quantize_backward_block<W>(q.source[part], q.dy[part], *q.scale[part], begin, end, q.lo[part],
                                                     q.hi[part], accumulate);
  if (q.ds[part])
    add_share(acc, q.ds[part], q.grad_scale[part], q.partial[part], arrivals + part, 0, 1, blockIdx.x, gridDim.x);
}

// The quantizer's side of a launch: scales (device), range, LSQ gradient scale, saturation counter.
struct QuantizeLaunch {
  const float* scale;
  float* scale_grad;  // nullptr: the scale takes no gradient (backward only)
  int64_t n, channels;
  float lo, hi;
  double grad_scale;
  int64_t* clipped;  // device counter, or nullptr
  int8_t* integers = nullptr;  // forward: also the integers behind the values (QuantizeOutput::integers), or nullptr
  int64_t per_channel() const { return n / channels; }
  int64_t blocks_per_channel() const {
    const int64_t per = per_channel();
    return per > kQuantizeBlock ? (per + kQuantizeBlock - 1) / kQuantizeBlock : 1;
  }
  dim3 grid() const { return dim3(static_cast<unsigned>(blocks_per_channel()), static_cast<unsigned>(channels)); }
};

// Elements per access for a kernel moving elements of `bytes` and `other_bytes` (its two element types):
// 16-byte accesses (8 BF16 values: 8-byte ones leave the memory system half idle; 4 floats), when every
// pointer is 16-byte aligned and every channel holds a multiple of the width; else 4, else 1.
// `pointers`: any range of const void* (a braced list, or a vector for a variable number of buffers).
template <typename Pointers>
int pack_width(std::size_t bytes, std::size_t other_bytes, int64_t per_channel, const Pointers& pointers) {
  if (per_channel % 4 != 0) return 1;
  for (const void* p : pointers)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return 1;
  return bytes == 2 && other_bytes == 2 && per_channel % 8 == 0 ? 8 : 4;
}
inline int pack_width(std::size_t bytes, std::size_t other_bytes, int64_t per_channel,
                      std::initializer_list<const void*> pointers) {
  return pack_width<std::initializer_list<const void*>>(bytes, other_bytes, per_channel, pointers);
}

// y = fake_quantize(source values), `width` elements per access (pack_width).
template <typename Y, typename Source>
void launch_fake_quantize_forward(const Graph<float>& g, const QuantizeLaunch& q, Y* y, const Source& source,
                                  int width) {
  if (q.n == 0) return;
  auto* kernel = width == 8   ? &fake_quantize_forward<8, Y, Source>
                 : width == 4 ? &fake_quantize_forward<4, Y, Source>
                              : &fake_quantize_forward<1, Y, Source>;
  kernel<<<q.grid(), kThreads, 0, stream(g)>>>(y, source, q.scale, q.per_channel(), q.lo, q.hi,
                                               reinterpret_cast<unsigned long long*>(q.clipped), q.integers);
  BERT_CUDA_LAUNCHED();
}

// The gradients of the source's input (through source.store_input_grad) and of the scale (added to q.scale_grad).
template <typename Y, typename Source>
void launch_fake_quantize_backward(Graph<float>& g, const QuantizeLaunch& q, const Y* dy, const Source& source,
                                   int width, bool accumulate) {
  if (q.n == 0) return;
  const int64_t blocks = q.blocks_per_channel() * q.channels;
  double* partial = q.scale_grad && blocks > q.channels ? g.scratch<double>(blocks) : nullptr;
  auto* kernel = width == 8   ? &fake_quantize_backward<8, Y, Source>
                 : width == 4 ? &fake_quantize_backward<4, Y, Source>
                              : &fake_quantize_backward<1, Y, Source>;
  kernel<<<q.grid(), kThreads, 0, stream(g)>>>(source, dy, q.scale, q.per_channel(), q.lo, q.hi, accumulate,
                                               q.scale_grad, q.grad_scale, partial, context(g.device()).arrivals);
  BERT_CUDA_LAUNCHED();
}

// The parts' quantizers in one launch each way (fake_quantize_parts_forward / _backward), `width` elements
// per access; `parts` of them (at most kMostParts), every one n elements long.
template <typename Y, typename Source>
void launch_fake_quantize_parts_forward(const Graph<float>& g, const QuantizeParts<Y, Source>& q, int parts,
                                        int width) {
  BERT_CHECK(parts >= 1 && parts <= kMostParts, "fake quantization: 1 to 3 parts in one launch");
  if (q.n == 0) return;
  auto* kernel = width == 8   ? &fake_quantize_parts_forward<8, Y, Source>
                 : width == 4 ? &fake_quantize_parts_forward<4, Y, Source>
                              : &fake_quantize_parts_forward<1, Y, Source>;
  const dim3 grid(static_cast<unsigned>((q.n + kQuantizeBlock - 1) / kQuantizeBlock), 1, static_cast<unsigned>(parts));
  kernel<<<grid, kThreads, 0, stream(g)>>>(q);
  BERT_CUDA_LAUNCHED();
}
template <typename Y, typename Source>
void launch_fake_quantize_parts_backward(Graph<float>& g, QuantizeParts<Y, Source> q, int parts, int width,
                                         bool accumulate) {
  BERT_CHECK(parts >= 1 && parts <= kMostParts, "fake quantization: 1 to 3 parts in one launch");
  if (q.n == 0) return;
  const int64_t blocks = (q.n + kQuantizeBlock - 1) / kQuantizeBlock;
  for (int p = 0; p < parts; ++p) q.partial[p] = q.ds[p] && blocks > 1 ? g.scratch<double>(blocks) : nullptr;
  auto* kernel = width == 8   ? &fake_quantize_parts_backward<8, Y, Source>
                 : width == 4 ? &fake_quantize_parts_backward<4, Y, Source>
                              : &fake_quantize_parts_backward<1, Y, Source>;
  kernel<<<dim3(static_cast<unsigned>(blocks), 1, static_cast<unsigned>(parts)), kThreads, 0, stream(g)>>>(
      q, accumulate, context(g.device()).arrivals);
  BERT_CUDA_LAUNCHED();
}

// The launch of an op with its output's quantizer fused in (ops::QuantizeOutput), over its n outputs.
inline QuantizeLaunch fused_launch(Graph<float>& g, const ops::QuantizeOutput& q, int64_t n) {
  BERT_CHECK(g.value(q.scale).numel() == 1,
             "a fused fake quantization takes one (per-tensor) scale, got " + g.shape(q.scale).str());
  BERT_CHECK(q.qmin < 0 && q.qmax > 0, "fake_quantize: need qmin < 0 < qmax");
  return {g.value(q.scale).data(),    nullptr,      n,        1, static_cast<float>(q.qmin),
          static_cast<float>(q.qmax), q.grad_scale, q.clipped};
}
// Where q asks for them (QuantizeOutput::integers) and its range fits int8: memory for the integers behind
// y's n values, which launch writes (Graph::integers gives them to y's reader).
inline void add_integers(Graph<float>& g, const ops::QuantizeOutput& q, Var y, QuantizeLaunch& launch) {
  if (!q.integers || q.qmin < -128 || q.qmax > 127) return;
  launch.integers = g.scratch<int8_t>(std::size_t(g.shape(y).numel()));
  g.set_integers(y, launch.integers);
}

// In a fused op's backward: the launch with the scale's gradient (when it takes one), and x's target.
struct FusedBackward {
  QuantizeLaunch launch;
  Graph<float>::RawGradTarget dx;
};
inline FusedBackward fused_backward(Graph<float>& g, const QuantizeLaunch& forward, Var x, Var scale) {
  FusedBackward b{forward, {nullptr, false}};
  b.launch.scale_grad = g.requires_grad(scale) ? g.grad(scale).data() : nullptr;
  if (g.requires_grad(x)) b.dx = g.raw_grad_target(x);
  return b;
}

}  // namespace bert::cuda
