// Calibrators on synthetic distributions whose right answer is known; quantizer selection and plans;
// calibrating a model end to end.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "core/graph.h"
#include "core/rng.h"
#include "quant/calibrator.h"
#include "quant/quantize.h"
#include "sys/error.h"
#include "sys/json.h"
#include "sys/text_file.h"
#include "tests/common/fixtures.h"
#include "tests/common/temp_dir.h"

namespace bert::quant {
namespace {

std::vector<float> sample(int n, uint64_t seed, const std::function<double(Rng&)>& draw) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(draw(rng));
  return v;
}

TEST(Calibrator, MaxIsTheLargestMagnitudeSeen) {
  AbsHistogram h;
  std::vector<float> a{0.5f, -3.25f, 1.0f}, b{2.0f, -0.1f};
  h.observe(a);
  h.observe(b);
  EXPECT_EQ(h.amax(Method::kMax), 3.25);
  EXPECT_EQ(h.count(), 5);
}

// The statistics gathered through the graph (ops::abs_max and ops::abs_histogram, what calibration on
// a GPU uses) are the host's exactly: the same batches, zeros first, a range that doubles twice, values
// on bin edges; a NaN is refused the same way.
TEST(Calibrator, ObservingAGraphNodeGathersTheHostsStatistics) {
  const std::vector<std::vector<float>> batches = {{0.0f, 0.0f, -0.0f},
                                                   sample(5000, 3, [](Rng& r) { return r.next_normal(); }),
                                                   {0.5f, -1.0f, 0.25f, 4.0f / 2048},
                                                   sample(7000, 4, [](Rng& r) { return 20 * r.next_normal(); }),
                                                   sample(100, 5, [](Rng& r) { return r.next_uniform() - 0.5; })};
  AbsHistogram host, graph;
  for (const std::vector<float>& b : batches) {
    host.observe(b);
    Graph<float> g;
    std::vector<float> copy = b;
    graph.observe(g, g.constant(TensorView<float>(copy.data(), Shape{static_cast<int64_t>(copy.size())})));
  }
  EXPECT_GT(host.range(), 40.0);
  EXPECT_EQ(graph.range(), host.range());
  EXPECT_EQ(graph.max(), host.max());
  EXPECT_EQ(graph.count(), host.count());
  EXPECT_EQ(graph.bins(), host.bins());
  std::vector<float> bad = {1.0f, std::nanf("")};
  Graph<float> g;
  EXPECT_THROW(graph.observe(g, g.constant(TensorView<float>(bad.data(), Shape{2}))), UserError);
}

TEST(Calibrator, PercentileOfAKnownDistribution) {
  // |x| uniform on [0, 1): the p-th percentile is p / 100, to within one bin.
  AbsHistogram h;
  h.observe(sample(1'000'000, 1, [](Rng& r) { return r.next_uniform(); }));
  for (double p : {50.0, 90.0, 99.0, 99.99}) EXPECT_NEAR(h.percentile_amax(p), p / 100, 2 * h.bin_width()) << p;
  EXPECT_EQ(h.percentile_amax(100.0), h.max());
  EXPECT_THROW(h.percentile_amax(0.0), UserError);
}

TEST(Calibrator, EntropyAndMseClipHeavyTailsButKeepAUniformRange) {
  // A unit normal with rare outliers 40x larger: entropy (distribution shape) clips far below the max.
  // MSE rightly keeps the outliers here (clipping 200 values by ~35 costs more squared error than all
  // the bulk's rounding), so it is tested on a dense heavy tail instead.
  AbsHistogram outliers;
  outliers.observe(
      sample(200'000, 2, [](Rng& r) { return r.next_uniform() < 0.001 ? 40 * r.next_normal() : r.next_normal(); }));
  EXPECT_LT(outliers.amax(Method::kEntropy), 0.5 * outliers.max());
  EXPECT_GT(outliers.amax(Method::kEntropy), 2.0) << "must still cover the bulk of the normal";
  // Laplace(1): the 8-bit MSE-optimal clip is about 9.9 (ACIQ, Banner et al. 2019); the max of 10^6
  // samples is about 14.
  AbsHistogram laplace;
  laplace.observe(sample(1'000'000, 6, [](Rng& r) {
    const double u = r.next_uniform() - 0.5;
    return (u < 0 ? 1 : -1) * std::log(1 - 2 * std::abs(u));
  }));
  EXPECT_NEAR(laplace.amax(Method::kMse), 9.9, 1.5);
  EXPECT_LT(laplace.amax(Method::kMse), 0.85 * laplace.max());
  EXPECT_LT(laplace.amax(Method::kEntropy), 0.85 * laplace.max());
  // Uniform: every value matters as much as any other; the threshold stays near the max.
  AbsHistogram uniform;
  uniform.observe(sample(200'000, 3, [](Rng& r) { return 2 * r.next_uniform() - 1; }));
  for (Method m : {Method::kEntropy, Method::kMse}) EXPECT_GT(uniform.amax(m), 0.9 * uniform.max()) << method_name(m);
}

// The entropy calibrator against pytorch-quantization's _compute_amax_entropy (TensorRT's method), run
// by tests/golden/make_entropy_fixture.py on the same histograms: a spike of exact zeros with a tail
// (softmax over padded keys), normal, normal with outliers, Laplace, uniform, and a sparse histogram.
TEST(Calibrator, EntropyMatchesTheReferenceImplementation) {
  const Json fixture = Json::parse(read_text_file(testing::fixtures_dir() + "/entropy_reference.json", "fixture"));
  int cases = 0;
  for (const Json& c : fixture.find("cases")->as_array()) {
    std::vector<double> bins;
    for (const Json& b : c.find("bins")->as_array()) bins.push_back(b.as_number());
    const double range = c.find("range")->as_number(), expected = c.find("amax")->as_number();
    const AbsHistogram h = AbsHistogram::from_bins(range, range, c.find("count")->as_int(), bins);
    const std::string name = c.find("name")->as_string();
    EXPECT_NEAR(h.amax(Method::kEntropy), expected, 1e-9 * range) << name;
    if (name == "attention_probs") {
      // The reference itself clips softmax rows (bounded by 1) to a tenth of their range: the peaks a
      // head attends with. Told the bound, every method keeps the whole range.
      EXPECT_LT(expected, 0.2 * range);
      for (Method m : {Method::kMax, Method::kPercentile, Method::kEntropy, Method::kMse})
        EXPECT_EQ(calibrated_amax(h, m, 99.99, /*bound=*/1.0), 1.0) << method_name(m);
    }
    ++cases;
  }
  EXPECT_EQ(cases, 7);
}

TEST(Calibrator, ABoundedTensorIsNeverClipped) {
  // Softmax rows over 128 keys, one row in eight peaked on one key (as the attention_probs fixture).
  // Unbounded, entropy and percentile clip the peaks; with its bound, every method returns the bound.
  Rng rng(8);
  std::vector<float> probs;
  for (int row = 0; row < 2000; ++row) {
    std::vector<double> logits(128);
    for (double& l : logits) l = rng.next_normal();
    if (rng.next_uniform() < 0.125) logits[rng.next_below(128)] += 9.0;
    double sum = 0;
    for (double& l : logits) sum += (l = std::exp(l));
    for (double l : logits) probs.push_back(static_cast<float>(l / sum));
  }
  AbsHistogram h;
  h.observe(probs);
  EXPECT_GT(h.max(), 0.9);
  EXPECT_LT(h.amax(Method::kEntropy), 0.5 * h.max());
  EXPECT_LT(h.amax(Method::kPercentile, 99.9), 0.5 * h.max());
  for (Method m : {Method::kMax, Method::kPercentile, Method::kEntropy, Method::kMse}) {
    EXPECT_EQ(calibrated_amax(h, m, 99.9, /*bound=*/1.0), 1.0) << method_name(m);
    EXPECT_EQ(calibrated_amax(h, m, 99.9), h.amax(m, 99.9)) << method_name(m) << ": no bound, the method's amax";
  }
}

TEST(Calibrator, HistogramGrowsWithLaterBatchesAndBarelyDependsOnOrder) {
  const std::vector<float> small = sample(50'000, 4, [](Rng& r) { return 0.1 * r.next_normal(); });
  const std::vector<float> large = sample(50'000, 5, [](Rng& r) { return 3.0 * r.next_normal(); });
  AbsHistogram a, b;
  a.observe(small);
  a.observe(large);
  b.observe(large);
  b.observe(small);
  EXPECT_EQ(a.max(), b.max());
  EXPECT_GE(a.range(), a.max());
  EXPECT_EQ(a.count(), b.count());
  double total = 0;
  for (double c : a.bins()) total += c;
  EXPECT_EQ(total, 100'000) << "re-binning keeps every count";
  for (Method m : {Method::kPercentile, Method::kEntropy, Method::kMse})
    EXPECT_NEAR(a.amax(m), b.amax(m), 0.05 * b.amax(m) + 2 * std::max(a.bin_width(), b.bin_width())) << method_name(m);
}

TEST(Calibrator, DegenerateInputsStillGiveALegalScale) {
  AbsHistogram zeros;
  std::vector<float> z(10, 0.0f);
  zeros.observe(z);
  EXPECT_EQ(zeros.amax(Method::kEntropy), 0.0);
  EXPECT_GT(scale_for_amax(0.0), 0.0f);
  EXPECT_FLOAT_EQ(scale_for_amax(127.0), 1.0f);
  std::vector<float> bad{1.0f, std::nanf("")};
  EXPECT_THROW(zeros.observe(bad), UserError);
  EXPECT_THROW(parse_method("minmax"), UserError);
}

TEST(Glob, MatchesStarsAndQuestionMarks) {
  EXPECT_TRUE(glob_match("*", "anything"));
  EXPECT_TRUE(glob_match("bert.encoder.layer.*.attention.self.query.*",
                         "bert.encoder.layer.1.attention.self.query.weight_quantizer"));
  EXPECT_TRUE(glob_match("*layer.?.output*", "bert.encoder.layer.3.output.dense.weight_quantizer"));
  EXPECT_FALSE(glob_match("*layer.?.output*", "bert.encoder.layer.13.output.dense.weight_quantizer"));
  EXPECT_FALSE(glob_match("query", "query2"));
  EXPECT_TRUE(glob_match("a*b*c", "aXXbYYc"));
  EXPECT_FALSE(glob_match("a*b*c", "aXXbYY"));
}

model::Bert& small_model() {
  static model::Bert* m = [] {
    model::BertConfig c = model::preset("tiny");
    c.vocab_size = 64;
    c.hidden_size = 32;
    c.intermediate_size = 64;
    c.max_position_embeddings = 16;
    auto* model = new model::Bert(c);
    model->initialize(1);
    return model;
  }();
  return *m;
}

TEST(Select, ByNameAndGlobWithClearErrors) {
  model::Bert& m = small_model();
  // Per layer: 6 weights, 4 linear inputs (Q, K and V share one), 4 attention matmul inputs, 4 residual
  // inputs; pooler and transform 2 each.
  EXPECT_EQ(m.quantizers().size(), 2u * (10 + 4 + 4) + 4);
  EXPECT_EQ(default_quantizers(m, false).size(), 2u * (10 + 4) + 4);
  EXPECT_EQ(select(m, "*.attention.self.*input_quantizer").size(), 2u * 5);
  EXPECT_THROW(select(m, "*.attention.self.query.input_quantizer"), UserError) << "the earlier layout's name";
  EXPECT_EQ(select(m, "*.weight_quantizer").size(), 2u * 6 + 2);
  EXPECT_EQ(select(m, "bert.encoder.layer.0.attention.self.matmul_?_input_quantizer").size(), 4u);
  EXPECT_EQ(select(m, "bert.pooler.dense.input_quantizer,bert.pooler.dense.*").size(), 2u);
  try {
    select(m, "*.nonexistent_quantizer");
    ADD_FAILURE();
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("no quantizer matches '*.nonexistent_quantizer'"), std::string::npos);
  }
}

TEST(Plan, WriteReadAndRejectUnknownNames) {
  model::Bert& m = small_model();
  testing::TempDir dir;
  Json details;
  details["max_mlm_accuracy_drop"] = 0.005;
  write_plan(dir.file("plan.json"), {"bert.pooler.dense.input_quantizer"}, details);
  EXPECT_EQ(read_plan(dir.file("plan.json"), m), std::vector<std::string>{"bert.pooler.dense.input_quantizer"});
  std::ofstream(dir.file("bad.json")) << R"({"keep_float": ["bert.encoder.layer.9.output.dense.input_quantizer"]})";
  EXPECT_THROW(read_plan(dir.file("bad.json"), m), UserError);
  // A plan of the earlier layout (Q, K and V each with an input quantizer) keeps their shared one in float.
  std::ofstream(dir.file("earlier.json"))
      << R"({"keep_float": ["bert.encoder.layer.1.attention.self.key.input_quantizer",
                            "bert.encoder.layer.1.attention.self.value.input_quantizer"]})";
  EXPECT_EQ(read_plan(dir.file("earlier.json"), m),
            std::vector<std::string>{"bert.encoder.layer.1.attention.self.input_quantizer"});
  std::ofstream(dir.file("junk.json")) << "{";
  EXPECT_THROW(read_plan(dir.file("junk.json"), m), UserError);
}

TEST(Calibrate, WeightScalesArePerChannelMaxOver127AndKeptFloatStaysFloat) {
  model::Bert& m = small_model();
  CalibrationStatistics stats;
  stats.quantizers = select(m, "*.weight_quantizer");
  apply_calibration(m, stats, Method::kMax, 99.99);
  const TensorView<float> w = m.parameters().get("bert.encoder.layer.0.intermediate.dense.weight").value;
  const TensorView<float> s =
      m.parameters().get("bert.encoder.layer.0.intermediate.dense.weight_quantizer.scale").value;
  for (int64_t c = 0; c < s.numel(); ++c) {
    float largest = 0;
    for (int64_t i = 0; i < 32; ++i) largest = std::max(largest, std::abs(w[c * 32 + i]));
    EXPECT_EQ(s[c], static_cast<float>(largest / 127.0)) << c;
  }
  int enabled = 0;
  for (model::Quantizer* q : m.quantizers()) enabled += q->mode == model::QuantMode::kQuantize;
  EXPECT_EQ(enabled, 2 * 6 + 2);
  disable_all(m);
}

TEST(Calibrate, ChosenSetFollowsIncludeKeepFloatGlobsAndPlan) {
  model::Bert& m = small_model();
  CalibrationOptions o;
  EXPECT_EQ(chosen_quantizers(m, o).size(), default_quantizers(m, true).size()) << "residual inputs by default";
  o.residuals = false;
  EXPECT_EQ(chosen_quantizers(m, o).size(), default_quantizers(m, false).size());
  o.include = "*.weight_quantizer,*matmul_a*";
  o.keep_float_globs = "bert.encoder.layer.1.*";
  o.keep_float = {"bert.pooler.dense.weight_quantizer"};
  // 14 weights + 2 matmul_a, minus layer 1's 6 weights and matmul_a, minus the pooler's weight.
  EXPECT_EQ(chosen_quantizers(m, o).size(), 16u - 7u - 1u);
  o.keep_float_globs = "*.nothing_quantizer";
  EXPECT_THROW(chosen_quantizers(m, o), UserError);
  o.keep_float_globs.clear();
  o.keep_float = {"no.such.quantizer"};
  EXPECT_THROW(chosen_quantizers(m, o), UserError);
}

}  // namespace
}  // namespace bert::quant
