#include "data/hdf5_io.h"

#include <algorithm>
#include <filesystem>
#include <type_traits>

#include "sys/error.h"

namespace bert::data::hdf5 {

Quiet::Quiet() {
  // HDF5 1.10 closes still-open files in an exit handler; after a write failed (a full disk) the file
  // it could not close makes that handler crash (seen: SIGSEGV in H5F__close_cb). Every handle here is
  // closed by RAII, so the handler is not needed: turn it off before the library initialises (a later
  // call only returns an error, which is harmless).
  static const bool no_exit_handler = H5dont_atexit() >= 0;
  (void)no_exit_handler;
  H5Eget_auto2(H5E_DEFAULT, &old_func_, &old_data_);
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
}
Quiet::~Quiet() { H5Eset_auto2(H5E_DEFAULT, old_func_, old_data_); }

bool library_threadsafe() {
  hbool_t threadsafe = 0;
  return H5is_library_threadsafe(&threadsafe) >= 0 && threadsafe;
}

Handle open_read(const std::string& path, const std::string& what) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) throw UserError(what + " '" + path + "' does not exist");
  if (H5Fis_hdf5(path.c_str()) <= 0)
    throw UserError(what + " '" + path + "' is not an HDF5 file (truncated or corrupt?)");
  Handle h(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!h.ok()) throw UserError(what + " '" + path + "' cannot be opened as HDF5 (truncated or corrupt?)");
  return h;
}

Handle create(const std::string& path, const std::string& display_path) {
  Handle h(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), H5Fclose);
  if (!h.ok()) throw UserError("cannot create '" + display_path + "' (missing folder or no permission?)");
  return h;
}

