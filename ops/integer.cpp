// INT8 inference ops on the CPU: integer linears (static and dynamic activation scales), integer
// products of two activations, and integer self-attention, all on kernels/int8_gemm. Forward only.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>
#include "core/source_location.h"

#include "kernels/gemm.h"
#include "kernels/int8_gemm.h"
#include "kernels/vector_math.h"
#include "ops/ops.h"
#if BERT_WITH_CUDA
#include "ops/cuda_impl.h"
#endif
#include "sys/parallel.h"

namespace bert::ops {

namespace {

// The checks every integer op makes: CPU, and no gradient recorded.
void check_inference(const Graph<float>& g, const std::string& op) {
  BERT_CHECK(!g.on_cuda(), op + ": integer inference runs on the CPU");
  BERT_CHECK(!g.grad_enabled(), op + " has no gradient: run it under NoGradGuard (inference only)");
}

// The checks every integer linear makes, then its output (.., out). op: the public op's name, for
// errors; made_by: the same, for an OpProfile.
Var emit_integer_linear(Graph<float>& g, Var x, const Int8Weights& weights, std::span<const float> scale_w, Var bias,
                        const std::string& op, SourceLocation made_by) {
  check_inference(g, op);
  const Shape& xs = g.shape(x);
  BERT_CHECK(xs.rank() >= 1 && xs[-1] == weights.k(),
             op + ": x " + xs.str() + " does not fit " + std::to_string(weights.k()) + " inputs");
  BERT_CHECK(static_cast<int64_t>(scale_w.size()) == weights.n(), op + ": one weight scale per output");
  if (bias.valid()) BERT_CHECK(g.shape(bias) == Shape({weights.n()}), op + " bias " + g.shape(bias).str());
  return bias.valid() ? g.emit(xs.with_last(weights.n()), {x, bias}, made_by)
                      : g.emit(xs.with_last(weights.n()), {x}, made_by);
}

Var integer_linear(Graph<float>& g, Var x, const Int8Weights& weights, float scale_x, std::span<const float> scale_w,
                   Var bias, Int8Finish finish, const char* op, SourceLocation made_by) {
  Var y = emit_integer_linear(g, x, weights, scale_w, bias, op, made_by);
  BERT_CHECK(scale_x > 0, std::string(op) + ": the input scale must be positive");
  const int64_t rows = g.shape(x).rows();
  uint8_t* quantized = g.scratch<uint8_t>(rows * int8_row_bytes(weights.k()));  // reused every step
  quantize_activations(g.value(x).data(), rows, weights.k(), scale_x, quantized);
  bert::int8_linear(rows, quantized, weights, scale_x, scale_w.data(), bias.valid() ? g.value(bias).data() : nullptr,
                    g.value(y).data(), weights.n(), Int8Kernel::kAuto, finish);
  return y;
}

}  // namespace

Var int8_linear(Graph<float>& g, Var x, const Int8Weights& weights, float scale_x, std::span<const float> scale_w,
                Var bias) {
  return integer_linear(g, x, weights, scale_x, scale_w, bias, Int8Finish::kNone, "int8_linear",
                        SourceLocation::current());
}

Var int8_linear_gelu(Graph<float>& g, Var x, const Int8Weights& weights, float scale_x, std::span<const float> scale_w,
                     Var bias) {
  return integer_linear(g, x, weights, scale_x, scale_w, bias, Int8Finish::kGelu, "int8_linear_gelu",
                        SourceLocation::current());
}

Var exact_quantized_linear(Graph<float>& g, Var x, float scale_x, Var weight, std::span<const float> scale_w, Var bias,
                           bool gelu) {
  const char* op = gelu ? "exact_quantized_linear (gelu)" : "exact_quantized_linear";
  BERT_CHECK(!g.grad_enabled(), std::string(op) + " has no gradient: run it under NoGradGuard (inference only)");
  const Shape &xs = g.shape(x), &ws = g.shape(weight);
  BERT_CHECK(ws.rank() == 2 && xs.rank() >= 1 && xs[-1] == ws[1],
             std::string(op) + ": x " + xs.str() + " does not fit the weight " + ws.str());
  const int64_t n = ws[0], k = ws[1], rows = xs.rows();
  BERT_CHECK(static_cast<int64_t>(scale_w.size()) == n, std::string(op) + ": one weight scale per output");
  BERT_CHECK(scale_x > 0, std::string(op) + ": the input scale must be positive");
  if (bias.valid()) BERT_CHECK(g.shape(bias) == Shape({n}), std::string(op) + " bias " + g.shape(bias).str());
#if BERT_WITH_CUDA
  if (g.on_cuda()) return cuda_impl::exact_quantized_linear(g, x, scale_x, weight, scale_w, bias, gelu);
#endif
  Var y = bias.valid() ? g.emit(xs.with_last(n), {x, weight, bias}) : g.emit(xs.with_last(n), {x, weight});
  // The integers behind the fake-quantized values (each value is q * scale rounded to float: dividing and
  // rounding to the nearest integer gives q back), clamped as int8_linear's quantization clamps.
  float* a = g.scratch<float>(rows * k);
  float* b = g.scratch<float>(n * k);
  const float* xv = g.value(x).data();
  const float* wv = g.value(weight).data();
  parallel_for(rows, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo * k; i < hi * k; ++i) a[i] = std::clamp(std::nearbyint(xv[i] / scale_x), -128.0f, 127.0f);
  });
  parallel_for(n, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c)
      for (int64_t i = 0; i < k; ++i)
        b[c * k + i] = std::clamp(std::nearbyint(wv[c * k + i] / scale_w[c]), -128.0f, 127.0f);
  });
  // Every partial sum of up to kExactDepth products (|a b| <= 2^14) is an integer below 2^24 in magnitude:
  // FP32 holds it exactly, whatever the GEMM's order. Deeper products (BERT-base's second FFN linear,
  // 3,072 inputs) run in slices of kExactDepth whose sums are added in int32, as int8_linear adds; either
  // way the sum then rounds to float once, as int8_linear's epilogue rounds it. The integers are BF16
  // values too (8 significant bits), so where the CPU has AMX the products run on its BF16 tiles, which sum
  // in FP32: the same sums, faster than the FP32 kernel (elsewhere the FP32 kernel: on Intel's cores without
  // AMX, vdpbf16ps runs slower than it).
  constexpr int64_t kExactDepth = 1024;
  const bool bf16 = bf16_products() == Bf16Products::kAmx;
  float* yv = g.value(y).data();
  const float* bv = bias.valid() ? g.value(bias).data() : nullptr;
  // The epilogue, y = sum x scale_x x scale_w + bias (one rounding, as int8_linear's), then the GELU, on a
  // block of y while it is in cache.
  const GemmFinish finish = [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = yv + r * n;
      for (int64_t c = c0; c < c1; ++c) row[c] = std::fma(row[c], scale_x * scale_w[c], bv ? bv[c] : 0.0f);
      if (gelu) vec::gelu(row + c0, row + c0, c1 - c0);
    }
  };
  if (k <= kExactDepth) {
    gemm<float>({.trans_a = false, .trans_b = true, .m = rows, .n = n, .k = k, .bf16 = bf16}, 1.0f, a, k, b, k, 0.0f,
                yv, n, CpuKernels::kAuto, nullptr, &finish);
    return y;
  }
  int32_t* sums = g.scratch<int32_t>(rows * n);
  for (int64_t first = 0; first < k; first += kExactDepth) {
    const int64_t depth = std::min(kExactDepth, k - first);
    gemm<float>({.trans_a = false, .trans_b = true, .m = rows, .n = n, .k = depth, .bf16 = bf16}, 1.0f, a + first, k,
                b + first, k, 0.0f, yv, n);
    parallel_for(rows, 16, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo * n; i < hi * n; ++i) sums[i] = (first == 0 ? 0 : sums[i]) + static_cast<int32_t>(yv[i]);
    });
  }
  parallel_for(rows, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo * n; i < hi * n; ++i) yv[i] = static_cast<float>(sums[i]);
    finish(lo, hi, 0, n);
  });
  return y;
}

