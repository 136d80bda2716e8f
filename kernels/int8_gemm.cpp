#include "kernels/int8_gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels/cpu_kernels.h"
#include "kernels/vector_math.h"
#include "sys/error.h"
#include "sys/parallel.h"

namespace bert {

namespace {

constexpr int64_t kBlock = 16;        // output channels per packed block
constexpr int64_t kGroupBytes = 64;   // 16 channels x 4 inputs
constexpr int64_t kRowsPerTask = 96;  // rows of activations a task keeps in cache while it sweeps the weights

inline int32_t load_u32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// What every kernel needs besides the operands: per padded channel, the offset to subtract, the
// combined scale and the bias; with per-row activation scales, also each row's scale (null: one scale for
// every row, already in `scales`), multiplied into the channel's scale.
struct Epilogue {
  const int32_t* offsets;
  const float* scales;
  const float* bias;
  const float* row_scales = nullptr;  // from the tile's first row
};

// ---- plain C++: any x86-64 (and the fallback everywhere)

template <int kRows>
void tile_generic(const uint8_t* a, int64_t lda, const int8_t* b, int64_t groups, const Epilogue& e, float* y,
                  int64_t ldy, int64_t cols) {
  int32_t acc[kRows][kBlock] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* bg = b + g * kGroupBytes;
    for (int r = 0; r < kRows; ++r) {
      const uint8_t* ar = a + r * lda + 4 * g;
      for (int c = 0; c < kBlock; ++c)
        for (int t = 0; t < 4; ++t) acc[r][c] += int32_t(ar[t]) * int32_t(bg[4 * c + t]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      y[r * ldy + c] = std::fma(float(acc[r][c] - e.offsets[c]),
                                e.row_scales ? e.row_scales[r] * e.scales[c] : e.scales[c], e.bias[c]);
}

// ---- AVX2: inputs widened to 16 bits (exact; vpmaddubsw would saturate), vpmaddwd sums pairs

__attribute__((target("avx2,fma"))) inline void store8_avx2(__m256i sums, const Epilogue& e, int r, int64_t c0,
                                                            float* y, int64_t cols) {
  __m256 scales = _mm256_loadu_ps(e.scales + c0);
  if (e.row_scales) scales = _mm256_mul_ps(_mm256_set1_ps(e.row_scales[r]), scales);
  const __m256 v = _mm256_fmadd_ps(
      _mm256_cvtepi32_ps(_mm256_sub_epi32(sums, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(e.offsets + c0)))),
      scales, _mm256_loadu_ps(e.bias + c0));
  if (cols >= 8) {
    _mm256_storeu_ps(y, v);
    return;
  }
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(cols)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  _mm256_maskstore_ps(y, mask, v);
}

template <int kRows>
__attribute__((target("avx2,fma"))) void tile_avx2(const uint8_t* a, int64_t lda, const int8_t* b, int64_t groups,
                                                   const Epilogue& e, float* y, int64_t ldy, int64_t cols) {
  // acc[r][q]: channels 4q..4q+3 of the block, two partial sums each (inputs 0-1 and 2-3 of a group).
  __m256i acc[kRows][4];
  for (int r = 0; r < kRows; ++r)
    for (int q = 0; q < 4; ++q) acc[r][q] = _mm256_setzero_si256();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i x[kRows];
    for (int r = 0; r < kRows; ++r)
      x[r] = _mm256_broadcastq_epi64(_mm_cvtepu8_epi16(_mm_cvtsi32_si128(load_u32(a + r * lda + 4 * g))));
    for (int q = 0; q < 4; ++q) {
      const __m256i w =
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + g * kGroupBytes + 16 * q)));
      for (int r = 0; r < kRows; ++r) acc[r][q] = _mm256_add_epi32(acc[r][q], _mm256_madd_epi16(w, x[r]));
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int half = 0; half < 2; ++half) {
      const int64_t c0 = 8 * half;
      if (c0 >= cols) break;
      // hadd gives channels (0 1 4 5 | 2 3 6 7) of the pair; the permute puts them in order.
      const __m256i sums = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[r][2 * half], acc[r][2 * half + 1]), 0xD8);
      store8_avx2(sums, e, r, c0, y + r * ldy + c0, cols - c0);
    }
  }
}

