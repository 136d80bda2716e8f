// The safetensors reader: header parsing and validation, then reading every tensor it accepted.
#include "store/safetensors.h"
#include "tests/fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace bert;
  fuzz::InputFile file(data, size, ".safetensors");
  fuzz::expect_clean([&] {
    hf::SafetensorsFile f(file.path());
    for (const hf::TensorEntry& t : f.tensors()) {
      const std::vector<float> values = f.read(t);
      if (static_cast<int64_t>(values.size()) != t.num_elements()) __builtin_trap();
    }
  });
  return 0;
}
