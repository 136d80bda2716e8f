// Google's create_pretraining_data algorithm, and the streaming shard builder.
#include "data/examples.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>

#include "data/corpus.h"
#include "data/shard.h"
#include "sys/error.h"
#include "sys/parallel.h"

namespace bert::data {

namespace {

// Uniform integer in [lo, hi].
int64_t randint(Rng& rng, int64_t lo, int64_t hi) {
  return lo + static_cast<int64_t>(rng.next_below(static_cast<uint64_t>(hi - lo + 1)));
}

template <typename T>
void shuffle(std::vector<T>& v, Rng& rng) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[rng.next_below(i)]);
}

// An independent stream for (seed, a, b): examples of document b in pass a, and so on.
uint64_t derive_seed(uint64_t seed, uint64_t a, uint64_t b) { return Rng(Rng(seed).bits(a)).bits(b); }

// Removes tokens from the longer side, at its front or back at random, until the pair fits.
void truncate_pair(std::vector<int32_t>& a, std::vector<int32_t>& b, size_t max_tokens, Rng& rng) {
  while (a.size() + b.size() > max_tokens) {
    std::vector<int32_t>& longer = a.size() > b.size() ? a : b;
    if (rng.next_uniform() < 0.5) {
      longer.erase(longer.begin());
    } else {
      longer.pop_back();
    }
  }
}

}  // namespace

void ExampleOptions::validate() const {
  auto fail = [](const std::string& flag, const std::string& value, const std::string& expected) {
    throw UserError(flag + " " + value + ": expected " + expected);
  };
  if (max_seq_len < 8 || max_seq_len > 4096) fail("--max-seq-len", std::to_string(max_seq_len), "8 to 4096");
  if (max_predictions < 1 || max_predictions > max_seq_len)
    fail("--max-predictions", std::to_string(max_predictions), "1 to --max-seq-len");
  if (!(masked_lm_prob > 0 && masked_lm_prob < 1))
    fail("--masked-lm-prob", std::to_string(masked_lm_prob), "in (0, 1)");
  if (!(short_seq_prob >= 0 && short_seq_prob <= 1))
    fail("--short-seq-prob", std::to_string(short_seq_prob), "in [0, 1]");
  if (!(random_next_prob >= 0 && random_next_prob <= 1))
    fail("--random-next-prob", std::to_string(random_next_prob), "in [0, 1]");
  if (dupe_factor < 1 || dupe_factor > 1000) fail("--dupe-factor", std::to_string(dupe_factor), "1 to 1000");
}

void mask_tokens(Example& e, const ExampleOptions& o, const tokenizer::Tokenizer& tokenizer, Rng& rng) {
  const tokenizer::SpecialTokens& sp = tokenizer.specials();
  // Candidate positions, grouped into whole words when asked.
  std::vector<std::vector<int32_t>> candidates;
  for (int32_t i = 0; i < static_cast<int32_t>(e.tokens.size()); ++i) {
    const int32_t t = e.tokens[i];
    if (t < sp.first_regular) continue;  // never mask special tokens ([UNK] included: nothing to learn)
    const bool continues_word =
        o.whole_word_mask && !candidates.empty() && candidates.back().back() == i - 1 && !tokenizer.is_word_start(t);
    if (continues_word) {
      candidates.back().push_back(i);
    } else {
      candidates.push_back({i});
    }
  }
  shuffle(candidates, rng);
  // Python's round() (half to even), as the reference uses.
  const auto wanted = static_cast<size_t>(std::min<double>(
      o.max_predictions, std::max(1.0, std::nearbyint(static_cast<double>(e.tokens.size()) * o.masked_lm_prob))));
  std::vector<std::pair<int32_t, int32_t>> masked;  // (position, original id)
  const std::vector<int32_t> original = e.tokens;
  for (const auto& word : candidates) {
    if (masked.size() >= wanted) break;
    if (masked.size() + word.size() > wanted) continue;
    for (int32_t pos : word) {
      if (rng.next_uniform() < 0.8) {
        e.tokens[pos] = sp.mask;
      } else if (rng.next_uniform() >= 0.5) {  // else: 10% keep the original
        e.tokens[pos] = static_cast<int32_t>(randint(rng, sp.first_regular, tokenizer.vocab_size() - 1));
      }
      masked.emplace_back(pos, original[pos]);
    }
  }
  std::sort(masked.begin(), masked.end());
  e.masked_positions.clear();
  e.masked_ids.clear();
  for (auto [pos, id] : masked) {
    e.masked_positions.push_back(pos);
    e.masked_ids.push_back(id);
  }
}

