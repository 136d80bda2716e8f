// fill_mask: the model's top-k tokens for each [MASK] in a piece of text.
#pragma once

#include <string>
#include <vector>

#include "core/graph.h"
#include "model/bert.h"
#include "tokenizer/tokenizer.h"

namespace bert::eval {

struct MaskPrediction {
  int32_t position = 0;                                    // in [CLS] text [SEP]
  std::vector<std::pair<std::string, double>> candidates;  // (token piece, probability), best first
};

// Tokenizes `text` ("[MASK]" marks the positions to fill) as [CLS] text [SEP] and returns the top_k
// predictions for each mask. UserError if the text holds no [MASK].
std::vector<MaskPrediction> fill_mask(model::Bert& model, const tokenizer::Tokenizer& tokenizer,
                                      const std::string& text, int top_k, Graph<float>& g);

}  // namespace bert::eval
