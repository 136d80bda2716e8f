// Small RAII and convenience layer over the HDF5 C API, shared by shards and checkpoints: handles that
// close themselves, HDF5's own error printing silenced (we report errors ourselves), scalar
// attributes, and whole-dataset reads/writes with exact type checks.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace bert::data::hdf5 {

class Handle {
 public:
  Handle() = default;
  Handle(hid_t id, herr_t (*close)(hid_t)) : id_(id), close_(close) {}
  ~Handle() { reset(); }
  Handle(Handle&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = -1; }
  Handle& operator=(Handle&& o) noexcept {
    reset();
    id_ = o.id_;
    close_ = o.close_;
    o.id_ = -1;
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  hid_t get() const { return id_; }
  bool ok() const { return id_ >= 0; }

 private:
  void reset() {
    if (id_ >= 0 && close_) close_(id_);
    id_ = -1;
  }
  hid_t id_ = -1;
  herr_t (*close_)(hid_t) = nullptr;
};

// Silences HDF5's automatic error-stack printing for its lifetime. Every use of the library starts
// with one (the first also turns off HDF5's exit handler; see hdf5_io.cpp).
class Quiet {
 public:
  Quiet();
  ~Quiet();
  Quiet(const Quiet&) = delete;
  Quiet& operator=(const Quiet&) = delete;

 private:
  H5E_auto2_t old_func_ = nullptr;
  void* old_data_ = nullptr;
};

// Whether the HDF5 library serialises its calls across threads (built thread-safe), so that two threads may
// read and write files at once.
bool library_threadsafe();

// Opens an existing file read-only; UserError naming it if it is missing or not HDF5 ("what" says
// what kind of file was expected, e.g. "shard", "checkpoint").
Handle open_read(const std::string& path, const std::string& what);
// Creates (truncates) a file; UserError naming `display_path` on failure.
Handle create(const std::string& path, const std::string& display_path);

void write_attribute(hid_t object, const char* name, int64_t value);
void write_attribute(hid_t object, const char* name, const std::string& value);
std::optional<int64_t> read_int_attribute(hid_t object, const char* name);
std::optional<std::string> read_string_attribute(hid_t object, const char* name);  // fixed or variable length

// Creates intermediate groups as needed ("a/b/c" creates a and a/b).
hid_t link_creation_properties();
// Writes a whole dataset (gzip level `compression`, 0 for none); `dims` empty means a scalar.
template <typename T>
void write_dataset(hid_t file, const std::string& name, const T* data, const std::vector<hsize_t>& dims,
                   const std::string& path, int compression = 0);
// Reads a whole dataset whose type must be exactly T's (int8/int32/int64 signed integers, float32);
// returns its dims. UserError naming path and dataset on a missing dataset, another type, dims other
// than `expected` (when given), or a size the file cannot hold (checked before allocating).
template <typename T>
std::vector<hsize_t> read_dataset(hid_t file, const std::string& name, std::vector<T>& out, const std::string& path,
                                  const std::string& what, const std::vector<hsize_t>* expected = nullptr);
bool exists(hid_t file, const std::string& name);  // a link at this path (intermediate groups checked)
std::string dims_str(const std::vector<hsize_t>& dims);

}  // namespace bert::data::hdf5
