// Rng: a counter-based random generator. Draw i of a stream is a hash of (seed, i), so a block of
// draws can be reserved and filled by several threads in any order with identical results, and the
// whole state is two integers (easy to checkpoint). Each user (dropout, initialisation, data
// shuffling) holds its own Rng: there is no global generator.
#pragma once

#include <cmath>
#include <cstdint>

namespace bert {

class Rng {
 public:
  struct State {
    uint64_t seed = 0;
    uint64_t counter = 0;
    bool operator==(const State&) const = default;
  };

  explicit Rng(uint64_t seed = 0) : state_{seed, 0} {}
  explicit Rng(State state) : state_(state) {}

  State state() const { return state_; }

  // Reserves n consecutive draws and returns the index of the first; use bits()/uniform() on them.
  uint64_t reserve(uint64_t n) {
    uint64_t first = state_.counter;
    state_.counter += n;
    return first;
  }
  // 64 random bits for draw `index` of this stream (does not advance the stream).
  uint64_t bits(uint64_t index) const { return mix(state_.seed ^ mix(index + 0x632BE59BD9B4E019ull)); }
  // Uniform in [0, 1) with 53 random bits.
  double uniform(uint64_t index) const { return static_cast<double>(bits(index) >> 11) * 0x1.0p-53; }

  double next_uniform() { return uniform(reserve(1)); }
  // Standard normal by Box-Muller (consumes two draws).
  double next_normal() {
    uint64_t i = reserve(2);
    double u1 = 1.0 - uniform(i);  // (0, 1]: log is finite
    double u2 = uniform(i + 1);
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  // Uniform integer in [0, n).
  uint64_t next_below(uint64_t n) { return static_cast<uint64_t>(next_uniform() * static_cast<double>(n)); }

 private:
  // splitmix64's finaliser: a bijection with full avalanche.
  static uint64_t mix(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  State state_;
};

}  // namespace bert
