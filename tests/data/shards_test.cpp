// Example creation and HDF5 shards on the fixture corpus: exact layout, per-example invariants,
// masking and random-next statistics, determinism, reader/loader round trips, and bad input.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "data/corpus.h"
#include "data/examples.h"
#include "data/hdf5_io.h"
#include "data/loader.h"
#include "data/shard.h"
#include "data/task_data.h"
#include "sys/error.h"
#include "tests/common/expect_user_error.h"
#include "tests/common/temp_dir.h"
#include "tokenizer/load.h"
#include "tokenizer/sentencepiece.h"
#include "tokenizer/tokenizer.h"

namespace bert::data {
namespace {

const std::string kFixture = std::string(BERT_TEST_FIXTURES_DIR) + "/kjv_paragraphs.txt";

// One tokenizer and one set of shards from the fixture, shared by the tests of this file.
class FixtureData : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ready_ = false;
    dir_ = new testing::TempDir();
    tokenizer::SentencePieceTrainOptions t;
    t.output_prefix = dir_->file("spm");
    t.vocab_size = 800;
    CorpusReader corpus({kFixture}, CorpusFormat::kParagraphs);
    tokenizer::train_sentencepiece(t, [&](std::string& s) { return corpus.next_sentence(s); });
    tokenizer_ = tokenizer::load_tokenizer(dir_->file("spm.model")).release();
    stats_ = new ShardBuildStats(build_shards(options(dir_->file("shards")), *tokenizer_));
    ready_ = true;
  }
  // GoogleTest reports the tests of a suite whose set-up threw as "skipped"; make them fail instead.
  void SetUp() override { ASSERT_TRUE(ready_) << "the test suite's set-up failed (see above)"; }
  static inline bool ready_ = false;

  static void TearDownTestSuite() {
    delete stats_;
    delete tokenizer_;
    delete dir_;
  }
  static ShardBuildOptions options(const std::string& out) {
    ShardBuildOptions o;
    o.inputs = {kFixture};
    o.corpus_format = "paragraphs";
    o.output_dir = out;
    o.examples_per_shard = 700;
    o.window_documents = 25;
    o.examples.dupe_factor = 3;
    o.examples.max_seq_len = 64;
    o.examples.max_predictions = 10;
    return o;
  }
  static std::vector<Shard> all_shards(const ShardBuildStats& stats) {
    std::vector<Shard> shards;
    for (const std::string& p : stats.shard_paths) shards.push_back(read_shard(p));
    return shards;
  }

  static testing::TempDir* dir_;
  static tokenizer::Tokenizer* tokenizer_;
  static ShardBuildStats* stats_;
};
testing::TempDir* FixtureData::dir_ = nullptr;
tokenizer::Tokenizer* FixtureData::tokenizer_ = nullptr;
ShardBuildStats* FixtureData::stats_ = nullptr;

TEST_F(FixtureData, TokenizerHasSpecialTokensAtFixedIdsAndRoundTrips) {
  EXPECT_EQ(tokenizer_->vocab_size(), 800);
  EXPECT_EQ(tokenizer_->piece(0), "[PAD]");
  EXPECT_EQ(tokenizer_->piece(1), "[UNK]");
  EXPECT_EQ(tokenizer_->piece(2), "[CLS]");
  EXPECT_EQ(tokenizer_->piece(3), "[SEP]");
  EXPECT_EQ(tokenizer_->piece(4), "[MASK]");
  std::vector<int32_t> ids = tokenizer_->encode("In the beginning God created the heaven");
  ASSERT_FALSE(ids.empty());
  for (int32_t id : ids) EXPECT_GE(id, tokenizer_->specials().first_regular);
  EXPECT_EQ(tokenizer_->decode(ids), "in the beginning god created the heaven");  // case-folded
  EXPECT_TRUE(tokenizer_->is_word_start(ids[0]));
  EXPECT_EQ(tokenizer_->file_sha256().size(), 64u);
}

TEST_F(FixtureData, ShardLayoutIsExactlyNvidias) {
  ASSERT_EQ(stats_->shard_paths.size(), static_cast<size_t>(stats_->shards));
  ASSERT_GE(stats_->shards, 2);
  // h5dump -H shows the datasets with their exact types and shapes.
  const std::string path = stats_->shard_paths[0];
  FILE* pipe = popen(("h5dump -H " + path).c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string header;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, pipe)) header.append(buf, n);
  ASSERT_EQ(pclose(pipe), 0) << "h5dump failed";
  auto expect_dataset = [&](const std::string& name, const std::string& type, const std::string& space) {
    const size_t at = header.find("DATASET \"" + name + "\"");
    ASSERT_NE(at, std::string::npos) << name << " missing in:\n" << header;
    const std::string block = header.substr(at, header.find('}', header.find("DATASPACE", at)) - at);
    EXPECT_NE(block.find("DATATYPE  " + type), std::string::npos) << block;
    EXPECT_NE(block.find("SIMPLE { " + space), std::string::npos) << block;
  };
  expect_dataset("input_ids", "H5T_STD_I32LE", "( 700, 64 )");
  expect_dataset("input_mask", "H5T_STD_I8LE", "( 700, 64 )");
  expect_dataset("segment_ids", "H5T_STD_I8LE", "( 700, 64 )");
  expect_dataset("masked_lm_positions", "H5T_STD_I32LE", "( 700, 10 )");
  expect_dataset("masked_lm_ids", "H5T_STD_I32LE", "( 700, 10 )");
  expect_dataset("next_sentence_labels", "H5T_STD_I8LE", "( 700 )");
  // gzip-compressed, checked through the API.
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  hid_t d = H5Dopen2(f, "input_ids", H5P_DEFAULT);
  hid_t p = H5Dget_create_plist(d);
  unsigned flags = 0, info = 0;
  size_t n_values = 1;
  unsigned values[1] = {0};
  EXPECT_EQ(H5Pget_filter2(p, 0, &flags, &n_values, values, 0, nullptr, &info), H5Z_FILTER_DEFLATE);
  H5Pclose(p), H5Dclose(d), H5Fclose(f);
}

TEST_F(FixtureData, EveryExampleSatisfiesTheInvariants) {
  const tokenizer::SpecialTokens& sp = tokenizer_->specials();
  int64_t checked = 0;
  for (const Shard& s : all_shards(*stats_)) {
    ASSERT_TRUE(s.metadata.has_value());
    EXPECT_EQ(s.metadata->vocab_size, 800);
    EXPECT_EQ(s.metadata->tokenizer_sha256, tokenizer_->file_sha256());
    const int64_t L = s.seq_len, P = s.max_predictions;
    for (int64_t i = 0; i < s.size; ++i, ++checked) {
      const int32_t* ids = &s.input_ids[i * L];
      const int8_t* mask = &s.input_mask[i * L];
      const int8_t* seg = &s.segment_ids[i * L];
      int64_t len = 0;
      while (len < L && mask[len]) ++len;
      for (int64_t j = len; j < L; ++j) ASSERT_TRUE(mask[j] == 0 && ids[j] == sp.pad && seg[j] == 0) << "padding";
      ASSERT_GE(len, 5);
      ASSERT_EQ(ids[0], sp.cls);
      ASSERT_EQ(ids[len - 1], sp.sep);
      std::vector<int64_t> seps;
      for (int64_t j = 0; j < len; ++j)
        if (ids[j] == sp.sep) seps.push_back(j);
      ASSERT_EQ(seps.size(), 2u) << "exactly two [SEP]";
      ASSERT_GE(seps[0], 2);        // A is not empty
      ASSERT_LE(seps[0], len - 3);  // B is not empty
      for (int64_t j = 0; j < len; ++j) ASSERT_EQ(seg[j], j <= seps[0] ? 0 : 1) << "segment ids";
      for (int64_t j = 1; j < len; ++j) ASSERT_NE(ids[j], sp.cls);
      // Masked positions: sorted, unique, never special, the expected count; the first 0 ends the list.
      const int32_t* pos = &s.masked_lm_positions[i * P];
      const int32_t* orig = &s.masked_lm_ids[i * P];
      int64_t n = 0;
      while (n < P && pos[n] != 0) ++n;
      for (int64_t j = n; j < P; ++j) ASSERT_TRUE(pos[j] == 0 && orig[j] == 0);
      const int64_t expected =
          std::min<int64_t>(P, std::max<int64_t>(1, static_cast<int64_t>(std::nearbyint(len * 0.15))));
      ASSERT_EQ(n, expected) << "length " << len;
      for (int64_t j = 0; j < n; ++j) {
        ASSERT_TRUE(pos[j] > 0 && pos[j] < len - 1 && pos[j] != seps[0]) << "position " << pos[j];
        if (j > 0) {
          ASSERT_LT(pos[j - 1], pos[j]) << "sorted and unique";
        }
        ASSERT_GE(orig[j], sp.first_regular) << "the original token is never special";
      }
      ASSERT_TRUE(s.next_sentence_labels[i] == 0 || s.next_sentence_labels[i] == 1);
    }
  }
  EXPECT_EQ(checked, stats_->examples);
}

