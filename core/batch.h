// A batch of examples in the shard layout (NVIDIA's BERT HDF5 fields), row-major. The loader fills a
// Batch; the model reads a BatchView, of a Batch or of any buffers the caller holds. B batch, T sequence,
// P max predictions.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace bert {

// The label of a token that carries none (Hugging Face's ignore index).
inline constexpr int32_t kIgnoredLabel = -100;

struct BatchView {
  int64_t batch = 0, seq_len = 0, max_predictions = 0;
  std::span<const int32_t> input_ids;            // (B, T)
  std::span<const int8_t> attention_mask;        // (B, T): 1 real token, 0 padding
  std::span<const int8_t> token_type_ids;        // (B, T): segment A 0, B 1
  std::span<const int32_t> masked_positions;     // (B, P): 0-padded (the first 0 ends a row's list)
  std::span<const int32_t> masked_ids;           // (B, P): original tokens there
  std::span<const int8_t> next_sentence_labels;  // (B) or empty: 1 = random next
  // Task heads: (B) sequence labels, (B, T) token labels (kIgnoredLabel where none) or (B, 2) answer spans
  // (start, end positions); or empty.
  std::span<const int32_t> labels;
  std::span<const float> scores;  // sequence regression: (B) target scores; or empty
  // Sequence regression: (B) each sequence's group (a query whose passages are ranked), unique over the
  // loader's shards; or empty.
  std::span<const int64_t> groups = {};
};

// Owns its arrays: input_ids etc. (B, T); masked_lm_* (B, P); next_sentence_labels (B); for task
// shards labels (B), (B, T) or (B, 2), or scores (B) for sequence regression, and no pretraining arrays.
struct Batch {
  int64_t size = 0, seq_len = 0, max_predictions = 0;
  std::vector<int32_t> input_ids, masked_lm_positions, masked_lm_ids;
  std::vector<int8_t> input_mask, segment_ids, next_sentence_labels;
  std::vector<int32_t> labels;
  std::vector<float> scores;
  std::vector<int64_t> groups;

  // Spans into this batch, valid while it lives unchanged.
  BatchView view() const {
    return {size,
            seq_len,
            max_predictions,
            input_ids,
            input_mask,
            segment_ids,
            masked_lm_positions,
            masked_lm_ids,
            next_sentence_labels,
            labels,
            scores,
            groups};
  }
};

}  // namespace bert
