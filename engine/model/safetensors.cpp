#include "engine/model/safetensors.h"

#include <ATen/ATen.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "engine/common/file_util.h"
#include "engine/common/status_macros.h"
#include "engine/model/log.h"

namespace dropkv {
namespace {

using json = nlohmann::json;

int64_t DtypeBytes(const std::string& dtype) {
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2")
    return 1;
  return 0;
}

std::optional<at::ScalarType> ToScalarType(const std::string& dtype) {
  if (dtype == "F32") return at::kFloat;
  if (dtype == "F16") return at::kHalf;
  if (dtype == "BF16") return at::kBFloat16;
  if (dtype == "F8_E4M3") return at::kFloat8_e4m3fn;  // FP8 checkpoints' projection weights
  return std::nullopt;
}

const char* DtypeName(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "F32";
    case at::kHalf:
      return "F16";
    case at::kBFloat16:
      return "BF16";
    case at::kFloat8_e4m3fn:
      return "F8_E4M3";
    default:
      return nullptr;
  }
}

}  // namespace

SafetensorsFile::~SafetensorsFile() = default;
const std::string& SafetensorsFile::path() const {
  return file_->path();
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  ASSIGN_OR_RETURN(auto mapped, MappedFile::Open(path));
  const uint64_t size = mapped->size_bytes();
  if (size < 8)
    return absl::DataLossError(
        absl::StrCat(path, ": truncated safetensors file (", size, " bytes)"));
  uint64_t header_len = 0;
  std::memcpy(&header_len, mapped->data(), 8);  // little-endian hosts only (x86, arm64)
  if (header_len > size - 8) {
    return absl::DataLossError(absl::StrCat(path, ": truncated safetensors file: header of ",
                                            header_len, " bytes but the file has ", size));
  }
  json header;
  try {
    header = json::parse(reinterpret_cast<const char*>(mapped->data()) + 8,
                         reinterpret_cast<const char*>(mapped->data()) + 8 + header_len);
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat(path, ": bad safetensors header: ", e.what()));
  }
  if (!header.is_object())
    return absl::DataLossError(absl::StrCat(path, ": safetensors header is not an object"));
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  const uint64_t data_len = size - 8 - header_len;
  for (const auto& [name, e] : header.items()) {
    if (name == "__metadata__") continue;
    SafetensorsEntry entry;
    try {
      entry.dtype = e.at("dtype").get<std::string>();
      entry.shape = e.at("shape").get<std::vector<int64_t>>();
      const auto offsets = e.at("data_offsets").get<std::vector<uint64_t>>();
      if (offsets.size() != 2) throw std::runtime_error("data_offsets needs 2 values");
      entry.begin = offsets[0];
      entry.end = offsets[1];
    } catch (const std::exception& ex) {
      return absl::DataLossError(
          absl::StrCat(path, ": tensor '", name, "': bad header entry: ", ex.what()));
    }
    if (entry.end < entry.begin || entry.end > data_len) {
      return absl::DataLossError(absl::StrCat(path, ": tensor '", name, "': data [", entry.begin,
                                              ", ", entry.end, ") lies outside the file's ",
                                              data_len, " data bytes (truncated file?)"));
    }
    // Checked arithmetic: a corrupt header must not overflow its way past the size check.
    int64_t numel = 1;
    bool bad_shape = false;
    for (int64_t d : entry.shape) bad_shape |= d < 0 || __builtin_mul_overflow(numel, d, &numel);
    const int64_t elem = DtypeBytes(entry.dtype);
    int64_t num_bytes = 0;
    bad_shape |= __builtin_mul_overflow(numel, elem, &num_bytes);
    if (bad_shape) {
      return absl::DataLossError(
          absl::StrCat(path, ": tensor '", name, "': invalid shape (negative or overflowing)"));
    }
    if (elem > 0 && static_cast<uint64_t>(num_bytes) != entry.end - entry.begin) {
      return absl::DataLossError(
          absl::StrCat(path, ": tensor '", name, "': ", entry.end - entry.begin,
                       " bytes do not match its shape and dtype ", entry.dtype));
    }
    f->entries_.emplace(name, std::move(entry));
  }
  f->data_ = mapped->data() + 8 + header_len;
  f->file_ = std::move(mapped);
  return f;
}

