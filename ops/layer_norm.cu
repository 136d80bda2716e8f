// LayerNorm (add_layer_norm, dropout_add_layer_norm: the residual add, the dropout and its quantizer in the
// same kernels) on a CUDA device, forward and backward side by side like ops/layer_norm.cpp. One warp per
// row; the parameter gradients are column sums taken in two fixed-order passes (deterministic).
#include "ops/cuda/common.cuh"
#include "ops/cuda/fake_quantize.cuh"
#include "ops/cuda/rows.cuh"
#include "ops/cuda_impl.h"

namespace bert::ops::cuda_impl {

namespace {

template <typename A>
__global__ void layer_norm_forward(A* y, float* mean_out, float* rstd_out, const A* x, const float* gamma,
                                   const float* beta, int64_t rows, int64_t c, float eps) {
  const int64_t r = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const A* in = x + r * c;
  float sum = 0;
  for (int64_t j = lane; j < c; j += 32) sum += cuda::to_float(in[j]);
  const float mean = cuda::warp_sum(sum) / float(c);
  float var = 0;
  for (int64_t j = lane; j < c; j += 32) {
    const float d = cuda::to_float(in[j]) - mean;
    var += d * d;
  }
  const float rstd = rsqrtf(cuda::warp_sum(var) / float(c) + eps);
  for (int64_t j = lane; j < c; j += 32)
    y[r * c + j] = cuda::from_float<A>((cuda::to_float(in[j]) - mean) * rstd * gamma[j] + beta[j]);
  if (lane == 0) mean_out[r] = mean, rstd_out[r] = rstd;
}

template <typename A>
__global__ void layer_norm_backward_input(A* dx, const A* dy, const A* x, const float* gamma, const float* mean,
                                          const float* rstd, int64_t rows, int64_t c, bool accumulate) {
  const int64_t r = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const A *in = x + r * c, *dyr = dy + r * c;
  const float m = mean[r], rs = rstd[r];
  float mean_dn = 0, mean_dn_n = 0;
  for (int64_t j = lane; j < c; j += 32) {
    const float dn = cuda::to_float(dyr[j]) * gamma[j];
    mean_dn += dn;
    mean_dn_n += dn * (cuda::to_float(in[j]) - m) * rs;
  }
  mean_dn = cuda::warp_sum(mean_dn) / float(c);
  mean_dn_n = cuda::warp_sum(mean_dn_n) / float(c);
  for (int64_t j = lane; j < c; j += 32) {
    const float n = (cuda::to_float(in[j]) - m) * rs;
    cuda::store_grad(dx, r * c + j, rs * (cuda::to_float(dyr[j]) * gamma[j] - mean_dn - n * mean_dn_n), accumulate);
  }
}

// Dropout of LayerNorm's first addend inside its kernels (ops::dropout_add_layer_norm): element e of a is
// kept by DropoutDraws(seed, first + e) and scaled by keep_scale, as ops::dropout does it. Off: threshold 0.
// With `bits` set (a training step), the forward keeps the draws for the backward, which then reads them
// instead of drawing again: a word a lane a row (lane l's columns (k 32 + l) 4 + w, k < C <= 8, at bit
// 4 k + w), bits[row 32 + lane]; 128 bytes a row.
struct RowDrop {
  uint64_t seed = 0, first = 0;
  uint32_t threshold = 0;
  float keep_scale = 1.0f;
  uint32_t* bits = nullptr;
  // The keep bits of elements e .. e + 3 (bit w: e + w kept); e a multiple of 4, and so first + e
  // (DropoutDraws::reserve): the four share one hash.
  __device__ __forceinline__ uint32_t kept(int64_t e) const {
    return DropoutDraws::kept4(seed, (first + uint64_t(e)) / 4, threshold);
  }
  __device__ __forceinline__ void scales(float (&s)[4], uint32_t kept4) const {
    for (int w = 0; w < 4; ++w) s[w] = (kept4 >> w) & 1u ? keep_scale : 0.0f;
  }
};

// The quantizer of LayerNorm's first addend after its dropout (ops::dropout_add_layer_norm with a
// QuantizeOutput): the dropped value divided by the scale, rounded half to even, clamped and scaled back,
// in float, as fake_quantize over the dropout computes it. The backward recomputes it from a, passes the
// gradient straight through inside the range and sums the scale's gradient (cuda::add_scale_gradient).
template <typename A>
struct RowQuantize {
  const float* scale = nullptr;  // nullptr: no quantizer
  float lo = 0, hi = 0;
  unsigned long long* clipped = nullptr;  // forward: saturated elements, or nullptr
  const A* a = nullptr;                   // backward: the dropout's input
  float* ds = nullptr;                    // backward: the scale's gradient, or nullptr
  double grad_scale = 1;
  double* partial = nullptr;
  unsigned int* arrivals = nullptr;
};

// Where LayerNorm's output goes in inference when only quantizers read it (ops::add_layer_norm_quantized):
// up to two outputs instead of y, each the output rounded to A (as y would store it), then fake-quantized
// at its scale (q * scale in A) or as int8 (the integers); scale 0: the value itself.
// In a training step (NormOuts::kQuantizers) the outputs are those of per-tensor quantizers whose scales
// live on the device (`scales`; scale and reciprocal unused): each the output rounded to A, fake-quantized to
// [lo, hi] as fake_quantize_each of the stored output, its saturations counted in `clipped` (where set); the
// output itself goes to y (the quantizers' backward reads it).
struct RowOutputs {
  int count = 0;  // 0: y
  void* out[2] = {nullptr, nullptr};
  float scale[2] = {0.0f, 0.0f}, reciprocal[2] = {1.0f, 1.0f};
  bool integers[2] = {false, false};
  const float* scales[2] = {nullptr, nullptr};
  float lo[2] = {0.0f, 0.0f}, hi[2] = {0.0f, 0.0f};
  unsigned long long* clipped[2] = {nullptr, nullptr};
  int8_t* quantized_integers[2] = {nullptr, nullptr};  // kQuantizers: the integers behind out[o] too, where set
};
// The outputs an INT8 model's residual LayerNorms make, compiled in: the integers of the next integer
// layer's input and the residual add's input, fake-quantized (kIntegersFake; kIntegersShared where its
// quantizer's scale is the integers' own, as calibration gives two quantizers of the same tensor: the
// quotient worked out once) or as it is (kIntegersValue); both as integers (kIntegersTwo: the next residual
// LayerNorm reads them), or one output of integers (kIntegersOne: both readers at one scale). kAny: whatever
// RowOutputs holds, its kinds tested a chunk. kQuantizers: a training step's (RowOutputs::scales).
enum class NormOuts { kAny, kIntegersFake, kIntegersShared, kIntegersValue, kIntegersTwo, kIntegersOne, kQuantizers };
NormOuts norm_outs(const RowOutputs& o) {
  if (o.count > 0 && o.scales[0]) return NormOuts::kQuantizers;
  if (o.count == 1) return o.integers[0] && o.scale[0] > 0 ? NormOuts::kIntegersOne : NormOuts::kAny;
  if (o.count != 2 || !o.integers[0] || !(o.scale[0] > 0)) return NormOuts::kAny;
  if (o.integers[1]) return o.scale[1] > 0 ? NormOuts::kIntegersTwo : NormOuts::kAny;
  if (!(o.scale[1] > 0)) return NormOuts::kIntegersValue;
  return o.scale[1] == o.scale[0] && o.reciprocal[1] == o.reciprocal[0] ? NormOuts::kIntegersShared
                                                                        : NormOuts::kIntegersFake;
}

// The addends' storage (ops::NormInputs): each in A, or int8 integers at a scale (> 0), integer i standing
// for from_float<A>(i * scale), the value its quantizer's fake quantization stores (an INT8 model's residual
// stream: half the bytes of BF16). kIns: both in A (kValues) or both integers (kIntegers) compiled in; kAny:
// as RowIns says, tested a row; kGathered: BERT's embeddings (RowGather), a and b unused.
enum class NormIns { kValues, kIntegers, kAny, kGathered };
// BERT's embeddings as LayerNorm's addends (ops::embedding_layer_norm_quantized): row r's a is its word's row
// plus its position's (r % seq), b its token type's, each gathered row rounded to A and the sum too, as
// gather_rows and add store them. F32 tables of the row's width.
struct RowGather {
  const float *words = nullptr, *positions = nullptr, *types = nullptr;
  const int32_t *ids = nullptr, *type_ids = nullptr;
  int64_t seq = 1;
};
struct RowIns {
  float a_scale = 0.0f, b_scale = 0.0f;  // 0: that addend in A
  RowGather gather;                      // NormIns::kGathered
};

// Four floats rounded to A as from_float<A> rounds each, in BF16 a pair a conversion.
template <typename A>
__device__ __forceinline__ cuda::Pack<A, 4> rounded_pack(const float (&x)[4]) {
  cuda::Pack<A, 4> p;
  if constexpr (std::is_same_v<A, cuda::bf16>) {
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(p.v);
    pairs[0] = __floats2bfloat162_rn(x[0], x[1]);
    pairs[1] = __floats2bfloat162_rn(x[2], x[3]);
  } else {
    for (int w = 0; w < 4; ++w) p.v[w] = cuda::from_float<A>(x[w]);
  }
  return p;
}

// The floats of four A values, as to_float gives each; in BF16 from the pack's two 32-bit words, one shift
// or mask a value (taken apart a value at a time, each half went to a register of its own first: two
// instructions a value, about 3.4 of the INT8 LayerNorm's 34 an element).
template <typename A>
__device__ __forceinline__ void unpacked(const cuda::Pack<A, 4>& p, float (&x)[4]) {
  if constexpr (std::is_same_v<A, cuda::bf16>) {
    const uint2 words = *reinterpret_cast<const uint2*>(p.v);
    x[0] = __uint_as_float(words.x << 16), x[1] = __uint_as_float(words.x & 0xFFFF0000u);
    x[2] = __uint_as_float(words.y << 16), x[3] = __uint_as_float(words.y & 0xFFFF0000u);
  } else {
    for (int w = 0; w < 4; ++w) x[w] = cuda::to_float(p.v[w]);
  }
}

// A row's loads in the register layout (ops/cuda/rows.cuh): a's packs and, where b is set, b's.
template <int C, typename A>
struct RowPacks {
  cuda::Pack<A, 4> a[C], b[C];
  __device__ __forceinline__ void load(const A* pa, const A* pb, int64_t row, int c, int lane) {
#pragma unroll
    for (int k = 0; k < C; ++k) {
      const int j = (k * 32 + lane) * 4;
      if (j >= c) continue;  // (not break: the loop unrolls, the arrays stay in registers)
      a[k] = cuda::load_pack<4>(pa + row + j);
      if (pb) b[k] = cuda::load_pack<4>(pb + row + j);
    }
  }
  // The same for addends stored as kIns and ins say (NormIns: kValues or kAny; kIntegers loads through RowWords):
  // every load first, then the integers' values.
  template <NormIns kIns>
  __device__ __forceinline__ void load_addends(const void* pa, const void* pb, const RowIns& ins, int64_t row, int c,
                                               int lane) {
    static_assert(kIns != NormIns::kIntegers && kIns != NormIns::kGathered,
                  "integer addends load through RowWords, embeddings through gather");
    if constexpr (kIns == NormIns::kValues) {
      load(static_cast<const A*>(pa), static_cast<const A*>(pb), row, c, lane);
    } else {
      const bool int_a = ins.a_scale > 0, int_b = ins.b_scale > 0;
      uint32_t qa[C], qb[C];  // four integers each
#pragma unroll
      for (int k = 0; k < C; ++k) {
        const int j = (k * 32 + lane) * 4;
        if (j >= c) continue;
        if (int_a)
          qa[k] = *reinterpret_cast<const uint32_t*>(static_cast<const int8_t*>(pa) + row + j);
        else
          a[k] = cuda::load_pack<4>(static_cast<const A*>(pa) + row + j);
        if (!pb) continue;
        if (int_b)
          qb[k] = *reinterpret_cast<const uint32_t*>(static_cast<const int8_t*>(pb) + row + j);
        else
          b[k] = cuda::load_pack<4>(static_cast<const A*>(pb) + row + j);
      }
#pragma unroll
      for (int k = 0; k < C; ++k) {
        if ((k * 32 + lane) * 4 >= c) continue;
        if (int_a) a[k] = integer_values(qa[k], ins.a_scale);
        if (pb && int_b) b[k] = integer_values(qb[k], ins.b_scale);
      }
    }
  }
  // Row r's embeddings (NormIns::kGathered): every load first, then the roundings and the sum.
  __device__ __forceinline__ void gather(const RowGather& e, int64_t r, int c, int lane) {
    const float* word = e.words + int64_t(e.ids[r]) * c;
    const float* position = e.positions + (r % e.seq) * c;
    const float* type = e.types + int64_t(e.type_ids[r]) * c;
    cuda::Pack<float, 4> w[C], p[C], t[C];
#pragma unroll
    for (int k = 0; k < C; ++k) {
      const int j = (k * 32 + lane) * 4;
      if (j >= c) continue;
      w[k] = cuda::load_pack<4>(word + j), p[k] = cuda::load_pack<4>(position + j), t[k] = cuda::load_pack<4>(type + j);
    }
#pragma unroll
    for (int k = 0; k < C; ++k) {
      if ((k * 32 + lane) * 4 >= c) continue;
      float word[4], position[4], sum[4];
      unpacked(rounded_pack<A>(w[k].v), word);
      unpacked(rounded_pack<A>(p[k].v), position);
      for (int v = 0; v < 4; ++v) sum[v] = word[v] + position[v];
      a[k] = rounded_pack<A>(sum);
      b[k] = rounded_pack<A>(t[k].v);
    }
  }
  // Four int8 integers (the lowest byte first) as their values at `scale` in A.
  __device__ __forceinline__ static cuda::Pack<A, 4> integer_values(uint32_t q, float scale) {
    float x[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) x[w] = float(int8_t(q >> (8 * w))) * scale;
    return rounded_pack<A>(x);
  }
};

// A row's addends as int8 integers (NormIns::kIntegers): four a word, a lane's words in the register layout.
template <int C>
struct RowWords {
  uint32_t a[C], b[C];
  __device__ __forceinline__ void load(const void* pa, const void* pb, int64_t row, int c, int lane) {
#pragma unroll
    for (int k = 0; k < C; ++k) {
      const int j = (k * 32 + lane) * 4;
      if (j >= c) continue;
      a[k] = *reinterpret_cast<const uint32_t*>(static_cast<const int8_t*>(pa) + row + j);
      b[k] = *reinterpret_cast<const uint32_t*>(static_cast<const int8_t*>(pb) + row + j);
    }
  }
  // Their values at the addends' scales, in A.
  template <typename A>
  __device__ __forceinline__ RowPacks<C, A> values(const RowIns& ins, int c, int lane) const {
    RowPacks<C, A> packs;
#pragma unroll
    for (int k = 0; k < C; ++k) {
      if ((k * 32 + lane) * 4 >= c) continue;
      packs.a[k] = RowPacks<C, A>::integer_values(a[k], ins.a_scale);
      packs.b[k] = RowPacks<C, A>::integer_values(b[k], ins.b_scale);
    }
    return packs;
  }
};

// How many blocks of `kernel` (with `shared_bytes` of dynamic shared memory) fit on the device at once, at
// most one a kWarpsPerBlock rows.
template <typename Kernel>
unsigned resident_row_blocks(const Graph<float>& g, Kernel kernel, int64_t rows, size_t shared_bytes = 0) {
  int per_sm = 0;
  BERT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32 * kWarpsPerBlock, shared_bytes));
  const int64_t resident = int64_t(std::max(per_sm, 1)) * std::max(cuda::context(g.device()).sm_count, 1);
  return unsigned(std::clamp<int64_t>(row_blocks(rows), 1, resident));
}

