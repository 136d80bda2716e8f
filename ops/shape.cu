// Shape ops (reshape, permute) and row gathering on a CUDA device, forward and backward side by side
// like ops/shape.cpp. The gather's backward adds rows in a fixed order (no atomics), so repeated
// ids (padding, [CLS]) give the same gradient on every run.
#include <algorithm>
#include <cstddef>
#include <span>

#include "ops/cuda/fake_quantize.cuh"
#include "ops/cuda_impl.h"

namespace bert::ops::cuda_impl {

namespace {

struct Permute {
  int64_t out_dims[4];
  int64_t in_stride[4];  // input stride walked by each output axis
};

// I: the index type, 32-bit whenever the tensor allows (64-bit division costs several times more).
template <typename I, typename A>
__global__ void permute_kernel(A* out, const A* in, Permute p, int64_t n, bool backward, bool accumulate) {
  BERT_GRID_STRIDE(o, n) {
    I rest = static_cast<I>(o), i = 0;
    for (int axis = 3; axis >= 0; --axis) {
      i += (rest % static_cast<I>(p.out_dims[axis])) * static_cast<I>(p.in_stride[axis]);
      rest /= static_cast<I>(p.out_dims[axis]);
    }
    if (backward)
      cuda::store_grad(out, i, cuda::to_float(in[o]), accumulate);  // a bijection: no write conflicts
    else
      out[o] = in[i];
  }
}

// The same permutation when the innermost axis stays innermost and holds a multiple of W elements:
// packs of W move (W = 8 BF16 values: one 16-byte access), and the index arithmetic is done once per pack.
template <typename A, int W>
__global__ void permute_rows_kernel(A* out, const A* in, Permute p, int64_t packs, bool backward, bool accumulate) {
  const int32_t d3 = static_cast<int32_t>(p.out_dims[3] / W);
  BERT_GRID_STRIDE(o, packs) {
    int32_t rest = static_cast<int32_t>(o / d3), i = 0;
    const int32_t inner = static_cast<int32_t>(o % d3);
    for (int axis = 2; axis >= 0; --axis) {
      i += (rest % static_cast<int32_t>(p.out_dims[axis])) * static_cast<int32_t>(p.in_stride[axis] / W);
      rest /= static_cast<int32_t>(p.out_dims[axis]);
    }
    i += inner;
    if (backward && accumulate) {
      cuda::Pack<A, W> a = cuda::load_pack<W>(out + W * int64_t(i));
      const cuda::Pack<A, W> b = cuda::load_pack<W>(in + W * o);
      for (int j = 0; j < W; ++j) a.v[j] = cuda::from_float<A>(cuda::to_float(a.v[j]) + cuda::to_float(b.v[j]));
      cuda::store_pack<W>(out + W * int64_t(i), a);
    } else if (backward) {
      cuda::store_pack<W>(out + W * int64_t(i), cuda::load_pack<W>(in + W * o));
    } else {
      cuda::store_pack<W>(out + W * o, cuda::load_pack<W>(in + W * int64_t(i)));
    }
  }
}

// y (dtype Y) = x (dtype X), element by element; also a conversion's backward (accumulating).
template <int W, typename Y, typename X>
__global__ void convert_kernel(Y* y, const X* x, int64_t n, bool accumulate) {
  BERT_GRID_STRIDE_PACKS(i, n, W) {
    const cuda::Pack<X, W> in = cuda::load_pack<W>(x + i);
    cuda::Pack<Y, W> out;
    if (accumulate) out = cuda::load_pack<W>(y + i);
    for (int j = 0; j < W; ++j)
      out.v[j] = cuda::from_float<Y>(accumulate ? cuda::to_float(out.v[j]) + cuda::to_float(in.v[j])
                                                : cuda::to_float(in.v[j]));
    cuda::store_pack<W>(y + i, out);
  }
}

// W elements a thread (packs of 4 where the width and both pointers allow); I the index type, 32-bit
// where the output allows (a 64-bit division costs several times more).
template <int W, typename I, typename Y, typename X>
__global__ void gather_forward(Y* y, const X* table, const int32_t* ids, int64_t n, int64_t cols) {
  BERT_GRID_STRIDE_PACKS(e, n * cols, W) {
    const I row = I(e) / I(cols), col = I(e) - row * I(cols);
    const cuda::Pack<X, W> in = cuda::load_pack<W>(table + int64_t(ids[row]) * cols + col);
    cuda::Pack<Y, W> out;
    for (int j = 0; j < W; ++j) out.v[j] = cuda::from_float<Y>(cuda::to_float(in.v[j]));
    cuda::store_pack<W>(y + e, out);
  }
}

// The positions of one id are summed in chunks of at most kGatherChunk (in parallel), then the chunks
// of each id in order: a fixed order whatever the id frequencies, and no long serial loop for a
// frequent id (padding, segment ids). The grouping is made on the host, where the ids are, as the forward
// uploads them (one upload, no kernels: a sort and two scans on the GPU took about ten launches a gather):
// the positions sorted by id (a stable counting sort: an id's positions stay in order), then each run of
// one id cut into chunks.
constexpr int64_t kGatherChunk = 64;

// The layout, in one array of host scratch memory: order (n: the positions sorted by id), chunk_begin
// (chunks + 1: chunk k's first sorted position, n after the last chunk), unique (runs: run u's id),
// first_chunk (runs + 1: its first chunk, the chunk count after the last run), counts (2: runs, chunks).
// O(n + rows): a count per row, then each row's chunks, then the positions placed in order.
struct GatherLayout {
  const int32_t* data = nullptr;
  int64_t size = 0, runs = 0, chunks = 0;
  int64_t chunk_begin = 0, unique = 0, first_chunk = 0, counts = 0;  // offsets into data
};
GatherLayout gather_layout(Graph<float>& g, std::span<const int32_t> ids, int64_t rows) {
  const int64_t n = static_cast<int64_t>(ids.size());
  int32_t* begin = g.host_scratch<int32_t>(static_cast<size_t>(rows) + 1);  // counts, then each id's next slot
  std::fill(begin, begin + rows + 1, 0);
  for (int32_t id : ids) ++begin[id + 1];
  GatherLayout l;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t count = begin[r + 1];
    l.runs += count > 0;
    l.chunks += (count + kGatherChunk - 1) / kGatherChunk;
    begin[r + 1] += begin[r];
  }
  l.chunk_begin = n, l.unique = n + l.chunks + 1, l.first_chunk = l.unique + l.runs;
  l.counts = l.first_chunk + l.runs + 1, l.size = l.counts + 2;
  int32_t* d = g.host_scratch<int32_t>(static_cast<size_t>(l.size));
  int32_t *chunk_begin = d + l.chunk_begin, *unique = d + l.unique, *first_chunk = d + l.first_chunk;
  for (int64_t r = 0, u = 0, k = 0; r < rows; ++r) {
    if (begin[r + 1] == begin[r]) continue;
    unique[u] = static_cast<int32_t>(r), first_chunk[u++] = static_cast<int32_t>(k);
    for (int32_t at = begin[r]; at < begin[r + 1]; at += kGatherChunk) chunk_begin[k++] = at;
  }
  chunk_begin[l.chunks] = static_cast<int32_t>(n), first_chunk[l.runs] = static_cast<int32_t>(l.chunks);
  d[l.counts] = static_cast<int32_t>(l.runs), d[l.counts + 1] = static_cast<int32_t>(l.chunks);
  for (int64_t i = 0; i < n; ++i) d[begin[ids[i]]++] = static_cast<int32_t>(i);  // in order within an id
  l.data = d;
  return l;
}

// Pass 1: partial[k] (a row of cols) = sum of dy's rows order[chunk_begin[k] .. chunk_begin[k + 1]).
template <typename Y>
__global__ void gather_backward_chunks(float* partial, const Y* dy, const int32_t* chunk_begin, const int32_t* order,
                                       const int32_t* counts, int64_t cols) {
  BERT_GRID_STRIDE(e, int64_t(counts[1]) * cols) {
    const int64_t k = e / cols, c = e % cols;
    float acc = 0;
    for (int32_t i = chunk_begin[k]; i < chunk_begin[k + 1]; ++i)
      acc += cuda::to_float(dy[int64_t(order[i]) * cols + c]);
    partial[e] = acc;
  }
}

// Pass 2: row unique[u] of the table += the sum of its chunks first_chunk[u] .. first_chunk[u + 1].
template <typename X>
__global__ void gather_backward_rows(X* dtable, const float* partial, const int32_t* unique, const int32_t* first_chunk,
                                     const int32_t* counts, int64_t cols) {
  BERT_GRID_STRIDE(e, int64_t(counts[0]) * cols) {
    const int64_t u = e / cols, c = e % cols;
    float acc = 0;
    for (int32_t k = first_chunk[u]; k < first_chunk[u + 1]; ++k) acc += partial[int64_t(k) * cols + c];
    const int64_t at = int64_t(unique[u]) * cols + c;
    dtable[at] = cuda::from_float<X>(cuda::to_float(dtable[at]) + acc);
  }
}

}  // namespace

