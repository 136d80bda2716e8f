// LayerNorm (and add_layer_norm: the residual add fused in; dropout_add_layer_norm, with or without its
// quantizer, which the CPU composes): forward and backward side by side; the GPU twin is ops/layer_norm.cu.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>
#include "core/source_location.h"

#include "kernels/vector_math.h"
#include "ops/cuda_impl.h"
#include "ops/ops.h"
#include "sys/parallel.h"

namespace bert::ops {

namespace {
constexpr int64_t kRowGrain = 16;  // rows per thread below which threading does not pay

// The sum of term(j) over j < n in 16 lanes (j mod 16), the lanes added in order at the end: the loop
// vectorises (each lane is its own chain), and the result does not depend on where the row lies in
// memory (Eigen's reductions start at an aligned element, so their order of additions would).
template <typename T, typename Term>
T lane_sum(int64_t n, Term term) {
  constexpr int kLanes = 16;
  T lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += term(j + l);
  for (int l = 0; j < n; ++j, ++l) lanes[l] += term(j);
  T total = 0;
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

// LayerNorm of x = a, or of x = a + b (b valid: the residual add fused in, each sum formed as its row is
// normalised). The sums are stored only where a gradient will need them. op, made_by: the public op.
template <typename T>
Var normalize(Graph<T>& g, Var a, Var b, Var gamma, Var beta, double eps, const std::string& op,
              SourceLocation made_by) {
  const Shape& xs = g.shape(a);
  const int64_t c = xs.last(), rows = xs.rows();
  if (b.valid())
    BERT_CHECK(g.shape(b) == xs, op + ": the addends " + xs.str() + " and " + g.shape(b).str() + " differ");
  BERT_CHECK(g.shape(gamma) == Shape({c}) && g.shape(beta) == Shape({c}),
             op + ": gamma " + g.shape(gamma).str() + " / beta " + g.shape(beta).str() + " for x " + xs.str());
  Var y = b.valid() ? g.emit(xs, {a, b, gamma, beta}, made_by) : g.emit(xs, {a, gamma, beta}, made_by);
  // Saved for backward: per-row mean and reciprocal standard deviation, (N), and the sums (N, C).
  T* mean = g.template scratch<T>(rows);
  T* rstd = g.template scratch<T>(rows);
  const bool save_sums = b.valid() && g.requires_grad(y);
  T* sums = save_sums ? g.template scratch<T>(rows * c) : nullptr;
  const T* av = g.value(a).data();
  const T* bv = b.valid() ? g.value(b).data() : nullptr;
  const T* gv = g.value(gamma).data();
  const T* betav = g.value(beta).data();
  T* yv = g.value(y).data();
  parallel_for(rows, kRowGrain, [&](int64_t lo, int64_t hi) {
    std::vector<T> row_sum(bv && !sums ? c : 0);  // one row of a + b, when the sums are not kept
    for (int64_t r = lo; r < hi; ++r) {
      const T* x = av + r * c;
      if (bv) {
        T* to = sums ? sums + r * c : row_sum.data();
        for (int64_t j = 0; j < c; ++j) to[j] = av[r * c + j] + bv[r * c + j];
        x = to;
      }
      // The row's sums in vector lanes (a loop of scalar adds would wait on each add in turn).
      const T m = lane_sum<T>(c, [x](int64_t j) { return x[j]; }) / static_cast<T>(c);
      const T var = lane_sum<T>(c, [x, m](int64_t j) { return (x[j] - m) * (x[j] - m); }) / static_cast<T>(c);
      const T rs = T(1) / std::sqrt(var + static_cast<T>(eps));
      mean[r] = m;
      rstd[r] = rs;
      T* out = yv + r * c;
      for (int64_t j = 0; j < c; ++j) out[j] = (x[j] - m) * rs * gv[j] + betav[j];
    }
  });
  g.on_backward(y, [a, b, gamma, beta, y, mean, rstd, sums, rows, c](Graph<T>& g) {
    // With n = (x - mean) * rstd and dn = dy * gamma:
    //   dx = rstd * (dn - mean(dn) - n * mean(dn * n)),  dgamma = sum_rows dy * n,  dbeta = sum_rows dy,
    // and dx goes to a (and to b: the gradient of a sum).
    const T* xv = sums ? sums : g.value(a).data();
    const T* gv = g.value(gamma).data();
    const T* dy = g.grad(y).data();
    // One pass over fixed blocks of rows: dx row by row, and each block's sums of dy * n and dy per
    // channel, added into dgamma and dbeta in block order afterwards (the same sums whatever the thread
    // count). dx is stored, not added, where its buffer is fresh (no zeroing pass first).
    using Target = typename Graph<T>::GradTarget;
    const Target da = g.requires_grad(a) ? g.grad_target(a) : Target{nullptr, false};
    const Target db = b.valid() && g.requires_grad(b) ? g.grad_target(b) : Target{nullptr, false};
    const bool want_x = da.data || db.data;
    T* dgamma = g.requires_grad(gamma) ? g.grad(gamma).data() : nullptr;
    T* dbeta = g.requires_grad(beta) ? g.grad(beta).data() : nullptr;
    const bool want_params = dgamma || dbeta;
    constexpr int64_t kRowsPerBlock = 64;
    const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
    T* block_sums = want_params ? g.template scratch<T>(2 * blocks * c) : nullptr;  // [block][dgamma | dbeta]
    parallel_for(blocks, std::max<int64_t>(1, kRowGrain / kRowsPerBlock), [&](int64_t lo, int64_t hi) {
      std::vector<T> dx(want_x ? c : 0);
      for (int64_t blk = lo; blk < hi; ++blk) {
        T* sum_dyn = want_params ? block_sums + 2 * blk * c : nullptr;
        T* sum_dy = want_params ? sum_dyn + c : nullptr;
        if (want_params) std::fill(sum_dyn, sum_dyn + 2 * c, T(0));
        for (int64_t r = blk * kRowsPerBlock, end = std::min(rows, (blk + 1) * kRowsPerBlock); r < end; ++r) {
          const T* in = xv + r * c;
          const T* dyr = dy + r * c;
          const T m = mean[r], rs = rstd[r];
          if (want_params)
            for (int64_t j = 0; j < c; ++j) {
              sum_dyn[j] += dyr[j] * ((in[j] - m) * rs);
              sum_dy[j] += dyr[j];
            }
          if (!want_x) continue;
          const T mean_dn = lane_sum<T>(c, [=](int64_t j) { return dyr[j] * gv[j]; }) / static_cast<T>(c);
          const T mean_dn_n =
              lane_sum<T>(c, [=](int64_t j) { return dyr[j] * gv[j] * (in[j] - m) * rs; }) / static_cast<T>(c);
          for (int64_t j = 0; j < c; ++j) dx[j] = rs * (dyr[j] * gv[j] - mean_dn - (in[j] - m) * rs * mean_dn_n);
          for (const Target* to : {&da, &db}) {
            if (!to->data) continue;
            T* into = to->data + r * c;
            if (to->accumulate)
              for (int64_t j = 0; j < c; ++j) into[j] += dx[j];
            else
              std::copy(dx.begin(), dx.end(), into);
          }
        }
      }
    });
    if (!want_params) return;
    parallel_for(c, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const T* sum_dyn = block_sums + 2 * blk * c;
        const T* sum_dy = sum_dyn + c;
        for (int64_t j = lo; j < hi; ++j) {
          if (dgamma) dgamma[j] += sum_dyn[j];
          if (dbeta) dbeta[j] += sum_dy[j];
        }
      }
    });
  });
  return y;
}

}  // namespace

