// HDF5 shards in the layout of NVIDIA DeepLearningExamples' BERT (docs/data.md):
//   input_ids int32 [N, L]; input_mask int8 [N, L]; segment_ids int8 [N, L];
//   masked_lm_positions int32 [N, P]; masked_lm_ids int32 [N, P]; next_sentence_labels int8 [N]
// gzip-compressed. Our shards also carry root attributes (vocab_size, tokenizer_sha256, max_seq_len,
// max_predictions_per_seq, seed); shards from other tools in the same layout read fine without them.
//
// Task shards (fine-tuning) hold input_ids, input_mask and segment_ids as above and, instead of the
// pretraining datasets, labels int32: [N] for sequence classification, [N, L] for token classification
// (-100 where no label applies: padding, [CLS]/[SEP], a word's continuation pieces), [N, 2] for extractive
// question answering (the answer's first and last token; 0, 0, the [CLS] token, where the window holds no
// answer); or, for sequence regression (a similarity score, a relevance score), labels float32 [N], each a
// finite number, and optionally groups int32 [N] (each example's group, a query whose passages a reranker ranks,
// numbered from 0 in the shard). Root attributes "task" (seq-cls, token-cls, qa or seq-reg) and "label_names" (a JSON
// array: label i's name; for qa "start", "end"; for seq-reg the score's, one) describe them; a qa shard made here also
// records how its windows were cut
// ("doc_stride", "max_query_len"), so that its questions can be windowed again for scoring answers.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/batch.h"
#include "data/examples.h"
#include "sys/enum_names.h"

namespace bert::data {

struct ShardMetadata {
  int64_t vocab_size = 0;
  std::string tokenizer_sha256;
  int64_t max_seq_len = 0;
  int64_t max_predictions = 0;
  uint64_t seed = 0;
};

enum class ShardKind { kPretraining, kSequenceLabels, kTokenLabels, kSpanLabels, kSequenceScores };
inline constexpr EnumNames<ShardKind, 5> kShardKindNames{{{{ShardKind::kPretraining, "pretraining"},
                                                           {ShardKind::kSequenceLabels, "seq-cls"},
                                                           {ShardKind::kTokenLabels, "token-cls"},
                                                           {ShardKind::kSpanLabels, "qa"},
                                                           {ShardKind::kSequenceScores, "seq-reg"}}}};
// The labels a task example holds: one (seq-cls), one per token (token-cls), or a span's start and end (qa);
// a seq-reg example holds one score instead (Shard::scores).
inline int64_t label_width(ShardKind kind, int64_t seq_len) {
  return kind == ShardKind::kTokenLabels ? seq_len : kind == ShardKind::kSpanLabels ? 2 : 1;
}

struct Shard {
  ShardKind kind = ShardKind::kPretraining;
  int64_t size = 0;             // N
  int64_t seq_len = 0;          // L
  int64_t max_predictions = 0;  // P
  std::vector<int32_t> input_ids, masked_lm_positions, masked_lm_ids;
  std::vector<int8_t> input_mask, segment_ids, next_sentence_labels;
  std::vector<int32_t> labels;            // task shards: (N), (N, L) or (N, 2); empty for seq-reg
  std::vector<float> scores;              // seq-reg shards: (N)
  std::vector<int32_t> groups;            // seq-reg shards: (N) each example's group, or empty
  std::vector<std::string> label_names;   // task shards: the name of each label id
  int64_t doc_stride = 0, max_query_len = 0;  // qa shards made here (data/task_data.h); 0: not recorded
  std::optional<ShardMetadata> metadata;  // absent in shards written by other tools

  Shard() = default;
  Shard(int64_t seq_len, int64_t max_predictions) : seq_len(seq_len), max_predictions(max_predictions) {}
  bool is_task() const { return kind != ShardKind::kPretraining; }
  int64_t label_width() const { return data::label_width(kind, seq_len); }
  void append(const Example& example);  // pads with zeros
  // Task shards: one sequence (at most seq_len tokens) and its label(s): one label, one per token, or a span.
  void append_labeled(std::span<const int32_t> tokens, std::span<const int8_t> segment_ids,
                      std::span<const int32_t> labels);
  // Sequence regression shards: one sequence and its score (finite), and its group (>= 0) or -1 for none (a
  // shard's examples all have one or none do).
  void append_scored(std::span<const int32_t> tokens, std::span<const int8_t> segment_ids, float score,
                     int32_t group = -1);
  void clear();

 private:
  void append_tokens(std::span<const int32_t> tokens, std::span<const int8_t> segment_ids);
};

// "seq-cls" / "token-cls" / "qa" / "seq-reg" for task shards, "pretraining" otherwise.
std::string shard_kind_name(ShardKind kind);

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
