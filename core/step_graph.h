// StepGraph: a training step's work (or an evaluation batch's forward pass) on a GPU recorded from the
// device's stream and launched as one CUDA graph. Launched op by op, the GPU waits between kernels for each
// launch to arrive (about 1.7 us each, 500 kernels a BERT-base step); as one graph the driver hands them
// over together. Each step is recorded afresh (its kernels' arguments differ: dropout seeds, batch data,
// learning rate), and the executable graph made from the first recording is updated in place from each
// later one with the same nodes; a step of another shape makes a new one. On the CPU, record() and
// launch() do nothing.
//
// While recording, nothing runs: the host must not wait for the stream (a read-back that waits, a
// synchronise) until launch(). Memory allocated meanwhile is usable at once; memory freed meanwhile is
// released after the graph.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/device.h"

namespace bert {

class StepGraph {
 public:
  StepGraph() = default;
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // Starts recording the work queued on `device` (a CUDA device; nothing happens on the CPU).
  void record(const Device& device);
  // Ends the recording and launches it. The executable graph is updated from the recording where `key`
  // (the caller's description of the step: its shapes) is the last recording's and no device memory has been
  // allocated or freed since (the recording then differs from the last in its kernels' arguments alone);
  // elsewhere it is made afresh. Without a recording, nothing.
  void launch(const std::vector<int64_t>& key);
  // Ends a recording without running it (the step threw); nothing if none is under way.
  void abandon() noexcept;
  // Whether to record the next run of work described by `key` (its shapes): not before two runs of that
  // key ran op by op (their memory is then in place), and not any more once more than one launch in five
  // (of at least 50) has made a new executable graph, which costs more than it saves (`stopped` then says
  // why, once, for the caller to tell).
  bool schedule(const std::vector<int64_t>& key, std::string& stopped);
  bool recording() const { return recording_ != nullptr; }

  int64_t launches() const { return launches_; }
  int64_t instantiations() const { return instantiations_; }  // launches that made a new executable graph

 private:
  const Device* recording_ = nullptr;  // the device being recorded
  const Device* device_ = nullptr;     // the device exec_ belongs to
  void* exec_ = nullptr;               // the executable graph (cudaGraphExec_t)
  std::vector<int64_t> key_;           // its recording's key, then the device's count of memory events
  int64_t launches_ = 0, instantiations_ = 0;
  std::vector<int64_t> last_key_;  // schedule(): the last key asked about, how many runs in a row had it
  int64_t same_key_runs_ = 0;
  bool off_ = false;
};

}  // namespace bert
