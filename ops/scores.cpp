// Scoring a vocabulary-wide linear layer without its output, on the CPU: the product made tile by tile
// (kernels/output_tiles.h) and each tile reduced to softmax statistics while in cache. Forward only. On a
// GPU the op is ops/matmul.cu's (the GEMM's output scored in place, with gradients).
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>
#include "core/source_location.h"

#include "kernels/gemm.h"
#include "kernels/int8_gemm.h"
#include "kernels/vector_math.h"
#include "ops/ops.h"
#include "sys/parallel.h"

#if BERT_WITH_CUDA
#include "ops/cuda_impl.h"
#endif

namespace bert::ops {

namespace {

// Output tiles: rows a thread keeps while it sweeps its columns, and columns per tile. A float tile of
// 128 x 512 (256 KB) and its packed slice of the weights stay in L2; an integer tile needs no packing.
constexpr int64_t kTileRows = 128, kFloatTileCols = 512, kIntegerTileCols = 256;

// Each row's softmax statistics over one tile of columns, merged over the tiles in column order at the end
// (the same result on any thread count).
struct TileStats {
  float max = -std::numeric_limits<float>::infinity();  // of the tile's numbers (NaN passed over)
  float sum_exp = 0;                                    // sum of exp(z - max) over the tile
  int32_t argmax = -1;                                  // first column of max; -1: no number in the tile
  bool nan = false;                                     // a NaN among the tile's values
  bool first_is_nan = false;                            // the row's column 0 is NaN (in the first tile)
};

class SoftmaxScorer {
 public:
  SoftmaxScorer(int64_t rows, int64_t cols, int64_t tile_cols, std::span<const int32_t> targets)
      : rows_(rows),
        tiles_((cols + tile_cols - 1) / tile_cols),
        targets_(targets),
        stats_(static_cast<size_t>(rows * tiles_)),
        target_logit_(static_cast<size_t>(rows), 0.0f),
        tile_cols_(tile_cols) {}

  // The visitor of kernels/output_tiles.h.
  void visit(int64_t r0, int64_t r1, int64_t c0, int64_t c1, const float* tile, int64_t ld) {
    const int64_t n = c1 - c0;
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = tile + (r - r0) * ld;
      TileStats& s = stats_[r * tiles_ + c0 / tile_cols_];
      s.max = vec::max_of_numbers(row, n);
      const int64_t found = vec::index_of(row, n, s.max);
      s.argmax = found == n ? -1 : static_cast<int32_t>(c0 + found);
      // exp(z - max) of a NaN is NaN: the sum carries it, as cross_entropy's does.
      s.sum_exp = s.argmax < 0 ? std::numeric_limits<float>::quiet_NaN() : vec::sum_exp_shifted(row, s.max, n);
      s.nan = std::isnan(s.sum_exp);
      s.first_is_nan = c0 == 0 && n > 0 && std::isnan(row[0]);
      const int32_t t = targets_[r];
      if (t >= c0 && t < c1) target_logit_[r] = row[t - c0];
    }
  }

  // The mean of logsumexp - target logit over the rows, and each row's first largest column (0 when none is a
  // number, or its first value is NaN: what row_argmax gives).
  double finish(std::vector<int32_t>& predictions) const {
    predictions.assign(static_cast<size_t>(rows_), 0);
    std::vector<double> losses(static_cast<size_t>(rows_));
    parallel_for(rows_, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const TileStats* s = &stats_[r * tiles_];
        float max = -std::numeric_limits<float>::infinity();
        int32_t argmax = -1;
        bool nan = false;
        for (int64_t i = 0; i < tiles_; ++i) {
          nan = nan || s[i].nan;
          if (s[i].argmax >= 0 && (argmax < 0 || s[i].max > max)) max = s[i].max, argmax = s[i].argmax;
        }
        double sum = 0;
        for (int64_t i = 0; i < tiles_; ++i)
          if (s[i].argmax >= 0) sum += double(s[i].sum_exp) * std::exp(double(s[i].max) - double(max));
        losses[r] = nan || argmax < 0 ? std::numeric_limits<double>::quiet_NaN()
                                      : double(max) + std::log(sum) - double(target_logit_[r]);
        predictions[r] = argmax < 0 || s[0].first_is_nan ? 0 : argmax;
      }
    });
    double total = 0;
    for (double l : losses) total += l;  // in row order: the same on any thread count
    return rows_ > 0 ? total / double(rows_) : 0.0;
  }

 private:
  int64_t rows_, tiles_;
  std::span<const int32_t> targets_;
  std::vector<TileStats> stats_;
  std::vector<float> target_logit_;
  int64_t tile_cols_;
};