DeviceInt8Weights::DeviceInt8Weights(const Device& device, const int8_t* weights, std::span<const float> scales,
                                     std::span<const float> bias, int64_t n, int64_t k)
    : device_(&device), n_(n), k_(k), ld_(row_bytes(k)) {
  BERT_CHECK(n > 0 && k > 0, "DeviceInt8Weights: empty weights");
  BERT_CHECK(static_cast<int64_t>(scales.size()) == n, "DeviceInt8Weights: " + std::to_string(scales.size()) +
                                                           " weight scales for " + std::to_string(n) + " outputs");
  BERT_CHECK(bias.empty() || static_cast<int64_t>(bias.size()) == n,
             "DeviceInt8Weights: " + std::to_string(bias.size()) + " biases for " + std::to_string(n) + " outputs");
  std::vector<int8_t> padded(static_cast<size_t>(n * ld_), 0);
  for (int64_t c = 0; c < n; ++c) std::copy(weights + c * k, weights + (c + 1) * k, padded.begin() + c * ld_);
  buffer_ = DeviceBuffer(device, padded.size());
  device.copy_to_device(buffer_.data(), padded.data(), padded.size());
  const std::vector<float> zeros(bias.empty() ? static_cast<size_t>(n) : 0, 0.0f);
  const std::span<const float> b = bias.empty() ? std::span<const float>(zeros) : bias;
  scales_ = DeviceBuffer(device, static_cast<size_t>(n) * sizeof(float));
  device.copy_to_device(scales_.data(), scales.data(), scales_.bytes());
  bias_ = DeviceBuffer(device, static_cast<size_t>(n) * sizeof(float));
  device.copy_to_device(bias_.data(), b.data(), bias_.bytes());
#if BERT_WITH_CUDA
  encode_ = cuda_impl::int8_weights_tensor_map(device, data(), n_, ld_, map_.data());
#endif
}

