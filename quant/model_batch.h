// The model's view of a loader batch. It lives in quant/ because quant is the first layer that sees
// both data/ and model/ (calibration reads batches); eval and train use it from here.
#pragma once

#include "data/loader.h"
#include "model/bert.h"

namespace bert::quant {

static_assert(model::kIgnoredLabel == data::kIgnoredLabel);

// Spans into `batch`, which must outlive the result.
inline model::BertBatch as_model_batch(const data::Batch& b) {
  return model::BertBatch{b.size,
                          b.seq_len,
                          b.max_predictions,
                          b.input_ids,
                          b.input_mask,
                          b.segment_ids,
                          b.masked_lm_positions,
                          b.masked_lm_ids,
                          b.next_sentence_labels,
                          b.labels};
}

}  // namespace bert::quant
