// matmul and linear on a CUDA device: cuBLAS GEMMs (FP32, or TF32 tensor cores as the device's
// precision says, FP32 in and out), forward and backward side by side like core/ops_matmul.cpp.
#include <cublasLt.h>

#include "core/cuda/common.cuh"
#include "core/ops_cuda.h"

namespace bert::ops::cuda_impl {

namespace {

cublasComputeType_t compute_type(const Graph<float>& g) {
  switch (g.device().precision()) {
    case Precision::kTf32:
      return CUBLAS_COMPUTE_32F_FAST_TF32;
    default:
      return CUBLAS_COMPUTE_32F;
  }
}

// Row-major C (M, N) = alpha op(A) op(B) + beta C for `batch` items at the given element strides.
// cuBLAS is column-major, so it computes C^T = op(B)^T op(A)^T on the same memory.
void gemm(const Graph<float>& g, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, int64_t stride_a, const float* b, int64_t ldb, int64_t stride_b, float beta,
          float* c, int64_t ldc, int64_t stride_c, int64_t batch) {
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (batch == 1) {
    BERT_CUBLAS_CHECK(cublasGemmEx(cuda::cublas(g), op_b, op_a, int(n), int(m), int(k), &alpha, b, CUDA_R_32F, int(ldb),
                                   a, CUDA_R_32F, int(lda), &beta, c, CUDA_R_32F, int(ldc), compute_type(g),
                                   CUBLAS_GEMM_DEFAULT));
    return;
  }
  BERT_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      cuda::cublas(g), op_b, op_a, int(n), int(m), int(k), &alpha, b, CUDA_R_32F, int(ldb), stride_b, a, CUDA_R_32F,
      int(lda), stride_a, &beta, c, CUDA_R_32F, int(ldc), stride_c, int(batch), compute_type(g), CUBLAS_GEMM_DEFAULT));
}

// y (rows, out) = x (rows, in) W^T + bias, the bias added in the GEMM's epilogue (cuBLASLt), so y is
// written once. Column-major view: y^T (out, rows) = W (out, in) x^T, the bias running along y^T's rows.
// Returns false when cuBLASLt has no algorithm for the shape (the caller then adds the bias itself).
bool gemm_bias(const Graph<float>& g, int64_t rows, int64_t in, int64_t out, const float* x, const float* w,
               const float* bias, float* y, int64_t ldy) {
  const CudaContext& c = cuda::context(g.device());
  auto lt = reinterpret_cast<cublasLtHandle_t>(c.cublas_lt);
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t w_layout = nullptr, x_layout = nullptr, y_layout = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  BERT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, compute_type(g), CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;
  const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
  BERT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof transpose));
  BERT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof none));
  BERT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue));
  BERT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
  BERT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&w_layout, CUDA_R_32F, uint64_t(in), uint64_t(out), int64_t(in)));
  BERT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&x_layout, CUDA_R_32F, uint64_t(in), uint64_t(rows), int64_t(in)));
  BERT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&y_layout, CUDA_R_32F, uint64_t(out), uint64_t(rows), int64_t(ldy)));
  BERT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
  BERT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                         &c.cublas_workspace_bytes, sizeof c.cublas_workspace_bytes));
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(lt, desc, w_layout, x_layout, y_layout, y_layout,
                                                               preference, 1, &heuristic, &found);
  const bool ok = status == CUBLAS_STATUS_SUCCESS && found > 0;
  if (ok) {
    const float one = 1.0f, zero = 0.0f;
    BERT_CUBLAS_CHECK(cublasLtMatmul(lt, desc, &one, w, w_layout, x, x_layout, &zero, y, y_layout, y, y_layout,
                                     &heuristic.algo, c.cublas_workspace, c.cublas_workspace_bytes, c.stream));
  }
  cublasLtMatmulPreferenceDestroy(preference);
  cublasLtMatrixLayoutDestroy(y_layout);
  cublasLtMatrixLayoutDestroy(x_layout);
  cublasLtMatrixLayoutDestroy(w_layout);
  cublasLtMatmulDescDestroy(desc);
  return ok;
}