// No copy either way: the output's value and gradient are views of x's.
Var reshape(Graph<float>& g, Var x, Shape shape) { return g.emit_view(x, shape); }

Var to_dtype(Graph<float>& g, Var x, DType dtype) {
  const DType from = g.dtype(x);
  if (from == dtype) return x;
  const int64_t n = g.shape(x).numel();
  Var y = g.emit(g.shape(x), {x}, dtype);
  auto convert = [n](const Graph<float>& g, void* out, DType out_type, const void* in, DType in_type, bool accumulate) {
    cuda::with_element_type(out_type, [&](auto out_tag) {
      cuda::with_element_type(in_type, [&](auto in_tag) {
        using Y = typename decltype(out_tag)::type;
        using X = typename decltype(in_tag)::type;
        Y* o = static_cast<Y*>(out);
        const X* i = static_cast<const X*>(in);
        BERT_LAUNCH_PACKED(convert_kernel, n, cuda::packs_of_4(n, {o, i}), g, o, i, n, accumulate);
      });
    });
  };
  convert(g, g.data(y), dtype, g.data(x), from, false);
  g.on_backward(y, [x, y, from, dtype, convert](Graph<float>& g) {
    const auto dx = g.raw_grad_target(x);
    convert(g, dx.data, from, g.grad_data(y), dtype, dx.accumulate);
  });
  return y;
}

