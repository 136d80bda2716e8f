// An int8 GEMM on Hopper's warpgroup tensor cores (wgmma, sm_90a) whose epilogue dequantizes per output
// channel: y (m, n) = finish(fma(float(sum), scale_x * scale_w[c], bias[c])) with exact int32 sums,
// written once in the output type (float or BF16, or int8 quantized for the consumer: Int8Epilogue, which
// the unfused path in ops/integer.cu applies too). cuBLASLt's int8 GEMMs offer no per-channel scale on
// Hopper, so with them the int32 sums go through memory and back (ops/integer.cu keeps that path: the
// reference this kernel is tested against, and where sm_90a is not there).
//
// q (m, ld) and w (n, ld) int8 row-major, ld a multiple of 16 (both K-major, as int8 wgmma takes them). Tiles
// of y are 128 x 128, made from 128-byte slices of K that a producer loads by TMA (128-byte swizzle) into a
// ring of stages guarded by mbarriers; consumer warpgroups multiply them (wgmma m64n128k32, four a slice and
// 64 rows) and release the stage. The epilogue stages 64 rows of outputs at a time in shared memory and writes
// them out in 16-byte pieces along the rows; the tile's weight scales and biases reach shared memory by
// cp.async while its products run (read from global memory in the epilogue, each waited for in turn, they were
// up to a fifth of the kernel's stalls). Two schedules, after CUTLASS's:
// - one_tile: a block makes one tile, its two consumer warpgroups 64 rows each, two blocks an SM, two stages
//   that the staging then reuses.
// - ping_pong: a persistent block an SM whose two sides take its tiles in turn at the tensor cores, so that
//   one side's epilogue runs under the other's products; 4-6 stages; registers moved to the consumers from the
//   producer's warpgroup by setmaxnreg. A side is one warpgroup making whole tiles (128 int32 accumulators a
//   thread) or a pair of them making 64 rows each. The epilogue is latency- and instruction-bound (ncu
//   counts about 20 instructions an output at 768 inputs, the products and waits included): one warpgroup a
//   side issues it at under half the rate of the one-tile schedule's four warpgroups an SM, and pays only where
//   a tile's products are long (from 1,024 inputs); pairs pay below that. ops/integer.cu runs ping-pong where
//   one-tile blocks would take more than two waves.
// Shared memory is addressed through the kernel's shared array (aligned_shared), so that the epilogue's
// staging and column reads compile to shared-memory instructions, not generic ones.

#pragma once

#include <cuda.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ops/cuda/common.cuh"
#include "ops/cuda/fake_quantize.cuh"
#include "ops/cuda/mma.cuh"

