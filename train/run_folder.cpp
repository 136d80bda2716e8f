#include "train/run_folder.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <fstream>

#include "store/checkpoint.h"
#include "store/model_source.h"
#include "sys/error.h"
#include "sys/text_file.h"
#include "tokenizer/tokenizer_file.h"
#include "train/qat_setup.h"

namespace bert::train {

namespace fs = std::filesystem;

// Keeps metrics.jsonl lines up to `step` (used on resume: later lines belong to the interrupted run).
void truncate_metrics(const std::string& path, int64_t step) {
  std::ifstream in(path);
  if (!in) return;
  std::string kept, line;
  while (std::getline(in, line)) {
    try {
      const Json j = Json::parse(line);
      if (const Json* s = j.find("step"); s && s->as_int() <= step) kept += line + "\n";
    } catch (const UserError&) {  // a half-written last line of a killed run
    }
  }
  in.close();
  write_text_file(path, kept);
}

// checkpoint.h5 is always the newest; with keep > 1 the last `keep` saves also stay as
// checkpoint-<step>.h5 (hard links where possible, so they cost no space until superseded).
void keep_numbered_checkpoints(const std::string& output_dir, const std::string& latest, int64_t step, int64_t keep) {
  if (keep <= 1) return;
  const fs::path dir(output_dir);
  const fs::path numbered = dir / ("checkpoint-" + std::to_string(step) + ".h5");
  std::error_code ec;
  fs::remove(numbered, ec);
  fs::create_hard_link(latest, numbered, ec);
  if (ec) fs::copy_file(latest, numbered, fs::copy_options::overwrite_existing);
  std::vector<std::pair<int64_t, fs::path>> all;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with("checkpoint-") || !name.ends_with(".h5")) continue;
    const std::string number = name.substr(11, name.size() - 14);
    if (number.empty() || number.find_first_not_of("0123456789") != std::string::npos) continue;
    all.emplace_back(std::stoll(number), entry.path());
  }
  std::sort(all.begin(), all.end());
  for (size_t i = 0; i + keep < all.size(); ++i) fs::remove(all[i].second, ec);
}

std::string label_list(const std::vector<std::string>& labels) {
  std::string s;
  for (size_t i = 0; i < labels.size() && i < 8; ++i) s += (i ? ", " : "") + labels[i];
  return s + (labels.size() > 8 ? ", ... (" + std::to_string(labels.size()) + ")" : "");
}

namespace {

model::Head head_of(data::ShardKind kind) {
  switch (kind) {
    case data::ShardKind::kSequenceLabels:
    case data::ShardKind::kSequenceScores:
      return model::Head::kSequenceClassification;
    case data::ShardKind::kTokenLabels:
      return model::Head::kTokenClassification;
    case data::ShardKind::kSpanLabels:
      return model::Head::kQuestionAnswering;
    default:
      return model::Head::kPretraining;
  }
}

// Gives `config` the head and labels of the training data. A model that already has that head must
// have the same labels (in the same order), or be a regression where the data has scores (`scores`); a
// model with another head gets the new one.
void adopt_task(model::BertConfig& config, model::Head head, const std::vector<std::string>& labels, bool scores,
                const std::string& source) {
  if (config.head == head && (scores || config.regression())) {
    if (scores && config.regression()) return;  // one score, whatever its name (Hugging Face's LABEL_0)
    throw UserError(source + (scores ? " classifies into [" + label_list(config.labels) + "]" : " is a regression") +
                    ", the training shards " +
                    (scores ? "hold scores (seq-reg)" : "classify into [" + label_list(labels) + "]") +
                    ": a head mismatch (fine-tune from the encoder of a pretraining " +
                    "model, or make the shards for the model's task)");
  }
  if (config.head == head) {
    // (A question-answering head's two outputs are start and end whatever their names: LABEL_0, LABEL_1.)
    if (head == model::Head::kQuestionAnswering) config.labels = labels;
    if (head != model::Head::kPretraining && head != model::Head::kQuestionAnswering && config.labels != labels)
      throw UserError(source + " classifies into [" + label_list(config.labels) + "], the training shards into [" +
                      label_list(labels) + "]: a head mismatch (fine-tune from the encoder of a pretraining model, " +
                      "or make the shards with the model's labels)");
    return;
  }
  if (head == model::Head::kPretraining)
    throw UserError(source + " is a " + model::head_architecture(config.head) +
                    "; pretraining shards need a BertForPreTraining model");
  config.head = head;
  config.labels = labels;
}

}  // namespace

