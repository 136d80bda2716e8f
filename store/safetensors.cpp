#include "store/safetensors.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "sys/atomic_file.h"
#include "sys/error.h"
#include "sys/json.h"

namespace bert::hf {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

namespace {

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // the reference implementation's limit

struct DTypeInfo {
  DType dtype;
  const char* name;
  int64_t size;
};
constexpr DTypeInfo kDTypes[] = {{DType::kF32, "F32", 4},  {DType::kF16, "F16", 2}, {DType::kBF16, "BF16", 2},
                                 {DType::kF64, "F64", 8},  {DType::kI64, "I64", 8}, {DType::kI32, "I32", 4},
                                 {DType::kI16, "I16", 2},  {DType::kI8, "I8", 1},   {DType::kU8, "U8", 1},
                                 {DType::kBool, "BOOL", 1}};

int64_t dtype_size(DType d) {
  for (const DTypeInfo& info : kDTypes)
    if (info.dtype == d) return info.size;
  return 0;
}

template <typename T>
T load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

}  // namespace

const char* dtype_name(DType d) {
  for (const DTypeInfo& info : kDTypes)
    if (info.dtype == d) return info.name;
  return "?";
}

int64_t TensorEntry::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f;
  const uint32_t mantissa = h & 0x3ff;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  uint32_t bits;
  if (exponent == 0x1f)
    bits = sign | 0x7f800000u | (mantissa << 13);  // Inf / NaN
  else
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  return std::bit_cast<float>(bits);
}

float bfloat16_to_float(uint16_t b) { return std::bit_cast<float>(uint32_t(b) << 16); }

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path_, ec)) throw UserError("safetensors file '" + path_ + "' does not exist");
  const uint64_t file_size = std::filesystem::file_size(path_, ec);
  std::ifstream in(path_, std::ios::binary);
  if (!in || ec) throw UserError("cannot read safetensors file '" + path_ + "'");
  auto bad = [&](const std::string& what) { return UserError("safetensors file '" + path_ + "': " + what); };
  if (file_size < 8) throw bad("shorter than its 8-byte header length (" + std::to_string(file_size) + " bytes)");
  uint64_t header_size = 0;
  in.read(reinterpret_cast<char*>(&header_size), 8);
  if (header_size > kMaxHeaderBytes || header_size > file_size - 8)
    throw bad("header length " + std::to_string(header_size) + " exceeds the file (" + std::to_string(file_size) +
              " bytes) or the 100 MB limit; not a safetensors file?");
  std::string header(header_size, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_size));
  if (!in) throw bad("cannot read the header");
  data_start_ = 8 + header_size;
  const uint64_t data_size = file_size - data_start_;

  Json json;
  try {
    json = Json::parse(header);
  } catch (const UserError& e) {
    throw bad(std::string("header is not valid JSON: ") + e.what());
  }
  if (!json.is_object()) throw bad("header is not a JSON object");
  for (const auto& member : json.as_object()) {
    const std::string& name = member.first;  // named, not a structured binding: clang 14 lambdas cannot capture those
    const Json& value = member.second;
    if (name == "__metadata__") {
      if (!value.is_object()) throw bad("__metadata__ is not an object");
      for (const auto& [key, text] : value.as_object()) {
        if (!text.is_string()) throw bad("__metadata__ value '" + key + "' is not a string");
        metadata_[key] = text.as_string();
      }
      continue;
    }
    auto tensor_error = [&](const std::string& what) { return bad("tensor '" + name + "': " + what); };
    if (!value.is_object()) throw tensor_error("entry is not an object");
    const Json* dtype = value.find("dtype");
    const Json* shape = value.find("shape");
    const Json* offsets = value.find("data_offsets");
    if (!dtype || !shape || !offsets) throw tensor_error("needs dtype, shape and data_offsets");
    TensorEntry t;
    t.name = name;
    const std::string d = dtype->is_string() ? dtype->as_string() : "";
    const DTypeInfo* info =
        std::find_if(std::begin(kDTypes), std::end(kDTypes), [&](const DTypeInfo& i) { return d == i.name; });
    if (info == std::end(kDTypes))
      throw tensor_error("dtype '" + d +
                         "' is not supported (expected F32, F16, BF16, F64, I64, I32, I16, I8, U8 or BOOL)");
    t.dtype = info->dtype;
    try {
      for (const Json& dim : shape->as_array()) {
        const int64_t n = dim.as_int();
        if (n < 0 || n > (int64_t(1) << 40)) throw UserError("dimension out of range");
        t.shape.push_back(n);
      }
      const Json::Array& range = offsets->as_array();
      if (range.size() != 2) throw UserError("data_offsets needs two numbers");
      const int64_t begin = range[0].as_int(), end = range[1].as_int();
      if (begin < 0 || end < begin)
        throw UserError("data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "] are not a range");
      t.begin = static_cast<uint64_t>(begin);
      t.end = static_cast<uint64_t>(end);
    } catch (const UserError& e) {
      throw tensor_error(e.what());
    }
    if (t.shape.size() > 8) throw tensor_error("rank " + std::to_string(t.shape.size()) + " is more than 8");
    const uint64_t bytes = static_cast<uint64_t>(t.num_elements()) * dtype_size(t.dtype);
    if (t.end - t.begin != bytes)
      throw tensor_error("data_offsets hold " + std::to_string(t.end - t.begin) + " bytes, but shape and dtype need " +
                         std::to_string(bytes));
    if (t.end > data_size)
      throw tensor_error("data ends at byte " + std::to_string(t.end) + " of a " + std::to_string(data_size) +
                         "-byte data section (truncated file?)");
    tensors_.push_back(std::move(t));
  }
  // No two tensors may share bytes (a corrupt or hostile header could alias them).
  std::vector<const TensorEntry*> by_offset;
  for (const TensorEntry& t : tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i]->begin < by_offset[i - 1]->end)
      throw bad("tensors '" + by_offset[i - 1]->name + "' and '" + by_offset[i]->name + "' overlap");
}

