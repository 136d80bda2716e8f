// The shard reader (HDF5 in NVIDIA's layout, our metadata, id ranges).
#include "data/shard.h"
#include "tests/fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace bert;
  fuzz::InputFile file(data, size, ".hdf5");
  fuzz::expect_clean([&] { data::read_shard(file.path()); });
  return 0;
}
