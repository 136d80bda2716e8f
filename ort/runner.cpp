#include "ort/runner.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/process.h"

namespace bert::ort {

namespace {

bool on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  std::error_code ec;
  for (std::string dir; std::getline(dirs, dir, ':');)
    if (!dir.empty() && std::filesystem::is_regular_file(std::filesystem::path(dir) / program, ec)) return true;
  return false;
}

}  // namespace

std::string default_ort_script() {
  if (const char* set = std::getenv("BERT_ORT_SCRIPT"); set && *set) return set;
  const std::string name = on_path("node") || !on_path("python3") ? "ort_run.js" : "ort_run.py";
  namespace fs = std::filesystem;
  // The checkout the program runs from: build/tools/<program> or gpu-bundle/bin/<program>, two levels
  // below the root; or the current folder.
  std::error_code ec, missing;
  fs::path dir = fs::read_symlink("/proc/self/exe", ec).parent_path();
  for (int up = 0; up < 4 && !ec && dir.has_relative_path(); ++up, dir = dir.parent_path())
    if (fs::is_regular_file(dir / "scripts" / name, missing)) return (dir / "scripts" / name).string();
  return (fs::current_path(ec) / "scripts" / name).string();
}

std::vector<data::Batch> take_batches(data::ShardLoader& loader, int64_t max_batches) {
  std::vector<data::Batch> batches;
  data::Batch batch;
  for (int64_t n = 0; (max_batches <= 0 || n < max_batches) && loader.next(batch); ++n) batches.push_back(batch);
  return batches;
}

Json batch_feeds(const std::vector<data::Batch>& batches, bool masked_positions) {
  Json::Array feeds;
  for (const data::Batch& b : batches) {
    auto tensor = [&](const auto& values, int64_t cols) {
      Json t;
      t["dims"] = Json::Array{Json(b.size), Json(cols)};
      Json::Array data;
      for (auto v : values) data.emplace_back(static_cast<int64_t>(v));
      t["data"] = data;
      return t;
    };
    Json feed;
    feed["input_ids"] = tensor(b.input_ids, b.seq_len);
    feed["attention_mask"] = tensor(b.input_mask, b.seq_len);
    feed["token_type_ids"] = tensor(b.segment_ids, b.seq_len);
    if (masked_positions) feed["masked_lm_positions"] = tensor(b.masked_lm_positions, b.max_predictions);
    feeds.push_back(feed);
  }
  return Json(feeds);
}

Json run_onnx_runtime(const std::string& script, const std::string& mode, const std::string& model, const Json& feeds,
                      const std::string& work_dir) {
  if (!std::filesystem::exists(model)) throw UserError("ONNX model '" + model + "' does not exist");
  if (!std::filesystem::exists(script)) throw UserError("ONNX Runtime script '" + script + "' does not exist");
  const std::string in = work_dir + "/ort_inputs.json", out = work_dir + "/ort_outputs.json",
                    log = work_dir + "/ort.log";
  std::ofstream(in) << feeds.dump();
  std::filesystem::remove(log);
  // The runner: scripts/ort_run.js under Node (npm onnxruntime-node), or scripts/ort_run.py under Python
  // (the onnxruntime wheel), with the same arguments and files.
  const std::string interpreter = script.ends_with(".py") ? "python3" : "node";
  if (run_program({interpreter, script, mode, model, in, out}, log) != 0) {
    std::ifstream l(log);
    std::stringstream text;
    text << l.rdbuf();
    throw UserError("ONNX Runtime could not run '" + model + "': " + text.str());
  }
  std::ifstream f(out);
  std::stringstream text;
  text << f.rdbuf();
  return Json::parse(text.str());
}

}  // namespace bert::ort
