// Graph<T>: the reverse-mode autograd tape. The caller owns it (there is no global graph); ops record
// a node per output and, when gradients are wanted, a backward closure beside it. backward() runs the
// closures in reverse and then frees the graph (nodes, activations, saved tensors) in one go, keeping
// the workspace's memory for the next step.
//
// A graph lives on one Device (the CPU unless one is given): its nodes' values and gradients are in
// that device's memory and its ops run there. Reading a value on the host is explicit (item, to_host).
//
// Gradients of leaves go to buffers the caller owns (the parameter arena, or a test's buffer) and
// ACCUMULATE across backward() calls until the caller zeroes them.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <new>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>
#include "core/source_location.h"

#include "core/arena.h"
#include "core/device.h"
#include "core/op_profile.h"
#include "core/tensor.h"
#include "core/workspace.h"

namespace bert {

// How a node's value and gradient are stored. Every node of a CPU graph, and of a GPU graph in FP32 or
// TF32, is kF32 (the graph's own T). In BF16 mixed precision (Precision::kBf16) the ops that make
// activations store them, and their gradients, as kBF16 (ops/cuda_impl.h says which); leaves, losses and
// parameter gradients stay kF32. kS8 holds the integers of INT8 inference on a GPU (an integer linear
// writing its consumer's quantized input: ops::int8_linear_quantized); such a node takes no gradient and
// only ops::int8_linear and ops::int8_attention_integers read it.
enum class DType : uint8_t { kF32, kBF16, kS8 };
inline std::size_t dtype_size(DType t, std::size_t native_size) {
  return t == DType::kBF16 ? 2 : t == DType::kS8 ? 1 : native_size;
}
const char* dtype_name(DType t);

// A handle to a node of one graph, valid until that graph is next cleared (checked).
struct Var {
  int32_t index = -1;
  uint32_t generation = 0;
  bool valid() const { return index >= 0; }
};

template <typename T>
class Graph {
 public:
  explicit Graph(std::size_t initial_workspace_bytes = 0) : Graph(Device::cpu(), initial_workspace_bytes) {}
  explicit Graph(const Device& device, std::size_t initial_workspace_bytes = 0);
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  ~Graph() { destroy_closures(); }

  // --- leaves
  Var constant(TensorView<T> value);                  // never receives a gradient
  // Gradient accumulates into `grad`; with grad_uninitialised, `grad` holds nothing yet: the first op to
  // write it stores instead of adding (as an inner node's), and a gradient nothing flowed into is zeroed when
  // the backward ends (a sub-graph's leaf writing its outer graph's fresh gradient, ops::recompute).
  Var leaf(TensorView<T> value, TensorView<T> grad, bool grad_uninitialised = false);
  // A parameter of an arena, on this graph's device (the arena must have been placed there).
  Var param(const Parameter<T>& p);
  // A constant holding a copy of host values (token ids turned into masks, weights), on this device.
  Var input(std::span<const T> host_values, Shape shape);

