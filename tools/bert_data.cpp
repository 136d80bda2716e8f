// bert-data: corpus -> sentences -> tokenizer -> MLM+NSP shards, and shard inspection.
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>

#include "data/corpus.h"
#include "data/examples.h"
#include "data/loader.h"
#include "data/shard.h"
#include "data/task_data.h"
#include "sys/atomic_file.h"
#include "sys/error.h"
#include "sys/openmp_wait.h"
#include "tokenizer/load.h"
#include "tokenizer/sentencepiece.h"
#include "tokenizer/tokenizer.h"
#include "tools/tool_main.h"

namespace {

using namespace bert;
using namespace bert::data;

double peak_rss_mb() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_maxrss / 1024.0;  // kilobytes on Linux
}

// split: paragraphs of prose -> one sentence per line.
void run_split(const std::vector<std::string>& inputs, const std::string& output) {
  CorpusReader reader(inputs, CorpusFormat::kParagraphs);
  AtomicFile file(output);
  std::ofstream out(file.temp_path());
  if (!out) throw UserError("cannot create '" + output + "'");
  std::vector<std::string> sentences;
  int64_t count = 0;
  while (reader.next(sentences)) {
    for (const std::string& s : sentences) out << s << '\n';
    out << '\n';
    count += static_cast<int64_t>(sentences.size());
  }
  out.close();
  if (!out) throw UserError("cannot write '" + output + "' (disk full?)");
  file.commit();
  spdlog::info("split: {} documents, {} sentences -> {}", reader.documents_read(), count, output);
}

// task: JSON lines -> one task shard.
void run_task(const std::string& input, const std::string& output, const std::string& tokenizer_path,
              const std::string& task, const std::string& labels_path, TaskDataOptions options) {
  if (task != "seq-cls" && task != "token-cls" && task != "qa" && task != "seq-reg")
    throw UserError("--task '" + task + "': expected seq-cls, token-cls, qa or seq-reg");
  options.kind = kShardKindNames.parse(task, "--task");
  if (options.max_seq_len == 0) options.max_seq_len = options.kind == ShardKind::kSpanLabels ? 384 : 128;
  const TaskFields& f = options.fields;
  const TaskFields defaults;
  const bool sequence_fields = f.text != defaults.text || f.text_b != defaults.text_b || f.label != defaults.label;
  const bool token_fields = f.tokens != defaults.tokens || f.tags != defaults.tags;
  if (options.kind == ShardKind::kSpanLabels && (sequence_fields || token_fields))
    throw UserError(
        "--text-fields, --label-field, --tokens-field, --tags-field: a qa shard reads SQuAD's fields "
        "(question, context, answers)");
  const bool sequence = options.kind == ShardKind::kSequenceLabels || options.kind == ShardKind::kSequenceScores;
  if (sequence && token_fields)
    throw UserError("--tokens-field, --tags-field: for --task token-cls (" + task +
                    " reads --text-fields, --label-field)");
  if (!f.group.empty() && options.kind != ShardKind::kSequenceScores)
    throw UserError("--group-field: for --task seq-reg (the queries whose passages a reranker's scores rank)");
  if (options.kind == ShardKind::kTokenLabels && sequence_fields)
    throw UserError("--text-fields, --label-field: for --task seq-cls (token-cls reads --tokens-field, --tags-field)");
  if (!labels_path.empty()) {
    if (options.kind == ShardKind::kSpanLabels) throw UserError("--labels: a qa shard has no label set");
    if (options.kind == ShardKind::kSequenceScores)
      throw UserError("--labels: a seq-reg shard has no label set (each example has a score)");
    options.labels = read_label_names(labels_path);
  }
  const std::unique_ptr<tokenizer::Tokenizer> tokenizer = tokenizer::load_tokenizer(tokenizer_path);
  TaskDataReport report;
  const Shard shard = make_task_shard(input, *tokenizer, options, &report);
  write_shard(output, shard);
  if (options.kind == ShardKind::kSpanLabels) {
    spdlog::info("task: {} questions -> {} sequences of {} tokens ({} without the answer: [CLS]) -> {}",
                 report.examples, report.windows, options.max_seq_len, report.windows_without_answer, output);
    if (report.unanswerable) spdlog::info("task: {} unanswerable question(s)", report.unanswerable);
    if (report.truncated)
      spdlog::warn("task: {} question(s) longer than --max-query-len {} were cut", report.truncated,
                   options.max_query_len);
    if (report.answers_not_found)
      spdlog::warn("task: {} question(s) skipped: the answer's text is not the context's at answer_start",
                   report.answers_not_found);
    return;
  }
  if (options.kind == ShardKind::kSequenceScores) {
    const auto [low, high] = std::minmax_element(shard.scores.begin(), shard.scores.end());
    spdlog::info("task: {} seq-reg examples, scores {:.4g} to {:.4g}{} -> {}", report.examples, *low, *high,
                 shard.groups.empty()
                     ? ""
                     : fmt::format(", {} groups", *std::max_element(shard.groups.begin(), shard.groups.end()) + 1),
                 output);
  } else {
    spdlog::info("task: {} {} examples, {} labels -> {}", report.examples, task, shard.label_names.size(), output);
  }
  if (report.truncated > 0)
    spdlog::warn("task: {} example(s) longer than --max-seq-len {} were truncated{}", report.truncated,
                 options.max_seq_len,
                 report.labels_dropped ? fmt::format(" ({} word labels dropped)", report.labels_dropped) : "");
}

