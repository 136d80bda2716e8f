// matmul and linear on a CUDA device: cuBLAS GEMMs (FP32, TF32 tensor cores, or BF16 tensor cores
// with FP32 accumulation, as the device's precision says), forward and backward side by side like
// ops/matmul.cpp.
#include <cublasLt.h>

#include "core/cuda/lt_plans.h"
#include "ops/cuda/column_sums.cuh"
#include "ops/cuda/common.cuh"
#include "ops/cuda/cross_entropy.cuh"
#include "ops/cuda/gemm.cuh"
#include "ops/cuda_impl.h"

namespace bert::ops::cuda_impl {

using cuda::bf16;
using cuda::compute_type;

namespace {

// One column-major cuBLASLt product D (m, n) = alpha op(A) op(B) + beta C (C = D) with an epilogue: A stored
// (trans_a ? k x m : m x k), B (trans_b ? n x k : k x n), both of type ab, D of type d; `vector` is the
// epilogue's bias (added, of D's type). `batch` such products with A, B, D and the bias at the given strides
// (elements; 0: the same for every item). Returns false when cuBLASLt has no algorithm for it (the caller
// then does without the epilogue).
struct LtProduct {
  bool trans_a, trans_b;
  int64_t m, n, k;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  void* d;
  int64_t ldd;
  cudaDataType_t ab, dt;
  float beta;
  cublasLtEpilogue_t epilogue;
  void* vector;
  cudaDataType_t vector_type;
  int64_t batch = 1, stride_a = 0, stride_b = 0, stride_d = 0, vector_stride = 0;
  float alpha = 1.0f;
  void* aux = nullptr;  // the GELU epilogues' auxiliary matrix (the pre-activation), of D's type, aux_ld apart
  int64_t aux_ld = 0;
};
// Candidates asked of the heuristic for a product (core/cuda/lt_plans.h: the first run tunes among them).
constexpr int kLtCandidates = LtPlan::kMaxCandidates;

// The plan for p's shape: made (descriptors, the heuristic's candidates) at its first use, then kept
// by the context.
LtPlan& lt_plan(const CudaContext& c, cublasComputeType_t compute, const LtProduct& p) {
  const LtPlans::Key key = {
      p.trans_a,  p.trans_b,     p.m,     p.n,     p.k,        p.lda,      p.ldb,      p.ldd,           p.ab,    p.dt,
      p.epilogue, p.vector_type, compute, p.batch, p.stride_a, p.stride_b, p.stride_d, p.vector_stride, p.aux_ld};
  const auto [it, made] = c.lt_plans->plans.try_emplace(key);
  LtPlan& plan = it->second;
  if (!made) return plan;
  auto lt = reinterpret_cast<cublasLtHandle_t>(c.cublas_lt);
  BERT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.desc, compute, CUDA_R_32F));
  const cublasOperation_t op_a = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  BERT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
  BERT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b));
  BERT_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &p.epilogue, sizeof p.epilogue));
  BERT_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.vector, sizeof p.vector));
  BERT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &p.vector_type,
                                                   sizeof p.vector_type));
  if (p.aux) {  // the heuristic reads the pointer's alignment
    BERT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &p.aux, sizeof p.aux));
    BERT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &p.aux_ld, sizeof p.aux_ld));
  }
  BERT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.a, p.ab, uint64_t(p.trans_a ? p.k : p.m),
                                               uint64_t(p.trans_a ? p.m : p.k), p.lda));
  BERT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.b, p.ab, uint64_t(p.trans_b ? p.n : p.k),
                                               uint64_t(p.trans_b ? p.k : p.n), p.ldb));
  BERT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.d, p.dt, uint64_t(p.m), uint64_t(p.n), p.ldd));
  if (p.batch > 1) {
    const int32_t count = int32_t(p.batch);
    const std::array<std::pair<cublasLtMatrixLayout_t, int64_t>, 3> layouts = {
        {{plan.a, p.stride_a}, {plan.b, p.stride_b}, {plan.d, p.stride_d}}};
    for (const auto& [layout, stride] : layouts) {
      BERT_CUBLAS_CHECK(
          cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
      BERT_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                         sizeof stride));
    }
    BERT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE,
                                                     &p.vector_stride, sizeof p.vector_stride));
  }
  cublasLtMatmulPreference_t preference = nullptr;
  BERT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
  BERT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                         &c.cublas_workspace_bytes, sizeof c.cublas_workspace_bytes));
  std::array<cublasLtMatmulHeuristicResult_t, kLtCandidates> heuristic{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(lt, plan.desc, plan.a, plan.b, plan.d, plan.d,
                                                               preference, kLtCandidates, heuristic.data(), &found);
  cublasLtMatmulPreferenceDestroy(preference);
  plan.found = status == CUBLAS_STATUS_SUCCESS && found > 0;
  if (!plan.found) return plan;
  plan.algo = heuristic[0].algo;
  const int wanted = c.lt_plans->tune ? LtPlan::kMaxCandidates : 1;
  for (int i = 0; i < found && plan.candidate_count < wanted; ++i)
    if (heuristic[i].state == CUBLAS_STATUS_SUCCESS) plan.candidates[plan.candidate_count++] = heuristic[i].algo;
  return plan;
}

// Bytes of one element of D.
std::size_t element_bytes(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_16BF:
    case CUDA_R_16F:
      return 2;
    case CUDA_R_32F:
    case CUDA_R_32I:
      return 4;
    default:
      BERT_CHECK(false, "cuBLASLt product: unexpected output type");
  }
  return 0;
}

