#include "data/task_data.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <string_view>

#include "sys/error.h"
#include "sys/json.h"
#include "sys/text_file.h"

namespace bert::data {

namespace {

struct Line {
  std::string where;  // "file:line" for messages
  Json json;
};

// A classification field is named by a flag (`flag`, or none): the flag is named where the field is missing.
std::string missing(const Line& line, const std::string& key, const char* flag) {
  return line.json.find(key) || !flag ? "" : std::string(" (") + flag + " names the field to read)";
}
const std::string& string_field(const Line& line, const std::string& key, const char* flag = nullptr) {
  const Json* v = line.json.find(key);
  if (!v || !v->is_string())
    throw UserError(line.where + ": expected a string field \"" + key + "\"" + missing(line, key, flag));
  return v->as_string();
}

// A label as a string: a string as it is, an integer (a dataset's class id) or a boolean as its JSON text.
bool is_label(const Json& v) {
  return v.is_string() || v.is_bool() ||
         (v.is_number() && std::isfinite(v.as_number()) && v.as_number() == std::trunc(v.as_number()) &&
          std::fabs(v.as_number()) < 1e15);
}
std::string label_text(const Json& v) {
  if (v.is_string()) return v.as_string();
  if (v.is_bool()) return v.as_bool() ? "true" : "false";
  return std::to_string(static_cast<int64_t>(v.as_number()));
}
const Json& label_field(const Line& line, const std::string& key, const char* flag) {
  const Json* v = line.json.find(key);
  if (!v || !is_label(*v))
    throw UserError(line.where + ": expected a label field \"" + key + "\" (a string, an integer or a boolean" +
                    (v && v->is_number() ? "; a fractional number is a score: --task seq-reg makes a regression" : "") +
                    ")" + missing(line, key, flag));
  return *v;
}

// A sequence's score (regression): a finite JSON number.
float score_field(const Line& line, const std::string& key) {
  const Json* v = line.json.find(key);
  if (!v || !v->is_number() || !std::isfinite(v->as_number()) || std::fabs(v->as_number()) > 3e38)
    throw UserError(line.where + ": expected a score field \"" + key + "\" (a finite number)" +
                    missing(line, key, "--label-field"));
  return static_cast<float>(v->as_number());
}

// Whether `label` is an integer written as such ("7", "-1"; not "07"), and which.
std::optional<int64_t> integer_label(const std::string& label) {
  int64_t n = 0;
  const auto [end, error] = std::from_chars(label.data(), label.data() + label.size(), n);
  if (error != std::errc{} || end != label.data() + label.size() || std::to_string(n) != label) return std::nullopt;
  return n;
}

// An array field whose items are strings (items_are_labels: labels, is_label).
const Json::Array& array_field(const Line& line, const std::string& key, const char* flag,
                               bool items_are_labels = false) {
  const Json* v = line.json.find(key);
  if (!v || !v->is_array())
    throw UserError(line.where + ": expected an array field \"" + key + "\"" + missing(line, key, flag));
  for (const Json& item : v->as_array())
    if (items_are_labels ? !is_label(item) : !item.is_string())
      throw UserError(line.where + ": \"" + key + "\" must hold " +
                      (items_are_labels ? "labels (strings, integers or booleans)" : "strings"));
  return v->as_array();
}

// Labels in id order: sorted, as numbers where every one is an integer written as such ("7", "-1"; not "07").
std::vector<std::string> sorted_labels(const std::set<std::string>& seen) {
  std::vector<std::pair<int64_t, std::string>> numbers;
  for (const std::string& l : seen) {
    const std::optional<int64_t> n = integer_label(l);
    if (!n) return {seen.begin(), seen.end()};
    numbers.emplace_back(*n, l);
  }
  std::sort(numbers.begin(), numbers.end());
  std::vector<std::string> labels;
  for (auto& [n, l] : numbers) labels.push_back(std::move(l));
  return labels;
}

std::vector<Line> read_lines(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw UserError("task data '" + path + "' cannot be read (missing?)");
  std::vector<Line> lines;
  std::string text;
  for (int64_t number = 1; std::getline(in, text); ++number) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    Line line{path + ":" + std::to_string(number), {}};
    try {
      line.json = Json::parse(text);
    } catch (const UserError& e) {
      throw UserError(line.where + ": not a JSON object (" + e.what() + ")");
    }
    if (!line.json.is_object()) throw UserError(line.where + ": expected a JSON object");
    lines.push_back(std::move(line));
  }
  if (lines.empty()) throw UserError("task data '" + path + "' holds no examples");
  return lines;
}

// A context as SQuAD's words: runs of characters between whitespace (' ', tab, CR, LF, U+202F), with their
// byte ranges, the word each character belongs to (a whitespace character: the word before it) and each
// character's byte offset in the UTF-8 text (one more at the end).
struct ContextWords {
  std::vector<std::string> words;
  std::vector<std::pair<size_t, size_t>> spans;
  std::vector<int64_t> char_word;
  std::vector<size_t> char_byte;
};

ContextWords split_context(const std::string& text) {
  ContextWords c;
  bool after_space = true;
  for (size_t i = 0; i < text.size();) {
    const auto lead = static_cast<unsigned char>(text[i]);
    size_t len = lead < 0x80 ? 1 : lead >> 5 == 0x6 ? 2 : lead >> 4 == 0xE ? 3 : lead >> 3 == 0x1E ? 4 : 1;
    len = std::min(len, text.size() - i);
    const std::string_view ch(text.data() + i, len);
    const bool space = ch == " " || ch == "\t" || ch == "\r" || ch == "\n" || ch == "\xE2\x80\xAF";
    if (!space) {
      if (after_space) c.words.emplace_back(), c.spans.emplace_back(i, i);
      c.words.back().append(ch);
      c.spans.back().second = i + len;
    }
    after_space = space;
    c.char_byte.push_back(i);
    c.char_word.push_back(static_cast<int64_t>(c.words.size()) - 1);
    i += len;
  }
  c.char_byte.push_back(text.size());
  return c;
}

int64_t count_chars(const std::string& text) {
  int64_t n = 0;
  for (char ch : text) n += (static_cast<unsigned char>(ch) & 0xC0) != 0x80;
  return n;
}

// The answers of a question-answering line: each one's text and first character's index (none: an empty
// "answers", unanswerable).
std::vector<std::pair<std::string, int64_t>> read_answers(const Line& line) {
  const Json* answers = line.json.find("answers");
  auto bad = [&] {
    return UserError(line.where +
                     ": expected \"answers\": {\"text\": [...], \"answer_start\": [...]} or [{\"text\": ..., "
                     "\"answer_start\": ...}]");
  };
  if (!answers) throw bad();
  std::vector<std::pair<std::string, int64_t>> out;
  auto add = [&](const Json* text, const Json* start) {
    if (!text || !start || !text->is_string() || !start->is_number()) throw bad();
    out.emplace_back(text->as_string(), start->as_int());
  };
  if (answers->is_object()) {
    const Json *texts = answers->find("text"), *starts = answers->find("answer_start");
    if (!texts || !starts || !texts->is_array() || !starts->is_array() ||
        texts->as_array().size() != starts->as_array().size())
      throw bad();
    for (size_t i = 0; i < texts->as_array().size(); ++i) add(&texts->as_array()[i], &starts->as_array()[i]);
  } else if (answers->is_array()) {
    for (const Json& answer : answers->as_array()) {
      if (!answer.is_object()) throw bad();
      add(answer.find("text"), answer.find("answer_start"));
    }
  } else {
    throw bad();
  }
  return out;
}

void append_question_windows(const Line& line, const tokenizer::Tokenizer& tokenizer, const TaskDataOptions& options,
                             Shard& shard, TaskDataReport& r, QuestionWindows* windows) {
  const tokenizer::SpecialTokens& special = tokenizer.specials();
  std::vector<int32_t> question = tokenizer.encode(string_field(line, "question"));
  if (static_cast<int64_t>(question.size()) > options.max_query_len) {
    question.resize(static_cast<size_t>(options.max_query_len));
    ++r.truncated;
  }
  const int64_t room = options.max_seq_len - static_cast<int64_t>(question.size()) - 3;
  if (room < 1)
    throw UserError(line.where + ": --max-seq-len " + std::to_string(options.max_seq_len) +
                    " leaves no room for the context after the question's " + std::to_string(question.size()) +
                    " tokens (raise --max-seq-len or lower --max-query-len)");
  const ContextWords context = split_context(string_field(line, "context"));
  const std::vector<std::pair<std::string, int64_t>> answers = read_answers(line);
  const auto answer = answers.empty() ? std::nullopt : std::optional(answers.front());  // the one trained on
  int64_t first_word = -1, last_word = -1;
  if (answer) {
    const int64_t chars = static_cast<int64_t>(context.char_word.size()), start = answer->second,
                  length = count_chars(answer->first);
    if (start < 0 || start + length > chars)
      throw UserError(line.where + ": answer_start " + std::to_string(start) + " with an answer of " +
                      std::to_string(length) + " characters is outside the context's " + std::to_string(chars) +
                      " characters");
    const size_t from = context.char_byte[start], to = context.char_byte[start + length];
    const std::string& text = string_field(line, "context");
    if (length == 0 || text.compare(from, to - from, answer->first) != 0) {
      ++r.answers_not_found;  // skipped, as BERT's run_squad.py skips them
      return;
    }
    first_word = context.char_word[start], last_word = context.char_word[start + length - 1];
  } else {
    ++r.unanswerable;
  }
  // Each word's pieces; the answer's span in them.
  std::vector<int32_t> pieces, piece_word;
  std::vector<int64_t> word_start(context.words.size() + 1);
  for (size_t w = 0; w < context.words.size(); ++w) {
    word_start[w] = static_cast<int64_t>(pieces.size());
    std::vector<int32_t> p = tokenizer.encode(context.words[w]);
    if (p.empty()) p.push_back(special.unk);  // a word the tokenizer drops keeps its place
    pieces.insert(pieces.end(), p.begin(), p.end());
    piece_word.resize(pieces.size(), static_cast<int32_t>(w));
  }
  if (windows) {
    QuestionWindows::Question q;
    const Json* id = line.json.find("id");
    q.id = id && id->is_string() ? id->as_string() : line.where;
    q.context = string_field(line, "context");
    q.words = context.spans;
    for (const auto& a : answers) q.answers.push_back(a.first);
    windows->questions.push_back(std::move(q));
    windows->seq_len = options.max_seq_len;
  }
  const auto total = static_cast<int64_t>(pieces.size());
  word_start[context.words.size()] = total;
  int64_t answer_first = answer ? word_start[first_word] : -1;
  int64_t answer_last = answer ? word_start[last_word + 1] - 1 : -1;
  if (answer) {  // the answer's own pieces where its words hold them ("attic" in "attic."), as run_squad.py
    const std::vector<int32_t> own = tokenizer.encode(answer->first);
    const auto n = static_cast<int64_t>(own.size());
    for (int64_t s = answer_first; n > 0 && s + n - 1 <= answer_last; ++s)
      if (std::equal(own.begin(), own.end(), pieces.begin() + s)) {
        answer_first = s, answer_last = s + n - 1;
        break;
      }
  }

  std::vector<int32_t> tokens;
  std::vector<int8_t> segments;
  const auto offset = static_cast<int32_t>(question.size() + 2);  // [CLS] question [SEP]
  for (int64_t begin = 0;;) {
    const int64_t length = std::min(room, total - begin);
    tokens.assign(1, special.cls);
    tokens.insert(tokens.end(), question.begin(), question.end());
    tokens.push_back(special.sep);
    segments.assign(tokens.size(), 0);
    tokens.insert(tokens.end(), pieces.begin() + begin, pieces.begin() + begin + length);
    tokens.push_back(special.sep);
    segments.resize(tokens.size(), 1);
    std::array<int32_t, 2> span = {0, 0};
    if (answer && answer_first >= begin && answer_last < begin + length)
      span = {offset + static_cast<int32_t>(answer_first - begin), offset + static_cast<int32_t>(answer_last - begin)};
    else
      ++r.windows_without_answer;
    shard.append_labeled(tokens, segments, span);
    ++r.windows;
    if (windows) {
      windows->window_question.push_back(static_cast<int32_t>(windows->questions.size() - 1));
      windows->token_word.resize(windows->token_word.size() + options.max_seq_len, -1);
      std::copy_n(piece_word.begin() + begin, length, windows->token_word.end() - options.max_seq_len + offset);
      windows->tokens.insert(windows->tokens.end(), tokens.begin(), tokens.end());
      windows->tokens.resize(windows->token_word.size(), 0);
    }
    if (begin + length >= total) break;
    begin += std::min(length, options.doc_stride);
  }
  ++r.examples;
}

}  // namespace

