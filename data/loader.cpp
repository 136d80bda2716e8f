#include "data/loader.h"

#include <algorithm>
#include <filesystem>
#include <numeric>

#include "core/rng.h"
#include "data/hdf5_io.h"
#include "sys/error.h"

namespace bert::data {

std::vector<std::string> expand_shard_paths(const std::vector<std::string>& paths) {
  std::vector<std::string> out;
  for (const std::string& p : paths) {
    std::error_code ec;
    if (std::filesystem::is_directory(p, ec)) {
      std::vector<std::string> found;
      for (const auto& entry : std::filesystem::directory_iterator(p)) {
        const std::string ext = entry.path().extension().string();
        if (entry.is_regular_file() && (ext == ".hdf5" || ext == ".h5")) found.push_back(entry.path().string());
      }
      if (found.empty()) throw UserError("shard folder '" + p + "' holds no .hdf5 or .h5 files");
      std::sort(found.begin(), found.end());
      out.insert(out.end(), found.begin(), found.end());
    } else if (std::filesystem::is_regular_file(p, ec)) {
      out.push_back(p);
    } else {
      throw UserError("shard path '" + p + "' does not exist");
    }
  }
  if (out.empty()) throw UserError("no shards given");
  return out;
}

bool check_loader_compatible(const ShardLoader& loader, const std::string& first_shard, int64_t vocab_size,
                             int64_t max_seq_len, const std::string& tokenizer_sha256) {
  if (loader.seq_len() > max_seq_len)
    throw UserError("shards have sequence length " + std::to_string(loader.seq_len()) +
                    ", longer than max_position_embeddings " + std::to_string(max_seq_len));
  if (!loader.metadata()) return false;
  Shard header;  // the recorded facts of the first shard, without its data
  header.seq_len = loader.seq_len();
  header.metadata = loader.metadata();
  check_shard_compatible(header, first_shard, vocab_size, max_seq_len, tokenizer_sha256);
  return true;
}

ShardLoader::ShardLoader(LoaderOptions options) : options_(std::move(options)) {
  if (options_.shards.empty()) throw UserError("no shards given to the loader");
  if (options_.batch_size < 1) throw UserError("batch size must be at least 1");
  if (options_.world_size < 1 || options_.rank < 0 || options_.rank >= options_.world_size)
    throw UserError("rank " + std::to_string(options_.rank) + " outside a world of " +
                    std::to_string(options_.world_size));
  restore(State{});
  seq_len_ = shard_.seq_len;
  max_predictions_ = shard_.max_predictions;
  metadata_ = shard_.metadata;
  kind_ = shard_.kind;
  label_names_ = shard_.label_names;
  grouped_ = !shard_.groups.empty();
}

std::vector<int64_t> ShardLoader::permutation(int64_t n, uint64_t stream) const {
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  if (!options_.shuffle) return order;
  Rng rng(Rng(options_.seed).bits(stream));
  for (int64_t i = n; i > 1; --i) std::swap(order[i - 1], order[rng.next_below(i)]);
  return order;
}

void ShardLoader::restore(State state) {
  state_ = state;
  shard_order_ = permutation(static_cast<int64_t>(options_.shards.size()), state_.epoch * 2);
  if (state_.shard < static_cast<int64_t>(shard_order_.size())) load_current_shard();
}

void ShardLoader::load_current_shard() {
  const int64_t index = shard_order_[state_.shard];
  if (index != loaded_) {  // (a shard already in memory, as after a restore to it, is not read again)
    const std::string& path = options_.shards[index];
    const bool first = loaded_ < 0 && seq_len_ == 0;
    loaded_ = -1;
    if (index == ahead_index_ && ahead_.valid()) {
      ahead_index_ = -1;
      shard_ = ahead_.get();  // (rethrows what the read threw)
    } else {
      shard_ = read_shard(path);
    }
    if (!first) {
      if (shard_.seq_len != seq_len_ || shard_.max_predictions != max_predictions_)
        throw UserError("shard '" + path + "' has sequence length " + std::to_string(shard_.seq_len) + " and " +
                        std::to_string(shard_.max_predictions) + " predictions; the first shard has " +
                        std::to_string(seq_len_) + " and " + std::to_string(max_predictions_));
      if (!shard_.groups.empty() != grouped_)
        throw UserError("shard '" + path + "' " + (grouped_ ? "has no groups" : "has groups") + "; the first shard " +
                        (grouped_ ? "has" : "has none") + " (all shards of a run must agree)");
      if (shard_.kind != kind_ || shard_.label_names != label_names_)
        throw UserError("shard '" + path + "' is a " + shard_kind_name(shard_.kind) + " shard with " +
                        std::to_string(shard_.label_names.size()) + " labels; the first shard is a " +
                        shard_kind_name(kind_) + " shard with " + std::to_string(label_names_.size()) +
                        " (all shards of a run must agree)");
    }
    loaded_ = index;
  }
  // The examples' order is the epoch's (the same shard comes again in another epoch in another order).
  example_order_ = permutation(shard_.size, (state_.epoch * 1000003 + static_cast<uint64_t>(index)) * 2 + 1);
  prefetch_next();
}

void ShardLoader::prefetch_next() {
  if (!options_.prefetch || !hdf5::library_threadsafe()) return;
  int64_t next = -1;
  if (state_.shard + 1 < static_cast<int64_t>(shard_order_.size()))
    next = shard_order_[state_.shard + 1];
  else if (options_.repeat)
    next = permutation(static_cast<int64_t>(options_.shards.size()), (state_.epoch + 1) * 2).front();
  if (next < 0 || next == loaded_ || (next == ahead_index_ && ahead_.valid())) return;
  ahead_index_ = next;  // (a read of another shard still running is waited for here, and dropped)
  ahead_ = std::async(std::launch::async, [path = options_.shards[next]] { return read_shard(path); });
}

bool ShardLoader::next(Batch& batch) {
  const int64_t l = seq_len_, p = max_predictions_;
  const bool task = kind_ != ShardKind::kPretraining, scored = kind_ == ShardKind::kSequenceScores;
  const int64_t label_width = data::label_width(kind_, l);
  batch.size = 0;
  batch.seq_len = l;
  batch.max_predictions = p;
  auto resize_rows = [&](int64_t rows) {
    for (auto* v : {&batch.input_ids, &batch.masked_lm_positions, &batch.masked_lm_ids})
      v->resize(rows * (v == &batch.input_ids ? l : p));
    for (auto* v : {&batch.input_mask, &batch.segment_ids}) v->resize(rows * l);
    batch.next_sentence_labels.resize(task ? 0 : rows);
    batch.labels.resize(task && !scored ? rows * label_width : 0);
    batch.scores.resize(scored ? rows : 0);
    batch.groups.resize(grouped_ ? rows : 0);
  };
  // The global batch's examples before this rank's slice are read past, those after it too.
  const int64_t global = options_.batch_size * options_.world_size;
  const int64_t first = options_.batch_size * options_.rank, end = first + options_.batch_size;
  resize_rows(options_.batch_size);
  for (int64_t position = 0; position < global;) {
    if (state_.shard >= static_cast<int64_t>(shard_order_.size())) {  // end of an epoch
      if (!options_.repeat) break;
      restore(State{state_.epoch + 1, 0, 0});
    }
    if (state_.example >= shard_.size) {
      state_.example = 0;
      ++state_.shard;
      if (state_.shard < static_cast<int64_t>(shard_order_.size())) load_current_shard();
      continue;
    }
    const int64_t src = example_order_[state_.example++];
    const int64_t index = position++;  // in the global batch
    if (index < first || index >= end) continue;
    const int64_t dst = batch.size++;
    std::copy_n(shard_.input_ids.begin() + src * l, l, batch.input_ids.begin() + dst * l);
    std::copy_n(shard_.input_mask.begin() + src * l, l, batch.input_mask.begin() + dst * l);
    std::copy_n(shard_.segment_ids.begin() + src * l, l, batch.segment_ids.begin() + dst * l);
    std::copy_n(shard_.masked_lm_positions.begin() + src * p, p, batch.masked_lm_positions.begin() + dst * p);
    std::copy_n(shard_.masked_lm_ids.begin() + src * p, p, batch.masked_lm_ids.begin() + dst * p);
    if (scored) {
      batch.scores[dst] = shard_.scores[src];
      if (grouped_) batch.groups[dst] = (loaded_ << 32) | shard_.groups[src];  // groups are numbered per shard
    } else if (task) {
      std::copy_n(shard_.labels.begin() + src * label_width, label_width, batch.labels.begin() + dst * label_width);
    } else {
      batch.next_sentence_labels[dst] = shard_.next_sentence_labels[src];
    }
  }
  resize_rows(batch.size);  // a short final batch keeps only its real rows
  return batch.size > 0;
}

}  // namespace bert::data