// ---- AVX-512 VNNI: one vpdpbusd multiplies 16 channels x 4 inputs of unsigned activations and signed
// weights and adds them into int32

// The epilogue of the VNNI and AMX kernels for the 16 channels of a block from c0 (fewer at the end):
// their offsets, scales and bias loaded once, then each row's sums stored as floats.
struct Block16 {
  __mmask16 mask;
  __m512i offsets;
  __m512 scales, bias;
  __attribute__((target("avx512f,avx512bw"))) Block16(const Epilogue& e, int64_t c0, int64_t cols)
      : mask(cols - c0 >= kBlock ? __mmask16(0xFFFF) : __mmask16((1u << (cols - c0)) - 1)),
        offsets(_mm512_loadu_si512(e.offsets + c0)),
        scales(_mm512_loadu_ps(e.scales + c0)),
        bias(_mm512_loadu_ps(e.bias + c0)) {}
  // Row r's sums to y (the row's channel c0).
  __attribute__((target("avx512f,avx512bw"))) void store(__m512i sums, const Epilogue& e, int r, float* y) const {
    const __m512 row = e.row_scales ? _mm512_mul_ps(_mm512_set1_ps(e.row_scales[r]), scales) : scales;
    _mm512_mask_storeu_ps(y, mask, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums, offsets)), row, bias));
  }
};

template <int kRows, int kBlocks>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni(const uint8_t* a, int64_t lda, const int8_t* b,
                                                                      int64_t block_stride, int64_t groups,
                                                                      const Epilogue& e, float* y, int64_t ldy,
                                                                      int64_t cols) {
  __m512i acc[kRows][kBlocks];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kBlocks; ++j) acc[r][j] = _mm512_setzero_si512();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i w[kBlocks];
    for (int j = 0; j < kBlocks; ++j) w[j] = _mm512_loadu_si512(b + j * block_stride + g * kGroupBytes);
    for (int r = 0; r < kRows; ++r) {
      const __m512i x = _mm512_set1_epi32(load_u32(a + r * lda + 4 * g));
      for (int j = 0; j < kBlocks; ++j) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], x, w[j]);
    }
  }
  for (int j = 0; j < kBlocks; ++j) {
    const int64_t c0 = kBlock * j;
    if (c0 >= cols) break;
    const Block16 block(e, c0, cols);
    for (int r = 0; r < kRows; ++r) block.store(acc[r][j], e, r, y + r * ldy + c0);
  }
}

// One task: rows [r0, r1) against channel blocks [b0, b1), in tiles of the kernel's shape.
struct Task {
  const uint8_t* a;
  const Int8Weights& w;
  const Epilogue& e;
  float* y;
  int64_t ldy;
  int64_t y_row = 0, y_col = 0;  // the output row and channel at y (a tile of the output, or all of it)
  float* out(int64_t r, int64_t c) const { return y + (r - y_row) * ldy + (c - y_col); }
};

// Calls fn(std::integral_constant<int, R>) for R = n_rows (1 <= n_rows <= kMax): the tile kernels take
// their row count as a template parameter.
template <int kMax, typename Fn>
void with_rows(int64_t n_rows, Fn&& fn) {
  if constexpr (kMax > 1)
    if (n_rows < kMax) return with_rows<kMax - 1>(n_rows, fn);
  fn(std::integral_constant<int, kMax>{});
}

