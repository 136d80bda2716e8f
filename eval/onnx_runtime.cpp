#include "eval/onnx_runtime.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/json.h"

namespace bert::eval {

PretrainingMetrics evaluate_onnx(const std::string& onnx_path, data::ShardLoader& loader, int64_t max_batches,
                                 const std::string& script, const std::string& work_dir) {
  if (!std::filesystem::exists(onnx_path)) throw UserError("ONNX model '" + onnx_path + "' does not exist");
  if (!std::filesystem::exists(script)) throw UserError("ONNX Runtime script '" + script + "' does not exist");
  std::vector<data::Batch> batches;
  Json::Array feeds;
  data::Batch batch;
  for (int64_t n = 0; (max_batches <= 0 || n < max_batches) && loader.next(batch); ++n) {
    auto tensor = [&](const auto& values, int64_t cols) {
      Json t;
      t["dims"] = Json::Array{Json(batch.size), Json(cols)};
      Json::Array data;
      for (auto v : values) data.emplace_back(static_cast<int64_t>(v));
      t["data"] = data;
      return t;
    };
    Json feed;
    feed["input_ids"] = tensor(batch.input_ids, batch.seq_len);
    feed["attention_mask"] = tensor(batch.input_mask, batch.seq_len);
    feed["token_type_ids"] = tensor(batch.segment_ids, batch.seq_len);
    feed["masked_lm_positions"] = tensor(batch.masked_lm_positions, batch.max_predictions);
    feeds.push_back(feed);
    batches.push_back(batch);
  }
  const std::string in = work_dir + "/onnx_eval_inputs.json", out = work_dir + "/onnx_eval_outputs.json",
                    log = work_dir + "/onnx_eval.log";
  std::ofstream(in) << Json(feeds).dump();
  const std::string command = "node '" + script + "' --argmax '" + onnx_path + "' '" + in + "' '" + out + "' 2>'" + log + "'";
  if (std::system(command.c_str()) != 0) {
    std::ifstream l(log);
    std::stringstream text;
    text << l.rdbuf();
    throw UserError("ONNX Runtime could not run '" + onnx_path + "' (exported with --masked-positions?): " + text.str());
  }
  std::ifstream f(out);
  std::stringstream text;
  text << f.rdbuf();
  const Json results = Json::parse(text.str());
  PretrainingMetrics m;
  for (size_t b = 0; b < batches.size(); ++b) {
    const data::Batch& bt = batches[b];
    const Json& r = results.as_array().at(b);
    const auto& mlm = r.find("prediction_logits")->find("data")->as_array();
    const auto& nsp = r.find("seq_relationship_logits")->find("data")->as_array();
    for (int64_t i = 0; i < bt.size; ++i) {
      for (int64_t j = 0; j < bt.max_predictions; ++j) {
        const int64_t k = i * bt.max_predictions + j;
        if (bt.masked_lm_positions[k] == 0) break;
        m.mlm_correct += mlm.at(k).as_int() == bt.masked_lm_ids[k];
        ++m.target_counts[bt.masked_lm_ids[k]];
        ++m.predictions;
      }
      m.nsp_correct += nsp.at(i).as_int() == bt.next_sentence_labels[i];
      m.nsp_random_next += bt.next_sentence_labels[i];
      ++m.sequences;
    }
  }
  return m;
}

}  // namespace bert::eval
