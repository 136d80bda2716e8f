// The CUDA device context: stream, cuBLAS handle, shared buffers, memory, copies and BF16 rounding.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <vector>

#include "core/cuda/context.h"
#include "core/cuda/lt_plans.h"
#include "sys/error.h"

namespace bert::cuda {

void check(int status, const char* what, const char* file, int line) {
  if (status == cudaSuccess) return;
  const auto error = static_cast<cudaError_t>(status);
  throw_internal_error(file, line, what,
                       std::string("CUDA error: ") + cudaGetErrorName(error) + ": " + cudaGetErrorString(error));
}

void check_cublas(int status, const char* what, const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw_internal_error(file, line, what,
                       std::string("cuBLAS error: ") + cublasGetStatusName(static_cast<cublasStatus_t>(status)));
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver" state
    return 0;
  }
  return n;
}

std::string why_no_device() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  (void)cudaGetLastError();
  return e == cudaSuccess ? "the driver reports no devices" : cudaGetErrorString(e);
}

CudaContext* create_context(int ordinal, Precision precision) {
  auto* c = new CudaContext;
  c->ordinal = ordinal;
  c->precision = precision;
  BERT_CUDA_CHECK(cudaSetDevice(ordinal));
  cudaDeviceProp prop{};
  BERT_CUDA_CHECK(cudaGetDeviceProperties(&prop, ordinal));
  c->device_name = prop.name;
  c->total_memory = prop.totalGlobalMem;
  c->sm_count = prop.multiProcessorCount;
  c->compute_major = prop.major;
  c->compute_minor = prop.minor;
  c->shared_optin = prop.sharedMemPerBlockOptin;
  cudaStream_t stream;
  BERT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  c->stream = stream;
  cudaStream_t side;
  BERT_CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  c->side_stream = side;
  c->capture_start = create_event();
  cublasHandle_t handle;
  BERT_CUBLAS_CHECK(cublasCreate(&handle));
  c->cublas = handle;
  BERT_CUBLAS_CHECK(cublasSetStream(handle, stream));
  cublasLtHandle_t lt;
  BERT_CUBLAS_CHECK(cublasLtCreate(&lt));
  c->cublas_lt = lt;
  c->lt_plans = new LtPlans;
  // TF32 only when asked: FP32 must reproduce the CPU within FP32 rounding.
  BERT_CUBLAS_CHECK(
      cublasSetMathMode(handle, precision == Precision::kTf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
  c->cublas_workspace_bytes = std::size_t{32} << 20;  // cuBLAS's recommendation for Hopper
  BERT_CUDA_CHECK(cudaMalloc(&c->cublas_workspace, c->cublas_workspace_bytes));
  BERT_CUBLAS_CHECK(cublasSetWorkspace(handle, c->cublas_workspace, c->cublas_workspace_bytes));
  BERT_CUDA_CHECK(cudaMalloc(&c->arrivals, CudaContext::kArrivals * sizeof(unsigned int)));
  BERT_CUDA_CHECK(cudaMemset(c->arrivals, 0, CudaContext::kArrivals * sizeof(unsigned int)));
  BERT_CUDA_CHECK(
      cudaMalloc(reinterpret_cast<void**>(&c->reduce_scratch), CudaContext::kReduceScratch * sizeof(double)));
  BERT_CUDA_CHECK(cudaMallocHost(&c->host_staging, CudaContext::kHostStaging));
  BERT_CUDA_CHECK(cudaMallocHost(&c->upload_ring, CudaContext::kUploadRing));
  return c;
}

void destroy_context(CudaContext* c) {
  if (!c) return;
  cudaSetDevice(c->ordinal);
  cudaStreamSynchronize(c->stream);
  cublasDestroy(c->cublas);
  delete c->lt_plans;  // before the handle its descriptors were made for
  cublasLtDestroy(c->cublas_lt);
  cudaFree(c->cublas_workspace);
  cudaFree(c->arrivals);
  cudaFree(c->reduce_scratch);
  cudaFreeHost(c->host_staging);
  cudaFreeHost(c->upload_ring);
  destroy_event(c->capture_start);
  cudaStreamDestroy(c->side_stream);
  cudaStreamDestroy(c->stream);
  delete c;
}

std::string describe(const CudaContext& c) {
  char text[160];
  std::snprintf(text, sizeof text, "cuda:%d (%s, %.1f GiB, %s)", c.ordinal, c.device_name.c_str(),
                c.total_memory / double(1 << 30), precision_name(c.precision).c_str());
  return text;
}

void* allocate(const CudaContext& c, std::size_t bytes) {
  void* p = nullptr;
  ++c.memory_events;
  // While recording, from the side stream, waited for at once: usable by the recorded work and after it.
  const cudaError_t e = cudaMallocAsync(&p, bytes == 0 ? 1 : bytes, c.capturing ? c.side_stream : c.stream);
  if (e == cudaSuccess && c.capturing) BERT_CUDA_CHECK(cudaStreamSynchronize(c.side_stream));
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    auto [used, total] = memory_use(c);
    char text[256];
    std::snprintf(text, sizeof text,
                  "out of GPU memory: %.2f GiB requested with %.2f of %.2f GiB in use on %s; "
                  "lower --batch-size (and raise --accumulate to keep the global batch) or the sequence length",
                  bytes / double(1 << 30), used / double(1 << 30), total / double(1 << 30), c.device_name.c_str());
    throw OutOfDeviceMemory(text);
  }
  BERT_CUDA_CHECK(e);
  return p;
}

void free(const CudaContext& c, void* p) {
  ++c.memory_events;
  if (c.capturing) {  // the recorded work may use it, and the work queued before the recording does
    c.deferred_frees.push_back(p);
    return;
  }
  cudaFreeAsync(p, c.stream);
}

void fill_zero(const CudaContext& c, void* p, std::size_t bytes) {
  BERT_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, c.stream));
}

