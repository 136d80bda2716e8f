// bert-eval: masked-LM and NSP accuracy (with baselines) of a checkpoint on shards; fill-mask.
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <filesystem>

#include "core/error.h"
#include "core/parallel.h"
#include "data/loader.h"
#include "data/tokenizer.h"
#include "eval/fill_mask.h"
#include "eval/metrics.h"
#include "train/checkpoint.h"

int main(int argc, char** argv) {
  using namespace bert;
  std::string checkpoint, tokenizer_path, fill_text;
  std::vector<std::string> shards;
  bool mlm = false, nsp = false, json = false;
  int64_t batch_size = 64, max_batches = 0;
  int top_k = 5, threads = 0;
  CLI::App app{"bert-eval: evaluate a checkpoint. --mlm-accuracy / --nsp-accuracy on shards (with the "
               "most-frequent-token and majority-class baselines), or --fill-mask \"text with [MASK]\"."};
  app.add_option("--checkpoint", checkpoint, "checkpoint .h5 (from bert-train), or its output folder")->required();
  app.add_option("--shards", shards, "evaluation shards (files or folders)")->expected(1, -1);
  app.add_flag("--mlm-accuracy", mlm, "masked-LM accuracy and loss");
  app.add_flag("--nsp-accuracy", nsp, "next-sentence-prediction accuracy and loss");
  app.add_option("--fill-mask", fill_text, "text with [MASK] tokens to fill");
  app.add_option("--top-k", top_k, "candidates per mask")->check(CLI::Range(1, 100))->capture_default_str();
  app.add_option("--tokenizer", tokenizer_path, "tokenizer (default: tokenizer.model beside the checkpoint)");
  app.add_option("--batch-size", batch_size, "sequences per batch")->check(CLI::Range(int64_t{1}, int64_t{1} << 20))->capture_default_str();
  app.add_option("--max-batches", max_batches, "stop after this many batches (0: all)")->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_flag("--json", json, "print JSON instead of a table");
  app.add_option("--threads", threads, "threads (0: all cores)")->check(CLI::Range(0, 1024));
  CLI11_PARSE(app, argc, argv);

  try {
    if (threads > 0) omp_set_num_threads(threads);
    namespace fs = std::filesystem;
    if (fs::is_directory(checkpoint)) checkpoint = (fs::path(checkpoint) / "checkpoint.h5").string();
    if (tokenizer_path.empty()) tokenizer_path = (fs::path(checkpoint).parent_path() / "tokenizer.model").string();
    if (fill_text.empty() && shards.empty()) throw UserError("nothing to do: give --shards (with --mlm-accuracy/--nsp-accuracy) or --fill-mask");
    if ((mlm || nsp) && shards.empty()) throw UserError("--mlm-accuracy / --nsp-accuracy need --shards");
    if (!shards.empty() && !mlm && !nsp) mlm = nsp = true;

    model::BertForPreTraining model(train::read_checkpoint_config(checkpoint));
    const train::TrainingState state = train::load_checkpoint(checkpoint, model, nullptr);
    Graph<float> g;
    Json report;
    report["checkpoint"] = checkpoint;
    report["step"] = state.step;

    if (!shards.empty()) {
      data::LoaderOptions lo;
      lo.shards = data::expand_shard_paths(shards);
      lo.batch_size = batch_size;
      lo.shuffle = false;
      lo.repeat = false;
      data::ShardLoader loader(lo);
      if (loader.metadata()) {
        data::Shard header;
        header.seq_len = loader.seq_len();
        header.metadata = loader.metadata();
        data::check_shard_compatible(header, lo.shards.front(), model.config().vocab_size,
                                     model.config().max_position_embeddings, state.tokenizer_sha256);
      }
      const eval::PretrainingMetrics m = eval::evaluate(model, loader, max_batches, g);
      report["shards"] = static_cast<int64_t>(lo.shards.size());
      report["metrics"] = m.to_json();
      if (!json) {
        std::printf("checkpoint %s (step %lld) on %zu shard(s)\n", checkpoint.c_str(), (long long)state.step, lo.shards.size());
        std::printf("%-22s %10s %12s %12s\n", "metric", "value", "baseline", "count");
        if (mlm) {
          std::printf("%-22s %10.4f %12.4f %12lld   (baseline: most frequent token)\n", "MLM accuracy", m.mlm_accuracy(),
                      m.most_frequent_token_accuracy(), (long long)m.predictions);
          std::printf("%-22s %10.4f %12s %12lld\n", "MLM loss", m.mlm_loss(), "", (long long)m.predictions);
        }
        if (nsp) {
          std::printf("%-22s %10.4f %12.4f %12lld   (baseline: majority class)\n", "NSP accuracy", m.nsp_accuracy(),
                      m.nsp_majority_accuracy(), (long long)m.sequences);
          std::printf("%-22s %10.4f %12s %12lld\n", "NSP loss", m.nsp_loss(), "", (long long)m.sequences);
        }
      }
    }
    if (!fill_text.empty()) {
      std::unique_ptr<data::Tokenizer> tokenizer = data::load_tokenizer(tokenizer_path);
      if (!state.tokenizer_sha256.empty() && tokenizer->file_sha256() != state.tokenizer_sha256)
        throw UserError("tokenizer '" + tokenizer_path + "' is not the one the checkpoint was trained with");
      Json::Array masks;
      for (const eval::MaskPrediction& p : eval::fill_mask(model, *tokenizer, fill_text, top_k, g)) {
        Json::Array candidates;
        if (!json) std::printf("[MASK] at position %d:\n", p.position);
        for (const auto& [piece, prob] : p.candidates) {
          if (!json) std::printf("  %-20s %.4f\n", piece.c_str(), prob);
          Json c;
          c["token"] = piece;
          c["probability"] = prob;
          candidates.push_back(c);
        }
        Json mj;
        mj["position"] = p.position;
        mj["candidates"] = candidates;
        masks.push_back(mj);
      }
      report["fill_mask"] = masks;
    }
    if (json) std::printf("%s\n", report.dump(2).c_str());
  } catch (const UserError& e) {
    spdlog::error("{}", e.what());
    return 1;
  } catch (const std::exception& e) {
    spdlog::error("internal error: {}", e.what());
    return 2;
  }
  return 0;
}
