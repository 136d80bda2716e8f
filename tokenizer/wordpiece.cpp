#include "tokenizer/wordpiece.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include "sys/error.h"
#include "sys/json.h"
#include "sys/sha256.h"
#include "sys/text_file.h"
#include "sys/utf8.h"
#include "tokenizer/unicode.h"

namespace bert::tokenizer {

using unicode::is_cjk;
using unicode::is_control;
using unicode::is_punctuation;
using unicode::is_whitespace;
using unicode::strip_accents;
using unicode::to_lower;

std::vector<std::string> basic_tokenize(std::string_view text, const BasicTokenizerOptions& options) {
  // Clean (drop NUL, U+FFFD and control characters; whitespace becomes a space) and isolate CJK ideographs.
  std::u32string cleaned;
  for (char32_t c : utf8::decode(text)) {
    if (c == 0 || c == 0xFFFD || is_control(c)) continue;
    if (is_whitespace(c)) {
      cleaned.push_back(U' ');
    } else if (is_cjk(c)) {
      cleaned.push_back(U' ');
      cleaned.push_back(c);
      cleaned.push_back(U' ');
    } else {
      cleaned.push_back(c);
    }
  }
  std::vector<std::string> tokens;
  std::u32string word;
  auto split_word = [&]() {
    if (word.empty()) return;
    if (options.lowercase) word = to_lower(word);
    if (options.strip_accents) word = strip_accents(word);
    std::u32string piece;
    for (char32_t c : word) {
      if (is_punctuation(c)) {
        if (!piece.empty()) tokens.push_back(utf8::encode(piece));
        piece.clear();
        tokens.push_back(utf8::encode(std::u32string(1, c)));
      } else {
        piece.push_back(c);
      }
    }
    if (!piece.empty()) tokens.push_back(utf8::encode(piece));
    word.clear();
  };
  for (char32_t c : cleaned) {
    if (c == U' ')
      split_word();
    else
      word.push_back(c);
  }
  split_word();
  return tokens;
}

namespace {

constexpr size_t kMaxWordChars = 100;

class WordPieceTokenizer final : public Tokenizer {
 public:
  WordPieceTokenizer(const std::string& path, std::optional<BasicTokenizerOptions> options) : path_(path) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec)) throw UserError("vocabulary file '" + path + "' does not exist");
    std::ifstream in(path, std::ios::binary);
    if (!in) throw UserError("cannot read vocabulary file '" + path + "'");
    std::string line;
    while (std::getline(in, line)) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      // Tokens are whole lines; the reference strips surrounding whitespace.
      const size_t b = line.find_first_not_of(" \t"), e = line.find_last_not_of(" \t");
      std::string token = b == std::string::npos ? std::string() : line.substr(b, e - b + 1);
      const int32_t id = static_cast<int32_t>(pieces_.size());
      if (token.empty())
        throw UserError("vocabulary '" + path + "': line " + std::to_string(id + 1) + " is empty (one token per line)");
      if (!ids_.emplace(token, id).second)
        throw UserError("vocabulary '" + path + "': token '" + token + "' appears twice (line " +
                        std::to_string(id + 1) + ")");
      pieces_.push_back(std::move(token));
    }
    if (pieces_.size() < 8)
      throw UserError("vocabulary '" + path + "' has " + std::to_string(pieces_.size()) +
                      " tokens; not a WordPiece vocab.txt?");

    // Special tokens, which must precede every regular token (BERT's layout: [PAD], [unused..], [UNK],
    // [CLS], [SEP], [MASK], [unused..], then the regular tokens).
    int32_t* slots[] = {&specials_.pad, &specials_.unk, &specials_.cls, &specials_.sep, &specials_.mask};
    const char* names[] = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"};
    int32_t first_regular = 0;
    while (first_regular < vocab_size() && pieces_[first_regular].size() > 2 && pieces_[first_regular].front() == '[' &&
           pieces_[first_regular].back() == ']')
      ++first_regular;
    specials_.first_regular = first_regular;
    for (int k = 0; k < 5; ++k) {
      auto it = ids_.find(names[k]);
      if (it == ids_.end()) throw UserError("vocabulary '" + path + "' lacks the special token " + names[k]);
      if (it->second >= first_regular)
        throw UserError("vocabulary '" + path + "': special token " + names[k] + " is at id " +
                        std::to_string(it->second) + ", after the first regular token (id " +
                        std::to_string(first_regular) + ")");
      *slots[k] = it->second;
    }

    if (options) {
      options_ = *options;
    } else {
      const auto config = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
      bool lowercase = true;
      const Json* strip = nullptr;
      Json json;
      if (std::filesystem::is_regular_file(config, ec)) {
        const std::string text = read_text_file(config.string(), "tokenizer config");
        try {
          json = Json::parse(text);
        } catch (const UserError& e) {
          throw UserError("tokenizer config '" + config.string() + "': " + e.what());
        }
        const Json* lower = json.is_object() ? json.find("do_lower_case") : nullptr;
        lowercase = lower && lower->is_bool() ? lower->as_bool() : vocabulary_is_uncased();
        strip = json.is_object() ? json.find("strip_accents") : nullptr;
      } else {
        lowercase = vocabulary_is_uncased();
      }
      options_.lowercase = lowercase;
      options_.strip_accents = strip && strip->is_bool() ? strip->as_bool() : lowercase;
    }
    sha256_ = sha256_file(path);
  }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids;
    // Special tokens written in the text (e.g. [MASK] for fill-mask) are kept whole.
    while (!text.empty()) {
      size_t at = std::string_view::npos;
      int32_t special = -1;
      size_t special_len = 0;
      for (int32_t id : {specials_.mask, specials_.cls, specials_.sep, specials_.pad, specials_.unk}) {
        const size_t p = text.find(pieces_[id]);
        if (p < at) at = p, special = id, special_len = pieces_[id].size();
      }
      for (const std::string& word : basic_tokenize(text.substr(0, at), options_)) wordpiece(word, ids);
      if (at == std::string_view::npos) break;
      ids.push_back(special);
      text.remove_prefix(at + special_len);
    }
    return ids;
  }

  std::string decode(std::span<const int32_t> ids) const override {
    std::string out;
    for (int32_t id : ids) {
      const std::string& p = pieces_.at(id);
      if (p.starts_with("##") && !out.empty()) {
        out += p.substr(2);
      } else {
        if (!out.empty()) out += ' ';
        out += p;
      }
    }
    return out;
  }
  std::string piece(int32_t id) const override { return pieces_.at(id); }
  int32_t vocab_size() const override { return static_cast<int32_t>(pieces_.size()); }
  bool is_word_start(int32_t id) const override { return !pieces_.at(id).starts_with("##"); }
  const SpecialTokens& specials() const override { return specials_; }
  const std::string& file_sha256() const override { return sha256_; }
  const std::string& path() const override { return path_; }

 private:
  bool vocabulary_is_uncased() const {
    for (int32_t id = specials_.first_regular; id < vocab_size(); ++id)
      for (char c : pieces_[id])
        if (c >= 'A' && c <= 'Z') return false;
    return true;
  }

  // Greedy longest-match-first; the whole word becomes [UNK] if any part cannot be matched.
  void wordpiece(const std::string& word, std::vector<int32_t>& ids) const {
    const std::u32string chars = utf8::decode(word);
    if (chars.size() > kMaxWordChars) {
      ids.push_back(specials_.unk);
      return;
    }
    std::vector<int32_t> pieces;
    size_t start = 0;
    while (start < chars.size()) {
      size_t end = chars.size();
      int32_t found = -1;
      for (; end > start; --end) {
        std::string candidate = start > 0 ? "##" : "";
        candidate += utf8::encode(chars.substr(start, end - start));
        if (auto it = ids_.find(candidate); it != ids_.end()) {
          found = it->second;
          break;
        }
      }
      if (found < 0) {
        ids.push_back(specials_.unk);
        return;
      }
      pieces.push_back(found);
      start = end;
    }
    ids.insert(ids.end(), pieces.begin(), pieces.end());
  }

  std::string path_, sha256_;
  std::vector<std::string> pieces_;
  std::unordered_map<std::string, int32_t> ids_;
  SpecialTokens specials_;
  BasicTokenizerOptions options_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_wordpiece(const std::string& vocab_path, std::optional<BasicTokenizerOptions> options) {
  return std::make_unique<WordPieceTokenizer>(vocab_path, options);
}

}  // namespace bert::tokenizer