void inspect_span_shard(const std::string& path, const Shard& s, const tokenizer::Tokenizer* tokenizer, int show) {
  int64_t tokens = 0, answered = 0;
  for (int8_t m : s.input_mask) tokens += m;
  for (int64_t i = 0; i < s.size; ++i) answered += s.labels[2 * i + 1] > 0;
  std::printf("%s: %lld qa sequences, seq_len %lld, %.1f tokens/sequence, %lld with the answer (%.1f%%)\n",
              path.c_str(), (long long)s.size, (long long)s.seq_len, double(tokens) / std::max<int64_t>(s.size, 1),
              (long long)answered, 100.0 * answered / std::max<int64_t>(s.size, 1));
  auto piece = [&](int32_t id) { return tokenizer ? tokenizer->piece(id) : std::to_string(id); };
  for (int64_t i = 0; i < std::min<int64_t>(show, s.size); ++i) {
    std::printf("  example %lld:", (long long)i);
    for (int64_t j = 0; j < s.seq_len && s.input_mask[i * s.seq_len + j]; ++j)
      std::printf(" %s", piece(s.input_ids[i * s.seq_len + j]).c_str());
    const int32_t start = s.labels[2 * i], end = s.labels[2 * i + 1];
    std::printf("\n    answer (tokens %d..%d):", start, end);
    if (end == 0) std::printf(" none in this window ([CLS])");
    for (int32_t j = start; end > 0 && j <= end; ++j) std::printf(" %s", piece(s.input_ids[i * s.seq_len + j]).c_str());
    std::printf("\n");
  }
}