// Rows [r0, r1) of the output against kBlocks blocks of channels starting at block b, kMaxRows rows
// per call of tile(rows, a, lda, w, groups, epilogue, y, ldy, cols) (fewer for the last).
template <int kMaxRows, int kBlocks, typename Tile>
void tile_rows(const Task& t, int64_t r0, int64_t r1, int64_t b, Tile tile) {
  const int64_t lda = t.w.k_padded(), groups = t.w.k_padded() / 4;
  const int64_t c0 = b * kBlock, cols = std::min(t.w.n() - c0, kBlocks * kBlock);
  for (int64_t r = r0; r < r1; r += kMaxRows)
    with_rows<kMaxRows>(std::min<int64_t>(kMaxRows, r1 - r), [&](auto rows) {
      const Epilogue e{t.e.offsets + c0, t.e.scales + c0, t.e.bias + c0, t.e.row_scales ? t.e.row_scales + r : nullptr};
      tile(rows, t.a + r * lda, lda, t.w.block(b), groups, e, t.out(r, c0), t.ldy, cols);
    });
}

void run_generic(const Task& t, int64_t r0, int64_t r1, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b)
    tile_rows<4, 1>(t, r0, r1, b, [](auto rows, auto... args) { tile_generic<decltype(rows)::value>(args...); });
}

void run_avx2(const Task& t, int64_t r0, int64_t r1, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b)
    tile_rows<3, 1>(t, r0, r1, b, [](auto rows, auto... args) { tile_avx2<decltype(rows)::value>(args...); });
}

template <int kBlocks>
void vnni_rows(const Task& t, int64_t r0, int64_t r1, int64_t b) {
  const int64_t stride = t.w.k_padded() * kBlock;
  tile_rows<8, kBlocks>(t, r0, r1, b,
                        [stride](auto rows, const uint8_t* a, int64_t lda, const int8_t* w, int64_t groups,
                                 const Epilogue& e, float* y, int64_t ldy, int64_t cols) {
                          tile_vnni<decltype(rows)::value, kBlocks>(a, lda, w, stride, groups, e, y, ldy, cols);
                        });
}

void run_vnni(const Task& t, int64_t r0, int64_t r1, int64_t b0, int64_t b1) {
  int64_t b = b0;
  for (; b + 2 <= b1; b += 2) vnni_rows<2>(t, r0, r1, b);
  if (b < b1) vnni_rows<1>(t, r0, r1, b);
}

// ---- AMX (Intel's tile unit): one tdpbusd multiplies a 16 x 64 tile of unsigned activations by a
// 64 x 16 tile of signed weights into 16 x 16 int32 sums. The weights' packing is already the B tile's
// layout (a block's groups are its rows, 64 bytes apart); the activations' rows are the A tile's rows.
// Tiles: sums in tmm0-3 (row tile i, block j at 2i + j), activations in tmm4-5, weights in tmm6-7.

constexpr int64_t kTileRows = 16, kTileK = 64;  // rows per tile; inputs per tile (64 bytes a row)

#include "kernels/amx_tiles.inc"

// kRowTiles x 16 rows against kBlocks blocks, all k_padded inputs (a multiple of 64), into sums
// (kRowTiles * 16 rows of 32 int32).
template <int kRowTiles, int kBlocks>
void amx_product(const uint8_t* a, int64_t lda, const int8_t* b, int64_t block_stride, int64_t k_padded,
                 int32_t* sums) {
  _tile_zero(0);
  if constexpr (kBlocks > 1) _tile_zero(1);
  if constexpr (kRowTiles > 1) _tile_zero(2);
  if constexpr (kRowTiles > 1 && kBlocks > 1) _tile_zero(3);
  for (int64_t k0 = 0; k0 < k_padded; k0 += kTileK) {
    const int8_t* w = b + (k0 / 4) * kGroupBytes;
    _tile_loadd(4, a + k0, lda);
    _tile_loadd(6, w, kGroupBytes);
    if constexpr (kBlocks > 1) _tile_loadd(7, w + block_stride, kGroupBytes);
    _tile_dpbusd(0, 4, 6);
    if constexpr (kBlocks > 1) _tile_dpbusd(1, 4, 7);
    if constexpr (kRowTiles > 1) {
      _tile_loadd(5, a + kTileRows * lda + k0, lda);
      _tile_dpbusd(2, 5, 6);
      if constexpr (kBlocks > 1) _tile_dpbusd(3, 5, 7);
    }
  }
  constexpr int64_t kStride = 2 * kBlock * sizeof(int32_t);  // bytes between rows of sums
  _tile_stored(0, sums, kStride);
  if constexpr (kBlocks > 1) _tile_stored(1, sums + kBlock, kStride);
  if constexpr (kRowTiles > 1) _tile_stored(2, sums + kTileRows * 2 * kBlock, kStride);
  if constexpr (kRowTiles > 1 && kBlocks > 1) _tile_stored(3, sums + kTileRows * 2 * kBlock + kBlock, kStride);
}

