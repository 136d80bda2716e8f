// Warp-level BF16 (and TF32, further below) tensor-core products with the operands in registers (mma.sync
// m16n8k16, FP32 accumulation; sm_80 and later), and the shared-memory loads (ldmatrix) that give their fragments. For
// kernels that keep a tile's results in registers between products (ops/attention.cu's BF16 kernels),
// where WMMA's opaque fragments would go through shared memory.
//
// Fragments, as the PTX ISA lays them out (lane l, g = l / 4, t = l % 4):
//   A (16 x 16, 4 registers of two BF16): rows g and g + 8, columns 2t, 2t + 1 and 2t + 8, 2t + 9;
//   B (16 x 8, 2 registers): k rows 2t, 2t + 1 and 2t + 8, 2t + 9 of column g;
//   C (16 x 8, 4 floats): c[0], c[1] row g, columns 2t, 2t + 1; c[2], c[3] row g + 8.
// Two adjacent C tiles (columns 0-7 and 8-15) converted to BF16 are an A fragment over those 16 columns
// (a_from_c): a product's result feeds the next product without leaving registers.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace bert::cuda::mma {

using Accumulator = float[4];  // a 16 x 8 C tile

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8 x 8 matrices of 16-bit values from shared memory: lanes 8m .. 8m + 7 give the addresses of the
// rows of matrix m (16-byte aligned); register m of lane l holds row l / 4, columns 2(l % 4) and
// 2(l % 4) + 1 of matrix m, or of its transpose with Trans.
template <bool Trans>
__device__ __forceinline__ void load_matrices(uint32_t (&r)[4], const void* row) {
  const uint32_t a = shared_address(row);
  if constexpr (Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a)
                 : "memory");
}

// The A fragment of the 16 x 16 tile at row r0, column c0 of a row-major BF16 array (row stride ld
// elements, rows 16-byte aligned).
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const __nv_bfloat16* s, int ld, int r0, int c0) {
  const int lane = threadIdx.x % 32;
  load_matrices<false>(a, s + (r0 + lane % 16) * ld + c0 + (lane / 16) * 8);
}

// The same tile of an array stored column by column (element (r, c) at s[c ld + r], as a product's
// transpose is kept), through ldmatrix's transposing load.
__device__ __forceinline__ void load_a_transposed(uint32_t (&a)[4], const __nv_bfloat16* s, int ld, int r0, int c0) {
  const int lane = threadIdx.x % 32;
  load_matrices<true>(a, s + (c0 + lane % 8 + (lane / 16) * 8) * ld + r0 + ((lane / 8) % 2) * 8);
}

// The B fragments of two adjacent 8-column tiles, columns n0 .. n0 + 15 over k0 .. k0 + 15: b[0], b[1]
// for columns n0 .. n0 + 7 and b[2], b[3] for n0 + 8 .. n0 + 15. KMajor: element (k, n) at s[k ld + n]
// (B stored row by row, as V for P V); otherwise at s[n ld + k] (B transposed, as K for Q K^T).
template <bool KMajor>
__device__ __forceinline__ void load_b_pair(uint32_t (&b)[4], const __nv_bfloat16* s, int ld, int k0, int n0) {
  const int lane = threadIdx.x % 32;
  if constexpr (KMajor)
    load_matrices<true>(b, s + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * ld + n0 + (lane / 16) * 8);
  else
    load_matrices<false>(b, s + (n0 + lane % 8 + (lane / 16) * 8) * ld + k0 + ((lane / 8) % 2) * 8);
}