// LayerNorm with its rows in registers (ops/cuda/rows.cuh's layout: C chunks of 128 columns,
// 4 a lane; c a multiple of 4 up to 1024). With b set, x = a + b rounded to A (what the add op would store)
// is normalised and, where `sums` is set, stored for the backward; with `drop` on (threshold > 0), a is
// first dropped out and rounded to A (what the dropout op would store); with q on, the dropped value is
// fake-quantized before that rounding. With `outs` set the output goes there instead of y. kPlain: neither
// q nor outs (a training step's LayerNorm), those paths compiled out (fewer registers and instructions).
// kFull: c = 128 C (with_full_rows), known when compiled: no bounds test or address arithmetic a pack
// (BERT-base's LayerNorm in a BF16 step 18.2 -> 15.4 us, 70 -> 64 registers; its INT8 one 46 -> 38 us).
// kOuts: the outputs' kinds where known when compiled (NormOuts; the integers rounded and saturated by
// int8_quad's two packs).
// The quantized variants are held to 64 registers (four blocks an SM; a little spilled): with the division
// chosen once per row they took 84, two blocks an SM (BERT-base's INT8 LayerNorm 57.6 us against 46.1).
// (0: no minimum.)
template <int C, typename A, bool kPlain, bool kFull, NormOuts kOuts = NormOuts::kAny, NormIns kIns = NormIns::kValues>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, kPlain                       ? 0
                                                       : kIns == NormIns::kIntegers ? 3
                                                       : kIns == NormIns::kGathered ? 2
                                                                                    : 4)
    layer_norm_rows_forward(A* y, A* sums, float* mean_out, float* rstd_out, const void* a, const void* b,
                            const float* gamma, const float* beta, int64_t rows, int width, float eps, RowDrop drop,
                            RowQuantize<A> q, RowOutputs outs, RowIns ins) {
  const int c = kFull ? C * 128 : width;
  __shared__ int64_t shared[32];
  const int64_t first = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  int clipped = 0;  // at most 4 C
  const cuda::ScaleDivision divide(!kPlain && q.scale ? *q.scale : 1.0f);
  // A training step's output quantizers (kQuantizers): their divisions and saturation counts.
  cuda::ScaleDivision out_divide[2];
  int out_clipped[2] = {0, 0};
  bool outs_normal = true;
  if constexpr (kOuts == NormOuts::kQuantizers) {
#pragma unroll
    for (int o = 0; o < 2; ++o)
      if (o < outs.count) out_divide[o] = cuda::ScaleDivision(*outs.scales[o]), outs_normal &= out_divide[o].normal;
  }
  // Row r from its loaded addends, with the quantizer's division known to be the branch-free one (kNormal) or
  // not: chosen once.
  auto normalize = [&](auto normal_tag, int64_t r, RowPacks<C, A> packs) {
    constexpr bool kNormal = decltype(normal_tag)::value;
    float v[C][4];
    float sum = 0;
    const int64_t row = r * c;
    auto &pa = packs.a, &pb = packs.b;
    uint32_t kept_bits = 0;  // this lane's draws of the row, for drop.bits
#pragma unroll
    for (int k = 0; k < C; ++k) {
      const int j = (k * 32 + lane) * 4;
      if (j >= c) continue;
      const bool quantized = !kPlain && q.scale;
      if (drop.threshold || quantized) {
        float keep[4] = {1.0f, 1.0f, 1.0f, 1.0f};
        if (drop.threshold) {
          const uint32_t kept = drop.kept(row + j);
          kept_bits |= kept << (4 * k);
          drop.scales(keep, kept);
        }
        for (int w = 0; w < 4; ++w) {
          const float e = cuda::to_float(pa[k].v[w]) * keep[w];
          pa[k].v[w] =
              cuda::from_float<A>(quantized ? cuda::fake_quantize_value<kNormal>(e, divide, q.lo, q.hi, clipped) : e);
        }
      }
      if (kIns == NormIns::kGathered || b) {
        float added[4], other[4];
        unpacked(pa[k], added);
        unpacked(pb[k], other);
        for (int w = 0; w < 4; ++w) added[w] += other[w];
        const cuda::Pack<A, 4> ps = rounded_pack<A>(added);
        if (sums) cuda::store_pack<4>(sums + row + j, ps);
        unpacked(ps, v[k]);
      } else {
        unpacked(pa[k], v[k]);
      }
      for (int w = 0; w < 4; ++w) sum += v[k][w];
    }
    const float mean = cuda::warp_sum(sum) / float(c);
    float var = 0;  // (v holds the differences from the mean from here on)
#pragma unroll
    for (int k = 0; k < C; ++k) {
      if ((k * 32 + lane) * 4 >= c) continue;
      for (int w = 0; w < 4; ++w) v[k][w] -= mean, var += v[k][w] * v[k][w];
    }
    const float rstd = rsqrtf(cuda::warp_sum(var) / float(c) + eps);
#pragma unroll
    for (int k = 0; k < C; ++k) {
      const int j = (k * 32 + lane) * 4;
      if (j >= c) continue;
      const cuda::Pack<float, 4> gm = cuda::load_pack<4>(gamma + j), bt = cuda::load_pack<4>(beta + j);
      float normalized[4];
      for (int w = 0; w < 4; ++w) normalized[w] = v[k][w] * rstd * gm.v[w] + bt.v[w];
      const cuda::Pack<A, 4> out = rounded_pack<A>(normalized);
      float stored[4];  // out's values
      unpacked(out, stored);
      if constexpr (kOuts == NormOuts::kQuantizers) {
        cuda::store_pack<4>(y + row + j, out);  // for the quantizers' backward
#pragma unroll
        for (int o = 0; o < 2; ++o) {
          if (o >= outs.count) break;
          cuda::Pack<A, 4> fake;
          if (int8_t* integers = outs.quantized_integers[o]) {  // (QuantizeOutput::integers)
            float u[4];
            for (int w = 0; w < 4; ++w) {
              u[w] = cuda::fake_quantize_integer<kNormal>(stored[w], out_divide[o], outs.lo[o], outs.hi[o],
                                                          out_clipped[o]);
              fake.v[w] = cuda::from_float<A>(u[w] * out_divide[o].s);
            }
            *reinterpret_cast<uint32_t*>(integers + row + j) = cuda::int8_quad(u[0], u[1], u[2], u[3]);
          } else {
            for (int w = 0; w < 4; ++w)
              fake.v[w] = cuda::from_float<A>(
                  cuda::fake_quantize_value<kNormal>(stored[w], out_divide[o], outs.lo[o], outs.hi[o], out_clipped[o]));
          }
          cuda::store_pack<4>(static_cast<A*>(outs.out[o]) + row + j, fake);
        }
        continue;
      } else if constexpr (kOuts != NormOuts::kAny) {
        float u[4];
        for (int w = 0; w < 4; ++w)
          u[w] = cuda::ScaleDivision::normal_quotient(stored[w], outs.scale[0], outs.reciprocal[0]);
        *reinterpret_cast<uint32_t*>(static_cast<int8_t*>(outs.out[0]) + row + j) =
            cuda::int8_quad(u[0], u[1], u[2], u[3]);
        if constexpr (kOuts == NormOuts::kIntegersOne) {
          continue;
        } else if constexpr (kOuts == NormOuts::kIntegersTwo) {
          for (int w = 0; w < 4; ++w)
            u[w] = cuda::ScaleDivision::normal_quotient(stored[w], outs.scale[1], outs.reciprocal[1]);
          *reinterpret_cast<uint32_t*>(static_cast<int8_t*>(outs.out[1]) + row + j) =
              cuda::int8_quad(u[0], u[1], u[2], u[3]);
        } else if constexpr (kOuts == NormOuts::kIntegersShared) {
          cuda::Pack<A, 4> fake;
          for (int w = 0; w < 4; ++w) fake.v[w] = cuda::from_float<A>(cuda::int8_round(u[w]) * outs.scale[0]);
          cuda::store_pack<4>(static_cast<A*>(outs.out[1]) + row + j, fake);
        } else if constexpr (kOuts == NormOuts::kIntegersFake) {
          cuda::Pack<A, 4> fake;
          for (int w = 0; w < 4; ++w)
            fake.v[w] = cuda::from_float<A>(
                cuda::int8_round(cuda::ScaleDivision::normal_quotient(stored[w], outs.scale[1], outs.reciprocal[1])) *
                outs.scale[1]);
          cuda::store_pack<4>(static_cast<A*>(outs.out[1]) + row + j, fake);
        } else {
          cuda::store_pack<4>(static_cast<A*>(outs.out[1]) + row + j, out);
        }
        continue;
      } else if constexpr (!kPlain) {
        if (outs.count > 0) {
#pragma unroll
          for (int o = 0; o < 2; ++o) {
            if (o >= outs.count) break;
            if (!outs.integers[o] && !(outs.scale[o] > 0)) {  // the value itself: no quotients to work out
              cuda::store_pack<4>(static_cast<A*>(outs.out[o]) + row + j, out);
              continue;
            }
            const float s = outs.scale[o] > 0 ? outs.scale[o] : 1.0f;
            float quantized[4];
            for (int w = 0; w < 4; ++w)
              quantized[w] = cuda::int8_round(cuda::ScaleDivision::normal_quotient(stored[w], s, outs.reciprocal[o]));
            if (outs.integers[o]) {
              cuda::Pack<int8_t, 4> integers;
              for (int w = 0; w < 4; ++w) integers.v[w] = static_cast<int8_t>(quantized[w]);
              cuda::store_pack<4>(static_cast<int8_t*>(outs.out[o]) + row + j, integers);
            } else {
              cuda::Pack<A, 4> fake;
              for (int w = 0; w < 4; ++w) fake.v[w] = cuda::from_float<A>(quantized[w] * outs.scale[o]);
              cuda::store_pack<4>(static_cast<A*>(outs.out[o]) + row + j, fake);
            }
          }
          continue;
        }
      }
      cuda::store_pack<4>(y + row + j, out);
    }
    if (lane == 0) mean_out[r] = mean, rstd_out[r] = rstd;
    if (drop.bits) drop.bits[r * 32 + lane] = kept_bits;
  };
  if constexpr (kIns == NormIns::kIntegers) {
    // A grid of resident blocks, each warp taking every (grid's warps)-th row from `first`, the next row's
    // integers loaded while it works on one: their latency hidden, for 2 C registers. (No quantizer of a.)
    const int64_t stride = int64_t(gridDim.x) * kWarpsPerBlock;
    RowWords<C> next;
    if (first < rows) next.load(a, b, first * c, c, lane);
#pragma unroll 1
    for (int64_t r = first; r < rows; r += stride) {
      const RowWords<C> now = next;
      if (r + stride < rows) next.load(a, b, (r + stride) * c, c, lane);
      normalize(std::true_type{}, r, now.template values<A>(ins, c, lane));
    }
  } else if (first < rows) {  // one row a warp; no early return: the saturation count below is a block's sum
    RowPacks<C, A> packs;     // every load first, then the arithmetic
    if constexpr (kIns == NormIns::kGathered)
      packs.gather(ins.gather, first, c, lane);
    else
      packs.template load_addends<kIns>(a, b, ins, first * c, c, lane);
    cuda::with_division(kPlain || (divide.normal && outs_normal),
                        [&](auto normal_tag) { normalize(normal_tag, first, packs); });
  }
  if (!kPlain && q.clipped) {
    const int64_t total = cuda::block_sum(int64_t{clipped}, shared);
    if (threadIdx.x == 0 && total) atomicAdd(q.clipped, static_cast<unsigned long long>(total));
  }
  if constexpr (kOuts == NormOuts::kQuantizers) {
#pragma unroll
    for (int o = 0; o < 2; ++o) {
      if (o >= outs.count || !outs.clipped[o]) continue;
      const int64_t total = cuda::block_sum(int64_t{out_clipped[o]}, shared);
      if (threadIdx.x == 0 && total) atomicAdd(outs.clipped[o], static_cast<unsigned long long>(total));
    }
  }
}

