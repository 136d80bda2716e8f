#include "core/shape.h"

#include "sys/error.h"

namespace bert {

Shape::Shape(std::initializer_list<int64_t> dims) {
  BERT_CHECK(static_cast<int>(dims.size()) <= kMaxRank, "rank " + std::to_string(dims.size()) + " > 4");
  for (int64_t d : dims) {
    BERT_CHECK(d >= 0, "negative dimension " + std::to_string(d));
    dims_[rank_++] = d;
  }
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank_; ++i) n *= dims_[i];
  return n;
}

Shape Shape::with_last(int64_t d) const {
  BERT_CHECK(rank_ > 0, "with_last on a scalar shape");
  Shape s = *this;
  s.dims_[rank_ - 1] = d;
  return s;
}

int Shape::normalize_axis(int axis) const {
  int a = axis < 0 ? axis + rank_ : axis;
  BERT_CHECK(a >= 0 && a < rank_, "axis " + std::to_string(axis) + " out of range for shape " + str());
  return a;
}

bool Shape::operator==(const Shape& other) const {
  if (rank_ != other.rank_) return false;
  for (int i = 0; i < rank_; ++i)
    if (dims_[i] != other.dims_[i]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < rank_; ++i) s += (i ? ", " : "") + std::to_string(dims_[i]);
  return s + "]";
}

}  // namespace bert
