// INT8 inference on a CUDA device: the linear layers as integer GEMMs on the tensor cores (cuBLASLt's
// int8 kernels, exact int32 sums), and the fake-quantized model's linears with the same exact sums (BF16
// tensor cores on integer operands), beside ops/integer.cpp's CPU ops and held to them by the CudaOps
// tests. Forward only.
//
// cuBLASLt on Hopper offers int8 GEMMs that write int32 sums or int8 outputs at one per-tensor scale, not
// the per-output-channel scale and bias that dequantize a per-channel quantized linear: with it the int32
// sums go through memory once more, to the kernel that applies them (dequantize_rows). On Hopper
// int8_linear runs our own GEMM with that epilogue inside (cuda/int8_wgmma.cuh); the cuBLASLt path is its
// reference and the fallback. This file is compiled for sm_90a where the build targets sm_90
// (ops/CMakeLists.txt).
#include <cublasLt.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <type_traits>

#include "ops/cuda/common.cuh"
#include "ops/cuda/fake_quantize.cuh"
#include "ops/cuda/int8_wgmma.cuh"
#include "ops/cuda_impl.h"

namespace bert::ops::cuda_impl {

namespace {

// q (rows, ld) int8: round(x / scale) half to even, clamped to [-128, 127], as fake_quantize and the
// CPU's quantize_activations round (the same division: cuda::ScaleDivision); the bytes past k are zero.
// Each thread makes 4 bytes of a row.
template <typename A>
__global__ void quantize_rows(int8_t* q, const A* x, int64_t rows, int64_t k, int64_t ld, float scale) {
  const cuda::ScaleDivision divide(scale);
  const int64_t groups = ld / 4;
  BERT_GRID_STRIDE(i, rows * groups) {
    const int64_t r = i / groups, c = (i - r * groups) * 4;
    char4 out;
    int8_t* bytes = reinterpret_cast<int8_t*>(&out);
    for (int j = 0; j < 4; ++j) {
      const float u = c + j < k ? divide(cuda::to_float(x[r * k + c + j])) : 0.0f;
      bytes[j] = static_cast<int8_t>(fminf(fmaxf(rintf(u), -128.0f), 127.0f));
    }
    *reinterpret_cast<char4*>(q + r * ld + c) = out;
  }
}

// The same for rows of k == ld inputs, 8 a thread (one 8-byte store), x 32-byte aligned.
template <typename A>
__global__ void quantize_rows_packed(int8_t* q, const A* x, int64_t count, float scale) {
  const cuda::ScaleDivision divide(scale);
  BERT_GRID_STRIDE_PACKS(i, count, 8) {
    const cuda::Pack<A, 8> in = cuda::load_pack<8>(x + i);
    cuda::Pack<int8_t, 8> out;
    for (int j = 0; j < 8; ++j)
      out.v[j] = static_cast<int8_t>(fminf(fmaxf(rintf(divide(cuda::to_float(in.v[j]))), -128.0f), 127.0f));
    cuda::store_pack<8>(q + i, out);
  }
}

__device__ __forceinline__ float sum_value(int32_t sum) { return __int2float_rn(sum); }
__device__ __forceinline__ float sum_value(float sum) { return sum; }

// The int8 GEMM's epilogue (cuda::Int8Epilogue) as a kernel of its own, from sums (rows, ld_sums) of type S
// (int32, or integers an FP32 GEMM summed exactly), W outputs a thread (W = 4: n, ld_sums and every part's
// width multiples of 4).
template <int W, typename A, typename O, typename S, bool kGelu, bool kQuantize>
__global__ void dequantize_rows(const cuda::Int8Epilogue e, const S* sums, int64_t rows, int64_t n, int64_t ld_sums) {
  BERT_GRID_STRIDE_PACKS(i, rows * n, W) {
    const int64_t r = i / n, c = i - r * n;
    const int p = e.part(c);
    const float scale = cuda::Int8Epilogue::pick(p, e.scale), reciprocal = cuda::Int8Epilogue::pick(p, e.reciprocal);
    const cuda::Pack<S, W> s = cuda::load_pack<W>(sums + r * ld_sums + c);
    cuda::Pack<O, W> out;
    for (int j = 0; j < W; ++j) {
      const float v = fmaf(sum_value(s.v[j]), __fmul_rn(e.scale_x, e.scale_w[c + j]), e.bias[c + j]);
      out.v[j] = cuda::int8_epilogue_value<A, O, kGelu, kQuantize>(v, scale, reciprocal);
    }
    cuda::store_pack<W>(static_cast<O*>(cuda::Int8Epilogue::pick(p, e.out)) + r * e.width(p) + (c - e.begin(p)), out);
  }
}

// Whether some part of e is quantized.
bool quantizes(const cuda::Int8Epilogue& e) { return e.scale[0] > 0 || e.scale[1] > 0 || e.scale[2] > 0; }

// Launches dequantize_rows, in packs of 4 where the shapes allow.
template <typename A, typename O, typename S>
void launch_dequantize(const Graph<float>& g, const cuda::Int8Epilogue& e, int parts, const S* sums, int64_t rows,
                       int64_t n, int64_t ld_sums, bool gelu) {
  bool packed = n % 4 == 0 && ld_sums % 4 == 0 && cuda::packs_of_4(rows * n, {sums});
  for (int p = 0; p < parts; ++p)
    packed = packed && e.width(p) % 4 == 0 && reinterpret_cast<uintptr_t>(e.out[p]) % 16 == 0;
  auto launch = [&](auto w, auto quantize) {
    constexpr int W = decltype(w)::value;
    constexpr bool kQuantize = decltype(quantize)::value;
    if constexpr (kQuantize || !std::is_same_v<O, int8_t>) {
      const auto kernel =
          gelu ? dequantize_rows<W, A, O, S, true, kQuantize> : dequantize_rows<W, A, O, S, false, kQuantize>;
      BERT_LAUNCH(kernel, rows * n / W, g, e, sums, rows, n, ld_sums);
    }
  };
  const bool quantize = quantizes(e);
  if (packed)
    quantize ? launch(std::integral_constant<int, 4>{}, std::true_type{})
             : launch(std::integral_constant<int, 4>{}, std::false_type{});
  else
    quantize ? launch(std::integral_constant<int, 1>{}, std::true_type{})
             : launch(std::integral_constant<int, 1>{}, std::false_type{});
}

// sums (rows, ld_sums) int32 = q (rows, w.ld()) times w^T, on the int8 tensor cores. cuBLASLt is
// column-major: sums^T (n, rows) = W (n, ld) q^T, i.e. A = W transposed, B = q as it lies (the "TN"
// layout its int8 kernels take).
void integer_gemm(const Graph<float>& g, const int8_t* q, int64_t rows, const DeviceInt8Weights& w, int32_t* sums,
                  int64_t ld_sums) {
  const CudaContext& c = cuda::context(g.device());
  auto lt = reinterpret_cast<cublasLtHandle_t>(c.cublas_lt);
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t w_layout = nullptr, q_layout = nullptr, s_layout = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  BERT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32I, CUDA_R_32I));
  const cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;
  BERT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof transpose));
  BERT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof none));
  BERT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&w_layout, CUDA_R_8I, uint64_t(w.ld()), uint64_t(w.n()), w.ld()));
  BERT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&q_layout, CUDA_R_8I, uint64_t(w.ld()), uint64_t(rows), w.ld()));
  BERT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&s_layout, CUDA_R_32I, uint64_t(w.n()), uint64_t(rows), ld_sums));
  BERT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference));
  BERT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                         &c.cublas_workspace_bytes, sizeof c.cublas_workspace_bytes));
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(lt, desc, w_layout, q_layout, s_layout, s_layout,
                                                               preference, 1, &heuristic, &found);
  if (status == CUBLAS_STATUS_SUCCESS && found > 0) {
    const int32_t one = 1, zero = 0;
    BERT_CUBLAS_CHECK(cublasLtMatmul(lt, desc, &one, w.data(), w_layout, q, q_layout, &zero, sums, s_layout, sums,
                                     s_layout, &heuristic.algo, c.cublas_workspace, c.cublas_workspace_bytes,
                                     c.stream));
  }
  cublasLtMatmulPreferenceDestroy(preference);
  cublasLtMatrixLayoutDestroy(s_layout);
  cublasLtMatrixLayoutDestroy(q_layout);
  cublasLtMatrixLayoutDestroy(w_layout);
  cublasLtMatmulDescDestroy(desc);
  if (status != CUBLAS_STATUS_SUCCESS || found == 0)
    throw UserError("int8_linear: this GPU's cuBLASLt has no int8 tensor-core GEMM for " + std::to_string(rows) +
                    " rows of " + std::to_string(w.k()) + " inputs and " + std::to_string(w.n()) +
                    " outputs (cuBLASLt status " + std::to_string(int(status)) +
                    "); INT8 inference needs an NVIDIA GPU of compute capability 7.5 or later: use --device cpu");
}

