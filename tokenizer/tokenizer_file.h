// The files a tokenizer lives in, and how a model folder carries the tokenizer it was trained with.
// Nothing here tokenizes, so a program that only moves tokenizer files (bert-export) never loads
// SentencePiece (cmake/dependencies.cmake says why that matters).
#pragma once

#include <string>

namespace bert::tokenizer {

// True for the paths load_tokenizer() treats as WordPiece vocabularies (*.txt).
bool is_wordpiece_vocab(const std::string& path);

// The tokenizer file a model folder (a Hugging Face model, a run's output) holds: vocab.txt, else
// tokenizer.model; "" when it holds neither.
std::string tokenizer_file_in(const std::string& dir);

// Copies a tokenizer file into `dir` so a model folder (a run, a Hugging Face directory, a Triton model)
// carries the tokenizer it was trained with: as `file_name`, by default vocab.txt (WordPiece) or
// tokenizer.model (SentencePiece), written atomically; a WordPiece vocabulary's casing settings
// (tokenizer_config.json beside it) come along under the default name. Nothing is copied onto itself.
// Returns the copy's path.
std::string copy_tokenizer(const std::string& tokenizer_path, const std::string& dir,
                           const std::string& file_name = "");

}  // namespace bert::tokenizer
