// Averaging the gradients over data-parallel ranks in buckets that start while the backward pass is
// still running: a bucket (consecutive parameters of the arena, about `bucket_bytes`) starts its
// all-reduce as soon as the graph reports every gradient in it final (Graph::backward's on_final), so
// the exchange of the last layers' gradients overlaps the backward pass of the first layers. Buckets
// start in a fixed order (from the end of the arena), the same on every rank whatever the timing.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "core/arena.h"
#include "core/graph.h"
#include "train/communicator.h"

namespace bert::train {

class GradientReduction {
 public:
  GradientReduction(ParameterArena<float>& params, Communicator& ranks, const Device& device,
                    int64_t bucket_bytes = int64_t{16} << 20);

  // Before the backward pass that completes the step's gradients: each bucket waits for the gradients
  // `g` will write (its parameters that are leaves of the graph); a bucket with none is ready at once.
  void expect(const Graph<float>& g);
  // Graph::backward's on_final: `grad` is complete (a parameter's gradient, or another leaf's: ignored).
  void on_final(TensorView<float> grad);
  // Starts the buckets not started yet, in order, and makes the device's later work wait for all.
  void finish();

  int64_t num_buckets() const { return static_cast<int64_t>(buckets_.size()); }
  // Buckets started during the last backward pass, before finish() (how much overlapped).
  int64_t started_early() const { return started_early_; }

 private:
  struct Bucket {
    int64_t begin = 0, end = 0;  // elements of the flat gradient buffer
    int waiting = 0;             // parameters whose gradient is not final yet
  };
  void start_ready();

  ParameterArena<float>& params_;
  Communicator& ranks_;
  const Device& device_;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_;                          // by parameter id
  std::unordered_map<const float*, ParamId> by_start_;  // a parameter's gradient buffer -> its id
  std::vector<bool> waited_for_;                        // by parameter id, this step
  int64_t next_ = -1;                                   // the next bucket to start (they start from the last)
  int64_t started_early_ = 0;
  bool finishing_ = false;
};

}  // namespace bert::train
