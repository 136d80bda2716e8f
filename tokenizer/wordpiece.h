// WordPiece, the tokenizer of Hugging Face BERT vocabularies (vocab.txt, one token per line, id = line
// number), as in BERT's reference tokenization.py: basic tokenization (text cleanup, CJK characters as
// words, optional lower-casing and accent stripping, punctuation split), then greedy
// longest-match-first WordPiece with "##" continuations; a word longer than 100 characters, or one
// that cannot be covered, becomes [UNK]. The vocabulary's special tokens ([PAD] [UNK] [CLS] [SEP]
// [MASK]) are matched in the text before anything else.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace bert::tokenizer {

struct BasicTokenizerOptions {
  bool lowercase = true;
  bool strip_accents = true;  // BERT strips accents exactly when it lower-cases, unless told otherwise
};

// BERT's BasicTokenizer on UTF-8 text (invalid bytes count as U+FFFD and are dropped with the
// control characters). Exposed for tests.
std::vector<std::string> basic_tokenize(std::string_view text, const BasicTokenizerOptions& options);

// Loads vocab.txt. Lower-casing and accent stripping come from tokenizer_config.json beside it
// ("do_lower_case", "strip_accents") when present; otherwise the vocabulary decides: uncased when no
// regular token holds an upper-case ASCII letter. `options` overrides both. Throws UserError naming
// the file for a missing or empty vocabulary, duplicate tokens, or missing special tokens.
std::unique_ptr<Tokenizer> load_wordpiece(const std::string& vocab_path,
                                          std::optional<BasicTokenizerOptions> options = std::nullopt);

}  // namespace bert::tokenizer
