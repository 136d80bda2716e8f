// Rows in registers, shared by the softmax and LayerNorm kernels (ops/softmax.cu, ops/layer_norm.cu): one
// warp a row, lane l holding elements (c 32 + l) 4 + w (w < 4) of chunk c < C (128 columns a chunk).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <type_traits>

namespace bert::ops::cuda_impl {

constexpr int kWarpsPerBlock = 8;
inline unsigned row_blocks(int64_t rows) { return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock); }

// Runs `launch` with the register kernels' C for rows of k (k <= 1024, a multiple of 4); false where they do
// not apply (the one-pass-per-element kernels above run instead).
template <typename Launch>
bool with_row_chunks(int64_t k, std::initializer_list<const void*> pointers, Launch&& launch) {
  if (k % 4 != 0 || k > 1024) return false;
  for (const void* p : pointers)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  // Registers for the row's chunks only (BERT's widths: 128, 256, 384, 512, 768, 1024).
  const int64_t chunks = (k + 127) / 128;
  if (chunks <= 1)
    launch(std::integral_constant<int, 1>{});
  else if (chunks <= 2)
    launch(std::integral_constant<int, 2>{});
  else if (chunks <= 3)
    launch(std::integral_constant<int, 3>{});
  else if (chunks <= 4)
    launch(std::integral_constant<int, 4>{});
  else if (chunks <= 6)
    launch(std::integral_constant<int, 6>{});
  else
    launch(std::integral_constant<int, 8>{});
  return true;
}

// f(std::true_type{}) where rows of k fill their C chunks (k = 128 C: every BERT width), so that a kernel
// compiled for it knows k and skips the per-pack bounds tests; else f(std::false_type{}).
template <int C, typename F>
void with_full_rows(int64_t k, F&& f) {
  if (k == int64_t{C} * 128)
    f(std::true_type{});
  else
    f(std::false_type{});
}

}  // namespace bert::ops::cuda_impl
