#include "core/arena.h"

#include <algorithm>
#include <type_traits>

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
  Parameter<T> p{&e.name,
                 TensorView<T>(values_.data() + e.offset, e.shape),
                 TensorView<T>(grads_.data() + e.offset, e.shape),
                 {},
                 {}};
  if (device_->is_cuda()) {
    p.device_value = TensorView<T>(device_values_.as<T>() + e.offset, e.shape);
    p.device_grad = TensorView<T>(device_grads_.as<T>() + e.offset, e.shape);
    if (bf16_current_) p.device_bf16 = static_cast<const uint16_t*>(bf16_copy_.data()) + e.offset;
  }
  return p;
}

template <typename T>
ParamId ParameterArena<T>::id(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) throw UserError("unknown parameter '" + name + "'");
  return it->second;
}

template <typename T>
Parameter<T> ParameterArena<T>::get(const std::string& name) {
  return get(id(name));
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
  if (device_->is_cuda()) return device_->fill_zero(device_grads_.data(), device_grads_.bytes());
  device_->fill_zero(grads_.data(), grads_.size() * sizeof(T));  // threaded on the host
}

template <typename T>
void ParameterArena<T>::place_on(const Device& device) {
  BERT_CHECK(allocated_, "place_on() before allocate()");
  device_ = &device;
  device_values_.reset();
  device_grads_.reset();
  bf16_copy_.reset();
  bf16_current_ = false;
  if (!device.is_cuda()) return;
  const std::size_t bytes = static_cast<std::size_t>(padded_size_) * sizeof(T);
  device_values_ = DeviceBuffer(device, bytes);
  device_grads_ = DeviceBuffer(device, bytes);
  device.fill_zero(device_grads_.data(), bytes);
  upload_values();
}

template <typename T>
void ParameterArena<T>::upload_values() {
  bf16_current_ = false;
  if (device_->is_cuda()) device_->copy_to_device(device_values_.data(), values_.data(), device_values_.bytes());
}

template <typename T>
void ParameterArena<T>::download_values() {
  if (device_->is_cuda()) device_->copy_to_host(values_.data(), device_values_.data(), device_values_.bytes());
}

template <typename T>
void ParameterArena<T>::download_grads() {
  if (device_->is_cuda()) device_->copy_to_host(grads_.data(), device_grads_.data(), device_grads_.bytes());
}

template <typename T>
TensorView<T> ParameterArena<T>::device_values() {
  bf16_current_ = false;
  if (!device_->is_cuda()) return values();
  return TensorView<T>(device_values_.as<T>(), Shape{padded_size_});
}

template <typename T>
TensorView<T> ParameterArena<T>::device_grads() {
  if (!device_->is_cuda()) return grads();
  return TensorView<T>(device_grads_.as<T>(), Shape{padded_size_});
}

template <typename T>
TensorView<T> ParameterArena<T>::device_grads(ParamId first, ParamId end) {
  BERT_CHECK(0 <= first && first <= end && end <= size(), "device_grads(): parameters [" + std::to_string(first) +
                                                              ", " + std::to_string(end) + ") of " +
                                                              std::to_string(size()));
  const int64_t begin = first < size() ? entries_[first].offset : padded_size_;
  const int64_t stop = end < size() ? entries_[end].offset : padded_size_;
  return TensorView<T>(device_grads().data() + begin, Shape{stop - begin});
}

template <typename T>
void* ParameterArena<T>::bf16_copy_for_update() {
  if (!std::is_same_v<T, float> || !device_->is_cuda() || device_->precision() != Precision::kBf16) return nullptr;
  if (!bf16_copy_.data()) bf16_copy_ = DeviceBuffer(*device_, static_cast<std::size_t>(padded_size_) * 2);
  bf16_current_ = false;
  return bf16_copy_.data();
}

template <typename T>
void ParameterArena<T>::refresh_bf16_copy() {
  if constexpr (std::is_same_v<T, float>) {
    if (bf16_current_) return;
    void* copy = bf16_copy_for_update();
    if (!copy) return;
    device_->round_to_bf16(static_cast<uint16_t*>(copy), device_values_.as<float>(),
                           static_cast<std::size_t>(padded_size_));
    bf16_copy_updated();
  }
}

template class ParameterArena<float>;
template class ParameterArena<double>;

}  // namespace bert