absl::StatusOr<at::Tensor> SafetensorsFile::Read(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end())
    return absl::NotFoundError(absl::StrCat(path(), ": no tensor '", name, "'"));
  const auto& e = it->second;
  auto st = ToScalarType(e.dtype);
  if (!st) {
    return absl::InvalidArgumentError(absl::StrCat(path(), ": tensor '", name, "' has dtype ",
                                                   e.dtype,
                                                   "; supported: F32, F16, BF16, F8_E4M3"));
  }
  // A copy, not a view of the mapping: the mapping may be unaligned and must not outlive us.
  try {
    at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(*st));
    if (e.end > e.begin)
      std::memcpy(t.data_ptr(), data_ + e.begin, e.end - e.begin);  // empty: no data pointer
    return t;
  } catch (const std::exception& ex) {
    return absl::DataLossError(absl::StrCat(path(), ": tensor '", name, "': ", ex.what()));
  }
}

absl::StatusOr<std::unique_ptr<SafetensorsFolder>> SafetensorsFolder::Open(
    const std::string& model_dir) {
  namespace fs = std::filesystem;
  auto folder = std::make_unique<SafetensorsFolder>();
  const fs::path dir(model_dir);
  std::vector<std::string> shard_names;
  const fs::path index_path = dir / "model.safetensors.index.json";
  if (fs::exists(index_path)) {
    ASSIGN_OR_RETURN(std::string text, ReadFileToString(index_path.string()));
    std::set<std::string> uniq;
    try {
      json j = json::parse(text);
      for (const auto& [tensor, file] : j.at("weight_map").items())
        uniq.insert(file.get<std::string>());
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path.string(), ": bad index: ", e.what()));
    }
    shard_names.assign(uniq.begin(), uniq.end());
  } else if (fs::exists(dir / "model.safetensors")) {
    shard_names.push_back("model.safetensors");
  } else {
    return absl::NotFoundError(
        absl::StrCat(model_dir, ": no model.safetensors or model.safetensors.index.json"));
  }
  for (size_t i = 0; i < shard_names.size(); ++i) {
    const fs::path p = dir / shard_names[i];
    if (!fs::exists(p)) {
      return absl::NotFoundError(absl::StrCat(p.string(), ": missing shard (listed in ",
                                              index_path.filename().string(), ")"));
    }
    ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(p.string()));
    LogInfo(absl::StrCat("model: mapped shard ", i + 1, "/", shard_names.size(), " ", p.string(),
                         " (", file->entries().size(), " tensors)"));
    for (const auto& [name, e] : file->entries()) folder->by_name_[name] = file.get();
    folder->files_.push_back(std::move(file));
  }
  return folder;
}

const SafetensorsFile* SafetensorsFolder::Find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second;
}

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  json header = json::object();
  uint64_t offset = 0;
  std::vector<at::Tensor> data;
  for (const auto& [name, t0] : tensors) {
    const char* dt = DtypeName(t0.scalar_type());
    if (dt == nullptr)
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': unsupported dtype"));
    at::Tensor t = t0.to(at::kCPU).contiguous();
    const uint64_t n = t.numel() * t.element_size();
    header[name] = {
        {"dtype", dt}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + n}}};
    offset += n;
    data.push_back(t);
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8 != 0) h.push_back(' ');  // align the data section as HF does
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat(path, ": cannot open for writing"));
  const uint64_t hlen = h.size();
  out.write(reinterpret_cast<const char*>(&hlen), 8);
  out.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (const auto& t : data) {
    out.write(static_cast<const char*>(t.data_ptr()),
              static_cast<std::streamsize>(t.numel() * t.element_size()));
  }
  if (!out) return absl::DataLossError(absl::StrCat(path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace dropkv
