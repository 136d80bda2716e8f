// Fine-tuning data: JSON lines made into task shards of each kind (data/task_data.h), questions windowed
// with the fixture vocabulary; every span labelled lies in its window's context, every window's words are
// the context's; every score of a regression is finite, one per sequence, and its groups (by "qid") number
// each sequence from 0 in order of first occurrence.
#include <cmath>
#include <memory>

#include "core/batch.h"
#include "data/task_data.h"
#include "tests/fuzz/fuzz_target.h"
#include "tokenizer/wordpiece.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace bert;
  static const std::unique_ptr<tokenizer::Tokenizer> vocab =
      tokenizer::load_wordpiece(std::string(BERT_FUZZ_FIXTURES_DIR) + "/hf/tiny/vocab.txt");
  fuzz::InputFile file(data, size, ".jsonl");
  for (const data::ShardKind kind : {data::ShardKind::kSequenceLabels, data::ShardKind::kTokenLabels,
                                     data::ShardKind::kSpanLabels, data::ShardKind::kSequenceScores}) {
    fuzz::expect_clean([&] {
      data::TaskDataOptions o;
      o.kind = kind;
      o.max_seq_len = 24;
      o.doc_stride = 5;
      o.max_query_len = 8;
      data::QuestionWindows windows;
      const data::Shard s = data::make_task_shard(file.path(), *vocab, o, nullptr, &windows);
      if (kind == data::ShardKind::kSequenceScores) {
        if (s.scores.size() != static_cast<size_t>(s.size) || !s.labels.empty()) __builtin_trap();
        for (const float score : s.scores)
          if (!std::isfinite(score)) __builtin_trap();
        o.fields.group = "qid";
        const data::Shard grouped = data::make_task_shard(file.path(), *vocab, o);
        if (grouped.groups.size() != static_cast<size_t>(grouped.size)) __builtin_trap();
        int32_t next = 0;  // numbered as they first occur
        for (const int32_t g : grouped.groups) {
          if (g < 0 || g > next) __builtin_trap();
          if (g == next) ++next;
        }
        return;
      }
      if (kind != data::ShardKind::kSpanLabels) {
        // Every label one of the set's (tokens: or ignored); again with a set of names, which integer labels
        // (class ids) index.
        auto check_labels = [](const data::Shard& shard) {
          for (const int32_t label : shard.labels)
            if ((label < 0 || static_cast<size_t>(label) >= shard.label_names.size()) && label != kIgnoredLabel)
              __builtin_trap();
        };
        check_labels(s);
        o.labels = {"no", "yes", "maybe"};
        check_labels(data::make_task_shard(file.path(), *vocab, o));
        return;
      }
      if (windows.window_question.size() != static_cast<size_t>(s.size)) __builtin_trap();
      for (int64_t i = 0; i < s.size; ++i) {
        const int32_t start = s.labels[2 * i], end = s.labels[2 * i + 1];
        const int32_t* word = windows.token_word.data() + i * s.seq_len;
        if (end > 0 && (word[start] < 0 || word[end] < 0)) __builtin_trap();  // an answer outside the context
        const auto& q = windows.questions.at(windows.window_question[i]);
        for (int64_t j = 0; j < s.seq_len; ++j)
          if (word[j] >= 0 &&
              (static_cast<size_t>(word[j]) >= q.words.size() || q.words[word[j]].second > q.context.size()))
            __builtin_trap();
      }
    });
  }
  return 0;
}