bool lt_product(const Graph<float>& g, const LtProduct& p) {
  const CudaContext& c = cuda::context(g.device());
  LtPlan& plan = lt_plan(c, compute_type(g, p.ab), p);
  if (!plan.found) return false;
  BERT_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.vector, sizeof p.vector));
  if (p.aux)
    BERT_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &p.aux, sizeof p.aux));
  if (plan.candidate_count > 0) {  // its first run outside a recording: the candidates timed (lt_plans.h)
    // Elements from an operand's first to its last: `rows` x `cols` column-major, batch items `stride` apart.
    auto extent = [&](int64_t rows, int64_t cols, int64_t ld, int64_t stride, cudaDataType_t type) {
      return LtExtent{std::size_t((p.batch - 1) * stride + (cols - 1) * ld + rows), int(element_bytes(type))};
    };
    tune(c, plan,
         {double(p.m) * double(p.n) * double(p.k) * double(p.batch), &p.alpha, &p.beta,
          extent(p.trans_a ? p.k : p.m, p.trans_a ? p.m : p.k, p.lda, p.stride_a, p.ab),
          extent(p.trans_b ? p.n : p.k, p.trans_b ? p.k : p.n, p.ldb, p.stride_b, p.ab),
          extent(p.m, p.n, p.ldd, p.stride_d, p.dt)});
  }
  BERT_CUBLAS_CHECK(cublasLtMatmul(reinterpret_cast<cublasLtHandle_t>(c.cublas_lt), plan.desc, &p.alpha, p.a, plan.a,
                                   p.b, plan.b, &p.beta, p.d, plan.d, p.d, plan.d, &plan.algo, c.cublas_workspace,
                                   c.cublas_workspace_bytes, c.stream));
  return true;
}

}  // namespace

// cuBLAS is column-major, so it computes C^T = op(B)^T op(A)^T on the same memory: a cuBLASLt plan
// (tuned at its first run, core/cuda/lt_plans.h), or cuBLAS's own choice where cuBLASLt has none.
void gemm(const Graph<float>& g, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const void* a, int64_t lda, int64_t stride_a, const void* b, int64_t ldb, int64_t stride_b, float beta,
          void* c, int64_t ldc, int64_t stride_c, int64_t batch, cudaDataType_t ab, cudaDataType_t ct) {
  LtProduct p{trans_b, trans_a, n, m, k, b, ldb, a, lda, c, ldc, ab, ct, beta, CUBLASLT_EPILOGUE_DEFAULT, nullptr, ct};
  p.batch = batch, p.stride_a = stride_b, p.stride_b = stride_a, p.stride_d = stride_c, p.alpha = alpha;
  if (lt_product(g, p)) return;
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (batch == 1) {
    BERT_CUBLAS_CHECK(cublasGemmEx(cuda::cublas(g), op_b, op_a, int(n), int(m), int(k), &alpha, b, ab, int(ldb), a, ab,
                                   int(lda), &beta, c, ct, int(ldc), compute_type(g, ab), CUBLAS_GEMM_DEFAULT));
    return;
  }
  BERT_CUBLAS_CHECK(cublasGemmStridedBatchedEx(cuda::cublas(g), op_b, op_a, int(n), int(m), int(k), &alpha, b, ab,
                                               int(ldb), stride_b, a, ab, int(lda), stride_a, &beta, c, ct, int(ldc),
                                               stride_c, int(batch), compute_type(g, ab), CUBLAS_GEMM_DEFAULT));
}

// The bias is added in the GEMM's epilogue (cuBLASLt), so y is written once. Column-major view: y^T (out,
// rows) = W (out, in) x^T, the bias running along y^T's rows (the bias is of the output's type).
bool gemm_bias(const Graph<float>& g, int64_t rows, int64_t in, int64_t out, const void* x, const void* w,
               const void* bias, void* y, int64_t ldy, cudaDataType_t type, int64_t batch, int64_t w_stride,
               int64_t bias_stride, int64_t y_stride) {
  LtProduct p{true,
              false,
              out,
              rows,
              in,
              w,
              in,
              x,
              in,
              y,
              ldy,
              type,
              type,
              0.0f,
              CUBLASLT_EPILOGUE_BIAS,
              const_cast<void*>(bias),
              type};
  p.batch = batch, p.stride_a = w_stride, p.stride_d = y_stride, p.vector_stride = bias_stride;
  return lt_product(g, p);
}

namespace {

// out (rows, cols; rows ld apart) += bias (cols) broadcast over rows: blockIdx.y walks rows, x the columns.
template <typename A>
__global__ void add_row_vector(A* out, const float* bias, int64_t rows, int64_t cols, int64_t ld) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  const float b = bias[c];
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    out[r * ld + c] = cuda::from_float<A>(cuda::to_float(out[r * ld + c]) + b);
}
}  // namespace

void linear_product(const Graph<float>& g, int64_t rows, int64_t in, int64_t out, const void* x, const void* w,
                    const void* bias_gemm, const float* bias, int64_t bias_cols, void* y, int64_t ldy,
                    cudaDataType_t type) {
  if (bias_gemm && gemm_bias(g, rows, in, out, x, w, bias_gemm, y, ldy, type)) return;
  gemm(g, false, true, rows, out, in, 1.0f, x, in, 0, w, in, 0, 0.0f, y, ldy, 0, 1, type, type);
  if (!bias) return;
  const dim3 grid(static_cast<unsigned>((bias_cols + cuda::kThreads - 1) / cuda::kThreads),
                  static_cast<unsigned>(std::min<int64_t>(rows, 4096)));
  cuda::with_element_type(type == CUDA_R_16BF ? DType::kBF16 : DType::kF32, [&](auto tag) {
    using A = typename decltype(tag)::type;
    add_row_vector<A><<<grid, cuda::kThreads, 0, cuda::stream(g)>>>(static_cast<A*>(y), bias, rows, bias_cols, ldy);
  });
  BERT_CUDA_LAUNCHED();
}