namespace bert::cuda {

// How an integer linear finishes output channel c from its exact sum (ops::int8_linear_quantized): the
// value fma(float(sum), scale_x * scale_w[c], bias[c]), then by the part of the columns c falls in (up to
// three, each written to its own (rows, width) tensor): unquantized (scale 0) GELU with kGelu and the value
// in the output type; quantized, the value rounded to the activations' type A first (as the fake-quantized
// model stores the linear's output), GELU, then round(v / scale) half to even clamped to [-128, 127],
// written as int8 or as q * scale in A (the fake quantizer's value). Parts are picked by selects, never by
// indexing (an indexed register array would live in local memory).
struct Int8Epilogue {
  float scale_x;
  const float* scale_w;
  const float* bias;
  int64_t end[3];  // each part's end column (unused parts end at n)
  void* out[3];
  float scale[3];
  float reciprocal[3];  // 1 / scale rounded to nearest (ScaleDivision), a normal float; 1 where unquantized
  // With BF16 activations, GELU and one quantized part, written as int8: that part's integer for each BF16
  // value of the linear's output, indexed by its 16 bits (int8_epilogue_table), or nullptr. The output
  // is rounded to BF16 before GELU, so the epilogue's arithmetic after that rounding is a lookup.
  const int8_t* table = nullptr;
  // Where set, the input's scale is read here in device memory instead of scale_x: a training step's
  // learned scale (ops::quantized_linear), which changes without the host.
  const float* scale_x_at = nullptr;
  __device__ __forceinline__ float input_scale() const { return scale_x_at ? *scale_x_at : scale_x; }
  template <typename V>
  __host__ __device__ __forceinline__ static V pick(int p, const V (&v)[3]) {
    return p == 0 ? v[0] : p == 1 ? v[1] : v[2];
  }
  __host__ __device__ __forceinline__ int part(int64_t c) const { return c < end[0] ? 0 : c < end[1] ? 1 : 2; }
  __host__ __device__ __forceinline__ int64_t begin(int p) const { return p == 0 ? 0 : p == 1 ? end[0] : end[1]; }
  __host__ __device__ __forceinline__ int64_t width(int p) const { return pick(p, end) - begin(p); }
  // Sets part p (columns up to `end_column`, written to `y`, quantized at `part_scale`, 0: not).
  void set_part(int p, int64_t end_column, void* y, float part_scale) {
    end[p] = end_column;
    out[p] = y;
    scale[p] = part_scale;
    reciprocal[p] = part_scale > 0 ? 1.0f / part_scale : 1.0f;
  }
};
// The quotient of an int8 output before rounding: v rounded to the activations' type A first (as the
// fake-quantized model stores the linear's output), GELU with kGelu, divided by the scale.
template <typename A, bool kGelu>
__device__ __forceinline__ float int8_epilogue_quotient(float v, float scale, float reciprocal) {
  v = to_float(from_float<A>(v));
  if constexpr (kGelu) v = gelu_value(v);
  return ScaleDivision::normal_quotient(v, scale, reciprocal);
}
// The same for two values at once (their rounding to A one conversion: round_pair).
template <typename A, bool kGelu>
__device__ __forceinline__ void int8_epilogue_quotients(float& v0, float& v1, float scale0, float reciprocal0,
                                                        float scale1, float reciprocal1) {
  round_pair<A>(v0, v1);
  if constexpr (kGelu) v0 = gelu_value(v0), v1 = gelu_value(v1);
  v0 = ScaleDivision::normal_quotient(v0, scale0, reciprocal0);
  v1 = ScaleDivision::normal_quotient(v1, scale1, reciprocal1);
}
// kQuantize: some part is quantized (else the values only, O == A).
template <typename A, typename O, bool kGelu, bool kQuantize>
__device__ __forceinline__ O int8_epilogue_value(float v, float scale, float reciprocal) {
  if constexpr (std::is_same_v<O, int8_t>) {  // every part quantized
    return static_cast<int8_t>(int8_round(int8_epilogue_quotient<A, kGelu>(v, scale, reciprocal)));
  } else {
    if (!kQuantize || scale == 0.0f) return from_float<O>(kGelu ? gelu_value(v) : v);
    return from_float<O>(int8_round(int8_epilogue_quotient<A, kGelu>(v, scale, reciprocal)) * scale);
  }
}
// The table of Int8Epilogue::table for a quantizer at (scale, reciprocal): entry b is the integer
// int8_epilogue_value gives for the BF16 value of bits b, GELU applied: the same function, so the same values.
__global__ void int8_epilogue_table(int8_t* table, float scale, float reciprocal) {
  BERT_GRID_STRIDE(i, 65536) {
    const float v = to_float(__ushort_as_bfloat16(static_cast<unsigned short>(i)));
    table[i] = int8_epilogue_value<bf16, int8_t, true, true>(v, scale, reciprocal);
  }
}

namespace int8_wgmma {

constexpr int kTileN = 128, kTileK = 128;
// A consumer's staged outputs: 64 rows, each padded by 16 bytes (rows 8 apart fall in other banks).
template <typename O>
constexpr int kOutRow = kTileN* int(sizeof(O)) + 16;
// Each consumer's copy of its tile's weight scales and biases (kTileN of each), for two consumers.
constexpr int kColumnBytes = 2 * 2 * kTileN * 4;
// The GELU table's window in shared memory (the ping-pong kernel's with kTable): the entries of BF16 magnitudes 2^-31
// up to 2^33 (biased exponents 96 to 159), each sign, 16 KiB; a value outside it reads the window's nearest entry, its
// own where the scale is in [2^-24, 2^24] (table_window_exact): below 2^-31 GELU is under half a step of such a scale
// (0), from 2^32 up it is the value itself (127) or, negative, -0 (0).
constexpr int kWindowLow = 96 << 7, kWindowEntries = 64 << 7, kWindowBytes = 2 * kWindowEntries;
__host__ __device__ constexpr int window_bytes(bool table) { return table ? kWindowBytes : 0; }
inline bool table_window_exact(float scale) { return scale >= 0x1p-24f && scale <= 0x1p24f; }
// The most dynamic shared memory a block may have on Hopper (227 KiB).
constexpr int kMaxShared = 232448;

// One tile a block: two consumer warpgroups of 64 rows each share a 128 x 128 tile, a producer warp after them,
// two blocks an SM, two stages; the staging reuses the stages.
namespace one_tile {
constexpr int kConsumers = 2, kBlocks = 2;
constexpr int kTileM = 64 * kConsumers, kStages = 2, kThreads = 128 * kConsumers + 32;
constexpr int kStageBytes = (kTileM + kTileN) * kTileK;
template <typename O>
constexpr int kData = std::max(kStages * kStageBytes, kConsumers * 64 * kOutRow<O>);
// Data, 1 KiB of alignment slack (the swizzled tiles start at 1 KiB boundaries), the 2 x kStages barriers,
// the columns.
template <typename O>
constexpr int kSharedBytes = kData<O> + 1024 + 2 * kStages * 8 + kColumnBytes;
}  // namespace one_tile

// Ping-pong, persistent: one block an SM takes tile after tile (blockIdx.x, + gridDim.x, ...), its two sides
// making whole 128 x 128 tiles in turn (the block's even tiles, its odd ones), so that one side's epilogue runs
// while the other's products do; the producer fills a ring of kStages stages in the tiles' order. A side is
// kSide consumer warpgroups: one making all 128 rows of its tiles (ping-pong proper, 128 accumulators a thread),
// or two making 64 rows each (a pair, as one_tile's: 64 accumulators a thread, and the epilogue issued by twice
// the warps). Each consumer stages 64 rows of outputs at a time beside the stages.
namespace ping_pong {
constexpr int kTileM = 128, kStageBytes = (kTileM + kTileN) * kTileK;
// The consumer warpgroups and a producer warpgroup (one thread of it loads), whose registers go to the
// consumers by setmaxnreg: of the 168 a thread a block of 384 has at launch, 40 a producer thread, 232 a
// consumer's (128 accumulators beside the epilogue's); of 640 threads' 96, 24 and 112.
template <int kSide>
constexpr int kThreads = (2 * kSide + 1) * 128;
template <int kSide>
constexpr int kProducerRegisters = kSide == 1 ? 40 : 24;
template <int kSide>
constexpr int kConsumerRegisters = kSide == 1 ? 232 : 112;
template <typename O, int kSide>
constexpr int kStaging = 2 * kSide * 64 * kOutRow<O>;
constexpr int kMaxStages = 6;
// As many stages as fit beside the staging, each consumer's columns, the barriers and the alignment slack
// (int8 outputs 6, BF16 5, float 4 with one warpgroup a side; 5, 4, 2 with two). kTable: the GELU table's
// window beside them (int8 outputs 5 with one warpgroup a side or two).
template <typename O, int kSide, bool kTable = false>
constexpr int kStages = std::min(kMaxStages, (kMaxShared - kStaging<O, kSide> - kSide * kColumnBytes -
                                              window_bytes(kTable) - 2 * kMaxStages * 8 - 1024) /
                                                 kStageBytes);
template <typename O, int kSide, bool kTable = false>
constexpr int kSharedBytes = kStages<O, kSide, kTable>* kStageBytes + kStaging<O, kSide> + 1024 +
                             2 * kStages<O, kSide, kTable> * 8 + kSide* kColumnBytes + window_bytes(kTable);
// setmaxnreg moves registers within the block's pool (a request beyond it waits forever).
template <int kSide>
constexpr bool kRegistersFit = kProducerRegisters<kSide> * 128 + kConsumerRegisters<kSide> * 2 * kSide * 128 <=
                               65536 / kThreads<kSide> / 8 * 8 * kThreads<kSide>;
static_assert(kRegistersFit<1> && kRegistersFit<2>);
static_assert(kSharedBytes<float, 1> <= kMaxShared && kStages<float, 1> >= 2);
static_assert(kSharedBytes<float, 2> <= kMaxShared && kStages<float, 2> >= 2);
static_assert(kSharedBytes<int8_t, 1, true> <= kMaxShared && kStages<int8_t, 1, true> >= 2);
static_assert(kSharedBytes<int8_t, 2, true> <= kMaxShared && kStages<int8_t, 2, true> >= 2);
}  // namespace ping_pong

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// The operand descriptor of a K-major tile of 128-byte rows, 128-byte swizzle: 8-row groups 1,024 bytes
// apart (stride), the leading offset unused under swizzling.
// Built from its low word: the descriptor of address + b (b a multiple of 16, inside shared memory, whose
// addresses are below 2^18) is the low word plus b / 16, the 14-bit address field never overflowing; so the
// loops add offsets to one low word instead of building each descriptor from its address.
__device__ __forceinline__ uint32_t descriptor_low(uint32_t address) { return ((address & 0x3FFFF) >> 4) | (1u << 16); }
__device__ __forceinline__ uint64_t descriptor_of(uint32_t low) {
  return uint64_t(low) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}
__device__ __forceinline__ void barrier_init(uint64_t* b, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(b)), "r"(count));
}
__device__ __forceinline__ void barrier_expect(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(b)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void barrier_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(b)) : "memory");
}
__device__ __forceinline__ void barrier_wait(uint64_t* b, int parity) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n @done bra.uni DONE;\n"
      " bra.uni WAIT;\n DONE:\n }\n" ::"r"(shared_address(b)),
      "r"(parity)
      : "memory");
}
// The first 1 KiB boundary in dynamic shared memory (the swizzled tiles start at one), found by pointer
// arithmetic on the shared array so that the compiler knows what derives from it is shared memory (LDS/STS,
// not generic loads and stores).
__device__ __forceinline__ uint8_t* aligned_shared(uint8_t* raw) {
  return raw + ((1024 - (shared_address(raw) & 1023)) & 1023);
}
// Named barrier `id` of `threads` threads: waited for, or arrived at without waiting.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Tile (c0, c1) of `map` (inner coordinate first) into shared memory, completing on `b`.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* b, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], "
      "[%2];\n" ::"r"(shared_address(dst)),
      "l"(map), "r"(shared_address(b)), "r"(c0), "r"(c1)
      : "memory");
}
// d (64 x 128 of int32, 64 a thread) = a (64 x 32 int8) b (128 x 32 int8)^T, plus d where `accumulate` (a tile's
// first product starts its sums: no zeroing of the accumulators).
__device__ __forceinline__ void wgmma(int (&d)[64], uint64_t a, uint64_t b, bool accumulate) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
      "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, "
      "p;\n}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]),
        "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]),
        "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]),
        "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]),
        "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]),
        "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]),
        "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]),
        "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
      : "l"(a), "l"(b), "r"(int(accumulate)));
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// The coordinates of the tiles tile, tile + step, tile + 2 step, ... of a row-major grid of tiles with
// `column_tiles` a row: divisions when the walk starts, none a tile.
struct TileWalk {
  int row, column, step_rows, step_columns, columns;
  __device__ TileWalk(int tile, int step, int column_tiles)
      : row(tile / column_tiles),
        column(tile % column_tiles),
        step_rows(step / column_tiles),
        step_columns(step % column_tiles),
        columns(column_tiles) {}
  __device__ __forceinline__ void next() {
    row += step_rows, column += step_columns;
    if (column >= columns) column -= columns, ++row;
  }
};