// Where LayerNorm's backward writes the input's gradient: one target, or two for a + b (the gradient of a
// sum goes to both addends), each stored or added.
template <typename A>
struct InputGrads {
  A* da = nullptr;
  A* db = nullptr;
  bool accumulate_a = false, accumulate_b = false;
};
template <int W, typename A>
__device__ __forceinline__ void store_grad_to(A* d, bool accumulate, const float (&v)[W]) {
  cuda::Pack<A, W> out;
  if (accumulate) out = cuda::load_pack<W>(d);
  for (int w = 0; w < W; ++w) out.v[w] = cuda::from_float<A>(accumulate ? cuda::to_float(out.v[w]) + v[w] : v[w]);
  cuda::store_pack<W>(d, out);
}

// LayerNorm's backward, rows in registers: the input's gradient row by row and, in the same pass, the
// block's sums of dy n and dy over its rows per column into partial_gamma/partial_beta[block][col] (gamma's
// and beta's gradients: cuda::launch_add_partial_rows adds the blocks in order). Block i takes rows
// i per_block on, warp w every kWarpsPerBlock-th of them from w, adding into its own rows of the column
// sums in shared memory (backward_row_shared bytes; registers would hold 8 C floats a lane and leave room
// for two blocks an SM); the warps' sums are then added in warp order (deterministic). The loops over a
// row's packs unroll so that its arrays stay in registers. In the plain kernel a warp loads its next row
// while it works on the current one (below), at two blocks an SM from 640 columns on (up to 128
// registers), as many blocks as are resident: BERT-base's BF16 LayerNorm backward 24.7 -> 21.3 us with
// kFull (23.7 with kFull alone, three blocks an SM), and 264 partial rows instead of 342 for the second
// pass (7.5 -> 5.2 us). With partial_da set, the blocks also sum the gradient they write to a (its rows
// as stored) into partial_da[block][col], a third array of column sums: a linear's bias gradient
// (Graph::bias_to_sum), added by the second pass with gamma's and beta's.
// The sum a LayerNorm normalised, four columns from e (a multiple of 4) of its row: a dropped out (its
// four keep bits, or drawn again where drop.bits is unset) and rounded to A, plus the residual, rounded to
// A: layer_norm_rows_forward's arithmetic, so the same values.
template <typename A>
__device__ __forceinline__ cuda::Pack<A, 4> normalised_sum(cuda::Pack<A, 4> a, const cuda::Pack<A, 4>& residual,
                                                           const RowDrop& drop, uint32_t kept4, int64_t e) {
  if (drop.threshold) {
    float keep[4];
    drop.scales(keep, drop.bits ? kept4 & 15u : drop.kept(e));
    for (int w = 0; w < 4; ++w) a.v[w] = cuda::from_float<A>(cuda::to_float(a.v[w]) * keep[w]);
  }
  float added[4], other[4];
  unpacked(a, added);
  unpacked(residual, other);
  for (int w = 0; w < 4; ++w) added[w] += other[w];
  return rounded_pack<A>(added);
}

