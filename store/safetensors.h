// Safetensors, the weights format of Hugging Face checkpoints: an 8-byte little-endian header length N,
// N bytes of JSON ({"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}),
// then the raw little-endian tensor bytes, offsets relative to the end of the header.
// Reading converts F32, F16, BF16, F64 and the integer types (I64, I32, I16, I8, U8, BOOL: buffers
// such as position_ids) to float; writing produces F32.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace bert::hf {

enum class DType { kF32, kF16, kBF16, kF64, kI64, kI32, kI16, kI8, kU8, kBool };
const char* dtype_name(DType dtype);

struct TensorEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range inside the data section
  int64_t num_elements() const;
};

// An open safetensors file. The constructor reads and validates the whole header (sizes, dtypes,
// shapes against byte ranges, ranges inside the file and not overlapping) and throws UserError naming
// the file and the offending tensor; tensor data is read on demand.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(std::string path);

  const std::string& path() const { return path_; }
  const std::vector<TensorEntry>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const TensorEntry* find(const std::string& name) const;
  // The tensor's values converted to float (F64 and large integers are rounded to nearest).
  std::vector<float> read(const TensorEntry& entry) const;

 private:
  std::string path_;
  uint64_t data_start_ = 0;
  std::vector<TensorEntry> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Collects F32 tensors and metadata, then writes them atomically (a failed write leaves any previous
// file intact). Tensors are written in the order added; the header is padded to 8 bytes.
class SafetensorsWriter {
 public:
  void add(const std::string& name, std::vector<int64_t> shape, const float* values);
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  void write(const std::string& path) const;

 private:
  struct Pending {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<float> values;
  };
  std::vector<Pending> tensors_;
  std::map<std::string, std::string> metadata_;
};

// IEEE half and bfloat16 to float (exact).
float half_to_float(uint16_t bits);
float bfloat16_to_float(uint16_t bits);

}  // namespace bert::hf