TEST_F(FixtureData, AboutHalfRandomNextAndMaskingIsAbout80_10_10) {
  int64_t random_next = 0, examples = 0, masked = 0, kept = 0, replaced = 0, total = 0;
  for (const Shard& s : all_shards(*stats_)) {
    for (int64_t i = 0; i < s.size; ++i) {
      random_next += s.next_sentence_labels[i];
      ++examples;
      for (int64_t j = 0; j < s.max_predictions; ++j) {
        const int32_t p = s.masked_lm_positions[i * s.max_predictions + j];
        if (p == 0) break;
        const int32_t now = s.input_ids[i * s.seq_len + p], was = s.masked_lm_ids[i * s.max_predictions + j];
        ++total;
        if (now == tokenizer_->specials().mask)
          ++masked;
        else if (now == was)
          ++kept;
        else
          ++replaced;
      }
    }
  }
  ASSERT_GT(total, 10000);
  // Random-next is 50% plus the chunks of a single sentence, which must take a random B.
  EXPECT_NEAR(double(random_next) / examples, 0.5, 0.08);
  EXPECT_NEAR(double(masked) / total, 0.8, 0.02);
  EXPECT_NEAR(double(kept) / total, 0.1, 0.02);
  EXPECT_NEAR(double(replaced) / total, 0.1, 0.02);
}

TEST_F(FixtureData, SameSeedGivesIdenticalShardsWhateverTheThreadCount) {
  testing::TempDir out;
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  ShardBuildStats one = build_shards(options(out.file("one")), *tokenizer_);
  omp_set_num_threads(saved);
  std::vector<Shard> a = all_shards(*stats_), b = all_shards(one);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].input_ids, b[i].input_ids);
    EXPECT_EQ(a[i].segment_ids, b[i].segment_ids);
    EXPECT_EQ(a[i].masked_lm_positions, b[i].masked_lm_positions);
    EXPECT_EQ(a[i].next_sentence_labels, b[i].next_sentence_labels);
  }
  ShardBuildOptions other = options(out.file("other"));
  other.examples.seed = 777;
  std::vector<Shard> c = all_shards(build_shards(other, *tokenizer_));
  EXPECT_NE(a[0].input_ids, c[0].input_ids) << "another seed gives other examples";
}

// Checks whole-word masking in `shards` and returns how many masked word-continuation tokens it saw.
int64_t check_whole_words_masked(const std::vector<Shard>& shards, const tokenizer::Tokenizer& tokenizer) {
  int64_t continuation_masked = 0;
  const int32_t first_regular = tokenizer.specials().first_regular;
  for (const Shard& s : shards) {
    for (int64_t i = 0; i < s.size; ++i) {
      std::set<int32_t> masked;
      std::map<int32_t, int32_t> original;
      for (int64_t j = 0; j < s.max_predictions && s.masked_lm_positions[i * s.max_predictions + j]; ++j) {
        masked.insert(s.masked_lm_positions[i * s.max_predictions + j]);
        original[s.masked_lm_positions[i * s.max_predictions + j]] = s.masked_lm_ids[i * s.max_predictions + j];
      }
      auto token_at = [&](int32_t p) { return masked.count(p) ? original[p] : s.input_ids[i * s.seq_len + p]; };
      for (int32_t p : masked) {
        // A masked word-continuation token has its predecessor masked too (unless that is [SEP]/[CLS]).
        if (!tokenizer.is_word_start(original[p]) && token_at(p - 1) >= first_regular) {
          ++continuation_masked;
          EXPECT_TRUE(masked.count(p - 1)) << "example " << i << " position " << p;
        }
        // ... and a masked token followed by a continuation has that continuation masked.
        if (p + 1 < s.seq_len && s.input_mask[i * s.seq_len + p + 1] && token_at(p + 1) >= first_regular &&
            !tokenizer.is_word_start(token_at(p + 1))) {
          EXPECT_TRUE(masked.count(p + 1)) << "example " << i << " position " << p + 1;
        }
      }
    }
  }
  return continuation_masked;
}

TEST_F(FixtureData, WholeWordMaskingMasksWholeWords) {
  testing::TempDir out;
  ShardBuildOptions o = options(out.file("wwm"));
  o.examples.whole_word_mask = true;
  o.examples.dupe_factor = 1;
  EXPECT_GT(check_whole_words_masked(all_shards(build_shards(o, *tokenizer_)), *tokenizer_), 0)
      << "the fixture has multi-piece words";
}

// The same with a WordPiece vocabulary (vocab.txt), where "##" marks a word's continuation.
TEST_F(FixtureData, WholeWordMaskingWithWordPiece) {
  testing::TempDir out;
  ShardBuildOptions o = options(out.file("wwm-wordpiece"));
  o.examples.whole_word_mask = true;
  o.examples.dupe_factor = 1;
  const std::unique_ptr<tokenizer::Tokenizer> wordpiece =
      tokenizer::load_tokenizer(std::string(BERT_TEST_FIXTURES_DIR) + "/hf/tiny/vocab.txt");
  const std::vector<Shard> shards = all_shards(build_shards(o, *wordpiece));
  ASSERT_FALSE(shards.empty());
  ASSERT_TRUE(shards[0].metadata.has_value());
  EXPECT_EQ(shards[0].metadata->tokenizer_sha256, wordpiece->file_sha256());
  for (const Shard& s : shards)
    for (int32_t id : s.input_ids) ASSERT_LT(id, wordpiece->vocab_size());
  EXPECT_GT(check_whole_words_masked(shards, *wordpiece), 0) << "rare KJV words split into ## pieces";
}

TEST_F(FixtureData, ReaderRoundTripsWhatTheWriterWrote) {
  testing::TempDir out;
  Shard s(8, 2);
  Example e;
  e.tokens = {2, 10, 11, 3, 12, 3};
  e.segment_ids = {0, 0, 0, 0, 1, 1};
  e.masked_positions = {2};
  e.masked_ids = {99};
  e.random_next = true;
  s.append(e);
  s.append(e);
  s.metadata = ShardMetadata{800, "abc", 8, 2, 5};
  write_shard(out.file("s.hdf5"), s);
  Shard r = read_shard(out.file("s.hdf5"));
  EXPECT_EQ(r.size, 2);
  EXPECT_EQ(r.input_ids, s.input_ids);
  EXPECT_EQ(r.input_mask, s.input_mask);
  EXPECT_EQ(r.segment_ids, s.segment_ids);
  EXPECT_EQ(r.masked_lm_positions, s.masked_lm_positions);
  EXPECT_EQ(r.masked_lm_ids, s.masked_lm_ids);
  EXPECT_EQ(r.next_sentence_labels, s.next_sentence_labels);
  ASSERT_TRUE(r.metadata);
  EXPECT_EQ(r.metadata->tokenizer_sha256, "abc");
  EXPECT_EQ(r.input_ids, (std::vector<int32_t>{2, 10, 11, 3, 12, 3, 0, 0, 2, 10, 11, 3, 12, 3, 0, 0}));
  EXPECT_EQ(std::filesystem::directory_iterator(out.path())->path().filename(), "s.hdf5") << "no temporary left";
}

