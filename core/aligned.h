// AlignedAllocator: a std::allocator replacement that returns 64-byte-aligned storage (a cache line,
// one AVX-512 vector), for buffers that vector loops and the optimizer sweep.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace bert {

template <typename T, std::size_t Alignment = 64>
struct AlignedAllocator {
  using value_type = T;
  template <typename U>
  struct rebind {
    using other = AlignedAllocator<U, Alignment>;
  };
  AlignedAllocator() = default;
  template <typename U>
  AlignedAllocator(const AlignedAllocator<U, Alignment>&) {}

  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(Alignment))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(Alignment)); }
  bool operator==(const AlignedAllocator&) const { return true; }
};

template <typename T>
using AlignedVector = std::vector<T, AlignedAllocator<T>>;

}  // namespace bert
