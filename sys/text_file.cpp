#include "sys/text_file.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "sys/atomic_file.h"
#include "sys/error.h"

namespace bert {

std::string read_text_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw UserError("cannot read " + what + " '" + path +
                    "': " + (std::filesystem::exists(path, ec) ? "not a regular file" : "no such file"));
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  if (in) text << in.rdbuf();
  if (!in || in.bad()) throw UserError("cannot read " + what + " '" + path + "': " + std::strerror(errno));
  return text.str();
}

void write_text_file(const std::string& path, std::string_view contents) {
  AtomicFile file(path);
  {
    std::ofstream out(file.temp_path(), std::ios::binary | std::ios::trunc);
    if (!out) throw UserError("cannot create '" + file.temp_path() + "' (" + std::strerror(errno) + ")");
    out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    out.flush();
    if (!out) throw UserError("cannot write '" + path + "' (disk full?); any previous file was left unchanged");
  }
  file.commit();
}

}  // namespace bert
