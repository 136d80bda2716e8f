// Reductions to a scalar (sum, mean, cross-entropy): forward and backward side by side.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/vector_math.h"
#include "ops/cuda_impl.h"
#include "ops/ops.h"
#include "sys/parallel.h"

namespace bert::ops {

template <typename T>
Var sum(Graph<T>& g, Var x) {
  BERT_DISPATCH_CUDA(g, sum(g, x))
  Var y = g.emit(Shape{}, {x});
  double total = 0;  // accumulate in double: a sum of many float terms
  for (T v : g.value(x)) total += v;
  g.value(y)[0] = static_cast<T>(total);
  g.on_backward(y, [x, y](Graph<T>& g) {
    const T d = g.grad(y)[0];
    for (T& v : g.grad(x)) v += d;
  });
  return y;
}

template <typename T>
Var mean(Graph<T>& g, Var x) {
  const int64_t n = g.value(x).numel();
  BERT_CHECK(n > 0, "mean of an empty tensor");
  return scale(g, sum(g, x), 1.0 / static_cast<double>(n));
}

template <typename T>
Var cross_entropy(Graph<T>& g, Var logits, std::span<const int32_t> targets, std::span<const T> weights,
                  int32_t ignore_index) {
  BERT_DISPATCH_CUDA(g, cross_entropy(g, logits, targets, weights, ignore_index))
  const Shape& ls = g.shape(logits);
  BERT_CHECK(ls.rank() == 2, "cross_entropy: logits must be (N, C), got " + ls.str());
  const int64_t n = ls[0], c = ls[1];
  BERT_CHECK(static_cast<int64_t>(targets.size()) == n,
             "cross_entropy: " + std::to_string(targets.size()) + " targets for " + std::to_string(n) + " rows");
  BERT_CHECK(weights.empty() || static_cast<int64_t>(weights.size()) == n, "cross_entropy: weights size");

  // Saved for backward: targets, each row's weight / total weight (0 when skipped) and logsumexp.
  int32_t* target = g.template scratch<int32_t>(n);
  T* row_weight = g.template scratch<T>(n);
  T* logsumexp = g.template scratch<T>(n);
  double total_weight = 0;
  for (int64_t i = 0; i < n; ++i) {
    target[i] = targets[i];
    const bool active = targets[i] != ignore_index;
    if (active)
      BERT_CHECK(targets[i] >= 0 && targets[i] < c,
                 "cross_entropy: target " + std::to_string(targets[i]) + " outside [0, " + std::to_string(c) + ")");
    row_weight[i] = active ? (weights.empty() ? T(1) : weights[i]) : T(0);
    total_weight += row_weight[i];
  }
  const T inv_total = total_weight > 0 ? static_cast<T>(1.0 / total_weight) : T(0);
  for (int64_t i = 0; i < n; ++i) row_weight[i] *= inv_total;

  Var y = g.emit(Shape{}, {logits});  // first, so that an OpProfile gives the work below to this op
  const T* z = g.value(logits).data();
  parallel_for(n, rows_per_thread(c, 4), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      if (row_weight[i] == T(0)) continue;
      const T* row = z + i * c;
      const T max = vec::max_of(row, c);
      logsumexp[i] = max + std::log(vec::sum_exp_shifted(row, max, c));
    }
  });
  double loss = 0;
  for (int64_t i = 0; i < n; ++i)
    if (row_weight[i] != T(0)) loss += double(row_weight[i]) * (double(logsumexp[i]) - double(z[i * c + target[i]]));
  g.value(y)[0] = static_cast<T>(loss);
  g.on_backward(y, [logits, y, target, row_weight, logsumexp, n, c](Graph<T>& g) {
    // d/dz_ij = upstream * w_i / W * (softmax(z_i)_j - [j == target_i])
    const T upstream = g.grad(y)[0];
    const T* z = g.value(logits).data();
    T* dz = g.grad(logits).data();
    parallel_for(n, rows_per_thread(c, 4), [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        if (row_weight[i] == T(0)) continue;
        const T w = upstream * row_weight[i];
        vec::add_scaled_exp_shifted(z + i * c, logsumexp[i], w, dz + i * c, c);
        dz[i * c + target[i]] -= w;
      }
    });
  });
  return y;
}