template <int kRowTiles, int kBlocks>
__attribute__((target("avx512f,avx512bw"))) void amx_tiles(const Task& t, int64_t r, int64_t b) {
  alignas(64) int32_t sums[2 * kTileRows][2 * kBlock];
  const int64_t lda = t.w.k_padded(), c0 = b * kBlock;
  amx_product<kRowTiles, kBlocks>(t.a + r * lda, lda, t.w.block(b), t.w.k_padded() * kBlock, lda, &sums[0][0]);
  const Epilogue e{t.e.offsets + c0, t.e.scales + c0, t.e.bias + c0, t.e.row_scales ? t.e.row_scales + r : nullptr};
  const int64_t cols = std::min(t.w.n() - c0, kBlocks * kBlock);
  for (int j = 0; j < kBlocks; ++j) {
    if (kBlock * j >= cols) break;
    const Block16 block(e, kBlock * j, cols);
    for (int i = 0; i < kRowTiles * kTileRows; ++i)
      block.store(_mm512_load_si512(&sums[i][kBlock * j]), e, i, t.out(r + i, c0 + kBlock * j));
  }
}

// Rows in tiles of 32 and 16; the last rows (fewer than 16) by the VNNI kernel. Needs k_padded % 64 == 0.
void run_amx(const Task& t, int64_t r0, int64_t r1, int64_t b0, int64_t b1) {
  load_tile_config();
  int64_t r = r0;
  for (; r + 2 * kTileRows <= r1; r += 2 * kTileRows) {
    int64_t b = b0;
    for (; b + 2 <= b1; b += 2) amx_tiles<2, 2>(t, r, b);
    if (b < b1) amx_tiles<2, 1>(t, r, b);
  }
  for (; r + kTileRows <= r1; r += kTileRows) {
    int64_t b = b0;
    for (; b + 2 <= b1; b += 2) amx_tiles<1, 2>(t, r, b);
    if (b < b1) amx_tiles<1, 1>(t, r, b);
  }
  asm volatile("tilerelease");
  if (r < r1) run_vnni(t, r, r1, b0, b1);
}

// round(x / scale) to even, clamped to [-128, 127]: divide, as fake quantization and QuantizeLinear do.
// Clamping first (NaN goes to -128) lets the magic-number rounding round half to even (|v| < 2^22); unlike
// std::nearbyint it is inlined, so the loops that call it vectorise.
inline int32_t quantize_value(float x, float scale) {
  float v = x / scale;
  v = v > -128.0f ? v : -128.0f;
  v = v < 127.0f ? v : 127.0f;
  return static_cast<int32_t>((v + 12582912.0f) - 12582912.0f);
}

// One row of activations (the loop vectorises: its bounds are locals that no store can change), and a
// run of signed values. Each is compiled twice: for the build's target and for AVX-512 (picked at run
// time like the kernels, so a build for any x86-64 quantizes 16 floats at a time where it can). The
// arithmetic is the same IEEE operations at any width: the same bytes.
#define BERT_QUANTIZE_LOOPS(suffix, target)                                                                            \
  target void quantize_row##suffix(const float* __restrict x, int64_t k, float scale, uint8_t* __restrict out,         \
                                   int64_t row) {                                                                      \
    for (int64_t i = 0; i < k; ++i) out[i] = static_cast<uint8_t>(quantize_value(x[i], scale) + 128);                  \
    for (int64_t i = k; i < row; ++i) out[i] = 128;                                                                    \
  }                                                                                                                    \
  target void quantize_signed_run##suffix(const float* __restrict x, int64_t n, float scale, int8_t* __restrict out) { \
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int8_t>(quantize_value(x[i], scale));                         \
  }
