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

// I: the index type, 32-bit whenever the tensor allows (64-bit division costs several times more).
template <typename I>
__global__ void permute_kernel(float* out, const float* in, Permute p, int64_t n, bool backward, bool accumulate) {
  BERT_GRID_STRIDE(o, n) {
    I rest = static_cast<I>(o), i = 0;
    for (int axis = 3; axis >= 0; --axis) {
      i += (rest % static_cast<I>(p.out_dims[axis])) * static_cast<I>(p.in_stride[axis]);
      rest /= static_cast<I>(p.out_dims[axis]);
    }
    if (backward)
      cuda::store_grad(out, i, in[o], accumulate);  // a bijection: no write conflicts
    else
      out[o] = in[i];
  }
}

// The same permutation when the innermost axis stays innermost and holds a multiple of 4 floats:
// whole float4s move, and the index arithmetic is done once per 4 elements.
__global__ void permute_rows_kernel(float4* out, const float4* in, Permute p, int64_t n4, bool backward,
                                    bool accumulate) {
  const int32_t d3 = static_cast<int32_t>(p.out_dims[3] / 4);
  BERT_GRID_STRIDE(o, n4) {
    int32_t rest = static_cast<int32_t>(o / d3), i = 0;
    const int32_t inner = static_cast<int32_t>(o % d3);
    for (int axis = 2; axis >= 0; --axis) {
      i += (rest % static_cast<int32_t>(p.out_dims[axis])) * static_cast<int32_t>(p.in_stride[axis] / 4);
      rest /= static_cast<int32_t>(p.out_dims[axis]);
    }
    i += inner;
    if (backward && accumulate) {
      float4 a = out[i];
      const float4 b = in[o];
      a.x += b.x, a.y += b.y, a.z += b.z, a.w += b.w;
      out[i] = a;
    } else if (backward) {
      out[i] = in[o];
    } else {
      out[o] = in[i];
    }
  }
}

__global__ void gather_forward(float* y, const float* table, const int32_t* ids, int64_t n, int64_t cols) {
  BERT_GRID_STRIDE(e, n * cols) y[e] = table[int64_t(ids[e / cols]) * cols + e % cols];
}

// The positions of one id are summed in chunks of at most kGatherChunk (in parallel), then the chunks
// of each id in order: a fixed order whatever the id frequencies, and no long serial loop for a
// frequent id (padding, segment ids).
constexpr int64_t kGatherChunk = 64;

// Pass 1: partial[k] (a row of cols) = sum of dy's rows order[chunk_begin[k] .. chunk_begin[k + 1]).
__global__ void gather_backward_chunks(float* partial, const float* dy, const int32_t* chunk_begin,
                                       const int32_t* order, int64_t n_chunks, int64_t cols) {
  BERT_GRID_STRIDE(e, n_chunks * cols) {
    const int64_t k = e / cols, c = e % cols;
    float acc = 0;
    for (int32_t i = chunk_begin[k]; i < chunk_begin[k + 1]; ++i) acc += dy[int64_t(order[i]) * cols + c];
    partial[e] = acc;
  }
}

// Pass 2: row unique[u] of the table += the sum of its chunks first_chunk[u] .. first_chunk[u + 1].
__global__ void gather_backward_rows(float* dtable, const float* partial, const int32_t* unique,
                                     const int32_t* first_chunk, int64_t n_unique, int64_t cols) {
  BERT_GRID_STRIDE(e, n_unique * cols) {
    const int64_t u = e / cols, c = e % cols;
    float acc = 0;
    for (int32_t k = first_chunk[u]; k < first_chunk[u + 1]; ++k) acc += partial[int64_t(k) * cols + c];
    dtable[int64_t(unique[u]) * cols + c] += acc;
  }
}

}  // namespace

// No copy either way: the output's value and gradient are views of x's.
Var reshape(Graph<float>& g, Var x, Shape shape) { return g.emit_view(x, shape); }