template <typename T>
Var layer_norm(Graph<T>& g, Var x, Var gamma, Var beta, double eps) {
  BERT_DISPATCH_CUDA(g, layer_norm(g, x, gamma, beta, eps))
  return normalize(g, x, Var{}, gamma, beta, eps, "layer_norm", SourceLocation::current());
}

template <typename T>
Var add_layer_norm(Graph<T>& g, Var a, Var b, Var gamma, Var beta, double eps) {
  BERT_DISPATCH_CUDA(g, add_layer_norm(g, a, b, gamma, beta, eps))
  return normalize(g, a, b, gamma, beta, eps, "add_layer_norm", SourceLocation::current());
}

// The CPU composes the two ops (dropout's pass is cheap there against the LayerNorm's).
template <typename T>
Var dropout_add_layer_norm(Graph<T>& g, Var a, Var b, Var gamma, Var beta, double eps, double p, bool training,
                           Rng& rng) {
  BERT_CHECK(p >= 0.0 && p < 1.0, "dropout probability " + std::to_string(p) + " outside [0, 1)");
  if (!training || p == 0.0) return add_layer_norm(g, a, b, gamma, beta, eps);
  BERT_DISPATCH_CUDA(g, dropout_add_layer_norm(g, a, b, gamma, beta, eps, p, rng))
  return add_layer_norm(g, dropout(g, a, p, training, rng), b, gamma, beta, eps);
}

