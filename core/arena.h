// ParameterArena<T>: every parameter and its gradient in two flat, contiguous buffers, so an optimizer
// step (or an all-reduce of the gradients across processes) is one pass over memory.
//
// Two phases: declare parameters with add(), then allocate() once; after that parameters are views
// into the arena and no more can be added.
//
// The host buffers are where parameters are initialised, loaded and saved. place_on(cuda) adds a
// mirror of both buffers on the GPU (same layout) where training runs; values move between the two
// only when asked (upload_values, download_values), never behind the caller's back.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/aligned.h"
#include "core/device.h"
#include "core/tensor.h"

namespace bert {

using ParamId = int32_t;

template <typename T>
struct Parameter {
  const std::string* name = nullptr;
  TensorView<T> value;  // host
  TensorView<T> grad;
  TensorView<T> device_value;  // the device mirror, empty unless the arena was placed on a GPU
  TensorView<T> device_grad;
  // device_value rounded to BF16 (2-byte elements), where the arena keeps a current copy (see
  // ParameterArena::bf16_copy_for_update); else nullptr.
  const void* device_bf16 = nullptr;
};

template <typename T>
class ParameterArena {
 public:
  // Declares a parameter; names are unique (Hugging Face state-dict names in the model).
  ParamId add(const std::string& name, Shape shape);
  void allocate();  // values and gradients start at zero
  bool allocated() const { return allocated_; }

  Parameter<T> get(ParamId id);
  Parameter<T> get(const std::string& name);  // throws UserError naming the unknown parameter
  bool contains(const std::string& name) const { return index_.count(name) > 0; }
  ParamId id(const std::string& name) const;  // throws UserError naming the unknown parameter
  int32_t size() const { return static_cast<int32_t>(entries_.size()); }
  const std::string& name(ParamId id) const { return entries_.at(id).name; }
  const Shape& shape(ParamId id) const { return entries_.at(id).shape; }

  // The flat buffers. Parameters start on 64-byte boundaries; the padding between them stays zero.
  TensorView<T> values();
  TensorView<T> grads();
  int64_t num_elements() const;  // sum of the parameters' element counts (without padding)
  int64_t offset(ParamId id) const { return entries_.at(id).offset; }  // into the flat buffers
  // Zeroes the gradients where training runs (the device mirror when there is one).
  void zero_grad();

  // --- the device mirror
  // Allocates value and gradient buffers on `device` (nothing for the CPU), copies the values there
  // and zeroes the gradients. The device must outlive the arena.
  void place_on(const Device& device);
  const Device& device() const { return *device_; }
  bool on_cuda() const { return device_->is_cuda(); }
  void upload_values();           // host values -> device (after loading or initialising on the host)
  void download_values();         // device values -> host (before saving or reading them on the host)
  void download_grads();          // device gradients -> host (for diagnostics)
  // The flat buffers where training runs (the host ones on the CPU). device_values() marks the BF16
  // copy stale: its caller may change the values.
  TensorView<T> device_values();
  TensorView<T> device_grads();
  // The part of device_grads() that holds the gradients of parameters [first, end), their padding
  // included (end == size(): up to the buffer's end).
  TensorView<T> device_grads(ParamId first, ParamId end);

  // --- the BF16 copy of the device values, for BF16 mixed precision on a GPU: the GEMMs read it instead
  // of rounding every F32 weight at every use. The optimizer writes it beside the values in its own pass:
  // bf16_copy_for_update() gives the buffer (allocated on first use; nullptr unless the arena is on a GPU
  // in BF16), bf16_copy_updated() says it now holds the values rounded to nearest. Anything else that
  // changes the values (upload_values, device_values, place_on) marks it stale, and get() hands it out
  // only while it is current.
  void* bf16_copy_for_update();
  void bf16_copy_updated() { bf16_current_ = bf16_copy_.data() != nullptr; }
  bool bf16_copy_current() const { return bf16_current_; }
  // Makes the copy current where it is not: the device values each rounded to nearest BF16, in one pass
  // queued on the device (the bits AdamW writes). Nothing unless the arena is on a GPU in BF16. For
  // inference, where no optimizer writes it, and before a training step whose copy is stale (the first, or
  // any under an optimizer that does not keep it), so that no GEMM rounds its weight into the step's
  // workspace, which would keep that memory for good.
  void refresh_bf16_copy();

 private:
  struct Entry {
    std::string name;
    Shape shape;
    int64_t offset = 0;
  };
  std::vector<Entry> entries_;
  std::unordered_map<std::string, ParamId> index_;
  AlignedVector<T> values_, grads_;
  const Device* device_ = &Device::cpu();
  DeviceBuffer device_values_, device_grads_;
  DeviceBuffer bf16_copy_;
  bool bf16_current_ = false;
  int64_t padded_size_ = 0;
  bool allocated_ = false;
};

}  // namespace bert
