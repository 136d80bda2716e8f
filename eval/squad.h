// Extractive question answering scored as SQuAD scores it: each question's answer text, chosen from the
// start and end logits of all its windows, against every gold answer, after SQuAD's normalisation (lower
// case, no punctuation, no articles a/an/the, single spaces): exact match and word-overlap F1, each the best
// over the gold answers (an unanswerable question's gold answer is the empty text), as SQuAD 2.0's
// evaluate script computes them (1.1's on answerable questions).
//
// Choosing an answer, as BERT's run_squad.py and Hugging Face's run_qa.py do: in each window the
// `n_best` largest start logits and `n_best` largest end logits pair into spans of context tokens, start
// <= end, at most `max_answer_tokens` long, scored by the sum of their logits; the question's best span
// over its windows gives the text from its first token's word to its last token's word (whole words of
// the context), narrowed to the span's decoded pieces where the words hold them, letter case aside ("Tokyo"
// of "Tokyo.", as run_squad.py's get_final_text aligns them). When some question of the
// set is unanswerable (SQuAD 2.0), the empty answer is chosen where the windows' lowest [CLS] score
// (start + end logit at position 0) exceeds the best span's.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/graph.h"
#include "data/loader.h"
#include "data/task_data.h"
#include "eval/metrics.h"
#include "model/bert.h"
#include "sys/json.h"
#include "tokenizer/tokenizer.h"

namespace bert::eval {

// SQuAD's normalize_answer on UTF-8 text: lower-cased as Python lowers (tokenizer::unicode::to_lower), ASCII
// punctuation dropped, the articles a, an and the dropped where they are whole words, single spaces.
std::string normalize_answer(std::string_view text);
// SQuAD's per-answer scores of a prediction against one gold answer.
double answer_exact_match(std::string_view prediction, std::string_view gold);
double answer_f1(std::string_view prediction, std::string_view gold);

struct AnswerOptions {
  int64_t n_best = 20;
  int64_t max_answer_tokens = 30;
};

struct AnswerScores {
  int64_t questions = 0;  // scored: every window of each was evaluated
  int64_t unscored = 0;   // questions some of whose windows were not (--max-batches)
  double exact_sum = 0, f1_sum = 0;
  int64_t answerable = 0, unanswerable = 0;
  double answerable_exact_sum = 0, answerable_f1_sum = 0;
  std::vector<std::pair<std::string, std::string>> predictions;  // (question id, answer text), in input order

  double exact_match() const { return questions ? exact_sum / questions : 0.0; }
  double f1() const { return questions ? f1_sum / questions : 0.0; }
  Json to_json() const;           // the scores, without the predictions
  Json predictions_json() const;  // {"id": "answer text", ...}: the input of SQuAD's evaluate script
};

// The questions of `jsonl`, windowed again as the question-answering shard at `shard_path` was (the
// settings it records) and checked to give exactly its sequences and labels. UserError naming `flag` and
// the files otherwise (another file or tokenizer, or a shard that records no settings).
data::QuestionWindows windows_of_shard(const std::string& jsonl, const std::string& shard_path,
                                       const tokenizer::Tokenizer& tokenizer, const std::string& flag);

// What scoring questions needs beside a pass over their shard: its questions and windows, the tokenizer
// that narrows answers (or none), the choice's options, and the first window the pass reads (a pass that
// starts later, after batches held for calibration, leaves the questions with windows before it unscored).
struct QuestionScoring {
  const data::QuestionWindows& windows;
  const tokenizer::Tokenizer* tokenizer = nullptr;
  AnswerOptions options = {};
  int64_t first_window = 0;
};

// Collects the start and end logits of the windows of `windows`, in its order, and chooses and scores
// each question's answer.
class AnswerCollector {
 public:
  // `tokenizer` (the shard's, or none: whole words) narrows answers to their pieces' text.
  AnswerCollector(const data::QuestionWindows& windows, AnswerOptions options = {},
                  const tokenizer::Tokenizer* tokenizer = nullptr);
  explicit AnswerCollector(const QuestionScoring& scoring);  // skips to its first window
  // The next windows' logits: `rows` (2 n, T), each window's start logits then its end logits (the
  // question-answering head's ModelOutputs::logits). UserError past the last window or for another T.
  void add(std::span<const float> rows, int64_t t);
  int64_t windows_added() const { return next_window_; }
  // Passes over the next `n` windows (not evaluated: their questions are not scored).
  void skip(int64_t n) { next_window_ += n; }
  AnswerScores finish() const;

 private:
  struct Best {
    double span_score = -1e300, null_score = 1e300;
    int64_t first_word = -1, last_word = -1;
    int64_t window = -1, first_token = -1, last_token = -1;
    int64_t windows = 0;  // added so far
  };
  std::string answer_text(const data::QuestionWindows::Question& question, const Best& best) const;

  const data::QuestionWindows& w_;
  AnswerOptions options_;
  const tokenizer::Tokenizer* tokenizer_;
  std::vector<Best> best_;
  std::vector<int64_t> windows_of_;  // each question's number of windows
  int64_t next_window_ = 0;
};

// evaluate_task over the loader (the shard made from the questions, in order, not shuffled, at the
// scoring's first window) with each question's answer chosen and scored.
struct AnswerEvaluation {
  TaskMetrics windows;  // per window, as evaluate_task
  AnswerScores answers;
};
AnswerEvaluation evaluate_answers(model::Bert& model, data::ShardLoader& loader, const QuestionScoring& scoring,
                                  int64_t max_batches, Graph<float>& g, bool cuda_graphs = true);

}  // namespace bert::eval
