#include "core/step_graph.h"

#include "sys/error.h"
#if BERT_WITH_CUDA
#include "core/cuda/context.h"
#endif

namespace bert {

StepGraph::~StepGraph() {
  abandon();
#if BERT_WITH_CUDA
  cuda::destroy_graph(exec_);
#endif
}

void StepGraph::record(const Device& device) {
  BERT_CHECK(!recording_, "StepGraph::record: a recording is under way");
  if (!device.is_cuda()) return;
#if BERT_WITH_CUDA
  if (device_ && device_ != &device) {  // a graph of another device cannot be updated
    cuda::destroy_graph(exec_);
    exec_ = nullptr;
  }
  cuda::begin_capture(*device.cuda_context());
  recording_ = device_ = &device;
#endif
}

void StepGraph::launch(const std::vector<int64_t>& key) {
  if (!recording_) return;
#if BERT_WITH_CUDA
  CudaContext& c = *recording_->cuda_context();
  recording_ = nullptr;
  std::vector<int64_t> full = key;
  full.push_back(static_cast<int64_t>(c.memory_events));
  if (full != key_) {  // another shape, or memory moved: a graph of its own
    cuda::destroy_graph(exec_);
    exec_ = nullptr;
  }
  if (cuda::end_capture_and_launch(c, exec_)) ++instantiations_;
  key_ = std::move(full);
  ++launches_;
#else
  (void)key;
#endif
}

bool StepGraph::schedule(const std::vector<int64_t>& key, std::string& stopped) {
  if (off_) return false;
  same_key_runs_ = key == last_key_ ? same_key_runs_ + 1 : 0;
  last_key_ = key;
  if (same_key_runs_ < 2) return false;
  if (launches_ >= 50 && instantiations_ * 5 > launches_) {
    off_ = true;
    stopped = std::to_string(instantiations_) + " of " + std::to_string(launches_) +
              " recorded as CUDA graphs needed a graph of their own (their memory moved)";
    return false;
  }
  return true;
}

void StepGraph::abandon() noexcept {
  if (!recording_) return;
#if BERT_WITH_CUDA
  cuda::abandon_capture(*recording_->cuda_context());
#endif
  recording_ = nullptr;
}

}  // namespace bert
