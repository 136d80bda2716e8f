#include "train/checkpoint_writer.h"

#include <spdlog/spdlog.h>

#include <exception>
#include <utility>

#include "data/hdf5_io.h"

namespace bert::train {

CheckpointWriter::~CheckpointWriter() {
  if (!pending_.valid()) return;
  try {
    pending_.get();
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
  }
}

void CheckpointWriter::reserve(int64_t values, bool moments) {
  wait();
  pending_ = std::async(std::launch::async, [this, values, moments] {
    const size_t n = static_cast<size_t>(values);
    snapshot_.values.resize(n);  // (zeroed: every page touched)
    snapshot_.first.resize(moments ? n : 0);
    snapshot_.second.resize(moments ? n : 0);
  });
}

store::CheckpointSnapshot& CheckpointWriter::next() {
  wait();
  return snapshot_;
}

void CheckpointWriter::write(std::string path, std::function<void()> then) {
  wait();
  auto job = [this, path = std::move(path), then = std::move(then)] {
    store::write_checkpoint(path, snapshot_);
    if (then) then();
  };
  if (!data::hdf5::library_threadsafe()) return job();
  pending_ = std::async(std::launch::async, std::move(job));
}

void CheckpointWriter::wait() {
  if (pending_.valid()) pending_.get();  // (leaves pending_ empty, also when it throws)
}

}  // namespace bert::train
