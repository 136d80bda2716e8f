// The JSON parser (configs, safetensors headers, metadata, plans) and the model config on top of it.
#include "sys/json.h"
#include "model/config.h"
#include "tests/fuzz/fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace bert;
  fuzz::expect_clean([&] {
    const Json json = Json::parse(fuzz::as_text(data, size));
    const std::string text = json.dump();
    if (Json::parse(text).dump() != text) __builtin_trap();  // dump -> parse -> dump is stable
    model::BertConfig::from_json(json);
  });
  return 0;
}