namespace {

// y (padded_rows, cols) = x (rows, cols) converted to A, rows past `rows` zero: a parameter (weight,
// bias) as the GEMM's operand type, with the zero rows that pad its output width.
// W elements a thread (packs of 4 where every pointer allows; a pack across the end of x reads
// element by element).
template <int W, typename A>
__global__ void convert_padded(A* y, const float* x, int64_t rows, int64_t padded_rows, int64_t cols) {
  const int64_t n = rows * cols;
  BERT_GRID_STRIDE_PACKS(e, padded_rows * cols, W) {
    cuda::Pack<float, W> in{};
    if (e + W <= n)
      in = cuda::load_pack<W>(x + e);
    else
      for (int j = 0; j < W; ++j) in.v[j] = e + j < n ? x[e + j] : 0.0f;
    cuda::Pack<A, W> out;
    for (int j = 0; j < W; ++j) out.v[j] = cuda::from_float<A>(in.v[j]);
    cuda::store_pack<W>(y + e, out);
  }
}

}  // namespace

void add_column_sums(Graph<float>& g, const void* dy, DType dy_type, int64_t rows, int64_t cols, int64_t ld,
                     float* dbias, int parts, int64_t dy_part_stride, int64_t dbias_part_stride) {
  cuda::with_element_type(dy_type, [&](auto tag) {
    using A = typename decltype(tag)::type;
    const A* d = static_cast<const A*>(dy);
    const auto address = reinterpret_cast<uintptr_t>(d);
    auto fits = [&](int64_t w) {
      return cols % w == 0 && ld % w == 0 && dy_part_stride % w == 0 && address % (w * sizeof(A)) == 0;
    };
    cuda::launch_column_sums(g, rows, cols, dbias, parts, dbias_part_stride, fits, [&]<int W>() {
      return cuda::RowsOf<W, A>{d, ld, dy_part_stride};
    });
  });
}

template <typename A>
const A* gemm_operand(Graph<float>& g, Var v, int64_t rows, int64_t padded_rows, int64_t cols) {
  if (g.dtype(v) == DType::kBF16) {
    BERT_CHECK((std::is_same_v<A, bf16>), "a BF16 operand for an F32 GEMM");
    if (rows == padded_rows) return cuda::typed<A>(g.data(v));
    A* padded = g.scratch<A>(padded_rows * cols);
    cuda::copy_on_device(cuda::context(g.device()), padded, g.data(v), rows * cols * sizeof(A));
    cuda::fill_zero(cuda::context(g.device()), padded + rows * cols, (padded_rows - rows) * cols * sizeof(A));
    return padded;
  }
  if (std::is_same_v<A, float> && rows == padded_rows) return cuda::typed<A>(g.data(v));
  if (const void* copy = g.bf16_copy(v); copy && std::is_same_v<A, bf16>) {  // the arena's rounded copy
    if (rows == padded_rows) return static_cast<const A*>(copy);
    A* padded = g.scratch<A>(padded_rows * cols);
    cuda::copy_on_device(cuda::context(g.device()), padded, copy, rows * cols * sizeof(A));
    cuda::fill_zero(cuda::context(g.device()), padded + rows * cols, (padded_rows - rows) * cols * sizeof(A));
    return padded;
  }
  A* converted = g.scratch<A>(padded_rows * cols);
  const int64_t n = padded_rows * cols;
  BERT_LAUNCH_PACKED(convert_padded, n, cuda::packs_of_4(n, {converted, g.value(v).data()}), g, converted,
                     g.value(v).data(), rows, padded_rows, cols);
  return converted;
}
template const float* gemm_operand<float>(Graph<float>&, Var, int64_t, int64_t, int64_t);
template const bf16* gemm_operand<bf16>(Graph<float>&, Var, int64_t, int64_t, int64_t);

