#include "train/nccl_communicator.h"

#include <dlfcn.h>

#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>

#include "sys/error.h"

#if BERT_WITH_CUDA
#include <cuda_runtime.h>
#include <nccl.h>

#include "core/cuda/context.h"
#endif

namespace bert::train {

#if BERT_WITH_CUDA

namespace {

// The NCCL functions used, resolved from the shared library at run time.
struct Nccl {
  void* library = nullptr;
  std::string loaded_from;
  ncclResult_t (*get_version)(int*) = nullptr;
  ncclResult_t (*get_unique_id)(ncclUniqueId*) = nullptr;
  ncclResult_t (*comm_init_rank)(ncclComm_t*, int, ncclUniqueId, int) = nullptr;
  ncclResult_t (*all_reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                             cudaStream_t) = nullptr;
  ncclResult_t (*comm_destroy)(ncclComm_t) = nullptr;
  ncclResult_t (*comm_abort)(ncclComm_t) = nullptr;
  const char* (*get_error_string)(ncclResult_t) = nullptr;
  std::string error;  // why it could not be loaded
};

// Loaded once per process and kept (NCCL's own state is per process too).
const Nccl& nccl() {
  static const Nccl loaded = [] {
    Nccl n;
    const char* chosen = std::getenv("BERT_NCCL_LIBRARY");
    n.loaded_from = chosen && *chosen ? chosen : "libnccl.so.2";
    n.library = ::dlopen(n.loaded_from.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!n.library) {
      const char* why = ::dlerror();
      n.error = "cannot load NCCL ('" + n.loaded_from + "'" + (why ? std::string(": ") + why : "") +
                "): install it (the CUDA toolkit's, or PyTorch's nvidia-nccl package) and put its folder in "
                "LD_LIBRARY_PATH, or set BERT_NCCL_LIBRARY to the file";
      return n;
    }
    auto resolve = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(n.library, name));
      if (!fn && n.error.empty()) n.error = "'" + n.loaded_from + "' has no " + name + ": not NCCL 2.10 or newer?";
    };
    resolve(n.get_version, "ncclGetVersion");
    resolve(n.get_unique_id, "ncclGetUniqueId");
    resolve(n.comm_init_rank, "ncclCommInitRank");
    resolve(n.all_reduce, "ncclAllReduce");
    resolve(n.comm_destroy, "ncclCommDestroy");
    resolve(n.comm_abort, "ncclCommAbort");
    resolve(n.get_error_string, "ncclGetErrorString");
    int version = 0;
    if (n.error.empty() && (n.get_version(&version) != ncclSuccess || version < 21000))
      n.error = "'" + n.loaded_from + "' is NCCL " + std::to_string(version) + ": 2.10 or newer is needed (ncclAvg)";
    return n;
  }();
  return loaded;
}

void check(ncclResult_t result, const char* what, int rank) {
  if (result == ncclSuccess) return;
  throw UserError(std::string("NCCL ") + what + " failed on rank " + std::to_string(rank) + ": " +
                  nccl().get_error_string(result) + " (NCCL_DEBUG=INFO in the environment makes NCCL say more)");
}