// The producer: loads the slices of the block's tiles (blockIdx.x, + gridDim.x, ...) into the ring of kStages
// stages of (kTileM + kTileN) x kTileK bytes, in order, each stage once its consumers released it.
template <int kTileM, int kStages>
__device__ __forceinline__ void produce(uint8_t* shared, uint64_t* full, uint64_t* empty, const CUtensorMap& q_map,
                                        const CUtensorMap& w_map, int output_tiles, int column_tiles, int slices) {
  constexpr int kStageBytes = (kTileM + kTileN) * kTileK;
  int u = 0;  // slices loaded so far, over every tile of this block
  TileWalk at(blockIdx.x, gridDim.x, column_tiles);
  for (int tile = blockIdx.x; tile < output_tiles; tile += gridDim.x, at.next()) {
    const int m0 = at.row * kTileM, n0 = at.column * kTileN;
    for (int t = 0; t < slices; ++t, ++u) {
      const int s = u % kStages;
      if (u >= kStages) barrier_wait(&empty[s], (u / kStages - 1) & 1);
      barrier_expect(&full[s], kStageBytes);
      uint8_t* stage = shared + s * kStageBytes;
      tma_load(stage, &q_map, &full[s], t * kTileK, m0);
      tma_load(stage + kTileM * kTileK, &w_map, &full[s], t * kTileK, n0);
    }
  }
}

