#include "eval/squad.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "eval/output_reads.h"
#include "sys/error.h"
#include "sys/utf8.h"
#include "tokenizer/unicode.h"

namespace bert::eval {

namespace {

// Python's str.isspace(): category Zs (BERT's whitespace holds them) and the control characters of
// bidirectional classes WS, B and S.
bool python_space(char32_t c) {
  return tokenizer::unicode::is_whitespace(c) || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F) || c == 0x85 ||
         c == 0x2028 || c == 0x2029;
}
// A word character of Python's re (\w: letters, digits and the underscore, in Unicode), approximated by the
// tables at hand: ASCII letters, digits and "_", and beyond ASCII whatever is neither space, punctuation nor a
// control character (symbols such as U+00A9 count as word characters here, not in re).
bool python_word(char32_t c) {
  if (c < 0x80) return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  return !python_space(c) && !tokenizer::unicode::is_punctuation(c) && !tokenizer::unicode::is_control(c);
}

std::vector<std::string> answer_words(std::string_view text) {
  std::vector<std::string> words;
  const std::string normal = normalize_answer(text);
  for (size_t i = 0; i < normal.size();) {
    const size_t end = std::min(normal.find(' ', i), normal.size());
    if (end > i) words.emplace_back(normal.substr(i, end - i));
    i = end + 1;
  }
  return words;
}

}  // namespace

std::string normalize_answer(std::string_view text) {
  // lower(), then no string.punctuation (ASCII), then re.sub(r"\b(a|an|the)\b", " "), then split() and
  // join with single spaces, as the script does them.
  static constexpr std::u32string_view kPunctuation = U"!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~";
  std::u32string kept;
  for (char32_t c : tokenizer::unicode::to_lower(utf8::decode(text)))
    if (kPunctuation.find(c) == std::u32string_view::npos) kept.push_back(c);
  // \b: between a word character and another (or the ends).
  auto word_at = [&](size_t i) { return i < kept.size() && python_word(kept[i]); };
  std::u32string spaced;
  for (size_t i = 0; i < kept.size();) {
    size_t article = 0;
    if (i == 0 || !word_at(i - 1))
      for (std::u32string_view a : {std::u32string_view(U"a"), std::u32string_view(U"an"), std::u32string_view(U"the")})
        if (kept.compare(i, a.size(), a) == 0 && !word_at(i + a.size())) article = a.size();
    if (article) {
      spaced.push_back(U' ');
      i += article;
    } else {
      spaced.push_back(kept[i++]);
    }
  }
  std::u32string out;
  for (size_t i = 0; i < spaced.size();) {
    while (i < spaced.size() && python_space(spaced[i])) ++i;
    size_t end = i;
    while (end < spaced.size() && !python_space(spaced[end])) ++end;
    if (end > i) {
      if (!out.empty()) out.push_back(U' ');
      out.append(spaced, i, end - i);
    }
    i = end;
  }
  return utf8::encode(out);
}

double answer_exact_match(std::string_view prediction, std::string_view gold) {
  return normalize_answer(prediction) == normalize_answer(gold) ? 1.0 : 0.0;
}

double answer_f1(std::string_view prediction, std::string_view gold) {
  const std::vector<std::string> p = answer_words(prediction), g = answer_words(gold);
  if (p.empty() || g.empty()) return p == g ? 1.0 : 0.0;
  std::map<std::string, int64_t> counts;
  for (const std::string& w : g) ++counts[w];
  int64_t same = 0;
  for (const std::string& w : p)
    if (auto it = counts.find(w); it != counts.end() && it->second > 0) --it->second, ++same;
  if (same == 0) return 0.0;
  const double precision = double(same) / p.size(), recall = double(same) / g.size();
  return 2 * precision * recall / (precision + recall);
}

Json AnswerScores::to_json() const {
  Json j;
  j["exact_match"] = exact_match();
  j["f1"] = f1();
  j["questions"] = questions;
  if (unscored) j["questions_not_scored"] = unscored;
  if (unanswerable) {
    j["answerable"] = answerable;
    j["answerable_exact_match"] = answerable ? answerable_exact_sum / answerable : 0.0;
    j["answerable_f1"] = answerable ? answerable_f1_sum / answerable : 0.0;
    j["unanswerable"] = unanswerable;
  }
  return j;
}

Json AnswerScores::predictions_json() const {
  Json j = Json::Object{};
  for (const auto& [id, text] : predictions) j[id] = text;
  return j;
}

AnswerCollector::AnswerCollector(const data::QuestionWindows& windows, AnswerOptions options,
                                 const tokenizer::Tokenizer* tokenizer)
    : w_(windows),
      options_(options),
      tokenizer_(tokenizer),
      best_(windows.questions.size()),
      windows_of_(windows.questions.size(), 0) {
  BERT_CHECK(options.n_best >= 1 && options.max_answer_tokens >= 1, "AnswerCollector: bad options");
  for (int32_t q : windows.window_question) ++windows_of_[q];
}