TEST_F(FixtureData, LoaderVisitsEveryExampleOncePerEpochAndResumesExactly) {
  LoaderOptions o;
  o.shards = expand_shard_paths({dir_->file("shards")});
  o.batch_size = 64;
  o.repeat = false;
  ShardLoader once(o);
  EXPECT_EQ(once.seq_len(), 64);
  std::multiset<std::vector<int32_t>> seen, expected;
  Batch b;
  int64_t rows = 0;
  while (once.next(b)) {
    for (int64_t i = 0; i < b.size; ++i)
      seen.insert({b.input_ids.begin() + i * 64, b.input_ids.begin() + (i + 1) * 64});
    rows += b.size;
  }
  for (const Shard& s : all_shards(*stats_))
    for (int64_t i = 0; i < s.size; ++i)
      expected.insert({s.input_ids.begin() + i * 64, s.input_ids.begin() + (i + 1) * 64});
  EXPECT_EQ(rows, stats_->examples);
  EXPECT_TRUE(seen == expected) << "one epoch yields every example exactly once";

  // Repeating loader: take a state mid-way (across a shard boundary), continue, and compare.
  o.repeat = true;
  ShardLoader a(o), b2(o);
  for (int i = 0; i < 13; ++i) a.next(b);
  const ShardLoader::State mid = a.state();
  std::vector<std::vector<int32_t>> continued, resumed;
  for (int i = 0; i < 40; ++i) {  // runs past the end of the epoch
    a.next(b);
    continued.push_back(b.input_ids);
  }
  b2.restore(mid);
  for (int i = 0; i < 40; ++i) {
    b2.next(b);
    resumed.push_back(b.input_ids);
  }
  EXPECT_EQ(continued, resumed);
  EXPECT_GT(a.state().epoch, 0u);
}

// The next shard read on a thread of its own changes nothing the loader gives: the same batches and states
// across shard and epoch boundaries, for training (repeating) and evaluation (one pass), and a shard that
// cannot be read fails when it is reached, with the same error, not when it is read ahead.
TEST_F(FixtureData, ReadingTheNextShardAheadGivesTheSameBatches) {
  ASSERT_TRUE(hdf5::library_threadsafe()) << "this HDF5 library is not thread-safe: the loader never reads ahead";
  const std::vector<std::string> paths = expand_shard_paths({dir_->file("shards")});
  ASSERT_GE(paths.size(), 3u);
  LoaderOptions o;
  o.shards = paths;
  o.batch_size = 48;
  o.seed = 9;
  auto loader = [&](bool prefetch, bool repeat) {
    LoaderOptions l = o;
    l.prefetch = prefetch;
    l.repeat = repeat;
    return std::make_unique<ShardLoader>(l);
  };
  for (bool repeat : {true, false}) {
    SCOPED_TRACE(repeat ? "repeating" : "one pass");
    const auto ahead = loader(true, repeat), plain = loader(false, repeat);
    EXPECT_GE(ahead->reading_ahead(), 0);
    EXPECT_EQ(plain->reading_ahead(), -1);
    Batch a, b;
    int64_t rows = 0;
    for (int step = 0; step < 200; ++step) {  // three epochs of ~3,000 examples when repeating
      const bool more = ahead->next(a);
      ASSERT_EQ(more, plain->next(b)) << "step " << step;
      if (!more) break;
      rows += a.size;
      ASSERT_EQ(a.input_ids, b.input_ids) << "step " << step;
      ASSERT_EQ(a.masked_lm_ids, b.masked_lm_ids) << "step " << step;
      ASSERT_EQ(a.next_sentence_labels, b.next_sentence_labels) << "step " << step;
      ASSERT_EQ(ahead->state(), plain->state()) << "step " << step;
    }
    if (repeat) {
      EXPECT_GE(ahead->state().epoch, 2u);
      EXPECT_GE(ahead->reading_ahead(), 0);
      // Restored elsewhere (a resumed run) while a shard is being read ahead: that read is not (always) the
      // shard needed there.
      for (const ShardLoader::State& state : {ShardLoader::State{0, 1, 0}, ShardLoader::State{5, 3, 17},
                                              ShardLoader::State{1, 0, 100}, ShardLoader::State{2, 4, 3}}) {
        ahead->restore(state);
        plain->restore(state);
        for (int step = 0; step < 60; ++step) {
          ahead->next(a), plain->next(b);
          ASSERT_EQ(a.input_ids, b.input_ids) << "step " << step << " after a restore to epoch " << state.epoch;
        }
      }
    } else {
      EXPECT_EQ(rows, stats_->examples) << "one pass, then the end";
    }
  }
  // The last shard in file order (no shuffling) cut short: read ahead while the one before it is served.
  testing::TempDir copy;
  std::vector<std::string> copied;
  for (const std::string& p : paths) {
    copied.push_back(copy.file(std::filesystem::path(p).filename().string()));
    std::filesystem::copy_file(p, copied.back());
  }
  std::filesystem::resize_file(copied.back(), std::filesystem::file_size(copied.back()) / 2);
  o.shards = copied;
  o.shuffle = false;
  auto batches_before_error = [&](bool prefetch) {
    const auto l = loader(prefetch, true);
    Batch batch;
    for (int64_t n = 0;; ++n) {
      if (prefetch && n == 0) {
        EXPECT_EQ(l->reading_ahead(), 1);
      }
      try {
        l->next(batch);
      } catch (const UserError& e) {
        EXPECT_NE(std::string(e.what()).find(std::filesystem::path(copied.back()).filename().string()),
                  std::string::npos)
            << e.what();
        return n;
      }
    }
  };
  const int64_t with = batches_before_error(true), without = batches_before_error(false);
  EXPECT_EQ(with, without);
  EXPECT_GT(with, 0);
}

// A restore to the shard in memory (a run's held-out evaluations, each from the start; an epoch of one
// shard) keeps it: the file is not read again (here it is gone by then), and the batches are the first ones.
TEST_F(FixtureData, ARestoreToTheShardInMemoryDoesNotReadItAgain) {
  testing::TempDir copy;
  const std::string only = copy.file("only.hdf5");
  std::filesystem::copy_file(expand_shard_paths({dir_->file("shards")}).front(), only);
  LoaderOptions o;
  o.shards = {only};
  o.batch_size = 16;
  o.shuffle = false;
  o.repeat = false;
  ShardLoader eval(o);
  o.shuffle = o.repeat = true;
  ShardLoader train(o);
  Batch first, batch;
  ASSERT_TRUE(eval.next(first));
  for (int i = 0; i < 3; ++i) eval.next(batch);
  for (int i = 0; i < 100; ++i) train.next(batch);  // 1,600 examples: epochs of the one shard of 700
  std::filesystem::remove(only);
  eval.restore({});
  ASSERT_TRUE(eval.next(batch));
  EXPECT_EQ(batch.input_ids, first.input_ids);
  const uint64_t epoch = train.state().epoch;
  for (int i = 0; i < 100; ++i) train.next(batch);
  EXPECT_GT(train.state().epoch, epoch) << "an epoch started over the shard in memory";
}

// ---------------------------------------------------------------- bad input

using testing::expect_user_error;

bool folder_is_empty_or_missing(const std::string& path) {
  return !std::filesystem::exists(path) || std::filesystem::is_empty(path);
}

TEST_F(FixtureData, RanksSliceTheSingleProcessGlobalBatchAndShareTheirState) {
  LoaderOptions single;
  single.shards = expand_shard_paths({dir_->file("shards")});
  single.batch_size = 24;
  single.seed = 5;
  ShardLoader one(single);
  std::vector<ShardLoader> ranks;
  for (int r = 0; r < 3; ++r) {
    LoaderOptions o = single;
    o.batch_size = 8;
    o.rank = r;
    o.world_size = 3;
    ranks.emplace_back(o);
  }
  Batch global, part;
  for (int step = 0; step < 120; ++step) {  // past the first epoch's end (~700 examples per shard)
    ASSERT_TRUE(one.next(global));
    std::vector<int32_t> joined;
    for (ShardLoader& r : ranks) {
      ASSERT_TRUE(r.next(part));
      ASSERT_EQ(part.size, 8);
      joined.insert(joined.end(), part.input_ids.begin(), part.input_ids.end());
      EXPECT_EQ(r.state(), one.state()) << "step " << step;
    }
    ASSERT_EQ(joined, global.input_ids) << "step " << step;
  }
  LoaderOptions bad = single;
  bad.world_size = 2;
  bad.rank = 2;
  testing::expect_user_error([&] { ShardLoader l(bad); }, "rank 2 outside a world of 2");
}

