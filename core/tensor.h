// Tensor<T> owns row-major contiguous storage; TensorView<T> is a non-owning window onto storage
// that someone else owns (a Tensor, the parameter arena, a graph's workspace).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/aligned.h"
#include "core/shape.h"
#include "sys/error.h"

namespace bert {

// A view of an existing buffer. It does not own the buffer, and copying a view never copies data:
// the name says so at every use.
template <typename T>
class TensorView {
 public:
  TensorView() = default;
  TensorView(T* data, Shape shape) : data_(data), shape_(shape) {}

  T* data() const { return data_; }
  const Shape& shape() const { return shape_; }
  int64_t numel() const { return shape_.numel(); }
  bool empty() const { return data_ == nullptr; }
  T& operator[](int64_t i) const { return data_[i]; }
  T* begin() const { return data_; }
  T* end() const { return data_ + numel(); }

  // The same elements under another shape with the same number of elements.
  TensorView reshaped(Shape shape) const {
    BERT_CHECK(shape.numel() == numel(), "reshape " + shape_.str() + " -> " + shape.str());
    return TensorView(data_, shape);
  }
  void fill(T value) const { std::fill(begin(), end(), value); }
  void copy_from(const TensorView<T>& src) const {
    BERT_CHECK(src.numel() == numel(), "copy " + src.shape().str() + " into " + shape_.str());
    std::copy(src.begin(), src.end(), data_);
  }

 private:
  T* data_ = nullptr;
  Shape shape_;
};

// Owns its storage (zero-initialised). Move-only: a copy must be asked for with clone().
template <typename T>
class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(Shape shape) : storage_(shape.numel(), T(0)), shape_(shape) {}
  Tensor(Shape shape, const std::vector<T>& values) : storage_(values.begin(), values.end()), shape_(shape) {
    BERT_CHECK(static_cast<int64_t>(storage_.size()) == shape.numel(),
               std::to_string(storage_.size()) + " values for shape " + shape.str());
  }
  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(Tensor&&) noexcept = default;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  Tensor clone() const {
    Tensor copy(shape_);
    copy.storage_ = storage_;
    return copy;
  }

  TensorView<T> view() { return TensorView<T>(storage_.data(), shape_); }
  TensorView<const T> view() const { return TensorView<const T>(storage_.data(), shape_); }
  T* data() { return storage_.data(); }
  const T* data() const { return storage_.data(); }
  const Shape& shape() const { return shape_; }
  int64_t numel() const { return shape_.numel(); }
  T& operator[](int64_t i) { return storage_[i]; }
  const T& operator[](int64_t i) const { return storage_[i]; }

 private:
  AlignedVector<T> storage_;  // 64-byte aligned
  Shape shape_;
};

}  // namespace bert
