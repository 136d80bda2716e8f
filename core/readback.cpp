#include "core/readback.h"

#include <algorithm>
#include <cstring>

#include "sys/error.h"
#if BERT_WITH_CUDA
#include "core/cuda/context.h"
#endif

namespace bert {

namespace {
constexpr std::size_t kAlign = 64;
std::size_t round_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
constexpr std::size_t kInitialCapacity = std::size_t{64} << 10;
}  // namespace

Readback::Readback(const Device& device) : device_(device) {
#if BERT_WITH_CUDA
  if (device_.is_cuda()) {
    pinned_ = cuda::allocate_pinned(kInitialCapacity);
    event_ = cuda::create_event();
    capacity_ = kInitialCapacity;
  }
#endif
}

Readback::~Readback() {
#if BERT_WITH_CUDA
  if (device_.is_cuda()) {
    for (void* p : extra_pinned_) cuda::free_pinned(p);
    cuda::free_pinned(pinned_);
    cuda::destroy_event(event_);
  }
#endif
}

const void* Readback::read_bytes(const void* on_device, std::size_t bytes) {
  needed_ += round_up(bytes);
  if (!device_.is_cuda()) {  // the CPU: its memory is the host's, a copy now
    overflow_.emplace_back(std::max<std::size_t>(bytes, 1));
    device_.copy_to_host(overflow_.back().data(), on_device, bytes);
    return overflow_.back().data();
  }
  void* to = nullptr;
#if BERT_WITH_CUDA
  if (used_ + round_up(bytes) > capacity_) {
    // Beyond this round's pinned memory: pinned memory of its own until clear(), copied into without
    // waiting as well (the stream may be being recorded: core/step_graph.h).
    to = extra_pinned_.emplace_back(cuda::allocate_pinned(bytes));
  } else {
    to = static_cast<std::byte*>(pinned_) + used_;
    used_ += round_up(bytes);
  }
  cuda::copy_to_host_async(*device_.cuda_context(), to, on_device, bytes);
#endif
  ++pending_;
  sealed_ = false;  // (a copy after seal(): wait() records the event again)
  return to;
}

void Readback::seal() {
  if (pending_ == 0 || sealed_) return;
#if BERT_WITH_CUDA
  cuda::record_event(*device_.cuda_context(), event_);
#endif
  sealed_ = true;
}

void Readback::wait() {
  if (pending_ == 0) return;
  seal();
#if BERT_WITH_CUDA
  cuda::wait_event(event_);
#endif
  pending_ = 0;
  sealed_ = false;
}

void Readback::clear() {
  BERT_CHECK(pending_ == 0, "Readback::clear() with copies still queued (wait() first)");
  overflow_.clear();
#if BERT_WITH_CUDA
  for (void* p : extra_pinned_) cuda::free_pinned(p);
  extra_pinned_.clear();
  if (device_.is_cuda() && needed_ > capacity_) {
    cuda::free_pinned(pinned_);
    capacity_ = needed_ + needed_ / 4;
    pinned_ = cuda::allocate_pinned(capacity_);
  }
#endif
  used_ = needed_ = 0;
}

}  // namespace bert