TEST_F(FixtureData, BadBuildInputsFailClearlyAndWriteNothing) {
  testing::TempDir out;
  ShardBuildOptions o = options(out.file("shards"));
  expect_user_error([&] { tokenizer::load_tokenizer(out.file("missing.model")); }, "missing.model' does not exist");
  std::ofstream(out.file("not_a_model.model")) << "hello";
  expect_user_error([&] { tokenizer::load_tokenizer(out.file("not_a_model.model")); }, "is not a SentencePiece model");

  std::ofstream(out.file("empty.txt")).close();
  o.inputs = {out.file("empty.txt")};
  expect_user_error([&] { build_shards(o, *tokenizer_); }, "empty.txt' is empty");
  std::ofstream(out.file("binary.txt"), std::ios::binary) << std::string(
      "\x7f"
      "ELF\x02\x01\x01\x00\x00",
      9);
  o.inputs = {out.file("binary.txt")};
  expect_user_error([&] { build_shards(o, *tokenizer_); }, "not UTF-8 text");
  EXPECT_TRUE(folder_is_empty_or_missing(o.output_dir));

  o = options(out.file("shards"));
  o.examples.max_predictions = 0;
  expect_user_error([&] { build_shards(o, *tokenizer_); }, "--max-predictions 0");
  o.examples.max_predictions = 10;
  o.examples.masked_lm_prob = 1.5;
  expect_user_error([&] { build_shards(o, *tokenizer_); }, "--masked-lm-prob");
}

TEST_F(FixtureData, SingleSentenceDocumentsAndOverlongLinesStillGiveValidExamples) {
  testing::TempDir out;
  std::string longline;
  for (int i = 0; i < 300; ++i) longline += "and the word went on ";
  std::ofstream(out.file("odd.txt")) << "Only one sentence here.\n\nAnother lonely sentence.\n\n"
                                     << longline << "end.\nA short one.\n\n";
  ShardBuildOptions o = options(out.file("shards"));
  o.inputs = {out.file("odd.txt")};
  o.corpus_format = "sentences";
  ShardBuildStats stats = build_shards(o, *tokenizer_);
  EXPECT_EQ(stats.single_sentence_documents, 2);
  for (const Shard& s : all_shards(stats))
    for (int64_t i = 0; i < s.size; ++i) {
      EXPECT_EQ(s.input_ids[i * s.seq_len], tokenizer_->specials().cls);
      if (s.input_mask[i * s.seq_len + s.seq_len - 1]) {
        EXPECT_EQ(s.input_ids[i * s.seq_len + s.seq_len - 1], 3);
      }
    }
}

// Writes an HDF5 file in the shard layout with one dataset altered.
// A shard written through the HDF5 API directly: `skip` leaves a dataset out, `as_float` stores one as
// float32, `short_rows` gives one 3 rows instead of 4.
void write_custom_shard(const std::string& path, const std::string& skip, const std::string& as_float,
                        const std::string& short_rows = "") {
  hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  auto put = [&](const char* name, hid_t type, std::vector<hsize_t> dims) {
    if (skip == name) return;
    if (short_rows == name) dims[0] = 3;
    hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
    hid_t t = as_float == name ? H5T_IEEE_F32LE : type;
    hid_t d = H5Dcreate2(f, name, t, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    std::vector<char> zeros(4 * 4 * 8, 0);
    H5Dwrite(d, as_float == name ? H5T_NATIVE_FLOAT : (type == H5T_STD_I32LE ? H5T_NATIVE_INT32 : H5T_NATIVE_INT8),
             H5S_ALL, H5S_ALL, H5P_DEFAULT, zeros.data());
    H5Dclose(d);
    H5Sclose(space);
  };
  put("input_ids", H5T_STD_I32LE, {4, 8});
  put("input_mask", H5T_STD_I8LE, {4, 8});
  put("segment_ids", H5T_STD_I8LE, {4, 8});
  put("masked_lm_positions", H5T_STD_I32LE, {4, 2});
  put("masked_lm_ids", H5T_STD_I32LE, {4, 2});
  put("next_sentence_labels", H5T_STD_I8LE, {4});
  H5Fclose(f);
}

TEST(ShardReader, RejectsBadShardsNamingFileDatasetAndProblem) {
  testing::TempDir out;
  write_custom_shard(out.file("ok.h5"), "", "");
  EXPECT_EQ(read_shard(out.file("ok.h5")).size, 4) << "a shard without our metadata (another tool's) reads fine";
  write_custom_shard(out.file("missing.h5"), "masked_lm_ids", "");
  expect_user_error([&] { read_shard(out.file("missing.h5")); }, "missing.h5': dataset 'masked_lm_ids' is missing");
  write_custom_shard(out.file("float.h5"), "", "input_ids");
  expect_user_error([&] { read_shard(out.file("float.h5")); }, "dataset 'input_ids' has dtype float, expected int32");
  write_custom_shard(out.file("short.h5"), "", "", "segment_ids");
  expect_user_error([&] { read_shard(out.file("short.h5")); },
                    "dataset 'segment_ids' has shape [3, 8], expected [4, 8]");
  write_custom_shard(out.file("short_labels.h5"), "", "", "next_sentence_labels");
  expect_user_error([&] { read_shard(out.file("short_labels.h5")); },
                    "dataset 'next_sentence_labels' has shape [3], expected [4]");
  expect_user_error([&] { read_shard(out.file("nothing.h5")); }, "nothing.h5' does not exist");
  std::ofstream(out.file("text.h5")) << "not hdf5 at all";
  expect_user_error([&] { read_shard(out.file("text.h5")); }, "is not an HDF5 file");
  // Truncated: the first half of a valid file.
  const auto size = std::filesystem::file_size(out.file("ok.h5"));
  std::filesystem::copy_file(out.file("ok.h5"), out.file("cut.h5"));
  std::filesystem::resize_file(out.file("cut.h5"), size / 2);
  EXPECT_THROW(read_shard(out.file("cut.h5")), UserError);
}

TEST(ShardReader, RejectsIdsOutsideTheVocabularyAndIncompatibleShards) {
  testing::TempDir out;
  Shard s(8, 2);
  Example e;
  e.tokens = {2, 10, 3, 900, 3};
  e.segment_ids = {0, 0, 0, 1, 1};
  e.masked_positions = {1};
  e.masked_ids = {10};
  s.append(e);
  s.metadata = ShardMetadata{800, "aaaa", 8, 2, 1};
  write_shard(out.file("bad_id.hdf5"), s);
  expect_user_error([&] { read_shard(out.file("bad_id.hdf5")); }, "= 900 outside [0, vocab_size=800)");
  s.input_ids[3] = 500;
  write_shard(out.file("ok.hdf5"), s);
  Shard r = read_shard(out.file("ok.hdf5"));
  expect_user_error([&] { check_shard_compatible(r, "ok.hdf5", 400, 128, ""); },
                    "vocabulary of 800 tokens; the model has 400");
  expect_user_error([&] { check_shard_compatible(r, "ok.hdf5", 800, 4, ""); },
                    "longer than the model's max_position_embeddings 4");
  expect_user_error([&] { check_shard_compatible(r, "ok.hdf5", 800, 128, "bbbb"); }, "made with another tokenizer");
  check_shard_compatible(r, "ok.hdf5", 800, 128, "aaaa");
  // The prediction targets and NSP labels are checked too (they would reach the loss as bad indices).
  Shard bad_target = r;
  bad_target.masked_lm_ids[0] = 800;
  write_shard(out.file("bad_target.hdf5"), bad_target);
  expect_user_error([&] { read_shard(out.file("bad_target.hdf5")); },
                    "masked_lm_ids holds 800, outside [0, vocab_size=800)");
  bad_target.masked_lm_ids[0] = 600;
  bad_target.metadata.reset();  // a shard from another tool: no vocabulary recorded
  write_shard(out.file("target600.hdf5"), bad_target);
  expect_user_error(
      [&] { check_shard_compatible(read_shard(out.file("target600.hdf5")), "target600.hdf5", 512, 128, ""); },
      "token id 600 >= the model's vocab_size 512");
  Shard bad_label = r;
  bad_label.next_sentence_labels[0] = 2;
  write_shard(out.file("bad_label.hdf5"), bad_label);
  expect_user_error([&] { read_shard(out.file("bad_label.hdf5")); }, "next_sentence_labels holds 2, expected 0 or 1");
}

}  // namespace
}  // namespace bert::data

