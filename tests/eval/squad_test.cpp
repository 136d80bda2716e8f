// Question answering scored as SQuAD scores it (eval/squad.h): the normalisation and per-answer scores of
// SQuAD's evaluate script, the choice of each question's answer from its windows' logits, and the whole way
// from SQuAD records through windows back to answer texts.
#include "eval/squad.h"

#include <gtest/gtest.h>

#include <fstream>

#include "tests/common/temp_dir.h"
#include "tokenizer/load.h"

namespace bert::eval {
namespace {

TEST(SquadScoring, NormalisationExactMatchAndF1AsSquadsScript) {
  EXPECT_EQ(normalize_answer("The  Cat's hat!"), "cats hat");
  EXPECT_EQ(normalize_answer("an apple, a pear and THE end."), "apple pear and end");
  EXPECT_EQ(normalize_answer("theatre anthem"), "theatre anthem") << "articles only as whole words";
  EXPECT_EQ(answer_exact_match("Paris.", "paris"), 1.0);
  EXPECT_EQ(answer_exact_match("in Paris", "Paris"), 0.0);
  EXPECT_DOUBLE_EQ(answer_f1("the cat sat", "a cat sat down"), 0.8);  // P 2/2, R 2/3
  EXPECT_DOUBLE_EQ(answer_f1("cat cat", "cat"), 2 * 0.5 * 1 / 1.5);   // a word counts as often as it occurs
  EXPECT_EQ(answer_f1("dog", "cat"), 0.0);
  EXPECT_EQ(answer_f1("", ""), 1.0) << "no answer, rightly";
  EXPECT_EQ(answer_f1("the", "x"), 0.0) << "an answer that normalises to nothing is empty";
  // Beyond ASCII, as the script's Python gives them (its outputs pasted here): str.lower() of every letter,
  // str.split()'s whitespace, re's word boundaries around non-ASCII punctuation; only ASCII punctuation goes.
  EXPECT_EQ(normalize_answer("\u00dcber DIE Stra\u00dfe"), "\u00fcber die stra\u00dfe");
  EXPECT_EQ(normalize_answer("\u03a3\u039f\u03a6\u038a\u0391"), "\u03c3\u03bf\u03c6\u03af\u03b1");
  EXPECT_EQ(normalize_answer("\u0130stanbul"), "i\u0307stanbul") << "one letter lowers to two code points";
  EXPECT_EQ(normalize_answer("the\u00a0cat\u2003sat"), "cat sat");
  EXPECT_EQ(normalize_answer("an\u2028answer"), "answer");
  EXPECT_EQ(normalize_answer("\u00abThe\u00bb end"), "\u00ab \u00bb end");
  EXPECT_EQ(normalize_answer("\u00dcn\u00efcode, the END\u2026"), "\u00fcn\u00efcode end\u2026");
  EXPECT_EQ(answer_exact_match("STRA\u00dfE", "stra\u00dfe"), 1.0);
}

// Two windows of one question, a second question unanswerable (so the set is SQuAD 2.0's).
data::QuestionWindows two_questions() {
  data::QuestionWindows w;
  w.seq_len = 8;
  // Question 0: context words "Ann met Bob in Rome ." with two windows; tokens 3..6 hold words.
  data::QuestionWindows::Question q0{
      "q0", "Ann met Bob in Rome .", {{0, 3}, {4, 7}, {8, 11}, {12, 14}, {15, 19}, {20, 21}}, {"Rome", "in Rome"}};
  data::QuestionWindows::Question q1{"q1", "Ann met Bob .", {{0, 3}, {4, 7}, {8, 11}, {12, 13}}, {}};
  w.questions = {q0, q1};
  w.window_question = {0, 0, 1};
  w.token_word = {-1, -1, -1, 0, 1, 2, 3, -1,   // q0, words 0-3
                  -1, -1, -1, 2, 3, 4, 5, -1,   // q0, words 2-5
                  -1, -1, -1, 0, 1, 2, 3, -1};  // q1
  return w;
}

std::vector<float> logits_with(std::vector<std::pair<int, float>> start, std::vector<std::pair<int, float>> end) {
  std::vector<float> rows(16, 0.0f);
  for (auto [i, v] : start) rows[i] = v;
  for (auto [i, v] : end) rows[8 + i] = v;
  return rows;
}

TEST(SquadScoring, EachQuestionTakesItsBestValidSpanOverItsWindows) {
  const data::QuestionWindows w = two_questions();
  AnswerOptions o;
  o.max_answer_tokens = 3;
  AnswerCollector c(w, o);
  // Window 0: the best pair (1, 1) lies in the question; the next, "Ann met Bob in" (3..6, 6 + 6), is longer
  // than 3 tokens; the rest score 6 at most.
  std::vector<float> rows = logits_with({{1, 9}, {3, 6}}, {{1, 9}, {6, 6}});
  // Window 1: "Rome" (5..5) scores 4 + 4, [CLS] 1 + 1: the question's best.
  std::vector<float> second = logits_with({{5, 4}, {0, 1}}, {{5, 4}, {0, 1}});
  rows.insert(rows.end(), second.begin(), second.end());
  c.add(rows, 8);
  EXPECT_EQ(c.windows_added(), 2);
  // Question 1: its best span "Ann met" (3..4) scores 2 + 1, its [CLS] 3 + 3: unanswerable, rightly.
  c.add(logits_with({{3, 2}, {0, 3}}, {{4, 1}, {0, 3}}), 8);
  const AnswerScores s = c.finish();
  ASSERT_EQ(s.predictions.size(), 2u);
  EXPECT_EQ(s.predictions[0], (std::pair<std::string, std::string>{"q0", "Rome"}));
  EXPECT_EQ(s.predictions[1], (std::pair<std::string, std::string>{"q1", ""}));
  EXPECT_EQ(s.questions, 2);
  EXPECT_EQ(s.exact_match(), 1.0);
  EXPECT_EQ(s.f1(), 1.0);
  EXPECT_EQ(s.answerable, 1);
  EXPECT_EQ(s.unanswerable, 1);
  EXPECT_EQ(s.predictions_json().find("q0")->as_string(), "Rome");
  EXPECT_THROW(c.add(rows, 8), UserError) << "past the last window";
}

TEST(SquadScoring, AQuestionWithWindowsLeftOutIsNotScored) {
  const data::QuestionWindows w = two_questions();
  AnswerCollector c(w);
  c.add(logits_with({{4, 3}}, {{4, 2}}), 8);  // one of question 0's two windows
  const AnswerScores s = c.finish();
  EXPECT_EQ(s.questions, 0);
  EXPECT_EQ(s.unscored, 2);
}

// SQuAD records -> windows -> the labels' spans as logits -> answer texts: every question gets its first
// gold answer back (whole words of the context, "attic." for "attic", which SQuAD's normalisation equates;
// with the tokenizer, the pieces' own text: "attic").
TEST(SquadScoring, TheLabelledSpansGiveTheGoldAnswersBackAsText) {
  const auto tokenizer = tokenizer::load_tokenizer(std::string(BERT_TEST_FIXTURES_DIR) + "/hf/tiny/vocab.txt");
  testing::TempDir dir;
  std::ofstream(dir.file("qa.jsonl"))
      << R"({"id": "a", "question": "Who wrote it?", "context": "The letter was written by Mary Smith in 1905 and )"
         R"(found in the attic.", "answers": {"text": ["Mary Smith", "Smith"], "answer_start": [26, 31]}})"
      << "\n"
      << R"({"id": "b", "question": "Where?", "context": "The letter was written by Mary Smith in 1905 and found )"
         R"(in the attic.", "answers": {"text": ["attic"], "answer_start": [62]}})"
      << "\n";
  data::TaskDataOptions o;
  o.kind = data::ShardKind::kSpanLabels;
  o.max_seq_len = 32;
  o.doc_stride = 7;
  data::QuestionWindows w;
  const data::Shard s = data::make_task_shard(dir.file("qa.jsonl"), *tokenizer, o, nullptr, &w);
  ASSERT_EQ(w.window_question.size(), static_cast<size_t>(s.size));
  ASSERT_GT(s.size, 4) << "the contexts need several windows";
  ASSERT_EQ(w.questions.size(), 2u);
  EXPECT_EQ(w.questions[1].id, "b");
  // Each context token's word holds its piece.
  for (int64_t i = 0; i < s.size; ++i)
    for (int64_t j = 0; j < s.seq_len; ++j) {
      const int32_t word = w.token_word[i * s.seq_len + j];
      if (word < 0) continue;
      EXPECT_EQ(s.segment_ids[i * s.seq_len + j], 1);
      const auto& q = w.questions[w.window_question[i]];
      const auto& [from, to] = q.words[word];
      const std::vector<int32_t> pieces = tokenizer->encode(q.context.substr(from, to - from));
      EXPECT_NE(std::find(pieces.begin(), pieces.end(), s.input_ids[i * s.seq_len + j]), pieces.end());
    }
  // Logits that point at each window's label: +10 there, 0 elsewhere (a window without the answer at [CLS]).
  std::vector<float> rows(static_cast<size_t>(2 * s.size * s.seq_len), 0.0f);
  for (int64_t i = 0; i < s.size; ++i) {
    rows[(2 * i) * s.seq_len + s.labels[2 * i]] = 10;
    rows[(2 * i + 1) * s.seq_len + s.labels[2 * i + 1]] = 10;
  }
  for (const bool narrowed : {false, true}) {
    AnswerCollector c(w, {}, narrowed ? tokenizer.get() : nullptr);
    c.add(rows, s.seq_len);
    const AnswerScores scores = c.finish();
    ASSERT_EQ(scores.predictions.size(), 2u);
    EXPECT_EQ(scores.predictions[0].second, "Mary Smith");
    EXPECT_EQ(scores.predictions[1].second, narrowed ? "attic" : "attic.");
    EXPECT_EQ(scores.exact_match(), 1.0);
    EXPECT_EQ(scores.f1(), 1.0);
  }
}

}  // namespace
}  // namespace bert::eval