void create_examples(std::span<const TokenizedDocument> documents, size_t index, const ExampleOptions& o,
                     const tokenizer::Tokenizer& tokenizer, Rng& rng, std::vector<Example>& out) {
  const TokenizedDocument& document = documents[index];
  const tokenizer::SpecialTokens& sp = tokenizer.specials();
  const int64_t max_tokens = o.max_seq_len - 3;  // [CLS] A [SEP] B [SEP]
  // As in the reference, a short target length is drawn once per document.
  int64_t target = max_tokens;
  if (rng.next_uniform() < o.short_seq_prob) target = randint(rng, 2, max_tokens);

  std::vector<size_t> chunk;  // sentence indices
  int64_t chunk_length = 0;
  for (size_t i = 0; i < document.size(); ++i) {
    chunk.push_back(i);
    chunk_length += static_cast<int64_t>(document[i].size());
    if (i + 1 != document.size() && chunk_length < target) continue;

    const size_t a_end = chunk.size() >= 2 ? static_cast<size_t>(randint(rng, 1, chunk.size() - 1)) : 1;
    std::vector<int32_t> a, b;
    for (size_t j = 0; j < a_end; ++j) a.insert(a.end(), document[chunk[j]].begin(), document[chunk[j]].end());
    Example e;
    if (chunk.size() == 1 || rng.next_uniform() < o.random_next_prob) {
      e.random_next = true;
      const int64_t target_b = target - static_cast<int64_t>(a.size());
      size_t other = index;
      for (int attempt = 0; attempt < 10 && documents.size() > 1; ++attempt) {
        other = static_cast<size_t>(randint(rng, 0, static_cast<int64_t>(documents.size()) - 1));
        if (other != index) break;
      }
      const TokenizedDocument& random_doc = documents[other];
      const auto start = static_cast<size_t>(randint(rng, 0, static_cast<int64_t>(random_doc.size()) - 1));
      for (size_t j = start; j < random_doc.size(); ++j) {
        b.insert(b.end(), random_doc[j].begin(), random_doc[j].end());
        if (static_cast<int64_t>(b.size()) >= target_b) break;
      }
      i -= chunk.size() - a_end;  // the unused sentences go back for the next chunk
    } else {
      for (size_t j = a_end; j < chunk.size(); ++j)
        b.insert(b.end(), document[chunk[j]].begin(), document[chunk[j]].end());
    }
    truncate_pair(a, b, static_cast<size_t>(max_tokens), rng);
    BERT_CHECK(!a.empty() && !b.empty(), "empty segment after truncation");

    e.tokens.reserve(a.size() + b.size() + 3);
    e.tokens.push_back(sp.cls);
    e.tokens.insert(e.tokens.end(), a.begin(), a.end());
    e.tokens.push_back(sp.sep);
    e.segment_ids.assign(e.tokens.size(), 0);
    e.tokens.insert(e.tokens.end(), b.begin(), b.end());
    e.tokens.push_back(sp.sep);
    e.segment_ids.resize(e.tokens.size(), 1);
    mask_tokens(e, o, tokenizer, rng);
    out.push_back(std::move(e));
    chunk.clear();
    chunk_length = 0;
  }
}

