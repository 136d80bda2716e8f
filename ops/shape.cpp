// Shape ops (reshape, permute/transpose) and row gathering (embedding lookup): forward and backward
// side by side.
#include <algorithm>
#include <array>
#include <vector>

#include "ops/cuda_impl.h"
#include "ops/ops.h"
#include "sys/parallel.h"

namespace bert::ops {

template <typename T>
Var reshape(Graph<T>& g, Var x, Shape shape) {
  BERT_DISPATCH_CUDA(g, reshape(g, x, shape))
  BERT_CHECK(shape.numel() == g.shape(x).numel(), "reshape of " + g.shape(x).str() + " to " + shape.str());
  // x's value and gradient under another shape: no backward, no copy of the gradient.
  return g.emit_view(x, shape);
}

namespace {

// Index arithmetic of a permutation, padded to rank 4 on the left with size-1 axes.
struct PermutePlan {
  Shape out;
  std::array<int64_t, 4> out_dims{1, 1, 1, 1};
  std::array<int64_t, 4> in_stride_for_out_axis{};  // input stride walked by each output axis
};

PermutePlan plan_permute(const Shape& in, std::initializer_list<int> perm) {
  const int rank = in.rank();
  BERT_CHECK(static_cast<int>(perm.size()) == rank,
             "permute of " + in.str() + " needs " + std::to_string(rank) + " axes");
  std::array<int64_t, 4> in_stride{};
  int64_t s = 1;
  for (int i = rank - 1; i >= 0; --i) {
    in_stride[i] = s;
    s *= in[i];
  }
  PermutePlan p;
  p.out = in;
  std::array<bool, 4> seen{};
  int i = 0;
  for (int axis : perm) {
    BERT_CHECK(axis >= 0 && axis < rank && !seen[axis], "permute: bad axis list for " + in.str());
    seen[axis] = true;
    p.out[i] = in[axis];
    p.out_dims[4 - rank + i] = in[axis];
    p.in_stride_for_out_axis[4 - rank + i] = in_stride[axis];
    ++i;
  }
  return p;
}

// fn(out_index, in_index) over all elements; parallel over the outer axes.
template <typename Fn>
void walk_permute(const PermutePlan& p, Fn fn) {
  const auto& d = p.out_dims;
  const auto& st = p.in_stride_for_out_axis;
  const int64_t inner = std::max<int64_t>(d[2] * d[3], 1);
  parallel_for(d[0] * d[1], std::max<int64_t>((int64_t{1} << 15) / inner, 1), [&](int64_t lo, int64_t hi) {
    for (int64_t outer = lo; outer < hi; ++outer) {
      int64_t i0 = outer / d[1], i1 = outer % d[1];
      int64_t o = outer * d[2] * d[3];
      for (int64_t i2 = 0; i2 < d[2]; ++i2) {
        int64_t base = i0 * st[0] + i1 * st[1] + i2 * st[2];
        for (int64_t i3 = 0; i3 < d[3]; ++i3, ++o) fn(o, base + i3 * st[3]);
      }
    }
  });
}

}  // namespace

template <typename T>
Var permute(Graph<T>& g, Var x, std::initializer_list<int> perm) {
  BERT_DISPATCH_CUDA(g, permute(g, x, perm))
  const PermutePlan p = plan_permute(g.shape(x), perm);
  Var y = g.emit(p.out, {x});
  const T* xv = g.value(x).data();
  T* yv = g.value(y).data();
  walk_permute(p, [&](int64_t o, int64_t i) { yv[o] = xv[i]; });
  g.on_backward(y, [x, y, p](Graph<T>& g) {
    const auto dx = g.grad_target(x);
    const T* dy = g.grad(y).data();
    // A bijection: every element of dx written once, no write conflicts.
    if (dx.accumulate)
      walk_permute(p, [&](int64_t o, int64_t i) { dx.data[i] += dy[o]; });
    else
      walk_permute(p, [&](int64_t o, int64_t i) { dx.data[i] = dy[o]; });
  });
  return y;
}

template <typename T>
Var transpose(Graph<T>& g, Var x, int axis0, int axis1) {
  const Shape& s = g.shape(x);
  std::array<int, 4> perm{0, 1, 2, 3};
  std::swap(perm[s.normalize_axis(axis0)], perm[s.normalize_axis(axis1)]);
  switch (s.rank()) {
    case 2:
      return permute(g, x, {perm[0], perm[1]});
    case 3:
      return permute(g, x, {perm[0], perm[1], perm[2]});
    case 4:
      return permute(g, x, {perm[0], perm[1], perm[2], perm[3]});
    default:
      BERT_CHECK(false, "transpose needs rank 2 to 4, got " + s.str());
  }
  return x;
}

template <typename T>
Var gather_rows(Graph<T>& g, Var table, std::span<const int32_t> ids, Shape ids_shape) {
  BERT_DISPATCH_CUDA(g, gather_rows(g, table, ids, ids_shape))
  const Shape& ts = g.shape(table);
  BERT_CHECK(ts.rank() == 2, "gather_rows table must be 2-D, got " + ts.str());
  BERT_CHECK(ids_shape.numel() == static_cast<int64_t>(ids.size()) && ids_shape.rank() < 4,
             "gather_rows: " + std::to_string(ids.size()) + " ids for ids shape " + ids_shape.str());
  const int64_t rows = ts[0], cols = ts[1], n = ids_shape.numel();
  const Shape out = [&] {  // ids_shape + (C)
    switch (ids_shape.rank()) {
      case 0:
        return Shape{cols};
      case 1:
        return Shape{ids_shape[0], cols};
      case 2:
        return Shape{ids_shape[0], ids_shape[1], cols};
      default:
        return Shape{ids_shape[0], ids_shape[1], ids_shape[2], cols};
    }
  }();
  // Keep a copy of the ids for backward: the caller's buffer may be gone by then.
  int32_t* saved = g.template scratch<int32_t>(n);
  for (int64_t i = 0; i < n; ++i) {
    BERT_CHECK(ids[i] >= 0 && ids[i] < rows,
               "gather_rows: id " + std::to_string(ids[i]) + " outside table of " + std::to_string(rows) + " rows");
    saved[i] = ids[i];
  }
  Var y = g.emit(out, {table});
  const T* tv = g.value(table).data();
  T* yv = g.value(y).data();
  parallel_for(n, rows_per_thread(cols, 64), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) std::copy(tv + saved[i] * cols, tv + (saved[i] + 1) * cols, yv + i * cols);
  });
  g.on_backward(y, [table, y, saved, n, cols](Graph<T>& g) {
    T* dt = g.grad(table).data();
    const T* dy = g.grad(y).data();
    // Repeated ids add into the same row, so threads split the columns (16 at a time: a cache line of
    // floats) rather than the ids; each column sums its ids in order, whatever the thread count.
    constexpr int64_t kColumnsPerChunk = 16;
    const int64_t chunks = (cols + kColumnsPerChunk - 1) / kColumnsPerChunk;
    parallel_for(chunks, std::max<int64_t>(1, kElementwiseGrain / std::max<int64_t>(n * kColumnsPerChunk, 1)),
                 [&](int64_t lo, int64_t hi) {
                   const int64_t c0 = lo * kColumnsPerChunk, c1 = std::min(cols, hi * kColumnsPerChunk);
                   for (int64_t i = 0; i < n; ++i) {
                     T* row = dt + saved[i] * cols;
                     const T* from = dy + i * cols;
                     for (int64_t c = c0; c < c1; ++c) row[c] += from[c];
                   }
                 });
  });
  return y;
}

#define BERT_INSTANTIATE(T)                                            \
  template Var reshape<T>(Graph<T>&, Var, Shape);                      \
  template Var permute<T>(Graph<T>&, Var, std::initializer_list<int>); \
  template Var transpose<T>(Graph<T>&, Var, int, int);                 \
  template Var gather_rows<T>(Graph<T>&, Var, std::span<const int32_t>, Shape);
BERT_INSTANTIATE(float)
BERT_INSTANTIATE(double)
#undef BERT_INSTANTIATE

}  // namespace bert::ops