namespace {
__global__ void round_to_bf16_kernel(uint16_t* dst, const float* src, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    dst[i] = __bfloat16_as_ushort(__float2bfloat16_rn(src[i]));
}
}  // namespace

void round_to_bf16(const CudaContext& c, uint16_t* dst, const float* src, std::size_t n) {
  if (n == 0) return;
  const std::size_t blocks = std::min<std::size_t>((n + 255) / 256, std::size_t{132} * 16);
  round_to_bf16_kernel<<<unsigned(blocks), 256, 0, c.stream>>>(dst, src, n);
  BERT_CUDA_LAUNCHED();
}

void copy_to_host(const CudaContext& c, void* host, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  if (bytes <= CudaContext::kHostStaging) {  // through pinned memory: one fast copy, then one memcpy
    BERT_CUDA_CHECK(cudaMemcpyAsync(c.host_staging, src, bytes, cudaMemcpyDeviceToHost, c.stream));
    BERT_CUDA_CHECK(cudaStreamSynchronize(c.stream));
    std::memcpy(host, c.host_staging, bytes);
    return;
  }
  BERT_CUDA_CHECK(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, c.stream));
  BERT_CUDA_CHECK(cudaStreamSynchronize(c.stream));
}

void copy_to_device(const CudaContext& c, void* dst, const void* host, std::size_t bytes) {
  if (bytes == 0) return;
  if (bytes > CudaContext::kUploadRing / 4) {  // large (weights): the runtime stages it, perhaps waiting
    BERT_CHECK(!c.capturing, "a step recorded as a CUDA graph uploads " + std::to_string(bytes >> 20) +
                                 " MiB at once (train with --no-cuda-graphs)");
    BERT_CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, c.stream));
    return;
  }
  // Small (batches, ids, masks): copied into the pinned ring, from there asynchronously; the caller may
  // reuse its buffer at once. Before the ring wraps, every copy out of it must have finished: one wait
  // per kUploadRing bytes uploaded (many steps).
  // While recording, the copies out of the ring run when the graph does: the ring may wrap once, after
  // the work queued before the recording (which read what it would overwrite) has finished, and never
  // over the recording's own uploads.
  if (c.capturing) {
    const std::size_t limit = c.ring_wrapped_in_capture ? c.capture_ring_start : CudaContext::kUploadRing;
    if (c.upload_offset + bytes > limit) {
      BERT_CHECK(!c.ring_wrapped_in_capture && bytes <= c.capture_ring_start,
                 "a step recorded as a CUDA graph uploads more than the " +
                     std::to_string(CudaContext::kUploadRing >> 20) +
                     " MiB upload ring holds (train with --no-cuda-graphs)");
      BERT_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(c.capture_start)));
      c.ring_wrapped_in_capture = true;
      c.upload_offset = 0;
    }
  } else if (c.upload_offset + bytes > CudaContext::kUploadRing) {
    BERT_CUDA_CHECK(cudaStreamSynchronize(c.stream));
    c.upload_offset = 0;
  }
  void* staged = static_cast<std::byte*>(c.upload_ring) + c.upload_offset;
  std::memcpy(staged, host, bytes);
  BERT_CUDA_CHECK(cudaMemcpyAsync(dst, staged, bytes, cudaMemcpyHostToDevice, c.stream));
  c.upload_offset += (bytes + 255) / 256 * 256;
}

