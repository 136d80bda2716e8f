// Device: where a graph's tensors live and its ops run. The CPU device is a plain value; a CUDA
// device owns a stream, a cuBLAS handle and the GEMM precision setting. The caller creates one and
// passes it to the graphs, the parameter arena and the optimizer that use it (there is no global
// device). Moving data between host and device goes through the functions below, which name the
// direction; nothing copies implicitly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "sys/enum_names.h"

namespace bert {

enum class DeviceKind { kCpu, kCuda };

// How a CUDA device computes. kFp32: strict FP32 GEMMs. kTf32: TF32 tensor cores (GEMM inputs rounded
// to 10 mantissa bits, FP32 accumulation and output). In both, every tensor is FP32. kBf16: mixed
// precision: activations and their gradients are stored in BF16 (8 mantissa bits), GEMMs run on BF16
// tensor cores, and every kernel computes in FP32 registers; parameters, their gradients, the
// optimizer, losses, reductions and quantizer scales stay FP32 (FP32 master weights).
// On the CPU (Device::open("cpu", ...)): kFp32, or kBf16, where every product (linear layers, attention,
// forward and backward) takes BF16-rounded operands and sums in FP32 (on AMX tiles or vdpbf16ps where the CPU
// has them: kernels/gemm.h) while every tensor, the weights and the optimizer stay FP32.
enum class Precision { kFp32, kTf32, kBf16 };
inline constexpr EnumNames<Precision, 3> kPrecisionNames{
    {{{Precision::kFp32, "fp32"}, {Precision::kTf32, "tf32"}, {Precision::kBf16, "bf16"}}}};
Precision parse_precision(const std::string& name);  // fp32 | tf32 | bf16; UserError naming --precision otherwise
std::string precision_name(Precision precision);

struct CudaContext;  // stream, cuBLAS handle, small staging buffers (core/cuda/context.cu)

class Device {
 public:
  // The host CPU (the default everywhere).
  static const Device& cpu();
  // CUDA device `ordinal`. UserError when the build has no CUDA support or no such GPU is present.
  static std::unique_ptr<Device> cuda(int ordinal = 0, Precision precision = Precision::kFp32);
  // "auto" (a GPU when one is present, else the CPU), "cpu", "cuda" or "cuda:N".
  static std::unique_ptr<Device> open(const std::string& spec, Precision precision = Precision::kFp32);
  // Whether this build can use CUDA and at least one GPU answers (never throws).
  static bool cuda_available();
  static int cuda_device_count();  // 0 in a build without CUDA or where no GPU answers
  static bool built_with_cuda();

  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  DeviceKind kind() const { return kind_; }
  bool is_cuda() const { return kind_ == DeviceKind::kCuda; }
  Precision precision() const { return precision_; }
  std::string name() const;           // "cpu", or "cuda:0 (NVIDIA H100 80GB HBM3, 79.1 GiB, bf16)"
  std::string hardware_name() const;  // the same without the precision: "cuda:0 (NVIDIA H100 80GB HBM3, 79.1 GiB)"
  // A GPU's compute capability (major, minor); (0, 0) for the CPU.
  std::pair<int, int> compute_capability() const;
  // Whether a GPU of that capability has int8 tensor cores, which INT8 inference on it needs (7.5, Turing,
  // and later).
  static constexpr bool int8_tensor_cores(int major, int minor) { return major > 7 || (major == 7 && minor >= 5); }
  CudaContext* cuda_context() const { return cuda_.get(); }

  // --- memory on this device (host memory for the CPU device)
  void* allocate(std::size_t bytes) const;  // 256-byte aligned; UserError naming the size when out of memory
  void free(void* p) const;
  void fill_zero(void* p, std::size_t bytes) const;
  void copy_to_host(void* host, const void* on_device, std::size_t bytes) const;  // waits for the copy
  void copy_to_device(void* on_device, const void* host, std::size_t bytes) const;
  void copy_on_device(void* dst, const void* src, std::size_t bytes) const;
  // dst (n 16-bit patterns) = src (n floats, on this device) each rounded to the nearest BF16, ties to even
  // (NaN stays NaN); on a GPU queued like the copies on the device.
  void round_to_bf16(uint16_t* dst, const float* src, std::size_t n) const;
  void synchronize() const;  // waits for all work queued on this device
  // Bytes of device memory in use by this process and in total (0, 0 on the CPU).
  std::pair<std::size_t, std::size_t> memory_use() const;

 private:
  Device(DeviceKind kind, Precision precision) : kind_(kind), precision_(precision) {}
  DeviceKind kind_;
  Precision precision_;
  std::unique_ptr<CudaContext, void (*)(CudaContext*)> cuda_{nullptr, nullptr};
};

// Memory owned on a device, freed by the device that gave it (RAII).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const Device& device, std::size_t bytes)
      : device_(&device), bytes_(bytes), data_(device.allocate(bytes)) {}
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      device_ = o.device_, bytes_ = o.bytes_, data_ = o.data_;
      o.device_ = nullptr, o.bytes_ = 0, o.data_ = nullptr;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  void reset() {
    if (data_) device_->free(data_);
    data_ = nullptr, bytes_ = 0;
  }

 private:
  const Device* device_ = nullptr;
  std::size_t bytes_ = 0;
  void* data_ = nullptr;
};

}  // namespace bert
