#include "data/corpus.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <filesystem>
#include <unordered_set>

#include "sys/error.h"

namespace bert::data {

CorpusFormat parse_corpus_format(const std::string& name) {
  return kCorpusFormatNames.parse(name, "unknown corpus format");
}

// ------------------------------------------------------------------ sentence splitting

namespace {

// Abbreviations after which a period does not end a sentence (lowercase, without the period).
const std::unordered_set<std::string>& abbreviations() {
  static const std::unordered_set<std::string> set = {
      "mr",  "mrs", "ms",  "dr",     "prof", "rev", "hon", "sr",   "jr", "st",  "mt",  "capt", "col",
      "gen", "lt",  "sgt", "gov",    "sen",  "rep", "fig", "figs", "no", "nos", "vol", "vols", "pp",
      "ch",  "sec", "art", "approx", "ca",   "cf",  "vs",  "viz",  "al", "jan", "feb", "mar",  "apr",
      "jun", "jul", "aug", "sep",    "sept", "oct", "nov", "dec",  "eq", "eqs", "ref", "refs", "resp"};
  return set;
}

bool is_closing(char c) { return c == '"' || c == '\'' || c == ')' || c == ']'; }
bool is_opening(char c) { return c == '"' || c == '\'' || c == '(' || c == '['; }

// Could a sentence start at text[i]? Uppercase, digit, an opening quote/bracket, or a non-ASCII byte
// (accented capitals, typographic quotes).
bool starts_sentence(std::string_view text, size_t i) {
  const auto c = static_cast<unsigned char>(text[i]);
  return std::isupper(c) || std::isdigit(c) || is_opening(text[i]) || c >= 0x80;
}

// Is the period at text[dot] part of an abbreviation, initial or dotted acronym?
bool period_is_abbreviation(std::string_view text, size_t dot) {
  size_t start = dot;
  while (start > 0 && !std::isspace(static_cast<unsigned char>(text[start - 1]))) --start;
  std::string word(text.substr(start, dot - start));
  while (!word.empty() && is_opening(word.front())) word.erase(word.begin());
  if (word.empty()) return false;
  if (word.size() == 1 && std::isalpha(static_cast<unsigned char>(word[0]))) return true;  // initial
  if (word.find('.') != std::string::npos) {  // e.g / i.e / U.S / a.m: letters separated by periods
    bool dotted = std::all_of(word.begin(), word.end(),
                              [](char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '.'; });
    if (dotted) return true;
  }
  std::transform(word.begin(), word.end(), word.begin(), [](unsigned char c) { return std::tolower(c); });
  return abbreviations().count(word) > 0;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

}  // namespace

std::vector<std::string> split_sentences(std::string_view text) {
  std::vector<std::string> out;
  size_t begin = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c != '.' && c != '!' && c != '?') continue;
    size_t end = i + 1;  // past the terminal run and any closing quotes/brackets
    while (end < text.size() && (text[end] == '.' || text[end] == '!' || text[end] == '?')) ++end;
    while (end < text.size() && is_closing(text[end])) ++end;
    if (end < text.size() && !std::isspace(static_cast<unsigned char>(text[end]))) continue;  // 3.14, a.b
    size_t next = end;
    while (next < text.size() && std::isspace(static_cast<unsigned char>(text[next]))) ++next;
    if (next >= text.size()) break;  // the paragraph's end closes the last sentence
    if (!starts_sentence(text, next)) continue;
    const bool single_period = c == '.' && (end == i + 1 || text[i + 1] != '.');
    if (single_period && period_is_abbreviation(text, i)) continue;
    std::string_view sentence = trim(text.substr(begin, end - begin));
    if (!sentence.empty()) out.emplace_back(sentence);
    begin = next;
    i = next - 1;
  }
  std::string_view last = trim(text.substr(std::min(begin, text.size())));
  if (!last.empty()) out.emplace_back(last);
  return out;
}

// ------------------------------------------------------------------ UTF-8 validation

bool is_text(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    int extra;  // continuation bytes after this lead byte
    if (c == 0) return false;
    if (c < 0x80)
      extra = 0;
    else if (c >= 0xC2 && c <= 0xDF)
      extra = 1;
    else if (c >= 0xE0 && c <= 0xEF)
      extra = 2;
    else if (c >= 0xF0 && c <= 0xF4)
      extra = 3;
    else
      return false;
    for (int k = 1; k <= extra; ++k)
      if (i + k >= s.size() || (static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    i += 1 + static_cast<size_t>(extra);
  }
  return true;
}

// ------------------------------------------------------------------ reader

CorpusReader::CorpusReader(std::vector<std::string> paths, CorpusFormat format)
    : paths_(std::move(paths)), format_(format) {
  if (paths_.empty()) throw UserError("no corpus files given");
  for (const std::string& p : paths_) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(p, ec))
      throw UserError("corpus file '" + p + "' does not exist or is not a regular file");
    const auto size = std::filesystem::file_size(p, ec);
    if (ec || size == 0)
      throw UserError("corpus file '" + p + "' is empty: expected text, one " +
                      (format_ == CorpusFormat::kSentences ? "sentence" : "paragraph") +
                      " per line with blank lines between documents");
    total_bytes_ += static_cast<int64_t>(size);
  }
}

bool CorpusReader::read_line(std::string& line) {
  while (true) {
    if (!in_.is_open()) {
      if (file_index_ >= paths_.size()) return false;
      in_.open(paths_[file_index_], std::ios::binary);
      if (!in_) throw UserError("cannot open corpus file '" + paths_[file_index_] + "'");
      line_number_ = 0;
      file_has_text_ = false;
    }
    if (std::getline(in_, line)) {
      ++line_number_;
      bytes_read_ += static_cast<int64_t>(line.size()) + 1;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (!is_text(line))
        throw UserError("corpus file '" + paths_[file_index_] + "' line " + std::to_string(line_number_) +
                        ": not UTF-8 text (a binary file?)");
      return true;
    }
    if (!file_has_text_) throw UserError("corpus file '" + paths_[file_index_] + "' holds no text (only blank lines)");
    in_.close();
    in_.clear();
    ++file_index_;
    line.clear();
    return true;  // end of file also ends a document
  }
}

bool CorpusReader::next(std::vector<std::string>& sentences) {
  sentences.clear();
  std::string line;
  while (read_line(line)) {
    std::string_view t = trim(line);
    if (t.empty()) {
      if (!sentences.empty()) break;
      continue;
    }
    file_has_text_ = true;
    if (format_ == CorpusFormat::kSentences) {
      sentences.emplace_back(t);
    } else {
      for (std::string& s : split_sentences(t)) sentences.push_back(std::move(s));
    }
  }
  if (sentences.empty()) return false;
  ++documents_read_;
  return true;
}

bool CorpusReader::next_sentence(std::string& sentence) {
  while (sentence_ >= document_.size()) {
    if (!next(document_)) return false;
    sentence_ = 0;
  }
  sentence = std::move(document_[sentence_++]);
  return true;
}

}  // namespace bert::data
