// ShardLoader: streams batches from many shards, shuffled, with bounded memory (the shard being served and
// the next one, read in the background). Order is a pure function of (seed, epoch): shards are visited in a
// permuted order each epoch and a shard's examples in a permuted order, so State (epoch, shard, example) is
// all a resumed run needs.
#pragma once

#include <cstdint>
#include <future>
#include <string>
#include <vector>

#include "core/batch.h"
#include "data/shard.h"

namespace bert::data {

struct LoaderOptions {
  std::vector<std::string> shards;
  int64_t batch_size = 32;  // per rank
  // Data parallelism: the loader walks the order a single process would see with global batches of
  // batch_size * world_size examples, and returns the rank's consecutive slice of each. The union over
  // the ranks is exactly the single-process global batch, and State is the same on every rank.
  int rank = 0, world_size = 1;
  uint64_t seed = 1;
  bool shuffle = true;
  bool repeat = true;  // training: cycle over epochs; evaluation: one pass (last batch may be short)
  // The next shard in the order (this epoch's next, or the next epoch's first) read on a thread of its own
  // while the current one is served, so next() does not stop at a shard boundary for the read (a 65,536-
  // example shard: about 0.2 s of HDF5 decompression, against a BERT-base step of 12 ms on a GPU). The
  // same batches either way; off, each shard is read when it is reached. Off where the HDF5 library is not
  // thread-safe (Debian's is).
  bool prefetch = true;
};

class ShardLoader {
 public:
  struct State {
    uint64_t epoch = 0;
    int64_t shard = 0;    // position in this epoch's shard order
    int64_t example = 0;  // position in that shard's example order
    bool operator==(const State&) const = default;
  };

  explicit ShardLoader(LoaderOptions options);

  // Fills `batch`; false when a non-repeating loader has nothing left.
  bool next(Batch& batch);
  State state() const { return state_; }
  void restore(State state);  // continue exactly where `state` was taken
  // Layout of the first shard (all shards must agree); its metadata if it has any.
  int64_t seq_len() const { return seq_len_; }
  int64_t max_predictions() const { return max_predictions_; }
  ShardKind kind() const { return kind_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  bool grouped() const { return grouped_; }  // seq-reg shards whose examples have groups
  const std::optional<ShardMetadata>& metadata() const { return metadata_; }
  // The shard being read ahead (an index into LoaderOptions::shards), -1 when none is.
  int64_t reading_ahead() const { return ahead_.valid() ? ahead_index_ : -1; }

 private:
  void load_current_shard();
  // Starts reading the shard after the current one in the background (see LoaderOptions::prefetch).
  void prefetch_next();
  std::vector<int64_t> permutation(int64_t n, uint64_t stream) const;

  LoaderOptions options_;
  State state_;
  std::vector<int64_t> shard_order_;
  Shard shard_;
  std::vector<int64_t> example_order_;
  int64_t loaded_ = -1;  // index into options_.shards of the shard in memory
  int64_t seq_len_ = 0, max_predictions_ = 0;
  ShardKind kind_ = ShardKind::kPretraining;
  std::vector<std::string> label_names_;
  bool grouped_ = false;  // seq-reg shards with groups
  std::optional<ShardMetadata> metadata_;
  // The shard being read ahead: its index into options_.shards (-1: none) and the read, whose errors
  // surface only if that shard is reached.
  int64_t ahead_index_ = -1;
  std::future<Shard> ahead_;
};

// Checks the loader's shards (their recorded metadata, if any) against a model and tokenizer: see
// check_shard_compatible. Returns false when the shards carry no metadata (nothing could be checked).
bool check_loader_compatible(const ShardLoader& loader, const std::string& first_shard, int64_t vocab_size,
                             int64_t max_seq_len, const std::string& tokenizer_sha256);

// Expands folders into their *.hdf5 / *.h5 files (sorted); files pass through. UserError if empty.
std::vector<std::string> expand_shard_paths(const std::vector<std::string>& paths);

}  // namespace bert::data
