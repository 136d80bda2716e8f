#include "tokenizer/load.h"

#include <filesystem>

#include "sys/error.h"
#include "tokenizer/sentencepiece.h"
#include "tokenizer/tokenizer_file.h"
#include "tokenizer/wordpiece.h"

namespace bert::tokenizer {

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {  // a Hugging Face model directory, or a run's output folder
    const std::string inside = tokenizer_file_in(path);
    if (inside.empty())
      throw UserError("tokenizer directory '" + path + "' holds neither vocab.txt nor tokenizer.model");
    return load_tokenizer(inside);
  }
  if (is_wordpiece_vocab(path)) return load_wordpiece(path);
  return load_sentencepiece(path);
}

}  // namespace bert::tokenizer