namespace {

template <typename A>
Var matmul_typed(Graph<float>& g, Var a, Var b, bool trans_a, bool trans_b, float alpha) {
  constexpr cudaDataType_t type = cuda::cuda_data_type<A>();
  const Shape as = g.shape(a), bs = g.shape(b);
  const int64_t lda = as[-1], ldb = bs[-1];
  const int64_t k = trans_b ? bs[-1] : bs[-2], n = trans_b ? bs[-2] : bs[-1];
  int64_t m, batch = 1, stride_a = 0, stride_b = 0;
  Shape out;
  if (bs.rank() == 2 && as.rank() > 2) {  // b shared by every row of a
    BERT_CHECK(!trans_a, "matmul with a shared 2-D b cannot transpose a");
    BERT_CHECK(as[-1] == k, "matmul inner sizes differ: " + as.str() + " x " + bs.str());
    m = as.rows();
    out = as.with_last(n);
  } else {
    BERT_CHECK(as.rank() == bs.rank(), "matmul ranks differ: " + as.str() + " x " + bs.str());
    for (int i = 0; i < as.rank() - 2; ++i)
      BERT_CHECK(as[i] == bs[i], "matmul batch axes differ: " + as.str() + " x " + bs.str());
    m = trans_a ? as[-1] : as[-2];
    BERT_CHECK((trans_a ? as[-2] : as[-1]) == k, "matmul inner sizes differ: " + as.str() + " x " + bs.str());
    batch = as.numel() / (as[-1] * as[-2]);
    stride_a = as[-1] * as[-2];
    stride_b = bs[-1] * bs[-2];
    out = as;
    out[-2] = m;
    out[-1] = n;
  }
  const int64_t stride_c = m * n;
  Var c = g.emit(out, {a, b}, g.dtype(a));
  gemm(g, trans_a, trans_b, m, n, k, alpha, g.data(a), lda, stride_a, g.data(b), ldb, stride_b, 0.0f, g.data(c), n,
       stride_c, batch, type, type);
  g.on_backward(c, [=](Graph<float>& g) {
    const void* dc = g.grad_data(c);
    if (g.requires_grad(a)) {
      const auto da = g.raw_grad_target(a);
      const float beta = da.accumulate ? 1.0f : 0.0f;  // cuBLAS does not read C when beta is 0
      if (!trans_a)                                    // dA (M, K) (+)= dC (M, N) op(B)^T
        gemm(g, false, !trans_b, m, k, n, alpha, dc, n, stride_c, g.data(b), ldb, stride_b, beta, da.data, lda,
             stride_a, batch, type, type);
      else  // dA (K, M) (+)= op(B) (K, N) dC^T
        gemm(g, trans_b, true, k, m, n, alpha, g.data(b), ldb, stride_b, dc, n, stride_c, beta, da.data, lda, stride_a,
             batch, type, type);
    }
    if (g.requires_grad(b)) {
      const auto db = g.raw_grad_target(b);
      const float beta = db.accumulate ? 1.0f : 0.0f;
      if (!trans_b)  // dB (K, N) (+)= op(A)^T (K, M) dC
        gemm(g, !trans_a, false, k, n, m, alpha, g.data(a), lda, stride_a, dc, n, stride_c, beta, db.data, ldb,
             stride_b, batch, type, type);
      else  // dB (N, K) (+)= dC^T (N, M) op(A)
        gemm(g, true, trans_a, n, k, m, alpha, dc, n, stride_c, g.data(a), lda, stride_a, beta, db.data, ldb, stride_b,
             batch, type, type);
    }
  });
  return c;
}

// The row stride of a linear layer's GEMM output. cuBLAS's fast kernels need the leading dimensions, and
// the extents along them, to be multiples of 16 bytes; a large product with an output width that is not
// (a vocabulary of 30522) ran 3-4x slower. It runs instead on a weight (and bias) with zero rows appended,
// into an output with padded rows.
template <typename A>
int64_t padded_width(int64_t rows, int64_t out) {
  constexpr int64_t kAlign = 16 / sizeof(A);
  return out % kAlign != 0 && rows * out >= (int64_t{1} << 20) ? (out + kAlign - 1) / kAlign * kAlign : out;
}

// scale_x, scale_w (device memory): x and weight hold a fake quantizer's values at them (ops::quantized_linear),
// and the forward sums their integers where the int8 GEMM runs.
template <typename A>
Var linear_typed(Graph<float>& g, Var x, Var weight, Var bias, const float* scale_x = nullptr,
                 const float* scale_w = nullptr) {
  constexpr cudaDataType_t type = cuda::cuda_data_type<A>();
  const Shape xs = g.shape(x), ws = g.shape(weight);
  const int64_t rows = xs.rows(), in = ws[1], out = ws[0];
  Var y = bias.valid() ? g.emit(xs.with_last(out), {x, weight, bias}, g.dtype(x))
                       : g.emit(xs.with_last(out), {x, weight}, g.dtype(x));
  // An odd output width runs padded (padded_width) and copies back: the copies cost much less than the
  // slow kernels.
  const int64_t ld = padded_width<A>(rows, out);
  // The weight as the GEMM's operand (a BF16 copy of an F32 weight in mixed precision; padded).
  const A* w_gemm = gemm_operand<A>(g, weight, out, ld, in);
  // The bias is of the output's type in cuBLASLt's epilogue: an F32 bias as is, else converted.
  const A* bias_gemm = bias.valid() ? gemm_operand<A>(g, bias, out, ld, 1) : nullptr;
  A* yv = cuda::typed<A>(g.data(y));
  A* y_gemm = ld == out ? yv : g.scratch<A>(rows * ld);
  const A* xv = cuda::typed<A>(g.data(x));
  const float* bias_values = bias.valid() ? g.value(bias).data() : nullptr;
  const QuantizedWeights<A> quantized{w_gemm, scale_w, bias_values, out, g.integers(weight)};
  const bool integers =
      scale_x && ld == out &&
      quantized_linear_product<A>(g, xv, g.integers(x), scale_x, std::span(&quantized, 1), yv, rows, in);
  if (!integers) linear_product(g, rows, in, ld, xv, w_gemm, bias_gemm, bias_values, out, y_gemm, ld, type);
  if (ld != out)
    BERT_CUDA_CHECK(cudaMemcpy2DAsync(yv, out * sizeof(A), y_gemm, ld * sizeof(A), out * sizeof(A), rows,
                                      cudaMemcpyDeviceToDevice, cuda::stream(g)));
  if (bias.valid() && g.requires_grad(bias)) g.set_bias_of(y, bias);  // its reader may sum dy's columns
  g.on_backward(y, [=](Graph<float>& g) {
    const A* dy = cuda::typed<A>(g.grad_data(y));
    const A* dy_gemm = dy;
    if (ld != out) {  // dy with zero columns appended (the padded weight's zero rows meet them in dx)
      A* padded = g.scratch<A>(rows * ld);
      BERT_CUDA_CHECK(cudaMemcpy2DAsync(padded, ld * sizeof(A), dy, out * sizeof(A), out * sizeof(A), rows,
                                        cudaMemcpyDeviceToDevice, cuda::stream(g)));
      BERT_CUDA_CHECK(
          cudaMemset2DAsync(padded + out, ld * sizeof(A), 0, (ld - out) * sizeof(A), rows, cuda::stream(g)));
      dy_gemm = padded;
    }
    if (g.requires_grad(x)) {  // dx (N, in) (+)= dy (N, out) W (out, in)
      const auto dx = g.raw_grad_target(x);
      gemm(g, false, false, rows, in, ld, 1.0f, dy_gemm, ld, 0, w_gemm, in, 0, dx.accumulate ? 1.0f : 0.0f, dx.data, in,
           0, 1, type, type);
    }
    if (g.requires_grad(weight)) {  // dW (out, in) (+)= dy^T (out, N) x (N, in), in the weight's own type
      const auto dw = g.raw_grad_target(weight);
      const cudaDataType_t w_type = g.dtype(weight) == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
      gemm(g, true, false, out, in, rows, 1.0f, dy_gemm, ld, 0, xv, in, 0, dw.accumulate ? 1.0f : 0.0f, dw.data, in, 0,
           1, type, w_type);
    }
    // The bias gradient in two passes of our own: cuBLASLt's BGRADB epilogue ran as a separate kernel
    // (21 us a call on 32,768 rows of 256 on an H200, these two take 11) and slowed the MLM decoder's
    // weight-gradient GEMM by a fifth. Not where y's reader summed dy as it wrote it (Graph::bias_summed).
    if (bias.valid() && g.requires_grad(bias) && !g.bias_summed(y))
      add_column_sums(g, dy, g.dtype(y), rows, out, out, g.grad(bias).data());
  });
  return y;
}

// The feed-forward block's GELU, forward (pre -> act, as ops::gelu's kernel computes it) and backward with
// the forward again: d (the gradient of act, in place) times the GELU's slope at pre, and act = gelu(pre)
// for the second GEMM's weight gradient, from one read of pre.
template <int W, typename A>
__global__ void ffn_gelu(A* act, const A* pre, int64_t n) {
  BERT_GRID_STRIDE_PACKS(i, n, W) {
    cuda::Pack<A, W> p = cuda::load_pack<W>(pre + i);
    for (int j = 0; j < W; ++j) p.v[j] = cuda::from_float<A>(cuda::gelu_value(cuda::to_float(p.v[j])));
    cuda::store_pack<W>(act + i, p);
  }
}
template <int W, typename A>
__device__ __forceinline__ void gelu_backward_pack(cuda::Pack<A, W>& g, cuda::Pack<A, W>& a,
                                                   const cuda::Pack<A, W>& p) {
  for (int j = 0; j < W; ++j) {
    float value, slope;
    cuda::gelu_value_and_derivative(cuda::to_float(p.v[j]), value, slope);
    a.v[j] = cuda::from_float<A>(value);
    g.v[j] = cuda::from_float<A>(cuda::to_float(g.v[j]) * slope);
  }
}
template <int W, typename A>
__global__ void ffn_gelu_backward(A* d, A* act, const A* pre, int64_t n) {
  BERT_GRID_STRIDE_PACKS(i, n, W) {
    const cuda::Pack<A, W> p = cuda::load_pack<W>(pre + i);
    cuda::Pack<A, W> g = cuda::load_pack<W>(d + i), a;
    gelu_backward_pack(g, a, p);
    cuda::store_pack<W>(act + i, a);
    cuda::store_pack<W>(d + i, g);
  }
}
// The same pass as column_sums' source: the first linear's bias gradient (dpre's column sums) from the
// values it writes, so dpre is not read again.
template <int W, typename A>
struct GeluBackwardRows {
  A *d, *act;
  const A* pre;
  int64_t ld;
  struct Loaded {
    cuda::Pack<A, W> g, p;
  };
  __device__ Loaded read(unsigned, int64_t r, int64_t col) const {
    return {cuda::load_pack<W>(d + r * ld + col), cuda::load_pack<W>(pre + r * ld + col)};
  }
  __device__ cuda::Pack<A, W> value(unsigned, int64_t r, int64_t col, Loaded loaded) const {
    cuda::Pack<A, W> a;
    gelu_backward_pack(loaded.g, a, loaded.p);
    cuda::store_pack<W>(act + r * ld + col, a);
    cuda::store_pack<W>(d + r * ld + col, loaded.g);
    return loaded.g;
  }
};

// BF16 only: act (rows, out) = GELU(x W^T + bias) and pre = x W^T + bias (the pre-activation, kept for the
// backward), both written by one product (cuBLASLt's GELU_AUX_BIAS epilogue). False where cuBLASLt has no
// algorithm for it. cuBLASLt's GELU is the tanh form, 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))) (within
// 5.3e-6 of it on an H200), within 4.7e-4 of erf's (at z near 2.7, where a BF16 step is 1.6e-2), and it
// takes the FP32 sum before rounding.
bool gemm_bias_gelu(const Graph<float>& g, int64_t rows, int64_t in, int64_t out, const void* x, const void* w,
                    const void* bias, void* act, void* pre) {
  LtProduct p{};
  p.trans_a = true, p.m = out, p.n = rows, p.k = in, p.a = w, p.lda = in, p.b = x, p.ldb = in, p.d = act, p.ldd = out;
  p.ab = p.dt = p.vector_type = CUDA_R_16BF;
  p.epilogue = CUBLASLT_EPILOGUE_GELU_AUX_BIAS, p.vector = const_cast<void*>(bias);
  p.aux = pre, p.aux_ld = out;
  return lt_product(g, p);
}
// BF16 only: d (rows, hidden) = (dy (rows, out) W (out, hidden)) GELU'(pre), GELU' of cuBLASLt's tanh form
// (DGELU epilogue). False where cuBLASLt has no algorithm for it.
bool gemm_gelu_backward(const Graph<float>& g, int64_t rows, int64_t out, int64_t hidden, const void* dy, const void* w,
                        const void* pre, void* d) {
  LtProduct p{};
  p.m = hidden, p.n = rows, p.k = out, p.a = w, p.lda = hidden, p.b = dy, p.ldb = out, p.d = d, p.ldd = hidden;
  p.ab = p.dt = p.vector_type = CUDA_R_16BF;
  p.epilogue = CUBLASLT_EPILOGUE_DGELU, p.aux = const_cast<void*>(pre), p.aux_ld = hidden;
  return lt_product(g, p);
}

// dpre = dact gelu'(pre) in place of d, act = gelu(pre) again and, with dbias, dpre's column sums added
// there, in one pass.
template <typename A>
void gelu_backward_pass(Graph<float>& g, A* d, A* act, const A* pre, int64_t rows, int64_t hidden, float* dbias) {
  const int64_t n = rows * hidden;
  if (!dbias) {
    BERT_LAUNCH_PACKED_WIDE(A, ffn_gelu_backward, n, cuda::packs_of_4(n, {d, act, pre}), g, d, act, pre, n);
    return;
  }
  const auto address =
      reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(act) | reinterpret_cast<uintptr_t>(pre);
  auto fits = [&](int64_t w) { return hidden % w == 0 && address % (w * sizeof(A)) == 0; };
  cuda::launch_column_sums(g, rows, hidden, dbias, 1, 0, fits, [&]<int W>() {
    return GeluBackwardRows<W, A>{d, act, pre, hidden};
  });
}

// ops::feed_forward on a GPU, or Var{} where the widths would run padded (linear_typed's copies): the caller
// then runs the three ops. The first product `pre` is kept (scratch) for the backward. In FP32 and TF32
// (and in BF16 where cuBLASLt lacks the epilogue) the GELU's output goes to transient slot 0 and the
// second GEMM reads it there; the backward: dact = dy W2 into slot 1, then one pass turns it into dpre in
// place, writes gelu(pre) into slot 0 again for dW2 = dy^T act and sums dpre's columns into b1's gradient.
// The kernels and GEMMs of linear, gelu, linear: the same bits. In BF16 the first product applies the GELU in
// its epilogue (gemm_bias_gelu: cuBLASLt's tanh form) and its output is kept (scratch) for dW2; the
// backward's dact product applies the GELU's derivative in its epilogue (gemm_gelu_backward), and b1's
// gradient is dpre's column sums. Then the first linear's other gradients from dpre. b2's gradient is dy's
// column sums, summed by y's reader where it says so (Graph::bias_summed: dropout_add_layer_norm), as
// linear's.
template <typename A>
Var feed_forward_typed(Graph<float>& g, Var x, Var w1, Var b1, Var w2, Var b2) {
  constexpr cudaDataType_t type = cuda::cuda_data_type<A>();
  const Shape xs = g.shape(x);
  const int64_t rows = xs.rows(), in = g.shape(w1)[1], hidden = g.shape(w1)[0], out = g.shape(w2)[0];
  if (padded_width<A>(rows, hidden) != hidden || padded_width<A>(rows, out) != out) return Var{};
  const int64_t n = rows * hidden;
  Var y = g.emit(xs.with_last(out), {x, w1, b1, w2, b2}, g.dtype(x));
  const bool backward = g.requires_grad(y);
  const A* w1_gemm = gemm_operand<A>(g, w1, hidden, hidden, in);
  const A* b1_gemm = gemm_operand<A>(g, b1, hidden, hidden, 1);
  const A* w2_gemm = gemm_operand<A>(g, w2, out, out, hidden);
  const A* b2_gemm = gemm_operand<A>(g, b2, out, out, 1);
  const A* xv = cuda::typed<A>(g.data(x));
  A* pre = backward ? g.scratch<A>(n) : g.transient<A>(1, n);
  // BF16 with the GELU in the first product's epilogue: its output kept for the second's weight gradient
  // (the backward's own product then applies the GELU's derivative). Else computed again there.
  bool epilogue = std::is_same_v<A, bf16> && b1_gemm;
  A* act = epilogue && backward ? g.scratch<A>(n) : g.transient<A>(0, n);
  epilogue = epilogue && gemm_bias_gelu(g, rows, in, hidden, xv, w1_gemm, b1_gemm, act, pre);
  if (!epilogue) {
    linear_product(g, rows, in, hidden, xv, w1_gemm, b1_gemm, g.value(b1).data(), hidden, pre, hidden, type);
    BERT_LAUNCH_PACKED_WIDE(A, ffn_gelu, n, cuda::packs_of_4(n, {act, pre}), g, act, pre, n);
  }
  linear_product(g, rows, hidden, out, act, w2_gemm, b2_gemm, g.value(b2).data(), out, cuda::typed<A>(g.data(y)), out,
                 type);
  if (g.requires_grad(b2)) g.set_bias_of(y, b2);  // its reader may sum dy's columns
  const bool kept = epilogue && backward;
  A* const kept_act = act;
  g.on_backward(y, [=](Graph<float>& g) {
    const A* dy = cuda::typed<A>(g.grad_data(y));
    A* act = kept ? kept_act : g.transient<A>(0, n);
    A* d = g.transient<A>(1, n);
    const bool b1_grad = g.requires_grad(b1);
    // The kept act: dpre = (dy W2) gelu'(pre) in the product's epilogue, then b1's gradient as dpre's column
    // sums (cuBLASLt's DGELU_BGRAD gives the bias gradient in BF16 only, and took 3x the time on an H200).
    if (kept && gemm_gelu_backward(g, rows, out, hidden, dy, w2_gemm, pre, d)) {
      if (b1_grad) add_column_sums(g, d, g.dtype(y), rows, hidden, hidden, g.grad(b1).data());
    } else {
      gemm(g, false, false, rows, hidden, out, 1.0f, dy, out, 0, w2_gemm, hidden, 0, 0.0f, d, hidden, 0, 1, type, type);
      gelu_backward_pass(g, d, act, pre, rows, hidden, b1_grad ? g.grad(b1).data() : nullptr);
    }
    // dW (out, in) (+)= dy^T (out, N) x (N, in), in the weight's own type; the bias as the column sums.
    auto weight_grads = [&](Var w, Var b, const A* dz, const A* input, int64_t o, int64_t i, bool bias_done) {
      if (g.requires_grad(w)) {
        const auto dw = g.raw_grad_target(w);
        const cudaDataType_t w_type = g.dtype(w) == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
        gemm(g, true, false, o, i, rows, 1.0f, dz, o, 0, input, i, 0, dw.accumulate ? 1.0f : 0.0f, dw.data, i, 0, 1,
             type, w_type);
      }
      if (g.requires_grad(b) && !bias_done) add_column_sums(g, dz, g.dtype(y), rows, o, o, g.grad(b).data());
    };
    weight_grads(w2, b2, dy, act, out, hidden, g.bias_summed(y));
    if (g.requires_grad(x)) {  // dx (N, in) (+)= dpre (N, hidden) W1 (hidden, in)
      const auto dx = g.raw_grad_target(x);
      gemm(g, false, false, rows, in, hidden, 1.0f, d, hidden, 0, w1_gemm, in, 0, dx.accumulate ? 1.0f : 0.0f, dx.data,
           in, 0, 1, type, type);
    }
    weight_grads(w1, b1, d, xv, hidden, in, b1_grad);
  });
  return y;
}

// linear_typed's product scored by the cross-entropy where the GEMM wrote it: no (rows, out) logits node,
// so none of the copies an odd output width costs linear (the padded output back into the node, the
// node's gradient out into a padded buffer); the gradient of the logits is written in the padded layout,
// zero in the padding, for the backward GEMMs. The same GEMMs and kernels as linear then
// cross_entropy_scores, so the same values, bit for bit.
template <typename A>
LinearScores linear_cross_entropy_typed(Graph<float>& g, Var x, Var weight, Var bias, std::span<const int32_t> targets,
                                        PredictionsTo to) {
  constexpr cudaDataType_t type = cuda::cuda_data_type<A>();
  const Shape xs = g.shape(x), ws = g.shape(weight);
  const int64_t rows = xs.rows(), in = ws[1], out = ws[0];
  const CrossEntropyRows ce = prepare_cross_entropy(g, targets, {}, -1, out);
  const int64_t ld = padded_width<A>(rows, out);
  const A* w_gemm = gemm_operand<A>(g, weight, out, ld, in);
  const A* bias_gemm = bias.valid() ? gemm_operand<A>(g, bias, out, ld, 1) : nullptr;
  const A* xv = cuda::typed<A>(g.data(x));
  A* z = g.scratch<A>(std::max<int64_t>(rows * ld, 1));  // the logits, kept for the backward pass (its dz)
  if (rows > 0)
    linear_product(g, rows, in, ld, xv, w_gemm, bias_gemm, bias.valid() ? g.value(bias).data() : nullptr, out, z, ld,
                   type);

  LinearScores scores;
  scores.loss = bias.valid() ? g.emit(Shape{}, {x, weight, bias}) : g.emit(Shape{}, {x, weight});
  int32_t* argmax = g.scratch<int32_t>(std::max<int64_t>(rows, 1));
  cross_entropy_forward(g, ce, g.dtype(x), z, ld, argmax, g.value(scores.loss).data());
  const Var loss = scores.loss;
  g.on_backward(loss, [=](Graph<float>& g) {
    if (rows == 0) return;
    // The gradient of the logits in place of the logits (zero in the padding: the padded weight's zero rows
    // meet it in dx), with the bias gradient's column sums in the same pass where the layout allows.
    A* dz = z;
    const bool bias_summed =
        bias.valid() && g.requires_grad(bias) &&
        cross_entropy_backward_with_column_sums(g, ce, g.dtype(x), z, ld, g.grad(loss).data(), dz, g.grad(bias).data());
    if (!bias_summed) cross_entropy_backward(g, ce, g.dtype(x), z, ld, g.grad(loss).data(), dz, false);
    if (g.requires_grad(x)) {  // dx (N, in) (+)= dz (N, out) W (out, in)
      const auto dx = g.raw_grad_target(x);
      gemm(g, false, false, rows, in, ld, 1.0f, dz, ld, 0, w_gemm, in, 0, dx.accumulate ? 1.0f : 0.0f, dx.data, in, 0,
           1, type, type);
    }
    if (g.requires_grad(weight)) {  // dW (out, in) (+)= dz^T (out, N) x (N, in), in the weight's own type
      const auto dw = g.raw_grad_target(weight);
      const cudaDataType_t w_type = g.dtype(weight) == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
      gemm(g, true, false, out, in, rows, 1.0f, dz, ld, 0, xv, in, 0, dw.accumulate ? 1.0f : 0.0f, dw.data, in, 0, 1,
           type, w_type);
    }
    if (bias.valid() && g.requires_grad(bias) && !bias_summed)
      add_column_sums(g, dz, g.dtype(x), rows, out, ld, g.grad(bias).data());
  });
  if (to == PredictionsTo::kDevice) {
    scores.device_predictions = argmax;
  } else {
    scores.predictions.resize(static_cast<size_t>(rows));
    g.device().copy_to_host(scores.predictions.data(), argmax, scores.predictions.size() * sizeof(int32_t));
  }
  return scores;
}
}  // namespace

