#include "eval/fill_mask.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "sys/error.h"

namespace bert::eval {

std::vector<MaskPrediction> fill_mask(model::Bert& model, const tokenizer::Tokenizer& tokenizer,
                                      const std::string& text, int top_k, Graph<float>& g) {
  const tokenizer::SpecialTokens& sp = tokenizer.specials();
  // The tokenizer matches "[MASK]" itself. SentencePiece puts a lone word-start piece before it, but in
  // training a masked word's own word-start piece was what [MASK] replaced: drop that lone piece.
  std::vector<int32_t> ids{sp.cls};
  for (int32_t id : tokenizer.encode(text)) {
    if (id == sp.mask && ids.size() > 1 && tokenizer.piece(ids.back()) == "\xE2\x96\x81") ids.pop_back();
    ids.push_back(id);
  }
  ids.push_back(sp.sep);
  const int64_t t = static_cast<int64_t>(ids.size());
  if (t > model.config().max_position_embeddings)
    throw UserError("--fill-mask text is " + std::to_string(t) + " tokens, longer than the model's " +
                    std::to_string(model.config().max_position_embeddings));
  std::vector<int32_t> positions;
  for (int32_t i = 0; i < t; ++i)
    if (ids[i] == sp.mask) positions.push_back(i);
  if (positions.empty()) throw UserError("--fill-mask text holds no [MASK]");

  std::vector<int8_t> mask(t, 1), types(t, 0);
  std::vector<int32_t> masked_ids(positions.size(), 0);
  BatchView batch{1, t, static_cast<int64_t>(positions.size()), ids, mask, types, positions, masked_ids, {}, {}, {}};
  NoGradGuard<float> no_grad(g);
  Rng unused(0);
  model::ModelOutputs out = model.forward(g, batch, false, unused);
  const int64_t v = g.shape(out.mlm_logits)[1];
  const std::vector<float> logits = g.to_host(out.mlm_logits);
  std::vector<MaskPrediction> result;
  for (size_t m = 0; m < positions.size(); ++m) {
    const float* row = logits.data() + m * v;
    const float max = *std::max_element(row, row + v);
    double total = 0;
    for (int64_t j = 0; j < v; ++j) total += std::exp(double(row[j]) - max);
    std::vector<int32_t> order(v);
    std::iota(order.begin(), order.end(), 0);
    const int k = std::min<int>(top_k, static_cast<int>(v));
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int32_t a, int32_t b) { return row[a] > row[b]; });
    MaskPrediction p;
    p.position = positions[m];
    for (int i = 0; i < k; ++i)
      p.candidates.emplace_back(tokenizer.piece(order[i]), std::exp(double(row[order[i]]) - max) / total);
    result.push_back(std::move(p));
  }
  g.clear();
  return result;
}

}  // namespace bert::eval
