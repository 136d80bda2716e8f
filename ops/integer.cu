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
#include "ops/cuda/mma.cuh"
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
      bytes[j] = static_cast<int8_t>(c + j < k ? cuda::int8_of(cuda::to_float(x[r * k + c + j]), divide) : 0.0f);
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
    for (int j = 0; j < 8; ++j) out.v[j] = static_cast<int8_t>(cuda::int8_of(cuda::to_float(in.v[j]), divide));
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
  const float scale_x = e.input_scale();
  BERT_GRID_STRIDE_PACKS(i, rows * n, W) {
    const int64_t r = i / n, c = i - r * n;
    const int p = e.part(c);
    const float scale = cuda::Int8Epilogue::pick(p, e.scale), reciprocal = cuda::Int8Epilogue::pick(p, e.reciprocal);
    const cuda::Pack<S, W> s = cuda::load_pack<W>(sums + r * ld_sums + c);
    cuda::Pack<O, W> out;
    for (int j = 0; j < W; ++j) {
      const float v = fmaf(sum_value(s.v[j]), __fmul_rn(scale_x, e.scale_w[c + j]), e.bias[c + j]);
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

// sums (count) = sums (or 0, when first) + slice, each slice value an integer held exactly in FP32.
__global__ void add_slice(int32_t* sums, const float* slice, int64_t count, bool first) {
  BERT_GRID_STRIDE(i, count) sums[i] = (first ? 0 : sums[i]) + __float2int_rn(slice[i]);
}

// Whether int8_linear's wgmma GEMM runs on a device: the build has sm_90a code (BERT_INT8_WGMMA) and the
// GPU is compute capability 9.0 (H100, H200).
bool wgmma_runs(const Device& device) {
#if BERT_INT8_WGMMA
  const CudaContext& c = cuda::context(device);
  return c.compute_major == 9 && c.compute_minor == 0;
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

// The weights operand of the wgmma GEMM: n rows of ld bytes (int8, ld a multiple of 16), their TMA descriptor,
// and the driver's cuTensorMapEncodeTiled for the activations'.
struct WgmmaWeights {
  const CUtensorMap* map;
  void* encode;
  int64_t n, ld;
};
WgmmaWeights wgmma_weights(const DeviceInt8Weights& w) {
  return {static_cast<const CUtensorMap*>(w.tensor_map()), w.encode_tensor_map(), w.n(), w.ld()};
}

// The dequantized product of q (rows, w.ld) and w, finished by e, in one kernel (cuda/int8_wgmma.cuh).
template <typename A, typename O>
void launch_wgmma(const Graph<float>& g, cuda::Int8Epilogue e, const int8_t* q, const WgmmaWeights& w, int64_t rows,
                  bool gelu) {
  namespace wg = cuda::int8_wgmma;
  BERT_CHECK(rows < (int64_t{1} << 31) && w.ld < (int64_t{1} << 31), "int8_linear: too large for the TMA kernel");
  using Kernel = void (*)(const CUtensorMap, const CUtensorMap, const cuda::Int8Epilogue, int64_t, int64_t, int64_t);
  const int64_t column_tiles = (w.n + wg::kTileN - 1) / wg::kTileN;
  const int64_t tiles = (rows + wg::one_tile::kTileM - 1) / wg::one_tile::kTileM * column_tiles;
  BERT_CHECK(tiles < (int64_t{1} << 31), "int8_linear: " + std::to_string(rows) + " rows exceed the GPU kernel's grid");
  const int sms = cuda::context(g.device()).sm_count;
  // Ping-pong where one-tile blocks would run in more than one wave: from 8 slices of K (1,024 inputs) with one
  // warpgroup a side, below with two (pairs). Against one-tile blocks on an H200 (ncu, real clocks, BERT-base
  // at 16,384 rows): 768 inputs 70.8 -> 65.7 us (Q/K/V), 25.1 -> 22.7 (attention output), 104.8 -> 101.3 (the
  // FFN's first, GELU lookup); 3,072 inputs 62.7 -> 54.4 with one a side, 56.7 with pairs.
  const bool ping_pong = tiles > int64_t{wg::one_tile::kBlocks} * sms;
  // The ping-pong kernel reads the GELU table's window (held to the table where table_window_exact), the
  // one-tile kernel the table itself; elsewhere the epilogue computes GELU and its quantizer.
  if (e.table && ping_pong && !wg::table_window_exact(e.scale[0])) e.table = nullptr;
  const int side = w.ld >= 8 * wg::kTileK ? 1 : 2;
  auto pick = [&](auto schedule) -> Kernel {
    constexpr int kSide = decltype(schedule)::value;  // warpgroups a ping-pong side, 0: one tile a block
    auto kernel = [](auto gelu, auto quantize, auto table) -> Kernel {
      constexpr bool kG = decltype(gelu)::value, kQ = decltype(quantize)::value, kT = decltype(table)::value;
      if constexpr (kSide > 0)
        return wg::gemm_ping_pong<A, O, kG, kQ, kT, kSide>;
      else
        return wg::gemm_one_tile<A, O, kG, kQ, kT>;
    };
    using T = std::true_type;
    using F = std::false_type;
    if constexpr (std::is_same_v<O, int8_t>) {  // every part quantized
      if constexpr (std::is_same_v<A, cuda::bf16>)
        if (e.table) return kernel(T{}, T{}, T{});
      return gelu ? kernel(T{}, T{}, F{}) : kernel(F{}, T{}, F{});
    } else if (quantizes(e)) {
      return gelu ? kernel(T{}, T{}, F{}) : kernel(F{}, T{}, F{});
    } else {
      return gelu ? kernel(T{}, F{}, F{}) : kernel(F{}, F{}, F{});
    }
  };
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  const Kernel kernel = !ping_pong ? pick(std::integral_constant<int, 0>{}) : side == 1 ? pick(One{}) : pick(Two{});
  const bool window = e.table != nullptr;  // (ping-pong: the GELU table's window beside the stages; int8 out)
  const int shared = !ping_pong ? wg::one_tile::kSharedBytes<O>
                     : side == 1
                         ? (window ? wg::ping_pong::kSharedBytes<int8_t, 1, true> : wg::ping_pong::kSharedBytes<O, 1>)
                         : (window ? wg::ping_pong::kSharedBytes<int8_t, 2, true> : wg::ping_pong::kSharedBytes<O, 2>);
  BERT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  // Ping-pong: a block an SM, each taking tiles in turn. Both read 128-row boxes of q.
  static_assert(wg::ping_pong::kTileM == wg::one_tile::kTileM);
  const dim3 grid{unsigned(ping_pong ? sms : tiles)};
  const int threads = !ping_pong  ? wg::one_tile::kThreads
                      : side == 1 ? wg::ping_pong::kThreads<1>
                                  : wg::ping_pong::kThreads<2>;
  const CUtensorMap q_map = int8_tensor_map(w.encode, q, rows, w.ld, wg::one_tile::kTileM);
  kernel<<<grid, threads, shared, cuda::stream(g)>>>(q_map, *w.map, e, rows, w.n, w.ld);
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

// INT8 self-attention from the integers of Q, K and V (ops::int8_attention_integers). A block takes 64 query
// rows of one (sequence, head), a warp 16 of them; the head's keys (T, D) and values, transposed (D, T), are
// in shared memory as int8, rows padded by 16 bytes (the fragments' 4-byte loads fall in distinct banks),
// T rounded up to 32 with zero keys that the mask row (-inf there) leaves out. Q K^T and P V are int8
// tensor-core products (mma.sync m16n8k32, exact int32 sums). The scores are float(sum) * scale rounded to
// the activations' type A as the fake-quantized model stores them, plus the mask; softmax as the GPU's
// softmax kernel makes it (the row's max, expf of the differences, their sum, times its reciprocal), each
// probability rounded to A and quantized by the probabilities' quantizer to [-128, 127]. Up to 128 keys
// (kResident) a row's scores stay in registers, made once; longer, three passes over the keys, 32 at a
// time, make them again in each (the row's max, the exponentials' sum, the products), the same values in
// the same order. Nothing of size T x T exists in memory.
// The probabilities of 32 keys become an A fragment in registers: the C tiles give lane (g, t) keys 2t, 2t + 1
// of each 8, the A fragment wants columns 4t .. 4t + 3, so column 4t + i holds key 2t + i (i < 2) or
// 8 + 2t + i - 2 (16 more for the second half), and V^T keeps its keys in that order.
namespace attention_int8 {
constexpr int kWarps = 4, kRows = 16 * kWarps, kChunk = 32;
constexpr int kResidentChunks = 4;  // lengths up to 128: every score of a row in registers, made once

struct Args {
  const int8_t *q, *k, *v;  // (B, T, ld) each, head h at columns h * D
  int64_t ld;
  const float* mask;  // (B, T) additive, or null
  void* y;            // (B, T, H * D) in O
  int t, heads;
  float score_scale;                    // scale_q * RN(scale_k * alpha)
  float probs_scale, probs_reciprocal;  // the probabilities' quantizer
  float context_scale;                  // scale_probs * scale_v
  float out_scale, out_reciprocal;      // O = int8: the consumer's quantizer
};

constexpr int shared_bytes(int t, int d) {
  const int tp = (t + kChunk - 1) / kChunk * kChunk;
  return tp * (d + 16) + d * (tp + 16) + tp * int(sizeof(float));
}

// K and V pieces (16 bytes of a row) a thread loads before storing any: the loads of a round in flight together
// (one round at lengths up to 128 with head size 64).
constexpr int kLoadRound = 4;

// Head size 64 with every score of a row in registers (BERT-base and -large at lengths up to 128): five blocks
// an SM, at most 102 registers (a few values spilled): 79.3 -> 75.3 us a BERT-base layer at batch 128 on an
// H200, against four blocks at 111. The other variants as the compiler lays them out (0: no minimum).
// kMask: a mask row is given or the keys are padded to a multiple of 32 (else no score has one to add).
template <typename A, typename O, int kD, bool kResident, bool kMask>
__global__ void __launch_bounds__(32 * kWarps, kD == 64 && kResident ? 5 : 0) forward(const Args a) {
  extern __shared__ __align__(16) uint8_t shared[];
  const int tp = (a.t + kChunk - 1) / kChunk * kChunk, ks_ld = kD + 16, vt_ld = tp + 16;
  int8_t* ks = reinterpret_cast<int8_t*>(shared);
  int8_t* vt = ks + tp * ks_ld;
  float* mask = reinterpret_cast<float*>(vt + kD * vt_ld);
  const int b = blockIdx.z, h = blockIdx.y;
  const int64_t head = int64_t(b) * a.t * a.ld + int64_t(h) * kD;  // the head's first value in q, k, v
  constexpr int kPieces = kD / 16;
  // Piece i of K: row i / kPieces, channels 16 (i % kPieces), stored as it is. V^T: job i takes 16 channels
  // (vc) of the four keys whose bytes make one word of V^T's permuted rows (keys kb + 2u, + 1, + 8, + 9 at
  // kb + 4u, kb a multiple of 16, u < 4: the order above), 16 words made by 4 x 4 byte transposes (byte_perm); a
  // warp's lanes store consecutive words of one row (from length 128 up: no bank conflicts). There are a
  // quarter as many jobs as pieces: a round takes kLoadRound pieces and one job a thread, loaded before any
  // is stored. Keys past the end are zeros.
  const int pieces = tp * kPieces, jobs = pieces / 4, words = tp / 4;  // words: jobs a channel group
  for (int round = 0; round * kLoadRound * 32 * kWarps < pieces; ++round) {
    uint4 key[kLoadRound], value[4];
#pragma unroll
    for (int j = 0; j < kLoadRound; ++j) {
      const int i = (round * kLoadRound + j) * 32 * kWarps + threadIdx.x;
      const int kr = i / kPieces, kc = (i % kPieces) * 16;
      key[j] = uint4{0, 0, 0, 0};
      if (i < pieces && kr < a.t) key[j] = *reinterpret_cast<const uint4*>(a.k + head + int64_t(kr) * a.ld + kc);
    }
    const int job = round * 32 * kWarps + threadIdx.x;
    const int vc = job / words * 16, kb = job % words / 4 * 16, u = job % 4;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int vr = kb + 2 * u + (e & 1) + 8 * (e >> 1);
      value[e] = uint4{0, 0, 0, 0};
      if (job < jobs && vr < a.t) value[e] = *reinterpret_cast<const uint4*>(a.v + head + int64_t(vr) * a.ld + vc);
    }
#pragma unroll
    for (int j = 0; j < kLoadRound; ++j) {
      const int i = (round * kLoadRound + j) * 32 * kWarps + threadIdx.x;
      if (i >= pieces) break;
      *reinterpret_cast<uint4*>(ks + i / kPieces * ks_ld + (i % kPieces) * 16) = key[j];
    }
    if (job < jobs) {
      auto word = [](const uint4& p, int m) { return m == 0 ? p.x : m == 1 ? p.y : m == 2 ? p.z : p.w; };
#pragma unroll
      for (int m = 0; m < 4; ++m) {  // channels vc + 4m .. + 3 of the four keys
        const uint32_t low01 = __byte_perm(word(value[0], m), word(value[1], m), 0x5140);
        const uint32_t low23 = __byte_perm(word(value[2], m), word(value[3], m), 0x5140);
        const uint32_t high01 = __byte_perm(word(value[0], m), word(value[1], m), 0x7362);
        const uint32_t high23 = __byte_perm(word(value[2], m), word(value[3], m), 0x7362);
        const uint32_t channel[4] = {__byte_perm(low01, low23, 0x5410), __byte_perm(low01, low23, 0x7632),
                                     __byte_perm(high01, high23, 0x5410), __byte_perm(high01, high23, 0x7632)};
#pragma unroll
        for (int x = 0; x < 4; ++x)
          *reinterpret_cast<uint32_t*>(vt + (vc + 4 * m + x) * vt_ld + kb + 4 * u) = channel[x];
      }
    }
  }
  if constexpr (kMask)
    for (int i = threadIdx.x; i < tp; i += blockDim.x)
      mask[i] = i < a.t ? (a.mask ? a.mask[int64_t(b) * a.t + i] : 0.0f) : -INFINITY;
  __syncthreads();
  const int lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const int row0 = blockIdx.x * kRows + (threadIdx.x / 32) * 16 + g, row1 = row0 + 8;
  if (row0 - g >= a.t) return;  // the warp's rows are all past the end
  // Q's A fragments, straight from memory (rows past the end: zeros, never written).
  uint32_t qa[kD / 32][4];
#pragma unroll
  for (int kk = 0; kk < kD / 32; ++kk) {
    const int c = kk * 32 + 4 * t4;
    const int8_t* q0 = a.q + head + int64_t(row0) * a.ld + c;
    const int8_t* q1 = a.q + head + int64_t(row1) * a.ld + c;
    qa[kk][0] = row0 < a.t ? *reinterpret_cast<const uint32_t*>(q0) : 0u;
    qa[kk][1] = row1 < a.t ? *reinterpret_cast<const uint32_t*>(q1) : 0u;
    qa[kk][2] = row0 < a.t ? *reinterpret_cast<const uint32_t*>(q0 + 16) : 0u;
    qa[kk][3] = row1 < a.t ? *reinterpret_cast<const uint32_t*>(q1 + 16) : 0u;
  }
  // The scores of chunk c: s[j][e], j the 8-key tile, e as the C fragment (rows row0, row1).
  auto scores = [&](int c, float(&s)[4][4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      cuda::mma::IntAccumulator sum = {0, 0, 0, 0};
      const int8_t* key = ks + (c * kChunk + j * 8 + g) * ks_ld + 4 * t4;
#pragma unroll
      for (int kk = 0; kk < kD / 32; ++kk)
        cuda::mma::product(sum, qa[kk], *reinterpret_cast<const uint32_t*>(key + kk * 32),
                           *reinterpret_cast<const uint32_t*>(key + kk * 32 + 16));
      const int k0 = c * kChunk + j * 8 + 2 * t4;
      float v[4];  // rounded to A a pair at a time
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = __int2float_rn(sum[e]) * a.score_scale;
      cuda::round_pair<A>(v[0], v[1]);
      cuda::round_pair<A>(v[2], v[3]);
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = v[e] + (kMask ? mask[k0 + (e & 1)] : 0.0f);
    }
  };
  const int chunks = tp / kChunk;
  float max0 = -INFINITY, max1 = -INFINITY, sum0 = 0.0f, sum1 = 0.0f;
  auto take_max = [&](const float(&s)[4][4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      max0 = fmaxf(max0, fmaxf(s[j][0], s[j][1])), max1 = fmaxf(max1, fmaxf(s[j][2], s[j][3]));
  };
  auto row_max = [&] {
#pragma unroll
    for (int o = 1; o < 4; o *= 2) {
      max0 = fmaxf(max0, __shfl_xor_sync(0xFFFFFFFFu, max0, o));
      max1 = fmaxf(max1, __shfl_xor_sync(0xFFFFFFFFu, max1, o));
    }
  };
  // The exponentials of the scores in s (written over them), added into the row sums where `add`.
  auto exponentials = [&](float(&s)[4][4], bool add) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = expf(s[j][e] - (e < 2 ? max0 : max1));
      if (add) sum0 += s[j][0] + s[j][1], sum1 += s[j][2] + s[j][3];
    }
  };
  auto row_sum = [&] {
#pragma unroll
    for (int o = 1; o < 4; o *= 2) {
      sum0 += __shfl_xor_sync(0xFFFFFFFFu, sum0, o);
      sum1 += __shfl_xor_sync(0xFFFFFFFFu, sum1, o);
    }
  };
  cuda::mma::IntAccumulator context[kD / 8];
#pragma unroll
  for (int n = 0; n < kD / 8; ++n) context[n][0] = context[n][1] = context[n][2] = context[n][3] = 0;
  // Chunk c's exponentials as quantized probabilities, times its values into the context. A probability is at
  // most 1 (NaN where every key of its row is masked), so its quotient by the quantizer's scale is finite: no
  // test for infinite quotients; the integers rounded and saturated four at a time (int8_quad), which differs
  // from int8_round only for NaN (0, not -128): rows whose keys are all masked take int8_round.
  bool some_row_empty = false;  // set once the rows' maxima are known
  auto add_products = [&](int c, const float(&s)[4][4], float inv0, float inv1) {
    float u[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float prob[4];  // rounded to A a pair at a time
#pragma unroll
      for (int e = 0; e < 4; ++e) prob[e] = s[j][e] * (e < 2 ? inv0 : inv1);
      cuda::round_pair<A>(prob[0], prob[1]);
      cuda::round_pair<A>(prob[2], prob[3]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float q = prob[e] * a.probs_reciprocal;
        u[j][e] = fmaf(fmaf(-q, a.probs_scale, prob[e]), a.probs_reciprocal, q);
      }
    }
    uint32_t pa[4];
    if (!some_row_empty) {
      pa[0] = cuda::int8_quad(u[0][0], u[0][1], u[1][0], u[1][1]);
      pa[1] = cuda::int8_quad(u[0][2], u[0][3], u[1][2], u[1][3]);
      pa[2] = cuda::int8_quad(u[2][0], u[2][1], u[3][0], u[3][1]);
      pa[3] = cuda::int8_quad(u[2][2], u[2][3], u[3][2], u[3][3]);
    } else {
      auto r = [&](int j, int e) { return int(cuda::int8_round(u[j][e])); };
      pa[0] = cuda::mma::pack_s8(r(0, 0), r(0, 1), r(1, 0), r(1, 1));
      pa[1] = cuda::mma::pack_s8(r(0, 2), r(0, 3), r(1, 2), r(1, 3));
      pa[2] = cuda::mma::pack_s8(r(2, 0), r(2, 1), r(3, 0), r(3, 1));
      pa[3] = cuda::mma::pack_s8(r(2, 2), r(2, 3), r(3, 2), r(3, 3));
    }
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      const int8_t* value = vt + (n * 8 + g) * vt_ld + c * kChunk + 4 * t4;
      cuda::mma::product(context[n], pa, *reinterpret_cast<const uint32_t*>(value),
                         *reinterpret_cast<const uint32_t*>(value + 16));
    }
  };
  if constexpr (kResident) {  // up to kResidentChunks chunks: the scores made once, kept in registers
    float s[kResidentChunks][4][4];
#pragma unroll
    for (int c = 0; c < kResidentChunks; ++c)
      if (c < chunks) scores(c, s[c]), take_max(s[c]);
    row_max();
    some_row_empty = !__all_sync(0xFFFFFFFFu, max0 > -INFINITY && max1 > -INFINITY);
#pragma unroll
    for (int c = 0; c < kResidentChunks; ++c)
      if (c < chunks) exponentials(s[c], true);
    row_sum();
    const float inv0 = 1.0f / sum0, inv1 = 1.0f / sum1;
#pragma unroll
    for (int c = 0; c < kResidentChunks; ++c)
      if (c < chunks) add_products(c, s[c], inv0, inv1);
  } else {  // three passes, the scores made again in each
    for (int c = 0; c < chunks; ++c) {
      float s[4][4];
      scores(c, s);
      take_max(s);
    }
    row_max();
    some_row_empty = !__all_sync(0xFFFFFFFFu, max0 > -INFINITY && max1 > -INFINITY);
    for (int c = 0; c < chunks; ++c) {
      float s[4][4];
      scores(c, s);
      exponentials(s, true);
    }
    row_sum();
    const float inv0 = 1.0f / sum0, inv1 = 1.0f / sum1;
    for (int c = 0; c < chunks; ++c) {
      float s[4][4];
      scores(c, s);
      exponentials(s, false);
      add_products(c, s, inv0, inv1);
    }
  }
  // Lane (g, t) has rows row0, row1, channels 8n + 2t, + 1 of the head: the context in A, or its integers at
  // the consumer's scale (the stored context quantized, as the fake-quantized model quantizes it).
  O* y = static_cast<O*>(a.y);
  const int64_t width = int64_t(a.heads) * kD;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = half ? row1 : row0;
    if (row >= a.t) continue;
    O* out = y + (int64_t(b) * a.t + row) * width + int64_t(h) * kD + 2 * t4;
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      float v[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) v[e] = __int2float_rn(context[n][2 * half + e]) * a.context_scale;
      if constexpr (std::is_same_v<O, int8_t>) {  // (a finite context: int8_pair's integers are int8_round's)
        cuda::round_pair<A>(v[0], v[1]);          // as stored
        const uint16_t integers =
            cuda::int8_pair(cuda::ScaleDivision::normal_quotient(v[0], a.out_scale, a.out_reciprocal),
                            cuda::ScaleDivision::normal_quotient(v[1], a.out_scale, a.out_reciprocal));
        *reinterpret_cast<uint16_t*>(out + n * 8) = integers;
      } else {
        cuda::Pack<O, 2> pair;
        for (int e = 0; e < 2; ++e) pair.v[e] = cuda::from_float<O>(v[e]);
        cuda::store_pack<2>(out + n * 8, pair);
      }
    }
  }
}
}  // namespace attention_int8
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
    BERT_LAUNCH((cuda::int8_values<cuda::bf16, X>), rows * k, g, a, cuda::typed<X>(g.data(x)), rows, k, scale_x,
                nullptr, int64_t{1});
  });
  cuda::with_element_type(g.dtype(weight), [&](auto tag) {
    using W = typename decltype(tag)::type;
    BERT_LAUNCH((cuda::int8_values<cuda::bf16, W>), n * k, g, b, cuda::typed<W>(g.data(weight)), n, k, 0.0f, scales, n);
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
        // BF16 GELU into one quantized part: the epilogue looks the integers up (int8_epilogue_table), in the
        // part's table where it has one at its scale (made once), else in one made for this call.
        if (std::is_same_v<A, cuda::bf16> && std::is_same_v<O, int8_t> && gelu && parts.size() == 1) {
          const DeviceGeluTable* made = parts[0].gelu_table;
          if (made && made->scale() == parts[0].scale) {
            e.table = made->data();
          } else {
            int8_t* table = g.scratch<int8_t>(65536);
            BERT_LAUNCH(cuda::int8_epilogue_table, 65536, g, table, e.scale[0], e.reciprocal[0]);
            e.table = table;
          }
        }
        launch_wgmma<A, O>(g, e, q, wgmma_weights(weights), rows, gelu);
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

namespace {

// q (count) int8 = the integers behind fake-quantized values x (rows of k, k a multiple of 16): round(x / scale)
// half to even, clamped to [-128, 127] (int8_of, the fake quantizer's division), row r at scales[r * scale_step]
// in device memory (scale_step 0: one scale for all). x is some integer times the scale rounded to x's type,
// within 2^-9 of it relatively in BF16, so the quotient rounds back to that integer: exactly the quantizer's.
// 16 values a thread (one 16-byte store).
template <typename A>
__global__ void integers_behind(int8_t* q, const A* x, int64_t count, int64_t k, const float* scales, int scale_step) {
  BERT_GRID_STRIDE_PACKS(i, count, 16) {
    const cuda::ScaleDivision divide(scales[(i / k) * scale_step]);
    const cuda::Pack<A, 16> in = cuda::load_pack<16>(x + i);
    cuda::Pack<int8_t, 16> out;
#pragma unroll
    for (int j = 0; j < 16; ++j) out.v[j] = static_cast<int8_t>(cuda::int8_of(cuda::to_float(in.v[j]), divide));
    cuda::store_pack<16>(q + i, out);
  }
}

// The driver's cuTensorMapEncodeTiled, or nullptr where the driver has none.
void* tensor_map_encoder() {
  void* encode = nullptr;
  cudaDriverEntryPointQueryResult found{};
  BERT_CUDA_CHECK(
      cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &encode, 12000, cudaEnableDefault, &found));
  return found == cudaDriverEntryPointSuccess ? encode : nullptr;
}

}  // namespace

template <typename A>
bool quantized_linear_product(Graph<float>& g, const A* x, const int8_t* x_integers, const float* scale_x,
                              std::span<const QuantizedWeights<A>> parts, A* y, int64_t rows, int64_t in) {
  namespace wg = cuda::int8_wgmma;
  constexpr uintptr_t kPack = 16 * sizeof(A);  // integers_behind's loads
  auto aligned = [&](const void* p, uintptr_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; };
  int64_t out = 0;
  bool fits = wgmma_runs(g.device()) && in % 16 == 0 && rows > 0 && !parts.empty() &&
              (x_integers ? aligned(x_integers, 16) : aligned(x, kPack)) && aligned(y, 16) &&
              rows < (int64_t{1} << 31) && in < (int64_t{1} << 31);
  for (const QuantizedWeights<A>& p : parts)
    fits = fits && (p.integers ? aligned(p.integers, 16) : aligned(p.w, kPack)), out += p.rows;
  void* encode = fits ? tensor_map_encoder() : nullptr;
  if (!encode) return false;
  const CudaContext& context = cuda::context(g.device());
  // The integers the quantizers did not write, made here from the values: they live while this op's forward
  // runs (Graph::transient), the GEMM reading them in stream order.
  const int8_t* qx = x_integers;
  if (!qx) {
    int8_t* made = g.transient<int8_t>(0, std::size_t(rows * in));
    BERT_LAUNCH(integers_behind<A>, rows * in / 16, g, made, x, rows * in, in, scale_x, 0);
    qx = made;
  }
  // Each part's weight scales and biases side by side where there are several (the GEMM's one weight).
  const bool one = parts.size() == 1;
  const int8_t* qw = one ? parts[0].integers : nullptr;
  int8_t* stacked = qw ? nullptr : g.transient<int8_t>(1, std::size_t(out * in));
  float* scales = one ? nullptr : g.scratch<float>(std::size_t(out));
  float* biases = one && parts[0].bias ? nullptr : g.scratch<float>(std::size_t(out));
  int64_t at = 0;
  for (const QuantizedWeights<A>& p : parts) {
    if (stacked && p.integers)
      cuda::copy_on_device(context, stacked + at * in, p.integers, std::size_t(p.rows * in));
    else if (stacked)
      BERT_LAUNCH(integers_behind<A>, p.rows * in / 16, g, stacked + at * in, p.w, p.rows * in, in, p.scales, 1);
    const std::size_t bytes = std::size_t(p.rows) * sizeof(float);
    if (scales) cuda::copy_on_device(context, scales + at, p.scales, bytes);
    if (biases && p.bias) cuda::copy_on_device(context, biases + at, p.bias, bytes);
    if (biases && !p.bias) cuda::fill_zero(context, biases + at, bytes);
    at += p.rows;
  }
  cuda::Int8Epilogue e = whole_output(y, out, 1.0f, one ? parts[0].scales : scales, biases ? biases : parts[0].bias);
  e.scale_x_at = scale_x;
  if (!qw) qw = stacked;
  const CUtensorMap w_map = int8_tensor_map(encode, qw, out, in, wg::kTileN);
  launch_wgmma<A, A>(g, e, qx, WgmmaWeights{&w_map, encode, out, in}, rows, /*gelu=*/false);
  return true;
}
template bool quantized_linear_product<float>(Graph<float>&, const float*, const int8_t*, const float*,
                                              std::span<const QuantizedWeights<float>>, float*, int64_t, int64_t);
template bool quantized_linear_product<cuda::bf16>(Graph<float>&, const cuda::bf16*, const int8_t*, const float*,
                                                   std::span<const QuantizedWeights<cuda::bf16>>, cuda::bf16*, int64_t,
                                                   int64_t);

bool int8_attention_fits(const Graph<float>& g, int64_t head_size, int64_t length) {
  if ((head_size != 32 && head_size != 64 && head_size != 128) || length < 1 || length > 512) return false;
  // (int8 mma.sync: sm_80 and later.)
  const CudaContext& c = cuda::context(g.device());
  return c.compute_major >= 8 && size_t(attention_int8::shared_bytes(int(length), int(head_size))) <= c.shared_optin;
}

Var int8_attention(Graph<float>& g, Var q, Var k, Var v, Var mask, int64_t heads, const Int8AttentionScales& scales,
                   double alpha, float out_scale) {
  namespace at = attention_int8;
  const Shape& qs = g.shape(q);
  const int64_t batch = qs[0], t = qs[1], width = qs[2], d = width / heads;
  const DType dtype = g.activation_dtype(), out_dtype = out_scale > 0 ? DType::kS8 : dtype;
  Var y = mask.valid() ? g.emit(qs, {q, k, v, mask}, out_dtype) : g.emit(qs, {q, k, v}, out_dtype);
  if (batch * t == 0) return y;
  BERT_CHECK(batch <= 65535 && heads <= 65535, "int8_attention_integers: " + std::to_string(batch) + " sequences or " +
                                                   std::to_string(heads) + " heads exceed the GPU kernel's grid");
  at::Args a{};
  a.q = static_cast<const int8_t*>(g.data(q));
  a.k = static_cast<const int8_t*>(g.data(k));
  a.v = static_cast<const int8_t*>(g.data(v));
  a.ld = width;
  a.mask = mask.valid() ? static_cast<const float*>(g.data(mask)) : nullptr;
  a.y = g.data(y);
  a.t = int(t), a.heads = int(heads);
  // The scales as the CPU's integer attention forms them (int8_matmul: the second operand's scale times
  // alpha, rounded to float, times the first's).
  a.score_scale = scales.q * static_cast<float>(scales.k * alpha);
  a.probs_scale = scales.probs, a.probs_reciprocal = 1.0f / scales.probs;
  a.context_scale = scales.probs * scales.v;
  a.out_scale = out_scale > 0 ? out_scale : 1.0f, a.out_reciprocal = 1.0f / a.out_scale;
  const int shared = at::shared_bytes(int(t), int(d));
  const dim3 grid(unsigned((t + at::kRows - 1) / at::kRows), unsigned(heads), unsigned(batch));
  cuda::with_element_type(dtype, [&](auto tag) {
    using A = typename decltype(tag)::type;
    auto launch = [&](auto out_tag) {
      using O = typename decltype(out_tag)::type;
      const bool resident = (t + at::kChunk - 1) / at::kChunk <= at::kResidentChunks;
      const bool masked = mask.valid() || t % at::kChunk != 0;
      auto pick = [&](auto d_tag) -> void (*)(const at::Args) {
        constexpr int D = decltype(d_tag)::value;
        if (resident) return masked ? at::forward<A, O, D, true, true> : at::forward<A, O, D, true, false>;
        return masked ? at::forward<A, O, D, false, true> : at::forward<A, O, D, false, false>;
      };
      void (*kernel)(const at::Args) = d == 32   ? pick(std::integral_constant<int, 32>{})
                                       : d == 64 ? pick(std::integral_constant<int, 64>{})
                                                 : pick(std::integral_constant<int, 128>{});
      BERT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
      kernel<<<grid, 32 * at::kWarps, shared, cuda::stream(g)>>>(a);
      BERT_CUDA_LAUNCHED();
    };
    if (out_scale > 0)
      launch(cuda::TypeTag<int8_t>{});
    else
      launch(cuda::TypeTag<A>{});
  });
  return y;
}

void int8_gelu_table(const Device& device, int8_t* table, float scale) {
  cuda::Int8Epilogue e{};
  e.set_part(0, 1, nullptr, scale);  // the reciprocal as int8_linear's epilogue forms it
  BERT_LAUNCH(cuda::int8_epilogue_table, 65536, device, table, e.scale[0], e.reciprocal[0]);
}

void* int8_weights_tensor_map(const Device& device, const int8_t* weights, int64_t n, int64_t ld, void* map) {
  if (!wgmma_runs(device)) return nullptr;
  void* encode = tensor_map_encoder();
  if (!encode) return nullptr;  // cuBLASLt's GEMM then
  static_assert(sizeof(CUtensorMap) == 128);
  const CUtensorMap m = int8_tensor_map(encode, weights, n, ld, cuda::int8_wgmma::kTileN);
  std::memcpy(map, &m, sizeof m);
  return encode;
}

}  // namespace bert::ops::cuda_impl