// With the residual add's input quantizer: on the CPU the ops in sequence (the GPU fuses them).
template <typename T>
Var dropout_add_layer_norm(Graph<T>& g, Var a, Var b, Var gamma, Var beta, double eps, double p, bool training,
                           Rng& rng, const QuantizeOutput& q) {
  BERT_CHECK(p >= 0.0 && p < 1.0, "dropout probability " + std::to_string(p) + " outside [0, 1)");
  BERT_DISPATCH_CUDA(g, dropout_add_layer_norm(g, a, b, gamma, beta, eps, training ? p : 0.0, rng, q))
  return add_layer_norm(g, dropout(g, a, p, training, rng, q), b, gamma, beta, eps);
}

// With its output's quantizers: on the CPU the ops in sequence (the GPU fuses them).
template <typename T>
std::vector<Var> dropout_add_layer_norm_each(Graph<T>& g, Var a, Var b, Var gamma, Var beta, double eps, double p,
                                             bool training, Rng& rng, const QuantizeOutput* q,
                                             std::span<const QuantizeOutput> outputs) {
  BERT_CHECK(p >= 0.0 && p < 1.0, "dropout probability " + std::to_string(p) + " outside [0, 1)");
  BERT_CHECK(!outputs.empty() && outputs.size() <= 2, "dropout_add_layer_norm_each: one or two output quantizers");
  BERT_DISPATCH_CUDA(g, dropout_add_layer_norm_each(g, a, b, gamma, beta, eps, training ? p : 0.0, rng, q, outputs))
  const Var y = q ? dropout_add_layer_norm(g, a, b, gamma, beta, eps, p, training, rng, *q)
                  : dropout_add_layer_norm(g, a, b, gamma, beta, eps, p, training, rng);
  return fake_quantize_each(g, y, outputs);
}

std::vector<Var> add_layer_norm_quantized(Graph<float>& g, Var a, Var b, Var gamma, Var beta, double eps,
                                          const QuantizeOutput* q, std::span<const NormOutput> outputs,
                                          const NormInputs& inputs) {
  BERT_CHECK(g.on_cuda(), "add_layer_norm_quantized runs on a GPU (INT8 inference there)");
  BERT_CHECK(!g.grad_enabled(), "add_layer_norm_quantized has no gradient: run it under NoGradGuard");
  BERT_CHECK(!outputs.empty() && outputs.size() <= 2, "add_layer_norm_quantized: one or two outputs");
  for (const NormOutput& o : outputs)
    BERT_CHECK((o.scale == 0 && !o.integers) || (o.scale > 0 && std::isnormal(1.0f / o.scale)),
               "add_layer_norm_quantized: an output needs a scale whose reciprocal is a normal float (0: not "
               "quantized; int8 outputs: quantized)");
  auto check_addend = [&](Var x, float scale, const char* which) {
    BERT_CHECK(scale >= 0 && std::isfinite(scale), std::string("add_layer_norm_quantized: addend ") + which +
                                                       "'s scale must be 0 (values) or a positive float");
    BERT_CHECK((scale > 0) == (g.dtype(x) == DType::kS8),
               std::string("add_layer_norm_quantized: addend ") + which +
                   (scale > 0 ? " has a scale but is not int8" : " is int8 but has no scale (NormInputs)"));
  };
  check_addend(a, inputs.a_scale, "a");
  check_addend(b, inputs.b_scale, "b");
  BERT_CHECK(!(q && inputs.a_scale > 0),
             "add_layer_norm_quantized: a given as integers is quantized already (no add-input quantizer)");
#if BERT_WITH_CUDA
  return cuda_impl::add_layer_norm_quantized(g, a, b, gamma, beta, eps, q, outputs, inputs);
#else
  (void)a, (void)b, (void)gamma, (void)beta, (void)eps, (void)q;
  throw InternalError("add_layer_norm_quantized: this build has no CUDA support");
#endif
}

