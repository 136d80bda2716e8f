// Errors in two tiers: programmer errors (BERT_CHECK, with file:line) and user/I-O errors (UserError).
#pragma once

#include <stdexcept>
#include <string>

namespace bert {

// A broken invariant inside the program: wrong shapes passed between our own functions, a stale
// handle. Carries file:line. Thrown (not abort) so tests can assert on it.
class InternalError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

// Something the user can fix: a bad path, a corrupt file, a flag out of range. The message names the
// file or flag, what was expected and what was found. Caught and printed by the tools' mains.
class UserError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Out of memory on a GPU: the message says what was asked for, what is in use and what the GPU has. The
// code that knows the work (the trainer: batch, length, precision) catches it and adds what to lower.
class OutOfDeviceMemory : public UserError {
 public:
  using UserError::UserError;
};

[[noreturn]] void throw_internal_error(const char* file, int line, const char* condition, const std::string& message);

}  // namespace bert

// BERT_CHECK(condition, message): message is any expression convertible to std::string and is only
// evaluated when the check fails.
#define BERT_CHECK(condition, message)                                                         \
  do {                                                                                         \
    if (!(condition)) ::bert::throw_internal_error(__FILE__, __LINE__, #condition, (message)); \
  } while (0)