void inspect_score_shard(const std::string& path, const Shard& s, const tokenizer::Tokenizer* tokenizer, int show) {
  int64_t tokens = 0;
  for (int8_t m : s.input_mask) tokens += m;
  double sum = 0, squares = 0;
  for (float v : s.scores) sum += v, squares += double(v) * v;
  const double n = static_cast<double>(std::max<int64_t>(s.size, 1)), mean = sum / n;
  const auto [low, high] = std::minmax_element(s.scores.begin(), s.scores.end());
  std::printf("%s: %lld seq-reg examples, seq_len %lld, %.1f tokens/example\n", path.c_str(), (long long)s.size,
              (long long)s.seq_len, double(tokens) / n);
  if (s.size > 0)
    std::printf("  scores: mean %.4g, standard deviation %.4g, %.4g to %.4g\n", mean,
                std::sqrt(std::max(0.0, squares / n - mean * mean)), *low, *high);
  if (!s.groups.empty())
    std::printf("  groups: %d (the examples ranked together)\n",
                *std::max_element(s.groups.begin(), s.groups.end()) + 1);
  for (int64_t i = 0; i < std::min<int64_t>(show, s.size); ++i) {
    std::printf("  example %lld:", (long long)i);
    for (int64_t j = 0; j < s.seq_len && s.input_mask[i * s.seq_len + j]; ++j) {
      const int32_t id = s.input_ids[i * s.seq_len + j];
      std::printf(" %s", tokenizer ? tokenizer->piece(id).c_str() : std::to_string(id).c_str());
    }
    std::printf("  -> %.4g\n", s.scores[i]);
  }
}

void inspect_task_shard(const std::string& path, const Shard& s, const tokenizer::Tokenizer* tokenizer, int show) {
  if (s.kind == ShardKind::kSpanLabels) return inspect_span_shard(path, s, tokenizer, show);
  if (s.kind == ShardKind::kSequenceScores) return inspect_score_shard(path, s, tokenizer, show);
  std::vector<int64_t> counts(s.label_names.size(), 0);
  int64_t tokens = 0, ignored = 0;
  for (int32_t label : s.labels) label == kIgnoredLabel ? ++ignored : ++counts[label];
  for (int8_t m : s.input_mask) tokens += m;
  const int64_t labeled = static_cast<int64_t>(s.labels.size()) - ignored;
  std::printf("%s: %lld %s examples, seq_len %lld, %.1f tokens/example, %lld labels\n", path.c_str(), (long long)s.size,
              shard_kind_name(s.kind).c_str(), (long long)s.seq_len, double(tokens) / std::max<int64_t>(s.size, 1),
              (long long)labeled);
  for (size_t l = 0; l < counts.size(); ++l)
    std::printf("  %-24s %8lld (%.1f%%)\n", s.label_names[l].c_str(), (long long)counts[l],
                100.0 * counts[l] / std::max<int64_t>(labeled, 1));
  for (int64_t i = 0; i < std::min<int64_t>(show, s.size); ++i) {
    std::printf("  example %lld:", (long long)i);
    for (int64_t j = 0; j < s.seq_len && s.input_mask[i * s.seq_len + j]; ++j) {
      const int32_t id = s.input_ids[i * s.seq_len + j];
      std::printf(" %s", tokenizer ? tokenizer->piece(id).c_str() : std::to_string(id).c_str());
      const int32_t label = s.kind == ShardKind::kTokenLabels ? s.labels[i * s.seq_len + j] : kIgnoredLabel;
      if (label != kIgnoredLabel) std::printf("/%s", s.label_names[label].c_str());
    }
    if (s.kind == ShardKind::kSequenceLabels) std::printf("  -> %s", s.label_names[s.labels[i]].c_str());
    std::printf("\n");
  }
}