BERT_QUANTIZE_LOOPS(_build, )
BERT_QUANTIZE_LOOPS(_avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))))
#undef BERT_QUANTIZE_LOOPS

// The loops this CPU runs (chosen once per call, outside the loops over rows).
using QuantizeRow = void (*)(const float*, int64_t, float, uint8_t*, int64_t);
using QuantizeSignedRun = void (*)(const float*, int64_t, float, int8_t*);
bool quantize_with_avx512() { return best_cpu_kernels() == CpuKernels::kAvx512; }
QuantizeRow row_quantizer() { return quantize_with_avx512() ? &quantize_row_avx512 : &quantize_row_build; }
QuantizeSignedRun signed_quantizer() {
  return quantize_with_avx512() ? &quantize_signed_run_avx512 : &quantize_signed_run_build;
}

}  // namespace

const char* int8_kernel_name(Int8Kernel kernel) {
  switch (kernel) {
    case Int8Kernel::kAuto:
      return int8_kernel_name(best_int8_kernel());
    case Int8Kernel::kGeneric:
      return "generic";
    case Int8Kernel::kAvx2:
      return "avx2";
    case Int8Kernel::kAvx512Vnni:
      return "avx512-vnni";
    case Int8Kernel::kAmx:
      return "amx";
  }
  return "?";
}

bool int8_kernel_supported(Int8Kernel kernel) {
  switch (kernel) {
    case Int8Kernel::kAuto:
    case Int8Kernel::kGeneric:
      return true;
    case Int8Kernel::kAvx2:
      return cpu_kernels_supported(CpuKernels::kAvx2);
    case Int8Kernel::kAvx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vnni");
    case Int8Kernel::kAmx:  // its last rows and its epilogue are the VNNI kernel's
      return int8_kernel_supported(Int8Kernel::kAvx512Vnni) && amx_usable(AmxOp::kInt8);
  }
  return false;
}

Int8Kernel best_int8_kernel() {
  // BERT_CPU_KERNELS=build or avx2 (kernels/cpu_kernels.h) rules out AVX-512 here too: the code an AVX2 machine runs.
  if (best_cpu_kernels() == CpuKernels::kAvx512 && int8_kernel_supported(Int8Kernel::kAmx)) return Int8Kernel::kAmx;
  if (best_cpu_kernels() == CpuKernels::kAvx512 && int8_kernel_supported(Int8Kernel::kAvx512Vnni))
    return Int8Kernel::kAvx512Vnni;
  if (int8_kernel_supported(Int8Kernel::kAvx2)) return Int8Kernel::kAvx2;
  return Int8Kernel::kGeneric;
}

Int8Weights::Int8Weights(const int8_t* weights, int64_t n, int64_t k) {
  resize(n, k);
  for (int64_t c = 0; c < n; ++c) {
    const int8_t* row = weights + c * k;
    // Channel c's 4 inputs of group g at block + g * kGroupBytes + (c % kBlock) * 4: whole groups copied
    // 4 bytes at a time (activations' products pack weights on every call).
    int8_t* lane = lane_of(c);
    int64_t i = 0;
    for (; i + 4 <= k; i += 4) std::memcpy(lane + (i / 4) * kGroupBytes, row + i, 4);
    for (; i < k; ++i) lane[(i / 4) * kGroupBytes + i % 4] = row[i];
    int32_t sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += row[j];
    offsets_[c] = 128 * sum;
  }
}

void Int8Weights::resize(int64_t n, int64_t k) {
  BERT_CHECK(n > 0 && k > 0, "Int8Weights: empty weights");
  n_ = n;
  k_ = k;
  k_padded_ = int8_row_bytes(k);
  blocks_ = (n + kBlock - 1) / kBlock;
  packed_.assign(blocks_ * kBlock * k_padded_, 0);  // keeps the capacity: no allocation when repacked
  offsets_.assign(blocks_ * kBlock, 0);
}

int8_t* Int8Weights::lane_of(int64_t c) {
  return packed_.data() + (c / kBlock) * k_padded_ * kBlock + (c % kBlock) * 4;
}

