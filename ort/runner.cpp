#include "ort/runner.h"

#include <cpuid.h>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "sys/error.h"
#include "sys/process.h"

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

bool integer_kernels_exact() {
  if (__builtin_cpu_supports("avx512vnni")) return true;
  // AVX-VNNI (VEX-encoded vpdpbusd): CPUID leaf 7, sub-leaf 1, EAX bit 4 (no name for it in clang 14).
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __builtin_cpu_supports("avx2") && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && ((eax >> 4) & 1u);
}

std::vector<Batch> take_batches(data::ShardLoader& loader, int64_t max_batches) {
  std::vector<Batch> batches;
  Batch batch;
  for (int64_t n = 0; (max_batches <= 0 || n < max_batches) && loader.next(batch); ++n) batches.push_back(batch);
  return batches;
}

Json batch_feeds(const std::vector<Batch>& batches, bool masked_positions) {
  Json::Array feeds;
  for (const Batch& b : batches) {
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

namespace {

// The runner's command line: scripts/ort_run.js under Node (npm onnxruntime-node), or scripts/ort_run.py
// under Python (the onnxruntime wheel), with the same arguments and files.
std::vector<std::string> runner_command(const std::string& script, const std::string& mode, const std::string& model,
                                        const Json& feeds, const std::string& work_dir) {
  if (!std::filesystem::exists(model)) throw UserError("ONNX model '" + model + "' does not exist");
  if (!std::filesystem::exists(script)) throw UserError("ONNX Runtime script '" + script + "' does not exist");
  const std::string in = work_dir + "/ort_inputs.json", out = work_dir + "/ort_outputs.json";
  std::ofstream(in) << feeds.dump();
  std::filesystem::remove(out);
  std::filesystem::remove(work_dir + "/ort.log");
  const std::string interpreter = script.ends_with(".py") ? "python3" : "node";
  std::vector<std::string> command = {interpreter, script, mode, model, in, out};
  if (mode.empty()) command.erase(command.begin() + 2);
  return command;
}

void check_ran(int status, const std::string& model, const std::string& work_dir) {
  if (status == 0) return;
  std::ifstream l(work_dir + "/ort.log");
  std::stringstream text;
  text << l.rdbuf();
  throw UserError("ONNX Runtime could not run '" + model + "': " + text.str());
}

}  // namespace

Json run_onnx_runtime(const std::string& script, const std::string& mode, const std::string& model, const Json& feeds,
                      const std::string& work_dir) {
  check_ran(run_program(runner_command(script, mode, model, feeds, work_dir), work_dir + "/ort.log"), model, work_dir);
  std::ifstream f(work_dir + "/ort_outputs.json");
  std::stringstream text;
  text << f.rdbuf();
  return Json::parse(text.str());
}

void stream_onnx_runtime(const std::string& script, const std::string& model, const Json& feeds,
                         const std::string& work_dir, const TensorConsumer& consume) {
  std::vector<float> values;
  const int status = run_program_streaming(
      runner_command(script, "--stream", model, feeds, work_dir), work_dir + "/ort.log", [&](ProgramStream& stream) {
        // Each message: uint32 batch, uint32 name length, the name, uint64 count, count float32 (little-endian,
        // as x86-64 and the runners write them).
        for (uint32_t head[2]; stream.read_exact(head, sizeof head);) {
          if (head[1] == 0 || head[1] > 4096)
            throw UserError("ONNX Runtime's stream from '" + model + "' is malformed (a tensor name of " +
                            std::to_string(head[1]) + " bytes)");
          std::string name(head[1], '\0');
          uint64_t count = 0;
          if (!stream.read_exact(name.data(), name.size()) || !stream.read_exact(&count, sizeof count))
            throw UserError("ONNX Runtime's stream from '" + model + "' ended inside a message");
          values.resize(count);
          if (count > 0 && !stream.read_exact(values.data(), count * sizeof(float)))
            throw UserError("ONNX Runtime's stream from '" + model + "' ended inside tensor '" + name + "'");
          consume(head[0], name, values);
        }
      });
  check_ran(status, model, work_dir);
}

}  // namespace bert::ort