// In BF16 mixed precision both operands become BF16 activations and the product is BF16.
Var matmul(Graph<float>& g, Var a, Var b, bool trans_a, bool trans_b, double alpha_d) {
  const Shape as = g.shape(a), bs = g.shape(b);
  BERT_CHECK(as.rank() >= 2 && bs.rank() >= 2, "matmul needs rank >= 2, got " + as.str() + " x " + bs.str());
  a = as_activation(g, a);
  b = as_activation(g, b);
  const float alpha = static_cast<float>(alpha_d);
  if (g.dtype(a) == DType::kBF16) return matmul_typed<bf16>(g, a, b, trans_a, trans_b, alpha);
  return matmul_typed<float>(g, a, b, trans_a, trans_b, alpha);
}

// In BF16 mixed precision x becomes a BF16 activation, an F32 weight (and bias) is converted for the
// GEMM, the output is BF16 and the weight's gradient is written in the weight's own type (F32 into
// the parameters: FP32 master weights).
Var linear(Graph<float>& g, Var x, Var weight, Var bias) {
  const Shape xs = g.shape(x), ws = g.shape(weight);
  BERT_CHECK(ws.rank() == 2 && xs.rank() >= 1 && xs[-1] == ws[1],
             "linear: x " + xs.str() + " does not fit weight " + ws.str());
  if (bias.valid()) BERT_CHECK(g.shape(bias) == Shape({ws[0]}), "linear bias " + g.shape(bias).str());
  if (bias.valid()) BERT_CHECK(g.dtype(bias) == DType::kF32, "linear: a BF16 bias is not supported");
  x = as_activation(g, x);
  if (g.dtype(x) == DType::kBF16) return linear_typed<bf16>(g, x, weight, bias);
  weight = to_dtype(g, weight, DType::kF32);
  return linear_typed<float>(g, x, weight, bias);
}