void check_scoring(const Graph<float>& g, const Shape& x, int64_t inputs, int64_t outputs,
                   std::span<const int32_t> targets, const std::string& op) {
  BERT_CHECK(!g.on_cuda(), op + " runs on the CPU");
  BERT_CHECK(!g.grad_enabled(), op + " has no gradient: run it under NoGradGuard (evaluation only)");
  BERT_CHECK(x.rank() == 2 && x[1] == inputs,
             op + ": x " + x.str() + " must be (rows, " + std::to_string(inputs) + ")");
  BERT_CHECK(static_cast<int64_t>(targets.size()) == x[0],
             op + ": " + std::to_string(targets.size()) + " targets for " + std::to_string(x[0]) + " rows");
  for (int32_t t : targets)
    BERT_CHECK(t >= 0 && t < outputs,
               op + ": target " + std::to_string(t) + " outside [0, " + std::to_string(outputs) + ")");
}

}  // namespace

LinearScores linear_cross_entropy_scores(Graph<float>& g, Var x, Var weight, Var bias, std::span<const int32_t> targets,
                                         PredictionsTo to) {
#if BERT_WITH_CUDA
  if (g.on_cuda()) return cuda_impl::linear_cross_entropy_scores(g, x, weight, bias, targets, to);
#endif
  BERT_CHECK(to == PredictionsTo::kHost, "linear_cross_entropy_scores on the CPU leaves its predictions on the host");
  const Shape &xs = g.shape(x), &ws = g.shape(weight);
  BERT_CHECK(ws.rank() == 2, "linear_cross_entropy_scores: weight " + ws.str() + " must be (out, in)");
  check_scoring(g, xs, ws[1], ws[0], targets, "linear_cross_entropy_scores");
  if (bias.valid())
    BERT_CHECK(g.shape(bias) == Shape({ws[0]}), "linear_cross_entropy_scores: bias " + g.shape(bias).str());
  LinearScores out;
  out.loss = bias.valid() ? g.emit(Shape{}, {x, weight, bias}) : g.emit(Shape{}, {x, weight});
  const int64_t rows = xs[0], n = ws[0], k = ws[1];
  SoftmaxScorer scorer(rows, n, kFloatTileCols, targets);
  GemmArgs args{.trans_a = false, .trans_b = true, .m = rows, .n = n, .k = k};
  args.bf16 = g.device().precision() == Precision::kBf16;  // as ops::linear multiplies on this device
  gemm_tiles(args, g.value(x).data(), k, g.value(weight).data(), k, bias.valid() ? g.value(bias).data() : nullptr,
             kTileRows, kFloatTileCols,
             [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1, const float* tile, int64_t ld) {
               scorer.visit(r0, r1, c0, c1, tile, ld);
             });
  g.value(out.loss)[0] = static_cast<float>(scorer.finish(out.predictions));
  return out;
}

LinearScores int8_linear_dynamic_cross_entropy_scores(Graph<float>& g, Var x, const Int8Weights& weights,
                                                      std::span<const float> scale_w, Var bias,
                                                      std::span<const int32_t> targets) {
  const Shape& xs = g.shape(x);
  const std::string op = "int8_linear_dynamic_cross_entropy_scores";
  check_scoring(g, xs, weights.k(), weights.n(), targets, op);
  BERT_CHECK(static_cast<int64_t>(scale_w.size()) == weights.n(), op + ": one weight scale per output");
  if (bias.valid()) BERT_CHECK(g.shape(bias) == Shape({weights.n()}), op + ": bias " + g.shape(bias).str());
  LinearScores out;
  out.loss = bias.valid() ? g.emit(Shape{}, {x, bias}) : g.emit(Shape{}, {x});
  const int64_t rows = xs[0];
  uint8_t* quantized = g.scratch<uint8_t>(rows * int8_row_bytes(weights.k()));
  float* row_scales = g.scratch<float>(rows);
  quantize_activations_per_row(g.value(x).data(), rows, weights.k(), row_scales, quantized);
  SoftmaxScorer scorer(rows, weights.n(), kIntegerTileCols, targets);
  int8_linear_per_row_tiles(rows, quantized, row_scales, weights, scale_w.data(),
                            bias.valid() ? g.value(bias).data() : nullptr, kTileRows, kIntegerTileCols,
                            [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1, const float* tile, int64_t ld) {
                              scorer.visit(r0, r1, c0, c1, tile, ld);
                            });
  g.value(out.loss)[0] = static_cast<float>(scorer.finish(out.predictions));
  return out;
}

}  // namespace bert::ops