// q (rows, k) as BF16 integers: row r of x divided by its scale (scales[r], or scale for every row),
// rounded half to even and clamped to [-128, 127], as int8_linear quantizes (and, for x fake-quantized
// at that scale, the integers behind it). Integers of 8 bits are exact in BF16.
template <typename A>
__global__ void integer_values(cuda::bf16* q, const A* x, int64_t rows, int64_t k, float scale, const float* scales) {
  BERT_GRID_STRIDE(i, rows * k) {
    const cuda::ScaleDivision divide(scales ? scales[i / k] : scale);
    q[i] = __float2bfloat16_rn(fminf(fmaxf(rintf(divide(cuda::to_float(x[i]))), -128.0f), 127.0f));
  }
}

// sums (count) = sums (or 0, when first) + slice, each slice value an integer held exactly in FP32.
__global__ void add_slice(int32_t* sums, const float* slice, int64_t count, bool first) {
  BERT_GRID_STRIDE(i, count) sums[i] = (first ? 0 : sums[i]) + __float2int_rn(slice[i]);
}

// Whether int8_linear's wgmma GEMM runs on a device: the build has sm_90a code (BERT_INT8_WGMMA) and the
// GPU is compute capability 9.0 (H100, H200).
bool wgmma_runs(const Device& device) {
#if BERT_INT8_WGMMA
  const int ordinal = cuda::context(device).ordinal;
  int major = 0, minor = 0;
  BERT_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal));
  BERT_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal));
  return major == 9 && minor == 0;