void Int8Weights::quantize_pack(const float* src, int64_t n, int64_t k, int64_t row_stride, int64_t col_stride,
                                float scale) {
  BERT_CHECK(row_stride == 1 || col_stride == 1, "Int8Weights::quantize_pack: rows or columns must be contiguous");
  resize(n, k);
  const QuantizeSignedRun quantize = signed_quantizer();
  if (col_stride == 1) {  // rows of weights lie in memory: each quantized whole, then packed 4 bytes at a time
    quantized_.resize(k_padded_);
    std::fill(quantized_.begin() + k, quantized_.end(), int8_t{0});
    for (int64_t c = 0; c < n; ++c) {
      quantize(src + c * row_stride, k, scale, quantized_.data());
      int8_t* lane = lane_of(c);
      int32_t sum = 0;
      for (int64_t g = 0; g < k_padded_ / 4; ++g) std::memcpy(lane + g * kGroupBytes, quantized_.data() + 4 * g, 4);
      for (int64_t i = 0; i < k; ++i) sum += quantized_[i];
      offsets_[c] = 128 * sum;
    }
    return;
  }
  // Columns lie in memory (a transposed operand): quantized a column at a time, then each channel's
  // inputs gathered from the columns.
  quantized_.resize(k * n);
  const int8_t* q = quantized_.data();
  for (int64_t i = 0; i < k; ++i) quantize(src + i * col_stride, n, scale, quantized_.data() + i * n);
  for (int64_t i = 0; i < k; ++i)  // channel sums, a row of inputs at a time (the loop vectorises)
    for (int64_t c = 0; c < n; ++c) offsets_[c] += q[i * n + c];
  for (int64_t c = 0; c < n; ++c) offsets_[c] *= 128;
  // Whole groups of 4 inputs x 16 channels: a 4 x 16 byte transpose (SSE2, any x86-64) gives the
  // group's 64 bytes, channel-major. The rest (last channels, last inputs) byte by byte.
  const int64_t whole_blocks = n / kBlock, whole_groups = k / 4;
  for (int64_t b = 0; b < whole_blocks; ++b)
    for (int64_t g = 0; g < whole_groups; ++g) {
      const int8_t* rows = q + 4 * g * n + b * kBlock;
      auto row = [&](int t) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + t * n)); };
      const __m128i r0 = row(0), r1 = row(1), r2 = row(2), r3 = row(3);
      const __m128i lo01 = _mm_unpacklo_epi8(r0, r1), hi01 = _mm_unpackhi_epi8(r0, r1);  // (c, t 0-1) pairs
      const __m128i lo23 = _mm_unpacklo_epi8(r2, r3), hi23 = _mm_unpackhi_epi8(r2, r3);  // (c, t 2-3) pairs
      __m128i* out = reinterpret_cast<__m128i*>(packed_.data() + b * k_padded_ * kBlock + g * kGroupBytes);
      _mm_storeu_si128(out + 0, _mm_unpacklo_epi16(lo01, lo23));  // channels 0-3
      _mm_storeu_si128(out + 1, _mm_unpackhi_epi16(lo01, lo23));  // 4-7
      _mm_storeu_si128(out + 2, _mm_unpacklo_epi16(hi01, hi23));  // 8-11
      _mm_storeu_si128(out + 3, _mm_unpackhi_epi16(hi01, hi23));  // 12-15
    }
  for (int64_t c = 0; c < n; ++c) {
    int8_t* lane = lane_of(c);
    for (int64_t i = c < whole_blocks * kBlock ? whole_groups * 4 : 0; i < k; ++i)
      lane[(i / 4) * kGroupBytes + i % 4] = q[i * n + c];
  }
}

void quantize_activations(const float* x, int64_t m, int64_t k, float scale, uint8_t* out) {
  quantize_activations(x, m, k, k, scale, out);
}

void quantize_activations(const float* x, int64_t m, int64_t k, int64_t ldx, float scale, uint8_t* out) {
  const int64_t row = int8_row_bytes(k);
  const QuantizeRow quantize_row = row_quantizer();
  parallel_for(m, 64, [=](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) quantize_row(x + r * ldx, k, scale, out + r * row, row);
  });
}

