// libFuzzer target for the YAML server config (config/server_config.h): arbitrary bytes as a
// config file. Invariants: no crash, no exception, no sanitizer report; a config it accepts and
// that passes ValidateServerConfig prints (ServerConfigToYaml) to YAML that parses back and prints
// the same again (the documented round trip of --print-config).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "config/server_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto config = dropkv::ParseServerConfigYaml(text, "fuzz.yaml");
  if (!config.ok()) {
    if (config.status().message().empty()) std::abort();  // errors must say what is wrong
    return 0;
  }
  if (!dropkv::ValidateServerConfig(*config).ok()) return 0;
  const std::string yaml = dropkv::ServerConfigToYaml(*config);
  auto again = dropkv::ParseServerConfigYaml(yaml, "printed.yaml");
  if (!again.ok()) {
    std::fprintf(stderr, "printed config does not parse back: %s\n%s\n",
                 std::string(again.status().message()).c_str(), yaml.c_str());
    std::abort();
  }
  if (dropkv::ServerConfigToYaml(*again) != yaml) {
    std::fprintf(stderr, "round trip changed the config:\n%s\n---\n%s\n", yaml.c_str(),
                 dropkv::ServerConfigToYaml(*again).c_str());
    std::abort();
  }
  return 0;
}
