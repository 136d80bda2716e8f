#include "export/fusion_report.h"

#include <onnx/shape_inference/implementation.h>

#include <cstdio>
#include <deque>
#include <map>
#include <set>

#include "export/qdq_rules.h"
#include "sys/error.h"

namespace bert::exporter {

namespace {

using Node = onnx::NodeProto;

bool is_shape_op(const std::string& op) {
  return op == "Transpose" || op == "Reshape" || op == "Squeeze" || op == "Unsqueeze" || op == "Identity" ||
         op == "Flatten";
}

// Producers, consumers and initializers of a graph, and the walks the rules need.
class GraphIndex {
 public:
  explicit GraphIndex(const onnx::GraphProto& g) {
    for (const auto& t : g.initializer()) initializers_[t.name()] = &t;
    for (int i = 0; i < g.node_size(); ++i) {
      const Node& n = g.node(i);
      order_[&n] = i;
      for (const auto& in : n.input()) consumers_[in].push_back(&n);
      for (const auto& out : n.output()) producers_[out] = &n;
    }
  }

  const Node* producer(const std::string& t) const {
    auto it = producers_.find(t);
    return it == producers_.end() ? nullptr : it->second;
  }
  const std::vector<const Node*>& consumers(const std::string& t) const {
    static const std::vector<const Node*> none;
    auto it = consumers_.find(t);
    return it == consumers_.end() ? none : it->second;
  }
  const onnx::TensorProto* initializer(const std::string& t) const {
    auto it = initializers_.find(t);
    return it == initializers_.end() ? nullptr : it->second;
  }
  int order(const Node* n) const { return order_.at(n); }

  // The DequantizeLinear the tensor comes from, through shape-only ops (TensorRT moves Q/DQ across
  // them); nullptr when it does not come from one.
  const Node* dequantized_from(std::string t) const {
    for (int hops = 0; hops < 16; ++hops) {
      const Node* p = producer(t);
      if (!p) return nullptr;
      if (p->op_type() == "DequantizeLinear") return p;
      if (!is_shape_op(p->op_type())) return nullptr;
      t = p->input(0);
    }
    return nullptr;
  }
  // Whether the tensor is a constant: an initializer, reached back through Q/DQ and shape-only ops.
  bool constant(std::string t) const {
    for (int hops = 0; hops < 16; ++hops) {
      if (initializer(t)) return true;
      const Node* p = producer(t);
      if (!p) return false;
      if (p->op_type() == "Constant") return true;
      if (!is_shape_op(p->op_type()) && p->op_type() != "QuantizeLinear" && p->op_type() != "DequantizeLinear")
        return false;
      t = p->input(0);
    }
    return false;
  }
  bool weight_gemm(const Node& n) const {
    return (n.op_type() == "MatMul" || n.op_type() == "Gemm") && n.input_size() >= 2 && !constant(n.input(0)) &&
           constant(n.input(1));
  }
  // The weight GEMM whose output reaches t going back through a bias Add, shape-only ops and Q/DQ.
  const Node* projection_of(std::string t) const {
    for (int hops = 0; hops < 16; ++hops) {
      const Node* p = producer(t);
      if (!p) return nullptr;
      const std::string& op = p->op_type();
      if (op == "MatMul" || op == "Gemm") return weight_gemm(*p) ? p : nullptr;
      if (op == "Add" && p->input_size() == 2 && constant(p->input(1))) {
        t = p->input(0);
      } else if (op == "Add" && p->input_size() == 2 && constant(p->input(0))) {
        t = p->input(1);
      } else if (is_shape_op(op) || op == "QuantizeLinear" || op == "DequantizeLinear") {
        t = p->input(0);
      } else {
        return nullptr;
      }
    }
    return nullptr;
  }
  // The first node (breadth first) after tensor t that `stop` accepts, passing through nodes `pass` accepts.
  template <typename Stop, typename Pass>
  const Node* forward(const std::string& t, Stop stop, Pass pass) const {
    std::deque<std::pair<std::string, int>> queue{{t, 0}};
    while (!queue.empty()) {
      auto [tensor, depth] = queue.front();
      queue.pop_front();
      for (const Node* c : consumers(tensor)) {
        if (stop(*c)) return c;
        if (depth < 12 && pass(*c) && c->output_size() > 0) queue.emplace_back(c->output(0), depth + 1);
      }
    }
    return nullptr;
  }