// out (rows, cols) += bias (cols) broadcast over rows: blockIdx.y walks rows, x the columns.
__global__ void add_row_vector(float* out, const float* bias, int64_t rows, int64_t cols) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  const float b = bias[c];
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) out[r * cols + c] += b;
}

// dbias (cols) += sum over rows of dy (rows, cols), as a GEMV with a vector of ones (deterministic).
void add_column_sums(const Graph<float>& g, const float* dy, int64_t rows, int64_t cols, float* dbias) {
  const CudaContext& c = cuda::context(g.device());
  const float one = 1.0f;
  for (int64_t r0 = 0; r0 < rows; r0 += int64_t(CudaContext::kOnes)) {
    const int64_t r = std::min<int64_t>(rows - r0, CudaContext::kOnes);
    BERT_CUBLAS_CHECK(cublasSgemv(cuda::cublas(g), CUBLAS_OP_N, int(cols), int(r), &one, dy + r0 * cols, int(cols),
                                  c.ones, 1, &one, dbias, 1));
  }
}

}  // namespace

Var matmul(Graph<float>& g, Var a, Var b, bool trans_a, bool trans_b, double alpha_d) {
  const float alpha = static_cast<float>(alpha_d);
  const Shape as = g.shape(a), bs = g.shape(b);
  BERT_CHECK(as.rank() >= 2 && bs.rank() >= 2, "matmul needs rank >= 2, got " + as.str() + " x " + bs.str());
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
  Var c = g.emit(out, {a, b});
  gemm(g, trans_a, trans_b, m, n, k, alpha, g.value(a).data(), lda, stride_a, g.value(b).data(), ldb, stride_b, 0.0f,
       g.value(c).data(), n, stride_c, batch);
  g.on_backward(c, [=](Graph<float>& g) {
    const float* dc = g.grad(c).data();
    if (g.requires_grad(a)) {
      const auto da = g.grad_target(a);
      const float beta = da.accumulate ? 1.0f : 0.0f;  // cuBLAS does not read C when beta is 0
      if (!trans_a)                                    // dA (M, K) (+)= dC (M, N) op(B)^T
        gemm(g, false, !trans_b, m, k, n, alpha, dc, n, stride_c, g.value(b).data(), ldb, stride_b, beta, da.data, lda,
             stride_a, batch);
      else  // dA (K, M) (+)= op(B) (K, N) dC^T
        gemm(g, trans_b, true, k, m, n, alpha, g.value(b).data(), ldb, stride_b, dc, n, stride_c, beta, da.data, lda,
             stride_a, batch);
    }
    if (g.requires_grad(b)) {
      const auto db = g.grad_target(b);
      const float beta = db.accumulate ? 1.0f : 0.0f;
      if (!trans_b)  // dB (K, N) (+)= op(A)^T (K, M) dC
        gemm(g, !trans_a, false, k, n, m, alpha, g.value(a).data(), lda, stride_a, dc, n, stride_c, beta, db.data, ldb,
             stride_b, batch);
      else  // dB (N, K) (+)= dC^T (N, M) op(A)
        gemm(g, true, trans_a, n, k, m, alpha, dc, n, stride_c, g.value(a).data(), lda, stride_a, beta, db.data, ldb,
             stride_b, batch);
    }
  });
  return c;
}