// A consumer's thread starts copying its tile's weight scale and bias (column n0 + thread, zeros past n)
// into shared memory, the columns in pairs: scales 2p, 2p + 1 then biases 2p, 2p + 1 at columns + 4p (one
// 16-byte read of a thread's pair in the epilogue). After mma::wait<0>() the thread multiplies its scale by
// the input's (scale_columns), and the warpgroup reads them after a barrier.
__device__ __forceinline__ int column_slot(int i) { return (i >> 1) * 4 + (i & 1); }
__device__ __forceinline__ void fetch_columns(const Int8Epilogue& e, float* columns, int64_t n0, int64_t n) {
  const int i = threadIdx.x & 127;
  const bool inside = n0 + i < n;
  mma::copy_async<4>(columns + column_slot(i), e.scale_w + (inside ? n0 + i : 0), inside);
  mma::copy_async<4>(columns + column_slot(i) + 2, e.bias + (inside ? n0 + i : 0), inside);
  mma::commit();
}
__device__ __forceinline__ void scale_columns(const Int8Epilogue& e, float* columns) {
  float& own = columns[column_slot(threadIdx.x & 127)];
  own = __fmul_rn(e.input_scale(), own);
}

// How a tile's outputs are finished: decided once for the tile (the usual case: inside n, in one part, no
// per-column bounds or part picks).
struct TileParts {
  int columns;  // the tile's columns inside n
  int part;     // the part of its first column
  bool one_part;
  float scale, reciprocal;  // that part's quantizer
  __device__ TileParts(const Int8Epilogue& e, int64_t n0, int64_t n) {
    columns = n - n0 < kTileN ? int(n - n0) : kTileN;
    part = e.part(n0);
    one_part = e.part(n0 + columns - 1) == part;
    scale = Int8Epilogue::pick(part, e.scale);
    reciprocal = Int8Epilogue::pick(part, e.reciprocal);
  }
};

