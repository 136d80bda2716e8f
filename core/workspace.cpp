#include "core/workspace.h"

#include <algorithm>
#include <cstdint>

namespace bert {

namespace {
std::size_t round_up(std::size_t n, std::size_t a) { return (n + a - 1) / a * a; }
}  // namespace

Workspace::Workspace(std::size_t initial_bytes, const Device& device) : device_(&device) {
  if (initial_bytes > 0) add_block(initial_bytes);
}

void Workspace::add_block(std::size_t bytes) {
  Block b;
  b.size = round_up(bytes, kAlignment);
  b.memory = DeviceBuffer(*device_, b.size);
  b.begin = b.memory.as<std::byte>();
  blocks_.push_back(std::move(b));
  ++system_allocations_;
}

void* Workspace::allocate_bytes(std::size_t bytes) {
  bytes = round_up(bytes == 0 ? 1 : bytes, kAlignment);
  if (blocks_.empty() || blocks_.back().size - blocks_.back().used < bytes) {
    // Grow by an eighth of what is held (at least 1 MiB), not by doubling: on a GPU the merged block
    // below is what stays allocated, so over-allocation costs device memory.
    const std::size_t grow = std::max(std::size_t{1} << 20, capacity() / 8);
    add_block(bytes > grow ? bytes : grow);
  }
  Block& b = blocks_.back();
  void* p = b.begin + b.used;
  b.used += bytes;
  in_use_ += bytes;
  peak_in_use_ = std::max(peak_in_use_, in_use_);
  return p;
}

void Workspace::reset() {
  if (blocks_.size() > 1) {  // one block for the whole cycle, with headroom for a slightly larger one
    const std::size_t total = in_use_ + std::min(in_use_ / 16, kMaxHeadroom);
    blocks_.clear();
    add_block(total);
  }
  for (Block& b : blocks_) b.used = 0;
  in_use_ = 0;
}

std::size_t Workspace::capacity() const {
  std::size_t total = 0;
  for (const Block& b : blocks_) total += b.size;
  return total;
}

}  // namespace bert
