// Opening any tokenizer file. In the bert_sentencepiece library (the file may be a SentencePiece model):
// only programs that tokenize link it (cmake/dependencies.cmake).
#pragma once

#include <memory>
#include <string>

#include "tokenizer/tokenizer.h"

namespace bert::tokenizer {

// Loads a tokenizer: a WordPiece vocabulary (*.txt), a SentencePiece model (any other file), or a
// directory holding vocab.txt or tokenizer.model (a Hugging Face model, a run's output). Throws
// UserError naming the file if it is missing, unreadable, or lacks the special tokens.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path);

}  // namespace bert::tokenizer
