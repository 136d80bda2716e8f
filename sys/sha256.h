// SHA-256 of a file, as lowercase hex: the same string `sha256sum FILE` prints. Used to tie shards,
// checkpoints and exports to the exact tokenizer file they were made with.
#pragma once

#include <string>
#include <string_view>

namespace bert {

std::string sha256_hex(std::string_view bytes);
// Throws UserError naming the file if it cannot be read.
std::string sha256_file(const std::string& path);

}  // namespace bert