// A warpgroup's 64 x 128 sums d, finished by e, into `staging` (64 rows of kOutRow<O>). Thread's outputs: rows
// lane / 4 and + 8 of its warp's 16, channels 2 (lane % 4) and + 1 of each 8. kParts: the quantizer picked per
// column (a tile across parts), else the tile's.
template <typename A, typename O, bool kGelu, bool kQuantize, bool kTable, bool kParts>
__device__ __forceinline__ void finish_columns(const int (&d)[64], uint8_t* staging, const Int8Epilogue& e,
                                               const float* columns, int64_t n0, const TileParts& tp) {
  static_assert(!kTable, "the table's outputs: finish_table");
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
#pragma unroll
  for (int j = 0; j < kTileN / 8; ++j) {
    const int local = j * 8 + (lane & 3) * 2;
    const float4 pair = *reinterpret_cast<const float4*>(columns + 2 * local);
    const float s0 = pair.x, s1 = pair.y, b0 = pair.z, b1 = pair.w;              // scale_x s_w, bias; zeros past n
    float q0 = tp.scale, r0 = tp.reciprocal, q1 = tp.scale, r1 = tp.reciprocal;  // the quantizers'
    if constexpr (kParts) {
      const int64_t c = n0 + local;
      const int p0 = e.part(c), p1 = e.part(c + 1);
      q0 = Int8Epilogue::pick(p0, e.scale), r0 = Int8Epilogue::pick(p0, e.reciprocal);
      q1 = Int8Epilogue::pick(p1, e.scale), r1 = Int8Epilogue::pick(p1, e.reciprocal);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float v0 = fmaf(__int2float_rn(d[4 * j + 2 * h]), s0, b0),
                  v1 = fmaf(__int2float_rn(d[4 * j + 2 * h + 1]), s1, b1);
      O* const to = reinterpret_cast<O*>(staging + (warp * 16 + (lane >> 2) + h * 8) * kOutRow<O>) + local;
      if constexpr (std::is_same_v<O, int8_t>) {
        float u0 = v0, u1 = v1;
        int8_epilogue_quotients<A, kGelu>(u0, u1, q0, r0, q1, r1);
        *reinterpret_cast<uint16_t*>(to) = int8_pair(u0, u1);
      } else if constexpr (std::is_same_v<O, bf16> && !kQuantize && !kGelu) {
        *reinterpret_cast<__nv_bfloat162*>(to) = __floats2bfloat162_rn(v0, v1);
      } else {
        Pack<O, 2> pair;
        pair.v[0] = int8_epilogue_value<A, O, kGelu, kQuantize>(v0, q0, r0);
        pair.v[1] = int8_epilogue_value<A, O, kGelu, kQuantize>(v1, q1, r1);
        store_pack<2>(to, pair);
      }
    }
  }
}
// The block copies the window of e.table (kWindowBytes) into shared memory, 16 bytes a thread at a time.
__device__ __forceinline__ void load_window(int8_t* window, const int8_t* table) {
  constexpr int kPieces = kWindowEntries / 16;  // a sign's
  for (int i = threadIdx.x; i < 2 * kPieces; i += blockDim.x)
    reinterpret_cast<uint4*>(window)[i] =
        reinterpret_cast<const uint4*>(table + (i / kPieces) * 32768 + kWindowLow)[i % kPieces];
}
// The window's entry for the BF16 value of 16 bits b: its magnitude clamped to the window's, its sign's half.
__device__ __forceinline__ int8_t window_entry(const int8_t* window, uint32_t b) {
  const int magnitude = min(max(int(b & 0x7FFFu), kWindowLow), kWindowLow + kWindowEntries - 1);
  return window[magnitude + int((b & 0x8000u) >> 2) - kWindowLow];
}
// The same through e.table (kTable: one part, GELU, int8 out): two column pairs (eight outputs) at a time, each
// pair of values rounded to BF16 by one conversion whose two halves index the table, the eight lookups in
// flight together before their stores (the lookups' latency, not their count, had set the pace). kWindow: the
// lookups read the table's window in shared memory (the ping-pong kernel, which loads it once for many
// tiles): from global memory (L1-cached) a warp's 32 lookups touch about 20 sectors and, beside the
// products' operand reads, the L1's wavefronts set the kernel's pace (BERT-base's FFN GEMM at batch 128 on
// an H200, ncu: 93.6 -> 89.4 us). Else `table` is e.table, read from global memory.
template <bool kWindow>
__device__ __forceinline__ void finish_table(const int (&d)[64], uint8_t* staging, const int8_t* table,
                                             const float* columns) {
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
#pragma unroll
  for (int j = 0; j < kTileN / 8; j += 2) {
    uint32_t bits[2][2];  // [column pair][row half]: the two BF16 values' bits, the first channel low
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      const int local = (j + jj) * 8 + (lane & 3) * 2;
      const float4 pair = *reinterpret_cast<const float4*>(columns + 2 * local);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const __nv_bfloat162 b =
            __floats2bfloat162_rn(fmaf(__int2float_rn(d[4 * (j + jj) + 2 * h]), pair.x, pair.z),
                                  fmaf(__int2float_rn(d[4 * (j + jj) + 2 * h + 1]), pair.y, pair.w));
        bits[jj][h] = *reinterpret_cast<const uint32_t*>(&b);
      }
    }
    int8_t got[2][2][2];