#else
  (void)device;
  return false;
#endif
}

// The TMA descriptor of an int8 matrix (rows, ld), read in boxes of box_rows rows of 128 bytes with the 128-byte
// swizzle the wgmma kernel's operand descriptors expect; rows and bytes past the matrix read as zeros. `encode` is the
// driver's cuTensorMapEncodeTiled.
CUtensorMap int8_tensor_map(void* encode, const int8_t* p, int64_t rows, int64_t ld, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {cuuint64_t(ld), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(ld)};
  const cuuint32_t box[2] = {cuuint32_t(cuda::int8_wgmma::kTileK), cuuint32_t(box_rows)};
  const cuuint32_t steps[2] = {1, 1};
  const CUresult status = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(encode)(
      &map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<int8_t*>(p), dims, strides, box, steps,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  BERT_CHECK(status == CUDA_SUCCESS, "int8_linear: cuTensorMapEncodeTiled failed (" + std::to_string(int(status)) +
                                         ") for " + std::to_string(rows) + " rows of " + std::to_string(ld) + " bytes");
  return map;
}

// The dequantized product of q (rows, w.ld()) and w, finished by e, in one kernel (cuda/int8_wgmma.cuh).
template <typename A, typename O>
void launch_wgmma(const Graph<float>& g, const cuda::Int8Epilogue& e, const int8_t* q, const DeviceInt8Weights& w,
                  int64_t rows, bool gelu) {
  namespace wg = cuda::int8_wgmma;
  BERT_CHECK(rows < (int64_t{1} << 31) && w.ld() < (int64_t{1} << 31), "int8_linear: too large for the TMA kernel");
  using Kernel = void (*)(const CUtensorMap, const CUtensorMap, const cuda::Int8Epilogue, int64_t, int64_t, int64_t);
  Kernel kernel = nullptr;
  if constexpr (std::is_same_v<O, int8_t>) {  // every part quantized
    kernel = gelu ? wg::gemm_dequantize<A, O, true, true> : wg::gemm_dequantize<A, O, false, true>;
  } else if (quantizes(e)) {
    kernel = gelu ? wg::gemm_dequantize<A, O, true, true> : wg::gemm_dequantize<A, O, false, true>;
  } else {
    kernel = gelu ? wg::gemm_dequantize<A, O, true, false> : wg::gemm_dequantize<A, O, false, false>;
  }
  constexpr int shared = wg::kSharedBytes<O>;
  BERT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  const int64_t row_tiles = (rows + wg::kTileM - 1) / wg::kTileM;
  BERT_CHECK(row_tiles <= 65535, "int8_linear: " + std::to_string(rows) + " rows exceed the GPU kernel's grid");
  const dim3 grid(unsigned((w.n() + wg::kTileN - 1) / wg::kTileN), unsigned(row_tiles));
  const CUtensorMap q_map = int8_tensor_map(w.encode_tensor_map(), q, rows, w.ld(), wg::kTileM);
  kernel<<<grid, wg::kThreads, shared, cuda::stream(g)>>>(q_map, *static_cast<const CUtensorMap*>(w.tensor_map()), e,
                                                          rows, w.n(), w.ld());
  BERT_CUDA_LAUNCHED();
}

// Rows of k int8 values into rows of ld bytes, zero past k.
__global__ void pad_rows(int8_t* q, const int8_t* x, int64_t rows, int64_t k, int64_t ld) {
  BERT_GRID_STRIDE(i, rows * ld) {
    const int64_t r = i / ld, c = i - r * ld;
    q[i] = c < k ? x[r * k + c] : int8_t{0};
  }
}

// The epilogue of one unquantized output y (n columns).
cuda::Int8Epilogue whole_output(void* y, int64_t n, float scale_x, const float* scale_w, const float* bias) {
  cuda::Int8Epilogue e{scale_x, scale_w, bias, {}, {}, {}, {}};
  for (int p = 0; p < 3; ++p) e.set_part(p, n, y, 0.0f);
  return e;
}

}  // namespace