  // --- used by op implementations
  // A new node whose output lives in the workspace (uninitialised); it requires a gradient when
  // gradients are enabled and any input requires one. `made_by` names the op (for an OpProfile).
  Var emit(Shape shape, std::initializer_list<Var> inputs, SourceLocation made_by = SourceLocation::current());
  // The same with the output stored as `dtype` (kBF16: 2 bytes per element).
  Var emit(Shape shape, std::initializer_list<Var> inputs, DType dtype,
           SourceLocation made_by = SourceLocation::current());
  Var emit(Shape shape, std::span<const Var> inputs, DType dtype, SourceLocation made_by = SourceLocation::current());
  // A new node whose output lives in transient slot `slot` (transient()) instead of the workspace: for an
  // output that only the op made next reads, in its forward (the unfused attention's scores, which softmax
  // turns into the probabilities its backward keeps), so that no layer keeps it until the step ends. Its
  // value is valid until the slot is next taken; reading it after that throws (value, data, to_host). Its
  // gradient is an ordinary one.
  Var emit_transient(Shape shape, std::initializer_list<Var> inputs, DType dtype, int slot,
                     SourceLocation made_by = SourceLocation::current());
  // A new node whose output aliases existing storage (a reshape); its gradient is its own buffer.
  Var emit_alias(TensorView<T> value, std::initializer_list<Var> inputs,
                 SourceLocation made_by = SourceLocation::current());
  // A node whose value AND gradient are x's under another shape (a reshape that needs no backward:
  // gradients flowing into it land in x's gradient directly).
  Var emit_view(Var x, Shape shape, SourceLocation made_by = SourceLocation::current());
  // Records how to propagate out's gradient to its inputs: `fn(graph)`, any callable (an op's lambda).
  // A no-op unless out requires a gradient. The callable is moved into the graph's host closure memory,
  // a bump allocator like the workspace: once a step's graph has been built, building it again
  // allocates nothing (a std::function per op would allocate on the heap each time).
  template <typename Fn>
  void on_backward(Var out, Fn&& fn) {
    using Stored = std::decay_t<Fn>;
    if (!takes_closure(out)) return;
    void* state = closure_memory_.allocate_bytes(sizeof(Stored));
    static_assert(alignof(Stored) <= Workspace::kAlignment);
    new (state) Stored(std::forward<Fn>(fn));
    Closure c{out.index, state, [](void* s, Graph& g) { (*static_cast<Stored*>(s))(g); }, nullptr};
    if constexpr (!std::is_trivially_destructible_v<Stored>)
      c.destroy = [](void* s) { static_cast<Stored*>(s)->~Stored(); };
    closures_.push_back(c);
  }
  // Storage on this graph's device, valid until the graph is cleared: for what a forward saves for
  // its backward (in lent memory where there is room: lend()).
  template <typename U>
  U* scratch(std::size_t n) {
    return static_cast<U*>(allocate_bytes(n * sizeof(U)));
  }
  // Uninitialised host memory valid until the graph is cleared, from the bump allocator of the backward
  // closures' captures: once a step's graph has been built, building it again allocates nothing (for
  // what an op works out on the host before uploading it).
  template <typename U>
  U* host_scratch(std::size_t n) {
    static_assert(std::is_trivially_copyable_v<U> && alignof(U) <= Workspace::kAlignment);
    return static_cast<U*>(closure_memory_.allocate_bytes(n * sizeof(U)));
  }
  // Memory on this graph's device for what an op makes and consumes within itself (the feed-forward
  // block's GELU output, ops::feed_forward) instead of keeping it until the graph is cleared: valid until
  // the op's forward returns, or its backward closure does. Slot `slot` (< kTransientSlots) is one buffer
  // kept across steps and grown to the largest request (the old one freed in stream order), so every
  // layer's op reuses the same memory; two slots for an op that needs two temporaries at once.
  static constexpr int kTransientSlots = 2;
  template <typename U>
  U* transient(int slot, std::size_t n) {
    static_assert(std::is_trivially_copyable_v<U>);
    return static_cast<U*>(transient_bytes(slot, n * sizeof(U)));
  }
  // Copies n host values into this device's scratch memory and returns the device pointer.
  template <typename U>
  U* upload(const U* host, std::size_t n) {
    U* p = scratch<U>(n);
    device_->copy_to_device(p, host, n * sizeof(U));
    return p;
  }

  const Device& device() const { return *device_; }
  bool on_cuda() const { return device_->is_cuda(); }
  // The value of a one-element node, read on the host (waits for the device).
  T item(Var v) const;  // converted from BF16 for a kBF16 node (as to_host)
  // All of v's values, copied to the host (waits for the device).
  std::vector<T> to_host(Var v) const;

