#include "sys/float_env.h"

#include <cstdlib>
#include <string_view>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

namespace bert {

namespace {
#if defined(__x86_64__) || defined(_M_X64)
constexpr unsigned kFlushToZero = 0x8000, kDenormalsAreZero = 0x0040;  // MXCSR bits 15 and 6
#endif
}  // namespace

void flush_denormals_to_zero() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_setcsr(_mm_getcsr() | kFlushToZero | kDenormalsAreZero);
#endif
}

void apply_denormal_setting() {
  const char* keep = std::getenv("BERT_KEEP_DENORMALS");
  if (!keep || std::string_view(keep) != "1") flush_denormals_to_zero();
}

bool flushes_denormals() {
#if defined(__x86_64__) || defined(_M_X64)
  const unsigned both = kFlushToZero | kDenormalsAreZero;
  return (_mm_getcsr() & both) == both;
#else
  return false;
#endif
}

}  // namespace bert