Var permute(Graph<float>& g, Var x, std::initializer_list<int> perm) {
  const Shape in = g.shape(x);
  const int rank = in.rank();
  BERT_CHECK(static_cast<int>(perm.size()) == rank,
             "permute of " + in.str() + " needs " + std::to_string(rank) + " axes");
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
  const bool small = n < (int64_t{1} << 31);
  // Rows: the innermost axis stays put (its input stride is 1) and is a multiple of 4 (workspace
  // buffers are 64-byte aligned, so float4 accesses are aligned).
  const bool rows = small && p.in_stride[3] == 1 && p.out_dims[3] % 4 == 0;
  auto launch = [p, n, small, rows](const Graph<float>& g, float* out, const float* in, bool backward,
                                    bool accumulate) {
    if (rows && reinterpret_cast<uintptr_t>(out) % 16 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0)
      BERT_LAUNCH(permute_rows_kernel, n / 4, g, reinterpret_cast<float4*>(out), reinterpret_cast<const float4*>(in), p,
                  n / 4, backward, accumulate);
    else if (small)
      BERT_LAUNCH(permute_kernel<int32_t>, n, g, out, in, p, n, backward, accumulate);
    else
      BERT_LAUNCH(permute_kernel<int64_t>, n, g, out, in, p, n, backward, accumulate);
  };
  launch(g, g.value(y).data(), g.value(x).data(), false, false);
  g.on_backward(y, [x, y, launch](Graph<float>& g) {
    const auto dx = g.grad_target(x);
    launch(g, dx.data, g.grad(y).data(), true, dx.accumulate);
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
  out = ids_shape.rank() == 0   ? Shape{cols}
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
  // For backward: the positions of each distinct id, grouped (sorted on the host), cut into chunks.
  // A counting sort, stable (positions of one id stay in order) and linear: a comparison sort of a
  // batch's 32k token ids took milliseconds of host time at the start of every step.
  std::vector<int32_t> order(static_cast<size_t>(n)), next(static_cast<size_t>(rows) + 1, 0);
  for (int64_t k = 0; k < n; ++k) ++next[ids[k] + 1];
  for (int64_t r = 0; r < rows; ++r) next[r + 1] += next[r];
  for (int64_t k = 0; k < n; ++k) order[next[ids[k]]++] = static_cast<int32_t>(k);
  std::vector<int32_t> unique, first_chunk, chunk_begin;
  for (int64_t k = 0; k < n; ++k) {
    const bool new_id = k == 0 || ids[order[k]] != ids[order[k - 1]];
    if (new_id) {
      unique.push_back(ids[order[k]]);
      first_chunk.push_back(static_cast<int32_t>(chunk_begin.size()));
    }
    if (new_id || k - chunk_begin.back() == kGatherChunk) chunk_begin.push_back(static_cast<int32_t>(k));
  }
  first_chunk.push_back(static_cast<int32_t>(chunk_begin.size()));
  chunk_begin.push_back(static_cast<int32_t>(n));
  const int64_t n_unique = static_cast<int64_t>(unique.size());
  const int64_t n_chunks = static_cast<int64_t>(chunk_begin.size()) - 1;
  const int32_t* d_unique = g.upload(unique.data(), unique.size());
  const int32_t* d_first_chunk = g.upload(first_chunk.data(), first_chunk.size());
  const int32_t* d_chunk_begin = g.upload(chunk_begin.data(), chunk_begin.size());
  const int32_t* d_order = g.upload(order.data(), order.size());
  g.on_backward(y, [=](Graph<float>& g) {
    if (n_chunks == 0) return;
    float* partial = g.scratch<float>(n_chunks * cols);
    BERT_LAUNCH(gather_backward_chunks, n_chunks * cols, g, partial, g.grad(y).data(), d_chunk_begin, d_order, n_chunks,
                cols);
    BERT_LAUNCH(gather_backward_rows, n_unique * cols, g, g.grad(table).data(), partial, d_unique, d_first_chunk,
                n_unique, cols);
  });
  return y;
}

}  // namespace bert::ops::cuda_impl
