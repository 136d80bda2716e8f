// Fine-tuning data: JSON lines -> task shards (data/shard.h), one line per example:
//   sequence classification: {"text": "...", "label": "news"}  (optional "text_b" for sentence pairs)
//   sequence regression:     {"text": "...", "text_b": "...", "label": 3.8}  (a score: STS-B's similarity,
//                             a cross-encoder's relevance; any finite number)
//   token classification:    {"tokens": ["The", "jury", "said"], "tags": ["DET", "NOUN", "VERB"]}
// The classification fields may have other names (TaskFields: Hugging Face datasets' GLUE exports have
// "sentence1", "sentence2"; CoNLL-2003's "ner_tags"), and a label or tag may be a string, an integer (a
// dataset's class id: "label": 1) or a boolean; integers and booleans name the label by their JSON text.
//   question answering:      {"question": "...", "context": "...",
//                             "answers": {"text": ["..."], "answer_start": [17]}}   (SQuAD's layout, as
//                             Hugging Face datasets write it; "answers": [{"text", "answer_start"}] too;
//                             no answers: unanswerable, SQuAD 2.0)
// Texts become [CLS] A [SEP] (B [SEP]). Each word of a token-classification example is tokenized on its
// own; its first piece carries the tag and its continuation pieces get the ignore label, as Hugging
// Face's token-classification recipe aligns labels; [CLS], [SEP] and padding are ignored too. A question
// becomes [CLS] question [SEP] context window [SEP], one sequence per window of a long context (BERT's
// run_squad.py): the context is split at whitespace, each word tokenized on its own, and the first
// answer's characters (answer_start counts Unicode characters, as Python does) mapped to the first piece
// of its first word and the last piece of its last word, narrowed to the answer's own pieces where they
// occur there ("attic" in "attic."); a window without the whole answer, and an
// unanswerable question, point at [CLS] (0, 0). Works with either tokenizer (WordPiece or SentencePiece).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "data/shard.h"
#include "tokenizer/tokenizer.h"

namespace bert::data {

// The JSON fields a classification example is read from (question answering: SQuAD's, fixed).
struct TaskFields {
  std::string text = "text", text_b = "text_b";  // seq-cls: the text, and the optional pair (absent or null: none)
  std::string label = "label";                   // seq-cls: the label; seq-reg: the score
  // seq-reg: each example's group (a query, whose passages a reranker ranks: a string or an integer); empty:
  // none. Groups are numbered in the order they first occur.
  std::string group;
  std::string tokens = "tokens", tags = "tags";  // token-cls
};

struct TaskDataOptions {
  ShardKind kind = ShardKind::kSequenceLabels;  // kSequenceLabels, kTokenLabels, kSpanLabels or kSequenceScores
  int64_t max_seq_len = 128;
  // Question answering: tokens between the starts of consecutive windows of a long context (BERT's
  // doc_stride; Hugging Face's run_qa.py passes its doc_stride as the windows' overlap instead), and the
  // question's tokens kept (the rest cut).
  int64_t doc_stride = 128;
  int64_t max_query_len = 64;
  // The label set, in id order (none for sequence regression). Empty: the distinct labels of the input, sorted (as
  // numbers where every label is an integer, so that a dataset's class ids 0..K-1 keep their ids).
  std::vector<std::string> labels;
  TaskFields fields;
};

struct TaskDataReport {
  int64_t examples = 0;
  int64_t truncated = 0;       // examples cut to max_seq_len (question answering: questions cut)
  int64_t labels_dropped = 0;  // token labels lost to truncation
  // Question answering: sequences written (windows), those of them without the answer (labelled 0, 0),
  // unanswerable questions, and answers whose text is not the context's at answer_start (skipped).
  int64_t windows = 0, windows_without_answer = 0, unanswerable = 0, answers_not_found = 0;
};

// Question answering: what scoring answers as text needs beyond the shard (eval/squad.h): each question
// (its id, context, the context's words as byte ranges, every gold answer's text) and, for each window of
// the shard in order, its question, its tokens and the context word of each of them.
struct QuestionWindows {
  struct Question {
    std::string id;  // the line's "id", else its line number
    std::string context;
    std::vector<std::pair<size_t, size_t>> words;  // [begin, end) bytes of each whitespace word
    std::vector<std::string> answers;              // empty: unanswerable
  };
  std::vector<Question> questions;
  int64_t seq_len = 0;
  std::vector<int32_t> window_question;  // (windows)
  std::vector<int32_t> token_word;       // (windows, seq_len): the context word of each token, -1 elsewhere
  std::vector<int32_t> tokens;           // (windows, seq_len): the shard's input_ids
};

// Reads `jsonl_path` and returns the shard (with tokenizer metadata). UserError naming the file and line
// for malformed JSON, missing fields (by their TaskFields names), a label outside `options.labels` (-1 noted
// as an unlabelled test split's), tokens and tags of different
// lengths, an answer_start outside its context, or an empty input. Question answering: `windows`, when
// given, receives the questions and windows of the shard.
Shard make_task_shard(const std::string& jsonl_path, const tokenizer::Tokenizer& tokenizer,
                      const TaskDataOptions& options, TaskDataReport* report = nullptr,
                      QuestionWindows* windows = nullptr);

// The label names of a labels file (one per line, blank lines ignored) or of a task shard (.hdf5/.h5).
std::vector<std::string> read_label_names(const std::string& path);

}  // namespace bert::data