  // The dtype activations take on this graph: kBF16 on a GPU in BF16 mixed precision, else kF32.
  DType activation_dtype() const { return activation_dtype_; }
  DType dtype(Var v) const { return node(v).dtype; }
  // The value of a kF32 node (throws, naming the dtype, for a kBF16 one: its storage holds 2-byte
  // elements and is read through data()).
  TensorView<T> value(Var v) const;
  // The storage of v's value, whatever its dtype.
  void* data(Var v) const { return readable(v).value.data(); }
  // A parameter's value rounded to BF16 where its arena keeps a current copy (Parameter::device_bf16),
  // else nullptr: what a BF16 GEMM reads instead of rounding the F32 value itself.
  const void* bf16_copy(Var v) const { return node(v).bf16_copy; }
  // By value: nodes live in a growing vector, so a reference would dangle after the next emit (ASan
  // caught one such use in the quantizer).
  Shape shape(Var v) const { return node(v).value.shape(); }
  bool requires_grad(Var v) const { return node(v).requires_grad; }
  // Whether anything has back-propagated into v yet (its gradient buffer exists).
  bool has_grad(Var v) { return !grad_owner(v).grad.empty(); }
  // The gradient buffer of v (zero-filled on first use for inner nodes). Only for nodes that
  // require a gradient.
  TensorView<T> grad(Var v);
  // The gradient buffer of v for an op whose backward writes EVERY element of it. `accumulate` is
  // true when the buffer already holds a gradient to add to (always for leaves); false when it was just
  // allocated and is uninitialised, so the op must store, not add and not read. This saves
  // zero-filling each gradient and reading it back once.
  struct GradTarget {
    T* data;
    bool accumulate;
  };
  GradTarget grad_target(Var v);  // kF32 nodes
  // grad() and grad_target() for a node of any dtype: the buffer holds elements of dtype(v).
  void* grad_data(Var v);
  struct RawGradTarget {
    void* data;
    bool accumulate;
  };
  RawGradTarget raw_grad_target(Var v);
  // Makes the gradient of y (same number of elements) x's gradient as well, when x has none yet and
  // may take one: for an op whose backward passes dy through unchanged (a same-shape add), called
  // from y's own backward (nothing reads y's gradient after it). Returns false when it could not, and
  // then the op copies dy itself.
  bool pass_grad_through(Var x, Var y);
  // A linear's bias gradient summed by the op that reads the linear's output. The linear says that its
  // bias's gradient is the column sums of y's gradient (set_bias_of); bias_to_sum(y) gives that bias to
  // the op that writes y's gradient, where it is y's only reader (nothing else made from y, no view of it)
  // and the bias takes a gradient, else Var{}. That op may then add the column sums of what it writes into
  // the bias's gradient in a pass it makes anyway, and say so (set_bias_summed); the linear's backward
  // then does not sum them again (bias_summed).
  void set_bias_of(Var y, Var bias);
  Var bias_to_sum(Var y);
  void set_bias_summed(Var y) { node(y).bias_summed = true; }
  bool bias_summed(Var y) const { return node(y).bias_summed; }
  // The int8 integers behind y's fake-quantized values (y's shape, in y's memory space), written beside them
  // by the op that quantized y where asked (ops::QuantizeOutput::integers), or nullptr.
  void set_integers(Var y, const int8_t* q) { node(y).integers = q; }
  const int8_t* integers(Var y) const { return node(y).integers; }