#pragma unroll
    for (int jj = 0; jj < 2; ++jj)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (kWindow) {
          got[jj][h][0] = window_entry(table, bits[jj][h] & 0xFFFFu);
          got[jj][h][1] = window_entry(table, bits[jj][h] >> 16);
        } else {
          got[jj][h][0] = __ldg(table + (bits[jj][h] & 0xFFFFu));
          got[jj][h][1] = __ldg(table + (bits[jj][h] >> 16));
        }
      }
#pragma unroll
    for (int jj = 0; jj < 2; ++jj)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int local = (j + jj) * 8 + (lane & 3) * 2;
        int8_t* const to =
            reinterpret_cast<int8_t*>(staging + (warp * 16 + (lane >> 2) + h * 8) * kOutRow<int8_t>) + local;
        Pack<int8_t, 2> out;  // one shared-memory store for the two channels
        out.v[0] = got[jj][h][0], out.v[1] = got[jj][h][1];
        store_pack<2>(to, out);
      }
  }
}
// kTable: the integers from the table (kWindow: its window in shared memory at `table`, else e.table).
template <typename A, typename O, bool kGelu, bool kQuantize, bool kTable, bool kWindow>
__device__ __forceinline__ void finish(const int (&d)[64], uint8_t* staging, const Int8Epilogue& e,
                                       const float* columns, int64_t n0, const TileParts& tp, const int8_t* table) {
  if constexpr (kTable) {
    static_assert(std::is_same_v<A, bf16> && std::is_same_v<O, int8_t> && kGelu);
    finish_table<kWindow>(d, staging, table, columns);  // (kTable: one part)
  } else if (kQuantize && !tp.one_part)
    finish_columns<A, O, kGelu, kQuantize, kTable, true>(d, staging, e, columns, n0, tp);
  else
    finish_columns<A, O, kGelu, kQuantize, kTable, false>(d, staging, e, columns, n0, tp);
}

// A warpgroup writes 64 staged rows (rows r0 .. r0 + 63 of y, those below m) to their parts in 16-byte pieces.
template <typename O>
__device__ __forceinline__ void store(const uint8_t* staging, const Int8Epilogue& e, int64_t r0, int64_t m, int64_t n0,
                                      int64_t n, const TileParts& tp) {
  constexpr int kPer = 16 / int(sizeof(O)), kPieces = kTileN / kPer;  // 16-byte pieces a row
  const int64_t tile_begin = e.begin(tp.part), tile_width = e.width(tp.part);
  // Every piece whole, in the tile's part and 16-byte aligned there: one store each.
  const bool whole = tp.columns == kTileN && tp.one_part && (n0 - tile_begin) % kPer == 0 && tile_width % kPer == 0;
  O* const tile_out = static_cast<O*>(Int8Epilogue::pick(tp.part, e.out)) + (n0 - tile_begin);
  for (int i = threadIdx.x & 127; i < 64 * kPieces; i += 128) {
    const int local_row = i / kPieces, piece = i % kPieces;
    const int64_t r = r0 + local_row;
    if (r >= m || piece * kPer >= tp.columns) continue;
    const O* from = reinterpret_cast<const O*>(staging + local_row * kOutRow<O>) + piece * kPer;
    if (whole) {
      *reinterpret_cast<uint4*>(tile_out + r * tile_width + piece * kPer) = *reinterpret_cast<const uint4*>(from);
      continue;
    }
    const int64_t c = n0 + piece * kPer;
    const int p = e.part(c);
    const int64_t begin = e.begin(p), width = e.width(p);
    if (c + kPer <= begin + width && (c - begin) % kPer == 0 && width % kPer == 0) {
      *reinterpret_cast<uint4*>(static_cast<O*>(Int8Epilogue::pick(p, e.out)) + r * width + (c - begin)) =
          *reinterpret_cast<const uint4*>(from);
    } else {
      for (int x = 0; x < kPer && c + x < n; ++x) {
        const int q = e.part(c + x);
        static_cast<O*>(Int8Epilogue::pick(q, e.out))[r * e.width(q) + (c + x - e.begin(q))] = from[x];
      }
    }
  }
}
#endif

