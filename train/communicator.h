// Data parallelism's collective operations, behind one interface: the trainer sums gradients and
// agrees on decisions (stop, skip a non-finite step) through it, and only rank 0 writes files.
//   SingleProcess: one rank, nothing to exchange (the default).
//   local_group(n): n ranks as threads of one process, exchanging through shared memory: the CPU
//   backend's data parallelism and the test of the rank logic without GPUs.
//   nccl_communicator (train/nccl_communicator.h): one process per GPU, through NCCL.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/device.h"

namespace bert::train {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Every rank passes a span of the same length; afterwards each holds the element-wise sum over the
  // ranks. Blocks until all ranks have called.
  virtual void all_reduce_sum(std::span<float> values) = 0;
  virtual void all_reduce_sum(std::span<double> values) = 0;
  // Replaces `count` floats in `device`'s memory (the gradients, where training runs) by their mean over
  // the ranks, queued in order with the device's other work. Host-memory communicators take the CPU only.
  virtual void all_reduce_mean(const Device& device, float* data, int64_t count) = 0;
  // The same, started after the work queued on the device so far and left running beside what is
  // queued next; finish_means() makes the device's later work wait for every mean started. Every rank
  // starts the same means in the same order. Host-memory communicators finish each one at once.
  virtual void start_mean(const Device& device, float* data, int64_t count) { all_reduce_mean(device, data, count); }
  virtual void finish_means(const Device& device) {}
};

class SingleProcess final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce_sum(std::span<float>) override {}
  void all_reduce_sum(std::span<double>) override {}
  void all_reduce_mean(const Device&, float*, int64_t) override {}
};

// `ranks` communicators sharing one exchange; give each to its own thread. The sums are taken in rank
// order, so every rank gets bit-identical results.
std::vector<std::unique_ptr<Communicator>> local_group(int ranks);

}  // namespace bert::train