const TensorEntry* SafetensorsFile::find(const std::string& name) const {
  for (const TensorEntry& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

std::vector<float> SafetensorsFile::read(const TensorEntry& t) const {
  std::ifstream in(path_, std::ios::binary);
  std::vector<char> raw(t.end - t.begin);
  in.seekg(static_cast<std::streamoff>(data_start_ + t.begin));
  in.read(raw.data(), static_cast<std::streamsize>(raw.size()));
  if (!in) throw UserError("safetensors file '" + path_ + "': cannot read tensor '" + t.name + "'");
  const int64_t n = t.num_elements();
  std::vector<float> out(n);
  const char* p = raw.data();
  for (int64_t i = 0; i < n; ++i) {
    switch (t.dtype) {
      case DType::kF32:
        out[i] = load<float>(p + 4 * i);
        break;
      case DType::kF64:
        out[i] = static_cast<float>(load<double>(p + 8 * i));
        break;
      case DType::kF16:
        out[i] = half_to_float(load<uint16_t>(p + 2 * i));
        break;
      case DType::kBF16:
        out[i] = bfloat16_to_float(load<uint16_t>(p + 2 * i));
        break;
      case DType::kI64:
        out[i] = static_cast<float>(load<int64_t>(p + 8 * i));
        break;
      case DType::kI32:
        out[i] = static_cast<float>(load<int32_t>(p + 4 * i));
        break;
      case DType::kI16:
        out[i] = static_cast<float>(load<int16_t>(p + 2 * i));
        break;
      case DType::kI8:
        out[i] = static_cast<float>(load<int8_t>(p + i));
        break;
      case DType::kU8:
      case DType::kBool:
        out[i] = static_cast<float>(load<uint8_t>(p + i));
        break;
    }
  }
  return out;
}

void SafetensorsWriter::add(const std::string& name, std::vector<int64_t> shape, const float* values) {
  for (const Pending& p : tensors_) BERT_CHECK(p.name != name, "tensor '" + name + "' added twice");
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  tensors_.push_back({name, std::move(shape), std::vector<float>(values, values + n)});
}

void SafetensorsWriter::write(const std::string& path) const {
  Json header;
  if (!metadata_.empty()) {
    Json::Object meta;
    for (const auto& [k, v] : metadata_) meta.emplace_back(k, Json(v));
    header["__metadata__"] = Json(std::move(meta));
  }
  uint64_t offset = 0;
  for (const Pending& p : tensors_) {
    Json::Array shape;
    for (int64_t d : p.shape) shape.emplace_back(d);
    const uint64_t bytes = p.values.size() * sizeof(float);
    Json entry;
    entry["dtype"] = "F32";
    entry["shape"] = Json(std::move(shape));
    entry["data_offsets"] = Json(Json::Array{Json(offset), Json(offset + bytes)});
    header[p.name] = std::move(entry);
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data 8-byte aligned
  const uint64_t size = text.size();

  AtomicFile file(path);
  {
    std::ofstream out(file.temp_path(), std::ios::binary | std::ios::trunc);
    if (!out) throw UserError("cannot create '" + file.temp_path() + "' (" + std::strerror(errno) + ")");
    out.write(reinterpret_cast<const char*>(&size), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const Pending& p : tensors_)
      out.write(reinterpret_cast<const char*>(p.values.data()), static_cast<std::streamsize>(p.values.size() * 4));
    out.flush();
    if (!out) throw UserError("cannot write '" + path + "' (disk full?); any previous file was left unchanged");
  }
  file.commit();
}

}  // namespace bert::hf