void run_inspect(const std::vector<std::string>& paths, const std::string& tokenizer_path, int show) {
  std::unique_ptr<tokenizer::Tokenizer> tokenizer;
  if (!tokenizer_path.empty()) tokenizer = tokenizer::load_tokenizer(tokenizer_path);
  for (const std::string& path : expand_shard_paths(paths)) {
    Shard s = read_shard(path);
    if (tokenizer) check_shard_compatible(s, path, tokenizer->vocab_size(), s.seq_len, tokenizer->file_sha256());
    if (s.is_task()) {
      inspect_task_shard(path, s, tokenizer.get(), show);
      continue;
    }
    int64_t random_next = 0, tokens = 0, predictions = 0;
    for (int64_t i = 0; i < s.size; ++i) random_next += s.next_sentence_labels[i];
    for (int8_t m : s.input_mask) tokens += m;
    for (int64_t i = 0; i < s.size; ++i)
      for (int64_t j = 0; j < s.max_predictions; ++j)
        predictions += s.masked_lm_positions[i * s.max_predictions + j] > 0;
    std::printf(
        "%s: %lld examples, seq_len %lld, max_predictions %lld, %.1f tokens/example, %.1f predictions/example, "
        "%.1f%% random-next\n",
        path.c_str(), (long long)s.size, (long long)s.seq_len, (long long)s.max_predictions,
        double(tokens) / std::max<int64_t>(s.size, 1), double(predictions) / std::max<int64_t>(s.size, 1),
        100.0 * random_next / std::max<int64_t>(s.size, 1));
    if (s.metadata)
      std::printf("  metadata: vocab_size %lld, tokenizer sha256 %s, seed %llu\n", (long long)s.metadata->vocab_size,
                  s.metadata->tokenizer_sha256.c_str(), (unsigned long long)s.metadata->seed);
    for (int64_t i = 0; i < std::min<int64_t>(show, s.size); ++i) {
      std::vector<int32_t> ids;
      for (int64_t j = 0; j < s.seq_len && s.input_mask[i * s.seq_len + j]; ++j)
        ids.push_back(s.input_ids[i * s.seq_len + j]);
      std::printf("  example %lld (%s):", (long long)i, s.next_sentence_labels[i] ? "random next" : "is next");
      if (tokenizer) {
        std::printf(" %s\n    masked:", tokenizer->decode(ids).c_str());
        for (int64_t j = 0; j < s.max_predictions && s.masked_lm_positions[i * s.max_predictions + j] > 0; ++j)
          std::printf(" %d=%s", s.masked_lm_positions[i * s.max_predictions + j],
                      tokenizer->piece(s.masked_lm_ids[i * s.max_predictions + j]).c_str());
      } else {
        for (int32_t id : ids) std::printf(" %d", id);
      }
      std::printf("\n");
    }
  }
}

// Every subcommand's options.
struct Args {
  std::vector<std::string> split_inputs;
  std::string split_output;
  std::vector<std::string> tok_inputs;
  std::string tok_format = "sentences";
  tokenizer::SentencePieceTrainOptions tok;
  bool cased = false;
  ShardBuildOptions sh;
  std::string sh_tokenizer;
  std::string task_input, task_output, task_tokenizer, task_kind, task_labels;
  TaskDataOptions task_options = [] {
    TaskDataOptions o;
    o.max_seq_len = 0;  // 128, or 384 for qa
    return o;
  }();
  std::vector<std::string> inspect_paths;
  std::string inspect_tokenizer;
  int inspect_show = 1;
};

struct Subcommands {
  CLI::App *split, *tokenizer, *shards, *task, *inspect;
};

CLI::App* add_split(CLI::App& app, Args& a) {
  CLI::App* split = app.add_subcommand("split",
                                       "paragraphs of prose (one per line, blank line between documents) -> "
                                       "one sentence per line");
  split->add_option("--input", a.split_inputs, "paragraph files")->required()->expected(1, -1);
  split->add_option("--output", a.split_output, "output file (sentences format)")->required();
  return split;
}

CLI::App* add_tokenizer(CLI::App& app, Args& a) {
  CLI::App* tokenizer = app.add_subcommand("tokenizer",
                                           "train a SentencePiece tokenizer with [PAD]=0 [UNK]=1 "
                                           "[CLS]=2 [SEP]=3 [MASK]=4");
  tokenizer->add_option("--input", a.tok_inputs, "corpus files")->required()->expected(1, -1);
  tokenizer->add_option("--format", a.tok_format, "corpus format: sentences | paragraphs")->capture_default_str();
  tokenizer->add_option("--output", a.tok.output_prefix, "writes PREFIX.model and PREFIX.vocab")->required();
  tokenizer->add_option("--vocab-size", a.tok.vocab_size, "vocabulary size")
      ->check(CLI::Range(16, 1000000))
      ->capture_default_str();
  tokenizer->add_option("--model-type", a.tok.model_type, "unigram | bpe")->capture_default_str();
  tokenizer->add_flag("--cased", a.cased, "keep case (default: case-folded, like bert-base-uncased)");
  tokenizer->add_option("--max-sentences", a.tok.max_sentences, "sentences sampled for training")
      ->check(CLI::Range(int64_t{1000}, int64_t{1} << 40))
      ->capture_default_str();
  tokenizer->add_option("--seed", a.tok.seed, "random seed")->capture_default_str();
  return tokenizer;
}