void copy_on_device(const CudaContext& c, void* dst, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  BERT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c.stream));
}

void synchronize(const CudaContext& c) { BERT_CUDA_CHECK(cudaStreamSynchronize(c.stream)); }

void* allocate_pinned(std::size_t bytes) {
  void* p = nullptr;
  BERT_CUDA_CHECK(cudaMallocHost(&p, bytes == 0 ? 1 : bytes));
  return p;
}
void free_pinned(void* p) {
  if (p) cudaFreeHost(p);
}
void copy_to_host_async(const CudaContext& c, void* pinned_host, const void* src, std::size_t bytes) {
  if (bytes == 0) return;
  BERT_CUDA_CHECK(cudaMemcpyAsync(pinned_host, src, bytes, cudaMemcpyDeviceToHost, c.stream));
}
void* create_event() {
  cudaEvent_t e = nullptr;
  BERT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}
void destroy_event(void* event) {
  if (event) cudaEventDestroy(static_cast<cudaEvent_t>(event));
}
void record_event(const CudaContext& c, void* event) {
  BERT_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), c.stream));
}
void wait_event(void* event) { BERT_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event))); }

void begin_capture(CudaContext& c) {
  BERT_CHECK(!c.capturing, "begin_capture: the stream is being recorded already");
  record_event(c, c.capture_start);
  // Relaxed: the host may wait for other streams and events while recording (allocate, copy_to_device).
  BERT_CUDA_CHECK(cudaStreamBeginCapture(c.stream, cudaStreamCaptureModeRelaxed));
  c.capturing = true;
  c.ring_wrapped_in_capture = false;
  c.capture_ring_start = c.upload_offset;
}

namespace {
// The frees asked for while recording, queued after the graph (or, abandoned, after what came before).
void release_deferred(const CudaContext& c) {
  for (void* p : c.deferred_frees) cudaFreeAsync(p, c.stream);
  c.deferred_frees.clear();
}
}  // namespace

bool end_capture_and_launch(CudaContext& c, void*& exec) {
  BERT_CHECK(c.capturing, "end_capture_and_launch: the stream is not being recorded");
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(c.stream, &graph);
  c.capturing = false;
  if (ended != cudaSuccess) {
    release_deferred(c);
    BERT_CUDA_CHECK(ended);
  }
  bool made = false;
  if (exec) {
    cudaGraphExecUpdateResultInfo info{};
    if (cudaGraphExecUpdate(static_cast<cudaGraphExec_t>(exec), graph, &info) != cudaSuccess) {
      (void)cudaGetLastError();  // another shape of step: made afresh below
      destroy_graph(exec);
      exec = nullptr;
    }
  }
  if (!exec) {
    cudaGraphExec_t made_exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&made_exec, graph, 0);
    if (e != cudaSuccess) cudaGraphDestroy(graph);
    BERT_CUDA_CHECK(e);
    exec = made_exec;
    made = true;
  }
  cudaGraphDestroy(graph);
  BERT_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec), c.stream));
  release_deferred(c);
  return made;
}

void abandon_capture(CudaContext& c) noexcept {
  if (!c.capturing) return;
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(c.stream, &graph);
  if (graph) cudaGraphDestroy(graph);
  (void)cudaGetLastError();
  c.capturing = false;
  release_deferred(c);
}

void destroy_graph(void* exec) noexcept {
  if (exec) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec));
}

std::pair<std::size_t, std::size_t> memory_use(const CudaContext& c) {
  std::size_t free_bytes = 0, total = 0;
  if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) return {0, c.total_memory};
  return {total - free_bytes, total};
}

}  // namespace bert::cuda
