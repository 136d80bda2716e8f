#include "sys/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "sys/error.h"

namespace bert {

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  temp_path_ = path_ + ".tmp." + std::to_string(::getpid());
}

AtomicFile::~AtomicFile() {
  if (!committed_) std::remove(temp_path_.c_str());
}

void AtomicFile::commit() {
  BERT_CHECK(!committed_, "commit() twice for " + path_);
  int fd = ::open(temp_path_.c_str(), O_RDONLY);
  if (fd < 0 || ::fsync(fd) != 0) {
    const std::string why = std::strerror(errno);
    if (fd >= 0) ::close(fd);
    throw UserError("cannot flush '" + temp_path_ + "' to disk (" + why + "); '" + path_ + "' was left unchanged");
  }
  ::close(fd);
  if (std::rename(temp_path_.c_str(), path_.c_str()) != 0)
    throw UserError("cannot rename '" + temp_path_ + "' to '" + path_ + "' (" + std::strerror(errno) +
                    "); the previous file, if any, was left unchanged");
  committed_ = true;
}

}  // namespace bert
