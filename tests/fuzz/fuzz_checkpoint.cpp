// The checkpoint reader: config attribute, then every tensor into a model built from it.
#include "model/bert.h"
#include "store/checkpoint.h"
#include "tests/fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace bert;
  fuzz::InputFile file(data, size, ".h5");
  fuzz::expect_clean([&] {
    model::BertConfig config = store::read_checkpoint_config(file.path());
    // A hostile config could ask for an enormous model; stay within the fuzzer's memory.
    if (config.vocab_size * config.hidden_size > (1 << 22) || config.num_hidden_layers > 4 ||
        config.intermediate_size * config.hidden_size > (1 << 22) || config.max_position_embeddings > 4096)
      return;
    model::Bert m(config);
    store::load_checkpoint(file.path(), m, nullptr);
  });
  return 0;
}
