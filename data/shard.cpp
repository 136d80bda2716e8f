// Shard I/O through the HDF5 C API.
#include "data/shard.h"

#include <algorithm>
#include <cmath>

#include "data/hdf5_io.h"

#include "sys/atomic_file.h"
#include "sys/error.h"
#include "sys/json.h"

namespace bert::data {

void Shard::append(const Example& e) {
  BERT_CHECK(static_cast<int64_t>(e.tokens.size()) <= seq_len, "example longer than the shard's sequence length");
  BERT_CHECK(static_cast<int64_t>(e.masked_positions.size()) <= max_predictions, "too many predictions");
  const size_t n = e.tokens.size(), m = e.masked_positions.size();
  input_ids.insert(input_ids.end(), e.tokens.begin(), e.tokens.end());
  input_ids.resize(input_ids.size() + (seq_len - n), 0);
  input_mask.resize(input_mask.size() + n, 1);
  input_mask.resize(input_mask.size() + (seq_len - n), 0);
  segment_ids.insert(segment_ids.end(), e.segment_ids.begin(), e.segment_ids.end());
  segment_ids.resize(segment_ids.size() + (seq_len - n), 0);
  masked_lm_positions.insert(masked_lm_positions.end(), e.masked_positions.begin(), e.masked_positions.end());
  masked_lm_positions.resize(masked_lm_positions.size() + (max_predictions - m), 0);
  masked_lm_ids.insert(masked_lm_ids.end(), e.masked_ids.begin(), e.masked_ids.end());
  masked_lm_ids.resize(masked_lm_ids.size() + (max_predictions - m), 0);
  next_sentence_labels.push_back(e.random_next ? 1 : 0);
  ++size;
}

void Shard::append_tokens(std::span<const int32_t> tokens, std::span<const int8_t> segments) {
  BERT_CHECK(static_cast<int64_t>(tokens.size()) <= seq_len && segments.size() == tokens.size(),
             "sequence longer than the shard's sequence length");
  const size_t n = tokens.size();
  input_ids.insert(input_ids.end(), tokens.begin(), tokens.end());
  input_ids.resize(input_ids.size() + (seq_len - n), 0);
  input_mask.resize(input_mask.size() + n, 1);
  input_mask.resize(input_mask.size() + (seq_len - n), 0);
  segment_ids.insert(segment_ids.end(), segments.begin(), segments.end());
  segment_ids.resize(segment_ids.size() + (seq_len - n), 0);
}

void Shard::append_scored(std::span<const int32_t> tokens, std::span<const int8_t> segments, float score,
                          int32_t group) {
  BERT_CHECK(kind == ShardKind::kSequenceScores, "append_scored on a shard that is not seq-reg");
  BERT_CHECK(std::isfinite(score), "a sequence score must be finite");
  BERT_CHECK(group >= 0 ? groups.size() == scores.size() : groups.empty(),
             "a shard's examples all have a group or none");
  append_tokens(tokens, segments);
  scores.push_back(score);
  if (group >= 0) groups.push_back(group);
  ++size;
}

void Shard::append_labeled(std::span<const int32_t> tokens, std::span<const int8_t> segments,
                           std::span<const int32_t> token_labels) {
  BERT_CHECK(is_task() && kind != ShardKind::kSequenceScores, "append_labeled on a shard without labels");
  append_tokens(tokens, segments);
  const size_t n = tokens.size();
  if (kind == ShardKind::kSequenceLabels) {
    BERT_CHECK(token_labels.size() == 1, "a sequence label shard takes one label per sequence");
    labels.push_back(token_labels[0]);
  } else if (kind == ShardKind::kSpanLabels) {
    BERT_CHECK(token_labels.size() == 2 && token_labels[0] <= token_labels[1] && token_labels[0] >= 0 &&
                   token_labels[1] < static_cast<int32_t>(n),
               "a span label shard takes a span of the sequence: start <= end");
    labels.insert(labels.end(), token_labels.begin(), token_labels.end());
  } else {
    BERT_CHECK(token_labels.size() == n, "a token label shard takes one label per token");
    labels.insert(labels.end(), token_labels.begin(), token_labels.end());
    labels.resize(labels.size() + (seq_len - n), kIgnoredLabel);
  }
  ++size;
}

std::string shard_kind_name(ShardKind kind) { return kShardKindNames.name(kind); }

void Shard::clear() {
  size = 0;
  labels.clear();
  scores.clear();
  groups.clear();
  for (auto* v : {&input_ids, &masked_lm_positions, &masked_lm_ids}) v->clear();
  for (auto* v : {&input_mask, &segment_ids, &next_sentence_labels}) v->clear();
}

void write_shard(const std::string& path, const Shard& s) {
  hdf5::Quiet quiet;
  AtomicFile file(path);
  {
    hdf5::Handle h = hdf5::create(file.temp_path(), path);
    const auto n = static_cast<hsize_t>(s.size), l = static_cast<hsize_t>(s.seq_len),
               p = static_cast<hsize_t>(s.max_predictions);
    constexpr int kGzipLevel = 4;  // as NVIDIA's tools write them
    hdf5::write_dataset(h.get(), "input_ids", s.input_ids.data(), {n, l}, path, kGzipLevel);
    hdf5::write_dataset(h.get(), "input_mask", s.input_mask.data(), {n, l}, path, kGzipLevel);
    hdf5::write_dataset(h.get(), "segment_ids", s.segment_ids.data(), {n, l}, path, kGzipLevel);
    if (s.is_task()) {
      const std::vector<hsize_t> dims = s.kind == ShardKind::kTokenLabels  ? std::vector<hsize_t>{n, l}
                                        : s.kind == ShardKind::kSpanLabels ? std::vector<hsize_t>{n, 2}
                                                                           : std::vector<hsize_t>{n};
      if (s.kind == ShardKind::kSequenceScores) {
        hdf5::write_dataset(h.get(), "labels", s.scores.data(), dims, path, kGzipLevel);
        if (!s.groups.empty()) hdf5::write_dataset(h.get(), "groups", s.groups.data(), dims, path, kGzipLevel);
      } else {
        hdf5::write_dataset(h.get(), "labels", s.labels.data(), dims, path, kGzipLevel);
      }
      hdf5::write_attribute(h.get(), "task", shard_kind_name(s.kind));
      Json::Array names;
      for (const std::string& name : s.label_names) names.emplace_back(name);
      hdf5::write_attribute(h.get(), "label_names", Json(names).dump());
      if (s.doc_stride > 0) hdf5::write_attribute(h.get(), "doc_stride", s.doc_stride);
      if (s.max_query_len > 0) hdf5::write_attribute(h.get(), "max_query_len", s.max_query_len);
    } else {
      hdf5::write_dataset(h.get(), "masked_lm_positions", s.masked_lm_positions.data(), {n, p}, path, kGzipLevel);
      hdf5::write_dataset(h.get(), "masked_lm_ids", s.masked_lm_ids.data(), {n, p}, path, kGzipLevel);
      hdf5::write_dataset(h.get(), "next_sentence_labels", s.next_sentence_labels.data(), {n}, path, kGzipLevel);
    }
    if (s.metadata) {
      hdf5::write_attribute(h.get(), "vocab_size", s.metadata->vocab_size);
      hdf5::write_attribute(h.get(), "tokenizer_sha256", s.metadata->tokenizer_sha256);
      hdf5::write_attribute(h.get(), "max_seq_len", s.metadata->max_seq_len);
      hdf5::write_attribute(h.get(), "max_predictions_per_seq", s.metadata->max_predictions);
      hdf5::write_attribute(h.get(), "seed", static_cast<int64_t>(s.metadata->seed));
    }
    if (H5Fflush(h.get(), H5F_SCOPE_GLOBAL) < 0) throw UserError("cannot write shard '" + path + "' (disk full?)");
  }
  file.commit();
}

Shard read_shard(const std::string& path) {
  hdf5::Quiet quiet;
  hdf5::Handle h = hdf5::open_read(path, "shard");
  Shard s;
  if (hdf5::exists(h.get(), "labels")) {
    const std::string task = hdf5::read_string_attribute(h.get(), "task").value_or("");
    if (task == "seq-cls")
      s.kind = ShardKind::kSequenceLabels;
    else if (task == "token-cls")
      s.kind = ShardKind::kTokenLabels;
    else if (task == "qa")
      s.kind = ShardKind::kSpanLabels;
    else if (task == "seq-reg")
      s.kind = ShardKind::kSequenceScores;
    else
      throw UserError("shard '" + path + "' holds labels but its 'task' attribute is '" + task +
                      "' (expected seq-cls, token-cls, qa or seq-reg)");
  }
  const std::vector<const char*> required =
      s.is_task() ? std::vector<const char*>{"input_ids", "input_mask", "segment_ids", "labels"}
                  : std::vector<const char*>{"input_ids",           "input_mask",    "segment_ids",
                                             "masked_lm_positions", "masked_lm_ids", "next_sentence_labels"};
  for (const char* name : required)
    if (!hdf5::exists(h.get(), name))
      throw UserError("shard '" + path + "': dataset '" + name + "' is missing (expected NVIDIA BERT layout: " +
                      "input_ids, input_mask, segment_ids, masked_lm_positions, masked_lm_ids, next_sentence_labels; " +
                      "or for a task shard input_ids, input_mask, segment_ids, labels)");
  auto read = [&](const char* name, auto& out, size_t rank) {
    std::vector<hsize_t> dims = hdf5::read_dataset(h.get(), name, out, path, "shard");
    if (dims.size() != rank)
      throw UserError("shard '" + path + "': dataset '" + name + "' has rank " + std::to_string(dims.size()) +
                      ", expected " + std::to_string(rank));
    return dims;
  };
  auto expect = [&](const char* name, const std::vector<hsize_t>& found, const std::vector<hsize_t>& want) {
    if (found != want)
      throw UserError("shard '" + path + "': dataset '" + name + "' has shape " + hdf5::dims_str(found) +
                      ", expected " + hdf5::dims_str(want));
  };
  const auto ids = read("input_ids", s.input_ids, 2);
  s.size = static_cast<int64_t>(ids[0]);
  s.seq_len = static_cast<int64_t>(ids[1]);
  expect("input_mask", read("input_mask", s.input_mask, 2), ids);
  expect("segment_ids", read("segment_ids", s.segment_ids, 2), ids);
  if (s.is_task()) {
    const bool per_token = s.kind == ShardKind::kTokenLabels, spans = s.kind == ShardKind::kSpanLabels;
    if (s.kind == ShardKind::kSequenceScores) {
      expect("labels", read("labels", s.scores, 1), {ids[0]});  // float32: read_dataset checks the type
      for (size_t i = 0; i < s.scores.size(); ++i)
        if (!std::isfinite(s.scores[i]))
          throw UserError("shard '" + path + "': labels[" + std::to_string(i) + "] holds " +
                          std::to_string(s.scores[i]) + ", expected a finite score");
      if (hdf5::exists(h.get(), "groups")) {
        expect("groups", read("groups", s.groups, 1), {ids[0]});
        for (size_t i = 0; i < s.groups.size(); ++i)
          if (s.groups[i] < 0)
            throw UserError("shard '" + path + "': groups[" + std::to_string(i) + "] holds " +
                            std::to_string(s.groups[i]) + ", expected a group number >= 0");
      }
    } else {
      expect("labels", read("labels", s.labels, per_token || spans ? 2 : 1),
             per_token ? ids
             : spans   ? std::vector<hsize_t>{ids[0], 2}
                       : std::vector<hsize_t>{ids[0]});
    }
    try {
      const Json names = Json::parse(hdf5::read_string_attribute(h.get(), "label_names").value_or(""));
      for (const Json& name : names.as_array()) s.label_names.push_back(name.as_string());
    } catch (const UserError&) {
      throw UserError("shard '" + path + "': attribute 'label_names' is missing or not a JSON array of strings");
    }
    if (s.label_names.empty()) throw UserError("shard '" + path + "': 'label_names' is empty");
    s.doc_stride = hdf5::read_int_attribute(h.get(), "doc_stride").value_or(0);
    s.max_query_len = hdf5::read_int_attribute(h.get(), "max_query_len").value_or(0);
    const auto num_labels = static_cast<int32_t>(s.label_names.size());
    for (size_t i = 0; spans && i < s.labels.size(); i += 2) {
      const int32_t start = s.labels[i], end = s.labels[i + 1];
      if (start < 0 || end < start || end >= s.seq_len)
        throw UserError("shard '" + path + "': labels[" + std::to_string(i / 2) + "] holds the span " +
                        std::to_string(start) + ".." + std::to_string(end) + ", expected 0 <= start <= end < " +
                        std::to_string(s.seq_len));
    }
    for (size_t i = 0; !spans && i < s.labels.size(); ++i) {
      const int32_t label = s.labels[i];
      if ((label < 0 || label >= num_labels) && !(per_token && label == kIgnoredLabel))
        throw UserError("shard '" + path + "': labels[" + std::to_string(i / s.label_width()) + "] holds " +
                        std::to_string(label) + ", outside [0, " + std::to_string(num_labels) + ")" +
                        (per_token ? " and not the ignore label -100" : ""));
    }
  } else {
    const auto pos = read("masked_lm_positions", s.masked_lm_positions, 2);
    s.max_predictions = static_cast<int64_t>(pos[1]);
    expect("masked_lm_positions", pos, {ids[0], pos[1]});
    expect("masked_lm_ids", read("masked_lm_ids", s.masked_lm_ids, 2), pos);
    expect("next_sentence_labels", read("next_sentence_labels", s.next_sentence_labels, 1), {ids[0]});
  }

  const auto vocab = hdf5::read_int_attribute(h.get(), "vocab_size");
  if (vocab) {
    ShardMetadata m;
    m.vocab_size = *vocab;
    m.tokenizer_sha256 = hdf5::read_string_attribute(h.get(), "tokenizer_sha256").value_or("");
    m.max_seq_len = hdf5::read_int_attribute(h.get(), "max_seq_len").value_or(s.seq_len);
    m.max_predictions = hdf5::read_int_attribute(h.get(), "max_predictions_per_seq").value_or(s.max_predictions);
    m.seed = static_cast<uint64_t>(hdf5::read_int_attribute(h.get(), "seed").value_or(0));
    s.metadata = m;
  }
  for (int64_t i = 0; i < static_cast<int64_t>(s.input_ids.size()); ++i) {
    const int32_t id = s.input_ids[i];
    if (id < 0 || (vocab && id >= *vocab))
      throw UserError("shard '" + path + "': input_ids[" + std::to_string(i / s.seq_len) + ", " +
                      std::to_string(i % s.seq_len) + "] = " + std::to_string(id) +
                      " outside [0, vocab_size=" + (vocab ? std::to_string(*vocab) : "?") + ")");
  }
  for (int32_t p : s.masked_lm_positions)
    if (p < 0 || p >= s.seq_len)
      throw UserError("shard '" + path + "': masked_lm_positions holds " + std::to_string(p) + ", outside [0, " +
                      std::to_string(s.seq_len) + ")");
  for (int32_t id : s.masked_lm_ids)
    if (id < 0 || (vocab && id >= *vocab))
      throw UserError("shard '" + path + "': masked_lm_ids holds " + std::to_string(id) +
                      ", outside [0, vocab_size=" + (vocab ? std::to_string(*vocab) : "?") + ")");
  for (int8_t label : s.next_sentence_labels)
    if (label != 0 && label != 1)
      throw UserError("shard '" + path + "': next_sentence_labels holds " + std::to_string(label) +
                      ", expected 0 or 1");
  return s;
}

void check_shard_compatible(const Shard& s, const std::string& path, int64_t vocab_size, int64_t max_seq_len,
                            const std::string& tokenizer_sha256) {
  if (s.seq_len > max_seq_len)
    throw UserError("shard '" + path + "' has sequence length " + std::to_string(s.seq_len) +
                    ", longer than the model's max_position_embeddings " + std::to_string(max_seq_len));
  if (s.metadata && s.metadata->vocab_size != vocab_size)
    throw UserError("shard '" + path + "' was made with a vocabulary of " + std::to_string(s.metadata->vocab_size) +
                    " tokens; the model has " + std::to_string(vocab_size));
  for (const std::vector<int32_t>* ids : {&s.input_ids, &s.masked_lm_ids})
    for (int32_t id : *ids)
      if (id >= vocab_size)
        throw UserError("shard '" + path + "' holds token id " + std::to_string(id) + " >= the model's vocab_size " +
                        std::to_string(vocab_size));
  if (s.metadata && !tokenizer_sha256.empty() && !s.metadata->tokenizer_sha256.empty() &&
      s.metadata->tokenizer_sha256 != tokenizer_sha256)
    throw UserError("shard '" + path + "' was made with another tokenizer (sha256 " +
                    s.metadata->tokenizer_sha256.substr(0, 12) + "..., expected " + tokenizer_sha256.substr(0, 12) +
                    "...)");
}

}  // namespace bert::data
