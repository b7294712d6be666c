// libFuzzer target for the config.json loader (engine/model/config.h ParseModelConfig): arbitrary
// bytes as config.json text. Invariants: no crash, no exception, no sanitizer report; a config
// it accepts has positive sizes and heads that divide evenly (what the model code relies on).
#include <cstdint>
#include <cstdlib>
#include <string>

#include "engine/model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto config = dropkv::ParseModelConfig(text, "fuzz/config.json");
  if (!config.ok()) {
    if (config.status().message().empty()) std::abort();  // errors must say what is wrong
    return 0;
  }
  if (config->num_layers <= 0 || config->hidden_size <= 0 || config->intermediate_size <= 0 ||
      config->num_heads <= 0 || config->num_kv_heads <= 0 || config->vocab_size <= 0 ||
      config->head_dim <= 0) {
    std::abort();
  }
  if (config->num_heads % config->num_kv_heads != 0 || config->head_dim % 2 != 0) std::abort();
  return 0;
}
