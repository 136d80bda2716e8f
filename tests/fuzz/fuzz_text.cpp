// Outside text: the sentence splitter, the text check, and BERT's basic tokenization + WordPiece with
// the fixture vocabulary.
#include <memory>

#include "data/corpus.h"
#include "tests/fuzz/fuzz_target.h"
#include "tokenizer/wordpiece.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace bert;
  static const std::unique_ptr<tokenizer::Tokenizer> vocab =
      tokenizer::load_wordpiece(std::string(BERT_FUZZ_FIXTURES_DIR) + "/hf/tiny/vocab.txt");
  const std::string_view text = fuzz::as_text(data, size);
  fuzz::expect_clean([&] {
    if (data::is_text(text))
      for (const std::string& s : data::split_sentences(text))
        if (s.empty()) __builtin_trap();  // sentences are never empty
    for (const bool lower : {true, false})
      for (const std::string& word : tokenizer::basic_tokenize(text, {lower, lower}))
        if (word.empty() || word.find(' ') != std::string::npos) __builtin_trap();
    for (int32_t id : vocab->encode(text))
      if (id < 0 || id >= vocab->vocab_size()) __builtin_trap();
  });
  return 0;
}
