// The CUDA side of a Device: its stream, cuBLAS handle and a few small buffers kernels share. Only
// the files of a CUDA build include this (core/device.cpp and the ops/*.cu kernels).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/device.h"

struct CUstream_st;
struct cublasContext;
struct cublasLtContext;

namespace bert {

struct LtPlans;  // core/cuda/lt_plans.h

struct CudaContext {
  int ordinal = 0;
  Precision precision = Precision::kFp32;
  CUstream_st* stream = nullptr;
  cublasContext* cublas = nullptr;
  cublasLtContext* cublas_lt = nullptr;  // for GEMMs with a fused bias epilogue
  LtPlans* lt_plans = nullptr;           // their descriptors and algorithms, by shape
  void* cublas_workspace = nullptr;
  std::size_t cublas_workspace_bytes = 0;
  double* reduce_scratch = nullptr;  // kReduceScratch doubles for two-pass reductions
  // For kernels whose last block to finish completes a reduction: blocks count their arrival here (kArrivals
  // counters, one per group of blocks that finish a reduction together; [0] for a whole grid), and the last
  // one resets its counter to 0 for the next kernel on the stream.
  unsigned int* arrivals = nullptr;
  static constexpr unsigned kArrivals = 4096;
  static constexpr std::size_t kReduceScratch = std::size_t{1} << 16;
  void* host_staging = nullptr;  // pinned, kHostStaging bytes: small device -> host reads
  static constexpr std::size_t kHostStaging = std::size_t{1} << 20;
  // Pinned ring that host -> device copies pass through, so they never wait for the stream (a copy
  // from pageable memory may): kUploadRing bytes, the next free byte at upload_offset.
  void* upload_ring = nullptr;
  static constexpr std::size_t kUploadRing = std::size_t{32} << 20;
  mutable std::size_t upload_offset = 0;  // copies change only this, through a const context
  // While the stream's work is being recorded into a CUDA graph (begin_capture .. end_capture_and_launch):
  // memory is allocated on side_stream (the recording stream's allocations would be the graph's own),
  // frees wait in deferred_frees until the graph is launched, and the upload ring wraps (once) by waiting
  // for capture_start (an event recorded before the recording: what came before it has read the ring).
  CUstream_st* side_stream = nullptr;
  bool capturing = false;
  mutable std::vector<void*> deferred_frees;
  void* capture_start = nullptr;
  mutable bool ring_wrapped_in_capture = false;
  std::size_t capture_ring_start = 0;  // the upload ring's offset when the recording began
  mutable uint64_t memory_events = 0;  // allocations and frees so far (a recorded graph's addresses are current)
  std::string device_name;
  std::size_t total_memory = 0;
  // What kernels size themselves by, read once: streaming multiprocessors, compute capability, and the
  // shared memory a block may opt into.
  int sm_count = 0, compute_major = 0, compute_minor = 0;
  std::size_t shared_optin = 0;
};

namespace cuda {

int device_count();           // 0 when no driver or no GPU
std::string why_no_device();  // the runtime's explanation when device_count() is 0
CudaContext* create_context(int ordinal, Precision precision);
void destroy_context(CudaContext* context);
std::string describe(const CudaContext& context);

void* allocate(const CudaContext& c, std::size_t bytes);
void free(const CudaContext& c, void* p);
void fill_zero(const CudaContext& c, void* p, std::size_t bytes);
void copy_to_host(const CudaContext& c, void* host, const void* src, std::size_t bytes);
void copy_to_device(const CudaContext& c, void* dst, const void* host, std::size_t bytes);
void copy_on_device(const CudaContext& c, void* dst, const void* src, std::size_t bytes);
void round_to_bf16(const CudaContext& c, uint16_t* dst, const float* src, std::size_t n);
void synchronize(const CudaContext& c);
// Pinned host memory, and copies into it that return without waiting (core/readback.h); an event
// recorded on the stream and waited for by the host.
void* allocate_pinned(std::size_t bytes);
void free_pinned(void* p);
void copy_to_host_async(const CudaContext& c, void* pinned_host, const void* src, std::size_t bytes);
void* create_event();
void destroy_event(void* event);
void record_event(const CudaContext& c, void* event);
void wait_event(void* event);
std::pair<std::size_t, std::size_t> memory_use(const CudaContext& c);

// The stream's work recorded as a CUDA graph (core/step_graph.h). begin_capture starts recording (the
// work is queued, not run); end_capture_and_launch ends it and launches it: `exec` (an executable graph,
// nullptr at first) is updated in place where the recording has the same nodes as the one it was made
// from, and made afresh where not (returns true then). abandon_capture ends a recording without running
// it (after an exception). destroy_graph frees an executable graph.
void begin_capture(CudaContext& c);
bool end_capture_and_launch(CudaContext& c, void*& exec);
void abandon_capture(CudaContext& c) noexcept;
void destroy_graph(void* exec) noexcept;

// Throws InternalError naming the call and CUDA's message; kernels are checked after each launch.
void check(int status, const char* what, const char* file, int line);
void check_cublas(int status, const char* what, const char* file, int line);

}  // namespace cuda
}  // namespace bert

#define BERT_CUDA_CHECK(call) ::bert::cuda::check(static_cast<int>(call), #call, __FILE__, __LINE__)
#define BERT_CUBLAS_CHECK(call) ::bert::cuda::check_cublas(static_cast<int>(call), #call, __FILE__, __LINE__)
#define BERT_CUDA_LAUNCHED() \
  ::bert::cuda::check(static_cast<int>(cudaGetLastError()), "kernel launch", __FILE__, __LINE__)
