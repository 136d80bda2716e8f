// Tokenizer: text <-> token ids, with BERT's special tokens. Implementations: SentencePiece (models we
// train, tokenizer/sentencepiece.h) and WordPiece (Hugging Face vocab.txt, tokenizer/wordpiece.h).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace bert::tokenizer {

struct SpecialTokens {
  int32_t pad = 0, unk = 1, cls = 2, sep = 3, mask = 4;
  // Ids below this are special (never masked, never drawn as random replacements).
  int32_t first_regular = 5;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  virtual std::string piece(int32_t id) const = 0;
  virtual int32_t vocab_size() const = 0;
  // True if the token begins a word (for whole-word masking: a word is a start token and the
  // continuation tokens after it).
  virtual bool is_word_start(int32_t id) const = 0;
  virtual const SpecialTokens& specials() const = 0;
  // SHA-256 of the tokenizer file (what `sha256sum` prints), recorded in shards and checkpoints.
  virtual const std::string& file_sha256() const = 0;
  virtual const std::string& path() const = 0;
};

}  // namespace bert::tokenizer
