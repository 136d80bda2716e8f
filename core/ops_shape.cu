// Shape ops (reshape, permute) and row gathering on a CUDA device, forward and backward side by side
// like core/ops_shape.cpp. The gather's backward adds rows in a fixed order (no atomics), so repeated
// ids (padding, [CLS]) give the same gradient on every run.
#include <algorithm>
#include <numeric>

#include "core/cuda/common.cuh"
#include "core/ops_cuda.h"

namespace bert::ops::cuda_impl {

namespace {

struct Permute {
  int64_t out_dims[4];
  int64_t in_stride[4];  // input stride walked by each output axis
};

__global__ void permute_kernel(float* out, const float* in, Permute p, int64_t n, bool backward) {
  BERT_GRID_STRIDE(o, n) {
    int64_t rest = o, i = 0;
    for (int axis = 3; axis >= 0; --axis) {
      i += (rest % p.out_dims[axis]) * p.in_stride[axis];
      rest /= p.out_dims[axis];
    }
    if (backward) out[i] += in[o];  // a bijection: no write conflicts
    else out[o] = in[i];
  }
}

__global__ void gather_forward(float* y, const float* table, const int32_t* ids, int64_t n, int64_t cols) {
  BERT_GRID_STRIDE(e, n * cols) y[e] = table[int64_t(ids[e / cols]) * cols + e % cols];
}

// Row `unique[u]` of the table gets the sum of dy's rows order[begin[u] .. begin[u + 1]), in order.
__global__ void gather_backward(float* dtable, const float* dy, const int32_t* unique, const int32_t* begin,
                                const int32_t* order, int64_t n_unique, int64_t cols) {
  BERT_GRID_STRIDE(e, n_unique * cols) {
    const int64_t u = e / cols, c = e % cols;
    float acc = 0;
    for (int32_t k = begin[u]; k < begin[u + 1]; ++k) acc += dy[int64_t(order[k]) * cols + c];
    dtable[int64_t(unique[u]) * cols + c] += acc;
  }
}

}  // namespace

Var reshape(Graph<float>& g, Var x, Shape shape) {
  Var y = g.emit_alias(g.value(x).reshaped(shape), {x});
  g.on_backward(y, [x, y](Graph<float>& g) {
    const int64_t n = g.value(y).numel();
    BERT_LAUNCH(cuda::accumulate_kernel<float>, n, g, g.grad(x).data(), g.grad(y).data(), 1.0f, n);
  });
  return y;
}

Var permute(Graph<float>& g, Var x, std::initializer_list<int> perm) {
  const Shape in = g.shape(x);
  const int rank = in.rank();
  BERT_CHECK(static_cast<int>(perm.size()) == rank, "permute of " + in.str() + " needs " + std::to_string(rank) + " axes");
  int64_t stride[4] = {0, 0, 0, 0}, s = 1;
  for (int i = rank - 1; i >= 0; --i) {
    stride[i] = s;
    s *= in[i];
  }
  Permute p{{1, 1, 1, 1}, {0, 0, 0, 0}};
  Shape out = in;
  bool seen[4] = {false, false, false, false};
  int i = 0;
  for (int axis : perm) {
    BERT_CHECK(axis >= 0 && axis < rank && !seen[axis], "permute: bad axis list for " + in.str());
    seen[axis] = true;
    out[i] = in[axis];
    p.out_dims[4 - rank + i] = in[axis];
    p.in_stride[4 - rank + i] = stride[axis];
    ++i;
  }
  Var y = g.emit(out, {x});
  const int64_t n = in.numel();
  BERT_LAUNCH(permute_kernel, n, g, g.value(y).data(), g.value(x).data(), p, n, false);
  g.on_backward(y, [x, y, p, n](Graph<float>& g) {
    BERT_LAUNCH(permute_kernel, n, g, g.grad(x).data(), g.grad(y).data(), p, n, true);
  });
  return y;
}

Var gather_rows(Graph<float>& g, Var table, std::span<const int32_t> ids, Shape ids_shape) {
  const Shape ts = g.shape(table);
  BERT_CHECK(ts.rank() == 2, "gather_rows table must be 2-D, got " + ts.str());
  BERT_CHECK(ids_shape.numel() == static_cast<int64_t>(ids.size()) && ids_shape.rank() < 4,
             "gather_rows: " + std::to_string(ids.size()) + " ids for ids shape " + ids_shape.str());
  const int64_t rows = ts[0], cols = ts[1], n = ids_shape.numel();
  Shape out = ids_shape;
  out = ids_shape.rank() == 0 ? Shape{cols}
        : ids_shape.rank() == 1 ? Shape{ids_shape[0], cols}
        : ids_shape.rank() == 2 ? Shape{ids_shape[0], ids_shape[1], cols}
                                : Shape{ids_shape[0], ids_shape[1], ids_shape[2], cols};
  for (int64_t i = 0; i < n; ++i)
    BERT_CHECK(ids[i] >= 0 && ids[i] < rows,
               "gather_rows: id " + std::to_string(ids[i]) + " outside table of " + std::to_string(rows) + " rows");
  const int32_t* device_ids = g.upload(ids.data(), static_cast<size_t>(n));
  Var y = g.emit(out, {table});
  BERT_LAUNCH(gather_forward, n * cols, g, g.value(y).data(), g.value(table).data(), device_ids, n, cols);
  if (!g.requires_grad(y)) return y;
  // For backward: the positions of each distinct id, grouped (a counting sort on the host).
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return ids[a] < ids[b]; });
  std::vector<int32_t> unique, begin;
  for (int64_t k = 0; k < n; ++k)
    if (k == 0 || ids[order[k]] != ids[order[k - 1]]) {
      unique.push_back(ids[order[k]]);
      begin.push_back(static_cast<int32_t>(k));
    }
  begin.push_back(static_cast<int32_t>(n));
  const int64_t n_unique = static_cast<int64_t>(unique.size());
  const int32_t* d_unique = g.upload(unique.data(), unique.size());
  const int32_t* d_begin = g.upload(begin.data(), begin.size());
  const int32_t* d_order = g.upload(order.data(), order.size());
  g.on_backward(y, [table, y, d_unique, d_begin, d_order, n_unique, cols](Graph<float>& g) {
    BERT_LAUNCH(gather_backward, n_unique * cols, g, g.grad(table).data(), g.grad(y).data(), d_unique, d_begin, d_order,
                n_unique, cols);
  });
  return y;
}

}  // namespace bert::ops::cuda_impl
