// Shape: the dimensions of a row-major tensor, rank 0 (scalar) to 4.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace bert {

class Shape {
 public:
  static constexpr int kMaxRank = 4;

  Shape() = default;  // rank 0: a scalar with one element
  Shape(std::initializer_list<int64_t> dims);

  int rank() const { return rank_; }
  int64_t numel() const;
  // Dimension i; negative i counts from the end (-1 is the last).
  int64_t operator[](int i) const { return dims_[normalize_axis(i)]; }
  int64_t& operator[](int i) { return dims_[normalize_axis(i)]; }
  // Product of all dimensions but the last (the number of rows of the row-major 2-D view).
  int64_t rows() const { return rank_ == 0 ? 1 : numel() / dims_[rank_ - 1]; }
  int64_t last() const { return rank_ == 0 ? 1 : dims_[rank_ - 1]; }
  // Same dimensions with the last one replaced.
  Shape with_last(int64_t d) const;
  int normalize_axis(int axis) const;

  bool operator==(const Shape& other) const;
  bool operator!=(const Shape& other) const { return !(*this == other); }
  std::string str() const;  // "[2, 3, 4]"

 private:
  std::array<int64_t, kMaxRank> dims_{};
  int rank_ = 0;
};

}  // namespace bert