ShardBuildStats build_shards(const ShardBuildOptions& o, const tokenizer::Tokenizer& tokenizer,
                             const std::function<void(const ShardBuildStats&, int, double)>& progress) {
  o.examples.validate();
  if (o.examples_per_shard < 1) throw UserError("--examples-per-shard must be at least 1");
  if (o.window_documents < 2) throw UserError("--window-docs must be at least 2 (random-next needs other documents)");
  const auto start_time = std::chrono::steady_clock::now();
  { CorpusReader check(o.inputs, parse_corpus_format(o.corpus_format)); }  // fail on bad inputs before writing
  std::error_code ec;
  std::filesystem::create_directories(o.output_dir, ec);
  if (ec) throw UserError("cannot create output folder '" + o.output_dir + "': " + ec.message());

  ShardBuildStats stats;
  Shard pending(o.examples.max_seq_len, o.examples.max_predictions);
  pending.metadata = ShardMetadata{tokenizer.vocab_size(), tokenizer.file_sha256(), o.examples.max_seq_len,
                                   o.examples.max_predictions, o.examples.seed};
  auto write_pending = [&] {
    char name[32];
    std::snprintf(name, sizeof name, "-%05lld.hdf5", static_cast<long long>(stats.shards));
    const std::string path = (std::filesystem::path(o.output_dir) / (o.prefix + name)).string();
    write_shard(path, pending);
    stats.shard_paths.push_back(path);
    ++stats.shards;
    pending.clear();
  };

  for (int pass = 0; pass < o.examples.dupe_factor; ++pass) {
    CorpusReader reader(o.inputs, parse_corpus_format(o.corpus_format));
    stats.corpus_bytes = reader.total_bytes();
    uint64_t first_document = 0;
    std::vector<std::vector<std::string>> texts;
    for (uint64_t window = 0;; ++window) {
      texts.clear();
      std::vector<std::string> sentences;
      while (static_cast<int64_t>(texts.size()) < o.window_documents && reader.next(sentences))
        texts.push_back(std::move(sentences));
      if (texts.empty()) break;

      std::vector<TokenizedDocument> documents(texts.size());
      parallel_for(static_cast<int64_t>(texts.size()), 8, [&](int64_t lo, int64_t hi) {
        for (int64_t d = lo; d < hi; ++d)
          for (const std::string& s : texts[d]) {
            std::vector<int32_t> ids = tokenizer.encode(s);
            if (!ids.empty()) documents[d].push_back(std::move(ids));
          }
      });
      std::erase_if(documents, [](const TokenizedDocument& d) { return d.empty(); });

      std::vector<std::vector<Example>> per_document(documents.size());
      parallel_for(static_cast<int64_t>(documents.size()), 8, [&](int64_t lo, int64_t hi) {
        for (int64_t d = lo; d < hi; ++d) {
          Rng rng(derive_seed(o.examples.seed, static_cast<uint64_t>(pass), first_document + d));
          create_examples(documents, static_cast<size_t>(d), o.examples, tokenizer, rng, per_document[d]);
        }
      });
      std::vector<Example> examples;
      for (auto& d : per_document)
        for (Example& e : d) examples.push_back(std::move(e));
      Rng window_rng(derive_seed(o.examples.seed ^ 0x5EED5EEDull, static_cast<uint64_t>(pass), window));
      shuffle(examples, window_rng);

      for (const TokenizedDocument& d : documents) {
        stats.sentences += pass == 0 ? static_cast<int64_t>(d.size()) : 0;
        stats.single_sentence_documents += pass == 0 && d.size() == 1;
      }
      stats.documents += pass == 0 ? static_cast<int64_t>(documents.size()) : 0;
      for (const Example& e : examples) {
        pending.append(e);
        stats.random_next += e.random_next;
        ++stats.examples;
        if (pending.size == o.examples_per_shard) write_pending();
      }
      first_document += texts.size();
      stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time).count();
      if (progress)
        progress(stats, pass,
                 (pass + static_cast<double>(reader.bytes_read()) / std::max<int64_t>(reader.total_bytes(), 1)) /
                     o.examples.dupe_factor);
    }
  }
  if (pending.size > 0) write_pending();
  if (stats.examples == 0) throw UserError("the corpus produced no examples (no non-empty sentences?)");
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_time).count();
  return stats;
}

}  // namespace bert::data