DeviceGeluTable::DeviceGeluTable(const Device& device, float scale) : scale_(scale) {
  BERT_CHECK(device.is_cuda(), "DeviceGeluTable: a GPU's table (the CPU's integer GELU computes its values)");
  BERT_CHECK(scale > 0 && std::isnormal(1.0f / scale),
             "DeviceGeluTable: the scale must be positive with a normal reciprocal, got " + std::to_string(scale));
#if BERT_WITH_CUDA
  buffer_ = DeviceBuffer(device, 65536);
  cuda_impl::int8_gelu_table(device, buffer_.as<int8_t>(), scale);
#endif
}

namespace {
// The checks the GPU integer linears share: op names the op in the message.
void check_device_linear(const Graph<float>& g, Var x, const DeviceInt8Weights& weights, float scale_x,
                         const std::string& op) {
  BERT_CHECK(g.on_cuda() && &g.device() == &weights.device(),
             op + ": the weights are on another device than the graph");
  BERT_CHECK(!g.grad_enabled(), op + " has no gradient: run it under NoGradGuard (inference only)");
  const Shape& xs = g.shape(x);
  BERT_CHECK(xs.rank() >= 1 && xs[-1] == weights.k(),
             op + ": x " + xs.str() + " does not fit " + std::to_string(weights.k()) + " inputs");
  BERT_CHECK(scale_x > 0, op + ": the input scale must be positive");
}
}  // namespace

Var int8_linear(Graph<float>& g, Var x, const DeviceInt8Weights& weights, float scale_x, bool gelu,
                DeviceInt8Gemm gemm) {
  check_device_linear(g, x, weights, scale_x, gelu ? "int8_linear (gelu, GPU)" : "int8_linear (GPU)");
#if BERT_WITH_CUDA
  const Int8OutputPart whole{weights.n(), 0.0f};
  return cuda_impl::int8_linear(g, x, weights, scale_x, gelu, std::span<const Int8OutputPart>(&whole, 1),
                                /*integers=*/false, gemm)[0];
#else
  (void)gemm;
  throw InternalError("int8_linear (GPU): this build has no CUDA support");
#endif
}