namespace {

// What every product shares: the kernel this CPU runs it on, and per padded channel the combined scale
// and the bias (padded channels get 0: never stored anyway, the kernels mask them).
struct Product {
  Int8Kernel kernel;
  std::vector<float> scales, biases;
  Epilogue epilogue;
  int64_t blocks_per_task;  // channel blocks a task sweeps with its rows

  Product(const Int8Weights& w, float scale_x, const float* row_scales, const float* scale_w, const float* bias,
          Int8Kernel requested)
      : kernel(requested == Int8Kernel::kAuto ? best_int8_kernel() : requested),
        scales(w.blocks() * kBlock, 0.0f),
        biases(w.blocks() * kBlock, 0.0f),
        epilogue{w.offsets(), scales.data(), biases.data(), row_scales} {
    BERT_CHECK(int8_kernel_supported(kernel),
               std::string("int8_linear: this CPU cannot run the ") + int8_kernel_name(kernel) + " kernel");
    for (int64_t c = 0; c < w.n(); ++c) {
      scales[c] = row_scales ? scale_w[c] : scale_x * scale_w[c];
      if (bias) biases[c] = bias[c];
    }
    // AMX takes 64 inputs a step: other widths run the VNNI kernel (the weights are packed alike).
    if (kernel == Int8Kernel::kAmx && w.k_padded() % kTileK != 0) kernel = Int8Kernel::kAvx512Vnni;
    blocks_per_task = kernel == Int8Kernel::kAvx512Vnni || kernel == Int8Kernel::kAmx ? 4 : 2;
  }

  // Rows [r0, r1) of the output against channel blocks [b0, b1).
  void run(const Task& t, int64_t r0, int64_t r1, int64_t b0, int64_t b1) const {
    switch (kernel) {
      case Int8Kernel::kAmx:
        return run_amx(t, r0, r1, b0, b1);
      case Int8Kernel::kAvx512Vnni:
        return run_vnni(t, r0, r1, b0, b1);
      case Int8Kernel::kAvx2:
        return run_avx2(t, r0, r1, b0, b1);
      default:
        return run_generic(t, r0, r1, b0, b1);
    }
  }
};

// int8_linear with one activation scale (row_scales null) or one per row.
void integer_product(int64_t m, const uint8_t* a, const Int8Weights& w, float scale_x, const float* row_scales,
                     const float* scale_w, const float* bias, float* y, int64_t ldy, Int8Kernel kernel,
                     Int8Finish finish) {
  BERT_CHECK(ldy >= w.n(), "int8_linear: output row stride below the channel count");
  const Product product(w, scale_x, row_scales, scale_w, bias, kernel);
  if (m <= 0) return;
  const Task task{a, w, product.epilogue, y, ldy};
  // Tasks: a range of rows against a range of channel blocks; consecutive tasks share their rows.
  const int64_t row_tasks = (m + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t block_tasks = (w.blocks() + product.blocks_per_task - 1) / product.blocks_per_task;
  parallel_for(row_tasks * block_tasks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t r0 = (i / block_tasks) * kRowsPerTask, r1 = std::min(m, r0 + kRowsPerTask);
      const int64_t b0 = (i % block_tasks) * product.blocks_per_task;
      const int64_t b1 = std::min(w.blocks(), b0 + product.blocks_per_task);
      product.run(task, r0, r1, b0, b1);
      if (finish == Int8Finish::kGelu) {  // the task's block of the output, still in cache
        const int64_t c0 = b0 * kBlock, c1 = std::min(w.n(), b1 * kBlock);
        for (int64_t r = r0; r < r1; ++r) vec::gelu(y + r * ldy + c0, y + r * ldy + c0, c1 - c0);
      }
    }
  });
}

}  // namespace

void int8_linear(int64_t m, const uint8_t* a, const Int8Weights& w, float scale_x, const float* scale_w,
                 const float* bias, float* y, int64_t ldy, Int8Kernel kernel, Int8Finish finish) {
  integer_product(m, a, w, scale_x, nullptr, scale_w, bias, y, ldy, kernel, finish);
}

