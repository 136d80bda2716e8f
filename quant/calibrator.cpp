#include "quant/calibrator.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/ops.h"
#include "sys/error.h"

namespace bert::quant {

Method parse_method(const std::string& name) { return kMethodNames.parse(name, "unknown calibrator"); }

std::string method_name(Method m) { return kMethodNames.name(m); }

float scale_for_amax(double amax) {
  constexpr double kSmallestAmax = 1e-8;  // an all-zero tensor still gets a legal scale
  return static_cast<float>(std::max(amax, kSmallestAmax) / 127.0);
}

double calibrated_amax(const AbsHistogram& histogram, Method method, double percentile, double bound) {
  return bound > 0 ? bound : histogram.amax(method, percentile);
}

bool AbsHistogram::add_batch(float batch_max, int64_t n) {
  max_ = std::max<double>(max_, batch_max);
  total_ += n;
  if (batch_max == 0 && range_ == 0) {
    bins_[0] += static_cast<double>(n);
    return false;
  }
  if (range_ == 0) range_ = batch_max;
  while (batch_max > range_) {  // double the range: bin i of the new histogram = bins 2i, 2i+1 of the old
    for (int i = 0; i < kBins / 2; ++i) bins_[i] = bins_[2 * i] + bins_[2 * i + 1];
    std::fill(bins_.begin() + kBins / 2, bins_.end(), 0.0);
    range_ *= 2;
  }
  return true;
}

void AbsHistogram::observe(std::span<const float> values) {
  float batch_max = 0;
  for (float v : values) {
    const float a = std::abs(v);
    if (!(a <= std::numeric_limits<float>::max()))  // NaN compares false: checked value by value
      throw UserError("calibration saw a non-finite activation (NaN or Inf)");
    batch_max = std::max(batch_max, a);
  }
  if (!add_batch(batch_max, static_cast<int64_t>(values.size()))) return;
  const double inv_width = kBins / range_;
  for (float v : values) {
    const int bin = std::min(kBins - 1, static_cast<int>(std::abs(v) * inv_width));
    bins_[bin] += 1;
  }
}

void AbsHistogram::observe(Graph<float>& g, Var x) {
  const double batch_max = ops::abs_max(g, x);
  if (!std::isfinite(batch_max)) throw UserError("calibration saw a non-finite activation (NaN or Inf)");
  if (!add_batch(static_cast<float>(batch_max), g.shape(x).numel())) return;
  const std::vector<int64_t> counts = ops::abs_histogram(g, x, range_, kBins);
  for (int i = 0; i < kBins; ++i) bins_[i] += static_cast<double>(counts[i]);
}

AbsHistogram AbsHistogram::from_bins(double range, double max, int64_t count, const std::vector<double>& bins) {
  if (static_cast<int>(bins.size()) != kBins || !(range >= 0) || !(max >= 0) || max > range * (1 + 1e-6) + 1e-30)
    throw UserError("histogram has " + std::to_string(bins.size()) + " bins (expected " + std::to_string(kBins) +
                    ") or an inconsistent range");
  AbsHistogram h;
  h.bins_ = bins;
  h.range_ = range;
  h.max_ = max;
  h.total_ = count;
  return h;
}

double AbsHistogram::amax(Method method, double percentile) const {
  if (range_ == 0) return max_;
  switch (method) {
    case Method::kMax:
      return max_;
    case Method::kPercentile:
      return percentile_amax(percentile);
    case Method::kEntropy:
      return entropy_amax();
    case Method::kMse:
      return mse_amax();
  }
  return max_;
}

double AbsHistogram::percentile_amax(double percentile) const {
  if (!(percentile > 0 && percentile <= 100)) throw UserError("--percentile must be in (0, 100]");
  if (range_ == 0 || percentile == 100) return max_;  // 100: everything, the max itself
  const double target = static_cast<double>(total_) * percentile / 100.0;
  double cumulative = 0;
  for (int i = 0; i < kBins; ++i) {
    cumulative += bins_[i];
    // The bin's lower edge, as pytorch-quantization's _compute_amax_percentile (searchsorted on the CDF).
    if (cumulative >= target) return std::min(max_, i * bin_width());
  }
  return max_;
}

double AbsHistogram::entropy_amax() const {
  if (range_ == 0) return max_;
  // TensorRT's entropy calibration as pytorch-quantization computes it (_compute_amax_entropy):
  //  - bin 0 takes bin 1's count (a spike of exact zeros, e.g. softmax over padded keys, says nothing
  //    about where to clip);
  //  - for every threshold i in [128, 2048]: P = bins[0:i] with everything beyond folded into bin i-1;
  //    Q = bins[0:i] merged into 128 levels, bin j in level floor(128 j / i), each level's mass spread
  //    evenly over its non-empty bins (empty bins stay empty);
  //  - KL(P || Q), infinite where P has mass and Q has none; the LAST threshold with the smallest
  //    divergence wins; amax is that threshold's bin edge.
  constexpr int kLevels = 128;
  std::vector<double> bins = bins_;
  bins[0] = bins[1];
  double best_kl = std::numeric_limits<double>::infinity();
  int best_i = kBins;
  std::vector<double> level_sum(kLevels), p, q;
  std::vector<int> level_count(kLevels);
  double beyond = 0;  // sum of bins[i:], updated as i falls
  for (int j = kLevels; j < kBins; ++j) beyond += bins[j];
  for (int i = kLevels; i <= kBins; ++i) {
    if (i > kLevels) beyond -= bins[i - 1];
    std::fill(level_sum.begin(), level_sum.end(), 0.0);
    std::fill(level_count.begin(), level_count.end(), 0);
    for (int j = 0; j < i; ++j) {
      if (bins[j] == 0) continue;
      const int level = static_cast<int>(int64_t{kLevels} * j / i);
      level_sum[level] += bins[j];
      ++level_count[level];
    }
    p.assign(bins.begin(), bins.begin() + i);
    p[i - 1] += beyond;
    q.assign(i, 0.0);
    for (int j = 0; j < i; ++j) {
      if (bins[j] == 0) continue;
      const int level = static_cast<int>(int64_t{kLevels} * j / i);
      q[j] = level_sum[level] / level_count[level];
    }
    double p_total = 0, q_total = 0;
    for (int j = 0; j < i; ++j) p_total += p[j], q_total += q[j];
    if (p_total == 0 || q_total == 0) continue;
    double kl = 0;
    for (int j = 0; j < i && std::isfinite(kl); ++j) {
      if (p[j] == 0) continue;
      if (q[j] == 0) {
        kl = std::numeric_limits<double>::infinity();
      } else {
        const double pj = p[j] / p_total, qj = q[j] / q_total;
        kl += pj * std::log(pj / qj);
      }
    }
    if (kl <= best_kl) best_kl = kl, best_i = i;  // <=: the last minimum, as the reference
  }
  return std::min(max_, best_i * bin_width());
}

double AbsHistogram::mse_amax() const {
  if (range_ == 0) return max_;
  // Candidate thresholds at bin edges; error of each bin centre against its fake-quantized value.
  const double width = bin_width();
  double best_error = std::numeric_limits<double>::infinity(), best = max_;
  for (int i = 128; i <= kBins; ++i) {
    const double amax = i * width, s = amax / 127.0;
    double error = 0;
    for (int j = 0; j < kBins; ++j) {
      if (bins_[j] == 0) continue;
      const double centre = (j + 0.5) * width;
      const double quantized = std::min(std::nearbyint(centre / s), 127.0) * s;
      error += bins_[j] * (centre - quantized) * (centre - quantized);
    }
    if (error < best_error) best_error = error, best = amax;
  }
  return std::min(max_, best);
}

}  // namespace bert::quant
