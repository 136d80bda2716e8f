// Unicode character classes and mappings as BERT's BasicTokenizer uses them (its tokenization.py), from
// tables scripts/gen_unicode_tables.py makes with Python's unicodedata: WordPiece's text cleanup, and answer
// normalisation as SQuAD's evaluation script does it (eval/squad.h).
#pragma once

#include <string>
#include <string_view>

namespace bert::tokenizer::unicode {

// BERT's _is_whitespace: tab, newline, carriage return, space, and category Zs.
bool is_whitespace(char32_t c);
// BERT's _is_control: category C* except tab, newline and carriage return.
bool is_control(char32_t c);
// BERT's _is_punctuation: the ASCII symbols that are not letters or digits, and category P*.
bool is_punctuation(char32_t c);
// Category Mn.
bool is_nonspacing_mark(char32_t c);
// The CJK Unified Ideograph blocks BERT treats as one word per character.
bool is_cjk(char32_t c);
// NFD with the nonspacing marks removed (BERT's _run_strip_accents).
std::u32string strip_accents(std::u32string_view word);
// Each code point's full lower-case mapping (Python's str.lower() character by character; without its
// final-sigma rule, which lowers a word-final capital sigma to the final form).
std::u32string to_lower(std::u32string_view word);

}  // namespace bert::tokenizer::unicode