// ---------------------------------------------------------------- task shards

namespace bert::data {
namespace {

// Writes `lines` to DIR/name and returns the path.
std::string write_lines(const testing::TempDir& dir, const std::string& name, const std::string& lines) {
  std::ofstream(dir.file(name)) << lines;
  return dir.file(name);
}

// Every word's tag sits on its first piece, the pieces up to the next tagged one spell the word, and
// everything else ([CLS], [SEP], continuations, padding) carries the ignore label.
void check_word_alignment(const tokenizer::Tokenizer& tokenizer, const std::string& name) {
  SCOPED_TRACE(name);
  testing::TempDir dir;
  const std::vector<std::string> words = {"The", "jury",        "praised", "Atlanta's", "administration",
                                          ",",   "unanimously", "."};
  const std::vector<std::string> tags = {"DET", "NOUN", "VERB", "NOUN", "NOUN", ".", "ADV", "."};
  std::string line = R"({"tokens": [)";
  for (size_t i = 0; i < words.size(); ++i) line += (i ? ", \"" : "\"") + words[i] + "\"";
  line += R"(], "tags": [)";
  for (size_t i = 0; i < tags.size(); ++i) line += (i ? ", \"" : "\"") + tags[i] + "\"";
  line += "]}\n";
  TaskDataOptions o;
  o.kind = ShardKind::kTokenLabels;
  o.max_seq_len = 48;
  const Shard s = make_task_shard(write_lines(dir, "tok.jsonl", line + line), tokenizer, o);
  ASSERT_EQ(s.size, 2);
  EXPECT_EQ(s.label_names, (std::vector<std::string>{".", "ADV", "DET", "NOUN", "VERB"}));  // sorted
  std::vector<int64_t> starts;
  for (int64_t j = 0; j < s.seq_len; ++j)
    if (s.labels[j] != kIgnoredLabel) starts.push_back(j);
  ASSERT_EQ(starts.size(), words.size());
  EXPECT_EQ(s.input_ids[0], tokenizer.specials().cls);
  EXPECT_EQ(s.labels[0], kIgnoredLabel);
  int64_t length = 0;
  while (length < s.seq_len && s.input_mask[length]) ++length;
  EXPECT_EQ(s.input_ids[length - 1], tokenizer.specials().sep);
  for (size_t w = 0; w < words.size(); ++w) {
    EXPECT_EQ(s.label_names[s.labels[starts[w]]], tags[w]) << words[w];
    const int64_t end = w + 1 < words.size() ? starts[w + 1] : length - 1;
    std::vector<int32_t> pieces(s.input_ids.begin() + starts[w], s.input_ids.begin() + end);
    EXPECT_EQ(pieces, tokenizer.encode(words[w])) << words[w];
  }
  for (int64_t j = length; j < s.seq_len; ++j) EXPECT_EQ(s.labels[j], kIgnoredLabel);
  for (int64_t j = 0; j < s.seq_len; ++j) EXPECT_EQ(s.labels[s.seq_len + j], s.labels[j]);
}

TEST_F(FixtureData, TokenTagsSitOnEachWordsFirstPieceWithBothTokenizers) {
  check_word_alignment(*tokenizer_, "SentencePiece");
  const std::unique_ptr<tokenizer::Tokenizer> wordpiece =
      tokenizer::load_tokenizer(std::string(BERT_TEST_FIXTURES_DIR) + "/hf/tiny/vocab.txt");
  check_word_alignment(*wordpiece, "WordPiece");
}

TEST_F(FixtureData, SequenceLabelsPairsTruncationAndTheShardRoundTrip) {
  testing::TempDir dir;
  const std::string input =
      write_lines(dir, "seq.jsonl",
                  R"({"text": "In the beginning God created the heaven", "label": "law"})"
                  "\n"
                  R"({"text": "Blessed are the meek", "text_b": "for they shall inherit the earth", "label": "gospel"})"
                  "\n\n");
  TaskDataOptions o;
  o.max_seq_len = 12;
  TaskDataReport report;
  const Shard s = make_task_shard(input, *tokenizer_, o, &report);
  EXPECT_EQ(report.examples, 2);
  EXPECT_EQ(s.label_names, (std::vector<std::string>{"gospel", "law"}));
  EXPECT_EQ(s.labels, (std::vector<int32_t>{1, 0}));
  // The pair: [CLS] A [SEP] B [SEP], B in segment 1, cut longest-first to 12 tokens.
  const auto a = tokenizer_->encode("Blessed are the meek"), b = tokenizer_->encode("for they shall inherit the earth");
  ASSERT_GT(a.size() + b.size() + 3, 12u) << "the fixture must need truncation";
  EXPECT_GE(report.truncated, 1);
  int64_t sep = 0, segment_b = 0;
  for (int64_t j = 0; j < 12; ++j) {
    sep += s.input_ids[12 + j] == tokenizer_->specials().sep;
    segment_b += s.segment_ids[12 + j];
  }
  EXPECT_EQ(sep, 2);
  EXPECT_GT(segment_b, 0);
  EXPECT_EQ(s.input_mask[12 + 11], 1) << "filled to the limit";

  write_shard(dir.file("seq.hdf5"), s);
  const Shard back = read_shard(dir.file("seq.hdf5"));
  EXPECT_EQ(back.kind, ShardKind::kSequenceLabels);
  EXPECT_EQ(back.labels, s.labels);
  EXPECT_EQ(back.label_names, s.label_names);
  EXPECT_EQ(back.input_ids, s.input_ids);
  EXPECT_EQ(read_label_names(dir.file("seq.hdf5")), s.label_names);
  LoaderOptions lo;
  lo.shards = {dir.file("seq.hdf5")};
  lo.batch_size = 2;
  lo.shuffle = false;
  ShardLoader loader(lo);
  Batch batch;
  ASSERT_TRUE(loader.next(batch));
  EXPECT_EQ(batch.labels, s.labels);
  EXPECT_TRUE(batch.masked_lm_positions.empty());
  EXPECT_TRUE(batch.next_sentence_labels.empty());
}

TEST_F(FixtureData, BadTaskDataFailsNamingTheFileAndLine) {
  testing::TempDir dir;
  TaskDataOptions seq;
  TaskDataOptions tok;
  tok.kind = ShardKind::kTokenLabels;
  tok.labels = {"X", "Y"};
  auto fails = [&](const std::string& lines, const TaskDataOptions& o, const std::string& fragment) {
    const std::string path = write_lines(dir, "bad.jsonl", lines);
    testing::expect_user_error([&] { make_task_shard(path, *tokenizer_, o); }, fragment);
  };
  fails("{\"text\": \"a\", \"label\": \"x\"}\n{not json\n", seq, "bad.jsonl:2: not a JSON object");
  fails("{\"text\": \"a\"}\n", seq, "bad.jsonl:1: expected a label field \"label\"");
  fails("{\"tokens\": [\"a\", \"b\"], \"tags\": [\"X\"]}\n", tok,
        "bad.jsonl:1: 2 tokens (\"tokens\") but 1 tags (\"tags\")");
  fails("{\"text\": \"a\", \"label\": \"x\"}\n{\"text\": \"b\", \"label\": \"x\"}\n", seq,
        "fewer than 2 distinct labels");
  fails("", seq, "holds no examples");
  TaskDataOptions fixed = seq;
  fixed.labels = {"x", "y"};
  fails("{\"text\": \"a\", \"label\": \"x\"}\n{\"text\": \"b\", \"label\": \"z\"}\n", fixed,
        "bad.jsonl:2: label 'z' is not one of the 2 labels");
  testing::expect_user_error([&] { make_task_shard(dir.file("missing.jsonl"), *tokenizer_, seq); },
                             "missing.jsonl' cannot be read");
  // A shard whose labels lie outside its label set.
  Shard s(8, 0);
  s.kind = ShardKind::kSequenceLabels;
  s.label_names = {"a", "b"};
  const std::vector<int32_t> tokens = {2, 7, 3};
  const std::vector<int8_t> segments(3, 0);
  const std::vector<int32_t> label = {2};
  s.append_labeled(tokens, segments, label);
  write_shard(dir.file("bad.hdf5"), s);
  testing::expect_user_error([&] { read_shard(dir.file("bad.hdf5")); }, "labels[0] holds 2, outside [0, 2)");
}

// Hugging Face datasets' JSON lines (Dataset.to_json) read as they are: other field names, integer class ids
// (in numeric order: 10 after 2), booleans, a null pair; the same sequences as the project's own field names.
TEST_F(FixtureData, HuggingFaceDatasetsJsonLinesReadAsTheyAre) {
  testing::TempDir dir;
  const std::string glue = write_lines(
      dir, "glue.jsonl",
      R"({"sentence1": "In the beginning God created the heaven", "sentence2": "and the earth", "label": 2, "idx": 0})"
      "\n"
      R"({"sentence1": "Blessed are the meek", "sentence2": null, "label": 10, "idx": 1})"
      "\n"
      R"({"sentence1": "Jesus wept", "sentence2": "and the earth", "label": 0, "idx": 2})"
      "\n");
  const std::string ours =
      write_lines(dir, "ours.jsonl",
                  R"({"text": "In the beginning God created the heaven", "text_b": "and the earth", "label": "2"})"
                  "\n"
                  R"({"text": "Blessed are the meek", "label": "10"})"
                  "\n"
                  R"({"text": "Jesus wept", "text_b": "and the earth", "label": "0"})"
                  "\n");
  TaskDataOptions hf;
  hf.fields.text = "sentence1", hf.fields.text_b = "sentence2";
  const Shard a = make_task_shard(glue, *tokenizer_, hf);
  const Shard b = make_task_shard(ours, *tokenizer_, TaskDataOptions{});
  EXPECT_EQ(a.label_names, (std::vector<std::string>{"0", "2", "10"})) << "class ids in numeric order";
  EXPECT_EQ(a.labels, (std::vector<int32_t>{1, 2, 0}));
  EXPECT_EQ(a.label_names, b.label_names);
  EXPECT_EQ(a.labels, b.labels);
  EXPECT_EQ(a.input_ids, b.input_ids);
  EXPECT_EQ(a.segment_ids, b.segment_ids);
  int64_t pair = 0;
  for (int64_t j = 0; j < a.seq_len; ++j) pair += a.segment_ids[a.seq_len + j];
  EXPECT_EQ(pair, 0) << "a null second sentence: no pair";

  // Class ids with their names given (--labels, as a Hugging Face ClassLabel lists them): integer k is the
  // k-th name; a name in the data is still read by name. Where a name is itself an integer, only names count.
  TaskDataOptions named = hf;
  named.labels = {"not_equivalent", "equivalent"};
  const std::string mixed = write_lines(dir, "named.jsonl",
                                        R"({"sentence1": "a", "sentence2": "b", "label": 1})"
                                        "\n"
                                        R"({"sentence1": "a", "sentence2": "b", "label": "not_equivalent"})"
                                        "\n"
                                        R"({"sentence1": "a", "sentence2": "b", "label": 0})"
                                        "\n");
  EXPECT_EQ(make_task_shard(mixed, *tokenizer_, named).labels, (std::vector<int32_t>{1, 0, 0}));
  named.labels = {"0", "7"};
  testing::expect_user_error([&] { make_task_shard(mixed, *tokenizer_, named); }, "label '1' is not one of the 2");
  named.labels = {"no", "yes"};
  testing::expect_user_error(
      [&] {
        make_task_shard(write_lines(dir, "two.jsonl",
                                    R"({"sentence1": "a", "label": 2})"
                                    "\n"),
                        *tokenizer_, named);
      },
      "label '2' is not one of the 2");

  // Booleans (BoolQ's "answer") name their labels "false" and "true"; labels that are not all integers sort
  // as strings.
  hf.fields = TaskFields{};
  hf.fields.text = "question", hf.fields.label = "answer";
  const Shard booleans = make_task_shard(write_lines(dir, "boolq.jsonl",
                                                     "{\"question\": \"is the earth void\", \"answer\": true}\n"
                                                     "{\"question\": \"is the light good\", \"answer\": false}\n"),
                                         *tokenizer_, hf);
  EXPECT_EQ(booleans.label_names, (std::vector<std::string>{"false", "true"}));
  EXPECT_EQ(booleans.labels, (std::vector<int32_t>{1, 0}));

  // CoNLL-2003: integer tags under "ner_tags".
  TaskDataOptions conll;
  conll.kind = ShardKind::kTokenLabels;
  conll.fields.tags = "ner_tags";
  const Shard tags = make_task_shard(
      write_lines(dir, "conll.jsonl",
                  "{\"id\": \"0\", \"tokens\": [\"God\", \"said\"], \"ner_tags\": [1, 0]}\n"
                  "{\"id\": \"1\", \"tokens\": [\"Moses\", \"saw\", \"Aaron\"], \"ner_tags\": [1, 0, 12]}\n"),
      *tokenizer_, conll);
  EXPECT_EQ(tags.label_names, (std::vector<std::string>{"0", "1", "12"}));
  EXPECT_EQ(tags.labels[1], 1) << "God: its first piece carries B-PER's id";

  auto fails = [&](const std::string& lines, const TaskDataOptions& o, const std::string& fragment) {
    const std::string path = write_lines(dir, "bad.jsonl", lines);
    testing::expect_user_error([&] { make_task_shard(path, *tokenizer_, o); }, fragment);
  };
  TaskDataOptions sentence;
  sentence.fields.text = "sentence";
  fails("{\"sentence\": \"a\", \"label\": 0.5}\n", sentence, "a fractional number is a score: --task seq-reg");
  sentence.labels = {"0", "1"};
  fails("{\"text\": \"a\", \"label\": 0}\n", sentence, "bad.jsonl:1: expected a string field \"sentence\"");
  fails("{\"sentence\": \"a\", \"label\": -1}\n", sentence,
        "unlabelled examples of a Hugging Face dataset's test split");
  fails("{\"tokens\": [\"a\"], \"ner_tags\": [[1]]}\n", conll, "\"ner_tags\" must hold labels");
}

// Sequence regression (STS-B, a cross-encoder's relevance): each line's score, a number, kept as float32; the
// texts as a classification's; the shard round-trips and batches its scores; what is not a finite number is
// refused naming the line, and a shard's non-finite score naming the file.
TEST_F(FixtureData, SequenceScoresMakeARegressionShard) {
  testing::TempDir dir;
  const std::string stsb = write_lines(
      dir, "stsb.jsonl",
      R"({"sentence1": "In the beginning God created the heaven", "sentence2": "and the earth", "label": 3.8, "idx": 0})"
      "\n"
      R"({"sentence1": "Blessed are the meek", "sentence2": null, "label": 0, "idx": 1})"
      "\n"
      R"({"sentence1": "Jesus wept", "sentence2": "and the earth", "label": -1.25e1, "idx": 2})"
      "\n");
  const std::string classes = write_lines(
      dir, "classes.jsonl",
      R"({"sentence1": "In the beginning God created the heaven", "sentence2": "and the earth", "label": "a"})"
      "\n"
      R"({"sentence1": "Blessed are the meek", "sentence2": null, "label": "b"})"
      "\n"
      R"({"sentence1": "Jesus wept", "sentence2": "and the earth", "label": "a"})"
      "\n");
  TaskDataOptions o;
  o.kind = ShardKind::kSequenceScores;
  o.fields.text = "sentence1", o.fields.text_b = "sentence2";
  TaskDataReport report;
  const Shard s = make_task_shard(stsb, *tokenizer_, o, &report);
  EXPECT_EQ(report.examples, 3);
  EXPECT_EQ(s.kind, ShardKind::kSequenceScores);
  EXPECT_EQ(s.scores, (std::vector<float>{3.8f, 0.0f, -12.5f}));
  EXPECT_TRUE(s.labels.empty());
  EXPECT_EQ(s.label_names, (std::vector<std::string>{"score"}));
  TaskDataOptions c = o;
  c.kind = ShardKind::kSequenceLabels;
  const Shard same_texts = make_task_shard(classes, *tokenizer_, c);
  EXPECT_EQ(s.input_ids, same_texts.input_ids) << "the texts make the sequences of a classification";
  EXPECT_EQ(s.segment_ids, same_texts.segment_ids);

  write_shard(dir.file("stsb.hdf5"), s);
  const Shard back = read_shard(dir.file("stsb.hdf5"));
  EXPECT_EQ(back.kind, ShardKind::kSequenceScores);
  EXPECT_EQ(back.scores, s.scores);
  EXPECT_TRUE(back.labels.empty());
  EXPECT_EQ(back.label_names, s.label_names);
  EXPECT_EQ(back.input_ids, s.input_ids);
  LoaderOptions lo;
  lo.shards = {dir.file("stsb.hdf5")};
  lo.batch_size = 2;
  lo.shuffle = lo.repeat = false;
  ShardLoader loader(lo);
  Batch batch;
  ASSERT_TRUE(loader.next(batch));
  EXPECT_EQ(batch.scores, (std::vector<float>{3.8f, 0.0f}));
  EXPECT_TRUE(batch.labels.empty());
  ASSERT_TRUE(loader.next(batch));
  EXPECT_EQ(batch.scores, (std::vector<float>{-12.5f})) << "the short last batch keeps its real row only";
  EXPECT_EQ(batch.view().scores.size(), 1u);

  // A run's shards agree: a classification shard after a regression one is refused.
  write_shard(dir.file("classes.hdf5"), same_texts);
  LoaderOptions mixed = lo;
  mixed.shards = {dir.file("stsb.hdf5"), dir.file("classes.hdf5")};
  mixed.batch_size = 3;
  testing::expect_user_error(
      [&] {
        ShardLoader l(mixed);
        Batch b;
        while (l.next(b)) {
        }
      },
      "is a seq-cls shard with 2 labels; the first shard is a seq-reg shard");

  auto fails = [&](const std::string& lines, const std::string& fragment) {
    const std::string path = write_lines(dir, "bad.jsonl", lines);
    testing::expect_user_error([&] { make_task_shard(path, *tokenizer_, o); }, fragment);
  };
  fails("{\"sentence1\": \"a\", \"label\": \"3.8\"}\n",
        "bad.jsonl:1: expected a score field \"label\" (a finite number)");
  fails("{\"sentence1\": \"a\", \"label\": true}\n", "bad.jsonl:1: expected a score field");
  fails("{\"sentence1\": \"a\", \"label\": 1e39}\n", "bad.jsonl:1: expected a score field");
  fails("{\"sentence1\": \"a\", \"score\": 1}\n", "(--label-field names the field to read)");
  fails("", "holds no examples");
  // Groups (--group-field: the queries a reranker's scores rank), numbered as they first occur; the loader
  // keeps them apart across shards.
  TaskDataOptions grouped = o;
  grouped.fields.group = "qid";
  const std::string ranked = write_lines(dir, "ranked.jsonl",
                                         R"({"sentence1": "q one", "sentence2": "a", "label": 1, "qid": "q7"})"
                                         "\n"
                                         R"({"sentence1": "q two", "sentence2": "b", "label": 0, "qid": 12})"
                                         "\n"
                                         R"({"sentence1": "q one", "sentence2": "c", "label": 0, "qid": "q7"})"
                                         "\n");
  const Shard g = make_task_shard(ranked, *tokenizer_, grouped);
  EXPECT_EQ(g.groups, (std::vector<int32_t>{0, 1, 0}));
  write_shard(dir.file("ranked.hdf5"), g);
  write_shard(dir.file("ranked2.hdf5"), g);
  EXPECT_EQ(read_shard(dir.file("ranked.hdf5")).groups, g.groups);
  EXPECT_TRUE(read_shard(dir.file("stsb.hdf5")).groups.empty()) << "a shard without groups has none";
  LoaderOptions two = lo;
  two.shards = {dir.file("ranked.hdf5"), dir.file("ranked2.hdf5")};
  two.batch_size = 6;
  ShardLoader both(two);
  Batch all;
  ASSERT_TRUE(both.next(all));
  ASSERT_EQ(all.groups.size(), 6u);
  EXPECT_EQ(all.groups[0], all.groups[2]);
  EXPECT_NE(all.groups[0], all.groups[1]);
  EXPECT_EQ(std::set<int64_t>(all.groups.begin(), all.groups.end()).size(), 4u) << "each shard's groups apart";
  EXPECT_EQ(all.view().groups.size(), 6u);
  LoaderOptions half = two;
  half.shards = {dir.file("ranked.hdf5"), dir.file("stsb.hdf5")};
  testing::expect_user_error(
      [&] {
        ShardLoader l(half);
        Batch b;
        while (l.next(b)) {
        }
      },
      "stsb.hdf5' has no groups; the first shard has (all shards of a run must agree)");
  const std::string no_group = write_lines(dir, "nogroup.jsonl", "{\"sentence1\": \"a\", \"label\": 1}\n");
  testing::expect_user_error([&] { make_task_shard(no_group, *tokenizer_, grouped); },
                             "nogroup.jsonl:1: expected a group field \"qid\"");
  // A shard whose score is not finite.
  Shard nan(8, 0);
  nan.kind = ShardKind::kSequenceScores;
  nan.label_names = {"score"};
  nan.append_scored(std::vector<int32_t>{2, 7, 3}, std::vector<int8_t>(3, 0), 1.0f);
  nan.scores[0] = std::nanf("");
  write_shard(dir.file("nan.hdf5"), nan);
  testing::expect_user_error([&] { read_shard(dir.file("nan.hdf5")); }, "labels[0] holds nan, expected a finite score");
}

// ---------------------------------------------------------------- question answering

// Question answering: [CLS] question [SEP] window [SEP]; the windows slide over the context's pieces by
// doc_stride and cover it; each window that holds the whole answer labels its first and last piece (the
// answer's own pieces), the others [CLS]. answer_start counts characters, not bytes.
void check_question_windows(const tokenizer::Tokenizer& tokenizer, const std::string& name) {
  SCOPED_TRACE(name);
  testing::TempDir dir;
  // "Café" and "naïve" put 2-byte characters before the answers: a byte offset would miss them.
  const std::string context =
      "The café letter, naïve in tone, was written by Mary Smith in 1905 and found in the attic of the old house "
      "beside the river.";
  const std::string first = "Mary Smith", second = "the old house";
  const auto chars = [](const std::string& text, size_t bytes) {
    int64_t n = 0;
    for (size_t i = 0; i < bytes; ++i) n += (static_cast<unsigned char>(text[i]) & 0xC0) != 0x80;
    return n;
  };
  const int64_t first_start = chars(context, context.find(first)), second_start = chars(context, context.find(second));
  ASSERT_EQ(first_start, static_cast<int64_t>(context.find(first)) - 2) << "two 2-byte characters before it";
  const std::string lines =
      R"({"id": "a", "question": "Who wrote the letter?", "context": ")" + context + R"(", "answers": {"text": [")" +
      first + R"("], "answer_start": [)" + std::to_string(first_start) + "]}}\n" +
      R"({"question": "Where was it found?", "context": ")" + context + R"(", "answers": [{"text": ")" + second +
      R"(", "answer_start": )" + std::to_string(second_start) + "}]}\n" +
      R"({"question": "What colour was the ink?", "context": ")" + context +
      R"(", "answers": {"text": [], "answer_start": []}})" + "\n";
  TaskDataOptions o;
  o.kind = ShardKind::kSpanLabels;
  o.max_seq_len = 32;
  o.doc_stride = 5;
  TaskDataReport report;
  const Shard s = make_task_shard(write_lines(dir, "qa.jsonl", lines), tokenizer, o, &report);
  EXPECT_EQ(report.examples, 3);
  EXPECT_EQ(report.unanswerable, 1);
  EXPECT_EQ(report.answers_not_found, 0);
  EXPECT_EQ(report.windows, s.size);
  EXPECT_EQ(s.label_names, (std::vector<std::string>{"start", "end"}));
  ASSERT_EQ(s.labels.size(), static_cast<size_t>(2 * s.size));

  // The context's pieces as the windows must hold them: each whitespace word tokenized on its own.
  std::vector<int32_t> pieces;
  for (size_t from = 0; from < context.size();) {
    size_t to = context.find(' ', from);
    if (to == std::string::npos) to = context.size();
    const std::vector<int32_t> word = tokenizer.encode(context.substr(from, to - from));
    pieces.insert(pieces.end(), word.begin(), word.end());
    from = to + 1;
  }
  const std::vector<std::string> questions = {"Who wrote the letter?", "Where was it found?",
                                              "What colour was the ink?"};
  const std::vector<std::string> answers = {first, second, ""};
  int64_t row = 0;
  for (size_t q = 0; q < questions.size(); ++q) {
    const std::vector<int32_t> question = tokenizer.encode(questions[q]);
    const auto offset = static_cast<int64_t>(question.size()) + 2, room = o.max_seq_len - offset - 1;
    const std::vector<int32_t> answer = answers[q].empty() ? std::vector<int32_t>{} : tokenizer.encode(answers[q]);
    int64_t labelled = 0;
    for (int64_t begin = 0;; begin += o.doc_stride, ++row) {
      ASSERT_LT(row, s.size);
      const int32_t* ids = s.input_ids.data() + row * s.seq_len;
      const int8_t* segments = s.segment_ids.data() + row * s.seq_len;
      const int64_t length = std::min<int64_t>(room, static_cast<int64_t>(pieces.size()) - begin);
      EXPECT_EQ(ids[0], tokenizer.specials().cls);
      EXPECT_EQ(std::vector<int32_t>(ids + 1, ids + offset - 1), question);
      EXPECT_EQ(ids[offset - 1], tokenizer.specials().sep);
      EXPECT_EQ(std::vector<int32_t>(ids + offset, ids + offset + length),
                std::vector<int32_t>(pieces.begin() + begin, pieces.begin() + begin + length))
          << "window " << begin;
      EXPECT_EQ(ids[offset + length], tokenizer.specials().sep);
      EXPECT_EQ(segments[offset - 1], 0);
      EXPECT_EQ(segments[offset], 1);
      const int32_t start = s.labels[2 * row], end = s.labels[2 * row + 1];
      // Where the answer's pieces lie whole in this window, the label is that span; elsewhere [CLS].
      int64_t found = -1;
      for (int64_t j = 0; !answer.empty() && j + static_cast<int64_t>(answer.size()) <= length && found < 0; ++j)
        if (std::equal(answer.begin(), answer.end(), ids + offset + j)) found = offset + j;
      if (found >= 0) {
        EXPECT_EQ(start, found);
        EXPECT_EQ(end, found + static_cast<int64_t>(answer.size()) - 1);
        ++labelled;
      } else {
        EXPECT_EQ(start, 0);
        EXPECT_EQ(end, 0);
      }
      if (begin + length >= static_cast<int64_t>(pieces.size())) {
        ++row;
        break;
      }
    }
    EXPECT_EQ(labelled > 0, !answers[q].empty()) << questions[q];
  }
  EXPECT_EQ(row, s.size);
  EXPECT_GE(s.size, 9) << "each question needs several windows";

  write_shard(dir.file("qa.hdf5"), s);
  const Shard back = read_shard(dir.file("qa.hdf5"));
  EXPECT_EQ(back.kind, ShardKind::kSpanLabels);
  EXPECT_EQ(back.labels, s.labels);
  EXPECT_EQ(back.input_ids, s.input_ids);
  LoaderOptions lo;
  lo.shards = {dir.file("qa.hdf5")};
  lo.batch_size = 3;
  lo.shuffle = false;
  ShardLoader loader(lo);
  Batch batch;
  ASSERT_TRUE(loader.next(batch));
  EXPECT_EQ(batch.labels, std::vector<int32_t>(s.labels.begin(), s.labels.begin() + 6));
}

