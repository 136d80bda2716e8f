// ExamplePredictions: each example's prediction, for bert-eval --predictions (a task model on task shards,
// without --qa-data): one JSON object per sequence, in the order the evaluation read them, so that users
// compute metrics of their own (a reranker's MRR over its queries), compare two runs example by example,
// or read what the model got wrong. Each object has "index" (the sequence's position in the pass) and:
//   sequence classification: "label" (the predicted name), "target" (the shard's), "logits";
//   regression:              "score", "target" (and "group": the loader's group number, where the shards
//                            have groups);
//   token classification:    "tags" and "targets", the labeled tokens' (each word's first piece) in order;
//   question answering:      "start", "end" (the most likely positions), "target_start", "target_end".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "eval/output_reads.h"
#include "model/config.h"
#include "sys/json.h"

namespace bert::eval {

class ExamplePredictions {
 public:
  explicit ExamplePredictions(const model::BertConfig& config) : config_(config) {}
  // Adds one batch's predictions, read back (its reads are the batch's, in order).
  void add(const OutputReads& reads);
  const std::vector<Json>& examples() const { return examples_; }
  // One JSON object a line.
  std::string jsonl() const;

 private:
  model::BertConfig config_;
  int64_t sequences_ = 0;  // the sequences of the batches added so far
  std::vector<Json> examples_;
};

}  // namespace bert::eval
