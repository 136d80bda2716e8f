// The SentencePiece implementation of Tokenizer, and training through the SentencePiece library.
#include "tokenizer/sentencepiece.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <filesystem>
#include <unordered_map>

#include "sys/atomic_file.h"
#include "sys/error.h"
#include "sys/sha256.h"

namespace bert::tokenizer {

namespace {

constexpr std::string_view kWordStartMarker = "\xE2\x96\x81";  // U+2581, SentencePiece's word boundary

class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : path_(path) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec))
      throw UserError("tokenizer file '" + path + "' does not exist (train one with `bert-data tokenizer`)");
    const auto status = processor_.Load(path);
    if (!status.ok())
      throw UserError("tokenizer file '" + path + "' is not a SentencePiece model: " + status.ToString());
    const std::pair<int32_t, const char*> expected[] = {{specials_.pad, "[PAD]"},
                                                        {specials_.unk, "[UNK]"},
                                                        {specials_.cls, "[CLS]"},
                                                        {specials_.sep, "[SEP]"},
                                                        {specials_.mask, "[MASK]"}};
    for (auto [id, name] : expected) {
      if (processor_.GetPieceSize() <= id || processor_.IdToPiece(id) != name)
        throw UserError("tokenizer '" + path + "': expected " + name + " at id " + std::to_string(id) + ", found '" +
                        (processor_.GetPieceSize() > id ? processor_.IdToPiece(id) : std::string("<none>")) +
                        "' (train it with `bert-data tokenizer`)");
    }
    word_start_.resize(processor_.GetPieceSize());
    for (int i = 0; i < processor_.GetPieceSize(); ++i)
      word_start_[i] = i < specials_.first_regular || processor_.IdToPiece(i).starts_with(kWordStartMarker);
    sha256_ = sha256_file(path);
  }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int> ids;
    const auto status = processor_.Encode(absl::string_view(text.data(), text.size()), &ids);
    BERT_CHECK(status.ok(), "SentencePiece encode failed: " + status.ToString());
    return {ids.begin(), ids.end()};
  }
  std::string decode(std::span<const int32_t> ids) const override {
    // Runs of regular tokens go through SentencePiece; special tokens are written as themselves.
    std::string out;
    auto append = [&out](const std::string& text) {
      if (text.empty()) return;
      if (!out.empty()) out += ' ';
      out += text;
    };
    for (size_t begin = 0; begin < ids.size();) {
      size_t end = begin;
      while (end < ids.size() && ids[end] >= specials_.first_regular) ++end;
      if (end > begin) append(processor_.DecodeIds(std::vector<int>(ids.begin() + begin, ids.begin() + end)));
      if (end < ids.size()) append(processor_.IdToPiece(ids[end]));
      begin = end + 1;
    }
    return out;
  }
  std::string piece(int32_t id) const override { return processor_.IdToPiece(id); }
  int32_t vocab_size() const override { return processor_.GetPieceSize(); }
  bool is_word_start(int32_t id) const override { return word_start_.at(id); }
  const SpecialTokens& specials() const override { return specials_; }
  const std::string& file_sha256() const override { return sha256_; }
  const std::string& path() const override { return path_; }

 private:
  std::string path_, sha256_;
  sentencepiece::SentencePieceProcessor processor_;
  SpecialTokens specials_;
  std::vector<bool> word_start_;
};

// Feeds SentencePiece's trainer from the caller's sentences, counting them.
class SentenceSource final : public sentencepiece::SentenceIterator {
 public:
  explicit SentenceSource(const NextSentence& next) : next_(next) { Next(); }
  bool done() const override { return done_; }
  void Next() override {
    done_ = !next_(value_);
    if (!done_) ++count_;
  }
  const std::string& value() const override { return value_; }
  sentencepiece::util::Status status() const override { return {}; }
  int64_t count() const { return count_; }

 private:
  const NextSentence& next_;
  std::string value_;
  bool done_ = false;
  int64_t count_ = 0;
};

}  // namespace

std::unique_ptr<Tokenizer> load_sentencepiece(const std::string& path) {
  return std::make_unique<SentencePieceTokenizer>(path);
}

int64_t train_sentencepiece(const SentencePieceTrainOptions& o, const NextSentence& next_sentence) {
  if (o.vocab_size < 16) throw UserError("--vocab-size " + std::to_string(o.vocab_size) + " is too small (>= 16)");
  if (o.model_type != "unigram" && o.model_type != "bpe")
    throw UserError("--model-type '" + o.model_type + "': expected 'unigram' or 'bpe'");
  AtomicFile model(o.output_prefix + ".model"), vocab(o.output_prefix + ".vocab");
  const std::string temp_prefix = o.output_prefix + ".training";
  const std::unordered_map<std::string, std::string> args = {
      {"model_prefix", temp_prefix},
      {"vocab_size", std::to_string(o.vocab_size)},
      {"model_type", o.model_type},
      {"pad_id", "0"},
      {"unk_id", "1"},
      {"bos_id", "-1"},
      {"eos_id", "-1"},
      {"pad_piece", "[PAD]"},
      {"unk_piece", "[UNK]"},
      {"user_defined_symbols", "[CLS],[SEP],[MASK]"},
      {"normalization_rule_name", o.lowercase ? "nmt_nfkc_cf" : "nmt_nfkc"},
      {"character_coverage", "0.9999"},
      {"input_sentence_size", std::to_string(o.max_sentences)},
      {"shuffle_input_sentence", "true"},
      {"max_sentence_length", "8192"},
      {"num_threads", std::to_string(o.threads)},
      {"minloglevel", "1"},  // its warnings and errors only: bert-data prints one summary line of its own
  };
  sentencepiece::SetRandomGeneratorSeed(static_cast<unsigned int>(o.seed));  // sentence sampling
  SentenceSource sentences(next_sentence);
  const auto status = sentencepiece::SentencePieceTrainer::Train(args, &sentences);
  if (!status.ok()) {
    std::filesystem::remove(temp_prefix + ".model");
    std::filesystem::remove(temp_prefix + ".vocab");
    throw UserError("SentencePiece training failed: " + status.ToString());
  }
  std::filesystem::rename(temp_prefix + ".model", model.temp_path());
  std::filesystem::rename(temp_prefix + ".vocab", vocab.temp_path());
  model.commit();
  vocab.commit();
  return sentences.count();
}

}  // namespace bert::tokenizer
