// Readback: device values the host reads after it has queued more work. read() queues a copy into host
// memory the device writes without the host waiting for it (pinned, on a GPU) and says where the values
// will be; wait() then waits once for every copy queued so far, not for the work queued after them.
// A training step queues its losses and predictions before its backward pass and reads them once the
// backward pass and the gradient norm are queued: the GPU runs the step without stopping for the host.
// On the CPU, read() copies at once and wait() does nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

#include "core/device.h"

namespace bert {

class Readback {
 public:
  explicit Readback(const Device& device);
  ~Readback();
  Readback(const Readback&) = delete;
  Readback& operator=(const Readback&) = delete;

  // Queues a copy of n elements of U from device memory of this device; the values are there after wait()
  // and until clear().
  template <typename U>
  const U* read(const void* on_device, std::size_t n) {
    return static_cast<const U*>(read_bytes(on_device, n * sizeof(U)));
  }
  const void* read_bytes(const void* on_device, std::size_t bytes);
  // Marks the end of this round's copies on the device: wait() then waits for the copies queued before
  // this call, not for the work queued after it (a training step queued ahead of the one being read).
  // Without it, wait() waits for everything queued until it is called.
  void seal();
  // Waits for every copy queued since the last wait() (a no-op when none is).
  void wait();
  bool waited() const { return pending_ == 0; }
  // Forgets the values read (their pointers become invalid); memory is kept for the next round, grown
  // to what this one needed.
  void clear();

 private:
  const Device& device_;
  void* pinned_ = nullptr;  // capacity_ bytes (host memory on the CPU)
  std::size_t capacity_ = 0, used_ = 0, needed_ = 0;
  std::size_t pending_ = 0;  // copies queued since the last wait()
  bool sealed_ = false;      // event_ recorded after them (seal())
  void* event_ = nullptr;    // a CUDA event recorded after the copies
  // The CPU's reads (copied at once), kept here until clear().
  std::deque<std::vector<std::byte>> overflow_;
  // On a GPU, reads beyond the capacity this round: pinned memory of their own until clear().
  std::vector<void*> extra_pinned_;
};

}  // namespace bert