void int8_linear_per_row(int64_t m, const uint8_t* a, const float* row_scales, const Int8Weights& w,
                         const float* scale_w, const float* bias, float* y, int64_t ldy, Int8Kernel kernel) {
  BERT_CHECK(row_scales != nullptr, "int8_linear_per_row: no row scales");
  integer_product(m, a, w, 0.0f, row_scales, scale_w, bias, y, ldy, kernel, Int8Finish::kNone);
}

void int8_linear_per_row_tiles(int64_t m, const uint8_t* a, const float* row_scales, const Int8Weights& w,
                               const float* scale_w, const float* bias, int64_t tile_rows, int64_t tile_cols,
                               const OutputTileVisitor& visit, Int8Kernel kernel) {
  BERT_CHECK(row_scales != nullptr, "int8_linear_per_row_tiles: no row scales");
  BERT_CHECK(tile_rows > 0 && tile_cols > 0 && tile_cols % kBlock == 0,
             "int8_linear_per_row_tiles: tiles of " + std::to_string(tile_rows) + " x " + std::to_string(tile_cols) +
                 " (rows > 0, columns a positive multiple of 16)");
  const Product product(w, 0.0f, row_scales, scale_w, bias, kernel);
  if (m <= 0 || w.n() <= 0) return;
  // Column tiles outer: a thread's consecutive tiles share their weights (in cache) and sweep the rows.
  const int64_t row_tiles = (m + tile_rows - 1) / tile_rows, col_tiles = (w.n() + tile_cols - 1) / tile_cols;
  parallel_for(row_tiles * col_tiles, 1, [&](int64_t lo, int64_t hi) {
    thread_local std::vector<float> tile;  // kept: the same shapes come back every batch
    tile.resize(static_cast<size_t>(tile_rows * tile_cols));
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t r0 = (i % row_tiles) * tile_rows, r1 = std::min(m, r0 + tile_rows);
      const int64_t c0 = (i / row_tiles) * tile_cols, c1 = std::min(w.n(), c0 + tile_cols);
      const Task task{a, w, product.epilogue, tile.data(), tile_cols, r0, c0};
      product.run(task, r0, r1, c0 / kBlock, (c1 + kBlock - 1) / kBlock);
      visit(r0, r1, c0, c1, tile.data(), tile_cols);
    }
  });
}

void quantize_activations_per_row(const float* x, int64_t m, int64_t k, float* scales, uint8_t* out) {
  const int64_t row = int8_row_bytes(k);
  const QuantizeRow quantize_row = row_quantizer();
  parallel_for(m, 64, [=](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* xr = x + r * k;
      float largest = 0.0f;
      bool finite = true;  // std::max passes NaN over
      for (int64_t i = 0; i < k; ++i) {
        largest = std::max(largest, std::abs(xr[i]));
        finite = finite && std::isfinite(xr[i]);
      }
      BERT_CHECK(finite && std::isfinite(largest),
                 "quantize_activations_per_row: row " + std::to_string(r) + " is not finite");
      // Symmetric, the row's largest magnitude at 127; a row of zeros gets scale 1 (it quantizes to 0 anyway).
      scales[r] = largest > 0.0f ? largest / 127.0f : 1.0f;
      quantize_row(xr, k, scales[r], out + r * row, row);
    }
  });
}

void int8_linear_reference(int64_t m, int64_t n, int64_t k, const int8_t* q_x, const int8_t* q_w, float scale_x,
                           const float* scale_w, const float* bias, float* y, int64_t ldy, const float* row_scales) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < n; ++c) {
      int64_t sum = 0;
      for (int64_t i = 0; i < k; ++i) sum += int64_t(q_x[r * k + i]) * q_w[c * k + i];
      y[r * ldy + c] =
          std::fma(float(sum), row_scales ? row_scales[r] * scale_w[c] : scale_x * scale_w[c], bias ? bias[c] : 0.0f);
    }
}

}  // namespace bert
