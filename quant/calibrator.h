// Calibration statistics of one activation quantizer, and the calibrators that turn them into amax
// (docs/quantization.md): max, percentile, entropy (KL, TensorRT's EntropyCalibrator2
// idea) and MSE. One pass collects max |x| and a 2048-bin histogram of |x|; every method's amax is then
// computed from the same statistics, so PTQ can compare calibrators without recalibrating.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "sys/enum_names.h"
#include "model/quantizer.h"

namespace bert::quant {

enum class Method { kMax, kPercentile, kEntropy, kMse };
inline constexpr EnumNames<Method, 4> kMethodNames{
    {{{Method::kMax, "max"}, {Method::kPercentile, "percentile"}, {Method::kEntropy, "entropy"},
      {Method::kMse, "mse"}}}};
Method parse_method(const std::string& name);  // max | percentile | entropy | mse; UserError otherwise
std::string method_name(Method m);

class AbsHistogram final : public model::QuantObserver {
 public:
  static constexpr int kBins = 2048;

  // Adds |x| for every value. The range starts at the first non-zero batch's max and doubles (merging
  // pairs of bins, so no count moves between bins' sums) whenever a later value exceeds it.
  void observe(std::span<const float> values) override;
  // The same statistics gathered where the graph lives (ops::abs_max, ops::abs_histogram): on a GPU
  // only the 2048 counts cross to the host.
  void observe(Graph<float>& g, Var x) override;

  // A histogram given by its bins (a reference implementation's, in the tests).
  static AbsHistogram from_bins(double range, double max, int64_t count, const std::vector<double>& bins);

  double max() const { return max_; }
  double range() const { return range_; }
  int64_t count() const { return total_; }
  const std::vector<double>& bins() const { return bins_; }
  double bin_width() const { return range_ / kBins; }

  // amax by each method (percentile in percent, e.g. 99.99). All return max() when the histogram is
  // degenerate (no non-zero values).
  double amax(Method method, double percentile = 99.99) const;
  double percentile_amax(double percentile) const;
  double entropy_amax() const;
  double mse_amax() const;

 private:
  // Takes a batch of n values whose largest |x| is batch_max: the max, the count and the range (doubled
  // as needed). False when the batch was all zeros before any range existed (counted in bin 0 already).
  bool add_batch(float batch_max, int64_t n);

  std::vector<double> bins_ = std::vector<double>(kBins, 0.0);
  double range_ = 0, max_ = 0;
  int64_t total_ = 0;
};

// The amax a calibrator gives a tensor: `bound` when its range is known (> 0: softmax probabilities and
// tanh, 1), whatever the method and the data; else the histogram's amax by the method. No calibrator
// clips a bounded tensor: a clipped attention peak is a head lost, while the whole known range costs at
// most a coarser step (1/127 for probabilities).
double calibrated_amax(const AbsHistogram& histogram, Method method, double percentile, double bound = 0);

// The scale for an amax: amax / 127, with amax = 0 replaced by a tiny positive value (a zero scale is
// illegal in Q/DQ and in the fake quantizer).
float scale_for_amax(double amax);

}  // namespace bert::quant