template <int C>
constexpr size_t backward_row_shared(int sums = 2) {
  return size_t(sums * kWarpsPerBlock) * C * 128 * sizeof(float);
}
template <int C, typename A, bool kPlain, bool kFull>
__global__ void __launch_bounds__(32 * kWarpsPerBlock, C <= 4 ? 3 : 2)
    layer_norm_rows_backward(InputGrads<A> to, float* partial_gamma, float* partial_beta, float* partial_da,
                             const A* dy, const A* x, const A* residual, const float* gamma, const float* mean,
                             const float* rstd, int64_t rows, int width, int64_t per_block, RowDrop drop,
                             RowQuantize<A> q) {
  const int c = kFull ? C * 128 : width;
  extern __shared__ __align__(16) float column_sums[];  // [2 or 3][kWarpsPerBlock][C 128]: dy n, dy, da
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* const sum_dyn = column_sums + warp * C * 128;                        // this warp's, touched by
  float* const sum_dy = column_sums + (kWarpsPerBlock + warp) * C * 128;      // its lanes' own columns
  float* const sum_da = column_sums + (2 * kWarpsPerBlock + warp) * C * 128;  // only
#pragma unroll
  for (int k = 0; k < C; ++k) {
    const int j = (k * 32 + lane) * 4;
    if (j >= c) continue;
    if (partial_gamma) {
      *reinterpret_cast<float4*>(sum_dyn + j) = float4{};
      *reinterpret_cast<float4*>(sum_dy + j) = float4{};
    }
    if (partial_da) *reinterpret_cast<float4*>(sum_da + j) = float4{};
  }
  double acc = 0;  // this thread's share of the quantizer scale's gradient
  const bool quantized = !kPlain && q.scale;
  const cuda::ScaleDivision divide(quantized ? *q.scale : 1.0f);
  const int64_t end = min(rows, (blockIdx.x + 1) * per_block);
  // The plain kernel loads x's and dy's next row while it works on the current one; the quantized one has
  // no registers for that and loads the quantizer's input (q.a) with the row instead, so that its loads
  // are in flight through the row's first pass (loaded where the second pass reads it, BERT-base's QAT
  // LayerNorm backward took 39.5 us in BF16; so, 35.4).
  // With `residual` set (the plain kernel in FP32), x holds the sum's first addend, a: the row LayerNorm
  // normalised is formed again from a, its dropout and the residual, as the forward formed it. (The
  // residual's row is loaded with the row it belongs to: loaded ahead with x's and dy's, it spilled.)
  // At 1,024 columns the row ahead does not fit in the registers beside the current one (it spilled: BERT-large's
  // BF16 LayerNorm backward took 24.4 us); there a row's own loads, 16 a lane, keep enough in flight.
  constexpr bool kAhead = kPlain && C < 8;
  int64_t r = blockIdx.x * per_block + warp;
  RowPacks<C, A> ahead;  // x's row (a) and dy's (b)
  if (kAhead && r < end) ahead.load(x, dy, r * c, c, lane);
#pragma unroll 1
  for (; r < end; r += kWarpsPerBlock) {
    const float m = mean[r], rs = rstd[r];
    const uint32_t kept_bits = drop.bits ? drop.bits[r * 32 + lane] : 0u;  // used in the second pass
    RowPacks<C, A> row;
    cuda::Pack<A, 4> qa[C];  // the quantizer's input, the dropout's (quantized only)
    if constexpr (kPlain) {
      if constexpr (kAhead)
        row = ahead;
      else
        row.load(x, dy, r * c, c, lane);
      cuda::Pack<A, 4> row_residual[C];
      if (residual)
#pragma unroll
        for (int k = 0; k < C; ++k)
          if ((k * 32 + lane) * 4 < c) row_residual[k] = cuda::load_pack<4>(residual + r * c + (k * 32 + lane) * 4);
      if (kAhead && r + kWarpsPerBlock < end) ahead.load(x, dy, (r + kWarpsPerBlock) * c, c, lane);
      if (residual)
#pragma unroll
        for (int k = 0; k < C; ++k) {
          const int j = (k * 32 + lane) * 4;
          if (j >= c) continue;
          row.a[k] = normalised_sum(row.a[k], row_residual[k], drop, kept_bits >> (4 * k), r * c + j);
        }
    } else {
      row.load(x, dy, r * c, c, lane);
      if (quantized)
#pragma unroll
        for (int k = 0; k < C; ++k)
          if ((k * 32 + lane) * 4 < c) qa[k] = cuda::load_pack<4>(q.a + r * c + (k * 32 + lane) * 4);
    }
    const auto &px = row.a, &pd = row.b;
    float mean_dn = 0, mean_dn_n = 0;
#pragma unroll
    for (int k = 0; k < C; ++k) {
      const int j = (k * 32 + lane) * 4;
      if (j >= c) continue;
      const cuda::Pack<float, 4> gm = cuda::load_pack<4>(gamma + j);
      cuda::Pack<float, 4> dyn, dys;
      if (partial_gamma) dyn = cuda::load_pack<4>(sum_dyn + j), dys = cuda::load_pack<4>(sum_dy + j);
      for (int w = 0; w < 4; ++w) {
        const float d = cuda::to_float(pd[k].v[w]), n = (cuda::to_float(px[k].v[w]) - m) * rs, dn = d * gm.v[w];
        dyn.v[w] += d * n;
        dys.v[w] += d;
        mean_dn += dn;
        mean_dn_n += dn * n;
      }
      if (partial_gamma) cuda::store_pack<4>(sum_dyn + j, dyn), cuda::store_pack<4>(sum_dy + j, dys);
    }
    if (!to.da && !to.db && (kPlain || !q.ds)) continue;
    mean_dn = cuda::warp_sum(mean_dn) / float(c);
    mean_dn_n = cuda::warp_sum(mean_dn_n) / float(c);
#pragma unroll
    for (int k = 0; k < C; ++k) {
      const int j = (k * 32 + lane) * 4;
      if (j >= c) continue;
      const cuda::Pack<float, 4> gm = cuda::load_pack<4>(gamma + j);
      float out[4];
      for (int w = 0; w < 4; ++w) {
        const float n = (cuda::to_float(px[k].v[w]) - m) * rs;
        out[w] = rs * (cuda::to_float(pd[k].v[w]) * gm.v[w] - mean_dn - n * mean_dn_n);
      }
      if (to.db) store_grad_to<4>(to.db + r * c + j, to.accumulate_b, out);
      if (!to.da && (kPlain || !q.ds)) continue;
      float keep[4] = {1.0f, 1.0f, 1.0f, 1.0f};
      if (drop.threshold)  // through the dropout: its mask as the forward kept it, or drawn again
        drop.scales(keep, drop.bits ? (kept_bits >> (4 * k)) & 15u : drop.kept(r * c + j));
      if (quantized) {                                   // and the quantizer: straight through inside its range
        const cuda::Pack<A, 4>& pa = qa[k];
        float part = 0;
        for (int w = 0; w < 4; ++w)
          out[w] = cuda::fake_quantize_value_grad(cuda::to_float(pa.v[w]) * keep[w], out[w], keep[w], divide, q.lo,
                                                  q.hi, part);
        acc += part;
      } else {
        for (int w = 0; w < 4; ++w) out[w] *= keep[w];
      }
      if (to.da) store_grad_to<4>(to.da + r * c + j, to.accumulate_a, out);
      if (partial_da) {  // what was stored (partial_da only where to.da is stored, not added to)
        cuda::Pack<float, 4> sums = cuda::load_pack<4>(sum_da + j);
        for (int w = 0; w < 4; ++w) sums.v[w] += cuda::to_float(cuda::from_float<A>(out[w]));
        cuda::store_pack<4>(sum_da + j, sums);
      }
    }
  }
  if (!kPlain && q.ds) cuda::add_scale_gradient(acc, q.ds, q.grad_scale, q.partial, q.arrivals);
  if (!partial_gamma && !partial_da) return;
  __syncthreads();
  for (int col = threadIdx.x; col < c; col += blockDim.x) {
    if (partial_gamma) {
      float total_dyn = 0, total_dy = 0;
      for (int v = 0; v < kWarpsPerBlock; ++v) {
        total_dyn += column_sums[v * C * 128 + col];
        total_dy += column_sums[(kWarpsPerBlock + v) * C * 128 + col];
      }
      partial_gamma[blockIdx.x * int64_t(c) + col] = total_dyn;
      partial_beta[blockIdx.x * int64_t(c) + col] = total_dy;
    }
    if (partial_da) {
      float total = 0;
      for (int v = 0; v < kWarpsPerBlock; ++v) total += column_sums[(2 * kWarpsPerBlock + v) * C * 128 + col];
      partial_da[blockIdx.x * int64_t(c) + col] = total;
    }
  }
}