Var exact_quantized_linear(Graph<float>& g, Var x, float scale_x, Var weight, std::span<const float> scale_w, Var bias,
                           bool gelu) {
  const DType dtype = g.activation_dtype();
  const Shape& xs = g.shape(x);
  const int64_t rows = xs.rows(), n = g.shape(weight)[0], k = g.shape(weight)[1];
  Var y =
      bias.valid() ? g.emit(xs.with_last(n), {x, weight, bias}, dtype) : g.emit(xs.with_last(n), {x, weight}, dtype);
  if (rows == 0) return y;
  const float* scales = g.upload(scale_w.data(), scale_w.size());
  cuda::bf16* a = g.scratch<cuda::bf16>(rows * k);
  cuda::bf16* b = g.scratch<cuda::bf16>(n * k);
  cuda::with_element_type(g.dtype(x), [&](auto tag) {
    using X = typename decltype(tag)::type;
    BERT_LAUNCH(integer_values<X>, rows * k, g, a, cuda::typed<X>(g.data(x)), rows, k, scale_x, nullptr);
  });
  cuda::with_element_type(g.dtype(weight), [&](auto tag) {
    using W = typename decltype(tag)::type;
    BERT_LAUNCH(integer_values<W>, n * k, g, b, cuda::typed<W>(g.data(weight)), n, k, 0.0f, scales);
  });
  // BF16 tensor-core GEMMs with FP32 sums over slices of up to kExactDepth inputs: every partial sum is an
  // integer below 2^24 in magnitude (|a b| <= 2^14), exact in FP32 whatever the order; the slices added in
  // int32 (one slice: its FP32 sums as they are). The products of the int8 engine, by another kernel family.
  constexpr int64_t kExactDepth = 1024;
  float* slice = g.scratch<float>(rows * n);
  int32_t* sums = k > kExactDepth ? g.scratch<int32_t>(rows * n) : nullptr;
  for (int64_t first = 0; first < k; first += kExactDepth) {
    const int64_t depth = std::min(kExactDepth, k - first);
    const float one = 1.0f, zero = 0.0f;
    // Column-major: slice^T (n, rows) = b[:, first:] (n, depth) a[:, first:]^T.
    BERT_CUBLAS_CHECK(cublasGemmEx(cuda::cublas(g), CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(rows), int(depth), &one,
                                   b + first, CUDA_R_16BF, int(k), a + first, CUDA_R_16BF, int(k), &zero, slice,
                                   CUDA_R_32F, int(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    if (sums) BERT_LAUNCH(add_slice, rows * n, g, sums, slice, rows * n, first == 0);
  }
  const float* bv = bias.valid() ? g.value(bias).data() : g.scratch<float>(n);
  if (!bias.valid()) g.device().fill_zero(const_cast<float*>(bv), n * sizeof(float));
  const cuda::Int8Epilogue e = whole_output(g.data(y), n, scale_x, scales, bv);
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    if (sums)
      launch_dequantize<A, A>(g, e, 1, sums, rows, n, n, gelu);
    else
      launch_dequantize<A, A>(g, e, 1, static_cast<const float*>(slice), rows, n, n, gelu);
  });
  return y;
}

std::vector<Var> int8_linear(Graph<float>& g, Var x, const DeviceInt8Weights& weights, float scale_x, bool gelu,
                             std::span<const Int8OutputPart> parts, bool integers, DeviceInt8Gemm gemm) {
  const bool given_integers = g.dtype(x) == DType::kS8;  // the input quantized already (at scale_x)
  if (!given_integers) x = as_activation(g, x);          // as the fake-quantized model's quantizer reads it
  const DType dtype = g.activation_dtype();
  const Shape& xs = g.shape(x);
  const int64_t rows = xs.rows(), k = weights.k(), n = weights.n(), ld = weights.ld();
  std::vector<Var> outputs;
  cuda::Int8Epilogue e{scale_x, weights.scales(), weights.bias(), {}, {}, {}, {}};
  int64_t end = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    outputs.push_back(g.emit(xs.with_last(parts[p].columns), {x}, integers ? DType::kS8 : dtype));
    end += parts[p].columns;
    e.set_part(int(p), end, g.data(outputs.back()), parts[p].scale);
  }
  for (size_t p = parts.size(); p < 3; ++p) e.set_part(int(p), n, e.out[parts.size() - 1], 0.0f);
  if (rows == 0) return outputs;
  const int8_t* q = nullptr;
  if (given_integers && k == ld) {
    q = static_cast<const int8_t*>(g.data(x));
  } else {
    int8_t* padded = g.scratch<int8_t>(rows * ld);
    if (given_integers) {
      BERT_LAUNCH(pad_rows, rows * ld, g, padded, static_cast<const int8_t*>(g.data(x)), rows, k, ld);
    } else {
      cuda::with_element_type(dtype, [&](auto tag) {
        using A = typename decltype(tag)::type;
        const A* xv = cuda::typed<A>(g.data(x));
        if (k == ld && reinterpret_cast<uintptr_t>(xv) % 32 == 0)
          BERT_LAUNCH(quantize_rows_packed<A>, rows * k / 8, g, padded, xv, rows * k, scale_x);
        else
          BERT_LAUNCH(quantize_rows<A>, rows * (ld / 4), g, padded, xv, rows, k, ld, scale_x);
      });
    }
    q = padded;
  }
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    auto run = [&](auto out_tag) {
      using O = typename decltype(out_tag)::type;
      if (gemm == DeviceInt8Gemm::kFastest && weights.tensor_map()) {
        launch_wgmma<A, O>(g, e, q, weights, rows, gelu);
      } else {
        const int64_t ld_sums = (n + 3) / 4 * 4;  // 16-byte aligned rows
        int32_t* sums = g.scratch<int32_t>(rows * ld_sums);
        integer_gemm(g, q, rows, weights, sums, ld_sums);
        launch_dequantize<A, O>(g, e, int(parts.size()), sums, rows, n, ld_sums, gelu);
      }
    };
    if (integers)
      run(cuda::TypeTag<int8_t>{});
    else
      run(cuda::TypeTag<A>{});
  });
  return outputs;
}

void* int8_weights_tensor_map(const Device& device, const int8_t* weights, int64_t n, int64_t ld, void* map) {
  if (!wgmma_runs(device)) return nullptr;
  void* encode = nullptr;
  cudaDriverEntryPointQueryResult found{};
  BERT_CUDA_CHECK(
      cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &encode, 12000, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || !encode) return nullptr;  // cuBLASLt's GEMM then
  static_assert(sizeof(CUtensorMap) == 128);
  const CUtensorMap m = int8_tensor_map(encode, weights, n, ld, cuda::int8_wgmma::kTileN);
  std::memcpy(map, &m, sizeof m);
  return encode;
}

}  // namespace bert::ops::cuda_impl
