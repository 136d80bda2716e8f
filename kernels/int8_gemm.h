// Integer matrix multiply for INT8 inference: y = (scale_x * scale_w[c]) * sum_k q_x[k] q_w[c][k] + bias[c],
// a symmetric per-tensor quantized activation times per-output-channel quantized weights, summed exactly
// in int32 (the values a Q/DQ graph's MatMul computes). The kernel is chosen at run time from what the CPU
// has (AMX, AVX-512 VNNI, AVX2, plain C++), so one binary runs well on any x86-64; each kernel is held to the
// plain reference by a test.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/output_tiles.h"

namespace bert {

enum class Int8Kernel { kAuto, kGeneric, kAvx2, kAvx512Vnni, kAmx };
// What is applied to the output after the scales and the bias: nothing, or GELU (vec::gelu, the same
// function ops::gelu applies), on each block of the output while it is in cache.
enum class Int8Finish { kNone, kGelu };
const char* int8_kernel_name(Int8Kernel kernel);
// Whether this CPU runs `kernel` (kAuto and kGeneric: always).
bool int8_kernel_supported(Int8Kernel kernel);
// The fastest kernel this CPU runs (neither AMX nor AVX-512 VNNI under BERT_CPU_KERNELS=build or avx2:
// kernels/cpu_kernels.h). AMX (Intel's tile unit, where the CPU and the kernel offer it) runs products whose
// padded input count is a multiple of 64, and the rows past the last whole 16, on the VNNI kernel.
Int8Kernel best_int8_kernel();

// Weights (n, k) as int8, packed once for every kernel: groups of 16 output channels x 4 inputs (64
// bytes, the operand of one VNNI instruction), zero-padded to multiples of 16 channels and 4 inputs.
class Int8Weights {
 public:
  Int8Weights() = default;
  Int8Weights(const int8_t* weights, int64_t n, int64_t k);  // row-major (n, k)
  // Float weights (n, k), weight (c, i) at src[c * row_stride + i * col_stride], one stride 1 (either layout: an
  // activation is packed as it lies, transposed or not), quantized as quantize_activations does (round(w /
  // scale) to even, clamped to [-128, 127]) but signed, then packed: the bytes the constructor packs from
  // those integers. Reuses this object's storage (an attention
  // head's operands, repacked for every head).
  void quantize_pack(const float* src, int64_t n, int64_t k, int64_t row_stride, int64_t col_stride, float scale);

  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  int64_t k_padded() const { return k_padded_; }
  int64_t blocks() const { return blocks_; }  // of 16 channels
  // Block b's 64-byte group g: channels 16b..16b+15, inputs 4g..4g+3 (channel-major within the group).
  const int8_t* block(int64_t b) const { return packed_.data() + b * k_padded_ * 16; }
  // 128 * (channel's weight sum), per padded channel: activations arrive offset by 128 (unsigned).
  const int32_t* offsets() const { return offsets_.data(); }

 private:
  void resize(int64_t n, int64_t k);  // zeroed storage for (n, k)
  int8_t* lane_of(int64_t c);         // channel c's 4 bytes in group 0
  int64_t n_ = 0, k_ = 0, k_padded_ = 0, blocks_ = 0;
  std::vector<int8_t> packed_;
  std::vector<int32_t> offsets_;
  std::vector<int8_t> quantized_;  // quantize_pack's unpacked integers, reused
};

// Rounds up to a multiple of 4: the row length of quantized activations for k inputs.
inline int64_t int8_row_bytes(int64_t k) { return (k + 3) / 4 * 4; }

// Quantizes x (m, k) for int8_linear as fake quantization does (round(x / scale) to even, clamped to
// [-128, 127]) and stores q + 128 as bytes, rows of int8_row_bytes(k) (padding 128, i.e. zero).
void quantize_activations(const float* x, int64_t m, int64_t k, float scale, uint8_t* out);
// The same with rows ldx floats apart (the rows of one attention head inside (B, T, H * D)).
void quantize_activations(const float* x, int64_t m, int64_t k, int64_t ldx, float scale, uint8_t* out);

// y (m, n), row stride ldy: a (m rows of w.k_padded() bytes from quantize_activations) times w.
// bias may be null.
void int8_linear(int64_t m, const uint8_t* a, const Int8Weights& w, float scale_x, const float* scale_w,
                 const float* bias, float* y, int64_t ldy, Int8Kernel kernel = Int8Kernel::kAuto,
                 Int8Finish finish = Int8Finish::kNone);

// Dynamic quantization, one scale per row of activations (the row's largest magnitude maps to 127), for
// a layer without a calibrated input scale: quantizes x (m, k) as quantize_activations does, each row
// with its own scale (written to scales[r]; a row of zeros gets 1). A row that is not finite throws.
void quantize_activations_per_row(const float* x, int64_t m, int64_t k, float* scales, uint8_t* out);
// int8_linear with row r's activations at scale row_scales[r]: y = (row_scales[r] * scale_w[c]) * sum + bias.
void int8_linear_per_row(int64_t m, const uint8_t* a, const float* row_scales, const Int8Weights& w,
                         const float* scale_w, const float* bias, float* y, int64_t ldy,
                         Int8Kernel kernel = Int8Kernel::kAuto);

// int8_linear_per_row made tile by tile (at most tile_rows x tile_cols, tile_cols a multiple of 16), each tile
// in a buffer of its thread handed to visit (kernels/output_tiles.h); the (m, n) output is never stored. The
// same values as int8_linear_per_row's.
void int8_linear_per_row_tiles(int64_t m, const uint8_t* a, const float* row_scales, const Int8Weights& w,
                               const float* scale_w, const float* bias, int64_t tile_rows, int64_t tile_cols,
                               const OutputTileVisitor& visit, Int8Kernel kernel = Int8Kernel::kAuto);

// Plain loops over signed, unpacked operands: q_x (m, k), q_w (n, k). The reference of every kernel (the
// same float rounding at the end: one fused multiply-add per output). With row_scales, row r's scale is
// row_scales[r] instead of scale_x.
void int8_linear_reference(int64_t m, int64_t n, int64_t k, const int8_t* q_x, const int8_t* q_w, float scale_x,
                           const float* scale_w, const float* bias, float* y, int64_t ldy,
                           const float* row_scales = nullptr);

}  // namespace bert
