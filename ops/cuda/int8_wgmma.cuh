// An int8 GEMM on Hopper's warpgroup tensor cores (wgmma, sm_90a) whose epilogue dequantizes per output
// channel: y (m, n) = finish(fma(float(sum), scale_x * scale_w[c], bias[c])) with exact int32 sums,
// written once in the output type (float or BF16). cuBLASLt's int8 GEMMs offer no per-channel scale on
// Hopper, so with them the int32 sums go through memory and back (ops/integer.cu keeps that path: the
// reference this kernel is tested against, and where sm_90a is not there).
//
// q (m, ld) and w (n, ld) int8 row-major, ld a multiple of 16 (both K-major, as int8 wgmma takes them).
// A block makes a 128 x 128 tile of y from 128-byte slices of K: one producer warp loads them by TMA
// (128-byte swizzle) into a ring of kStages stages guarded by mbarriers; two consumer warpgroups each
// multiply 64 rows of the tile (wgmma m64n128k32, four a slice) and release the stage. The epilogue
// stages each warpgroup's outputs in shared memory and writes them out in 16-byte pieces along the rows.
// Two blocks an SM.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "ops/cuda/common.cuh"

namespace bert::cuda::int8_wgmma {

constexpr int kTileM = 128, kTileN = 128, kTileK = 128, kStages = 2, kThreads = 288;
constexpr int kStageBytes = (kTileM + kTileN) * kTileK;
// A consumer's staged outputs: 64 rows, each padded by 16 bytes (rows 8 apart fall in other banks).
template <typename A>
constexpr int kOutRow = kTileN* int(sizeof(A)) + 16;
template <typename A>
constexpr int kData = kStages* kStageBytes > 2 * 64 * kOutRow<A> ? kStages* kStageBytes : 2 * 64 * kOutRow<A>;
// Data, 1 KiB of alignment slack (the swizzled tiles start at 1 KiB boundaries), the 2 x kStages barriers.
template <typename A>
constexpr int kSharedBytes = kData<A> + 1024 + 2 * kStages * 8;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// The operand descriptor of a K-major tile of 128-byte rows, 128-byte swizzle: 8-row groups 1,024 bytes
// apart (stride), the leading offset unused under swizzling.
__device__ __forceinline__ uint64_t descriptor(uint32_t address) {
  return uint64_t((address & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
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
// Tile (c0, c1) of `map` (inner coordinate first) into shared memory, completing on `b`.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* b, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], "
      "[%2];\n" ::"r"(shared_address(dst)),
      "l"(map), "r"(shared_address(b)), "r"(c0), "r"(c1)
      : "memory");
}
// d (64 x 128 of int32, 64 a thread) += a (64 x 32 int8) b (128 x 32 int8)^T.
__device__ __forceinline__ void wgmma(int (&d)[64], uint64_t a, uint64_t b) {
  asm volatile(
      "{\n wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "
      "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, "
      "%45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, "
      "1;\n}\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]),
        "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]),
        "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]),
        "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]),
        "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]),
        "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]),
        "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]),
        "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
      : "l"(a), "l"(b));
}
#endif

template <typename A, bool kGelu>
__global__ void __launch_bounds__(kThreads, 2)
    gemm_dequantize(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap w_map, A* y,
                    int64_t m, int64_t n, int64_t ld, float scale_x, const float* scale_w, const float* bias) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __align__(1024) uint8_t shared_raw[];
  uint8_t* shared = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(shared_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(shared + kData<A>);
  uint64_t* empty = full + kStages;
  const int64_t m0 = int64_t(blockIdx.y) * kTileM, n0 = int64_t(blockIdx.x) * kTileN;
  const int group = threadIdx.x >> 7;  // 0, 1: consumers (rows 64 group); 2: the producer warp
  const int tiles = int((ld + kTileK - 1) / kTileK);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) barrier_init(&full[s], 1), barrier_init(&empty[s], 2);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (group == 2) {
    if (threadIdx.x == 2 * 128)
      for (int t = 0; t < tiles; ++t) {
        const int s = t % kStages;
        if (t >= kStages) barrier_wait(&empty[s], (t / kStages - 1) & 1);
        barrier_expect(&full[s], kStageBytes);
        uint8_t* stage = shared + s * kStageBytes;
        tma_load(stage, &q_map, &full[s], t * kTileK, int(m0));
        tma_load(stage + kTileM * kTileK, &w_map, &full[s], t * kTileK, int(n0));
      }
    return;
  }
  int d[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) d[i] = 0;
  const int row0 = group * 64;
  for (int t = 0; t < tiles; ++t) {
    const int s = t % kStages;
    barrier_wait(&full[s], (t / kStages) & 1);
    const uint8_t* stage = shared + s * kStageBytes;
    const uint32_t a = shared_address(stage + row0 * kTileK), b = shared_address(stage + kTileM * kTileK);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < kTileK / 32; ++kk) wgmma(d, descriptor(a + kk * 32), descriptor(b + kk * 32));
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    if ((threadIdx.x & 127) == 0) barrier_arrive(&empty[s]);
  }
  // Thread's outputs: rows lane / 4 and + 8 of its warp's 16, channels 2 (lane % 4) and + 1 of each 8.
  const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
  uint8_t* out = shared + group * 64 * kOutRow<A>;
  asm volatile("bar.sync 1, 256;\n" ::: "memory");  // both consumers are done with the stages
#pragma unroll
  for (int j = 0; j < kTileN / 8; ++j) {
    const int local = j * 8 + (lane & 3) * 2;
    const int64_t c = n0 + local;
    const float s0 = c < n ? __fmul_rn(scale_x, scale_w[c]) : 0.0f,
                s1 = c + 1 < n ? __fmul_rn(scale_x, scale_w[c + 1]) : 0.0f;
    const float b0 = bias && c < n ? bias[c] : 0.0f, b1 = bias && c + 1 < n ? bias[c + 1] : 0.0f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float v0 = fmaf(__int2float_rn(d[4 * j + 2 * h]), s0, b0),
            v1 = fmaf(__int2float_rn(d[4 * j + 2 * h + 1]), s1, b1);
      if constexpr (kGelu) v0 = gelu_value(v0), v1 = gelu_value(v1);
      A* at = reinterpret_cast<A*>(out + (warp * 16 + (lane >> 2) + h * 8) * kOutRow<A>) + local;
      at[0] = from_float<A>(v0), at[1] = from_float<A>(v1);
    }
  }
  asm volatile("bar.sync %0, 128;\n" ::"r"(2 + group) : "memory");
  constexpr int kPer = 16 / int(sizeof(A)), kPieces = kTileN / kPer;  // 16-byte pieces a row
  for (int i = threadIdx.x & 127; i < 64 * kPieces; i += 128) {
    const int local_row = i / kPieces, piece = i % kPieces;
    const int64_t r = m0 + row0 + local_row, c = n0 + piece * kPer;
    if (r >= m || c >= n) continue;
    const A* from = reinterpret_cast<const A*>(out + local_row * kOutRow<A>) + piece * kPer;
    A* to = y + r * n + c;
    if (c + kPer <= n && n % kPer == 0)
      *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
    else
      for (int e = 0; e < kPer && c + e < n; ++e) to[e] = from[e];
  }
#else
  __trap();  // launched only where the build has sm_90a code (ops/integer.cu checks)
#endif
}

}  // namespace bert::cuda::int8_wgmma