CLI::App* add_shards(CLI::App& app, Args& a) {
  CLI::App* shards = app.add_subcommand("shards", "create MLM+NSP examples (Google's algorithm) and write HDF5 shards");
  shards->add_option("--input", a.sh.inputs, "corpus files")->required()->expected(1, -1);
  shards->add_option("--format", a.sh.corpus_format, "corpus format: sentences | paragraphs")->capture_default_str();
  shards
      ->add_option("--tokenizer", a.sh_tokenizer,
                   "SentencePiece model (.model), WordPiece vocab.txt, or a Hugging Face model directory")
      ->required();
  shards->add_option("--output", a.sh.output_dir, "output folder")->required();
  shards->add_option("--prefix", a.sh.prefix, "shard file prefix")->capture_default_str();
  shards->add_option("--max-seq-len", a.sh.examples.max_seq_len, "tokens per example")->capture_default_str();
  shards->add_option("--max-predictions", a.sh.examples.max_predictions, "max masked positions per example")
      ->capture_default_str();
  shards->add_option("--masked-lm-prob", a.sh.examples.masked_lm_prob, "fraction of tokens to mask")
      ->capture_default_str();
  shards->add_option("--short-seq-prob", a.sh.examples.short_seq_prob, "probability of a shorter target length")
      ->capture_default_str();
  shards->add_option("--dupe-factor", a.sh.examples.dupe_factor, "passes over the corpus with fresh masks")
      ->capture_default_str();
  shards->add_flag(
      "--whole-word-mask", a.sh.examples.whole_word_mask,
      "mask whole words (a word: a SentencePiece word start, or a WordPiece token and its ## continuations)");
  shards->add_option("--seed", a.sh.examples.seed, "random seed")->capture_default_str();
  shards->add_option("--examples-per-shard", a.sh.examples_per_shard, "examples per shard file")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30))
      ->capture_default_str();
  shards->add_option("--window-docs", a.sh.window_documents, "documents in memory at once (bounds memory)")
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 30))
      ->capture_default_str();
  return shards;
}