std::vector<std::string> read_label_names(const std::string& path) {
  if (path.ends_with(".hdf5") || path.ends_with(".h5")) {
    const Shard shard = read_shard(path);
    if (!shard.is_task()) throw UserError("'" + path + "' is a pretraining shard: it has no labels");
    return shard.label_names;
  }
  std::vector<std::string> names;
  std::string all = read_text_file(path, "labels file"), line;
  for (size_t start = 0; start < all.size();) {
    size_t end = all.find('\n', start);
    if (end == std::string::npos) end = all.size();
    line = all.substr(start, end - start);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!line.empty()) names.push_back(line);
    start = end + 1;
  }
  if (names.size() < 2) throw UserError("labels file '" + path + "': expected at least 2 labels, one per line");
  std::set<std::string> distinct(names.begin(), names.end());
  if (distinct.size() != names.size()) throw UserError("labels file '" + path + "' lists a label twice");
  return names;
}

Shard make_task_shard(const std::string& path, const tokenizer::Tokenizer& tokenizer, const TaskDataOptions& options,
                      TaskDataReport* report, QuestionWindows* windows) {
  BERT_CHECK(options.kind != ShardKind::kPretraining, "make_task_shard needs a task kind");
  if (options.max_seq_len < 3) throw UserError("--max-seq-len: expected at least 3");
  const bool per_token = options.kind == ShardKind::kTokenLabels;
  const std::vector<Line> lines = read_lines(path);
  if (options.kind == ShardKind::kSpanLabels) {
    if (options.doc_stride < 1) throw UserError("--doc-stride: expected at least 1");
    if (options.max_query_len < 1) throw UserError("--max-query-len: expected at least 1");
    Shard shard(options.max_seq_len, 0);
    shard.kind = options.kind;
    shard.label_names = {"start", "end"};
    shard.doc_stride = options.doc_stride, shard.max_query_len = options.max_query_len;
    if (windows) *windows = QuestionWindows{};
    shard.metadata = ShardMetadata{tokenizer.vocab_size(), tokenizer.file_sha256(), options.max_seq_len, 0, 0};
    TaskDataReport r;
    for (const Line& line : lines) append_question_windows(line, tokenizer, options, shard, r, windows);
    if (shard.size == 0)
      throw UserError("task data '" + path + "': no question's answer was found in its context (answer_start?)");
    if (report) *report = r;
    return shard;
  }

  const TaskFields& f = options.fields;
  const bool scored = options.kind == ShardKind::kSequenceScores;
  BERT_CHECK(!scored || options.labels.empty(), "a sequence regression has no label set");
  BERT_CHECK(scored || f.group.empty(), "groups are a sequence regression's");
  std::vector<std::string> labels = scored ? std::vector<std::string>{"score"} : options.labels;
  if (labels.empty()) {
    std::set<std::string> seen;
    for (const Line& line : lines) {
      if (per_token)
        for (const Json& tag : array_field(line, f.tags, "--tags-field", true)) seen.insert(label_text(tag));
      else
        seen.insert(label_text(label_field(line, f.label, "--label-field")));
    }
    labels = sorted_labels(seen);
    if (labels.size() < 2)
      throw UserError("task data '" + path + "' has fewer than 2 distinct labels: nothing to classify");
  }
  std::map<std::string, int32_t> label_ids;
  for (size_t i = 0; i < labels.size(); ++i) label_ids[labels[i]] = static_cast<int32_t>(i);
  // A label set of names, none of them an integer: a JSON integer k is then the k-th name (a Hugging Face
  // dataset's ClassLabel: class ids in the data, their names in --labels).
  const bool named_classes =
      std::none_of(labels.begin(), labels.end(), [](const std::string& l) { return integer_label(l).has_value(); });
  auto label_id = [&](const Line& line, const Json& value) {
    const std::string name = label_text(value);
    if (auto it = label_ids.find(name); it != label_ids.end()) return it->second;
    if (named_classes && value.is_number() && value.as_number() >= 0 && value.as_number() < double(labels.size()))
      return static_cast<int32_t>(value.as_number());
    throw UserError(line.where + ": label '" + name + "' is not one of the " + std::to_string(labels.size()) +
                    " labels (--labels)" +
                    (name == "-1" ? "; -1 marks the unlabelled examples of a Hugging Face dataset's test split" : ""));
  };

  const tokenizer::SpecialTokens& special = tokenizer.specials();
  Shard shard(options.max_seq_len, 0);
  shard.kind = options.kind;
  shard.label_names = labels;
  shard.metadata = ShardMetadata{tokenizer.vocab_size(), tokenizer.file_sha256(), options.max_seq_len, 0, 0};
  TaskDataReport r;
  const auto limit = static_cast<size_t>(options.max_seq_len);
  std::vector<int32_t> tokens, token_labels;
  std::vector<int8_t> segments;
  std::map<std::string, int32_t> group_ids;
  auto group_of = [&](const Line& line) {
    if (f.group.empty()) return -1;
    const Json* v = line.json.find(f.group);
    if (!v || !(v->is_string() || is_label(*v)) || v->is_bool())
      throw UserError(line.where + ": expected a group field \"" + f.group +
                      "\" (a string or an integer: the query the example belongs to) (--group-field)");
    return group_ids.emplace(label_text(*v), static_cast<int32_t>(group_ids.size())).first->second;
  };
  for (const Line& line : lines) {
    tokens.assign(1, special.cls);
    token_labels.assign(1, kIgnoredLabel);
    bool truncated = false;
    if (per_token) {
      const Json::Array& words = array_field(line, f.tokens, "--tokens-field");
      const Json::Array& tags = array_field(line, f.tags, "--tags-field", true);
      if (words.size() != tags.size())
        throw UserError(line.where + ": " + std::to_string(words.size()) + " tokens (\"" + f.tokens + "\") but " +
                        std::to_string(tags.size()) + " tags (\"" + f.tags + "\")");
      for (size_t w = 0; w < words.size(); ++w) {
        const int32_t tag = label_id(line, tags[w]);
        std::vector<int32_t> pieces = tokenizer.encode(words[w].as_string());
        if (pieces.empty()) pieces.push_back(special.unk);  // a word the tokenizer drops still carries its tag
        if (tokens.size() + pieces.size() + 1 > limit) {
          truncated = true;
          r.labels_dropped += static_cast<int64_t>(words.size() - w);
          break;
        }
        for (size_t p = 0; p < pieces.size(); ++p) {
          tokens.push_back(pieces[p]);
          token_labels.push_back(p == 0 ? tag : kIgnoredLabel);
        }
      }
      tokens.push_back(special.sep);
      token_labels.push_back(kIgnoredLabel);
      segments.assign(tokens.size(), 0);
    } else {
      std::vector<int32_t> a = tokenizer.encode(string_field(line, f.text, "--text-fields")), b;
      const Json* second = f.text_b.empty() ? nullptr : line.json.find(f.text_b);
      const bool pair = second && !second->is_null();
      if (pair) b = tokenizer.encode(string_field(line, f.text_b, "--text-fields"));
      const size_t room = limit - (pair ? 3 : 2);
      while (a.size() + b.size() > room) {  // longest first, as BERT's and Hugging Face's truncation
        truncated = true;
        (a.size() >= b.size() ? a : b).pop_back();
      }
      tokens.insert(tokens.end(), a.begin(), a.end());
      tokens.push_back(special.sep);
      segments.assign(tokens.size(), 0);
      if (pair) {
        tokens.insert(tokens.end(), b.begin(), b.end());
        tokens.push_back(special.sep);
        segments.resize(tokens.size(), 1);
      }
      if (!scored) token_labels.assign(1, label_id(line, label_field(line, f.label, "--label-field")));
    }
    r.truncated += truncated;
    if (scored)
      shard.append_scored(tokens, segments, score_field(line, f.label), group_of(line));
    else
      shard.append_labeled(tokens, segments, token_labels);
    ++r.examples;
  }
  if (report) *report = r;
  return shard;
}

}  // namespace bert::data
