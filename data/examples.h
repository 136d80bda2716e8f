// MLM + NSP pretraining examples, made by Google's create_pretraining_data algorithm
// (docs/data.md), and the streaming builder that turns a corpus into shards.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "core/rng.h"
#include "tokenizer/tokenizer.h"

namespace bert::data {

struct ExampleOptions {
  int max_seq_len = 128;
  int max_predictions = 20;  // max_predictions_per_seq
  double masked_lm_prob = 0.15;
  double short_seq_prob = 0.1;
  double random_next_prob = 0.5;
  bool whole_word_mask = false;
  int dupe_factor = 5;  // passes over the corpus, each with fresh masks and pairings
  uint64_t seed = 12345;
  void validate() const;  // UserError naming the flag
};

// [CLS] A [SEP] B [SEP] with its segment ids, masked positions (sorted) and original ids there.
struct Example {
  std::vector<int32_t> tokens;
  std::vector<int8_t> segment_ids;
  std::vector<int32_t> masked_positions, masked_ids;
  bool random_next = false;
};

using TokenizedDocument = std::vector<std::vector<int32_t>>;  // sentences of token ids, none empty

// Google's create_instances_from_document for documents[index]; "random next" text comes from the
// other documents of `documents`. Appends to `out`.
void create_examples(std::span<const TokenizedDocument> documents, size_t index, const ExampleOptions& options,
                     const tokenizer::Tokenizer& tokenizer, Rng& rng, std::vector<Example>& out);

// Masks `example.tokens` in place: n = min(max_predictions, max(1, round(len * masked_lm_prob)))
// positions among non-special tokens (whole words if asked), 80% [MASK], 10% a random regular token,
// 10% unchanged.
void mask_tokens(Example& example, const ExampleOptions& options, const tokenizer::Tokenizer& tokenizer, Rng& rng);

struct ShardBuildOptions {
  std::vector<std::string> inputs;
  std::string corpus_format = "sentences";
  std::string output_dir;
  std::string prefix = "shard";
  int64_t examples_per_shard = 65536;
  // Documents held in memory at once. Random-next text is drawn from the same window; memory use is
  // bounded by this window (text, tokens, examples) plus one shard, whatever the corpus size.
  int64_t window_documents = 10000;
  ExampleOptions examples;
};

struct ShardBuildStats {
  int64_t documents = 0, sentences = 0, examples = 0, random_next = 0, shards = 0;
  int64_t single_sentence_documents = 0;  // these only give random-next pairs (as in the reference)
  int64_t corpus_bytes = 0;
  double seconds = 0;
  std::vector<std::string> shard_paths;
};

// Streams the corpus dupe_factor times, builds examples window by window (tokenisation and example
// creation in parallel, deterministic for a seed whatever the thread count), shuffles each window's
// examples and writes shards <output_dir>/<prefix>-NNNNN.hdf5 atomically, with the tokenizer's size and
// hash in their metadata. `progress` is called after each window.
ShardBuildStats build_shards(
    const ShardBuildOptions& options, const tokenizer::Tokenizer& tokenizer,
    const std::function<void(const ShardBuildStats&, int pass, double fraction)>& progress = {});

}  // namespace bert::data
