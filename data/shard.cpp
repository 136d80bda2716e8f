// Shard I/O through the HDF5 C API.
#include "data/shard.h"

#include <hdf5.h>

#include <algorithm>
#include <filesystem>

#include "core/atomic_file.h"
#include "core/error.h"

namespace bert::data {

namespace {

// Closes an HDF5 handle on scope exit.
class Handle {
 public:
  Handle(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  ~Handle() {
    if (id_ >= 0) close_(id_);
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  hid_t get() const { return id_; }
  bool ok() const { return id_ >= 0; }

 private:
  hid_t id_;
  herr_t (*close_)(hid_t);
};

// HDF5 prints its error stack to stderr by default; we report errors ourselves.
class QuietHdf5 {
 public:
  QuietHdf5() {
    H5Eget_auto2(H5E_DEFAULT, &old_func_, &old_data_);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  }
  ~QuietHdf5() { H5Eset_auto2(H5E_DEFAULT, old_func_, old_data_); }

 private:
  H5E_auto2_t old_func_ = nullptr;
  void* old_data_ = nullptr;
};

template <typename T>
hid_t file_type() {
  return sizeof(T) == 4 ? H5T_STD_I32LE : H5T_STD_I8LE;
}
template <typename T>
hid_t memory_type() {
  return sizeof(T) == 4 ? H5T_NATIVE_INT32 : H5T_NATIVE_INT8;
}

template <typename T>
void write_dataset(hid_t file, const char* name, const std::vector<T>& data, std::vector<hsize_t> dims,
                   const std::string& path) {
  Handle space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
  Handle props(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  if (dims[0] > 0) {  // chunked + gzip (an empty dataset cannot be chunked)
    std::vector<hsize_t> chunk = dims;
    chunk[0] = std::min<hsize_t>(dims[0], 1024);
    H5Pset_chunk(props.get(), static_cast<int>(chunk.size()), chunk.data());
    H5Pset_deflate(props.get(), 4);
  }
  Handle set(H5Dcreate2(file, name, file_type<T>(), space.get(), H5P_DEFAULT, props.get(), H5P_DEFAULT), H5Dclose);
  if (!set.ok() || H5Dwrite(set.get(), memory_type<T>(), H5S_ALL, H5S_ALL, H5P_DEFAULT, data.data()) < 0)
    throw UserError("cannot write dataset '" + std::string(name) + "' to '" + path + "' (disk full?)");
}

void write_int_attribute(hid_t file, const char* name, int64_t value) {
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle attr(H5Acreate2(file, name, H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  H5Awrite(attr.get(), H5T_NATIVE_INT64, &value);
}

void write_string_attribute(hid_t file, const char* name, const std::string& value) {
  Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(type.get(), std::max<size_t>(value.size(), 1));
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle attr(H5Acreate2(file, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  H5Awrite(attr.get(), type.get(), value.c_str());
}

std::optional<int64_t> read_int_attribute(hid_t file, const char* name) {
  if (H5Aexists(file, name) <= 0) return std::nullopt;
  Handle attr(H5Aopen(file, name, H5P_DEFAULT), H5Aclose);
  int64_t value = 0;
  if (H5Aread(attr.get(), H5T_NATIVE_INT64, &value) < 0) return std::nullopt;
  return value;
}

std::optional<std::string> read_string_attribute(hid_t file, const char* name) {
  if (H5Aexists(file, name) <= 0) return std::nullopt;
  Handle attr(H5Aopen(file, name, H5P_DEFAULT), H5Aclose);
  Handle type(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tget_class(type.get()) != H5T_STRING || H5Tis_variable_str(type.get()) > 0) return std::nullopt;
  std::string value(H5Tget_size(type.get()), '\0');
  if (H5Aread(attr.get(), type.get(), value.data()) < 0) return std::nullopt;
  value.erase(std::find(value.begin(), value.end(), '\0'), value.end());
  return value;
}

std::string dims_str(const std::vector<hsize_t>& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// Reads a dataset of the exact integer type T with the given rank; returns its dims.
template <typename T>
std::vector<hsize_t> read_dataset(hid_t file, const char* name, int rank, std::vector<T>& out,
                                  const std::string& path) {
  const std::string where = "shard '" + path + "': dataset '" + name + "'";
  if (H5Lexists(file, name, H5P_DEFAULT) <= 0)
    throw UserError(where + " is missing (expected NVIDIA BERT layout: input_ids, input_mask, segment_ids, "
                            "masked_lm_positions, masked_lm_ids, next_sentence_labels)");
  Handle set(H5Dopen2(file, name, H5P_DEFAULT), H5Dclose);
  if (!set.ok()) throw UserError(where + " cannot be opened");
  Handle type(H5Dget_type(set.get()), H5Tclose);
  const bool is_int = H5Tget_class(type.get()) == H5T_INTEGER;
  const size_t size = H5Tget_size(type.get());
  const bool is_signed = is_int && H5Tget_sign(type.get()) == H5T_SGN_2;
  if (!is_int || size != sizeof(T) || !is_signed) {
    const std::string found = !is_int ? (H5Tget_class(type.get()) == H5T_FLOAT ? "float" : "non-integer")
                                      : std::string(is_signed ? "int" : "uint") + std::to_string(8 * size);
    throw UserError(where + " has dtype " + found + ", expected int" + std::to_string(8 * sizeof(T)));
  }
  Handle space(H5Dget_space(set.get()), H5Sclose);
  const int found_rank = H5Sget_simple_extent_ndims(space.get());
  if (found_rank != rank)
    throw UserError(where + " has rank " + std::to_string(found_rank) + ", expected " + std::to_string(rank));
  std::vector<hsize_t> dims(rank);
  H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  hsize_t n = 1;
  for (hsize_t d : dims) n *= d;
  out.resize(n);
  if (n > 0 && H5Dread(set.get(), memory_type<T>(), H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()) < 0)
    throw UserError(where + " cannot be read (truncated or corrupt file?)");
  return dims;
}

}  // namespace

void Shard::append(const Example& e) {
  BERT_CHECK(static_cast<int64_t>(e.tokens.size()) <= seq_len, "example longer than the shard's sequence length");
  BERT_CHECK(static_cast<int64_t>(e.masked_positions.size()) <= max_predictions, "too many predictions");
  const size_t n = e.tokens.size(), m = e.masked_positions.size();
  input_ids.insert(input_ids.end(), e.tokens.begin(), e.tokens.end());
  input_ids.resize(input_ids.size() + (seq_len - n), 0);
  input_mask.resize(input_mask.size() + n, 1);
  input_mask.resize(input_mask.size() + (seq_len - n), 0);
  segment_ids.insert(segment_ids.end(), e.segment_ids.begin(), e.segment_ids.end());
  segment_ids.resize(segment_ids.size() + (seq_len - n), 0);
  masked_lm_positions.insert(masked_lm_positions.end(), e.masked_positions.begin(), e.masked_positions.end());
  masked_lm_positions.resize(masked_lm_positions.size() + (max_predictions - m), 0);
  masked_lm_ids.insert(masked_lm_ids.end(), e.masked_ids.begin(), e.masked_ids.end());
  masked_lm_ids.resize(masked_lm_ids.size() + (max_predictions - m), 0);
  next_sentence_labels.push_back(e.random_next ? 1 : 0);
  ++size;
}

void Shard::clear() {
  size = 0;
  for (auto* v : {&input_ids, &masked_lm_positions, &masked_lm_ids}) v->clear();
  for (auto* v : {&input_mask, &segment_ids, &next_sentence_labels}) v->clear();
}

void write_shard(const std::string& path, const Shard& s) {
  QuietHdf5 quiet;
  AtomicFile file(path);
  {
    Handle h(H5Fcreate(file.temp_path().c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
    if (!h.ok()) throw UserError("cannot create shard '" + path + "' (missing folder or no permission?)");
    const auto n = static_cast<hsize_t>(s.size), l = static_cast<hsize_t>(s.seq_len),
               p = static_cast<hsize_t>(s.max_predictions);
    write_dataset(h.get(), "input_ids", s.input_ids, {n, l}, path);
    write_dataset(h.get(), "input_mask", s.input_mask, {n, l}, path);
    write_dataset(h.get(), "segment_ids", s.segment_ids, {n, l}, path);
    write_dataset(h.get(), "masked_lm_positions", s.masked_lm_positions, {n, p}, path);
    write_dataset(h.get(), "masked_lm_ids", s.masked_lm_ids, {n, p}, path);
    write_dataset(h.get(), "next_sentence_labels", s.next_sentence_labels, {n}, path);
    if (s.metadata) {
      write_int_attribute(h.get(), "vocab_size", s.metadata->vocab_size);
      write_string_attribute(h.get(), "tokenizer_sha256", s.metadata->tokenizer_sha256);
      write_int_attribute(h.get(), "max_seq_len", s.metadata->max_seq_len);
      write_int_attribute(h.get(), "max_predictions_per_seq", s.metadata->max_predictions);
      write_int_attribute(h.get(), "seed", static_cast<int64_t>(s.metadata->seed));
    }
    if (H5Fflush(h.get(), H5F_SCOPE_GLOBAL) < 0) throw UserError("cannot write shard '" + path + "' (disk full?)");
  }
  file.commit();
}

Shard read_shard(const std::string& path) {
  QuietHdf5 quiet;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) throw UserError("shard '" + path + "' does not exist");
  if (H5Fis_hdf5(path.c_str()) <= 0)
    throw UserError("shard '" + path + "' is not an HDF5 file (truncated or corrupt?)");
  Handle h(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!h.ok()) throw UserError("shard '" + path + "' cannot be opened as HDF5 (truncated or corrupt?)");

  Shard s;
  auto ids = read_dataset(h.get(), "input_ids", 2, s.input_ids, path);
  s.size = static_cast<int64_t>(ids[0]);
  s.seq_len = static_cast<int64_t>(ids[1]);
  auto expect = [&](const char* name, const std::vector<hsize_t>& found, std::vector<hsize_t> want) {
    if (found != want)
      throw UserError("shard '" + path + "': dataset '" + name + "' has shape " + dims_str(found) + ", expected " +
                      dims_str(want));
  };
  expect("input_mask", read_dataset(h.get(), "input_mask", 2, s.input_mask, path), ids);
  expect("segment_ids", read_dataset(h.get(), "segment_ids", 2, s.segment_ids, path), ids);
  auto pos = read_dataset(h.get(), "masked_lm_positions", 2, s.masked_lm_positions, path);
  s.max_predictions = static_cast<int64_t>(pos[1]);
  expect("masked_lm_positions", pos, {ids[0], pos[1]});
  expect("masked_lm_ids", read_dataset(h.get(), "masked_lm_ids", 2, s.masked_lm_ids, path), pos);
  expect("next_sentence_labels", read_dataset(h.get(), "next_sentence_labels", 1, s.next_sentence_labels, path),
         {ids[0]});

  auto vocab = read_int_attribute(h.get(), "vocab_size");
  if (vocab) {
    ShardMetadata m;
    m.vocab_size = *vocab;
    m.tokenizer_sha256 = read_string_attribute(h.get(), "tokenizer_sha256").value_or("");
    m.max_seq_len = read_int_attribute(h.get(), "max_seq_len").value_or(s.seq_len);
    m.max_predictions = read_int_attribute(h.get(), "max_predictions_per_seq").value_or(s.max_predictions);
    m.seed = static_cast<uint64_t>(read_int_attribute(h.get(), "seed").value_or(0));
    s.metadata = m;
  }
  for (int64_t i = 0; i < static_cast<int64_t>(s.input_ids.size()); ++i) {
    const int32_t id = s.input_ids[i];
    if (id < 0 || (vocab && id >= *vocab))
      throw UserError("shard '" + path + "': input_ids[" + std::to_string(i / s.seq_len) + ", " +
                      std::to_string(i % s.seq_len) + "] = " + std::to_string(id) + " outside [0, vocab_size=" +
                      (vocab ? std::to_string(*vocab) : "?") + ")");
  }
  for (int32_t p : s.masked_lm_positions)
    if (p < 0 || p >= s.seq_len)
      throw UserError("shard '" + path + "': masked_lm_positions holds " + std::to_string(p) +
                      ", outside [0, " + std::to_string(s.seq_len) + ")");
  return s;
}

void check_shard_compatible(const Shard& s, const std::string& path, int64_t vocab_size, int64_t max_seq_len,
                            const std::string& tokenizer_sha256) {
  if (s.seq_len > max_seq_len)
    throw UserError("shard '" + path + "' has sequence length " + std::to_string(s.seq_len) +
                    ", longer than the model's max_position_embeddings " + std::to_string(max_seq_len));
  if (s.metadata && s.metadata->vocab_size != vocab_size)
    throw UserError("shard '" + path + "' was made with a vocabulary of " + std::to_string(s.metadata->vocab_size) +
                    " tokens; the model has " + std::to_string(vocab_size));
  for (int32_t id : s.input_ids)
    if (id >= vocab_size)
      throw UserError("shard '" + path + "' holds token id " + std::to_string(id) + " >= the model's vocab_size " +
                      std::to_string(vocab_size));
  if (s.metadata && !tokenizer_sha256.empty() && !s.metadata->tokenizer_sha256.empty() &&
      s.metadata->tokenizer_sha256 != tokenizer_sha256)
    throw UserError("shard '" + path + "' was made with another tokenizer (sha256 " +
                    s.metadata->tokenizer_sha256.substr(0, 12) + "..., expected " + tokenizer_sha256.substr(0, 12) +
                    "...)");
}

}  // namespace bert::data