namespace {
// The permutation of a rank <= 4 tensor `in`, padded to rank 4 on the left; *out gets the output shape.
Permute plan_permute(const Shape& in, std::initializer_list<int> perm, Shape* out) {
  const int rank = in.rank();
  BERT_CHECK(static_cast<int>(perm.size()) == rank,
             "permute of " + in.str() + " needs " + std::to_string(rank) + " axes");
  int64_t stride[4] = {0, 0, 0, 0}, s = 1;
  for (int i = rank - 1; i >= 0; --i) {
    stride[i] = s;
    s *= in[i];
  }
  Permute p{{1, 1, 1, 1}, {0, 0, 0, 0}};
  *out = in;
  bool seen[4] = {false, false, false, false};
  int i = 0;
  for (int axis : perm) {
    BERT_CHECK(axis >= 0 && axis < rank && !seen[axis], "permute: bad axis list for " + in.str());
    seen[axis] = true;
    (*out)[i] = in[axis];
    p.out_dims[4 - rank + i] = in[axis];
    p.in_stride[4 - rank + i] = stride[axis];
    ++i;
  }
  return p;
}
}  // namespace

Var permute(Graph<float>& g, Var x, std::initializer_list<int> perm) {
  const Shape in = g.shape(x);
  Shape out;
  const Permute p = plan_permute(in, perm, &out);
  x = as_activation(g, x);
  const DType dtype = g.dtype(x);
  Var y = g.emit(out, {x}, dtype);
  const int64_t n = in.numel();
  const bool small = n < (int64_t{1} << 31);
  // Rows: the innermost axis stays put (its input stride is 1) and is a multiple of 4 (workspace
  // buffers are 64-byte aligned, so packs of 4 are aligned).
  const bool rows = small && p.in_stride[3] == 1 && p.out_dims[3] % 4 == 0;
  auto launch = [p, n, small, rows, dtype](const Graph<float>& g, void* out, const void* in, bool backward,
                                           bool accumulate) {
    cuda::with_element_type(dtype, [&](auto tag) {
      using A = typename decltype(tag)::type;
      A* o = static_cast<A*>(out);
      const A* i = static_cast<const A*>(in);
      const bool aligned = reinterpret_cast<uintptr_t>(out) % 16 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0;
      constexpr int kWide = 16 / sizeof(A);  // one 16-byte access
      if (rows && aligned && p.out_dims[3] % kWide == 0) {
        auto* kernel = &permute_rows_kernel<A, kWide>;
        BERT_LAUNCH(kernel, n / kWide, g, o, i, p, n / kWide, backward, accumulate);
      } else if (rows && aligned) {
        auto* kernel = &permute_rows_kernel<A, 4>;
        BERT_LAUNCH(kernel, n / 4, g, o, i, p, n / 4, backward, accumulate);
      } else if (small) {
        auto* kernel = &permute_kernel<int32_t, A>;
        BERT_LAUNCH(kernel, n, g, o, i, p, n, backward, accumulate);
      } else {
        auto* kernel = &permute_kernel<int64_t, A>;
        BERT_LAUNCH(kernel, n, g, o, i, p, n, backward, accumulate);
      }
    });
  };
  launch(g, g.data(y), g.data(x), false, false);
  g.on_backward(y, [x, y, launch](Graph<float>& g) {
    const auto dx = g.raw_grad_target(x);
    launch(g, dx.data, g.grad_data(y), true, dx.accumulate);
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
  // The output in the activation dtype; the table (a parameter, or an activation) in its own.
  const DType table_type = g.dtype(table), out_type = g.activation_dtype();
  Var y = g.emit(out, {table}, out_type);
  cuda::with_element_type(out_type, [&](auto out_tag) {
    cuda::with_element_type(table_type, [&](auto table_tag) {
      using Y = typename decltype(out_tag)::type;
      using X = typename decltype(table_tag)::type;
      Y* out = cuda::typed<Y>(g.data(y));
      const X* from = cuda::typed<X>(g.data(table));
      const bool packed = cuda::packs_of_4(cols, {out, from});
      const int64_t total = n * cols;
      const bool small = total < (int64_t{1} << 31);
      auto* kernel = packed ? (small ? &gather_forward<4, int32_t, Y, X> : &gather_forward<4, int64_t, Y, X>)
                            : (small ? &gather_forward<1, int32_t, Y, X> : &gather_forward<1, int64_t, Y, X>);
      BERT_LAUNCH(kernel, packed ? total / 4 : total, g, out, from, device_ids, n, cols);
    });
  });
  if (!g.requires_grad(y) || n == 0) return y;
  const GatherLayout layout = gather_layout(g, ids, rows);
  const int32_t* l = g.upload(layout.data, static_cast<size_t>(layout.size));
  const int32_t *order = l, *chunk_begin = l + layout.chunk_begin, *unique = l + layout.unique;
  const int32_t *first_chunk = l + layout.first_chunk, *counts = l + layout.counts;
  const int64_t runs = layout.runs, chunks = layout.chunks;
  g.on_backward(y, [=](Graph<float>& g) {
    float* partial = g.scratch<float>(chunks * cols);
    cuda::with_element_type(out_type, [&](auto out_tag) {
      using Y = typename decltype(out_tag)::type;
      BERT_LAUNCH(gather_backward_chunks<Y>, chunks * cols, g, partial, cuda::typed<Y>(g.grad_data(y)), chunk_begin,
                  order, counts, cols);
    });
    cuda::with_element_type(table_type, [&](auto table_tag) {
      using X = typename decltype(table_tag)::type;
      BERT_LAUNCH(gather_backward_rows<X>, runs * cols, g, cuda::typed<X>(g.grad_data(table)), partial, unique,
                  first_chunk, counts, cols);
    });
  });
  return y;
}

}  // namespace bert::ops::cuda_impl