  // --- modes and lifetime
  bool grad_enabled() const { return grad_enabled_; }
  void set_grad_enabled(bool enabled) { grad_enabled_ = enabled; }
  // Times every op's forward and backward into `profile` (the caller's) until set_profile(nullptr); a
  // forward's time runs until the next node is made, backward() or clear(). On a GPU the host does not
  // wait for the kernels, so the times are the host's: what it takes to queue each op (launch overhead).
  void set_profile(OpProfile* profile);
  bool profiling() const { return profile_ != nullptr; }
  // Back-propagates from a scalar (one-element) loss with d(loss)/d(loss) = 1, then clear()s.
  // `on_final`, when given, is called with each leaf's gradient buffer as soon as no closure still to
  // run writes it (after the closures of every op that took the leaf; leaves sharing one buffer, as
  // tied weights do, once for all of them), with the device's work to complete it already queued: what
  // an all-reduce overlapped with the rest of the backward pass starts from.
  void backward(Var loss, const std::function<void(TensorView<T> grad)>& on_final = {});
  // Back-propagates from an op's output `out` whose gradient is given (`grad`: out's elements, of its dtype,
  // on this device; read, not kept), then clear()s: the backward of a computation run on a graph of its own
  // (ops::recompute).
  void backward_from(Var out, const void* grad);
  // A graph on the same device kept by this one (made on first use, its workspace kept across clear()): where
  // an op runs a computation whose tensors live only while the op runs (ops::recompute).
  Graph& sub_graph();
  // Frees every node and all workspace memory handed out; handles taken before become invalid.
  void clear();
  // Whether backward() hands an inner node's gradient buffer on to a later gradient of the same size once
  // the node's closure has run (on by default: the gradients of a layer's activations then reuse those of
  // the layer above instead of each taking new memory). A closure that reads another node's gradient
  // after that node's closure ran is refused either way (checked).
  void set_reuse_gradients(bool reuse) { reuse_grads_ = reuse; }

  // Lends the forward pass gradient memory that nothing reads or writes until the backward reaches the ops
  // made before this call: the gradients of parameters that no later op takes (a layer's, once the forward
  // is past it), whose contents need not be kept. The values and saved tensors of the ops made after this
  // call go there first, before the workspace; once the backward has run those ops' closures, and before it
  // runs any closure made earlier, the graph fills all of it with zeros (clear() does so where no backward
  // came): the gradients start from zero there, so their owner need not zero them first. The memory the
  // gradients need at the end of a step then holds activations at its middle, where the step's memory
  // peaks. Checked: an op made later that takes a leaf whose gradient overlaps lent memory throws.
  // Gradients made by the backward never go there. A no-op while gradients are disabled. `memory` starts
  // on a Workspace::kAlignment boundary.
  void lend(void* memory, std::size_t bytes);
  // Bytes of lent memory the forward has used since the graph was last cleared (for tests and logs).
  std::size_t lent_bytes_in_use() const;

  // The gradient buffers of the leaves that take a gradient (each buffer once): what backward's
  // on_final will report.
  std::vector<TensorView<T>> leaf_gradients() const;

  std::size_t num_nodes() const { return nodes_.size(); }
  std::size_t num_backward_closures() const { return closures_.size(); }
  const Workspace& workspace() const { return workspace_; }
  const Workspace& closure_memory() const { return closure_memory_; }

