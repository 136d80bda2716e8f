// The WordPiece vocabulary loader (vocab.txt), then encoding a fixed sentence with whatever loaded.
#include "tests/fuzz/fuzz_target.h"
#include "tokenizer/wordpiece.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace bert;
  fuzz::InputFile file(data, size, ".txt");
  fuzz::expect_clean([&] {
    auto t = tokenizer::load_wordpiece(file.path(), tokenizer::BasicTokenizerOptions{true, true});
    for (int32_t id : t->encode("The [MASK] ran, quickly; 东京 caf\u00e9s!"))
      if (id < 0 || id >= t->vocab_size()) __builtin_trap();
  });
  return 0;
}
