// SentencePiece tokenizers: loading the models we train (special tokens at fixed ids) and training one.
// Linking this loads Debian's libsentencepiece, which must never share a process with ONNX's protobuf
// (cmake/dependencies.cmake).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "tokenizer/tokenizer.h"

namespace bert::tokenizer {

// Loads a model trained by train_sentencepiece (or any with [PAD] [UNK] [CLS] [SEP] [MASK] at ids 0-4).
// Throws UserError naming the file if it is missing, not a SentencePiece model, or lacks the specials.
std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& path);

struct SentencePieceTrainOptions {
  std::string output_prefix;  // writes <prefix>.model and <prefix>.vocab
  int vocab_size = 16000;
  std::string model_type = "unigram";  // or "bpe"
  bool lowercase = true;               // case-fold like bert-base-uncased
  int64_t max_sentences = 2000000;     // sampled from the sentences for training (bounds memory)
  int threads = 2;
  uint64_t seed = 1;
};

// Gives the next training sentence; false after the last.
using NextSentence = std::function<bool(std::string& sentence)>;

// Trains a SentencePiece model with [PAD]=0, [UNK]=1 and [CLS], [SEP], [MASK] as user-defined symbols
// 2, 3, 4 on the sentences `next_sentence` gives (data::train_tokenizer reads them from corpus files).
// Written atomically. Returns the number of sentences read.
int64_t train_sentencepiece(const SentencePieceTrainOptions& options, const NextSentence& next_sentence);

}  // namespace bert::tokenizer
