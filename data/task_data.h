// Fine-tuning data: JSON lines -> task shards (data/shard.h), one line per example:
//   sequence classification: {"text": "...", "label": "news"}  (optional "text_b" for sentence pairs)
//   token classification:    {"tokens": ["The", "jury", "said"], "tags": ["DET", "NOUN", "VERB"]}
// Texts become [CLS] A [SEP] (B [SEP]). Each word of a token-classification example is tokenized on its
// own; its first piece carries the tag and its continuation pieces get the ignore label, as Hugging
// Face's token-classification recipe aligns labels; [CLS], [SEP] and padding are ignored too. Works with
// either tokenizer (WordPiece or SentencePiece).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/shard.h"
#include "tokenizer/tokenizer.h"

namespace bert::data {

struct TaskDataOptions {
  ShardKind kind = ShardKind::kSequenceLabels;  // kSequenceLabels or kTokenLabels
  int64_t max_seq_len = 128;
  // The label set, in id order. Empty: the distinct labels of the input, sorted.
  std::vector<std::string> labels;
};

struct TaskDataReport {
  int64_t examples = 0;
  int64_t truncated = 0;       // examples cut to max_seq_len
  int64_t labels_dropped = 0;  // token labels lost to truncation
};

// Reads `jsonl_path` and returns the shard (with tokenizer metadata). UserError naming the file and line
// for malformed JSON, missing fields, a label outside `options.labels`, tokens and tags of different
// lengths, or an empty input.
Shard make_task_shard(const std::string& jsonl_path, const tokenizer::Tokenizer& tokenizer,
                      const TaskDataOptions& options, TaskDataReport* report = nullptr);

// The label names of a labels file (one per line, blank lines ignored) or of a task shard (.hdf5/.h5).
std::vector<std::string> read_label_names(const std::string& path);

}  // namespace bert::data