// Activations of type A, outputs of type O (A, or int8 where every part is quantized); kQuantize: some part is;
// kTable: e.table gives the integers (A BF16, O int8, GELU, one part). One tile a block (one_tile).
template <typename A, typename O, bool kGelu, bool kQuantize, bool kTable>
__global__ void __launch_bounds__(one_tile::kThreads, one_tile::kBlocks)
    gemm_one_tile(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap w_map,
                  const Int8Epilogue e, int64_t m, int64_t n, int64_t ld) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace one_tile;
  extern __shared__ __align__(1024) uint8_t shared_raw[];
  uint8_t* const shared = aligned_shared(shared_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(shared + kData<O>);
  uint64_t* empty = full + kStages;
  float* columns_shared = reinterpret_cast<float*>(empty + kStages);
  const int group = threadIdx.x >> 7;  // 0, 1: consumers (rows 64 group); 2: the producer warp
  const int slices = int((ld + kTileK - 1) / kTileK);
  const int column_tiles = int((n + kTileN - 1) / kTileN), output_tiles = column_tiles * int((m + kTileM - 1) / kTileM);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) barrier_init(&full[s], 1), barrier_init(&empty[s], kConsumers);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (group == kConsumers) {
    if (threadIdx.x == kConsumers * 128)
      produce<kTileM, kStages>(shared, full, empty, q_map, w_map, output_tiles, column_tiles, slices);
    return;
  }
  const int row0 = group * 64, tile = blockIdx.x;
  const int m0 = tile / column_tiles * kTileM, n0 = tile % column_tiles * kTileN;
  float* const columns = columns_shared + group * 2 * kTileN;  // this consumer's
  fetch_columns(e, columns, n0, n);                            // in flight while the products run
  int d[64];                                                   // the first product writes them
  const uint32_t a0 = descriptor_low(shared_address(shared + row0 * kTileK)),
                 b0 = descriptor_low(shared_address(shared + kTileM * kTileK));  // stage 0's
  for (int t = 0; t < slices; ++t) {
    const int s = t % kStages;
    barrier_wait(&full[s], (t / kStages) & 1);
    const uint32_t a = a0 + s * (kStageBytes / 16), b = b0 + s * (kStageBytes / 16);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kTileK / 32; ++kk)
      wgmma(d, descriptor_of(a + kk * 2), descriptor_of(b + kk * 2), t > 0 || kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    if ((threadIdx.x & 127) == 0) barrier_arrive(&empty[s]);
  }
  const TileParts tp(e, n0, n);
  mma::wait<0>();  // this thread's columns, then everyone's after the barrier
  scale_columns(e, columns);
  named_sync(1, kConsumers * 128);  // and the staging over the stages: both consumers done with them
  uint8_t* staging = shared + group * 64 * kOutRow<O>;
  finish<A, O, kGelu, kQuantize, kTable, false>(d, staging, e, columns, n0, tp, e.table);
  named_sync(2 + group, 128);
  store<O>(staging, e, m0 + row0, m, n0, n, tp);
#else
  __trap();  // launched only where the build has sm_90a code (ops/integer.cu checks)
#endif
}

