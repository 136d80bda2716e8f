// The CPU's handling of denormal floats for this thread and the threads it starts afterwards (they
// inherit it): flushed to zero (FTZ, results) and read as zero (DAZ, operands). Intel cores take a
// slow microcode assist for every denormal operand or result (values below 1.2e-38, e.g. GELU and
// exp tails), which made FP32 evaluation on a Xeon 1.3-1.5x slower than the same work without them;
// no BERT value that small matters. GPUs flush them in the same way.
#pragma once

namespace bert {

// Sets FTZ and DAZ in this thread's MXCSR (x86-64; elsewhere nothing). Call before any thread pool
// starts (first in main), so that every worker thread inherits it.
void flush_denormals_to_zero();
// What the programs do first: flush_denormals_to_zero() unless the environment says
// BERT_KEEP_DENORMALS=1 (to measure or compare with the IEEE default).
void apply_denormal_setting();
// Whether this thread flushes denormals (both bits set).
bool flushes_denormals();

}  // namespace bert