template <typename T>
Var mean_squared_error(Graph<T>& g, Var predictions, Var targets) {
  const Shape ps = g.shape(predictions), ts = g.shape(targets);
  BERT_CHECK(ps.numel() > 0 && ps.numel() == ts.numel(),
             "mean_squared_error: predictions " + ps.str() + " and targets " + ts.str() + " must hold as many values");
  BERT_CHECK(!g.requires_grad(targets), "mean_squared_error: the targets take no gradient");
  // From the ops it is made of, on either device (their dtypes met in F32).
  const Var difference = add(g, predictions, scale(g, reshape(g, targets, ps), -1.0));
  return mean(g, mul(g, difference, difference));
}

template <typename T>
Var distillation_loss(Graph<T>& g, Var student, Var teacher, double temperature) {
  const Shape ss = g.shape(student);
  BERT_CHECK(ss.rank() == 2 && g.shape(teacher) == ss, "distillation_loss: student " + ss.str() + " and teacher " +
                                                           g.shape(teacher).str() + " must be (N, C) alike");
  BERT_CHECK(!g.requires_grad(teacher), "distillation_loss: the teacher takes no gradient (run it without gradients)");
  BERT_CHECK(temperature > 0, "distillation_loss: temperature must be positive");
  BERT_DISPATCH_CUDA(g, distillation_loss(g, student, teacher, temperature))  // checked above for both devices
  const int64_t n = ss[0], c = ss[1];
  const T inv_t = static_cast<T>(1.0 / temperature);
  // Saved for backward: each row's log-sum-exp of student / T and teacher / T.
  T* lse_student = g.template scratch<T>(std::max<int64_t>(n, 1));
  T* lse_teacher = g.template scratch<T>(std::max<int64_t>(n, 1));
  std::vector<double> row_kl(static_cast<size_t>(n));
  const T* s = g.value(student).data();
  const T* t = g.value(teacher).data();
  auto logsumexp = [c, inv_t](const T* row) {
    T max = row[0] * inv_t;
    for (int64_t j = 1; j < c; ++j) max = std::max(max, row[j] * inv_t);
    double sum = 0;
    for (int64_t j = 0; j < c; ++j) sum += std::exp(double(row[j] * inv_t - max));
    return static_cast<T>(double(max) + std::log(sum));
  };
  parallel_for(n, rows_per_thread(c, 4), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const T* si = s + i * c;
      const T* ti = t + i * c;
      lse_student[i] = logsumexp(si);
      lse_teacher[i] = logsumexp(ti);
      double kl = 0;  // sum_j p_j (log p_j - log q_j)
      for (int64_t j = 0; j < c; ++j) {
        const double log_p = double(ti[j] * inv_t) - double(lse_teacher[i]);
        const double log_q = double(si[j] * inv_t) - double(lse_student[i]);
        kl += std::exp(log_p) * (log_p - log_q);
      }
      row_kl[i] = kl;
    }
  });
  double loss = 0;
  for (double kl : row_kl) loss += kl;  // in row order: the same on any thread count
  const double factor = n > 0 ? temperature * temperature / double(n) : 0.0;
  Var y = g.emit(Shape{}, {student, teacher});
  g.value(y)[0] = static_cast<T>(factor * loss);
  g.on_backward(y, [student, teacher, y, lse_student, lse_teacher, n, c, inv_t, temperature](Graph<T>& g) {
    // d/ds_ij = upstream * T / N * (q_ij - p_ij)
    const T w = static_cast<T>(double(g.grad(y)[0]) * temperature / double(std::max<int64_t>(n, 1)));
    const T* s = g.value(student).data();
    const T* t = g.value(teacher).data();
    T* ds = g.grad(student).data();
    parallel_for(n, rows_per_thread(c, 4), [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i)
        for (int64_t j = 0; j < c; ++j) {
          const T q = std::exp(s[i * c + j] * inv_t - lse_student[i]);
          const T p = std::exp(t[i * c + j] * inv_t - lse_teacher[i]);
          ds[i * c + j] += w * (q - p);
        }
    });
  });
  return y;
}