TEST_F(FixtureData, QuestionsBecomeWindowsLabelledWithTheAnswerWithBothTokenizers) {
  check_question_windows(*tokenizer_, "SentencePiece");
  const std::unique_ptr<tokenizer::Tokenizer> wordpiece =
      tokenizer::load_tokenizer(std::string(BERT_TEST_FIXTURES_DIR) + "/hf/tiny/vocab.txt");
  check_question_windows(*wordpiece, "WordPiece");
}

// An answer that ends a word ("attic" in "attic.") labels its own pieces, not the punctuation after it.
TEST(TaskData, AnAnswerInsideAWordLabelsItsOwnPieces) {
  const std::unique_ptr<tokenizer::Tokenizer> wordpiece =
      tokenizer::load_tokenizer(std::string(BERT_TEST_FIXTURES_DIR) + "/hf/tiny/vocab.txt");
  testing::TempDir dir;
  TaskDataOptions o;
  o.kind = ShardKind::kSpanLabels;
  o.max_seq_len = 64;
  const Shard s = make_task_shard(
      write_lines(dir, "qa.jsonl",
                  R"({"question": "Where?", "context": "It was found in the attic.", "answers": {"text": ["attic"], )"
                  R"("answer_start": [20]}})"
                  "\n"),
      *wordpiece, o);
  ASSERT_EQ(s.size, 1);
  const std::vector<int32_t> span(s.input_ids.begin() + s.labels[0], s.input_ids.begin() + s.labels[1] + 1);
  EXPECT_EQ(span, wordpiece->encode("attic"));
  EXPECT_NE(s.input_ids[s.labels[1] + 1], wordpiece->specials().sep) << "the period follows, outside the span";
}

