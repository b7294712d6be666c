// libFuzzer target for the safetensors header parser (engine/model/safetensors.h): the fuzz bytes
// are a whole .safetensors file. Invariants: Open never crashes or throws; a file it accepts has
// every entry inside the data section, and Read of any accepted F32/F16/BF16 entry either
// returns a tensor of exactly the entry's byte size or an error status (never an exception).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <ATen/ATen.h>

#include "engine/model/safetensors.h"

namespace {

const std::string& ScratchPath() {
  static const std::string path =
      "/tmp/dropkv_safetensors_fuzz_" + std::to_string(::getpid()) + ".safetensors";
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = ScratchPath();
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);

  auto file = dropkv::SafetensorsFile::Open(path);
  if (!file.ok()) return 0;
  const uint64_t data_len = size - 8 - [&] {
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | data[i];
    return n;
  }();
  for (const auto& [name, entry] : (*file)->entries()) {
    if (entry.begin > entry.end || entry.end > data_len) std::abort();  // accepted out of range
    // Only small tensors: the point is the header checks, not copying big buffers.
    if (entry.end - entry.begin > (1u << 16)) continue;
    if (entry.dtype != "F32" && entry.dtype != "F16" && entry.dtype != "BF16") continue;
    auto tensor = (*file)->Read(name);  // must not throw (c10::Error would abort the fuzzer)
    if (tensor.ok() && static_cast<uint64_t>(tensor->nbytes()) != entry.end - entry.begin) {
      std::abort();
    }
  }
  return 0;
}