void write_attribute(hid_t object, const char* name, int64_t value) {
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle attr(H5Acreate2(object, name, H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  if (!attr.ok() || H5Awrite(attr.get(), H5T_NATIVE_INT64, &value) < 0)
    throw UserError(std::string("cannot write attribute '") + name + "'");
}

void write_attribute(hid_t object, const char* name, const std::string& value) {
  Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
  H5Tset_size(type.get(), std::max<size_t>(value.size(), 1));
  H5Tset_cset(type.get(), H5T_CSET_UTF8);
  Handle space(H5Screate(H5S_SCALAR), H5Sclose);
  Handle attr(H5Acreate2(object, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  std::string padded = value.empty() ? std::string(1, '\0') : value;
  if (!attr.ok() || H5Awrite(attr.get(), type.get(), padded.c_str()) < 0)
    throw UserError(std::string("cannot write attribute '") + name + "'");
}

std::optional<int64_t> read_int_attribute(hid_t object, const char* name) {
  if (H5Aexists(object, name) <= 0) return std::nullopt;
  Handle attr(H5Aopen(object, name, H5P_DEFAULT), H5Aclose);
  Handle type(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tget_class(type.get()) != H5T_INTEGER) return std::nullopt;
  int64_t value = 0;
  if (H5Aread(attr.get(), H5T_NATIVE_INT64, &value) < 0) return std::nullopt;
  return value;
}

std::optional<std::string> read_string_attribute(hid_t object, const char* name) {
  if (H5Aexists(object, name) <= 0) return std::nullopt;
  Handle attr(H5Aopen(object, name, H5P_DEFAULT), H5Aclose);
  Handle type(H5Aget_type(attr.get()), H5Tclose);
  if (H5Tget_class(type.get()) != H5T_STRING) return std::nullopt;
  if (H5Tis_variable_str(type.get()) > 0) {
    Handle mem(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(mem.get(), H5T_VARIABLE);
    H5Tset_cset(mem.get(), H5Tget_cset(type.get()));
    char* s = nullptr;
    if (H5Aread(attr.get(), mem.get(), &s) < 0 || !s) return std::nullopt;
    std::string value(s);
    H5free_memory(s);
    return value;
  }
  std::string value(H5Tget_size(type.get()), '\0');
  if (H5Aread(attr.get(), type.get(), value.data()) < 0) return std::nullopt;
  value.erase(std::find(value.begin(), value.end(), '\0'), value.end());
  return value;
}

hid_t link_creation_properties() {
  static thread_local Handle props = [] {
    Handle p(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
    H5Pset_create_intermediate_group(p.get(), 1);
    return p;
  }();
  return props.get();
}

bool exists(hid_t file, const std::string& name) {
  size_t at = 0;
  while (true) {  // every prefix must exist before H5Lexists may be asked about the next
    at = name.find('/', at + 1);
    const std::string prefix = name.substr(0, at);
    if (H5Lexists(file, prefix.c_str(), H5P_DEFAULT) <= 0) return false;
    if (at == std::string::npos) return true;
  }
}

std::string dims_str(const std::vector<hsize_t>& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

namespace {
template <typename T>
hid_t file_type() {
  if constexpr (std::is_same_v<T, float>) return H5T_IEEE_F32LE;
  if constexpr (std::is_same_v<T, int64_t>) return H5T_STD_I64LE;
  if constexpr (std::is_same_v<T, int32_t>) return H5T_STD_I32LE;
  if constexpr (std::is_same_v<T, int8_t>) return H5T_STD_I8LE;
}
template <typename T>
hid_t memory_type() {
  if constexpr (std::is_same_v<T, float>) return H5T_NATIVE_FLOAT;
  if constexpr (std::is_same_v<T, int64_t>) return H5T_NATIVE_INT64;
  if constexpr (std::is_same_v<T, int32_t>) return H5T_NATIVE_INT32;
  if constexpr (std::is_same_v<T, int8_t>) return H5T_NATIVE_INT8;
}
template <typename T>
std::string type_name() {
  if constexpr (std::is_same_v<T, float>) return "float32";
  return "int" + std::to_string(8 * sizeof(T));
}
}  // namespace

template <typename T>
void write_dataset(hid_t file, const std::string& name, const T* data, const std::vector<hsize_t>& dims,
                   const std::string& path, int compression) {
  Handle space(
      dims.empty() ? H5Screate(H5S_SCALAR) : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
      H5Sclose);
  Handle props(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  if (compression > 0 && !dims.empty() && dims[0] > 0) {  // chunked + gzip (empty datasets cannot be chunked)
    std::vector<hsize_t> chunk = dims;
    chunk[0] = std::min<hsize_t>(dims[0], 1024);
    H5Pset_chunk(props.get(), static_cast<int>(chunk.size()), chunk.data());
    H5Pset_deflate(props.get(), static_cast<unsigned>(compression));
  }
  Handle set(
      H5Dcreate2(file, name.c_str(), file_type<T>(), space.get(), link_creation_properties(), props.get(), H5P_DEFAULT),
      H5Dclose);
  if (!set.ok() || H5Dwrite(set.get(), memory_type<T>(), H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0)
    throw UserError("cannot write dataset '" + name + "' to '" + path + "' (disk full?)");
}

template <typename T>
std::vector<hsize_t> read_dataset(hid_t file, const std::string& name, std::vector<T>& out, const std::string& path,
                                  const std::string& what, const std::vector<hsize_t>* expected) {
  const std::string where = what + " '" + path + "': dataset '" + name + "'";
  if (!exists(file, name)) throw UserError(where + " is missing");
  Handle set(H5Dopen2(file, name.c_str(), H5P_DEFAULT), H5Dclose);
  if (!set.ok()) throw UserError(where + " cannot be opened");
  Handle type(H5Dget_type(set.get()), H5Tclose);
  const H5T_class_t cls = H5Tget_class(type.get());
  const size_t size = H5Tget_size(type.get());
  const bool want_float = std::is_same_v<T, float>;
  const bool ok = want_float ? (cls == H5T_FLOAT && size == 4)
                             : (cls == H5T_INTEGER && size == sizeof(T) && H5Tget_sign(type.get()) == H5T_SGN_2);
  if (!ok) {
    std::string found = cls == H5T_FLOAT     ? "float" + std::to_string(8 * size)
                        : cls == H5T_INTEGER ? std::string(H5Tget_sign(type.get()) == H5T_SGN_2 ? "int" : "uint") +
                                                   std::to_string(8 * size)
                                             : "non-numeric";
    if (cls == H5T_FLOAT && !want_float) found = "float";
    throw UserError(where + " has dtype " + found + ", expected " + type_name<T>());
  }
  Handle space(H5Dget_space(set.get()), H5Sclose);
  const int rank = H5Sget_simple_extent_ndims(space.get());
  std::vector<hsize_t> dims(std::max(rank, 0));
  if (rank > 0) H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  if (expected && dims != *expected)
    throw UserError(where + " has shape " + dims_str(dims) + ", expected " + dims_str(*expected));
  // Allocate only what the file can hold: its stored bytes, at most deflate's 1032:1 ratio, so a
  // corrupt header cannot ask for terabytes (found by fuzzing).
  hsize_t n = 1;
  for (hsize_t d : dims) {
    if (d != 0 && n > (hsize_t(1) << 40) / d) throw UserError(where + " has an impossible shape " + dims_str(dims));
    n *= d;
  }
  // Only chunked datasets can be compressed; the others must store every byte. The stored size comes
  // from the file's own index, so it is capped by the file's size too.
  hsize_t stored = H5Dget_storage_size(set.get());
  hsize_t file_size = 0;
  if (Handle owner(H5Iget_file_id(set.get()), H5Fclose); owner.ok()) H5Fget_filesize(owner.get(), &file_size);
  stored = std::min(stored, file_size);
  Handle create_plist(H5Dget_create_plist(set.get()), H5Pclose);
  const H5D_layout_t layout = create_plist.ok() ? H5Pget_layout(create_plist.get()) : H5D_LAYOUT_ERROR;
  // Compact storage (data inside the object header) is never written by this project or by h5py's
  // defaults, and libhdf5 1.10 overflows its buffer on corrupt compact datasets (found by fuzzing).
  if (layout != H5D_CONTIGUOUS && layout != H5D_CHUNKED)
    throw UserError(where + " has " + (layout == H5D_COMPACT ? "compact" : "an unknown") +
                    " storage layout (expected contiguous or chunked)");
  const bool chunked = layout == H5D_CHUNKED;
  if (chunked) {
    // A chunk shape that disagrees with the dataspace sends libhdf5's reader into multi-GB allocations
    // (found by fuzzing): the chunk must have the dataset's rank and fit what the file can hold.
    std::vector<hsize_t> chunk(std::max(rank, 1));
    const int chunk_rank = H5Pget_chunk(create_plist.get(), static_cast<int>(chunk.size()), chunk.data());
    hsize_t chunk_elements = 1;
    for (int i = 0; i < std::max(chunk_rank, 0) && i < static_cast<int>(chunk.size()); ++i)
      chunk_elements *= std::max<hsize_t>(chunk[i], 1);
    if (chunk_rank != rank || rank < 1 || chunk_elements * sizeof(T) > std::min(stored, file_size) * 1032 + 4096)
      throw UserError(where + " has an inconsistent chunk layout (truncated or corrupt file?)");
  }
  const hsize_t bytes = n * sizeof(T);
  if (!chunked && bytes > 0) {
    // Contiguous data must lie inside the file (libhdf5 trusts the address and its sieve buffer
    // overflows on a corrupt one: found by fuzzing).
    const haddr_t offset = H5Dget_offset(set.get());
    if (offset == HADDR_UNDEF || offset > file_size || bytes > file_size - offset)
      throw UserError(where + " lies outside the file (truncated or corrupt file?)");
  }
  // Without a filter nothing is compressed, chunked or not: every byte must be stored (libhdf5 trusts
  // its chunk index and reads past a short chunk: a heap overflow found by fuzzing).
  const bool filtered = create_plist.ok() && H5Pget_nfilters(create_plist.get()) > 0;
  if (chunked && filtered ? bytes > stored * 1032 + 4096 : bytes > stored)
    throw UserError(where + " claims " + std::to_string(n) + " elements but stores only " + std::to_string(stored) +
                    " bytes (truncated or corrupt file?)");
  out.resize(n);
  if (n > 0 && H5Dread(set.get(), memory_type<T>(), H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()) < 0)
    throw UserError(where + " cannot be read (truncated or corrupt file?)");
  return dims;
}

#define BERT_INSTANTIATE(T)                                                                                            \
  template void write_dataset<T>(hid_t, const std::string&, const T*, const std::vector<hsize_t>&, const std::string&, \
                                 int);                                                                                 \
  template std::vector<hsize_t> read_dataset<T>(hid_t, const std::string&, std::vector<T>&, const std::string&,        \
                                                const std::string&, const std::vector<hsize_t>*);
BERT_INSTANTIATE(float)
BERT_INSTANTIATE(int64_t)
BERT_INSTANTIATE(int32_t)
BERT_INSTANTIATE(int8_t)
#undef BERT_INSTANTIATE

}  // namespace bert::data::hdf5
