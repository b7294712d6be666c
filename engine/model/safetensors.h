// safetensors files: a memory-mapped reader (single file or a sharded folder with
// model.safetensors.index.json) and a small writer (converter, demo model, tests).
// Format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}},
// then the data. Errors name the file and the tensor.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace dropkv {

class MappedFile;

struct SafetensorsEntry {
  std::string dtype;  // "F32", "F16", "BF16", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets into the data section
  uint64_t end = 0;
};

// One mapped .safetensors file with a validated header.
class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  const std::string& path() const;
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  // A CPU tensor that owns a copy of the data, in the file's dtype. Only F32/F16/BF16/F8_E4M3.
  absl::StatusOr<at::Tensor> Read(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  std::unique_ptr<MappedFile> file_;
  const std::byte* data_ = nullptr;  // start of the data section
  std::map<std::string, SafetensorsEntry> entries_;
};

// Every .safetensors file of a model folder: model.safetensors, or the shards listed in
// model.safetensors.index.json (each must exist).
class SafetensorsFolder {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFolder>> Open(const std::string& model_dir);
  // The file that holds `name`, or nullptr.
  const SafetensorsFile* Find(const std::string& name) const;
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*> by_name_;
};

// Writes named CPU tensors (F32/F16/BF16/F8_E4M3) to `path`, in the given order.
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<std::pair<std::string, at::Tensor>>& tensors);

}  // namespace dropkv