// Pass 1: partial[chunk][col] of sum dy * n (gamma) and sum dy (beta) over the chunk's rows. Block (32,
// 8): 32 columns, 8 row lanes.
constexpr int64_t kRowsPerChunk = 256;
template <typename A>
__global__ void layer_norm_param_partials(float* partial_gamma, float* partial_beta, const A* dy, const A* x,
                                          const float* mean, const float* rstd, int64_t rows, int64_t c) {
  __shared__ float sg[8][33], sb[8][33];
  const int64_t col = blockIdx.x * 32 + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  float ag = 0, ab = 0;
  if (col < c) {
    const int64_t end = min(rows, (chunk + 1) * kRowsPerChunk);
    for (int64_t r = chunk * kRowsPerChunk + threadIdx.y; r < end; r += 8) {
      const float d = cuda::to_float(dy[r * c + col]);
      ag += d * (cuda::to_float(x[r * c + col]) - mean[r]) * rstd[r];
      ab += d;
    }
  }
  sg[threadIdx.y][threadIdx.x] = ag;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && col < c) {
    for (int k = 1; k < 8; ++k) ag += sg[k][threadIdx.x], ab += sb[k][threadIdx.x];
    partial_gamma[chunk * c + col] = ag;
    partial_beta[chunk * c + col] = ab;
  }
}

void launch_param_sums(Graph<float>& g, float* dgamma, float* dbeta, const float* partial_gamma,
                       const float* partial_beta, int64_t chunks, int64_t c) {
  cuda::launch_add_partial_rows(g, dgamma, partial_gamma, dbeta, partial_beta, chunks, c);
}

// LayerNorm's backward: the input's gradient, then gamma's and beta's (F32 parameters).
template <typename A>
void layer_norm_backward(Graph<float>& g, Var x, Var gamma, Var beta, Var y, const float* mean, const float* rstd,
                         int64_t rows, int64_t c) {
  const A* dy = cuda::typed<A>(g.grad_data(y));
  const A* xv = cuda::typed<A>(g.data(x));
  if (g.requires_grad(x)) {
    const auto dx = g.raw_grad_target(x);
    layer_norm_backward_input<A><<<row_blocks(rows), 32 * kWarpsPerBlock, 0, cuda::stream(g)>>>(
        cuda::typed<A>(dx.data), dy, xv, g.value(gamma).data(), mean, rstd, rows, c, dx.accumulate);
    BERT_CUDA_LAUNCHED();
  }
  float* dgamma = g.requires_grad(gamma) ? g.grad(gamma).data() : nullptr;
  float* dbeta = g.requires_grad(beta) ? g.grad(beta).data() : nullptr;
  if (!dgamma && !dbeta) return;
  const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  float* partial_gamma = g.scratch<float>(chunks * c);
  float* partial_beta = g.scratch<float>(chunks * c);
  layer_norm_param_partials<A><<<dim3(unsigned((c + 31) / 32), unsigned(chunks)), dim3(32, 8), 0, cuda::stream(g)>>>(
      partial_gamma, partial_beta, dy, xv, mean, rstd, rows, c);
  BERT_CUDA_LAUNCHED();
  launch_param_sums(g, dgamma, dbeta, partial_gamma, partial_beta, chunks, c);
}

}  // namespace

