// Sentence splitting, corpus reading (both formats) and its bad-input errors, SHA-256.
#include <gtest/gtest.h>

#include <fstream>

#include "data/corpus.h"
#include "sys/error.h"
#include "sys/sha256.h"
#include "tests/common/expect_user_error.h"
#include "tests/common/temp_dir.h"

namespace bert::data {
namespace {

using Sentences = std::vector<std::string>;

TEST(SplitSentences, SplitsAtSentenceEnds) {
  EXPECT_EQ(split_sentences("The cat sat. The dog ran! Did it? Yes."),
            (Sentences{"The cat sat.", "The dog ran!", "Did it?", "Yes."}));
  EXPECT_EQ(split_sentences("He said \"stop.\" Then he left."), (Sentences{"He said \"stop.\"", "Then he left."}));
  EXPECT_EQ(split_sentences("It ended (finally.) Next one."), (Sentences{"It ended (finally.)", "Next one."}));
  EXPECT_EQ(split_sentences("Wait... What happened?"), (Sentences{"Wait...", "What happened?"}));
  EXPECT_EQ(split_sentences("In 1999. In 2000 it grew."), (Sentences{"In 1999.", "In 2000 it grew."}));
  EXPECT_EQ(split_sentences("  One.   Two.  "), (Sentences{"One.", "Two."}));
  EXPECT_EQ(split_sentences("No final punctuation"), (Sentences{"No final punctuation"}));
  EXPECT_TRUE(split_sentences("   ").empty());
}

TEST(SplitSentences, KeepsAbbreviationsInitialsAndNumbersTogether) {
  EXPECT_EQ(split_sentences("Mr. Smith met Dr. Jones at St. Paul's. They talked."),
            (Sentences{"Mr. Smith met Dr. Jones at St. Paul's.", "They talked."}));
  EXPECT_EQ(split_sentences("Use a tool, e.g. A hammer, i.e. Something heavy. Then strike."),
            (Sentences{"Use a tool, e.g. A hammer, i.e. Something heavy.", "Then strike."}));
  EXPECT_EQ(split_sentences("J. R. R. Tolkien wrote it. John F. Kennedy read it."),
            (Sentences{"J. R. R. Tolkien wrote it.", "John F. Kennedy read it."}));
  EXPECT_EQ(split_sentences("Pi is 3.14 or so. See Fig. 3 and No. 5 in Vol. 2."),
            (Sentences{"Pi is 3.14 or so.", "See Fig. 3 and No. 5 in Vol. 2."}));
  EXPECT_EQ(split_sentences("He moved to the U.S. in May. It rained."),
            (Sentences{"He moved to the U.S. in May.", "It rained."}));
  EXPECT_EQ(split_sentences("Apples, pears, etc. are fruit. So are plums."),
            (Sentences{"Apples, pears, etc. are fruit.", "So are plums."}));
  EXPECT_EQ(split_sentences("See file.txt for details. It is short."),
            (Sentences{"See file.txt for details.", "It is short."}));
}

void write(const std::string& path, const std::string& content) { std::ofstream(path, std::ios::binary) << content; }

TEST(CorpusReader, ReadsDocumentsInSentenceFormatAcrossFiles) {
  testing::TempDir dir;
  write(dir.file("a.txt"), "First sentence.\nSecond sentence.\n\n\nThird, new document.\r\n");
  write(dir.file("b.txt"), "\nFourth, another file.\nFifth.\n");
  CorpusReader reader({dir.file("a.txt"), dir.file("b.txt")}, CorpusFormat::kSentences);
  Sentences doc;
  ASSERT_TRUE(reader.next(doc));
  EXPECT_EQ(doc, (Sentences{"First sentence.", "Second sentence."}));
  ASSERT_TRUE(reader.next(doc));
  EXPECT_EQ(doc, (Sentences{"Third, new document."}));
  ASSERT_TRUE(reader.next(doc));  // a file's end also ends a document
  EXPECT_EQ(doc, (Sentences{"Fourth, another file.", "Fifth."}));
  EXPECT_FALSE(reader.next(doc));
  EXPECT_EQ(reader.documents_read(), 3);
}

TEST(CorpusReader, SplitsParagraphFormatIntoSentences) {
  testing::TempDir dir;
  write(dir.file("p.txt"), "One here. Two here.\nThree here.\n\nMr. Four here. Five.\n");
  CorpusReader reader({dir.file("p.txt")}, CorpusFormat::kParagraphs);
  Sentences doc;
  ASSERT_TRUE(reader.next(doc));
  EXPECT_EQ(doc, (Sentences{"One here.", "Two here.", "Three here."}));
  ASSERT_TRUE(reader.next(doc));
  EXPECT_EQ(doc, (Sentences{"Mr. Four here.", "Five."}));
}

using testing::expect_user_error;

TEST(CorpusReader, RejectsMissingEmptyBlankAndBinaryFilesNamingThem) {
  testing::TempDir dir;
  write(dir.file("empty.txt"), "");
  write(dir.file("blank.txt"), "\n\n  \n");
  write(dir.file("binary.bin"), std::string("text\n\x00\x01\x02\xff\xfe", 10));
  write(dir.file("latin1.txt"), "caf\xe9 au lait.\n");
  Sentences doc;
  expect_user_error([&] { CorpusReader({dir.file("missing.txt")}, CorpusFormat::kSentences); },
                    "missing.txt' does not exist");
  expect_user_error([&] { CorpusReader({dir.file("empty.txt")}, CorpusFormat::kSentences); }, "empty.txt' is empty");
  expect_user_error(
      [&] {
        CorpusReader r({dir.file("blank.txt")}, CorpusFormat::kSentences);
        r.next(doc);
      },
      "holds no text");
  expect_user_error(
      [&] {
        CorpusReader r({dir.file("binary.bin")}, CorpusFormat::kSentences);
        while (r.next(doc)) {
        }
      },
      "binary.bin' line 2: not UTF-8 text");
  expect_user_error(
      [&] {
        CorpusReader r({dir.file("latin1.txt")}, CorpusFormat::kSentences);
        r.next(doc);
      },
      "latin1.txt' line 1");
  expect_user_error([] { parse_corpus_format("csv"); }, "unknown corpus format 'csv'");
}

TEST(IsText, AcceptsUtf8AndRejectsNulAndBrokenSequences) {
  EXPECT_TRUE(is_text("plain ASCII"));
  EXPECT_TRUE(is_text("caf\xc3\xa9 \xe2\x96\x81 \xf0\x9f\x98\x80"));
  EXPECT_FALSE(is_text(std::string("a\0b", 3)));
  EXPECT_FALSE(is_text("\xc3"));
  EXPECT_FALSE(is_text("\x80"));
  EXPECT_FALSE(is_text("\xe2\x96"));
}

TEST(Sha256, MatchesPublishedTestVectors) {
  // FIPS 180-2, appendix B.
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex(std::string(1000000, 'a')), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

}  // namespace
}  // namespace bert::data
