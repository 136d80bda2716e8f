// parallel_for: split [0, n) into contiguous chunks, one per thread (OpenMP). Each index is handled
// by exactly one thread in a fixed order, so results do not depend on the thread count.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <exception>

namespace bert {

inline int num_threads() { return omp_get_max_threads(); }

// Elements per thread below which threading an elementwise pass does not pay.
constexpr int64_t kElementwiseGrain = 1 << 15;

// The same for a pass over rows of row_length elements each: rows per thread (at least at_least). Waking
// 16 sleeping threads for a few short rows cost a KVM guest's Xeon 1.3-1.6 ms (the NSP head's 64 x 2
// cross-entropy, against 0.01 ms on one thread).
inline int64_t rows_per_thread(int64_t row_length, int64_t at_least = 1) {
  return std::max(at_least, kElementwiseGrain / std::max<int64_t>(row_length, 1));
}

// body(lo, hi) handles indices [lo, hi). Runs serially when n < 2 * min_per_thread: threading a
// small loop costs more than it saves.
template <typename Body>
void parallel_for(int64_t n, int64_t min_per_thread, Body&& body) {
  int64_t chunks = std::min<int64_t>(num_threads(), n / std::max<int64_t>(min_per_thread, 1));
  if (chunks <= 1 || omp_in_parallel()) {
    if (n > 0) body(int64_t{0}, n);
    return;
  }
  // An exception must not leave an OpenMP region (that terminates the program): the first one is
  // caught, the other chunks finish, and it is rethrown here.
  std::exception_ptr error;
#pragma omp parallel for num_threads(static_cast <int>(chunks)) schedule(static, 1)
  for (int64_t c = 0; c < chunks; ++c) {
    try {
      body(n * c / chunks, n * (c + 1) / chunks);
    } catch (...) {
#pragma omp critical(bert_parallel_for_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace bert
