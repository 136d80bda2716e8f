#include "core/arena.h"

#include <algorithm>

namespace bert {

template <typename T>
ParamId ParameterArena<T>::add(const std::string& name, Shape shape) {
  BERT_CHECK(!allocated_, "add('" + name + "') after allocate()");
  BERT_CHECK(!index_.count(name), "duplicate parameter name '" + name + "'");
  constexpr int64_t kAlignElems = 64 / sizeof(T);
  Entry e{name, shape, padded_size_};
  padded_size_ += (shape.numel() + kAlignElems - 1) / kAlignElems * kAlignElems;
  auto id = static_cast<ParamId>(entries_.size());
  index_.emplace(name, id);
  entries_.push_back(std::move(e));
  return id;
}

template <typename T>
void ParameterArena<T>::allocate() {
  BERT_CHECK(!allocated_, "allocate() called twice");
  values_.assign(padded_size_, T(0));
  grads_.assign(padded_size_, T(0));
  allocated_ = true;
}

template <typename T>
Parameter<T> ParameterArena<T>::get(ParamId id) {
  BERT_CHECK(allocated_, "get() before allocate()");
  BERT_CHECK(id >= 0 && id < size(), "parameter id " + std::to_string(id) + " out of range");
  const Entry& e = entries_[id];
  return {&e.name, TensorView<T>(values_.data() + e.offset, e.shape),
          TensorView<T>(grads_.data() + e.offset, e.shape)};
}

template <typename T>
Parameter<T> ParameterArena<T>::get(const std::string& name) {
  auto it = index_.find(name);
  if (it == index_.end()) throw UserError("unknown parameter '" + name + "'");
  return get(it->second);
}

template <typename T>
TensorView<T> ParameterArena<T>::values() {
  BERT_CHECK(allocated_, "values() before allocate()");
  return TensorView<T>(values_.data(), Shape{padded_size_});
}

template <typename T>
TensorView<T> ParameterArena<T>::grads() {
  BERT_CHECK(allocated_, "grads() before allocate()");
  return TensorView<T>(grads_.data(), Shape{padded_size_});
}

template <typename T>
int64_t ParameterArena<T>::num_elements() const {
  int64_t n = 0;
  for (const Entry& e : entries_) n += e.shape.numel();
  return n;
}

template <typename T>
void ParameterArena<T>::zero_grad() {
  std::fill(grads_.begin(), grads_.end(), T(0));
}

template class ParameterArena<float>;
template class ParameterArena<double>;

}  // namespace bert