// The same, ping-pong (ping_pong): a block an SM, each side of kSide consumer warpgroups making whole tiles in turn.
template <typename A, typename O, bool kGelu, bool kQuantize, bool kTable, int kSide>
__global__ void __launch_bounds__(ping_pong::kThreads<kSide>, 1)
    gemm_ping_pong(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap w_map,
                   const Int8Epilogue e, int64_t m, int64_t n, int64_t ld) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace ping_pong;
  constexpr int S = kStages<O, kSide, kTable>, kRows = kTileM / kSide, kSideThreads = kSide * 128;
  extern __shared__ __align__(1024) uint8_t shared_raw[];
  uint8_t* const shared = aligned_shared(shared_raw);
  uint64_t* full = reinterpret_cast<uint64_t*>(shared + S * kStageBytes + kStaging<O, kSide>);
  uint64_t* empty = full + S;
  float* columns_shared = reinterpret_cast<float*>(empty + S);
  int8_t* const window = reinterpret_cast<int8_t*>(columns_shared) + kSide * kColumnBytes;  // kTable
  // Consumers 0 .. 2 kSide - 1: side group / kSide (the block's even tiles, its odd ones), rows kRows x
  // (group % kSide) of them; the producer after them.
  const int group = threadIdx.x >> 7, side = group / kSide, row0 = group % kSide * kRows;
  const int slices = int((ld + kTileK - 1) / kTileK);
  const int column_tiles = int((n + kTileN - 1) / kTileN), output_tiles = column_tiles * int((m + kTileM - 1) / kTileM);
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) barrier_init(&full[s], 1), barrier_init(&empty[s], kSide);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if constexpr (kTable) load_window(window, e.table);
  __syncthreads();
  if (group == 2 * kSide) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegisters<kSide>));
    if (threadIdx.x == 2 * kSide * 128)
      produce<kTileM, S>(shared, full, empty, q_map, w_map, output_tiles, column_tiles, slices);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegisters<kSide>));
  float* const columns = columns_shared + group * 2 * kTileN;  // this consumer's
  uint8_t* const staging = shared + S * kStageBytes + group * 64 * kOutRow<O>;
  // Turns: side s waits at barrier 1 + s for the other side's products to end, and arrives at the other's (each
  // side's threads arrive, the other's wait); barrier 3 + group is the warpgroup's own.
  const int my_turn = 1 + side, other_turn = 2 - side, own = 3 + group;
  const uint32_t a0 = descriptor_low(shared_address(shared + row0 * kTileK)),
                 b0 = descriptor_low(shared_address(shared + kTileM * kTileK));  // stage 0's
  TileWalk at(blockIdx.x + side * gridDim.x, 2 * gridDim.x, column_tiles);
#pragma unroll 1
  for (int j = side, tile = blockIdx.x + side * gridDim.x; tile < output_tiles;
       j += 2, tile += 2 * gridDim.x, at.next()) {
    const int m0 = at.row * kTileM, n0 = at.column * kTileN;
    fetch_columns(e, columns, n0, n);  // in flight while the products run
    int d[kRows / 64][64];             // rows row0 + 64 r; the first product writes them
    if (j > 0) named_sync(my_turn, 2 * kSideThreads);
    int u = j * slices, last = 0;  // the ring's slice; the stage of the slice before
    for (int t = 0; t < slices; ++t, ++u) {
      const int s = u % S;
      barrier_wait(&full[s], (u / S) & 1);
      const uint32_t a = a0 + s * (kStageBytes / 16), b = b0 + s * (kStageBytes / 16);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kTileK / 32; ++kk)
#pragma unroll
        for (int r = 0; r < kRows / 64; ++r)
          wgmma(d[r], descriptor_of(a + (r * 64 * kTileK + kk * 32) / 16), descriptor_of(b + kk * 2), t > 0 || kk > 0);
      wgmma_commit();
      if (t > 0) {  // the slice before done: its stage released (one group kept in flight)
        wgmma_wait<1>();
        if ((threadIdx.x & 127) == 0) barrier_arrive(&empty[last]);
      }
      last = s;
    }
    wgmma_wait<0>();
    if ((threadIdx.x & 127) == 0) barrier_arrive(&empty[last]);
    // The block's next tile is the other side's.
    if (tile + gridDim.x < output_tiles) named_arrive(other_turn, 2 * kSideThreads);
    const TileParts tp(e, n0, n);
    mma::wait<0>();  // this thread's columns, then everyone's after the first barrier (which also ends the last
    scale_columns(e, columns);  // tile's reads of the staging)
#pragma unroll
    for (int r = 0; r < kRows / 64; ++r) {
      named_sync(own, 128);
      finish<A, O, kGelu, kQuantize, kTable, true>(d[r], staging, e, columns, n0, tp, window);
      named_sync(own, 128);
      store<O>(staging, e, m0 + row0 + r * 64, m, n0, n, tp);
    }
  }
#else
  __trap();  // launched only where the build has sm_90a code (ops/integer.cu checks)
#endif
}

}  // namespace int8_wgmma
}  // namespace bert::cuda