namespace {

// Output `o` of an inference LayerNorm, emitted as `made`, added to outs.
void add_row_output(Graph<float>& g, RowOutputs& outs, Var made, const NormOutput& o) {
  outs.out[outs.count] = g.data(made);
  outs.scale[outs.count] = o.scale;
  outs.reciprocal[outs.count] = o.scale > 0 ? 1.0f / o.scale : 1.0f;
  outs.integers[outs.count] = o.integers;
  ++outs.count;
}

// LayerNorm of a (+ b) with the rows in registers, or Var{} where those kernels do not apply (rows wider
// than 1024 or not a multiple of 4, operands not 16-byte aligned, a and b one node; nothing done, nothing
// drawn). With dropout_p > 0 (and b set), a is dropped out first, the draws taken from `rng`; with q (and b
// set), the dropped a is fake-quantized.
// With `outputs` (inference), the output goes to them instead (RowOutputs), emitted into `emitted`; y is then
// the first of them. With `ins`, addends given as their integers (NormInputs). With `quantizers` (one or two,
// per tensor; a training step's), the output as each fake-quantizes it goes to `emitted` instead
// (NormOuts::kQuantizers) as well as to y, the returned node, which only their backward reads (as
// fake_quantize_each's, into y's gradient).
Var normalize_rows(Graph<float>& g, Var a, Var b, Var gamma, Var beta, double eps, double dropout_p = 0.0,
                   Rng* rng = nullptr, const QuantizeOutput* q = nullptr, std::span<const NormOutput> outputs = {},
                   std::vector<Var>* emitted = nullptr, const NormInputs& ins = {},
                   std::span<const QuantizeOutput> quantizers = {}) {
  const Shape xs = g.shape(a);
  const int64_t c = xs.last(), rows = xs.rows();
  if (b.valid() && a.index == b.index) return Var{};
  if (!with_row_chunks(c, {g.data(a), b.valid() ? g.data(b) : nullptr, g.value(gamma).data(), g.value(beta).data()},
                       [](auto) {}))
    return Var{};
  RowDrop drop;
  if (dropout_p > 0.0) {
    drop.first = DropoutDraws::reserve(*rng, static_cast<uint64_t>(rows * c));
    drop.seed = rng->state().seed;
    drop.threshold = DropoutDraws::threshold(dropout_p);
    drop.keep_scale = static_cast<float>(1.0 / (1.0 - dropout_p));
  }
  const bool integer_addends = ins.a_scale > 0 || ins.b_scale > 0;
  const DType dtype = integer_addends ? g.activation_dtype() : g.dtype(a);
  RowOutputs outs;
  for (const NormOutput& o : outputs) {
    const Var made = q           ? g.emit(xs, {a, b, gamma, beta, q->scale}, o.integers ? DType::kS8 : dtype)
                     : b.valid() ? g.emit(xs, {a, b, gamma, beta}, o.integers ? DType::kS8 : dtype)
                                 : g.emit(xs, {a, gamma, beta}, o.integers ? DType::kS8 : dtype);
    emitted->push_back(made);
    add_row_output(g, outs, made, o);
  }
  Var y = outs.count && quantizers.empty() ? emitted->front()
          : q         ? g.emit(xs, {a, b, gamma, beta, q->scale}, dtype)
          : b.valid() ? g.emit(xs, {a, b, gamma, beta}, dtype)
                      : g.emit(xs, {a, gamma, beta}, dtype);
  std::vector<cuda::QuantizeLaunch> out_launches;  // the quantizers' (checked: per tensor, qmin < 0 < qmax)
  for (const QuantizeOutput& o : quantizers) {
    out_launches.push_back(cuda::fused_launch(g, o, rows * c));
    const Var made = g.emit(xs, {y, o.scale}, dtype);  // (made after y: their backward runs before y's)
    emitted->push_back(made);
    const cuda::QuantizeLaunch& l = out_launches.back();
    outs.out[outs.count] = g.data(made);
    outs.scales[outs.count] = l.scale, outs.lo[outs.count] = l.lo, outs.hi[outs.count] = l.hi;
    outs.clipped[outs.count] = reinterpret_cast<unsigned long long*>(l.clipped);
    if (o.integers && o.qmin >= -128 && o.qmax <= 127) {
      int8_t* integers = g.scratch<int8_t>(std::size_t(rows * c));
      g.set_integers(made, integers);
      outs.quantized_integers[outs.count] = integers;
    }
    ++outs.count;
  }
  const cuda::QuantizeLaunch quantize = q ? cuda::fused_launch(g, *q, rows * c) : cuda::QuantizeLaunch{};
  auto quantizer = [q, quantize](auto tag) {
    RowQuantize<typename decltype(tag)::type> r;
    if (q) {
      r.scale = quantize.scale, r.lo = quantize.lo, r.hi = quantize.hi;
      r.clipped = reinterpret_cast<unsigned long long*>(quantize.clipped), r.grad_scale = quantize.grad_scale;
    }
    return r;
  };
  float* mean = g.scratch<float>(rows);
  float* rstd = g.scratch<float>(rows);
  if (drop.threshold && g.requires_grad(y)) drop.bits = g.scratch<uint32_t>(rows * 32);
  void* sums = nullptr;  // a + b, saved for the backward where it runs
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    // The sum a + b, kept for the backward where it is in BF16 or quantized. In FP32 (and TF32) the plain
    // backward forms it again from a and b, which the graph keeps anyway: a tensor less a LayerNorm,
    // BERT-base's 8,192 rows 25 MB (its FP32 step 7.56 -> 6.99 GiB, the same speed, one H200). In BF16
    // forming it again saved 12.6 MB a LayerNorm but read one tensor more in the backward than it wrote less
    // in the forward: the step 0.9% slower.
    const bool keep_sum = q || sizeof(A) == 2;
    A* sv = b.valid() && keep_sum && g.requires_grad(y) ? g.scratch<A>(rows * c) : nullptr;
    sums = sv;
    A* yv = cuda::typed<A>(g.data(y));
    with_row_chunks(c, {}, [&](auto chunks) {
      // (Integer addends of both kinds: a grid of resident blocks, which loop over the rows.)
      auto launch = [&](auto kernel, bool resident = false) {
        kernel<<<resident ? resident_row_blocks(g, kernel, rows) : row_blocks(rows), 32 * kWarpsPerBlock, 0,
                 cuda::stream(g)>>>(yv, sv, mean, rstd, g.data(a),
                                    b.valid() ? g.data(b) : nullptr, g.value(gamma).data(), g.value(beta).data(), rows,
                                    int(c), static_cast<float>(eps), drop, quantizer(tag), outs,
                                    RowIns{ins.a_scale, ins.b_scale});
      };
      constexpr int kChunks = decltype(chunks)::value;
      with_full_rows<kChunks>(c, [&](auto full) {
        constexpr bool kFull = decltype(full)::value;
        const NormOuts kind = norm_outs(outs);
        const bool both_integers = ins.a_scale > 0 && b.valid() && ins.b_scale > 0;
        if (integer_addends) {  // (the integer outputs' kernels compiled for full rows only)
          if constexpr (kFull) {
            if (both_integers && kind == NormOuts::kIntegersOne)
              return launch(
                  layer_norm_rows_forward<kChunks, A, false, true, NormOuts::kIntegersOne, NormIns::kIntegers>, true);
            if (both_integers && kind == NormOuts::kIntegersTwo)
              return launch(
                  layer_norm_rows_forward<kChunks, A, false, true, NormOuts::kIntegersTwo, NormIns::kIntegers>, true);
          }
          launch(layer_norm_rows_forward<kChunks, A, false, kFull, NormOuts::kAny, NormIns::kAny>);
        } else if (!q && outs.count == 0) {
          launch(layer_norm_rows_forward<kChunks, A, true, kFull>);
        } else if (kind == NormOuts::kQuantizers) {
          launch(layer_norm_rows_forward<kChunks, A, false, kFull, NormOuts::kQuantizers>);
        } else if (kind == NormOuts::kIntegersFake ||
                   (!kFull && kind == NormOuts::kIntegersShared)) {  // (compiled for full rows only)
          launch(layer_norm_rows_forward<kChunks, A, false, kFull, NormOuts::kIntegersFake>);
        } else if (kind == NormOuts::kIntegersShared) {
          launch(layer_norm_rows_forward<kChunks, A, false, true, NormOuts::kIntegersShared>);
        } else if (kind == NormOuts::kIntegersValue) {
          launch(layer_norm_rows_forward<kChunks, A, false, kFull, NormOuts::kIntegersValue>);
        } else {
          launch(layer_norm_rows_forward<kChunks, A, false, kFull>);
        }
      });
    });
    BERT_CUDA_LAUNCHED();
  });
  const Var scale = q ? q->scale : Var{};
  g.on_backward(y, [a, b, gamma, beta, y, mean, rstd, sums, rows, c, dtype, drop, scale, quantizer](Graph<float>& g) {
    cuda::with_element_type(dtype, [&](auto tag) {
      using A = typename decltype(tag)::type;
      const A* dy = cuda::typed<A>(g.grad_data(y));
      RowQuantize<A> quantize = quantizer(tag);
      quantize.clipped = nullptr;
      if (scale.valid()) {
        quantize.a = cuda::typed<A>(g.data(a));
        quantize.ds = g.requires_grad(scale) ? g.grad(scale).data() : nullptr;
        quantize.arrivals = cuda::context(g.device()).arrivals;
      }
      InputGrads<A> to;
      if (g.requires_grad(a)) {
        const auto t = g.raw_grad_target(a);
        to.da = cuda::typed<A>(t.data), to.accumulate_a = t.accumulate;
      }
      if (b.valid() && g.requires_grad(b)) {
        const auto t = g.raw_grad_target(b);
        to.db = cuda::typed<A>(t.data), to.accumulate_b = t.accumulate;
      }
      float* dgamma = g.requires_grad(gamma) ? g.grad(gamma).data() : nullptr;
      float* dbeta = g.requires_grad(beta) ? g.grad(beta).data() : nullptr;
      const bool params = dgamma || dbeta;
      // a's gradient summed into the bias of the linear that made a, where this writes all of it.
      const Var bias = to.da && !to.accumulate_a ? g.bias_to_sum(a) : Var{};
      float* dbias = bias.valid() ? g.grad(bias).data() : nullptr;
      const A* x = sums ? static_cast<const A*>(sums) : cuda::typed<A>(g.data(a));
      const A* residual = b.valid() && !sums ? cuda::typed<A>(g.data(b)) : nullptr;
      int64_t blocks = 0;
      float *partial_gamma = nullptr, *partial_beta = nullptr, *partial_da = nullptr;
      with_row_chunks(c, {}, [&](auto width) {
        constexpr int kChunks = decltype(width)::value;
        auto launch = [&](auto kernel) {
          const size_t bytes = backward_row_shared<kChunks>(dbias ? 3 : 2);
          // From 48 KiB on (768 columns: exactly 48, to which the quantizer's reduction adds static bytes),
          // beyond the default limit.
          if (bytes >= 48 * 1024)
            BERT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
          // As many blocks as are resident at once (BERT-base's 8,192 rows on an H200: 264 blocks of 32),
          // each warp loading its next row while it works on the current one; at least 2 rows a warp. Few
          // blocks also make few partial rows for the column sums' second pass.
          const int64_t resident = resident_row_blocks(g, kernel, rows, bytes);
          const int64_t per_block =
              std::max<int64_t>(2 * kWarpsPerBlock, (rows + resident - 1) / resident + kWarpsPerBlock - 1) /
              kWarpsPerBlock * kWarpsPerBlock;
          blocks = (rows + per_block - 1) / per_block;
          if (params) partial_gamma = g.scratch<float>(blocks * c), partial_beta = g.scratch<float>(blocks * c);
          if (dbias) partial_da = g.scratch<float>(blocks * c);
          if (quantize.ds && blocks > 1) quantize.partial = g.scratch<double>(blocks);
          kernel<<<unsigned(blocks), 32 * kWarpsPerBlock, bytes, cuda::stream(g)>>>(
              to, partial_gamma, partial_beta, partial_da, dy, x, residual,
              g.value(gamma).data(), mean, rstd, rows, int(c), per_block, drop, quantize);
        };
        with_full_rows<kChunks>(c, [&](auto full) {
          constexpr bool kFull = decltype(full)::value;
          if (!scale.valid())
            launch(layer_norm_rows_backward<kChunks, A, true, kFull>);
          else
            launch(layer_norm_rows_backward<kChunks, A, false, kFull>);
        });
      });
      BERT_CUDA_LAUNCHED();
      cuda::launch_add_partial_rows(g, dgamma, partial_gamma, dbeta, partial_beta, blocks, c, dbias, partial_da);
      if (dbias) g.set_bias_summed(a);
    });
  });
  if (quantizers.empty()) return y;
  // The quantized outputs' backward, one for all of them (as fake_quantize_each's), run by the first of their
  // closures to run (the latest output that received a gradient); the others find it done.
  const std::vector<Var> quantized_outs = *emitted;
  const std::vector<QuantizeOutput> out_quantizers(quantizers.begin(), quantizers.end());
  auto done = std::make_shared<bool>(false);
  for (const Var out : quantized_outs)
    g.on_backward(out, [y, quantized_outs, out_quantizers, out_launches, done, rows, c](Graph<float>& g) {
      if (*done) return;
      *done = true;
      std::vector<EachGradient> grads;
      for (size_t o = 0; o < quantized_outs.size(); ++o) {
        const bool has = g.has_grad(quantized_outs[o]);
        grads.push_back({out_launches[o].scale, out_launches[o].lo, out_launches[o].hi,
                         has ? g.grad_data(quantized_outs[o]) : nullptr,
                         has && g.requires_grad(out_quantizers[o].scale) ? g.grad(out_quantizers[o].scale).data()
                                                                         : nullptr,
                         out_quantizers[o].grad_scale});
      }
      const auto dy = g.requires_grad(y) ? g.raw_grad_target(y) : Graph<float>::RawGradTarget{nullptr, false};
      fake_quantize_each_backward(g, g.dtype(y), g.data(y), dy.data, dy.accumulate, rows * c, grads);
    });
  return y;
}