Var quantized_linear(Graph<float>& g, Var x, Var weight, Var bias, Var scale_x, Var scale_w) {
  x = as_activation(g, x);
  const float *sx = g.value(scale_x).data(), *sw = g.value(scale_w).data();
  if (g.dtype(x) == DType::kBF16) return linear_typed<bf16>(g, x, weight, bias, sx, sw);
  return linear_typed<float>(g, x, to_dtype(g, weight, DType::kF32), bias, sx, sw);
}

// As linear for each product; where the widths would run padded, the three ops.
Var feed_forward(Graph<float>& g, Var x, Var w1, Var b1, Var w2, Var b2) {
  const Shape xs = g.shape(x), s1 = g.shape(w1), s2 = g.shape(w2);
  BERT_CHECK(s1.rank() == 2 && s2.rank() == 2 && xs.rank() >= 1 && xs[-1] == s1[1] && s2[1] == s1[0],
             "feed_forward: x " + xs.str() + " does not fit weights " + s1.str() + " and " + s2.str());
  BERT_CHECK(
      b1.valid() && b2.valid() && g.shape(b1) == Shape({s1[0]}) && g.shape(b2) == Shape({s2[0]}) &&
          g.dtype(b1) == DType::kF32 && g.dtype(b2) == DType::kF32,
      "feed_forward: biases of " + std::to_string(s1[0]) + " and " + std::to_string(s2[0]) + " F32 values expected");
  x = as_activation(g, x);
  Var y = g.dtype(x) == DType::kBF16
              ? feed_forward_typed<bf16>(g, x, w1, b1, w2, b2)
              : feed_forward_typed<float>(g, x, to_dtype(g, w1, DType::kF32), b1, to_dtype(g, w2, DType::kF32), b2);
  return y.valid() ? y : linear(g, gelu(g, linear(g, x, w1, b1)), w2, b2);
}

