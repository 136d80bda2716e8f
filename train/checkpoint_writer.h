// CheckpointWriter: a training run's checkpoints written on a thread of their own, so the steps go on while
// the file is written (BERT-base's checkpoint, weights and AdamW moments, is 1.3 GB: seconds of writing
// and flushing to disk, against 6 s of steps between two checkpoints on a GPU at the default --save-every).
// One write at a time, each from a snapshot (store::CheckpointSnapshot) taken when the step ended.
#pragma once

#include <functional>
#include <future>
#include <string>

#include "store/checkpoint.h"

namespace bert::train {

class CheckpointWriter {
 public:
  CheckpointWriter() = default;
  // Waits for a write in progress; its error, if any, is logged (a destructor cannot throw it).
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Allocates the snapshot's buffers for `values` floats (and as many for each of the optimizer's two
  // moments) on the writer's thread, so the first snapshot copies into memory already mapped (mapping the
  // 3 GB of BERT-large's is seconds of page faults).
  void reserve(int64_t values, bool moments);
  // The snapshot to fill for the next write (store::snapshot_checkpoint), once the write before has ended
  // (waited for here; its error rethrown: a full disk, say). Its buffers are those of the last snapshot.
  store::CheckpointSnapshot& next();
  // Writes the snapshot next() gave to `path` (store::write_checkpoint: atomically) and runs `then` after
  // it, on a thread of its own: returns at once. Where the HDF5 library is not thread-safe, here, before
  // returning.
  void write(std::string path, std::function<void()> then = {});
  // Waits for the write in progress, if any, and rethrows its error.
  void wait();
  // Whether a write is in progress (or ended and not yet waited for).
  bool writing() const { return pending_.valid(); }

 private:
  store::CheckpointSnapshot snapshot_;  // read by the write in progress, filled between writes
  std::future<void> pending_;
};

}  // namespace bert::train