template <typename T>
LinearScores cross_entropy_scores(Graph<T>& g, Var logits, std::span<const int32_t> targets, PredictionsTo to) {
  BERT_DISPATCH_CUDA(g, cross_entropy_scores(g, logits, targets, to))
  LinearScores scores;
  scores.loss = cross_entropy<T>(g, logits, targets);
  scores.predictions = row_argmax(g, logits);
  if (to == PredictionsTo::kDevice) {  // the CPU's "device" memory is the graph's own
    int32_t* kept = g.template scratch<int32_t>(std::max<std::size_t>(scores.predictions.size(), 1));
    std::copy(scores.predictions.begin(), scores.predictions.end(), kept);
    scores.device_predictions = kept;
    scores.predictions.clear();
  }
  return scores;
}

template <typename T>
std::vector<int32_t> row_argmax(const Graph<T>& g, Var x) {
  BERT_DISPATCH_CUDA(g, row_argmax(g, x))
  const TensorView<T> v = g.value(x);
  const int64_t cols = v.shape().last(), rows = v.shape().rows();
  std::vector<int32_t> out(static_cast<size_t>(rows));
  const T* data = v.data();
  parallel_for(rows, rows_per_thread(cols, 16), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      // What std::max_element gives, found faster (its scalar scan waits on each comparison in turn): the
      // first position of the largest value that is not NaN (max_element never moves onto a NaN), from
      // a vector reduction and a scan for its first occurrence; 0 when the row starts with NaN (nothing
      // compares above it).
      const T* row = data + r * cols;
      if (cols == 0 || std::isnan(row[0])) {
        out[r] = 0;
        continue;
      }
      out[r] = static_cast<int32_t>(vec::index_of(row, cols, vec::max_of_numbers(row, cols)));
    }
  });
  return out;
}

template <typename T>
double abs_max(Graph<T>& g, Var x) {
  BERT_DISPATCH_CUDA(g, abs_max(g, x))
  const TensorView<T> v = g.value(x);
  double m = 0;
  for (T e : v) {
    const double a = std::abs(static_cast<double>(e));
    if (!(a <= static_cast<double>(std::numeric_limits<T>::max()))) return std::numeric_limits<double>::infinity();
    m = std::max(m, a);
  }
  return m;
}

template <typename T>
std::vector<int64_t> abs_histogram(Graph<T>& g, Var x, double range, int bins) {
  BERT_CHECK(range > 0 && bins > 0, "abs_histogram needs a positive range and bin count");
  BERT_DISPATCH_CUDA(g, abs_histogram(g, x, range, bins))
  const double inv_width = bins / range;
  std::vector<int64_t> counts(static_cast<size_t>(bins), 0);
  for (T e : g.value(x)) ++counts[std::min(bins - 1, static_cast<int>(std::abs(static_cast<double>(e)) * inv_width))];
  return counts;
}

#define BERT_INSTANTIATE(T)                                                                               \
  template Var sum<T>(Graph<T>&, Var);                                                                    \
  template Var mean<T>(Graph<T>&, Var);                                                                   \
  template Var cross_entropy<T>(Graph<T>&, Var, std::span<const int32_t>, std::span<const T>, int32_t);   \
  template Var distillation_loss<T>(Graph<T>&, Var, Var, double);                                         \
  template Var mean_squared_error<T>(Graph<T>&, Var, Var);                                                \
  template LinearScores cross_entropy_scores<T>(Graph<T>&, Var, std::span<const int32_t>, PredictionsTo); \
  template std::vector<int32_t> row_argmax<T>(const Graph<T>&, Var);                                      \
  template double abs_max<T>(Graph<T>&, Var);                                                             \
  template std::vector<int64_t> abs_histogram<T>(Graph<T>&, Var, double, int);
BERT_INSTANTIATE(float)
BERT_INSTANTIATE(double)
#undef BERT_INSTANTIATE

}  // namespace bert::ops
