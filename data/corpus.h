// Corpus input: documents of sentences, streamed from text files.
//
// Formats:
//  - sentences (BERT's convention): one sentence per line, a blank line between documents;
//  - paragraphs (ordinary prose): one paragraph per line, a blank line between documents; sentences are
//    found by split_sentences().
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "sys/enum_names.h"

namespace bert::data {

enum class CorpusFormat { kSentences, kParagraphs };
inline constexpr EnumNames<CorpusFormat, 2> kCorpusFormatNames{
    {{{CorpusFormat::kSentences, "sentences"}, {CorpusFormat::kParagraphs, "paragraphs"}}}};
CorpusFormat parse_corpus_format(const std::string& name);  // "sentences" | "paragraphs"; UserError otherwise

// Splits a paragraph of English prose into sentences at . ! ? followed by space and a capital, digit
// or opening quote, except after abbreviations (Mr., Dr., e.g., i.e., etc. before a lowercase word,
// Fig., No., months ...), initials ("J. R. R. Tolkien") and dotted acronyms ("U.S.").
std::vector<std::string> split_sentences(std::string_view paragraph);

// Reads documents one at a time from one or more files, in order, with bounded memory (one document).
// Every file is checked to exist and be non-empty up front; text must be UTF-8 (a NUL byte or an
// invalid sequence is reported with file and line as "not a text file").
class CorpusReader {
 public:
  CorpusReader(std::vector<std::string> paths, CorpusFormat format);

  // The next document's sentences (never empty); false after the last document of the last file.
  bool next(std::vector<std::string>& sentences);
  // The next sentence, across documents (what a tokenizer trains on); false after the last. Do not mix
  // with next() on one reader.
  bool next_sentence(std::string& sentence);

  int64_t bytes_read() const { return bytes_read_; }
  int64_t documents_read() const { return documents_read_; }
  int64_t total_bytes() const { return total_bytes_; }

 private:
  bool read_line(std::string& line);  // false at the end of the last file

  std::vector<std::string> paths_;
  std::vector<std::string> document_;  // next_sentence()'s current document
  size_t sentence_ = 0;
  CorpusFormat format_;
  std::ifstream in_;
  size_t file_index_ = 0;
  int64_t line_number_ = 0;
  bool file_has_text_ = false;
  int64_t bytes_read_ = 0, total_bytes_ = 0, documents_read_ = 0;
};

// True if `text` is valid UTF-8 without NUL bytes.
bool is_text(std::string_view text);

}  // namespace bert::data