void check_layer_norm(Graph<float>& g, const Shape& xs, Var gamma, Var beta, const char* op) {
  const int64_t c = xs.last();
  BERT_CHECK(g.shape(gamma) == Shape({c}) && g.shape(beta) == Shape({c}),
             std::string(op) + ": gamma " + g.shape(gamma).str() + " / beta " + g.shape(beta).str() + " for x " +
                 xs.str());
}

}  // namespace

Var layer_norm(Graph<float>& g, Var x, Var gamma, Var beta, double eps) {
  const Shape xs = g.shape(x);
  const int64_t c = xs.last(), rows = xs.rows();
  check_layer_norm(g, xs, gamma, beta, "layer_norm");
  x = as_activation(g, x);
  if (Var y = normalize_rows(g, x, Var{}, gamma, beta, eps); y.valid()) return y;
  const DType dtype = g.dtype(x);
  Var y = g.emit(xs, {x, gamma, beta}, dtype);
  float* mean = g.scratch<float>(rows);
  float* rstd = g.scratch<float>(rows);
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    layer_norm_forward<A><<<row_blocks(rows), 32 * kWarpsPerBlock, 0, cuda::stream(g)>>>(
        cuda::typed<A>(g.data(y)), mean, rstd, cuda::typed<A>(g.data(x)), g.value(gamma).data(), g.value(beta).data(),
        rows, c, static_cast<float>(eps));
    BERT_CUDA_LAUNCHED();
  });
  g.on_backward(y, [x, gamma, beta, y, mean, rstd, rows, c, dtype](Graph<float>& g) {
    cuda::with_element_type(dtype, [&](auto tag) {
      using A = typename decltype(tag)::type;
      layer_norm_backward<A>(g, x, gamma, beta, y, mean, rstd, rows, c);
    });
  });
  return y;
}