// d += a b (16 x 16 by 16 x 8, FP32 accumulation).
__device__ __forceinline__ void product(Accumulator& d, const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as BF16 (round to nearest even), lo in the low half: one register of a fragment.
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The A fragment over the 16 columns of two adjacent C tiles (left: columns 0-7, right: 8-15).
__device__ __forceinline__ void a_from_c(uint32_t (&a)[4], const Accumulator& left, const Accumulator& right) {
  a[0] = pack(left[0], left[1]);
  a[1] = pack(left[2], left[3]);
  a[2] = pack(right[0], right[1]);
  a[3] = pack(right[2], right[3]);
}

// --- TF32 products (mma.sync m16n8k8, FP32 accumulation; sm_80 and later) on FP32 operands, each rounded to
// TF32 (10 mantissa bits, to nearest) as its fragment is formed. Fragments (lane l, g = l / 4, t = l % 4):
//   A (16 x 8, 4 registers): a[0] row g, column t; a[1] row g + 8, column t; a[2], a[3] the same rows,
//   column t + 4;
//   B (8 x 8, 2 registers): b0 k row t of column g, b1 k row t + 4; C as above.
// A C tile feeds the next product as an A fragment over its 8 columns with the k order permuted (slot t
// is column 2t, slot t + 4 column 2t + 1: a_from_c_tf32), so the B fragment read with it takes its k rows
// in that order (load_b_permuted_tf32).

// x rounded to TF32 (to nearest, ties away from zero), as the 32-bit register an operand fragment holds.
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// d += a b (16 x 8 by 8 x 8, TF32 operands, FP32 accumulation).
__device__ __forceinline__ void product_tf32(Accumulator& d, const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The A fragment of the 16 x 8 tile at row r0, column c0 of a row-major float array (row stride ld, rows
// 16-byte aligned). ldmatrix's 8 x 8 matrices of 16-bit values are 8 x 4 floats here: register m of lane l
// holds float l % 4 of row l / 4 of matrix m, which is the fragment's layout.
__device__ __forceinline__ void load_a_tf32(uint32_t (&a)[4], const float* s, int ld, int r0, int c0) {
  const int lane = threadIdx.x % 32;
  load_matrices<false>(a, s + (r0 + lane % 8 + ((lane / 8) % 2) * 8) * ld + c0 + (lane / 16) * 4);
  for (uint32_t& x : a) x = to_tf32(__uint_as_float(x));
}

// The B fragments of two adjacent 8-column tiles, columns n0 .. n0 + 15 over k0 .. k0 + 7, element (k, n)
// at s[n ld + k] (B transposed, as K for Q K^T): b[0], b[1] for columns n0 .. n0 + 7, b[2], b[3] for the next 8.
__device__ __forceinline__ void load_b_pair_tf32(uint32_t (&b)[4], const float* s, int ld, int k0, int n0) {
  const int lane = threadIdx.x % 32;
  load_matrices<false>(b, s + (n0 + lane % 8 + (lane / 16) * 8) * ld + k0 + ((lane / 8) % 2) * 4);
  for (uint32_t& x : b) x = to_tf32(__uint_as_float(x));
}

// The A fragment of a C tile's 16 x 8 values in the permuted k order (slot t: column 2t, slot t + 4:
// column 2t + 1).
__device__ __forceinline__ void a_from_c_tf32(uint32_t (&a)[4], const Accumulator& c) {
  a[0] = to_tf32(c[0]);
  a[1] = to_tf32(c[2]);
  a[2] = to_tf32(c[1]);
  a[3] = to_tf32(c[3]);
}

// The B fragment for an A from a_from_c_tf32: column n0 + g over k rows k0 .. k0 + 7 in the same permuted
// order, element (k, n) at s[k ld + n] (B row by row, as V for P V).
__device__ __forceinline__ void load_b_permuted_tf32(uint32_t& b0, uint32_t& b1, const float* s, int ld, int k0,
                                                     int n0) {
  const int lane = threadIdx.x % 32;
  const float* p = s + (k0 + 2 * (lane % 4)) * ld + n0 + lane / 4;
  b0 = to_tf32(p[0]);
  b1 = to_tf32(p[ld]);
}

}  // namespace bert::cuda::mma

namespace bert::cuda::mma {

// Asynchronous copies into shared memory (cp.async, sm_80 and later): Bytes (4, 8 or 16) from global
// memory at src, or zeros where !valid (src is then not read, but must still be a valid address). A
// thread's copies since its last commit() form a group; wait<N>() returns when at most N of its groups are
// still in flight (a __syncthreads() after it makes every thread's copies visible to the block).
template <int Bytes>
__device__ __forceinline__ void copy_async(void* dst, const void* src, bool valid) {
  static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async copies 4, 8 or 16 bytes");
  const int size = valid ? Bytes : 0;
  if constexpr (Bytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src), "r"(size)
                 : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(shared_address(dst)), "l"(src), "n"(Bytes),
                 "r"(size)
                 : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace bert::cuda::mma

namespace bert::cuda::mma {

// Integer products (mma.sync m16n8k32, int8 operands, exact int32 sums; sm_80 and later). Fragments
// (lane l, g = l / 4, t = l % 4): A (16 x 32, 4 registers of four int8): a[0] row g, columns 4t .. 4t + 3;
// a[1] row g + 8, the same columns; a[2], a[3] the same rows, columns 16 + 4t .. 16 + 4t + 3. B (32 x 8,
// 2 registers): b0 k rows 4t .. 4t + 3 of column g, b1 k rows 16 + 4t .. 16 + 4t + 3. C as above (int32).
using IntAccumulator = int[4];

// d += a b (16 x 32 by 32 x 8, int32 sums).
__device__ __forceinline__ void product(IntAccumulator& d, const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four int8 values in one register, the first in the low byte.
__device__ __forceinline__ uint32_t pack_s8(int v0, int v1, int v2, int v3) {
  return (uint32_t(v0) & 0xFF) | ((uint32_t(v1) & 0xFF) << 8) | ((uint32_t(v2) & 0xFF) << 16) | (uint32_t(v3) << 24);
}

}  // namespace bert::cuda::mma
