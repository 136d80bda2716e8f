#include "core/device.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

#include "sys/error.h"
#include "sys/parallel.h"

#if BERT_WITH_CUDA
#include "core/cuda/context.h"
#endif

namespace bert {

namespace {

// Zeroes host memory on every thread when it is large: gradients start as zeros (Graph::grad), and one
// thread's memset of a 64 MB activation gradient took longer than the op that then filled it.
void host_fill_zero(void* p, std::size_t bytes) {
  constexpr std::size_t kChunk = std::size_t{1} << 16;
  const int64_t chunks = static_cast<int64_t>((bytes + kChunk - 1) / kChunk);
  parallel_for(chunks, 8, [&](int64_t lo, int64_t hi) {
    const std::size_t begin = static_cast<std::size_t>(lo) * kChunk;
    const std::size_t end = std::min(bytes, static_cast<std::size_t>(hi) * kChunk);
    std::memset(static_cast<char*>(p) + begin, 0, end - begin);
  });
}

void host_round_to_bf16(uint16_t* dst, const float* src, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, src + i, sizeof bits);
    const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
    dst[i] = static_cast<uint16_t>(nan ? (bits >> 16) | 0x40u : (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  }
}

}  // namespace

Precision parse_precision(const std::string& name) { return kPrecisionNames.parse(name, "--precision"); }

std::string precision_name(Precision precision) { return kPrecisionNames.name(precision); }

const Device& Device::cpu() {
  static const Device device(DeviceKind::kCpu, Precision::kFp32);  // immutable: no state to share
  return device;
}

bool Device::built_with_cuda() { return BERT_WITH_CUDA != 0; }

Device::~Device() = default;

namespace {
constexpr std::size_t kHostAlignment = 256;
}

#if BERT_WITH_CUDA

int Device::cuda_device_count() { return cuda::device_count(); }
bool Device::cuda_available() { return cuda::device_count() > 0; }

std::unique_ptr<Device> Device::cuda(int ordinal, Precision precision) {
  const int count = cuda::device_count();
  if (count == 0) throw UserError("--device cuda: no CUDA GPU is visible (" + cuda::why_no_device() + ")");
  if (ordinal < 0 || ordinal >= count)
    throw UserError("--device cuda:" + std::to_string(ordinal) + ": only " + std::to_string(count) + " GPU(s) visible");
  std::unique_ptr<Device> d(new Device(DeviceKind::kCuda, precision));
  d->cuda_ = {cuda::create_context(ordinal, precision), &cuda::destroy_context};
  return d;
}

std::string Device::name() const { return is_cuda() ? cuda::describe(*cuda_) : "cpu"; }
std::pair<int, int> Device::compute_capability() const {
  return is_cuda() ? std::pair{cuda_->compute_major, cuda_->compute_minor} : std::pair{0, 0};
}
std::string Device::hardware_name() const {
  if (!is_cuda()) return "cpu";
  char text[160];
  std::snprintf(text, sizeof text, "cuda:%d (%s, %.1f GiB)", cuda_->ordinal, cuda_->device_name.c_str(),
                cuda_->total_memory / double(1 << 30));
  return text;
}

void* Device::allocate(std::size_t bytes) const {
  if (!is_cuda()) return ::operator new(bytes == 0 ? 1 : bytes, std::align_val_t(kHostAlignment));
  return cuda::allocate(*cuda_, bytes);
}
void Device::free(void* p) const {
  if (!is_cuda()) return ::operator delete(p, std::align_val_t(kHostAlignment));
  cuda::free(*cuda_, p);
}
void Device::fill_zero(void* p, std::size_t bytes) const {
  if (!is_cuda()) return host_fill_zero(p, bytes);
  cuda::fill_zero(*cuda_, p, bytes);
}
void Device::copy_to_host(void* host, const void* src, std::size_t bytes) const {
  if (!is_cuda()) return (void)std::memcpy(host, src, bytes);
  cuda::copy_to_host(*cuda_, host, src, bytes);
}
void Device::copy_to_device(void* dst, const void* host, std::size_t bytes) const {
  if (!is_cuda()) return (void)std::memcpy(dst, host, bytes);
  cuda::copy_to_device(*cuda_, dst, host, bytes);
}
void Device::copy_on_device(void* dst, const void* src, std::size_t bytes) const {
  if (!is_cuda()) return (void)std::memmove(dst, src, bytes);
  cuda::copy_on_device(*cuda_, dst, src, bytes);
}
void Device::round_to_bf16(uint16_t* dst, const float* src, std::size_t n) const {
  if (!is_cuda()) return host_round_to_bf16(dst, src, n);
  cuda::round_to_bf16(*cuda_, dst, src, n);
}
void Device::synchronize() const {
  if (is_cuda()) cuda::synchronize(*cuda_);
}
std::pair<std::size_t, std::size_t> Device::memory_use() const {
  if (!is_cuda()) return {0, 0};
  return cuda::memory_use(*cuda_);
}

#else  // a CPU-only build

int Device::cuda_device_count() { return 0; }
bool Device::cuda_available() { return false; }
std::unique_ptr<Device> Device::cuda(int, Precision) {
  throw UserError("--device cuda: this build has no CUDA support (configure with nvcc present, -DBERT_CUDA=ON)");
}
std::string Device::name() const { return "cpu"; }
std::pair<int, int> Device::compute_capability() const { return {0, 0}; }
std::string Device::hardware_name() const { return "cpu"; }
void* Device::allocate(std::size_t bytes) const {
  return ::operator new(bytes == 0 ? 1 : bytes, std::align_val_t(kHostAlignment));
}
void Device::free(void* p) const { ::operator delete(p, std::align_val_t(kHostAlignment)); }
void Device::fill_zero(void* p, std::size_t bytes) const { host_fill_zero(p, bytes); }
void Device::copy_to_host(void* host, const void* src, std::size_t bytes) const { std::memcpy(host, src, bytes); }
void Device::copy_to_device(void* dst, const void* host, std::size_t bytes) const { std::memcpy(dst, host, bytes); }
void Device::copy_on_device(void* dst, const void* src, std::size_t bytes) const { std::memmove(dst, src, bytes); }
void Device::round_to_bf16(uint16_t* dst, const float* src, std::size_t n) const { host_round_to_bf16(dst, src, n); }
void Device::synchronize() const {}
std::pair<std::size_t, std::size_t> Device::memory_use() const { return {0, 0}; }

#endif

std::unique_ptr<Device> Device::open(const std::string& spec, Precision precision) {
  if (spec == "cpu") {
    if (precision == Precision::kTf32)
      throw UserError("--precision tf32 needs --device cuda (TF32 is a GPU format; the CPU runs fp32 or bf16)");
    return std::unique_ptr<Device>(new Device(DeviceKind::kCpu, precision));
  }
  if (spec == "auto") return cuda_available() ? cuda(0, precision) : open("cpu", precision);
  if (spec == "cuda") return cuda(0, precision);
  if (spec.starts_with("cuda:")) {
    const std::string n = spec.substr(5);
    if (!n.empty() && n.find_first_not_of("0123456789") == std::string::npos) return cuda(std::stoi(n), precision);
  }
  throw UserError("--device '" + spec + "': expected auto, cpu, cuda or cuda:N");
}

}  // namespace bert
