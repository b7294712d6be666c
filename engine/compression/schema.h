// The compression settings' one schema: a row per CompressionParams field with its name, kind,
// range, enum names and help. Everything that reads or writes a setting goes through it: the
// validator (ValidateCompression), the server config's compression.* keys (YAML, --compression-*
// flags, DROPKV_COMPRESSION_* variables, --print-config), the tools' flags (cli_flags.h), the gRPC
// and HTTP requests (a row maps to the CompressionSettings field of the same name, by
// reflection) and the settings sent to tensor-parallel ranks (EncodeCompression). A new setting
// is a field in params.h, a row in schema.cpp and, when clients may send it, a proto field.
// Torch-free and protobuf-free.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/compression/params.h"

namespace dropkv::compression {

// Bounds of the integer settings. They bound the work one request can put on the engine thread:
// scoring costs window x context per layer and the pooling kernel's size per score
// (docs/reliability.md, "Cost of one request").
inline constexpr int32_t kMaxWindow = 1024;
inline constexpr int32_t kMaxPoolingKernel = 127;
inline constexpr int32_t kMaxNumSinks = 4096;
inline constexpr int64_t kMaxCompressionTokens = int64_t{1} << 24;  // chunk sizes, budgets, caps

enum class FieldKind { kEnum, kBool, kInt, kDouble, kString, kDoubleList };

struct CompressionField {
  std::string_view name;  // "keep_ratio": config key compression.<name>, the request's field
  // The tools' flag without dashes ("keep"; dropkv-generate --keep). The server's flag is
  // --compression-<name> and both read DROPKV_COMPRESSION_<NAME>.
  std::string_view tool_flag;
  FieldKind kind = FieldKind::kString;
  std::string help;                     // what it is, its range or names
  std::vector<std::string_view> names;  // kEnum: the accepted names, in table order
  // Settings of which one may be given (the budget forms); "" = none.
  std::string_view exclusive_group;
  // Parses `text` (the canonical text of get, or what a user typed) into `params` and checks its
  // range; the error says what is wrong with the value, without the field's name.
  std::function<absl::Status(CompressionParams&, std::string_view text)> set;
  // The canonical text of the value; null for a form that is not stored (compression_ratio is
  // converted to keep_ratio).
  std::function<std::string(const CompressionParams&)> get;
  // Whether the value is set (false for an absent optional); null = always.
  std::function<bool(const CompressionParams&)> present;
  // The value's range; the error as set's.
  std::function<absl::Status(const CompressionParams&)> check;

  bool stored() const { return static_cast<bool>(get); }
  bool is_present(const CompressionParams& p) const { return !present || present(p); }
};

// Every row, in documentation order.
std::span<const CompressionField> CompressionFields();
const CompressionField* FindCompressionField(std::string_view name);

// "keep_ratio" -> "DROPKV_COMPRESSION_KEEP_RATIO" (the server's and the tools' variable).
std::string CompressionEnvName(const CompressionField& field);

// The ranges of every stored field: the first failure as "<name>: <what>".
absl::Status CheckCompressionRanges(const CompressionParams& params);

// Every stored field as text, and back: the settings as tensor-parallel ranks receive them.
// Decode starts from the defaults, so a field the sender did not have keeps its default, and
// fails on a field this build does not know (ranks of different builds).
std::string EncodeCompression(const CompressionParams& params);
absl::StatusOr<CompressionParams> DecodeCompression(std::string_view bytes);

}  // namespace dropkv::compression