Var add_layer_norm(Graph<float>& g, Var a, Var b, Var gamma, Var beta, double eps) {
  const Shape xs = g.shape(a);
  BERT_CHECK(g.shape(b) == xs, "add_layer_norm: the addends " + xs.str() + " and " + g.shape(b).str() + " differ");
  check_layer_norm(g, xs, gamma, beta, "add_layer_norm");
  Var y = normalize_rows(g, as_activation(g, a), as_activation(g, b), gamma, beta, eps);
  return y.valid() ? y : layer_norm(g, add(g, a, b), gamma, beta, eps);
}

// Shapes checked here; where the register kernels do not apply, the dropout and add_layer_norm ops run.
Var dropout_add_layer_norm(Graph<float>& g, Var a, Var b, Var gamma, Var beta, double eps, double p, Rng& rng) {
  const Shape xs = g.shape(a);
  BERT_CHECK(g.shape(b) == xs,
             "dropout_add_layer_norm: the addends " + xs.str() + " and " + g.shape(b).str() + " differ");
  check_layer_norm(g, xs, gamma, beta, "dropout_add_layer_norm");
  a = as_activation(g, a), b = as_activation(g, b);
  Var y = g.dtype(a) == g.dtype(b) ? normalize_rows(g, a, b, gamma, beta, eps, p, &rng) : Var{};
  return y.valid() ? y : add_layer_norm(g, dropout(g, a, p, rng), b, gamma, beta, eps);
}

// The same with the dropped a fake-quantized (p may be 0: the quantizer alone).
Var dropout_add_layer_norm(Graph<float>& g, Var a, Var b, Var gamma, Var beta, double eps, double p, Rng& rng,
                           const QuantizeOutput& q) {
  const Shape xs = g.shape(a);
  BERT_CHECK(g.shape(b) == xs,
             "dropout_add_layer_norm: the addends " + xs.str() + " and " + g.shape(b).str() + " differ");
  check_layer_norm(g, xs, gamma, beta, "dropout_add_layer_norm");
  a = as_activation(g, a), b = as_activation(g, b);
  Var y = g.dtype(a) == g.dtype(b) ? normalize_rows(g, a, b, gamma, beta, eps, p, &rng, &q) : Var{};
  if (y.valid()) return y;
  const Var dropped =
      p > 0 ? dropout(g, a, p, rng, q) : fake_quantize(g, a, q.scale, q.qmin, q.qmax, q.grad_scale, q.clipped);
  return add_layer_norm(g, dropped, b, gamma, beta, eps);
}

std::vector<Var> dropout_add_layer_norm_each(Graph<float>& g, Var a, Var b, Var gamma, Var beta, double eps, double p,
                                             Rng& rng, const QuantizeOutput* q,
                                             std::span<const QuantizeOutput> outputs) {
  const Shape xs = g.shape(a);
  BERT_CHECK(g.shape(b) == xs,
             "dropout_add_layer_norm_each: the addends " + xs.str() + " and " + g.shape(b).str() + " differ");
  check_layer_norm(g, xs, gamma, beta, "dropout_add_layer_norm_each");
  a = as_activation(g, a), b = as_activation(g, b);
  std::vector<Var> emitted;
  if (g.dtype(a) == g.dtype(b) && normalize_rows(g, a, b, gamma, beta, eps, p, &rng, q, {}, &emitted, {}, outputs).valid())
    return emitted;
  const Var y = q       ? dropout_add_layer_norm(g, a, b, gamma, beta, eps, p, rng, *q)
                : p > 0 ? dropout_add_layer_norm(g, a, b, gamma, beta, eps, p, rng)
                        : add_layer_norm(g, a, b, gamma, beta, eps);
  return fake_quantize_each(g, y, outputs);
}

std::vector<Var> add_layer_norm_quantized(Graph<float>& g, Var a, Var b, Var gamma, Var beta, double eps,
                                          const QuantizeOutput* q, std::span<const NormOutput> outputs,
                                          const NormInputs& ins) {
  const Shape xs = g.shape(a);
  BERT_CHECK(g.shape(b) == xs,
             "add_layer_norm_quantized: the addends " + xs.str() + " and " + g.shape(b).str() + " differ");
  check_layer_norm(g, xs, gamma, beta, "add_layer_norm_quantized");
  if (!(ins.a_scale > 0)) a = as_activation(g, a);
  if (!(ins.b_scale > 0)) b = as_activation(g, b);
  std::vector<Var> emitted;
  if (ins.a_scale > 0 || ins.b_scale > 0) {
    BERT_CHECK(ops::add_layer_norm_reads_integers(g, xs.last()),
               "add_layer_norm_quantized: integer addends need rows of a multiple of 4 up to 1,024 columns, got " +
                   std::to_string(xs.last()));
    normalize_rows(g, a, b, gamma, beta, eps, 0.0, nullptr, q, outputs, &emitted, ins);
    BERT_CHECK(!emitted.empty(), "add_layer_norm_quantized: integer addends need 16-byte aligned operands");
  } else if (g.dtype(a) == g.dtype(b)) {
    normalize_rows(g, a, b, gamma, beta, eps, 0.0, nullptr, q, outputs, &emitted);
  }
  return emitted;
}

std::vector<Var> embedding_layer_norm_quantized(Graph<float>& g, Var words, Var positions, Var types,
                                                std::span<const int32_t> ids, std::span<const int32_t> type_ids,
                                                Shape ids_shape, Var gamma, Var beta, double eps,
                                                std::span<const NormOutput> outputs) {
  const int64_t c = g.shape(words).last(), rows = ids_shape.numel();
  check_layer_norm(g, Shape{rows, c}, gamma, beta, "embedding_layer_norm_quantized");
  for (const Var table : {words, positions, types})
    if (g.dtype(table) != DType::kF32) return {};
  if (!with_row_chunks(c, {g.data(words), g.data(positions), g.data(types), g.value(gamma).data(), g.value(beta).data()},
                       [](auto) {}) ||
      c % 128 != 0 || rows == 0)  // (compiled for full rows only)
    return {};
  RowIns ins;
  ins.gather.words = static_cast<const float*>(g.data(words));
  ins.gather.positions = static_cast<const float*>(g.data(positions));
  ins.gather.types = static_cast<const float*>(g.data(types));
  ins.gather.ids = g.upload(ids.data(), ids.size());
  ins.gather.type_ids = g.upload(type_ids.data(), type_ids.size());
  ins.gather.seq = ids_shape.last();
  const Shape xs = ids_shape.rank() == 1 ? Shape{ids_shape[0], c} : Shape{ids_shape[0], ids_shape[1], c};
  const DType dtype = g.activation_dtype();
  std::vector<Var> emitted;
  RowOutputs outs;
  for (const NormOutput& o : outputs) {
    emitted.push_back(g.emit(xs, {words, positions, types, gamma, beta}, o.integers ? DType::kS8 : dtype));
    add_row_output(g, outs, emitted.back(), o);
  }
  if (outputs.empty()) emitted.push_back(g.emit(xs, {words, positions, types, gamma, beta}, dtype));
  float* mean = g.scratch<float>(rows);
  float* rstd = g.scratch<float>(rows);
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    with_row_chunks(c, {}, [&](auto chunks) {
      constexpr int kChunks = decltype(chunks)::value;
      auto launch = [&](auto kernel) {
        kernel<<<row_blocks(rows), 32 * kWarpsPerBlock, 0, cuda::stream(g)>>>(
            cuda::typed<A>(g.data(emitted.front())), nullptr, mean, rstd, nullptr, nullptr, g.value(gamma).data(),
            g.value(beta).data(), rows, int(c), static_cast<float>(eps), RowDrop{}, RowQuantize<A>{}, outs, ins);
      };
      const NormOuts kind = norm_outs(outs);
      if (outs.count == 0)
        launch(layer_norm_rows_forward<kChunks, A, true, true, NormOuts::kAny, NormIns::kGathered>);
      else if (kind == NormOuts::kIntegersOne)
        launch(layer_norm_rows_forward<kChunks, A, false, true, NormOuts::kIntegersOne, NormIns::kGathered>);
      else if (kind == NormOuts::kIntegersTwo)
        launch(layer_norm_rows_forward<kChunks, A, false, true, NormOuts::kIntegersTwo, NormIns::kGathered>);
      else
        launch(layer_norm_rows_forward<kChunks, A, false, true, NormOuts::kAny, NormIns::kGathered>);
    });
    BERT_CUDA_LAUNCHED();
  });
  return emitted;
}

}  // namespace bert::ops::cuda_impl
