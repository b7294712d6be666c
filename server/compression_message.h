// The gRPC CompressionSettings message and the compression schema (engine/compression/schema.h):
// a schema row maps to the message field of its name, by reflection, so a new setting that
// clients may send is a row and a proto field, with no mapping code. The server's validation
// (MapCompression) and dropkv-cli's flags use this. No torch.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "dropkv/v1/inference.pb.h"
#include "engine/compression/schema.h"

namespace dropkv {

// The message field of `field`'s row; null when clients cannot send it (profile_path, ...).
const google::protobuf::FieldDescriptor* CompressionMessageField(
    const compression::CompressionField& field);

// The field's value as text for its row's `set`; nullopt when the message does not set it (an
// empty string is unset: the server's default stays).
std::optional<std::string> CompressionMessageText(const v1::CompressionSettings& message,
                                                  const compression::CompressionField& field);

// Sets the row's message field from text of the field's type (no range check: the server's).
// INVALID_ARGUMENT "expected ..." when the text is not of that type.
absl::Status SetCompressionMessageText(v1::CompressionSettings* message,
                                       const compression::CompressionField& field,
                                       std::string_view text);

// Every field of `params` that the message has (ServerInfo's default compression).
void CompressionToMessage(const CompressionParams& params, v1::CompressionSettings* out);

}  // namespace dropkv
