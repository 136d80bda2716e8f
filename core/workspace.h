// Workspace: a bump allocator for one graph's activations, gradients and saved tensors. reset()
// releases everything at once and keeps the memory, so a training loop that builds the same graph
// every step stops allocating after the first step. Its memory lives on the device it was given (host
// memory for the CPU): on a GPU, after the first step, no cudaMalloc either.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "core/device.h"

namespace bert {

class Workspace {
 public:
  static constexpr std::size_t kAlignment = 64;  // one cache line; whole AVX-512 vectors

  explicit Workspace(std::size_t initial_bytes = 0, const Device& device = Device::cpu());
  const Device& device() const { return *device_; }

  // Uninitialised, kAlignment-aligned storage for n objects of trivial type U, valid until reset().
  template <typename U>
  U* allocate(std::size_t n) {
    return static_cast<U*>(allocate_bytes(n * sizeof(U)));
  }
  void* allocate_bytes(std::size_t bytes);

  // Frees every allocation. If the last cycle needed more than one block, they are replaced by one
  // block of what the cycle used plus 1/16 (at most kMaxHeadroom), so the next cycle of the same size,
  // or slightly larger (a batch with more masked positions), fits without allocating. The headroom is
  // capped because it is device memory held for good: 1/16 of a BERT-base FP32 step's 6.5 GiB was
  // 0.4 GiB, where what varies between a training run's batches is a few MiB.
  static constexpr std::size_t kMaxHeadroom = std::size_t{64} << 20;
  void reset();

  std::size_t bytes_in_use() const { return in_use_; }
  // The most bytes_in_use() has been since the workspace was made (over every cycle).
  std::size_t peak_bytes_in_use() const { return peak_in_use_; }
  std::size_t capacity() const;
  std::size_t system_allocations() const { return system_allocations_; }  // for tests and logs

 private:
  struct Block {
    DeviceBuffer memory;  // aligned by the device's allocator
    std::byte* begin = nullptr;
    std::size_t size = 0;
    std::size_t used = 0;
  };
  void add_block(std::size_t bytes);

  const Device* device_;
  std::vector<Block> blocks_;
  std::size_t in_use_ = 0;
  std::size_t peak_in_use_ = 0;
  std::size_t system_allocations_ = 0;
};

}  // namespace bert