// The model config of the run: the checkpoint's on --resume, --init-from's (with this run's dropout), or
// the given one; with the vocabulary of the tokenizer and the head and labels of the training shards.
model::BertConfig resolve_config(const TrainOptions& o, const RunFiles& files, const data::ShardLoader& loader) {
  model::BertConfig config = o.config;
  if (config.vocab_size != o.tokenizer_vocab_size) {
    spdlog::info("vocab_size set to the tokenizer's {} (config had {})", o.tokenizer_vocab_size, config.vocab_size);
    config.vocab_size = o.tokenizer_vocab_size;
  }
  if (o.resume) {
    if (!fs::exists(files.checkpoint))
      throw UserError("--resume: no checkpoint at '" + files.checkpoint + "' to resume from");
    config = store::read_checkpoint_config(files.checkpoint);
  } else if (!o.init_from.empty()) {
    config = store::read_model_config(store::find_model(o.init_from));
    config.hidden_dropout_prob = o.config.hidden_dropout_prob;
    config.attention_probs_dropout_prob = o.config.attention_probs_dropout_prob;
    if (o.qat) config.weight_scales = o.weights;  // the layout QAT's weight quantizers take
    if (config.vocab_size != o.tokenizer_vocab_size)
      throw UserError("--init-from '" + o.init_from + "' has vocab_size " + std::to_string(config.vocab_size) +
                      ", the tokenizer " + std::to_string(o.tokenizer_vocab_size));
  }
  const model::Head head = head_of(loader.kind());
  if (o.task && *o.task != data::shard_kind_name(loader.kind()))
    throw UserError("--task " + *o.task + ": the training shards are " + data::shard_kind_name(loader.kind()) +
                    " shards ('" + data::expand_shard_paths(o.train_shards).front() + "')");
  adopt_task(config, head, loader.label_names(), loader.kind() == data::ShardKind::kSequenceScores,
             o.resume              ? "the checkpoint"
             : o.init_from.empty() ? "the model"
                                   : "--init-from '" + o.init_from + "'");
  return config;
}

// The state training starts from: the checkpoint's on --resume (weights, moments, data order, dropout
// RNG), else fresh weights or --init-from's, calibrated for QAT; the run folder gets its tokenizer copy,
// config.json and an empty metrics log.
store::TrainingState start_state(const RunSetup& run, const RunPieces& pieces) {
  const TrainOptions& o = run.options;
  const RunFiles& files = run.files;
  model::Bert& model = pieces.model;
  Optimizer& optimizer = pieces.optimizer;
  ParameterArena<float>& params = model.parameters();
  store::TrainingState state;
  state.tokenizer_sha256 = o.tokenizer_sha256;
  state.run = o.to_json();
  if (o.resume) {
    store::OptimizerMoments moments = optimizer.checkpoint_moments();
    store::TrainingState loaded = store::load_checkpoint(files.checkpoint, model, &moments);
    optimizer.set_steps(moments.steps);
    params.upload_values();
    optimizer.upload_moments();
    if (!loaded.tokenizer_sha256.empty() && loaded.tokenizer_sha256 != o.tokenizer_sha256)
      throw UserError("--resume: the checkpoint was trained with another tokenizer than '" + o.tokenizer_path + "'");
    state.step = loaded.step;
    pieces.loader.restore(loaded.loader);
    pieces.dropout_rng = Rng(loaded.dropout_rng);
    state.quantization = loaded.quantization;
    if (run.writes) truncate_metrics(files.metrics, state.step);
    spdlog::info("resuming from '{}' at step {}", files.checkpoint, state.step);
    return state;
  }
  if (o.init_from.empty()) {
    model.initialize(o.seed);
  } else {
    model.initialize(o.seed);  // a head the checkpoint lacks keeps this
    const store::TrainingState init = store::load_model(store::find_model(o.init_from), model, o.seed);
    if (!init.tokenizer_sha256.empty() && init.tokenizer_sha256 != o.tokenizer_sha256)
      throw UserError("--init-from '" + o.init_from + "' was trained with another tokenizer than '" + o.tokenizer_path +
                      "'");
    spdlog::info("weights from '{}' (step {})", o.init_from, init.step);
    if (!init.fresh_parameters.empty())
      spdlog::info("fine-tuning for {} with {} labels: new head {}", model::head_architecture(run.config.head),
                   run.config.num_labels(), label_list(init.fresh_parameters));
  }
  params.upload_values();
  if (o.qat) state.quantization = calibrate_for_qat(o, model, run.loader_options, run.device);
  if (!run.writes) return state;
  tokenizer::copy_tokenizer(o.tokenizer_path, o.output_dir);
  write_text_file((fs::path(o.output_dir) / "config.json").string(), run.config.to_json().dump(2) + "\n");
  std::ofstream(files.metrics, std::ios::trunc).close();
  return state;
}

}  // namespace bert::train