void AnswerCollector::add(std::span<const float> rows, int64_t t) {
  if (t != w_.seq_len)
    throw UserError("question windows of " + std::to_string(w_.seq_len) + " tokens, logits of " + std::to_string(t));
  const auto n = static_cast<int64_t>(rows.size()) / (2 * t);
  if (next_window_ + n > static_cast<int64_t>(w_.window_question.size()))
    throw UserError("more windows evaluated (" + std::to_string(next_window_ + n) + ") than the questions make (" +
                    std::to_string(w_.window_question.size()) + ")");
  std::vector<int32_t> starts(static_cast<size_t>(t)), ends(static_cast<size_t>(t));
  const auto keep = static_cast<std::ptrdiff_t>(std::min(options_.n_best, t));
  for (int64_t i = 0; i < n; ++i, ++next_window_) {
    const float *start = rows.data() + 2 * i * t, *end = start + t;
    const int32_t* word = w_.token_word.data() + next_window_ * t;
    // The n_best largest of each (ties: the earlier position first).
    auto top = [&](std::vector<int32_t>& order, const float* logits) {
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + keep, order.end(), [logits](int32_t a, int32_t b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
      });
    };
    top(starts, start);
    top(ends, end);
    Best& best = best_[w_.window_question[next_window_]];
    for (std::ptrdiff_t a = 0; a < keep; ++a)
      for (std::ptrdiff_t b = 0; b < keep; ++b) {
        const int32_t s = starts[a], e = ends[b];
        if (word[s] < 0 || word[e] < 0 || e < s || e - s + 1 > options_.max_answer_tokens) continue;
        const double score = double(start[s]) + double(end[e]);
        if (score > best.span_score) {
          best.span_score = score, best.first_word = word[s], best.last_word = word[e];
          best.window = next_window_, best.first_token = s, best.last_token = e;
        }
      }
    best.null_score = std::min(best.null_score, double(start[0]) + double(end[0]));
    ++best.windows;
  }
}

AnswerCollector::AnswerCollector(const QuestionScoring& scoring)
    : AnswerCollector(scoring.windows, scoring.options, scoring.tokenizer) {
  skip(scoring.first_window);
}

std::string AnswerCollector::answer_text(const data::QuestionWindows::Question& question, const Best& best) const {
  const size_t from = question.words[best.first_word].first, to = question.words[best.last_word].second;
  const std::string words = question.context.substr(from, to - from);
  if (!tokenizer_ || w_.tokens.empty()) return words;
  const int32_t* tokens = w_.tokens.data() + best.window * w_.seq_len;
  const std::string pieces = tokenizer_->decode(std::span(tokens + best.first_token, tokens + best.last_token + 1));
  auto lower = [](std::string s) {
    for (char& c : s) c = c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c;
    return s;
  };
  const size_t at = pieces.empty() ? std::string::npos : lower(words).find(lower(pieces));
  return at == std::string::npos ? words : words.substr(at, pieces.size());
}

AnswerScores AnswerCollector::finish() const {
  AnswerScores r;
  const bool version2 = std::any_of(w_.questions.begin(), w_.questions.end(),
                                    [](const data::QuestionWindows::Question& q) { return q.answers.empty(); });
  for (size_t q = 0; q < w_.questions.size(); ++q) {
    const data::QuestionWindows::Question& question = w_.questions[q];
    const Best& best = best_[q];
    if (best.windows < windows_of_[q]) {
      ++r.unscored;
      continue;
    }
    std::string text;
    if (best.first_word >= 0 && !(version2 && best.null_score > best.span_score)) text = answer_text(question, best);
    double exact = 0, f1 = 0;
    const std::vector<std::string> golds = question.answers.empty() ? std::vector<std::string>{""} : question.answers;
    for (const std::string& gold : golds) {
      exact = std::max(exact, answer_exact_match(text, gold));
      f1 = std::max(f1, answer_f1(text, gold));
    }
    ++r.questions;
    r.exact_sum += exact, r.f1_sum += f1;
    if (question.answers.empty()) {
      ++r.unanswerable;
    } else {
      ++r.answerable;
      r.answerable_exact_sum += exact, r.answerable_f1_sum += f1;
    }
    r.predictions.emplace_back(question.id, std::move(text));
  }
  return r;
}

data::QuestionWindows windows_of_shard(const std::string& jsonl, const std::string& shard_path,
                                       const tokenizer::Tokenizer& tokenizer, const std::string& flag) {
  const data::Shard shard = data::read_shard(shard_path);
  if (shard.kind != data::ShardKind::kSpanLabels)
    throw UserError(flag + ": '" + shard_path + "' is not a question-answering shard");
  if (shard.doc_stride <= 0 || shard.max_query_len <= 0)
    throw UserError(flag + ": shard '" + shard_path +
                    "' does not record how its windows were cut (make it again with bert-data task --task qa)");
  data::TaskDataOptions o;
  o.kind = data::ShardKind::kSpanLabels;
  o.max_seq_len = shard.seq_len, o.doc_stride = shard.doc_stride, o.max_query_len = shard.max_query_len;
  data::QuestionWindows windows;
  const data::Shard again = data::make_task_shard(jsonl, tokenizer, o, nullptr, &windows);
  if (again.input_ids != shard.input_ids || again.labels != shard.labels)
    throw UserError(flag + " '" + jsonl + "' does not give the sequences of '" + shard_path +
                    "' (made from another file, or with another tokenizer)");
  return windows;
}

AnswerEvaluation evaluate_answers(model::Bert& model, data::ShardLoader& loader, const QuestionScoring& scoring,
                                  int64_t max_batches, Graph<float>& g, bool cuda_graphs) {
  BERT_CHECK(model.config().head == model::Head::kQuestionAnswering,
             "evaluate_answers needs a question-answering model");
  AnswerEvaluation r{TaskMetrics::for_head(model.config()), {}};
  AnswerCollector answers(scoring);
  BatchEvaluator evaluator(model, g, cuda_graphs);
  auto take = [&](const OutputReads& reads) {
    reads.add_to(r.windows);
    answers.add(reads.head_values(), reads.head_cols);
  };
  Batch batch;
  for (int64_t n = 0; (max_batches <= 0 || n < max_batches) && loader.next(batch); ++n)
    if (const OutputReads* reads = evaluator.queue(batch.view())) take(*reads);
  if (const OutputReads* reads = evaluator.finish()) take(*reads);
  g.clear();
  r.answers = answers.finish();
  return r;
}

}  // namespace bert::eval