Var linear(Graph<float>& g, Var x, Var weight, Var bias) {
  const Shape xs = g.shape(x), ws = g.shape(weight);
  BERT_CHECK(ws.rank() == 2 && xs.rank() >= 1 && xs[-1] == ws[1],
             "linear: x " + xs.str() + " does not fit weight " + ws.str());
  const int64_t rows = xs.rows(), in = ws[1], out = ws[0];
  if (bias.valid()) BERT_CHECK(g.shape(bias) == Shape({out}), "linear bias " + g.shape(bias).str());
  Var y = bias.valid() ? g.emit(xs.with_last(out), {x, weight, bias}) : g.emit(xs.with_last(out), {x, weight});
  // cuBLAS's fast kernels need the leading dimensions, and the extents along them, to be multiples of
  // 4 floats; a large product with an output width that is not (a vocabulary of 30522) ran 3-4x slower.
  // It runs instead on a weight (and bias) with zero rows appended, into an output with padded rows,
  // and copies back: the copies cost much less than the slow kernels.
  const int64_t ld = (out % 4 != 0 && rows * out >= (int64_t{1} << 20)) ? (out + 3) / 4 * 4 : out;
  const float* w_gemm = g.value(weight).data();
  const float* bias_gemm = bias.valid() ? g.value(bias).data() : nullptr;
  if (ld != out) {
    float* w_padded = g.scratch<float>(ld * in);
    cuda::copy_on_device(cuda::context(g.device()), w_padded, w_gemm, out * in * sizeof(float));
    cuda::fill_zero(cuda::context(g.device()), w_padded + out * in, (ld - out) * in * sizeof(float));
    w_gemm = w_padded;
    if (bias_gemm) {
      float* bias_padded = g.scratch<float>(ld);
      cuda::copy_on_device(cuda::context(g.device()), bias_padded, bias_gemm, out * sizeof(float));
      cuda::fill_zero(cuda::context(g.device()), bias_padded + out, (ld - out) * sizeof(float));
      bias_gemm = bias_padded;
    }
  }
  float* yv = g.value(y).data();
  float* y_gemm = ld == out ? yv : g.scratch<float>(rows * ld);
  const bool fused = bias_gemm && gemm_bias(g, rows, in, ld, g.value(x).data(), w_gemm, bias_gemm, y_gemm, ld);
  if (!fused) gemm(g, false, true, rows, ld, in, 1.0f, g.value(x).data(), in, 0, w_gemm, in, 0, 0.0f, y_gemm, ld, 0, 1);
  if (ld != out)
    BERT_CUDA_CHECK(cudaMemcpy2DAsync(yv, out * sizeof(float), y_gemm, ld * sizeof(float), out * sizeof(float), rows,
                                      cudaMemcpyDeviceToDevice, cuda::stream(g)));
  if (bias.valid() && !fused) {
    const dim3 grid(static_cast<unsigned>((out + cuda::kThreads - 1) / cuda::kThreads),
                    static_cast<unsigned>(std::min<int64_t>(rows, 4096)));
    add_row_vector<<<grid, cuda::kThreads, 0, cuda::stream(g)>>>(yv, g.value(bias).data(), rows, out);
    BERT_CUDA_LAUNCHED();
  }
  g.on_backward(y, [=](Graph<float>& g) {
    const float* dy = g.grad(y).data();
    const float* dy_gemm = dy;
    if (ld != out) {  // dy with zero columns appended (the padded weight's zero rows meet them in dx)
      float* padded = g.scratch<float>(rows * ld);
      BERT_CUDA_CHECK(cudaMemcpy2DAsync(padded, ld * sizeof(float), dy, out * sizeof(float), out * sizeof(float), rows,
                                        cudaMemcpyDeviceToDevice, cuda::stream(g)));
      BERT_CUDA_CHECK(
          cudaMemset2DAsync(padded + out, ld * sizeof(float), 0, (ld - out) * sizeof(float), rows, cuda::stream(g)));
      dy_gemm = padded;
    }
    if (g.requires_grad(x)) {  // dx (N, in) (+)= dy (N, out) W (out, in)
      const auto dx = g.grad_target(x);
      gemm(g, false, false, rows, in, ld, 1.0f, dy_gemm, ld, 0, w_gemm, in, 0, dx.accumulate ? 1.0f : 0.0f, dx.data, in,
           0, 1);
    }
    if (g.requires_grad(weight)) {  // dW (out, in) (+)= dy^T (out, N) x (N, in)
      const auto dw = g.grad_target(weight);
      gemm(g, true, false, out, in, rows, 1.0f, dy_gemm, ld, 0, g.value(x).data(), in, 0, dw.accumulate ? 1.0f : 0.0f,
           dw.data, in, 0, 1);
    }
    if (bias.valid() && g.requires_grad(bias)) add_column_sums(g, dy, rows, out, g.grad(bias).data());
  });
  return y;
}

}  // namespace bert::ops::cuda_impl