// As linear: x becomes an activation of the step's precision, an F32 weight is converted for the GEMM.
LinearScores linear_cross_entropy_scores(Graph<float>& g, Var x, Var weight, Var bias, std::span<const int32_t> targets,
                                         PredictionsTo to) {
  const Shape xs = g.shape(x), ws = g.shape(weight);
  BERT_CHECK(ws.rank() == 2 && xs.rank() == 2 && xs[1] == ws[1],
             "linear_cross_entropy_scores: x " + xs.str() + " does not fit weight " + ws.str());
  if (bias.valid())
    BERT_CHECK(g.shape(bias) == Shape({ws[0]}) && g.dtype(bias) == DType::kF32,
               "linear_cross_entropy_scores: bias " + g.shape(bias).str() + " (F32, one per output expected)");
  BERT_CHECK(static_cast<int64_t>(targets.size()) == xs[0],
             "linear_cross_entropy_scores: " + std::to_string(targets.size()) + " targets for " +
                 std::to_string(xs[0]) + " rows");
  x = as_activation(g, x);
  if (g.dtype(x) == DType::kBF16) return linear_cross_entropy_typed<bf16>(g, x, weight, bias, targets, to);
  weight = to_dtype(g, weight, DType::kF32);
  return linear_cross_entropy_typed<float>(g, x, weight, bias, targets, to);
}

}  // namespace bert::ops::cuda_impl