class NcclRank final : public Communicator {
 public:
  NcclRank(const ProcessGroup& group, const Device& device) : group_(group), device_(device) {
    const CudaContext& c = *device.cuda_context();
    BERT_CUDA_CHECK(cudaSetDevice(c.ordinal));
    ncclUniqueId id{};
    if (group.rank == 0) {
      check(nccl().get_unique_id(&id), "ncclGetUniqueId", group.rank);
      publish_rendezvous(group.rendezvous, std::span<const char>(id.internal, sizeof id.internal));
    } else {
      const char* text = std::getenv("BERT_RENDEZVOUS_TIMEOUT");
      const long seconds = text && *text ? std::strtol(text, nullptr, 10) : 300;
      const std::vector<char> bytes =
          await_rendezvous(group.rendezvous, sizeof id.internal, std::chrono::seconds(seconds > 0 ? seconds : 300));
      std::copy(bytes.begin(), bytes.end(), id.internal);
    }
    check(nccl().comm_init_rank(&comm_, group.size, id, group.rank), "ncclCommInitRank", group.rank);
    // Collectives run on a stream of their own, so gradient buckets travel while the backward pass
    // goes on; events order them against the device's stream.
    BERT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    BERT_CUDA_CHECK(cudaEventCreateWithFlags(&queued_, cudaEventDisableTiming));
    BERT_CUDA_CHECK(cudaEventCreateWithFlags(&reduced_, cudaEventDisableTiming));
    // Every rank has joined (the initialisation is collective): the file has done its job.
    if (group.rank == 0) {
      std::error_code ec;
      std::filesystem::remove(group.rendezvous, ec);
    }
  }
  ~NcclRank() override {
    // While an exception unwinds, the other ranks may never reach the matching call: abort rather than
    // wait for them.
    if (comm_) (std::uncaught_exceptions() > 0 ? nccl().comm_abort : nccl().comm_destroy)(comm_);
    if (reduced_) cudaEventDestroy(reduced_);
    if (queued_) cudaEventDestroy(queued_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  int rank() const override { return group_.rank; }
  int size() const override { return group_.size; }
  void all_reduce_sum(std::span<float> values) override { host_sum(values.data(), values.size(), ncclFloat32); }
  void all_reduce_sum(std::span<double> values) override { host_sum(values.data(), values.size(), ncclFloat64); }
  void all_reduce_mean(const Device& device, float* data, int64_t count) override {
    start_mean(device, data, count);
    finish_means(device);
  }
  void start_mean(const Device& device, float* data, int64_t count) override {
    BERT_CHECK(&device == &device_, "start_mean on another device than the communicator's");
    BERT_CUDA_CHECK(cudaEventRecord(queued_, device_.cuda_context()->stream));
    BERT_CUDA_CHECK(cudaStreamWaitEvent(stream_, queued_, 0));
    check(nccl().all_reduce(data, data, static_cast<size_t>(count), ncclFloat32, ncclAvg, comm_, stream_),
          "ncclAllReduce (gradients)", group_.rank);
  }
  void finish_means(const Device& device) override {
    BERT_CUDA_CHECK(cudaEventRecord(reduced_, stream_));
    BERT_CUDA_CHECK(cudaStreamWaitEvent(device_.cuda_context()->stream, reduced_, 0));
  }

 private:
  // Host values through a device buffer, on the collectives' stream (after the collectives already
  // queued there, as every rank queues them in the same order).
  template <typename T>
  void host_sum(T* values, size_t n, ncclDataType_t type) {
    if (n == 0) return;
    if (staging_.bytes() < n * sizeof(T)) staging_ = DeviceBuffer(device_, std::max<size_t>(n * sizeof(T), 4096));
    BERT_CUDA_CHECK(cudaMemcpyAsync(staging_.data(), values, n * sizeof(T), cudaMemcpyHostToDevice, stream_));
    check(nccl().all_reduce(staging_.data(), staging_.data(), n, type, ncclSum, comm_, stream_), "ncclAllReduce",
          group_.rank);
    BERT_CUDA_CHECK(cudaMemcpyAsync(values, staging_.data(), n * sizeof(T), cudaMemcpyDeviceToHost, stream_));
    BERT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  ProcessGroup group_;
  const Device& device_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t queued_ = nullptr, reduced_ = nullptr;
  DeviceBuffer staging_;
};

}  // namespace

bool nccl_available() { return nccl().error.empty(); }

std::unique_ptr<Communicator> nccl_communicator(const ProcessGroup& group, const Device& device) {
  if (!device.is_cuda())
    throw UserError("a job of " + std::to_string(group.size) + " processes needs GPUs (NCCL); --device is the CPU");
  if (!nccl().error.empty()) throw UserError(nccl().error);
  if (group.rendezvous.empty()) throw UserError("a job of several processes needs a rendezvous file (BERT_RENDEZVOUS)");
  return std::make_unique<NcclRank>(group, device);
}

#else  // a build without CUDA

bool nccl_available() { return false; }

std::unique_ptr<Communicator> nccl_communicator(const ProcessGroup& group, const Device&) {
  throw UserError("a job of " + std::to_string(group.size) +
                  " processes needs GPUs and NCCL, and this build has no CUDA support (rebuild with the CUDA "
                  "toolkit installed)");
}

#endif

}  // namespace bert::train
