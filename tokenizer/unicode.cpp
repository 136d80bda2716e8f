#include "tokenizer/unicode.h"

#include <algorithm>
#include <iterator>

namespace bert::tokenizer::unicode {

namespace {

struct CodeRange {
  char32_t first, last;
};
struct CodeMapping {
  char32_t code_point;
  uint32_t offset, count;
};
#include "tokenizer/unicode_tables.inc"

template <size_t N>
bool in_ranges(const CodeRange (&table)[N], char32_t c) {
  auto it = std::upper_bound(std::begin(table), std::end(table), c,
                             [](char32_t v, const CodeRange& r) { return v < r.first; });
  return it != std::begin(table) && c <= std::prev(it)->last;
}

// The mapped sequence of `c`, or false if `c` maps to itself.
template <size_t N>
bool mapped(const CodeMapping (&table)[N], char32_t c, std::u32string& out) {
  auto it = std::lower_bound(std::begin(table), std::end(table), c,
                             [](const CodeMapping& m, char32_t v) { return m.code_point < v; });
  if (it == std::end(table) || it->code_point != c) return false;
  out.append(kMappedCodePoints + it->offset, kMappedCodePoints + it->offset + it->count);
  return true;
}

}  // namespace

bool is_whitespace(char32_t c) { return in_ranges(kWhitespaceRanges, c); }
bool is_control(char32_t c) { return in_ranges(kControlRanges, c); }
bool is_punctuation(char32_t c) { return in_ranges(kPunctuationRanges, c); }
bool is_nonspacing_mark(char32_t c) { return in_ranges(kNonspacingMarkRanges, c); }

// The CJK Unified Ideograph blocks BERT treats as one word per character (not Hangul, Hiragana or
// Katakana, which are written with spaces or handled by WordPiece).
bool is_cjk(char32_t c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) || (c >= 0x20000 && c <= 0x2A6DF) ||
         (c >= 0x2A700 && c <= 0x2B73F) || (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B820 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

// NFD with the nonspacing marks removed (BERT's _run_strip_accents). Hangul syllables decompose
// algorithmically into their jamo.
std::u32string strip_accents(std::u32string_view word) {
  std::u32string out;
  for (char32_t c : word) {
    if (c >= 0xAC00 && c <= 0xD7A3) {
      const char32_t index = c - 0xAC00;
      out.push_back(0x1100 + index / (21 * 28));
      out.push_back(0x1161 + (index % (21 * 28)) / 28);
      if (index % 28) out.push_back(0x11A7 + index % 28);
    } else if (!mapped(kStrippedDecomposition, c, out) && !is_nonspacing_mark(c)) {
      out.push_back(c);
    }
  }
  return out;
}

std::u32string to_lower(std::u32string_view word) {
  std::u32string out;
  for (char32_t c : word)
    if (!mapped(kLowercase, c, out)) out.push_back(c);
  return out;
}

}  // namespace bert::tokenizer::unicode
