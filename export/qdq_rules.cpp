#include "export/qdq_rules.h"

#include <cmath>
#include <cstring>
#include <map>

namespace bert::exporter {

namespace {

int64_t numel(const onnx::TensorProto& t) {
  int64_t n = 1;
  for (int64_t d : t.dims()) n *= d;
  return n;
}

const onnx::AttributeProto* find_attribute(const onnx::NodeProto& n, const std::string& name) {
  for (const auto& a : n.attribute())
    if (a.name() == name) return &a;
  return nullptr;
}

}  // namespace

std::vector<double> initializer_values(const onnx::TensorProto& t) {
  std::vector<double> out;
  if (t.data_type() == onnx::TensorProto::FLOAT) {
    if (!t.raw_data().empty()) {
      std::vector<float> f(t.raw_data().size() / 4);
      std::memcpy(f.data(), t.raw_data().data(), f.size() * 4);
      out.assign(f.begin(), f.end());
    } else {
      out.assign(t.float_data().begin(), t.float_data().end());
    }
  } else if (t.data_type() == onnx::TensorProto::INT8 || t.data_type() == onnx::TensorProto::UINT8) {
    const bool is_signed = t.data_type() == onnx::TensorProto::INT8;
    if (!t.raw_data().empty()) {
      for (char c : t.raw_data())
        out.push_back(is_signed ? double(static_cast<int8_t>(c)) : double(static_cast<uint8_t>(c)));
    } else {
      out.assign(t.int32_data().begin(), t.int32_data().end());
    }
  }
  return out;
}

std::vector<RuleViolation> check_qdq_rules(const onnx::ModelProto& model) {
  std::vector<RuleViolation> v;
  auto fail = [&v](int rule, const std::string& node, const std::string& message) {
    v.push_back({rule, node, message});
  };
  const onnx::GraphProto& g = model.graph();
  std::map<std::string, const onnx::TensorProto*> init;
  for (const auto& t : g.initializer()) init[t.name()] = &t;
  std::map<std::string, std::vector<const onnx::NodeProto*>> consumers;
  std::map<std::string, const onnx::NodeProto*> producer;
  for (const auto& n : g.node()) {
    for (const auto& in : n.input()) consumers[in].push_back(&n);
    for (const auto& out : n.output()) producer[out] = &n;
  }

  // Rule 6: opset.
  for (const auto& o : model.opset_import())
    if ((o.domain().empty() || o.domain() == "ai.onnx") && o.version() < 13)
      fail(6, "opset_import", "opset " + std::to_string(o.version()) + " < 13 (per-axis Q/DQ needs 13)");

  // Rule 1: no UINT8 anywhere.
  for (const auto& t : g.initializer())
    if (t.data_type() == onnx::TensorProto::UINT8) fail(1, t.name(), "UINT8 initializer");
  for (const auto* list : {&g.input(), &g.output(), &g.value_info()})
    for (const auto& vi : *list)
      if (vi.type().tensor_type().elem_type() == onnx::TensorProto::UINT8) fail(1, vi.name(), "UINT8 tensor");

  for (const auto& n : g.node()) {
    const std::string& op = n.op_type();
    // Rule 8: Q/DQ format only.
    if (op.rfind("QLinear", 0) == 0 || op.find("Integer") != std::string::npos || op == "DynamicQuantizeLinear")
      fail(8, n.name(), "QOperator-format op " + op);
    if (op != "QuantizeLinear" && op != "DequantizeLinear") continue;

    // Rule 3: scale is a positive finite FP32 constant.
    const onnx::TensorProto* scale = n.input_size() > 1 && init.count(n.input(1)) ? init.at(n.input(1)) : nullptr;
    if (!scale) {
      fail(3, n.name(), "scale is not an initializer");
    } else {
      if (scale->data_type() != onnx::TensorProto::FLOAT) fail(3, n.name(), "scale is not FP32");
      for (double s : initializer_values(*scale))
        if (!(s > 0) || !std::isfinite(s))
          fail(3, n.name(), "scale " + std::to_string(s) + " is not positive and finite");
    }
    // Rule 2: zero point present, INT8, all zeros.
    const onnx::TensorProto* zp = n.input_size() > 2 && init.count(n.input(2)) ? init.at(n.input(2)) : nullptr;
    if (!zp) {
      fail(2, n.name(), "zero point missing");
    } else {
      if (zp->data_type() != onnx::TensorProto::INT8)
        fail(zp->data_type() == onnx::TensorProto::UINT8 ? 1 : 2, n.name(), "zero point is not INT8");
      for (double z : initializer_values(*zp))
        if (z != 0) fail(2, n.name(), "zero point " + std::to_string(z) + " is not 0 (asymmetric)");
    }
    const bool per_channel = scale && numel(*scale) > 1;
    if (op == "QuantizeLinear") {
      const onnx::TensorProto* weight = init.count(n.input(0)) ? init.at(n.input(0)) : nullptr;
      // Rule 4: per-channel scales only for weights.
      if (per_channel && !weight) fail(4, n.name(), "per-channel scale on an activation");
      // Rule 5: explicit axis, and one scale per element of that axis.
      if (per_channel) {
        const onnx::AttributeProto* axis = find_attribute(n, "axis");
        if (!axis) {
          fail(5, n.name(), "per-channel QuantizeLinear without an explicit axis");
        } else if (weight) {
          int64_t a = axis->i() < 0 ? axis->i() + weight->dims_size() : axis->i();
          if (a < 0 || a >= weight->dims_size() || weight->dims(static_cast<int>(a)) != numel(*scale))
            fail(5, n.name(),
                 "axis " + std::to_string(axis->i()) + " does not match " + std::to_string(numel(*scale)) + " scales");
          // The consumer decides the right axis: MatMul B [in, out] -> 1, Gemm transB=1 B [out, in] -> 0.
          const auto& dq = consumers[n.output(0)];
          if (dq.size() == 1)
            for (const onnx::NodeProto* user : consumers[dq[0]->output(0)]) {
              int64_t want = -1;
              if (user->op_type() == "MatMul" && user->input(1) == dq[0]->output(0)) want = 1;
              if (user->op_type() == "Gemm" && user->input(1) == dq[0]->output(0)) {
                const onnx::AttributeProto* tb = find_attribute(*user, "transB");
                want = tb && tb->i() == 1 ? 0 : 1;
              }
              if (want >= 0 && a != want)
                fail(5, n.name(),
                     "axis " + std::to_string(a) + " but " + user->op_type() + " needs " + std::to_string(want));
            }
        }
      }
      // Rule 7: weights go FP32 initializer -> Q -> DQ -> MatMul/Gemm; narrow range keeps Q above -128.
      if (weight) {
        if (weight->data_type() != onnx::TensorProto::FLOAT) fail(7, n.name(), "weight initializer is not FP32");
        if (scale) {
          const std::vector<double> w = initializer_values(*weight), s = initializer_values(*scale);
          const onnx::AttributeProto* axis = find_attribute(n, "axis");
          const int64_t a = axis ? (axis->i() < 0 ? axis->i() + weight->dims_size() : axis->i()) : 1;
          int64_t inner = 1;
          for (int i = static_cast<int>(a) + 1; i < weight->dims_size(); ++i) inner *= weight->dims(i);
          const int64_t channels = static_cast<int64_t>(s.size());
          for (size_t i = 0; i < w.size(); ++i) {
            const double si = s.size() == 1 ? s[0] : s[(static_cast<int64_t>(i) / inner) % channels];
            if (std::nearbyint(w[i] / si) < -127) {
              fail(9, n.name(), "a weight quantizes to -128: clamp weights to [-127 s, 127 s] before export");
              break;
            }
          }
        }
      }
      // Rule 10: every QuantizeLinear is followed by DequantizeLinear (a lone Q is the QOperator form).
      for (const onnx::NodeProto* user : consumers[n.output(0)])
        if (user->op_type() != "DequantizeLinear")
          fail(10, n.name(), "QuantizeLinear feeds " + user->op_type() + ", not DequantizeLinear");
    } else {  // DequantizeLinear
      // Rule 10: one consumer after each DQ; its Q feeds only it.
      if (consumers[n.output(0)].size() != 1)
        fail(10, n.name(), std::to_string(consumers[n.output(0)].size()) + " consumers of one DequantizeLinear");
      auto it = producer.find(n.input(0));
      if (it != producer.end() && it->second->op_type() == "QuantizeLinear") {
        if (consumers[n.input(0)].size() != 1)
          fail(10, it->second->name(), "QuantizeLinear shared by several DequantizeLinear");
        if (init.count(it->second->input(0)))  // a weight pair: DQ must feed MatMul/Gemm
          for (const onnx::NodeProto* user : consumers[n.output(0)])
            if (user->op_type() != "MatMul" && user->op_type() != "Gemm")
              fail(7, n.name(), "weight DequantizeLinear feeds " + user->op_type() + ", not MatMul/Gemm");
      }
      const onnx::NodeProto* q =
          it != producer.end() && it->second->op_type() == "QuantizeLinear" ? it->second : nullptr;
      const onnx::TensorProto* weight = q && init.count(q->input(0)) ? init.at(q->input(0)) : nullptr;
      if (q) {  // Rule 10: the two halves of a pair agree on scale and zero point.
        auto constant = [&init](const onnx::NodeProto* node, int i) -> std::vector<double> {
          return node->input_size() > i && init.count(node->input(i)) ? initializer_values(*init.at(node->input(i)))
                                                                      : std::vector<double>{};
        };
        if (constant(q, 1) != constant(&n, 1)) fail(10, n.name(), "scale differs from its QuantizeLinear's");
        if (constant(q, 2) != constant(&n, 2)) fail(10, n.name(), "zero point differs from its QuantizeLinear's");
      }
      // Rule 4: per-channel only for weights; rule 5: an explicit axis that matches the weight and its Q.
      if (per_channel && q && !weight) fail(4, n.name(), "per-channel scale on an activation");
      if (per_channel) {
        const onnx::AttributeProto* axis = find_attribute(n, "axis");
        if (!axis) {
          fail(5, n.name(), "per-channel DequantizeLinear without an explicit axis");
        } else if (weight) {
          const int64_t a = axis->i() < 0 ? axis->i() + weight->dims_size() : axis->i();
          if (a < 0 || a >= weight->dims_size() || weight->dims(static_cast<int>(a)) != numel(*scale))
            fail(5, n.name(),
                 "axis " + std::to_string(axis->i()) + " does not match " + std::to_string(numel(*scale)) + " scales");
          const onnx::AttributeProto* q_axis = find_attribute(*q, "axis");
          const int64_t qa = q_axis ? (q_axis->i() < 0 ? q_axis->i() + weight->dims_size() : q_axis->i()) : 1;
          if (q_axis && a != qa)
            fail(5, n.name(), "axis " + std::to_string(a) + " differs from its QuantizeLinear's " + std::to_string(qa));
        }
      }
    }
  }
  return v;
}

std::string describe(const std::vector<RuleViolation>& violations) {
  std::string s;
  for (const auto& r : violations) s += "  rule " + std::to_string(r.rule) + " at " + r.node + ": " + r.message + "\n";
  return s;
}

}  // namespace bert::exporter
