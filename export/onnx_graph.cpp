#include "export/onnx_graph.h"

namespace bert::exporter {

namespace {
onnx::TensorProto* new_initializer(onnx::GraphProto* g, const std::string& name, int32_t type,
                                   const std::vector<int64_t>& dims) {
  onnx::TensorProto* t = g->add_initializer();
  t->set_name(name);
  t->set_data_type(type);
  for (int64_t d : dims) t->add_dims(d);
  return t;
}
}  // namespace

std::string OnnxGraph::floats(const std::string& name, const std::vector<float>& values,
                              const std::vector<int64_t>& dims) {
  onnx::TensorProto* t = new_initializer(graph_, name, onnx::TensorProto::FLOAT, dims);
  t->set_raw_data(std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float)));
  return name;
}

std::string OnnxGraph::int64s(const std::string& name, const std::vector<int64_t>& values,
                              const std::vector<int64_t>& dims) {
  onnx::TensorProto* t = new_initializer(graph_, name, onnx::TensorProto::INT64, dims);
  t->set_raw_data(std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(int64_t)));
  return name;
}

std::string OnnxGraph::int8s(const std::string& name, const std::vector<int8_t>& values,
                             const std::vector<int64_t>& dims) {
  onnx::TensorProto* t = new_initializer(graph_, name, onnx::TensorProto::INT8, dims);
  t->set_raw_data(std::string(reinterpret_cast<const char*>(values.data()), values.size()));
  return name;
}

std::string OnnxGraph::node(const std::string& op, const std::vector<std::string>& inputs, const std::string& name,
                            const std::function<void(onnx::NodeProto&)>& set) {
  onnx::NodeProto* n = graph_->add_node();
  n->set_op_type(op);
  n->set_name(name);
  for (const std::string& in : inputs) n->add_input(in);
  n->add_output(name);
  if (set) set(*n);
  return name;
}

void OnnxGraph::attribute(onnx::NodeProto& n, const std::string& name, int64_t value) {
  onnx::AttributeProto* a = n.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::INT);
  a->set_i(value);
}

void OnnxGraph::attribute(onnx::NodeProto& n, const std::string& name, float value) {
  onnx::AttributeProto* a = n.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::FLOAT);
  a->set_f(value);
}

void OnnxGraph::attribute(onnx::NodeProto& n, const std::string& name, const std::vector<int64_t>& values) {
  onnx::AttributeProto* a = n.add_attribute();
  a->set_name(name);
  a->set_type(onnx::AttributeProto::INTS);
  for (int64_t v : values) a->add_ints(v);
}

void OnnxGraph::set_type(onnx::ValueInfoProto* v, int32_t elem_type, const std::vector<Dim>& dims) {
  onnx::TypeProto_Tensor* t = v->mutable_type()->mutable_tensor_type();
  t->set_elem_type(elem_type);
  for (const Dim& d : dims) {
    onnx::TensorShapeProto_Dimension* dim = t->mutable_shape()->add_dim();
    if (std::holds_alternative<int64_t>(d))
      dim->set_dim_value(std::get<int64_t>(d));
    else
      dim->set_dim_param(std::get<std::string>(d));
  }
}

void OnnxGraph::input(const std::string& name, int32_t elem_type, const std::vector<Dim>& dims) {
  onnx::ValueInfoProto* v = graph_->add_input();
  v->set_name(name);
  set_type(v, elem_type, dims);
}

void OnnxGraph::output(const std::string& name, int32_t elem_type, const std::vector<Dim>& dims) {
  onnx::ValueInfoProto* v = graph_->add_output();
  v->set_name(name);
  set_type(v, elem_type, dims);
}

}  // namespace bert::exporter
