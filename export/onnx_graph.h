// OnnxGraph: a small builder over ONNX's own protobuf schema. Node outputs take the node's (readable)
// name, so the graph reads like the model in Netron.
#pragma once

#include <onnx/onnx_pb.h>

#include <cstdint>
#include <functional>
#include <string>
#include <variant>
#include <vector>

namespace bert::exporter {

class OnnxGraph {
 public:
  explicit OnnxGraph(onnx::GraphProto* graph) : graph_(graph) {}

  // Initializers; return their names.
  std::string floats(const std::string& name, const std::vector<float>& values, const std::vector<int64_t>& dims);
  std::string int64s(const std::string& name, const std::vector<int64_t>& values, const std::vector<int64_t>& dims);
  std::string int8s(const std::string& name, const std::vector<int8_t>& values, const std::vector<int64_t>& dims);

  // A node named `name` whose single output is also called `name`; `set` adds attributes.
  std::string node(const std::string& op, const std::vector<std::string>& inputs, const std::string& name,
                   const std::function<void(onnx::NodeProto&)>& set = {});

  static void attribute(onnx::NodeProto& n, const std::string& name, int64_t value);
  static void attribute(onnx::NodeProto& n, const std::string& name, float value);
  static void attribute(onnx::NodeProto& n, const std::string& name, const std::vector<int64_t>& values);

  // Graph inputs/outputs with element type and dims (a string is a symbolic, dynamic dimension).
  using Dim = std::variant<int64_t, std::string>;
  void input(const std::string& name, int32_t elem_type, const std::vector<Dim>& dims);
  void output(const std::string& name, int32_t elem_type, const std::vector<Dim>& dims);

 private:
  static void set_type(onnx::ValueInfoProto* v, int32_t elem_type, const std::vector<Dim>& dims);
  onnx::GraphProto* graph_;
};

}  // namespace bert::exporter
