// ops::recompute: activation checkpointing on a graph's sub-graph, device-agnostic (the ops fn runs pick
// their device).
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "ops/ops.h"

namespace bert::ops {

namespace {

// Where an input's gradient goes in the sub-graph: g's buffer, and whether it holds nothing yet.
template <typename T>
struct SubGrad {
  T* data = nullptr;  // nullptr: the value itself, for a pass that runs no backward
  bool uninitialised = false;
};

// The inputs as nodes of `sub`: constants where g takes no gradient for them, else leaves whose gradients
// go to grads[i].
template <typename T>
std::vector<Var> sub_inputs(Graph<T>& sub, Graph<T>& g, std::span<const Var> inputs,
                            const std::vector<SubGrad<T>>& grads) {
  std::vector<Var> out;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const TensorView<T> v = g.value(inputs[i]);
    if (!g.requires_grad(inputs[i])) {
      out.push_back(sub.constant(v));
      continue;
    }
    const SubGrad<T> d = grads.empty() ? SubGrad<T>{} : grads[i];
    out.push_back(sub.leaf(v, TensorView<T>(d.data ? d.data : v.data(), v.shape()), d.uninitialised));
  }
  return out;
}

}  // namespace

template <typename T>
Var recompute(Graph<T>& g, std::span<const Var> inputs, Rng& rng, Recomputed<T> fn) {
  if (!g.grad_enabled()) return fn(g, inputs, rng);
  for (const Var v : inputs)
    BERT_CHECK(g.dtype(v) == DType::kF32, std::string("recompute: an input stored as ") + dtype_name(g.dtype(v)) +
                                              " (F32 nodes only: a BF16 step keeps its tensors)");
  const Rng saved = rng;
  Graph<T>& sub = g.sub_graph();
  BERT_CHECK(sub.num_nodes() == 0, "recompute: the sub-graph is in use (a recompute inside fn runs on fn's graph)");
  sub.set_grad_enabled(true);  // the backward's path, so the recomputed values are the same
  Var y;
  {
    struct ClearOnExit {
      Graph<T>* g;
      ~ClearOnExit() { g->clear(); }
    } clear_on_exit{&sub};
    const Var out = fn(sub, sub_inputs(sub, g, inputs, {}), rng);
    BERT_CHECK(sub.dtype(out) == DType::kF32, "recompute: fn's output is not F32");
    y = g.emit(sub.shape(out), inputs, DType::kF32);
    g.device().copy_on_device(g.data(y), sub.data(out), static_cast<size_t>(sub.shape(out).numel()) * sizeof(T));
  }
  if (!g.requires_grad(y)) return y;
  std::vector<Var> in(inputs.begin(), inputs.end());
  g.on_backward(y, [in = std::move(in), saved, fn = std::move(fn), y](Graph<T>& g) {
    std::vector<SubGrad<T>> grads(in.size());
    for (size_t i = 0; i < in.size(); ++i) {
      if (!g.requires_grad(in[i])) continue;
      const auto target = g.grad_target(in[i]);
      grads[i] = {target.data, !target.accumulate};
    }
    // Fresh memory the sub-graph's first writer stores into; zeroed where two inputs share the buffer (one
    // input twice, or views of one node: the second leaf must add to the first).
    for (size_t i = 0; i < in.size(); ++i) {
      const bool shared = std::count_if(grads.begin(), grads.end(),
                                        [&](const SubGrad<T>& d) { return d.data && d.data == grads[i].data; }) > 1;
      if (!grads[i].uninitialised || !shared) continue;
      g.device().fill_zero(grads[i].data, static_cast<size_t>(g.shape(in[i]).numel()) * sizeof(T));
      for (SubGrad<T>& d : grads)
        if (d.data == grads[i].data) d.uninitialised = false;
    }
    Graph<T>& sub = g.sub_graph();
    struct ClearOnExit {  // where fn throws (backward_from clears it otherwise)
      Graph<T>* g;
      ~ClearOnExit() { g->clear(); }
    } clear_on_exit{&sub};
    sub.set_grad_enabled(true);
    Rng replay = saved;
    const Var out = fn(sub, sub_inputs(sub, g, in, grads), replay);
    sub.backward_from(out, g.grad_data(y));
  });
  return y;
}

template Var recompute<float>(Graph<float>&, std::span<const Var>, Rng&, Recomputed<float>);
template Var recompute<double>(Graph<double>&, std::span<const Var>, Rng&, Recomputed<double>);

}  // namespace bert::ops