std::vector<Var> int8_linear_quantized(Graph<float>& g, Var x, const DeviceInt8Weights& weights, float scale_x,
                                       bool gelu, std::span<const Int8OutputPart> parts, bool integers,
                                       DeviceInt8Gemm gemm) {
  const std::string op = "int8_linear_quantized";
  check_device_linear(g, x, weights, scale_x, op);
  int64_t columns = 0;
  for (const Int8OutputPart& p : parts) {
    BERT_CHECK(p.columns > 0 && (p.scale == 0 || (p.scale > 0 && std::isnormal(1.0f / p.scale))),
               op + ": a part needs columns and a scale whose reciprocal is a normal float (0: not quantized)");
    BERT_CHECK(!integers || p.scale > 0, op + ": int8 outputs need every part quantized (a positive scale)");
    columns += p.columns;
  }
  BERT_CHECK(!parts.empty() && parts.size() <= 3 && columns == weights.n(),
             op + ": 1 to 3 parts of the " + std::to_string(weights.n()) + " outputs, " + std::to_string(parts.size()) +
                 " parts of " + std::to_string(columns) + " given");
#if BERT_WITH_CUDA
  return cuda_impl::int8_linear(g, x, weights, scale_x, gelu, parts, integers, gemm);
#else
  (void)gelu, (void)gemm;
  throw InternalError(op + ": this build has no CUDA support");
#endif
}

Var int8_linear_dynamic(Graph<float>& g, Var x, const Int8Weights& weights, std::span<const float> scale_w, Var bias) {
  Var y = emit_integer_linear(g, x, weights, scale_w, bias, "int8_linear_dynamic", SourceLocation::current());
  const int64_t rows = g.shape(x).rows();
  uint8_t* quantized = g.scratch<uint8_t>(rows * int8_row_bytes(weights.k()));
  float* row_scales = g.scratch<float>(rows);
  quantize_activations_per_row(g.value(x).data(), rows, weights.k(), row_scales, quantized);
  bert::int8_linear_per_row(rows, quantized, row_scales, weights, scale_w.data(),
                            bias.valid() ? g.value(bias).data() : nullptr, g.value(y).data(), weights.n());
  return y;
}

Var int8_matmul(Graph<float>& g, Var a, Var b, float scale_a, float scale_b, double alpha, bool trans_b) {
  check_inference(g, "int8_matmul");
  BERT_CHECK(scale_a > 0 && scale_b > 0, "int8_matmul: the scales must be positive");
  const Shape &as = g.shape(a), &bs = g.shape(b);
  BERT_CHECK(as.rank() >= 2 && as.rank() == bs.rank(), "int8_matmul of " + as.str() + " and " + bs.str());
  for (int i = 0; i + 2 < as.rank(); ++i)
    BERT_CHECK(as[i] == bs[i], "int8_matmul: batch axes of " + as.str() + " and " + bs.str() + " differ");
  const int64_t m = as[-2], k = as[-1], n = trans_b ? bs[-2] : bs[-1];
  BERT_CHECK((trans_b ? bs[-1] : bs[-2]) == k, "int8_matmul: inner sizes of " + as.str() + " and " + bs.str());
  const int64_t batch = m * k > 0 ? as.numel() / (m * k) : 0;
  Var y = g.emit(as.with_last(n), {a, b});
  const float* av = g.value(a).data();
  const float* bv = g.value(b).data();
  float* yv = g.value(y).data();
  // a quantized in one pass as unsigned rows; then each product on one thread (int8_linear runs
  // serially inside), b quantized and packed as weights. b's scale and alpha go in the per-channel
  // scales, a's is the activation scale.
  const int64_t row = int8_row_bytes(k);
  uint8_t* qa = g.scratch<uint8_t>(batch * m * row);
  quantize_activations(av, batch * m, k, scale_a, qa);
  const std::vector<float> scales(n, static_cast<float>(scale_b * alpha));
  parallel_for(batch, 1, [&](int64_t lo, int64_t hi) {
    Int8Weights packed;
    for (int64_t item = lo; item < hi; ++item) {
      // b as (N, K) when trans_b, else (K, N): weight (c, i) at c * K + i, or at i * N + c.
      packed.quantize_pack(bv + item * k * n, n, k, trans_b ? k : 1, trans_b ? 1 : n, scale_b);
      bert::int8_linear(m, qa + item * m * row, packed, scale_a, scales.data(), nullptr, yv + item * m * n, n);
    }
  });
  return y;
}