TEST_F(FixtureData, BadQuestionDataFailsNamingTheFileAndLine) {
  testing::TempDir dir;
  TaskDataOptions o;
  o.kind = ShardKind::kSpanLabels;
  o.max_seq_len = 32;
  auto fails = [&](const std::string& lines, const TaskDataOptions& options, const std::string& fragment) {
    const std::string path = write_lines(dir, "bad.jsonl", lines);
    testing::expect_user_error([&] { make_task_shard(path, *tokenizer_, options); }, fragment);
  };
  const std::string good = R"({"question": "q", "context": "in the beginning", "answers": [{"text": "the", )"
                           R"("answer_start": 3}]})"
                           "\n";
  fails(good + R"({"question": "q", "context": "abc"})" + "\n", o, "bad.jsonl:2: expected \"answers\"");
  fails(good + R"({"question": "q", "context": "abc", "answers": [{"text": "c", "answer_start": 3}]})" + "\n", o,
        "bad.jsonl:2: answer_start 3 with an answer of 1 characters is outside the context's 3 characters");
  fails(R"({"context": "abc", "answers": []})"
        "\n",
        o, "bad.jsonl:1: expected a string field \"question\"");
  fails(R"({"question": "q", "context": "abc", "answers": [{"text": "x", "answer_start": 0}]})"
        "\n",
        o, "no question's answer was found in its context");
  TaskDataOptions tight = o;
  tight.max_seq_len = 4;
  fails(good, tight, "leaves no room for the context");
  // An answer whose text is not the context's there is skipped and counted.
  TaskDataReport report;
  const Shard s = make_task_shard(
      write_lines(dir, "skip.jsonl",
                  good + R"({"question": "q", "context": "abc", "answers": [{"text": "x", "answer_start": 0}]})"
                         "\n"),
      *tokenizer_, o, &report);
  EXPECT_EQ(report.answers_not_found, 1);
  EXPECT_EQ(report.examples, 1);
  EXPECT_EQ(s.size, 1);
  // A shard whose span lies outside its sequences, or runs backwards.
  Shard bad = s;
  bad.labels[0] = 5, bad.labels[1] = 4;
  write_shard(dir.file("bad.hdf5"), bad);
  testing::expect_user_error([&] { read_shard(dir.file("bad.hdf5")); },
                             "labels[0] holds the span 5..4, expected 0 <= start <= end < 32");
}

}  // namespace
}  // namespace bert::data
