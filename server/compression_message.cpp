#include "server/compression_message.h"

#include "absl/strings/str_cat.h"
#include "engine/common/text_value.h"

namespace dropkv {
namespace {

using google::protobuf::FieldDescriptor;

// A set proto field's value as the text its schema row parses.
std::string ProtoFieldText(const google::protobuf::Message& m, const FieldDescriptor* fd) {
  const google::protobuf::Reflection* r = m.GetReflection();
  switch (fd->cpp_type()) {
    case FieldDescriptor::CPPTYPE_STRING:
      return r->GetString(m, fd);
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return FormatDoubleText(r->GetDouble(m, fd));
    case FieldDescriptor::CPPTYPE_FLOAT:
      return FormatDoubleText(r->GetFloat(m, fd));
    case FieldDescriptor::CPPTYPE_INT32:
      return absl::StrCat(r->GetInt32(m, fd));
    case FieldDescriptor::CPPTYPE_INT64:
      return absl::StrCat(r->GetInt64(m, fd));
    case FieldDescriptor::CPPTYPE_UINT32:
      return absl::StrCat(r->GetUInt32(m, fd));
    case FieldDescriptor::CPPTYPE_UINT64:
      return absl::StrCat(r->GetUInt64(m, fd));
    case FieldDescriptor::CPPTYPE_BOOL:
      return r->GetBool(m, fd) ? "true" : "false";
    default:
      return "";
  }
}

// Sets proto field `fd` from its row's canonical text.
absl::Status SetProtoFieldText(google::protobuf::Message* m, const FieldDescriptor* fd,
                               std::string_view text) {
  const google::protobuf::Reflection* r = m->GetReflection();
  switch (fd->cpp_type()) {
    case FieldDescriptor::CPPTYPE_STRING:
      r->SetString(m, fd, std::string(text));
      return absl::OkStatus();
    case FieldDescriptor::CPPTYPE_DOUBLE:
    case FieldDescriptor::CPPTYPE_FLOAT: {
      absl::StatusOr<double> d = ParseDoubleText(text);
      if (!d.ok()) return d.status();
      if (fd->cpp_type() == FieldDescriptor::CPPTYPE_DOUBLE)
        r->SetDouble(m, fd, *d);
      else
        r->SetFloat(m, fd, static_cast<float>(*d));
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_BOOL: {
      absl::StatusOr<bool> b = ParseBoolText(text);
      if (!b.ok()) return b.status();
      r->SetBool(m, fd, *b);
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_UINT32:
    case FieldDescriptor::CPPTYPE_UINT64: {
      absl::StatusOr<uint64_t> u = ParseUintText(text);
      if (!u.ok()) return u.status();
      if (fd->cpp_type() == FieldDescriptor::CPPTYPE_UINT64)
        r->SetUInt64(m, fd, *u);
      else
        r->SetUInt32(m, fd, static_cast<uint32_t>(*u));
      return absl::OkStatus();
    }
    case FieldDescriptor::CPPTYPE_INT32:
    case FieldDescriptor::CPPTYPE_INT64: {
      absl::StatusOr<int64_t> i = ParseIntText(text);
      if (!i.ok()) return i.status();
      if (fd->cpp_type() == FieldDescriptor::CPPTYPE_INT64)
        r->SetInt64(m, fd, *i);
      else
        r->SetInt32(m, fd, static_cast<int32_t>(*i));
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError("field type has no schema mapping");
  }
}

}  // namespace

const google::protobuf::FieldDescriptor* CompressionMessageField(
    const compression::CompressionField& field) {
  return v1::CompressionSettings::descriptor()->FindFieldByName(std::string(field.name));
}

std::optional<std::string> CompressionMessageText(const v1::CompressionSettings& message,
                                                  const compression::CompressionField& field) {
  const FieldDescriptor* fd = CompressionMessageField(field);
  if (fd == nullptr || !message.GetReflection()->HasField(message, fd)) return std::nullopt;
  return ProtoFieldText(message, fd);
}

absl::Status SetCompressionMessageText(v1::CompressionSettings* message,
                                       const compression::CompressionField& field,
                                       std::string_view text) {
  const FieldDescriptor* fd = CompressionMessageField(field);
  if (fd == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("not a request field: ", AbslView(field.name)));
  }
  return SetProtoFieldText(message, fd, text);
}

void CompressionToMessage(const CompressionParams& params, v1::CompressionSettings* out) {
  for (const compression::CompressionField& field : compression::CompressionFields()) {
    if (!field.stored() || !field.is_present(params) || !CompressionMessageField(field)) continue;
    // The row's canonical text always parses as its field's type.
    (void)SetCompressionMessageText(out, field, field.get(params));
  }
}

}  // namespace dropkv
