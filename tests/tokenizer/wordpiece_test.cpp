// WordPiece against tokenizations written down from BERT's published algorithm (google-research/bert
// tokenization.py and its tests): cleanup, CJK, lower-casing and accent stripping, punctuation,
// greedy longest-match-first with ##, [UNK] for words over 100 characters.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "tests/common/expect_user_error.h"
#include "tests/common/temp_dir.h"
#include "tokenizer/load.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/tokenizer_file.h"
#include "tokenizer/wordpiece.h"

namespace bert::tokenizer {
namespace {

using Strings = std::vector<std::string>;

const BasicTokenizerOptions kUncased{true, true};
const BasicTokenizerOptions kCased{false, false};

std::string write_vocab(const testing::TempDir& dir, const Strings& tokens, const std::string& name = "vocab.txt") {
  const std::string path = dir.file(name);
  std::ofstream out(path, std::ios::trunc);
  for (const std::string& t : tokens) out << t << "\n";
  return path;
}

const Strings kSpecials = {"[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[unused1]"};

Strings with_specials(const Strings& regular) {
  Strings all = kSpecials;
  all.insert(all.end(), regular.begin(), regular.end());
  return all;
}

Strings pieces(const Tokenizer& t, const std::string& text) {
  Strings out;
  for (int32_t id : t.encode(text)) out.push_back(t.piece(id));
  return out;
}

TEST(BasicTokenizer, LowerCasesAndSplitsPunctuation) {  // BERT's test_basic_tokenizer_lower
  EXPECT_EQ(basic_tokenize(" \tHeLLo!how  \n Are yoU?  ", kUncased), (Strings{"hello", "!", "how", "are", "you", "?"}));
  EXPECT_EQ(basic_tokenize("H\u00E9llo", kUncased), Strings{"hello"});
}

TEST(BasicTokenizer, KeepsCaseWhenCased) {  // test_basic_tokenizer_no_lower
  EXPECT_EQ(basic_tokenize(" \tHeLLo!how  \n Are yoU?  ", kCased), (Strings{"HeLLo", "!", "how", "Are", "yoU", "?"}));
  EXPECT_EQ(basic_tokenize("H\u00E9llo", kCased), Strings{"H\u00E9llo"}) << "a cased model keeps its accents";
}

TEST(BasicTokenizer, CjkIdeographsAreWordsOfTheirOwn) {  // test_chinese
  EXPECT_EQ(basic_tokenize("ah\u535A\u63A8zz", kUncased), (Strings{"ah", "\u535A", "\u63A8", "zz"}));
  // Hiragana and Hangul are not in the CJK ideograph blocks: they stay inside their words.
  EXPECT_EQ(basic_tokenize("\u3072\u3089\u304C\u306A\u4E2D", kCased), (Strings{"\u3072\u3089\u304C\u306A", "\u4E2D"}));
}

TEST(BasicTokenizer, StripsAccentsByDecomposing) {
  EXPECT_EQ(basic_tokenize("\u00C7a, na\u00EFve r\u00E9sum\u00E9 \u2014 \u00C5ngstr\u00F6m", kUncased),
            (Strings{"ca", ",", "naive", "resume", "\u2014", "angstrom"}));
  // Decomposed input (e + combining acute) gives the same.
  EXPECT_EQ(basic_tokenize("Re\u0301sume\u0301", kUncased), Strings{"resume"});
  // Greek: lower-cased, tonos removed.
  EXPECT_EQ(basic_tokenize("\u0391\u03B8\u03AE\u03BD\u03B1 \u0391\u0398\u0397\u039D\u0391", kUncased),
            (Strings{"\u03B1\u03B8\u03B7\u03BD\u03B1", "\u03B1\u03B8\u03B7\u03BD\u03B1"}));
  // Cyrillic upper case; the breve of short i is a nonspacing mark and goes too (as in BERT).
  EXPECT_EQ(basic_tokenize("\u041C\u041E\u0421\u041A\u0412\u0410 \u0439", kUncased),
            (Strings{"\u043C\u043E\u0441\u043A\u0432\u0430", "\u0438"}));
  // Hangul syllables decompose into their jamo (NFD), which are letters and stay.
  EXPECT_EQ(basic_tokenize("\uD55C", kUncased), Strings{"\u1112\u1161\u11AB"});
}

TEST(BasicTokenizer, CleansControlCharactersAndOddWhitespace) {
  EXPECT_EQ(basic_tokenize(std::string("hel\0lo", 6), kUncased), Strings{"hello"});
  EXPECT_EQ(basic_tokenize("co\u00ADoperate zero\u200Bwidth", kUncased), (Strings{"cooperate", "zerowidth"}))
      << "soft hyphen and zero-width space are format characters (Cf): dropped";
  EXPECT_EQ(basic_tokenize("a\u00A0b\u3000c\r\nd", kUncased), (Strings{"a", "b", "c", "d"}));
  EXPECT_EQ(basic_tokenize("bad\xFF\xFEutf8", kUncased), Strings{"badutf8"}) << "invalid bytes are dropped";
  EXPECT_EQ(basic_tokenize("\xC0\xAF", kUncased), Strings{}) << "an overlong '/' is invalid, not punctuation";
}

TEST(BasicTokenizer, PunctuationIncludesAsciiSymbols) {  // _is_punctuation: $ ` ^ are not Unicode P* but split
  EXPECT_EQ(basic_tokenize("a$b`c^d-e.f", kUncased), (Strings{"a", "$", "b", "`", "c", "^", "d", "-", "e", ".", "f"}));
  EXPECT_EQ(basic_tokenize("\u00BFqu\u00E9?", kUncased), (Strings{"\u00BF", "que", "?"}));
}

TEST(WordPiece, GreedyLongestMatchFirst) {  // test_wordpiece_tokenizer and test_full_tokenizer
  testing::TempDir dir;
  auto t = load_wordpiece(write_vocab(dir, with_specials({"want", "##want", "##ed", "wa", "un", "runn", "##ing", ","})),
                          kUncased);
  EXPECT_EQ(pieces(*t, ""), Strings{});
  EXPECT_EQ(pieces(*t, "unwanted running"), (Strings{"un", "##want", "##ed", "runn", "##ing"}));
  EXPECT_EQ(pieces(*t, "unwantedX running"), (Strings{"[UNK]", "runn", "##ing"}))
      << "one uncoverable piece makes the whole word [UNK]";
  EXPECT_EQ(pieces(*t, "UNwant\u00E9d,running"), (Strings{"un", "##want", "##ed", ",", "runn", "##ing"}));
  EXPECT_EQ(t->decode(t->encode("unwanted, running")), "unwanted , running");
  EXPECT_FALSE(t->is_word_start(t->encode("unwanted")[1]));
  EXPECT_TRUE(t->is_word_start(t->encode("unwanted")[0]));
}

TEST(WordPiece, WordsOverOneHundredCharactersAreUnknown) {
  testing::TempDir dir;
  auto t = load_wordpiece(write_vocab(dir, with_specials({"a", "##a"})), kUncased);
  const Strings hundred = pieces(*t, std::string(100, 'a'));
  ASSERT_EQ(hundred.size(), 100u);
  EXPECT_EQ(hundred[0], "a");
  EXPECT_EQ(hundred[99], "##a");
  EXPECT_EQ(pieces(*t, std::string(101, 'a')), Strings{"[UNK]"});
  // Characters, not bytes: 100 two-byte letters are still one word of 100.
  auto u = load_wordpiece(write_vocab(dir, with_specials({"\u00E9", "##\u00E9"}), "accents.txt"), kCased);
  std::string word;
  for (int i = 0; i < 100; ++i) word += "\u00E9";
  EXPECT_EQ(pieces(*u, word).size(), 100u);
}

TEST(WordPiece, SpecialTokensInTheTextStayWhole) {
  testing::TempDir dir;
  auto t = load_wordpiece(write_vocab(dir, with_specials({"the", "fox", ".", "[", "]", "mask"})), kUncased);
  EXPECT_EQ(pieces(*t, "The [MASK] fox."), (Strings{"the", "[MASK]", "fox", "."}));
  EXPECT_EQ(pieces(*t, "the[MASK][SEP]fox"), (Strings{"the", "[MASK]", "[SEP]", "fox"}));
  EXPECT_EQ(pieces(*t, "the [mask]"), (Strings{"the", "[", "mask", "]"})) << "only the exact spelling is special";
}

TEST(WordPiece, MixedCaseTextWithAnUncasedVocabulary) {
  testing::TempDir dir;
  // No tokenizer_config.json and no upper case in the vocabulary: uncased.
  auto t = load_tokenizer(write_vocab(dir, with_specials({"the", "quick", "brown", "fox", "##es"})));
  EXPECT_EQ(pieces(*t, "The QUICK Brown FOXES"), (Strings{"the", "quick", "brown", "fox", "##es"}));
  EXPECT_EQ(t->specials().pad, 0);
  EXPECT_EQ(t->specials().unk, 2);
  EXPECT_EQ(t->specials().cls, 3);
  EXPECT_EQ(t->specials().sep, 4);
  EXPECT_EQ(t->specials().mask, 5);
  EXPECT_EQ(t->specials().first_regular, 7);
}

TEST(WordPiece, CopiesTravelWithTheirCasingSettings) {
  testing::TempDir dir;
  std::filesystem::create_directories(dir.file("src"));
  std::filesystem::copy_file(std::string(BERT_TEST_FIXTURES_DIR) + "/hf/tiny/vocab.txt", dir.file("src/vocab.txt"));
  std::ofstream(dir.file("src/tokenizer_config.json")) << R"({"do_lower_case": false})";
  const std::string copy = copy_tokenizer(dir.file("src/vocab.txt"), dir.file("run"));
  EXPECT_EQ(copy, dir.file("run") + "/vocab.txt");
  EXPECT_TRUE(std::filesystem::is_regular_file(dir.file("run/tokenizer_config.json")));
  EXPECT_EQ(load_tokenizer(copy)->encode("Unto"), load_tokenizer(dir.file("src/vocab.txt"))->encode("Unto"))
      << "the copy keeps the casing (cased here)";
  EXPECT_NE(load_tokenizer(copy)->encode("Unto"), load_tokenizer(copy)->encode("unto")) << "cased";
  EXPECT_EQ(copy_tokenizer(copy, dir.file("run")), copy) << "onto itself: nothing to do";
  // Under another name (beside an ONNX export) only the vocabulary goes.
  const std::string beside = copy_tokenizer(dir.file("src/vocab.txt"), dir.file("onnx"), "model.vocab.txt");
  EXPECT_TRUE(std::filesystem::is_regular_file(beside));
  EXPECT_FALSE(std::filesystem::exists(dir.file("onnx/tokenizer_config.json")));
  testing::expect_user_error([&] { copy_tokenizer(dir.file("src/missing.txt"), dir.file("run2")); },
                             "cannot copy the tokenizer");
}

TEST(WordPiece, CasingComesFromTokenizerConfigOrTheVocabulary) {
  testing::TempDir dir;
  // A cased vocabulary (upper-case tokens), no config: cased.
  auto cased = load_tokenizer(write_vocab(dir, with_specials({"The", "the", "Fox", "##es", "\u00E9t\u00E9"})));
  EXPECT_EQ(pieces(*cased, "The Foxes \u00E9t\u00E9"), (Strings{"The", "Fox", "##es", "\u00E9t\u00E9"}));
  // tokenizer_config.json decides over the vocabulary.
  std::ofstream(dir.file("tokenizer_config.json")) << R"({"do_lower_case": true})";
  auto lowered = load_tokenizer(dir.file("vocab.txt"));
  EXPECT_EQ(pieces(*lowered, "The Foxes"), (Strings{"the", "[UNK]"}));
  std::ofstream(dir.file("tokenizer_config.json"), std::ios::trunc)
      << R"({"do_lower_case": true, "strip_accents": false})";
  auto accents = load_tokenizer(dir.path().string());  // a directory holding vocab.txt
  EXPECT_EQ(pieces(*accents, "\u00C9T\u00C9"), Strings{"\u00E9t\u00E9"});
}

TEST(WordPiece, BadVocabulariesAreRejected) {
  testing::TempDir dir;
  testing::expect_user_error([&] { load_wordpiece(dir.file("missing.txt")); }, "does not exist");
  testing::expect_user_error(
      [&] {
        load_wordpiece(write_vocab(dir, with_specials({"a", "b", "a"})));
      },
      "token 'a' appears twice (line 10)");
  testing::expect_user_error(
      [&] {
        load_wordpiece(write_vocab(dir, {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "a", "b", "c", "d"}));
      },
      "lacks the special token [MASK]");
  testing::expect_user_error(
      [&] {
        load_wordpiece(write_vocab(dir, {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "a", "b", "c", "[MASK]"}));
      },
      "special token [MASK] is at id 7, after the first regular token (id 4)");
  testing::expect_user_error([&] { load_wordpiece(write_vocab(dir, {"[PAD]", "[UNK]", "", "a"})); }, "line 3 is empty");
  testing::expect_user_error(
      [&] {
        load_wordpiece(write_vocab(dir, {"[PAD]", "[UNK]"}));
      },
      "not a WordPiece vocab.txt?");
  std::ofstream(dir.file("tokenizer_config.json")) << "{oops";
  write_vocab(dir, with_specials({"a"}));
  testing::expect_user_error([&] { load_wordpiece(dir.file("vocab.txt")); }, "tokenizer_config.json");
  testing::expect_user_error([&] { load_tokenizer(dir.file("nothing-here")); }, "nothing-here");
}

TEST(WordPiece, TheFixtureVocabularyTokenizesTheFixtureCorpus) {
  auto t = load_tokenizer(std::string(BERT_TEST_FIXTURES_DIR) + "/hf/tiny/vocab.txt");
  EXPECT_EQ(t->vocab_size(), 384);
  EXPECT_EQ(pieces(*t, "In the beginning God created the heaven and the earth."),
            (Strings{"in",  "the", "be",  "##g",  "##i", "##n",    "##n", "##ing", "god",   "c", "##r",
                     "##e", "##a", "##t", "##ed", "the", "heaven", "and", "the",   "earth", "."}))
      << "longest first: 'be' then single letters, as no '##gi', '##in' or '##ni' exists; '##ing' closes the word";
}

}  // namespace
}  // namespace bert::tokenizer
