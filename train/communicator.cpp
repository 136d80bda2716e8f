#include "train/communicator.h"

#include <barrier>

#include "sys/error.h"

namespace bert::train {

namespace {

// What the ranks of a local group share: each rank's span, published before the first barrier; rank
// order sums after it; a second barrier keeps the spans alive until every rank has read them.
struct Exchange {
  explicit Exchange(int ranks) : sync(ranks), floats(ranks), doubles(ranks) {}
  std::barrier<> sync;
  std::vector<std::span<float>> floats;
  std::vector<std::span<double>> doubles;
};

template <typename T>
void reduce(Exchange& ex, std::vector<std::span<T>>& slots, int rank, std::span<T> values) {
  slots[rank] = values;
  ex.sync.arrive_and_wait();
  std::vector<T> sum(values.size(), T(0));
  for (const std::span<T>& other : slots) {
    BERT_CHECK(other.size() == values.size(), "all_reduce_sum: ranks passed spans of different lengths");
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += other[i];
  }
  ex.sync.arrive_and_wait();  // everyone has read every span
  std::copy(sum.begin(), sum.end(), values.begin());
}

class LocalRank final : public Communicator {
 public:
  LocalRank(std::shared_ptr<Exchange> exchange, int rank, int size)
      : exchange_(std::move(exchange)), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_reduce_sum(std::span<float> values) override { reduce(*exchange_, exchange_->floats, rank_, values); }
  void all_reduce_sum(std::span<double> values) override { reduce(*exchange_, exchange_->doubles, rank_, values); }
  void all_reduce_mean(const Device& device, float* data, int64_t count) override {
    BERT_CHECK(!device.is_cuda(), "a local group exchanges host memory: its ranks train on the CPU");
    const std::span<float> values(data, static_cast<size_t>(count));
    all_reduce_sum(values);
    for (float& v : values) v /= static_cast<float>(size_);
  }

 private:
  std::shared_ptr<Exchange> exchange_;
  int rank_, size_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> local_group(int ranks) {
  if (ranks < 1) throw UserError("a group needs at least one rank");
  auto exchange = std::make_shared<Exchange>(ranks);
  std::vector<std::unique_ptr<Communicator>> group;
  for (int r = 0; r < ranks; ++r) group.push_back(std::make_unique<LocalRank>(exchange, r, ranks));
  return group;
}

}  // namespace bert::train
