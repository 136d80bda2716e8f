#include "core/graph.h"

#include <algorithm>

namespace bert {

template <typename T>
const typename Graph<T>::Node& Graph<T>::node(Var v) const {
  BERT_CHECK(v.valid() && v.index < static_cast<int32_t>(nodes_.size()) && v.generation == generation_,
             "stale or invalid Var (index " + std::to_string(v.index) + "): graph was cleared since it was made");
  return nodes_[v.index];
}

template <typename T>
Var Graph<T>::push(Node n) {
  nodes_.push_back(n);
  return Var{static_cast<int32_t>(nodes_.size() - 1), generation_};
}

template <typename T>
bool Graph<T>::any_requires_grad(std::initializer_list<Var> inputs) const {
  if (!grad_enabled_) return false;
  return std::any_of(inputs.begin(), inputs.end(), [&](Var v) { return node(v).requires_grad; });
}

template <typename T>
Var Graph<T>::constant(TensorView<T> value) {
  Node n;
  n.value = value;
  n.is_leaf = true;
  return push(n);
}

template <typename T>
Var Graph<T>::leaf(TensorView<T> value, TensorView<T> grad) {
  BERT_CHECK(grad.shape() == value.shape(), "leaf grad " + grad.shape().str() + " vs value " + value.shape().str());
  Node n;
  n.value = value;
  n.grad = grad;
  n.is_leaf = true;
  n.requires_grad = grad_enabled_;
  return push(n);
}

template <typename T>
Var Graph<T>::emit(Shape shape, std::initializer_list<Var> inputs) {
  Node n;
  n.value = TensorView<T>(workspace_.allocate<T>(shape.numel()), shape);
  n.requires_grad = any_requires_grad(inputs);
  return push(n);
}

template <typename T>
Var Graph<T>::emit_alias(TensorView<T> value, std::initializer_list<Var> inputs) {
  Node n;
  n.value = value;
  n.requires_grad = any_requires_grad(inputs);
  return push(n);
}

template <typename T>
void Graph<T>::on_backward(Var out, BackwardFn fn) {
  Node& n = node(out);
  if (!n.requires_grad) return;
  BERT_CHECK(!n.is_leaf && !n.has_closure, "on_backward on a leaf or twice on one node");
  n.has_closure = true;
  closures_.emplace_back(out.index, std::move(fn));
}

template <typename T>
TensorView<T> Graph<T>::grad(Var v) {
  Node& n = node(v);
  BERT_CHECK(n.requires_grad, "grad() of a node that does not require a gradient");
  if (n.grad.empty()) {
    n.grad = TensorView<T>(workspace_.allocate<T>(n.value.numel()), n.value.shape());
    n.grad.fill(T(0));
  }
  return n.grad;
}

template <typename T>
void Graph<T>::backward(Var loss) {
  struct ClearOnExit {
    Graph* g;
    ~ClearOnExit() { g->clear(); }
  } clear_on_exit{this};

  Node& root = node(loss);
  BERT_CHECK(root.value.numel() == 1, "backward() needs a scalar loss, got shape " + root.value.shape().str());
  BERT_CHECK(root.requires_grad, "backward() from a loss that does not depend on anything requiring a gradient");
  for (const Node& n : nodes_)
    BERT_CHECK(n.is_leaf || !n.requires_grad || n.has_closure, "an op recorded a node without its backward");
  grad(loss)[0] += T(1);
  for (auto it = closures_.rbegin(); it != closures_.rend(); ++it) {
    // A node whose gradient was never touched contributes nothing: skip its closure.
    if (nodes_[it->first].grad.empty()) continue;
    it->second(*this);
  }
}

template <typename T>
void Graph<T>::clear() {
  nodes_.clear();
  closures_.clear();
  workspace_.reset();
  ++generation_;
}

template class Graph<float>;
template class Graph<double>;

}  // namespace bert
