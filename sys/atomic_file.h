// AtomicFile: write a file so that readers see either the previous version or the complete new one.
// Writers write to temp_path(); commit() flushes it to disk and renames it over the target (atomic
// on POSIX). If commit() is never reached (an exception, a full disk, Ctrl-C), the destructor removes
// the temporary and any previous file at the target stays intact.
#pragma once

#include <string>

namespace bert {

class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_path_; }
  // fsync + rename; throws UserError naming the file if either fails (e.g. disk full).
  void commit();

 private:
  std::string path_, temp_path_;
  bool committed_ = false;
};

}  // namespace bert