 private:
  std::map<std::string, const onnx::TensorProto*> initializers_;
  std::map<std::string, const Node*> producers_;
  std::map<std::string, std::vector<const Node*>> consumers_;
  std::map<const Node*, int> order_;
};

std::string node_label(const Node& n) { return n.name().empty() ? n.output(0) : n.name(); }

}  // namespace

bool LayerFusion::int8_ready() const {
  for (const ProductCheck& p : products)
    if (!p.int8) return false;
  return qkv_one_scale;
}

bool FusionReport::clean() const {
  for (const LayerFusion& l : layers)
    if (!l.int8_ready() || !l.attention_fusable) return false;
  return !layers.empty();
}

FusionReport fusion_report(const onnx::ModelProto& model, const std::string& what) {
  const onnx::GraphProto& graph = model.graph();
  const GraphIndex g(graph);
  FusionReport r;
  r.model = what;
  int qdq_nodes = 0;
  std::vector<const Node*> softmaxes, weight_gemms;
  for (const Node& n : graph.node()) {
    qdq_nodes += n.op_type() == "QuantizeLinear" || n.op_type() == "DequantizeLinear";
    if (n.op_type() == "Softmax") softmaxes.push_back(&n);
    if (g.weight_gemm(n)) weight_gemms.push_back(&n);
  }
  const std::string not_bert = what + " is not a BERT encoder as the fusion report reads one";
  if (softmaxes.empty()) throw UserError(not_bert + ": it has no Softmax (no self-attention layer)");
  if (qdq_nodes == 0)
    throw UserError(what +
                    " has no QuantizeLinear/DequantizeLinear: an FP32 graph, which TensorRT runs in FP16 or FP32 "
                    "(export a QAT or PTQ checkpoint with --qdq for INT8)");
  for (const auto& t : graph.initializer())
    if (t.name().find("position_embeddings") != std::string::npos && t.dims_size() == 2) r.max_length = t.dims(0);

  // Static shapes of the attention inputs, for the head size.
  onnx::ModelProto inferred = model;
  try {
    onnx::shape_inference::InferShapes(inferred);
  } catch (const std::exception&) {  // the head size then stays unknown
  }
  std::map<std::string, int64_t> last_dim;
  for (const auto& v : inferred.graph().value_info()) {
    const auto& shape = v.type().tensor_type().shape();
    if (shape.dim_size() > 0 && shape.dim(shape.dim_size() - 1).has_dim_value())
      last_dim[v.name()] = shape.dim(shape.dim_size() - 1).dim_value();
  }

  auto product = [&](const std::string& role, const Node& n, const char* first, const char* second) {
    ProductCheck p{role, node_label(n), false, ""};
    const bool a = g.dequantized_from(n.input(0)) != nullptr, b = g.dequantized_from(n.input(1)) != nullptr;
    p.int8 = a && b;
    if (!a && !b)
      p.missing = "both inputs";
    else if (!a)
      p.missing = first;
    else if (!b)
      p.missing = second;
    return p;
  };
  auto gemm = [&](const std::string& role, const Node& n) { return product(role, n, "activation input", "weight"); };
  auto pass_scores = [](const Node& n) {
    const std::string& op = n.op_type();
    return op == "Add" || op == "Mul" || op == "Div" || op == "Sub" || op == "Where" || op == "Cast";
  };
  auto pass_values = [](const Node& n) {
    const std::string& op = n.op_type();
    return op == "QuantizeLinear" || op == "DequantizeLinear" || op == "Dropout" || op == "Cast" || is_shape_op(op);
  };
  auto is_matmul = [](const Node& n) { return n.op_type() == "MatMul"; };
  // The residual add after a GEMM: the first Add of two computed inputs, past its bias Add, dropout and Q/DQ.
  auto residual_after = [&](const Node& from) {
    return g.forward(
        from.output(0),
        [&](const Node& n) {
          return n.op_type() == "Add" && n.input_size() == 2 && !g.constant(n.input(0)) && !g.constant(n.input(1));
        },
        [&](const Node& n) { return pass_values(n) || (n.op_type() == "Add" && n.input_size() == 2); });
  };

  for (size_t i = 0; i < softmaxes.size(); ++i) {
    const Node& softmax = *softmaxes[i];
    LayerFusion l;
    l.index = static_cast<int>(i);
    const std::string where = not_bert + ": attention " + std::to_string(i) + " (" + node_label(softmax) + ")";
    // Q K^T: back from the softmax through the scale and the mask.
    const Node* qk = nullptr;
    std::string t = softmax.input(0);
    for (int hops = 0; hops < 8 && !qk; ++hops) {
      const Node* p = g.producer(t);
      if (!p) break;
      if (p->op_type() == "MatMul")
        qk = p;
      else if (pass_scores(*p))
        t = p->input(0);
      else
        break;
    }
    const Node* pv = g.forward(softmax.output(0), is_matmul, pass_values);
    if (!qk || !pv) throw UserError(where + ": no Q K^T MatMul before it or no P V MatMul after it");
    const Node* q = g.projection_of(qk->input(0));
    const Node* k = g.projection_of(qk->input(1));
    const Node* v = g.projection_of(pv->input(1));
    const Node* out = g.forward(
        pv->output(0), [&](const Node& n) { return g.weight_gemm(n); }, pass_values);
    if (!q || !k || !v || !out) throw UserError(where + ": its Q, K, V or output projection was not found");
    // FFN in and out: the two weight GEMMs after the output projection, in the graph's (topological) order.
    size_t at = 0;
    while (at < weight_gemms.size() && weight_gemms[at] != out) ++at;
    if (at + 2 >= weight_gemms.size()) throw UserError(where + ": no feed-forward GEMMs after it");
    const Node& ffn_in = *weight_gemms[at + 1];
    const Node& ffn_out = *weight_gemms[at + 2];
    if (i + 1 < softmaxes.size() && g.order(&ffn_out) > g.order(softmaxes[i + 1]))
      throw UserError(where + ": its feed-forward GEMMs were not found before the next attention");

    l.products = {gemm("Q", *q),
                  gemm("K", *k),
                  gemm("V", *v),
                  product("Q K^T", *qk, "Q input", "K input"),
                  product("P V", *pv, "probabilities", "V input"),
                  gemm("attention output", *out),
                  gemm("FFN in", ffn_in),
                  gemm("FFN out", ffn_out)};
    // Q, K, V: one tensor through Q/DQ of one scale (one initializer, or equal values).
    std::set<std::string> sources;
    std::vector<std::vector<double>> scales;
    std::set<std::string> scale_names;
    bool all_quantized = true;
    for (const Node* projection : {q, k, v}) {
      const Node* dq = g.dequantized_from(projection->input(0));
      const Node* qn = dq ? g.producer(dq->input(0)) : nullptr;
      if (!dq || !qn || qn->op_type() != "QuantizeLinear" || dq->input_size() < 2) {
        all_quantized = false;
        continue;
      }
      sources.insert(qn->input(0));
      scale_names.insert(dq->input(1));
      const onnx::TensorProto* s = g.initializer(dq->input(1));
      scales.push_back(s ? initializer_values(*s) : std::vector<double>{});
    }
    const bool equal_values =
        scales.size() == 3 && !scales[0].empty() && scales[0] == scales[1] && scales[1] == scales[2];
    l.qkv_one_scale = all_quantized && sources.size() == 1 && (scale_names.size() == 1 || equal_values);

    auto found = last_dim.find(qk->input(0));
    l.head_size = found == last_dim.end() ? 0 : found->second;
    l.probs_quantized = g.dequantized_from(pv->input(0)) != nullptr;
    // Q/DQ between P V and the output projection, through shape-only ops (where TensorRT moves it).
    if (const Node* dq = g.dequantized_from(out->input(0))) {
      const Node* qn = g.producer(dq->input(0));
      std::string from = qn && qn->op_type() == "QuantizeLinear" ? qn->input(0) : "";
      for (int hops = 0; hops < 8 && !from.empty() && from != pv->output(0); ++hops) {
        const Node* p = g.producer(from);
        from = p && is_shape_op(p->op_type()) ? p->input(0) : "";
      }
      l.context_quantized = !from.empty() && from == pv->output(0);
    }
    const bool head_ok = l.head_size == 16 || l.head_size == 32 || l.head_size == 64;
    l.attention_fusable = l.products[3].int8 && l.products[4].int8 && l.context_quantized && head_ok &&
                          (r.max_length == 0 || r.max_length <= 512);

    const std::string layer = "layer " + std::to_string(i);
    for (const ProductCheck& p : l.products)
      if (!p.int8)
        r.findings.push_back(layer + " " + p.role + " (" + p.node + "): " + p.missing +
                             " not quantized: runs in FP16, with reformat kernels between it and its INT8 neighbours");
    if (!l.qkv_one_scale && all_quantized)
      r.findings.push_back(layer + ": Q, K and V read their input " +
                           (sources.size() == 1 ? "at different scales" : "from different tensors") +
                           ": TensorRT runs three GEMMs instead of one (one input quantizer for the three fixes it)");
    if (!l.context_quantized)
      r.findings.push_back(
          layer + ": no Q/DQ after P V (" + node_label(*pv) +
          "): TensorRT's fused INT8 attention needs Q/DQ before Q K^T, after the softmax and after P V");
    if (!head_ok)
      r.findings.push_back(layer + ": head size " + (l.head_size ? std::to_string(l.head_size) : "unknown") +
                           ": TensorRT's fused INT8 attention takes 16, 32 or 64");
    for (const Node* from : {out, &ffn_out}) {
      const Node* add = residual_after(*from);
      if (!add) continue;
      int quantized = 0;
      for (const std::string& in : add->input()) quantized += g.dequantized_from(in) != nullptr;
      l.residual_inputs += 2;
      l.residual_inputs_quantized += quantized;
    }
    r.layers.push_back(l);
  }
  if (r.max_length > 512)
    r.findings.push_back("the model takes " + std::to_string(r.max_length) +
                         " positions: TensorRT's fused INT8 attention runs sequences up to 512");
  return r;
}

std::string FusionReport::text() const {
  std::string s = "fusion report: " + model + " (" + std::to_string(layers.size()) + " encoder layers";
  if (!layers.empty() && layers[0].head_size) s += ", head size " + std::to_string(layers[0].head_size);
  if (max_length) s += ", up to " + std::to_string(max_length) + " positions";
  s += ")\n";
  char line[256];
  std::snprintf(line, sizeof line, "%-6s %-5s %-5s %-5s %-6s %-5s %-5s %-6s %-7s %-10s %-10s %s\n", "layer", "Q", "K",
                "V", "QK^T", "PV", "out", "FFN-in", "FFN-out", "QKV scale", "attention", "residual inputs");
  s += line;
  for (const LayerFusion& l : layers) {
    auto p = [&](size_t i) { return l.products[i].int8 ? "int8" : "fp16"; };
    const std::string residual =
        std::to_string(l.residual_inputs_quantized) + "/" + std::to_string(l.residual_inputs) + " int8";
    std::snprintf(line, sizeof line, "%-6d %-5s %-5s %-5s %-6s %-5s %-5s %-6s %-7s %-10s %-10s %s\n", l.index, p(0),
                  p(1), p(2), p(3), p(4), p(5), p(6), p(7), l.qkv_one_scale ? "one" : "several",
                  l.attention_fusable ? "fused int8" : "unfused", residual.c_str());
    s += line;
  }
  for (const std::string& f : findings) s += "  - " + f + "\n";
  int residual = 0, residual_quantized = 0;
  for (const LayerFusion& l : layers) residual += l.residual_inputs, residual_quantized += l.residual_inputs_quantized;
  if (residual_quantized < residual)
    s += "  note: " + std::to_string(residual - residual_quantized) + " of " + std::to_string(residual) +
         " residual-add inputs are not quantized: those adds and their LayerNorms run in FP16 and the tensor between "
         "layers stays FP16 (NVIDIA's recipe quantizes both inputs, our default; a model calibrated with "
         "--no-quantize-residuals leaves them in float)\n";
  s += clean() ? "clean: every GEMM and attention matmul reads INT8, Q, K and V share one scale and the INT8 attention "
                 "pattern is complete in every layer\n"
               : "not clean: " + std::to_string(findings.size()) + " finding(s) above\n";
  return s;
}

Json FusionReport::to_json() const {
  Json::Array layer_list, finding_list;
  for (const LayerFusion& l : layers) {
    Json j;
    j["layer"] = l.index;
    Json products;
    for (const ProductCheck& p : l.products) {
      Json q;
      q["node"] = p.node;
      q["int8"] = p.int8;
      if (!p.int8) q["missing"] = p.missing;
      products[p.role] = q;
    }
    j["products"] = products;
    j["qkv_one_scale"] = l.qkv_one_scale;
    j["head_size"] = l.head_size;
    j["probs_quantized"] = l.probs_quantized;
    j["context_quantized"] = l.context_quantized;
    j["attention_fusable"] = l.attention_fusable;
    j["residual_inputs"] = l.residual_inputs;
    j["residual_inputs_quantized"] = l.residual_inputs_quantized;
    j["int8_ready"] = l.int8_ready();
    layer_list.push_back(j);
  }
  for (const std::string& f : findings) finding_list.emplace_back(f);
  Json r;
  r["model"] = model;
  r["max_length"] = max_length;
  r["layers"] = layer_list;
  r["findings"] = finding_list;
  r["clean"] = clean();
  return r;
}

}  // namespace bert::exporter
