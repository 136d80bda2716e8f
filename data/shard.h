// HDF5 shards in the layout of NVIDIA DeepLearningExamples' BERT (docs/data.md):
//   input_ids int32 [N, L]; input_mask int8 [N, L]; segment_ids int8 [N, L];
//   masked_lm_positions int32 [N, P]; masked_lm_ids int32 [N, P]; next_sentence_labels int8 [N]
// gzip-compressed. Our shards also carry root attributes (vocab_size, tokenizer_sha256, max_seq_len,
// max_predictions_per_seq, seed); shards from other tools in the same layout read fine without them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "data/examples.h"

namespace bert::data {

struct ShardMetadata {
  int64_t vocab_size = 0;
  std::string tokenizer_sha256;
  int64_t max_seq_len = 0;
  int64_t max_predictions = 0;
  uint64_t seed = 0;
};

struct Shard {
  int64_t size = 0;             // N
  int64_t seq_len = 0;          // L
  int64_t max_predictions = 0;  // P
  std::vector<int32_t> input_ids, masked_lm_positions, masked_lm_ids;
  std::vector<int8_t> input_mask, segment_ids, next_sentence_labels;
  std::optional<ShardMetadata> metadata;  // absent in shards written by other tools

  Shard() = default;
  Shard(int64_t seq_len, int64_t max_predictions) : seq_len(seq_len), max_predictions(max_predictions) {}
  void append(const Example& example);  // pads with zeros
  void clear();
};

// Writes atomically (temporary file, then rename). Throws UserError naming the path on failure.
void write_shard(const std::string& path, const Shard& shard);

// Reads and validates the layout: every dataset present with its dtype and a consistent shape, token
// ids non-negative and below vocab_size when the shard records it. Throws UserError naming the file,
// the dataset, what was expected and what was found.
Shard read_shard(const std::string& path);

// Checks that a shard fits a model/tokenizer: seq_len <= max_len, ids < vocab_size and (when both are
// known) the same tokenizer. Throws UserError naming the file.
void check_shard_compatible(const Shard& shard, const std::string& path, int64_t vocab_size, int64_t max_seq_len,
                            const std::string& tokenizer_sha256);

}  // namespace bert::data
