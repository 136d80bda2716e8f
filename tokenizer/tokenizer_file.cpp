#include "tokenizer/tokenizer_file.h"

#include <filesystem>

#include "sys/atomic_file.h"
#include "sys/error.h"

namespace bert::tokenizer {

namespace fs = std::filesystem;

bool is_wordpiece_vocab(const std::string& path) { return path.ends_with(".txt"); }

std::string tokenizer_file_in(const std::string& dir) {
  std::error_code ec;
  for (const char* name : {"vocab.txt", "tokenizer.model"})
    if (fs::is_regular_file(fs::path(dir) / name, ec)) return (fs::path(dir) / name).string();
  return "";
}

std::string copy_tokenizer(const std::string& tokenizer_path, const std::string& dir, const std::string& file_name) {
  const bool wordpiece = is_wordpiece_vocab(tokenizer_path);
  const fs::path target =
      fs::path(dir) / (file_name.empty() ? (wordpiece ? "vocab.txt" : "tokenizer.model") : file_name);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!fs::exists(target) || !fs::equivalent(tokenizer_path, target, ec)) {
    AtomicFile copy(target.string());
    fs::copy_file(tokenizer_path, copy.temp_path(), fs::copy_options::overwrite_existing, ec);
    if (ec)
      throw UserError("cannot copy the tokenizer '" + tokenizer_path + "' to '" + target.string() +
                      "': " + ec.message());
    copy.commit();
  }
  const fs::path settings = fs::path(tokenizer_path).parent_path() / "tokenizer_config.json";
  const fs::path settings_copy = fs::path(dir) / "tokenizer_config.json";
  if (wordpiece && file_name.empty() && fs::is_regular_file(settings) &&
      !(fs::exists(settings_copy) && fs::equivalent(settings, settings_copy, ec))) {
    AtomicFile copy(settings_copy.string());
    fs::copy_file(settings, copy.temp_path(), fs::copy_options::overwrite_existing);
    copy.commit();
  }
  return target.string();
}

}  // namespace bert::tokenizer
