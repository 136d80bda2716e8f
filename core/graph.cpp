#include "core/graph.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <climits>
#include <map>
#include <type_traits>

namespace bert {

const char* dtype_name(DType t) { return t == DType::kBF16 ? "bf16" : t == DType::kS8 ? "s8" : "f32"; }

namespace {
// BF16 is the top half of an IEEE float: widening is exact.
float bf16_bits_to_float(uint16_t bits) { return std::bit_cast<float>(uint32_t(bits) << 16); }
}  // namespace

template <typename T>
Graph<T>::Graph(const Device& device, std::size_t initial_workspace_bytes)
    : device_(&device), workspace_(initial_workspace_bytes, device) {
  BERT_CHECK((!device.is_cuda() || std::is_same_v<T, float>), "a CUDA graph computes in float only");
  if (device.is_cuda() && device.precision() == Precision::kBf16) activation_dtype_ = DType::kBF16;
}

template <typename T>
void* Graph<T>::allocate_bytes(std::size_t bytes) {
  if (!in_backward_ && !lent_.empty()) {
    const std::size_t rounded = (std::max<std::size_t>(bytes, 1) + Workspace::kAlignment - 1) /
                                Workspace::kAlignment * Workspace::kAlignment;
    for (Lent& r : lent_) {
      if (r.given_back || static_cast<std::size_t>(r.end - r.next) < rounded) continue;
      void* p = r.next;
      r.next += rounded;
      return p;
    }
  }
  return workspace_.allocate_bytes(bytes);
}

template <typename T>
void Graph<T>::lend(void* memory, std::size_t bytes) {
  if (!grad_enabled_ || bytes == 0) return;
  BERT_CHECK(!in_backward_, "lend() during backward");
  BERT_CHECK(reinterpret_cast<std::uintptr_t>(memory) % Workspace::kAlignment == 0,
             "lend(): memory not on a " + std::to_string(Workspace::kAlignment) + "-byte boundary");
  auto* begin = static_cast<std::byte*>(memory);
  // Leaves made before this call that overlap it are checked when an op takes them (note_consumer).
  lent_.push_back({begin, begin, begin + bytes, static_cast<int32_t>(nodes_.size()), false});
}

template <typename T>
std::size_t Graph<T>::lent_bytes_in_use() const {
  std::size_t used = 0;
  for (const Lent& r : lent_) used += static_cast<std::size_t>(r.next - r.begin);
  return used;
}

template <typename T>
void Graph<T>::give_back_lent_above(int32_t index) {
  for (auto it = lent_.rbegin(); it != lent_.rend(); ++it) {  // the latest first: they are ordered by first_node
    if (it->given_back || it->first_node <= index) continue;
    device_->fill_zero(it->begin, static_cast<std::size_t>(it->end - it->begin));
    it->given_back = true;
  }
}

template <typename T>
T* Graph<T>::allocate_grad(Node& n) {
  const std::size_t bytes = static_cast<std::size_t>(n.value.numel()) * dtype_size(n.dtype, sizeof(T));
  n.owns_grad = true;
  for (auto it = free_grads_.rbegin(); it != free_grads_.rend(); ++it) {
    if (it->bytes != bytes) continue;
    void* data = it->data;
    *it = free_grads_.back();
    free_grads_.pop_back();
    return static_cast<T*>(data);
  }
  return allocate(n.dtype, n.value.numel());
}

template <typename T>
void Graph<T>::release_grad(Node& n) {
  n.grad_released = true;
  if (!n.owns_grad || !reuse_grads_) return;
  free_grads_.push_back({static_cast<std::size_t>(n.value.numel()) * dtype_size(n.dtype, sizeof(T)), n.grad.data()});
  n.owns_grad = false;
}

template <typename T>
TensorView<T> Graph<T>::value(Var v) const {
  const Node& n = readable(v);
  BERT_CHECK(n.dtype == DType::kF32, std::string("value() of a node stored as ") + dtype_name(n.dtype) +
                                         " (read it with to_host(), or through data() in a kernel)");
  return n.value;
}

template <typename T>
Var Graph<T>::param(const Parameter<T>& p) {
  if (!device_->is_cuda()) return leaf(p.value, p.grad);
  BERT_CHECK(!p.device_value.empty(), "parameter '" + *p.name + "' is not on " + device_->name() +
                                          " (place the arena on the graph's device first)");
  const Var v = leaf(p.device_value, p.device_grad);
  node(v).bf16_copy = p.device_bf16;
  return v;
}

template <typename T>
Var Graph<T>::input(std::span<const T> host_values, Shape shape) {
  BERT_CHECK(static_cast<int64_t>(host_values.size()) == shape.numel(),
             std::to_string(host_values.size()) + " values for input shape " + shape.str());
  return constant(TensorView<T>(upload(host_values.data(), host_values.size()), shape));
}

template <typename T>
T Graph<T>::item(Var v) const {
  BERT_CHECK(node(v).value.numel() == 1, "item() of a node of shape " + node(v).value.shape().str());
  return to_host(v)[0];
}

template <typename T>
std::vector<T> Graph<T>::to_host(Var v) const {
  const Node& n = readable(v);
  std::vector<T> result(static_cast<size_t>(n.value.numel()));
  if (n.dtype == DType::kF32) {
    device_->copy_to_host(result.data(), n.value.data(), result.size() * sizeof(T));
    return result;
  }
  if (n.dtype == DType::kS8) {
    std::vector<int8_t> integers(result.size());
    device_->copy_to_host(integers.data(), n.value.data(), integers.size());
    std::copy(integers.begin(), integers.end(), result.begin());
    return result;
  }
  std::vector<uint16_t> bits(result.size());
  device_->copy_to_host(bits.data(), n.value.data(), bits.size() * sizeof(uint16_t));
  for (size_t i = 0; i < bits.size(); ++i) result[i] = static_cast<T>(bf16_bits_to_float(bits[i]));
  return result;
}

template <typename T>
const typename Graph<T>::Node& Graph<T>::node(Var v) const {
  BERT_CHECK(v.valid() && v.index < static_cast<int32_t>(nodes_.size()) && v.generation == generation_,
             "stale or invalid Var (index " + std::to_string(v.index) + "): graph was cleared since it was made");
  return nodes_[v.index];
}

template <typename T>
const typename Graph<T>::Node& Graph<T>::readable(Var v) const {
  const Node& n = node(v);
  BERT_CHECK(n.transient_slot < 0 || transient_takes_[n.transient_slot] == n.transient_take,
             std::string("the value of a node made by ") + (n.made_by ? n.made_by : "an op") +
                 " was read after its transient storage (slot " + std::to_string(n.transient_slot) +
                 ") was taken again: only the op made next may read it");
  return n;
}

template <typename T>
Var Graph<T>::push(Node n) {
  nodes_.push_back(n);
  return Var{static_cast<int32_t>(nodes_.size() - 1), generation_};
}

template <typename T>
Var Graph<T>::push_made_by(Node n, const SourceLocation& made_by) {
  n.made_by = made_by.function_name();
  if (profile_) profile_->start_forward(n.made_by, n.value.shape());
  return push(n);
}

template <typename T>
void Graph<T>::set_profile(OpProfile* profile) {
  if (profile_) profile_->stop();
  profile_ = profile;
}

template <typename T>
bool Graph<T>::any_requires_grad(std::span<const Var> inputs) const {
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
Var Graph<T>::leaf(TensorView<T> value, TensorView<T> grad, bool grad_uninitialised) {
  BERT_CHECK(grad.shape() == value.shape(), "leaf grad " + grad.shape().str() + " vs value " + value.shape().str());
  Node n;
  n.value = value;
  n.grad = grad;
  n.is_leaf = true;
  n.requires_grad = grad_enabled_;
  n.grad_unwritten = grad_uninitialised && grad_enabled_;
  return push(n);
}

template <typename T>
void Graph<T>::note_consumer(std::span<const Var> inputs, int32_t consumer) {
  for (Var v : inputs) {
    ++node(v).readers;
    Node& owner = grad_owner(v);
    if (!owner.is_leaf) continue;
    if (owner.first_consumer < 0) owner.first_consumer = consumer;
    if (!owner.grad.data()) continue;  // a leaf without gradient memory (a constant) borrows none
    const auto* begin = reinterpret_cast<const std::byte*>(owner.grad.data());
    const std::byte* end = begin + owner.grad.numel() * sizeof(T);
    for (const Lent& r : lent_)
      BERT_CHECK(end <= r.begin || begin >= r.end,
                 "an op takes a parameter whose gradient memory was lent to the forward pass (Graph::lend)");
  }
}

template <typename T>
void Graph<T>::set_bias_of(Var y, Var bias) {
  node(y).bias_of = bias.index;
}

template <typename T>
Var Graph<T>::bias_to_sum(Var y) {
  const Node& n = node(y);
  if (n.bias_of < 0 || n.readers != 1 || n.gradient_of >= 0) return Var{};
  const Var bias{n.bias_of, generation_};
  return requires_grad(bias) ? bias : Var{};
}

template <typename T>
Var Graph<T>::emit(Shape shape, std::initializer_list<Var> inputs, SourceLocation made_by) {
  return emit(shape, inputs, DType::kF32, made_by);
}

template <typename T>
Var Graph<T>::emit(Shape shape, std::initializer_list<Var> inputs, DType dtype, SourceLocation made_by) {
  return emit(shape, std::span<const Var>(inputs.begin(), inputs.size()), dtype, made_by);
}

template <typename T>
Var Graph<T>::emit(Shape shape, std::span<const Var> inputs, DType dtype, SourceLocation made_by) {
  BERT_CHECK(dtype == DType::kF32 || (device_->is_cuda() && std::is_same_v<T, float>),
             "BF16 and int8 nodes exist only on a CUDA graph");
  BERT_CHECK(dtype != DType::kS8 || !any_requires_grad(inputs), "an int8 node takes no gradient");
  Node n;
  n.value = TensorView<T>(allocate(dtype, shape.numel()), shape);
  n.dtype = dtype;
  n.requires_grad = any_requires_grad(inputs);
  if (n.requires_grad) note_consumer(inputs, static_cast<int32_t>(nodes_.size()));
  return push_made_by(n, made_by);
}

template <typename T>
Var Graph<T>::emit_transient(Shape shape, std::initializer_list<Var> inputs, DType dtype, int slot,
                             SourceLocation made_by) {
  BERT_CHECK(dtype == DType::kF32 || (device_->is_cuda() && std::is_same_v<T, float>),
             "BF16 and int8 nodes exist only on a CUDA graph");
  const std::span<const Var> in(inputs.begin(), inputs.size());
  BERT_CHECK(dtype != DType::kS8 || !any_requires_grad(in), "an int8 node takes no gradient");
  Node n;
  const std::size_t bytes = static_cast<std::size_t>(shape.numel()) * dtype_size(dtype, sizeof(T));
  n.value = TensorView<T>(static_cast<T*>(transient_bytes(slot, bytes)), shape);
  n.dtype = dtype;
  n.transient_slot = static_cast<int8_t>(slot);
  n.transient_take = transient_takes_[slot];
  n.requires_grad = any_requires_grad(in);
  if (n.requires_grad) note_consumer(in, static_cast<int32_t>(nodes_.size()));
  return push_made_by(n, made_by);
}

template <typename T>
Var Graph<T>::emit_alias(TensorView<T> value, std::initializer_list<Var> inputs, SourceLocation made_by) {
  Node n;
  n.value = value;
  n.requires_grad = any_requires_grad({inputs.begin(), inputs.size()});
  if (n.requires_grad) note_consumer({inputs.begin(), inputs.size()}, static_cast<int32_t>(nodes_.size()));
  return push_made_by(n, made_by);
}

template <typename T>
Var Graph<T>::emit_view(Var x, Shape shape, SourceLocation made_by) {
  Node n;
  n.value = node(x).value.reshaped(shape);
  n.dtype = node(x).dtype;
  n.transient_slot = node(x).transient_slot;
  n.transient_take = node(x).transient_take;
  n.requires_grad = any_requires_grad({&x, 1});
  n.gradient_of = x.index;
  ++node(x).readers;  // its gradient is x's: a writer x cannot see
  return push_made_by(n, made_by);
}

template <typename T>
bool Graph<T>::takes_closure(Var out) {
  Node& n = node(out);
  if (!n.requires_grad) return false;
  BERT_CHECK(!n.is_leaf && !n.has_closure, "on_backward on a leaf or twice on one node");
  n.has_closure = true;
  return true;
}

template <typename T>
void Graph<T>::destroy_closures() {
  for (const Closure& c : closures_)
    if (c.destroy) c.destroy(c.state);
  closures_.clear();
}

template <typename T>
void* Graph<T>::transient_bytes(int slot, std::size_t bytes) {
  BERT_CHECK(slot >= 0 && slot < kTransientSlots,
             "transient slot " + std::to_string(slot) + " of " + std::to_string(kTransientSlots));
  ++transient_takes_[slot];
  DeviceBuffer& b = transients_[slot];
  if (b.bytes() < bytes) {
    b.reset();  // stream-ordered on a GPU: the kernels queued on the old buffer still read it
    b = DeviceBuffer(*device_, bytes);
  }
  return b.data();
}

template <typename T>
TensorView<T> Graph<T>::grad(Var v) {
  BERT_CHECK(node(v).dtype == DType::kF32, std::string("grad() of a node stored as ") + dtype_name(node(v).dtype));
  return TensorView<T>(static_cast<T*>(grad_data(v)), node(v).value.shape());
}

template <typename T>
void* Graph<T>::grad_data(Var v) {
  Node& n = node(v);
  BERT_CHECK(n.requires_grad, "grad() of a node that does not require a gradient");
  BERT_CHECK(!grad_owner(v).reported_final,
             "a leaf's gradient written after backward reported it final (an op "
             "that writes it did not name it among its inputs)");
  BERT_CHECK(!grad_owner(v).grad_released, "a node's gradient used after its own backward closure ran");
  if (n.grad.empty() && n.gradient_of >= 0) {  // nodes_ does not grow here
    n.grad = TensorView<T>(static_cast<T*>(grad_data(Var{n.gradient_of, generation_})), n.value.shape());
  }
  if (n.grad.empty() || n.grad_unwritten) {
    if (n.grad.empty()) n.grad = TensorView<T>(allocate_grad(n), n.value.shape());
    device_->fill_zero(n.grad.data(), n.value.numel() * dtype_size(n.dtype, sizeof(T)));
    n.grad_unwritten = false;
  }
  return n.grad.data();
}

template <typename T>
typename Graph<T>::Node& Graph<T>::grad_owner(Var v) {
  Node* n = &node(v);
  while (n->gradient_of >= 0) n = &nodes_[n->gradient_of];
  return *n;
}

template <typename T>
typename Graph<T>::GradTarget Graph<T>::grad_target(Var v) {
  BERT_CHECK(node(v).dtype == DType::kF32,
             std::string("grad_target() of a node stored as ") + dtype_name(node(v).dtype));
  const RawGradTarget t = raw_grad_target(v);
  return {static_cast<T*>(t.data), t.accumulate};
}

template <typename T>
typename Graph<T>::RawGradTarget Graph<T>::raw_grad_target(Var v) {
  BERT_CHECK(node(v).requires_grad, "grad_target() of a node that does not require a gradient");
  Node& owner = grad_owner(v);
  BERT_CHECK(!owner.reported_final,
             "a leaf's gradient written after backward reported it final (an op that "
             "writes it did not name it among its inputs)");
  BERT_CHECK(!owner.grad_released, "a node's gradient used after its own backward closure ran");
  if (owner.grad_unwritten) {
    owner.grad_unwritten = false;
    return {owner.grad.data(), false};
  }
  if (!owner.grad.empty()) return {owner.grad.data(), true};
  owner.grad = TensorView<T>(allocate_grad(owner), owner.value.shape());
  return {owner.grad.data(), false};
}

template <typename T>
bool Graph<T>::pass_grad_through(Var x, Var y) {
  BERT_CHECK(node(x).requires_grad, "pass_grad_through() to a node that does not require a gradient");
  Node& owner = grad_owner(x);
  const TensorView<T> dy = grad_owner(y).grad;
  if (owner.is_leaf || !owner.grad.empty() || dy.empty() || dy.numel() != owner.value.numel() ||
      owner.dtype != grad_owner(y).dtype || !grad_owner(y).owns_grad)  // one owner per buffer
    return false;
  owner.grad = dy.reshaped(owner.value.shape());
  // The buffer now belongs to x: it is released after x's closure, not y's.
  owner.owns_grad = grad_owner(y).owns_grad;
  grad_owner(y).owns_grad = false;
  return true;
}

template <typename T>
void Graph<T>::backward(Var loss, const std::function<void(TensorView<T> grad)>& on_final) {
  struct ClearOnExit {
    Graph* g;
    ~ClearOnExit() { g->clear(); }
  } clear_on_exit{this};

  Node& root = node(loss);
  BERT_CHECK(root.value.numel() == 1, "backward() needs a scalar loss, got shape " + root.value.shape().str());
  BERT_CHECK(root.dtype == DType::kF32, "backward() from a loss stored as bf16");
  BERT_CHECK(root.requires_grad, "backward() from a loss that does not depend on anything requiring a gradient");
  if (!device_->is_cuda()) {
    grad(loss)[0] += T(1);
  } else {  // an inner node's gradient starts at zero: set it
    BERT_CHECK(!root.is_leaf, "backward() from a leaf on a device");
    const T one(1);
    device_->copy_to_device(grad(loss).data(), &one, sizeof(T));
  }
  run_closures(on_final);
}

template <typename T>
void Graph<T>::backward_from(Var out, const void* grad) {
  struct ClearOnExit {
    Graph* g;
    ~ClearOnExit() { g->clear(); }
  } clear_on_exit{this};
  BERT_CHECK(node(out).requires_grad, "backward_from() an output that does not require a gradient");
  Node& root = grad_owner(out);  // a reshape's output: the node it views
  BERT_CHECK(!root.is_leaf && root.grad.empty(), "backward_from() needs an op's output without a gradient yet");
  root.grad = TensorView<T>(static_cast<T*>(const_cast<void*>(grad)), root.value.shape());
  root.owns_grad = false;  // the caller's buffer: never handed on to another gradient
  run_closures({});
}

template <typename T>
Graph<T>& Graph<T>::sub_graph() {
  if (!sub_) sub_ = std::make_unique<Graph<T>>(*device_);
  return *sub_;
}

template <typename T>
void Graph<T>::run_closures(const std::function<void(TensorView<T> grad)>& on_final) {
  for (const Node& n : nodes_)
    BERT_CHECK(n.is_leaf || !n.requires_grad || n.has_closure || n.gradient_of >= 0,
               "an op recorded a node without its backward");
  // Gradient buffers of leaves, each with the first node made from any leaf sharing it: once the
  // closures run in reverse have passed below that node, nothing writes the buffer any more.
  struct Pending {
    int32_t first_consumer;
    std::vector<int32_t> leaves;
  };
  std::vector<Pending> pending;  // by first consumer, the latest first
  if (on_final) {
    std::map<std::pair<const T*, int64_t>, Pending> by_buffer;
    for (int32_t i = 0; i < static_cast<int32_t>(nodes_.size()); ++i) {
      const Node& n = nodes_[i];
      if (!n.is_leaf || !n.requires_grad || n.grad.empty()) continue;
      Pending& p = by_buffer.try_emplace({n.grad.data(), n.grad.numel()}, Pending{INT32_MAX, {}}).first->second;
      if (n.first_consumer >= 0) p.first_consumer = std::min(p.first_consumer, n.first_consumer);
      p.leaves.push_back(i);
    }
    for (auto& [buffer, p] : by_buffer) pending.push_back(std::move(p));
    std::sort(pending.begin(), pending.end(),
              [](const Pending& a, const Pending& b) { return a.first_consumer > b.first_consumer; });
  }
  size_t next_final = 0;
  auto report_final_above = [&](int32_t index) {  // every buffer whose writers all lie above `index`
    for (; next_final < pending.size() && pending[next_final].first_consumer > index; ++next_final) {
      for (int32_t leaf : pending[next_final].leaves) nodes_[leaf].reported_final = true;
      on_final(nodes_[pending[next_final].leaves.front()].grad);
    }
  };
  if (profile_) profile_->stop();
  in_backward_ = true;
  for (auto it = closures_.rbegin(); it != closures_.rend(); ++it) {
    give_back_lent_above(it->node);  // before anything writes the gradients it held
    report_final_above(it->node);
    // A node whose gradient was never touched contributes nothing: skip its closure.
    if (nodes_[it->node].grad.empty()) continue;
    if (!profile_) {
      it->run(it->state, *this);
      release_grad(nodes_[it->node]);
      continue;
    }
    const auto start = std::chrono::steady_clock::now();
    it->run(it->state, *this);
    release_grad(nodes_[it->node]);
    profile_->add_backward(nodes_[it->node].made_by, nodes_[it->node].value.shape(),
                           std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  for (Node& n : nodes_)  // an uninitialised gradient nothing flowed into is zero
    if (n.grad_unwritten) {
      device_->fill_zero(n.grad.data(), n.value.numel() * sizeof(T));
      n.grad_unwritten = false;
    }
  give_back_lent_above(-1);
  report_final_above(-1);
}

template <typename T>
std::vector<TensorView<T>> Graph<T>::leaf_gradients() const {
  std::vector<TensorView<T>> result;
  for (const Node& n : nodes_) {
    if (!n.is_leaf || !n.requires_grad || n.grad.empty()) continue;
    const bool seen = std::any_of(result.begin(), result.end(), [&](const TensorView<T>& r) {
      return r.data() == n.grad.data() && r.numel() == n.grad.numel();
    });
    if (!seen) result.push_back(n.grad);
  }
  return result;
}

template <typename T>
void Graph<T>::clear() {
  if (profile_) profile_->stop();
  give_back_lent_above(-1);  // a forward no backward followed
  lent_.clear();
  in_backward_ = false;
  nodes_.clear();
  free_grads_.clear();
  destroy_closures();
  closure_memory_.reset();
  workspace_.reset();
  ++generation_;
}

template class Graph<float>;
template class Graph<double>;

}  // namespace bert