namespace {

// Integer self-attention over Q, K, V rows `ld` floats apart (H * D when separate, 3 * H * D when side by
// side in one tensor), into y (B, T, H * D). The checks are the callers'.
void attention_heads(const float* qv, const float* kv, const float* vv, int64_t ld, const float* mv, int64_t batch,
                     int64_t t, int64_t heads, int64_t d, const Int8AttentionScales& scales, double alpha, float* yv) {
  const int64_t width = heads * d;
  // The scales exactly as int8_matmul forms them: the second operand's scale times alpha, per channel.
  const std::vector<float> score_scales(t, static_cast<float>(scales.k * alpha));
  const std::vector<float> value_scales(d, scales.v);
  const int64_t row_t = int8_row_bytes(t), row_d = int8_row_bytes(d);
  // One task per (sequence, head): its operands quantized and packed, the T x T scores, softmax and the
  // quantized probabilities stay in this thread's cache; the context goes straight into (B, T, H * D).
  parallel_for(batch * heads, 1, [&](int64_t lo, int64_t hi) {
    Int8Weights keys, values;
    std::vector<uint8_t> queries(t * row_d), probs(t * row_t);
    std::vector<float> scores(t * t), probs_row(t);
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t b = item / heads, h = item % heads;
      const int64_t at = b * t * ld + h * d;  // the head's first value in each operand
      quantize_activations(qv + at, t, d, ld, scales.q, queries.data());
      keys.quantize_pack(kv + at, t, d, ld, 1, scales.k);    // (T keys, D)
      values.quantize_pack(vv + at, d, t, 1, ld, scales.v);  // (D, T tokens): V transposed
      bert::int8_linear(t, queries.data(), keys, scales.q, score_scales.data(), nullptr, scores.data(), t);
      for (int64_t r = 0; r < t; ++r) {
        vec::softmax(scores.data() + r * t, mv ? mv + b * t : nullptr, probs_row.data(), t);
        quantize_activations(probs_row.data(), 1, t, scales.probs, probs.data() + r * row_t);
      }
      bert::int8_linear(t, probs.data(), values, scales.probs, value_scales.data(), nullptr, yv + b * t * width + h * d,
                        width);
    }
  });
}

// The checks both entries make; the mask's values (null: none).
const float* check_attention(const Graph<float>& g, const Shape& xs, int64_t width, Var mask, int64_t heads,
                             const Int8AttentionScales& scales, const std::string& op) {
  check_inference(g, op);
  BERT_CHECK(scales.q > 0 && scales.k > 0 && scales.v > 0 && scales.probs > 0, op + ": the scales must be positive");
  BERT_CHECK(heads > 0 && width % heads == 0,
             op + ": " + std::to_string(width) + " channels do not split into " + std::to_string(heads) + " heads");
  if (!mask.valid()) return nullptr;
  BERT_CHECK(g.shape(mask) == Shape({xs[0], xs[1]}),
             op + ": mask " + g.shape(mask).str() + " must be (B, T) for " + xs.str());
  return g.value(mask).data();
}

}  // namespace

