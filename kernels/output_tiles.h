// Products whose output is only reduced (a vocabulary's logits to a loss and a prediction) need never store
// it: made tile by tile, each tile handed to a visitor while it is in cache. For a (rows, vocabulary)
// product that is most of the memory traffic saved (gemm_tiles, int8_linear_per_row_tiles).
#pragma once

#include <cstdint>
#include <functional>

namespace bert {

// Called once per tile, on the thread that made it: rows r0 .. r1 and columns c0 .. c1 of the output, the
// tile's row i (of r0 + i), column j (of c0 + j) at tile[i * ld + j]. The buffer is the thread's own and is
// reused for its next tile.
using OutputTileVisitor =
    std::function<void(int64_t r0, int64_t r1, int64_t c0, int64_t c1, const float* tile, int64_t ld)>;

}  // namespace bert