CLI::App* add_task(CLI::App& app, Args& a) {
  CLI::App* task = app.add_subcommand(
      "task",
      "fine-tuning data: JSON lines ({\"text\": ..., \"label\": ...} with optional \"text_b\", the label a "
      "class or, for seq-reg, a score; "
      "{\"tokens\": [...], \"tags\": [...]}; or SQuAD's {\"question\": ..., \"context\": ..., \"answers\": "
      "{\"text\": [...], \"answer_start\": [...]}}) -> one HDF5 task shard; a word's first piece carries its tag; "
      "a question and a window of its context make a sequence, labelled with the answer's first and last token. "
      "Labels and tags may be strings, integers (a dataset's class ids) or booleans; the classification fields "
      "may have other names (--text-fields, --label-field, --tokens-field, --tags-field), so that Hugging Face "
      "datasets' JSON lines (Dataset.to_json) read as they are");
  task->add_option("--task", a.task_kind,
                   "seq-cls (a label per text) | token-cls (a tag per word) | qa (extractive question answering) | "
                   "seq-reg (a score per text or pair: STS-B's similarity, a cross-encoder's relevance)")
      ->required();
  task->add_option("--input", a.task_input, "JSON-lines file")->required();
  task->add_option("--tokenizer", a.task_tokenizer,
                   "SentencePiece model (.model), WordPiece vocab.txt, or a Hugging Face model directory")
      ->required();
  task->add_option("--output", a.task_output, "output shard (.hdf5)")->required();
  task->add_option("--labels", a.task_labels,
                   "the label set, in id order: a file with one label per line, or a task shard made before (give "
                   "the training shard when making dev/test); default: the input's distinct labels, sorted (as numbers "
                   "where all are integers: class ids 0..K-1 keep their ids); where no name is an integer, an "
                   "integer label k in the input (a dataset's class id) is the k-th name");
  task->add_option_function<std::string>(
      "--text-fields",
      [&a](const std::string& names) {
        const size_t comma = names.find(',');
        a.task_options.fields.text = names.substr(0, comma);
        a.task_options.fields.text_b = comma == std::string::npos ? "" : names.substr(comma + 1);
        if (a.task_options.fields.text.empty() || a.task_options.fields.text_b.find(',') != std::string::npos ||
            (comma != std::string::npos && a.task_options.fields.text_b.empty()))
          throw CLI::ValidationError("--text-fields", "'" + names + "': expected FIELD or FIELD,PAIR_FIELD");
      },
      "seq-cls, seq-reg: the text's JSON field and, after a comma, the optional pair's (absent or null in a line: no "
      "pair), e.g. sentence1,sentence2 (GLUE's MRPC, RTE), question1,question2 (QQP), premise,hypothesis "
      "(MNLI), sentence (SST-2, CoLA) [default: text,text_b]");
  task->add_option("--label-field", a.task_options.fields.label,
                   "seq-cls: the label's JSON field; seq-reg: the score's (a number)")
      ->capture_default_str();
  task->add_option("--group-field", a.task_options.fields.group,
                   "seq-reg: the JSON field of each example's group, a query whose passages are ranked by their "
                   "scores (a string or an integer): bert-eval then reports MRR@10 and NDCG@10 over the groups");
  task->add_option("--tokens-field", a.task_options.fields.tokens, "token-cls: the words' JSON field")
      ->capture_default_str();
  task->add_option("--tags-field", a.task_options.fields.tags,
                   "token-cls: the tags' JSON field, e.g. ner_tags (CoNLL-2003), pos_tags")
      ->capture_default_str();
  task->add_option("--max-seq-len", a.task_options.max_seq_len,
                   "tokens per example (longer ones are truncated, with a warning; qa: windows) [default: 128; qa: "
                   "384, BERT's SQuAD setting]")
      ->check(CLI::Range(int64_t{3}, int64_t{1} << 20));
  task->add_option("--doc-stride", a.task_options.doc_stride,
                   "qa: tokens between the starts of consecutive windows of a long context (BERT's run_squad.py; "
                   "Hugging Face's run_qa.py means the windows' overlap by its doc_stride)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  task->add_option("--max-query-len", a.task_options.max_query_len, "qa: the question's tokens kept (the rest cut)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  return task;
}

CLI::App* add_inspect(CLI::App& app, Args& a) {
  CLI::App* inspect = app.add_subcommand("inspect", "validate shards (layout, dtypes, ids) and summarise them");
  inspect->add_option("shards", a.inspect_paths, "shard files or folders")->required()->expected(1, -1);
  inspect->add_option("--tokenizer", a.inspect_tokenizer, "decode examples and check the tokenizer matches");
  inspect->add_option("--show", a.inspect_show, "examples to print per shard")
      ->check(CLI::Range(0, 1000))
      ->capture_default_str();
  return inspect;
}

Subcommands add_subcommands(CLI::App& app, Args& a) {
  app.description(
      "bert-data: build BERT pretraining data. Steps: `split` (prose -> one sentence per line), "
      "`tokenizer` (train SentencePiece), `shards` (MLM+NSP examples in NVIDIA's HDF5 layout), "
      "`task` (fine-tuning data: JSON lines -> a task shard), `inspect` (check and summarise shards).");
  app.footer(
      "Examples:\n"
      "  bert-data split --input my.paragraphs.txt --output my.txt\n"
      "  bert-data tokenizer --input my.txt --output spm --vocab-size 16000\n"
      "  bert-data shards --input my.txt --tokenizer spm.model --output shards/ --max-seq-len 128\n"
      "  bert-data task --task token-cls --input pos/train.jsonl --tokenizer spm.model --output pos/train.hdf5\n"
      "  bert-data task --task qa --input squad/train.jsonl --tokenizer vocab.txt --output squad/train.hdf5\n"
      "  bert-data task --task seq-reg --input stsb/train.jsonl --text-fields sentence1,sentence2 \\\n"
      "      --tokenizer vocab.txt --output stsb/train.hdf5\n"
      "  bert-data inspect shards/ --tokenizer spm.model\n"
      "Each step has its own --help (e.g. bert-data shards --help). Guide: docs/data.md");
  app.require_subcommand(1);

  app.require_subcommand(1);
  return {add_split(app, a), add_tokenizer(app, a), add_shards(app, a), add_task(app, a), add_inspect(app, a)};
}

void run_tokenizer(Args& a) {
  a.tok.lowercase = !a.cased;
  const auto start = std::chrono::steady_clock::now();
  CorpusReader corpus(a.tok_inputs, parse_corpus_format(a.tok_format));  // checks every file before training
  const int64_t n = tokenizer::train_sentencepiece(a.tok, [&](std::string& s) { return corpus.next_sentence(s); });
  spdlog::info("tokenizer: {} sentences read, vocab {} -> {}.model ({:.1f} s, peak RSS {:.0f} MB)", n, a.tok.vocab_size,
               a.tok.output_prefix, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
               peak_rss_mb());
}

void run_shards(Args& a) {
  const std::unique_ptr<tokenizer::Tokenizer> tokenizer = tokenizer::load_tokenizer(a.sh_tokenizer);
  ShardBuildStats stats = build_shards(a.sh, *tokenizer, [](const ShardBuildStats& s, int pass, double fraction) {
    spdlog::info("shards: pass {} {:5.1f}%  {} examples  {:.0f} examples/s  {} shards  peak RSS {:.0f} MB", pass + 1,
                 100 * fraction, s.examples, s.examples / std::max(s.seconds, 1e-9), s.shards, peak_rss_mb());
  });
  spdlog::info(
      "shards: {} documents, {} sentences, {:.1f} MB of text -> {} examples ({:.1f}% random-next) in {} "
      "shards in {:.1f} s ({:.0f} examples/s), peak RSS {:.0f} MB",
      stats.documents, stats.sentences, stats.corpus_bytes / 1e6, stats.examples,
      100.0 * stats.random_next / stats.examples, stats.shards, stats.seconds, stats.examples / stats.seconds,
      peak_rss_mb());
  if (stats.single_sentence_documents > 0)
    spdlog::info("shards: {} single-sentence documents gave random-next pairs only", stats.single_sentence_documents);
}

}  // namespace

int main(int argc, char** argv) {
  bert::wait_passively_unless_chosen(argv);  // first: it may re-execute the program
  Args args;
  CLI::App app;
  const Subcommands sub = add_subcommands(app, args);
  CLI11_PARSE(app, argc, argv);
  return tools::run_tool([&] {
    if (*sub.split) run_split(args.split_inputs, args.split_output);
    if (*sub.tokenizer) run_tokenizer(args);
    if (*sub.shards) run_shards(args);
    if (*sub.task)
      run_task(args.task_input, args.task_output, args.task_tokenizer, args.task_kind, args.task_labels,
               args.task_options);
    if (*sub.inspect) run_inspect(args.inspect_paths, args.inspect_tokenizer, args.inspect_show);
    return 0;
  });
}
