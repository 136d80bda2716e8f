// Tokenizer: text <-> token ids, with BERT's special tokens. Implementations: SentencePiece (models we
// train) and WordPiece (Hugging Face vocab.txt, data/wordpiece_tokenizer.h).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace bert::data {

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

// Loads a tokenizer: a WordPiece vocabulary (*.txt), a SentencePiece model (any other file), or a
// directory holding vocab.txt or tokenizer.model (a Hugging Face model, a run's output). Throws
// UserError naming the file if it is missing, unreadable, or lacks the special tokens.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path);

struct SentencePieceTrainOptions {
  std::vector<std::string> inputs;          // corpus files
  std::string corpus_format = "sentences";  // or "paragraphs"
  std::string output_prefix;                // writes <prefix>.model and <prefix>.vocab
  int vocab_size = 16000;
  std::string model_type = "unigram";  // or "bpe"
  bool lowercase = true;               // case-fold like bert-base-uncased
  int64_t max_sentences = 2000000;     // sampled from the corpus for training (bounds memory)
  int threads = 2;
  uint64_t seed = 1;
};

// Trains a SentencePiece model with [PAD]=0, [UNK]=1 and [CLS], [SEP], [MASK] as user-defined symbols
// 2, 3, 4. Written atomically. Returns the number of sentences read.
int64_t train_sentencepiece(const SentencePieceTrainOptions& options);

}  // namespace bert::data
