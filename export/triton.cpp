#include "export/triton.h"

#include <filesystem>
#include <fstream>

#include "export/bert_onnx.h"
#include "sys/atomic_file.h"
#include "sys/error.h"
#include "sys/text_file.h"

namespace bert::exporter {

namespace {

std::string triton_type(int32_t elem_type) {
  switch (elem_type) {
    case onnx::TensorProto::INT64:
      return "TYPE_INT64";
    case onnx::TensorProto::INT32:
      return "TYPE_INT32";
    case onnx::TensorProto::FLOAT:
      return "TYPE_FP32";
    default:
      throw UserError("Triton config: unsupported tensor type " + std::to_string(elem_type));
  }
}

// One "input"/"output" block; the first (batch) axis is left to Triton's max_batch_size.
std::string tensor_block(const onnx::ValueInfoProto& v) {
  const auto& t = v.type().tensor_type();
  std::string dims;
  for (int i = 1; i < t.shape().dim_size(); ++i) {
    const auto& d = t.shape().dim(i);
    dims += (i > 1 ? ", " : "") + (d.has_dim_value() ? std::to_string(d.dim_value()) : std::string("-1"));
  }
  return "  {\n    name: \"" + v.name() + "\"\n    data_type: " + triton_type(t.elem_type()) + "\n    dims: [ " + dims +
         " ]\n  }";
}

}  // namespace

std::string triton_config(const onnx::ModelProto& model, const std::string& name, int max_batch_size) {
  if (max_batch_size < 1) throw UserError("--triton-max-batch must be at least 1");
  std::string c =
      "name: \"" + name + "\"\nbackend: \"onnxruntime\"\nmax_batch_size: " + std::to_string(max_batch_size) + "\n";
  for (const auto* list : {&model.graph().input(), &model.graph().output()}) {
    c += list == &model.graph().input() ? "input [\n" : "output [\n";
    for (int i = 0; i < list->size(); ++i) c += tensor_block(list->Get(i)) + (i + 1 < list->size() ? ",\n" : "\n");
    c += "]\n";
  }
  c += "dynamic_batching { }\ninstance_group [ { kind: KIND_CPU } ]\n";
  return c;
}

std::string write_triton_repository(const onnx::ModelProto& model, const std::string& repository,
                                    const std::string& name, int max_batch_size) {
  namespace fs = std::filesystem;
  const fs::path folder = fs::path(repository) / name;
  std::error_code ec;
  fs::create_directories(folder / "1", ec);
  if (ec) throw UserError("cannot create Triton repository folder '" + (folder / "1").string() + "': " + ec.message());
  write_onnx(model, (folder / "1" / "model.onnx").string());
  write_text_file((folder / "config.pbtxt").string(), triton_config(model, name, max_batch_size));
  return folder.string();
}

}  // namespace bert::exporter