std::vector<Var> embedding_layer_norm_quantized(Graph<float>& g, Var words, Var positions, Var types,
                                                std::span<const int32_t> ids, std::span<const int32_t> type_ids,
                                                Shape ids_shape, Var gamma, Var beta, double eps,
                                                std::span<const NormOutput> outputs) {
  const char* op = "embedding_layer_norm_quantized";
  BERT_CHECK(g.on_cuda(), std::string(op) + " runs on a GPU (inference there)");
  BERT_CHECK(!g.grad_enabled(), std::string(op) + " has no gradient: run it under NoGradGuard");
  BERT_CHECK(outputs.size() <= 2, std::string(op) + ": at most two outputs");
  for (const NormOutput& o : outputs)
    BERT_CHECK((o.scale == 0 && !o.integers) || (o.scale > 0 && std::isnormal(1.0f / o.scale)),
               std::string(op) + ": an output needs a scale whose reciprocal is a normal float (0: not quantized; "
                                 "int8 outputs: quantized)");
  BERT_CHECK((ids_shape.rank() == 1 || ids_shape.rank() == 2) &&
                 ids_shape.numel() == static_cast<int64_t>(ids.size()) && type_ids.size() == ids.size(),
             std::string(op) + ": " + std::to_string(ids.size()) + " ids and " + std::to_string(type_ids.size()) +
                 " token types for ids shape " + ids_shape.str() + " ((T) or (B, T))");
  const Shape ws = g.shape(words), ps = g.shape(positions), ts = g.shape(types);
  BERT_CHECK(ws.rank() == 2 && ps.rank() == 2 && ts.rank() == 2 && ps[1] == ws[1] && ts[1] == ws[1],
             std::string(op) + ": tables " + ws.str() + ", " + ps.str() + ", " + ts.str() + " of different widths");
  BERT_CHECK(ids_shape.last() <= ps[0], std::string(op) + ": length " + std::to_string(ids_shape.last()) + " > " +
                                            std::to_string(ps[0]) + " positions");
  auto check_ids = [&](std::span<const int32_t> v, int64_t rows, const char* what) {
    for (const int32_t id : v)
      BERT_CHECK(id >= 0 && id < rows, std::string(op) + ": " + what + " " + std::to_string(id) + " outside table of " +
                                           std::to_string(rows) + " rows");
  };
  check_ids(ids, ws[0], "id");
  check_ids(type_ids, ts[0], "token type");
#if BERT_WITH_CUDA
  return cuda_impl::embedding_layer_norm_quantized(g, words, positions, types, ids, type_ids, ids_shape, gamma, beta,
                                                   eps, outputs);
#else
  (void)gamma, (void)beta, (void)eps;
  throw InternalError(std::string(op) + ": this build has no CUDA support");
#endif
}

bool add_layer_norm_reads_integers(const Graph<float>& g, int64_t width) {
  // (The row kernels' widths: cuda_impl's with_row_chunks.)
  return g.on_cuda() && width > 0 && width % 4 == 0 && width <= 1024;
}

#define BERT_INSTANTIATE(T)                                                                          \
  template Var layer_norm<T>(Graph<T>&, Var, Var, Var, double);                                      \
  template Var add_layer_norm<T>(Graph<T>&, Var, Var, Var, Var, double);                             \
  template Var dropout_add_layer_norm<T>(Graph<T>&, Var, Var, Var, Var, double, double, bool, Rng&); \
  template Var dropout_add_layer_norm<T>(Graph<T>&, Var, Var, Var, Var, double, double, bool, Rng&,  \
                                         const QuantizeOutput&);                                  \
  template std::vector<Var> dropout_add_layer_norm_each<T>(Graph<T>&, Var, Var, Var, Var, double, double, bool,  \
                                                           Rng&, const QuantizeOutput*,                         \
                                                           std::span<const QuantizeOutput>);
BERT_INSTANTIATE(float)
BERT_INSTANTIATE(double)
#undef BERT_INSTANTIATE

}  // namespace bert::ops