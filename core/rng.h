// Rng: a counter-based random generator. Draw i of a stream is a hash of (seed, i), so a block of
// draws can be reserved and filled by several threads in any order with identical results, and the
// whole state is two integers (easy to checkpoint). Each user (dropout, initialisation, data
// shuffling) holds its own Rng: there is no global generator.
#pragma once

#include <cmath>
#include <cstdint>

// Functions the CUDA kernels share with the CPU (one definition of each draw).
#if defined(__CUDACC__)
#define BERT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define BERT_HOST_DEVICE inline
#endif

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
  uint64_t bits(uint64_t index) const { return hash(state_.seed, index); }
  // bits() of the stream with this seed, for kernels that hold the seed alone.
  static BERT_HOST_DEVICE uint64_t hash(uint64_t seed, uint64_t index) {
    return mix(seed ^ mix(index + 0x632BE59BD9B4E019ull));
  }
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
  static BERT_HOST_DEVICE uint64_t mix(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  State state_;
};

// Dropout's draws, the same on the CPU and in every CUDA kernel that drops (dropout, fused softmax and
// dropout, fused attention). Element e of a block reserved with reserve() is kept when its 16 bits, bits
// 16 (e % 4) to 16 (e % 4) + 15 of the stream's draw e / 4, are at least threshold(p) = ceil(p 2^16): one
// 64-bit hash serves four elements (a quarter of the cost of a hash each), and p is used on a 1/65536
// grid (p = 0.1 drops with probability 0.100006). FlashAttention's kernels use a 1/256 grid.
struct DropoutDraws {
  // The first of n elements' indices; blocks start at a multiple of four, so four elements of a block
  // that start at a multiple of four share one hash.
  static uint64_t reserve(Rng& rng, uint64_t n) {
    const uint64_t counter = rng.state().counter;
    rng.reserve((4 - counter % 4) % 4);
    return rng.reserve(n);
  }
  static uint32_t threshold(double p) { return static_cast<uint32_t>(std::ceil(p * 65536.0)); }
  // Whether element e survives.
  static BERT_HOST_DEVICE bool kept(uint64_t seed, uint64_t e, uint32_t threshold) {
    return ((Rng::hash(seed, e / 4) >> (16 * (e % 4))) & 0xFFFFu) >= threshold;
  }
  // Elements 4 g .. 4 g + 3 as bits 0..3 (1 = kept).
  static BERT_HOST_DEVICE uint32_t kept4(uint64_t seed, uint64_t g, uint32_t threshold) {
    const uint64_t h = Rng::hash(seed, g);
    uint32_t m = 0;
    for (int l = 0; l < 4; ++l) m |= uint32_t(((h >> (16 * l)) & 0xFFFFu) >= threshold) << l;
    return m;
  }
};

}  // namespace bert
