// UTF-8 encoding and decoding of Unicode code points (JSON escapes, the WordPiece tokenizer).
#pragma once

#include <string>
#include <string_view>

namespace bert::utf8 {

// Appends the UTF-8 encoding of `code_point` (at most U+10FFFF).
void append(std::string& out, char32_t code_point);
std::string encode(std::u32string_view code_points);
// Decodes `text`; every byte that does not start a valid sequence (bad lead or continuation byte,
// truncation, overlong form, surrogate, value past U+10FFFF) becomes U+FFFD and decoding resumes at the
// next byte.
std::u32string decode(std::string_view text);

}  // namespace bert::utf8
