// Whole text files in and out, with the project's error conventions: reading names the file and what
// it was expected to be; writing is atomic (sys/atomic_file.h) and checks every write, so a full disk
// raises UserError and leaves any previous file untouched instead of renaming a truncated one over it.
#pragma once

#include <string>
#include <string_view>

namespace bert {

// The file's bytes. UserError "cannot read <what> '<path>': <reason>" if it is missing, not a regular
// file, or unreadable.
std::string read_text_file(const std::string& path, const std::string& what);

// Replaces `path` with `contents` atomically.
void write_text_file(const std::string& path, std::string_view contents);

}  // namespace bert
