#include "train/gradient_reduction.h"

#include "sys/error.h"

namespace bert::train {

GradientReduction::GradientReduction(ParameterArena<float>& params, Communicator& ranks, const Device& device,
                                     int64_t bucket_bytes)
    : params_(params), ranks_(ranks), device_(device) {
  const int64_t bucket_floats = std::max<int64_t>(1, bucket_bytes / int64_t(sizeof(float)));
  const int64_t total = params.device_grads().numel();
  float* const base = params.device_grads().data();
  bucket_of_.resize(params.size());
  for (ParamId id = 0; id < params.size(); ++id) {
    const int64_t begin = params.offset(id);
    if (buckets_.empty() || buckets_.back().end - buckets_.back().begin >= bucket_floats)
      buckets_.push_back(Bucket{begin, begin, 0});
    bucket_of_[id] = static_cast<int>(buckets_.size() - 1);
    by_start_[base + begin] = id;
    // The bucket runs to the next parameter's start (the padding between them is zero on every rank).
    buckets_.back().end = id + 1 < params.size() ? params.offset(id + 1) : total;
  }
  if (!buckets_.empty()) buckets_.front().begin = 0;
  waited_for_.assign(params.size(), false);
}

void GradientReduction::expect(const Graph<float>& g) {
  for (Bucket& b : buckets_) b.waiting = 0;
  std::fill(waited_for_.begin(), waited_for_.end(), false);
  for (const TensorView<float>& grad : g.leaf_gradients()) {
    const auto it = by_start_.find(grad.data());
    if (it == by_start_.end()) continue;
    BERT_CHECK(grad.numel() == params_.shape(it->second).numel(),
               "a leaf covers part of parameter '" + params_.name(it->second) + "'");
    waited_for_[it->second] = true;
    ++buckets_[bucket_of_[it->second]].waiting;
  }
  next_ = num_buckets() - 1;
  started_early_ = 0;
  finishing_ = false;
  start_ready();  // buckets whose parameters the graph does not use
}

void GradientReduction::on_final(TensorView<float> grad) {
  const auto it = by_start_.find(grad.data());
  if (it == by_start_.end() || !waited_for_[it->second]) return;
  waited_for_[it->second] = false;
  Bucket& b = buckets_[bucket_of_[it->second]];
  BERT_CHECK(b.waiting > 0 && bucket_of_[it->second] <= next_,
             "gradient of '" + params_.name(it->second) + "' completed after its bucket started");
  --b.waiting;
  start_ready();
}

void GradientReduction::start_ready() {
  float* const base = params_.device_grads().data();
  while (next_ >= 0 && (finishing_ || buckets_[next_].waiting == 0)) {
    const Bucket& b = buckets_[next_];
    ranks_.start_mean(device_, base + b.begin, b.end - b.begin);
    if (!finishing_) ++started_early_;
    --next_;
  }
}

void GradientReduction::finish() {
  finishing_ = true;
  start_ready();
  ranks_.finish_means(device_);
}

}  // namespace bert::train