Var int8_attention(Graph<float>& g, Var q, Var k, Var v, Var mask, int64_t heads, const Int8AttentionScales& scales,
                   double alpha) {
  const Shape& qs = g.shape(q);
  BERT_CHECK(qs.rank() == 3 && g.shape(k) == qs && g.shape(v) == qs,
             "int8_attention: q, k, v must be one (B, T, C) shape, got " + qs.str() + ", " + g.shape(k).str() + ", " +
                 g.shape(v).str());
  const float* mv = check_attention(g, qs, qs[2], mask, heads, scales, "int8_attention");
  Var y = g.emit(qs, {q, k, v});
  attention_heads(g.value(q).data(), g.value(k).data(), g.value(v).data(), qs[2], mv, qs[0], qs[1], heads,
                  qs[2] / heads, scales, alpha, g.value(y).data());
  return y;
}

Var int8_attention_packed(Graph<float>& g, Var qkv, Var mask, int64_t heads, const Int8AttentionScales& scales,
                          double alpha) {
  const Shape& xs = g.shape(qkv);
  BERT_CHECK(xs.rank() == 3 && xs[2] % 3 == 0, "int8_attention_packed: qkv must be (B, T, 3 C), got " + xs.str());
  const int64_t width = xs[2] / 3;
  const float* mv = check_attention(g, xs, width, mask, heads, scales, "int8_attention_packed");
  Var y = g.emit(xs.with_last(width), {qkv});
  const float* base = g.value(qkv).data();
  attention_heads(base, base + width, base + 2 * width, xs[2], mv, xs[0], xs[1], heads, width / heads, scales, alpha,
                  g.value(y).data());
  return y;
}

Var int8_attention_integers(Graph<float>& g, Var q, Var k, Var v, Var mask, int64_t heads,
                            const Int8AttentionScales& scales, double alpha, float out_scale) {
  const std::string op = "int8_attention_integers";
  BERT_CHECK(g.on_cuda(), op + ": runs on a CUDA device (on the CPU: int8_attention)");
  BERT_CHECK(!g.grad_enabled(), op + " has no gradient: run it under NoGradGuard (inference only)");
  const Shape& qs = g.shape(q);
  BERT_CHECK(qs.rank() == 3 && g.shape(k) == qs && g.shape(v) == qs,
             op + ": q, k, v must be one (B, T, C) shape, got " + qs.str() + ", " + g.shape(k).str() + ", " +
                 g.shape(v).str());
  BERT_CHECK(g.dtype(q) == DType::kS8 && g.dtype(k) == DType::kS8 && g.dtype(v) == DType::kS8,
             op + ": q, k and v must be int8 (their quantizers' integers)");
  auto usable = [](float s) { return s > 0 && std::isnormal(1.0f / s); };
  BERT_CHECK(usable(scales.q) && usable(scales.k) && usable(scales.v) && usable(scales.probs),
             op + ": the scales must be positive, with normal reciprocals");
  BERT_CHECK(out_scale == 0 || usable(out_scale), op + ": out_scale must be 0 (values) or positive");
  BERT_CHECK(heads > 0 && qs[2] % heads == 0,
             op + ": " + std::to_string(qs[2]) + " channels do not split into " + std::to_string(heads) + " heads");
  BERT_CHECK(int8_attention_fits(g, qs[2] / heads, qs[1]),
             op + ": head size " + std::to_string(qs[2] / heads) + " and length " + std::to_string(qs[1]) +
                 " are outside the kernel (head size 32, 64 or 128, length up to 512, compute capability 8.0+)");
  if (mask.valid())
    BERT_CHECK(g.shape(mask) == Shape({qs[0], qs[1]}) && g.dtype(mask) == DType::kF32,
               op + ": mask " + g.shape(mask).str() + " must be (B, T) FP32 for " + qs.str());
#if BERT_WITH_CUDA
  return cuda_impl::int8_attention(g, q, k, v, mask, heads, scales, alpha, out_scale);
#else
  (void)alpha;
  throw InternalError(op + ": this build has no CUDA support");
#endif
}

bool int8_attention_fits(const Graph<float>& g, int64_t head_size, int64_t length) {
#if BERT_WITH_CUDA
  return g.on_cuda() && cuda_impl::int8_attention_fits(g, head_size, length);
#else
  (void)g, (void)head_size, (void)length;
  return false;
#endif
}

}  // namespace bert::ops