 private:
  struct Node {
    TensorView<T> value;
    TensorView<T> grad;  // empty until first needed (inner nodes); elements of `dtype`
    DType dtype = DType::kF32;
    bool requires_grad = false;
    bool is_leaf = false;
    bool has_closure = false;
    int32_t gradient_of = -1;       // emit_view: the node whose gradient this one shares
    int32_t first_consumer = -1;    // leaves: the first node made from it (its last writer in backward)
    bool reported_final = false;    // leaves: handed to backward's on_final; no closure may write it after
    const char* made_by = nullptr;  // the op's function (SourceLocation), for an OpProfile
    const void* bf16_copy = nullptr;  // parameters: Parameter::device_bf16
    bool owns_grad = false;           // inner nodes: `grad` came from allocate_grad (not passed through)
    bool grad_released = false;       // its closure has run and its gradient buffer went back for reuse
    bool grad_unwritten = false;      // leaves made with grad_uninitialised, until first written
    int32_t readers = 0;              // nodes made from it that take a gradient, and views of it
    int32_t bias_of = -1;             // set_bias_of: the bias whose gradient its gradient's column sums are
    bool bias_summed = false;         // set_bias_summed
    const int8_t* integers = nullptr;  // set_integers
    int8_t transient_slot = -1;       // emit_transient: the slot holding the value
    uint32_t transient_take = 0;      // and which take of that slot (transient_takes_) it is
  };
  // A gradient buffer whose node's closure has run: nothing reads or writes it any more this step, so a
  // later gradient of the same size takes it instead of new workspace memory.
  struct FreeGrad {
    std::size_t bytes;
    void* data;
  };
  // A recorded backward: the callable's state in closure_memory_, how to call it and how to destroy it
  // (null when trivially destructible).
  struct Closure {
    int32_t node;
    void* state;
    void (*run)(void* state, Graph& graph);
    void (*destroy)(void* state);
  };
  // Whether out takes a backward closure (it requires a gradient); checks it has none yet and is no leaf.
  bool takes_closure(Var out);
  void destroy_closures();  // runs the callables' destructors and empties closures_
  // Records `consumer` as made from each input (for leaves: the first such node).
  void note_consumer(std::span<const Var> inputs, int32_t consumer);
  const Node& node(Var v) const;
  // node(v), checked to still hold its value (an emit_transient node whose slot was taken again does not).
  const Node& readable(Var v) const;
  Node& node(Var v) { return const_cast<Node&>(static_cast<const Graph*>(this)->node(v)); }
  // The node that owns v's gradient buffer (v itself, or what an emit_view chain points at).
  Node& grad_owner(Var v);
  Var push(Node n);
  // A node made by an op: starts timing that op's forward when profiling.
  Var push_made_by(Node n, const SourceLocation& made_by);
  bool any_requires_grad(std::span<const Var> inputs) const;
  // Storage for n elements of `dtype`, as the TensorView<T> a node keeps (whatever the element size).
  T* allocate(DType dtype, int64_t n) {
    return static_cast<T*>(allocate_bytes(static_cast<std::size_t>(n) * dtype_size(dtype, sizeof(T))));
  }
  // Forward storage: lent memory where a lent range has room (not during backward), else the workspace.
  void* allocate_bytes(std::size_t bytes);
  // Memory lent by lend(): bump-allocated from `next`; given back (zero-filled) once the backward has run
  // the closures of the nodes made after it (index `first_node` on).
  struct Lent {
    std::byte* begin;
    std::byte* next;
    std::byte* end;
    int32_t first_node;
    bool given_back;
  };
  // Gives back every lent range whose nodes all lie above `index` (each closure's node, then -1).
  void give_back_lent_above(int32_t index);
  // backward()'s loop: the closures in reverse, each node's gradient released after its closure.
  void run_closures(const std::function<void(TensorView<T> grad)>& on_final);
  // Storage for an inner node's gradient: a released buffer of the same size, else new memory.
  T* allocate_grad(Node& n);
  // After n's closure ran: its gradient buffer (when it owns one) becomes reusable.
  void release_grad(Node& n);
  void* transient_bytes(int slot, std::size_t bytes);

  const Device* device_;
  Workspace workspace_;       // on device_
  Workspace closure_memory_;  // host memory for the backward closures' captures
  std::vector<Node> nodes_;
  std::vector<Closure> closures_;  // in recording (topological) order
  std::vector<FreeGrad> free_grads_;  // during backward(); emptied by clear()
  std::vector<Lent> lent_;            // lend(); emptied by clear()
  bool in_backward_ = false;          // run_closures() is running: nothing goes into lent memory
  DeviceBuffer transients_[kTransientSlots];  // transient(): kept across clear()
  uint32_t transient_takes_[kTransientSlots] = {};  // how often each slot was handed out
  std::unique_ptr<Graph> sub_;                // sub_graph()
  bool reuse_grads_ = true;
  uint32_t generation_ = 1;
  bool grad_enabled_ = true;
  DType activation_dtype_ = DType::kF32;
  OpProfile* profile_ = nullptr;  // the caller's, when timing ops
};

// Disables gradient recording for a scope (evaluation), restoring the previous mode on exit.
template <typename T>
class NoGradGuard {
 public:
  explicit NoGradGuard(Graph<T>& graph) : graph_(graph), previous_(graph.grad_enabled()) {
    graph_.set_grad_enabled(false);
  }
  ~NoGradGuard() { graph_.set_grad_enabled(previous_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  Graph<T>& graph_;
  bool previous_;
};

}  // namespace bert
