// One table of settings drives every source: YAML keys, flags, environment variables, help text
// and --print-config all come from kSettings, so a setting is defined exactly once.
#include "config/server_config.h"

#include <yaml-cpp/yaml.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <limits>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "engine/common/text_value.h"
#include "engine/compression/compression.h"
#include "kernels/tuning.h"

extern char** environ;

namespace dropkv {
namespace {

absl::string_view A(std::string_view s) {
  return AbslView(s);
}

// ---- scalar parsers (engine/common/text_value.h) over abseil's string_view ------------------

std::string_view S(absl::string_view s) {
  return std::string_view(s.data(), s.size());
}
std::string Quote(absl::string_view s) {
  return QuoteText(S(s));
}
absl::StatusOr<int64_t> ParseInt(absl::string_view text) {
  return ParseIntText(S(text));
}
absl::StatusOr<double> ParseDouble(absl::string_view text) {
  return ParseDoubleText(S(text));
}
absl::StatusOr<bool> ParseBool(absl::string_view text) {
  return ParseBoolText(S(text));
}
std::string FormatDouble(double v) {
  return FormatDoubleText(v);
}

constexpr std::array<NamedValue<LogFormat>, 2> kLogFormats{{
    {LogFormat::kText, "text"},
    {LogFormat::kJson, "json"},
}};
// ---- the settings table --------------------------------------------------------------------

enum class Kind { kString, kInt, kDouble, kBool, kBytes, kEnum, kDoubleList };

absl::string_view KindName(Kind kind) {
  switch (kind) {
    case Kind::kString:
      return "string";
    case Kind::kInt:
      return "integer";
    case Kind::kDouble:
      return "number";
    case Kind::kBool:
      return "boolean";
    case Kind::kBytes:
      return "byte size";
    case Kind::kEnum:
      return "name";
    case Kind::kDoubleList:
      return "list of numbers";
  }
  return "value";
}

Kind ConfigKind(compression::FieldKind kind) {
  switch (kind) {
    case compression::FieldKind::kEnum:
      return Kind::kEnum;
    case compression::FieldKind::kBool:
      return Kind::kBool;
    case compression::FieldKind::kInt:
      return Kind::kInt;
    case compression::FieldKind::kDouble:
      return Kind::kDouble;
    case compression::FieldKind::kString:
      return Kind::kString;
    case compression::FieldKind::kDoubleList:
      return Kind::kDoubleList;
  }
  return Kind::kString;
}

struct Setting {
  std::string key;          // YAML path, "compression.keep_ratio"
  std::string alias_flags;  // extra CLI11 names, e.g. ",--model"
  Kind kind;
  std::string help;
  // Parses `text` into the config; the error says what is wrong with the value (no key prefix).
  std::function<absl::Status(ServerConfig&, absl::string_view)> set;
  // The canonical text of the current value (help defaults, --print-config).
  std::function<std::string(const ServerConfig&)> get;
};

template <typename T>
absl::Status CheckRange(T v, T min, T max) {
  if (v < min || v > max) {
    return absl::InvalidArgumentError(
        absl::StrCat("value ", v, " is out of range [", min, ", ", max, "]"));
  }
  return absl::OkStatus();
}

template <typename T, typename Ref>
Setting IntSetting(std::string key, std::string help, Ref ref, T min, T max,
                   Kind kind = Kind::kInt) {
  Setting s{std::move(key), "", kind, std::move(help), nullptr, nullptr};
  s.set = [ref, min, max, kind](ServerConfig& c, absl::string_view text) -> absl::Status {
    absl::StatusOr<int64_t> v = kind == Kind::kBytes
                                    ? ParseByteSize(std::string_view(text.data(), text.size()))
                                    : ParseInt(text);
    if (!v.ok()) return v.status();
    if (*v < static_cast<int64_t>(min) || *v > static_cast<int64_t>(max)) {
      return CheckRange<int64_t>(*v, min, max);
    }
    ref(c) = static_cast<T>(*v);
    return absl::OkStatus();
  };
  s.get = [ref](const ServerConfig& c) {
    return std::to_string(ref(const_cast<ServerConfig&>(c)));
  };
  return s;
}

template <typename Ref>
Setting DoubleSetting(std::string key, std::string help, Ref ref, double min, double max,
                      bool min_exclusive = false) {
  Setting s{std::move(key), "", Kind::kDouble, std::move(help), nullptr, nullptr};
  s.set = [ref, min, max, min_exclusive](ServerConfig& c, absl::string_view text) -> absl::Status {
    absl::StatusOr<double> v = ParseDouble(text);
    if (!v.ok()) return v.status();
    if ((min_exclusive ? *v <= min : *v < min) || *v > max) {
      return absl::InvalidArgumentError(absl::StrCat(
          "value ", *v, " is out of range ", min_exclusive ? "(" : "[", min, ", ", max, "]"));
    }
    ref(c) = *v;
    return absl::OkStatus();
  };
  s.get = [ref](const ServerConfig& c) { return FormatDouble(ref(const_cast<ServerConfig&>(c))); };
  return s;
}

template <typename Ref>
Setting StringSetting(std::string key, std::string help, Ref ref,
                      std::function<absl::Status(absl::string_view)> check = nullptr) {
  Setting s{std::move(key), "", Kind::kString, std::move(help), nullptr, nullptr};
  s.set = [ref, check](ServerConfig& c, absl::string_view text) -> absl::Status {
    if (check) {
      absl::Status st = check(text);
      if (!st.ok()) return st;
    }
    ref(c) = std::string(text);
    return absl::OkStatus();
  };
  s.get = [ref](const ServerConfig& c) { return ref(const_cast<ServerConfig&>(c)); };
  return s;
}

// The names come from a NamedValue table (engine/common/named_value.h); the help text lists them.
template <typename E, size_t N, typename Ref>
Setting EnumSetting(std::string key, std::string help, Ref ref,
                    const std::array<NamedValue<E>, N>& names) {
  Setting s{std::move(key), "",     Kind::kEnum, absl::StrCat(help, ": ", JoinNames(names)),
            nullptr,        nullptr};
  s.set = [ref, &names](ServerConfig& c, absl::string_view text) -> absl::Status {
    // No field prefix: the loader puts the key in front of every setting's error.
    absl::StatusOr<E> v = ParseName(names, std::string_view(text.data(), text.size()), "");
    if (!v.ok()) return v.status();
    ref(c) = *v;
    return absl::OkStatus();
  };
  s.get = [ref, &names](const ServerConfig& c) {
    return std::string(NameOf(names, ref(const_cast<ServerConfig&>(c))));
  };
  return s;
}

template <typename Ref>
Setting BoolSetting(std::string key, std::string help, Ref ref) {
  Setting s{std::move(key), "", Kind::kBool, std::move(help), nullptr, nullptr};
  s.set = [ref](ServerConfig& c, absl::string_view text) -> absl::Status {
    absl::StatusOr<bool> v = ParseBool(text);
    if (!v.ok()) return v.status();
    ref(c) = *v;
    return absl::OkStatus();
  };
  s.get = [ref](const ServerConfig& c) {
    return std::string(ref(const_cast<ServerConfig&>(c)) ? "true" : "false");
  };
  return s;
}

absl::Status CheckDevice(absl::string_view text) {
  if (text == "auto" || text == "cpu" || text == "cuda") return absl::OkStatus();
  if (absl::ConsumePrefix(&text, "cuda:")) {
    absl::StatusOr<int64_t> idx = ParseInt(text);
    if (idx.ok() && *idx >= 0 && *idx < 64) return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("expected auto|cpu|cuda|cuda:N, got ", Quote(text)));
}

absl::Status CheckNamed(absl::string_view text, std::initializer_list<const char*> names) {
  for (const char* n : names) {
    if (text == n) return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("expected one of ", absl::StrJoin(names, "|"), ", got ", Quote(text)));
}

absl::Status CheckNonEmpty(absl::string_view text) {
  if (text.empty()) return absl::InvalidArgumentError("must not be empty");
  return absl::OkStatus();
}

constexpr int32_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

std::vector<Setting> MakeSettings() {
  using C = ServerConfig;
  std::vector<Setting> v;
  // model
  v.push_back(StringSetting(
      "model_dir",
      "Hugging Face model folder; empty = the default model (SmolLM2-135M-Instruct from "
      "scripts/setup.sh)",
      [](C& c) -> std::string& { return c.model_dir; }));
  v.back().alias_flags = ",--model";
  v.push_back(BoolSetting(
      "demo_model",
      "serve the built-in demo model (random weights: gibberish by design) instead; for tests",
      [](C& c) -> bool& { return c.demo_model; }));
  v.push_back(StringSetting(
      "device", "auto|cpu|cuda|cuda:N", [](C& c) -> std::string& { return c.device; },
      CheckDevice));
  v.push_back(StringSetting(
      "dtype", "auto|float32|bfloat16|float16 (auto: bf16 on GPU, fp32 on CPU)",
      [](C& c) -> std::string& { return c.dtype; },
      [](absl::string_view t) {
        return CheckNamed(t, {"auto", "float32", "bfloat16", "float16"});
      }));
  v.push_back(StringSetting(
      "quantization",
      "none|fp8 (fp8: the projection weights quantized at load to float8 e4m3 with one scale per "
      "output channel; an FP8 checkpoint stays FP8 either way)",
      [](C& c) -> std::string& { return c.quantization; },
      [](absl::string_view t) {
        return CheckNamed(t, {"none", "fp8"});
      }));
  v.push_back(StringSetting(
      "kv_cache_dtype",
      "auto|fp8 (auto: the model dtype; fp8: the paged KV pool in float8 e4m3 with scale 1.0, "
      "half the bytes of bf16 per token; CUDA needs compute capability 8.9+)",
      [](C& c) -> std::string& { return c.kv_cache_dtype; },
      [](absl::string_view t) {
        return CheckNamed(t, {"auto", "fp8"});
      }));
  v.push_back(IntSetting<int32_t>(
      "tensor_parallel_size",
      "ranks the model is split over, one process each (Megatron-style shards; GPUs: device and "
      "the next ones, over NCCL; CPU: Gloo); the prefix cache is off above 1",
      [](C& c) -> int32_t& { return c.tensor_parallel_size; }, 1, 64));
  // network
  v.push_back(StringSetting(
      "host", "gRPC bind address (0.0.0.0 = all interfaces)",
      [](C& c) -> std::string& { return c.host; }, CheckNonEmpty));
  v.push_back(IntSetting<int32_t>(
      "port", "gRPC port; 0 = any free port (tests)", [](C& c) -> int32_t& { return c.port; }, 0,
      65535));
  v.push_back(IntSetting<int32_t>(
      "metrics_port", "Prometheus /metrics HTTP port; 0 = off",
      [](C& c) -> int32_t& { return c.metrics_port; }, 0, 65535));
  v.push_back(BoolSetting(
      "metrics_auth",
      "the /metrics port uses the TLS files and bearer token of the gRPC port (when set)",
      [](C& c) -> bool& { return c.metrics_auth; }));
  v.push_back(IntSetting<int32_t>(
      "http_port",
      "OpenAI-compatible HTTP API port (/v1/completions, /v1/chat/completions, /v1/models, "
      "/health, /metrics; same host, TLS and token as gRPC); 0 = off",
      [](C& c) -> int32_t& { return c.http_port; }, 0, 65535));
  v.push_back(IntSetting<int32_t>(
      "http_threads", "HTTP I/O threads (each holds any number of connections)",
      [](C& c) -> int32_t& { return c.http_threads; }, 1, 64));
  v.push_back(StringSetting(
      "served_model_name",
      "the model's name in the HTTP API (`model`, /v1/models); empty = the model folder's name",
      [](C& c) -> std::string& { return c.served_model_name; }));
  v.push_back(IntSetting<int64_t>(
      "max_message_bytes", "gRPC max message size (bytes, e.g. 16MiB)",
      [](C& c) -> int64_t& { return c.max_message_bytes; }, 1024, kInt32Max, Kind::kBytes));
  v.push_back(StringSetting("tls_cert_file", "PEM certificate chain (TLS on when set)",
                            [](C& c) -> std::string& { return c.tls_cert_file; }));
  v.push_back(StringSetting("tls_key_file", "PEM private key (with tls_cert_file)",
                            [](C& c) -> std::string& { return c.tls_key_file; }));
  v.push_back(StringSetting(
      "tls_client_ca_file",
      "PEM CA certificate: clients must present a certificate it signed (mutual TLS, on every "
      "TLS port); needs tls_cert_file",
      [](C& c) -> std::string& { return c.tls_client_ca_file; }));
  v.push_back(StringSetting("auth_token_file", "file with the bearer token; empty = no auth",
                            [](C& c) -> std::string& { return c.auth_token_file; }));
  v.push_back(DoubleSetting(
      "shutdown_grace_seconds", "on SIGTERM, drain running requests this long before cancelling",
      [](C& c) -> double& { return c.shutdown_grace_seconds; }, 0.0, 3600.0));
  v.push_back(IntSetting<int32_t>(
      "max_open_calls",
      "generation calls open at once (gRPC calls + HTTP connections each); beyond: "
      "RESOURCE_EXHAUSTED / a new HTTP connection replaces the one idle longest, 503 when all "
      "are answering",
      [](C& c) -> int32_t& { return c.max_open_calls; }, 1, 1 << 20));
  v.push_back(IntSetting<int32_t>(
      "max_concurrent_streams", "gRPC streams one HTTP/2 connection may open at once",
      [](C& c) -> int32_t& { return c.max_concurrent_streams; }, 1, 1 << 20));
  v.push_back(DoubleSetting(
      "write_stall_seconds",
      "a client that reads nothing of an answer for this long is cut off and its request "
      "cancelled (both APIs)",
      [](C& c) -> double& { return c.write_stall_seconds; }, 0.1, 3600.0));
  v.push_back(IntSetting<int64_t>(
      "http_unread_stream_bytes",
      "an HTTP stream whose client leaves this much unread (bytes, e.g. 64KiB; queued in the "
      "server "
      "and the socket) is paused: its sequences give their decode slots to waiting requests and "
      "are recomputed once it reads again; 0 = never",
      [](C& c) -> int64_t& { return c.http_unread_stream_bytes; }, 0, 1LL << 30, Kind::kBytes));
  // scheduler and KV cache
  v.push_back(IntSetting<int32_t>(
      "max_batch", "most sequences in one decode step",
      [](C& c) -> int32_t& { return c.max_batch; }, 1, 4096));
  v.push_back(IntSetting<int32_t>(
      "block_size", "KV slots per paged block", [](C& c) -> int32_t& { return c.block_size; }, 1,
      1024));
  v.push_back(IntSetting<int64_t>(
      "kv_memory",
      "KV pool size (bytes, e.g. 4GiB); 0 = auto (GPU: free memory after the weights less a "
      "reserve for activations; CPU: 1GiB)",
      [](C& c) -> int64_t& { return c.kv_memory_bytes; }, 0, kInt64Max, Kind::kBytes));
  v.push_back(IntSetting<int64_t>(
      "kv_blocks", "exact KV block count; 0 = from kv_memory",
      [](C& c) -> int64_t& { return c.kv_blocks; }, 0, 1LL << 32));
  v.push_back(IntSetting<int32_t>(
      "max_queue_requests", "waiting requests before RESOURCE_EXHAUSTED",
      [](C& c) -> int32_t& { return c.max_queue_requests; }, 1, 1 << 20));
  v.push_back(IntSetting<int64_t>(
      "max_queue_prompt_tokens", "waiting prompt tokens before RESOURCE_EXHAUSTED; 0 = no cap",
      [](C& c) -> int64_t& { return c.max_queue_prompt_tokens; }, 0, 1LL << 40));
  v.push_back(IntSetting<int32_t>(
      "max_new_tokens_limit", "largest max_new_tokens accepted",
      [](C& c) -> int32_t& { return c.max_new_tokens_limit; }, 1, 1 << 24));
  v.push_back(IntSetting<int32_t>(
      "max_prompt_tokens", "longest prompt; 0 = model context",
      [](C& c) -> int32_t& { return c.max_prompt_tokens; }, 0, 1 << 24));
  v.push_back(IntSetting<int32_t>(
      "prefill_tokens_per_step", "prefill tokens per scheduler step",
      [](C& c) -> int32_t& { return c.prefill_tokens_per_step; }, 1, 1 << 24));
  v.push_back(BoolSetting(
      "prefix_cache",
      "reuse the KV blocks of uncompressed prompts' cached prefixes (off for models with "
      "sliding-window layers)",
      [](C& c) -> bool& { return c.prefix_cache; }));
  v.push_back(
      BoolSetting("random_weights",
                  "benchmark only: draw the weights (normal, std 0.02) instead of reading them",
                  [](C& c) -> bool& { return c.random_weights; }));
  // logging
  v.push_back(EnumSetting(
      "log_format", "log line format", [](C& c) -> LogFormat& { return c.log_format; },
      kLogFormats));
  v.push_back(StringSetting(
      "log_level", "trace|debug|info|warn|error|critical|off",
      [](C& c) -> std::string& { return c.log_level; },
      [](absl::string_view t) {
        return CheckNamed(t, {"trace", "debug", "info", "warn", "error", "critical", "off"});
      }));
  v.push_back(BoolSetting("log_prompts", "include prompt text in request log lines",
                          [](C& c) -> bool& { return c.log_prompts; }));
  // compression defaults: one setting per stored row of the compression schema
  for (const compression::CompressionField& field : compression::CompressionFields()) {
    if (!field.stored()) continue;  // compression_ratio: requests and tools only
    Setting s{absl::StrCat("compression.", A(field.name)),
              "",
              ConfigKind(field.kind),
              field.help,
              nullptr,
              nullptr};
    s.set = [&field](C& c, absl::string_view text) { return field.set(c.compression, S(text)); };
    s.get = [&field](const C& c) { return field.get(c.compression); };
    v.push_back(std::move(s));
  }
  return v;
}

const std::vector<Setting>& Settings() {
  static const std::vector<Setting> settings = MakeSettings();
  return settings;
}

const Setting* FindSetting(absl::string_view key) {
  for (const Setting& s : Settings()) {
    if (s.key == key) return &s;
  }
  return nullptr;
}

absl::Status ApplyValue(ServerConfig& config, const Setting& setting, absl::string_view text,
                        absl::string_view source) {
  absl::Status st = setting.set(config, text);
  if (!st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", setting.key, ": ", st.message()));
  }
  return absl::OkStatus();
}

std::string NodeLocation(const YAML::Node& node) {
  YAML::Mark mark = node.Mark();
  if (mark.line < 0) return "";
  return absl::StrCat(" (line ", mark.line + 1, ")");
}

absl::string_view NodeTypeName(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map:
      return "a map";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Null:
      return "nothing (null)";
    default:
      return "a scalar";
  }
}

absl::Status ApplyYamlMap(ServerConfig& config, const YAML::Node& map, const std::string& prefix,
                          absl::string_view source) {
  std::vector<std::string> seen;
  for (const auto& item : map) {
    std::string name = item.first.as<std::string>();
    if (std::find(seen.begin(), seen.end(), name) != seen.end()) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": duplicate key '",
                                                     prefix.empty() ? "" : prefix + ".", name, "'",
                                                     NodeLocation(item.first)));
    }
    seen.push_back(name);
    std::string key = prefix.empty() ? name : absl::StrCat(prefix, ".", name);
    const YAML::Node& value = item.second;
    if (prefix.empty() && name == "compression") {
      if (!value.IsMap()) {
        return absl::InvalidArgumentError(absl::StrCat(source,
                                                       ": compression: expected a map, got ",
                                                       NodeTypeName(value), NodeLocation(value)));
      }
      absl::Status st = ApplyYamlMap(config, value, "compression", source);
      if (!st.ok()) return st;
      continue;
    }
    const Setting* setting = FindSetting(key);
    if (setting == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": unknown key '", key, "'",
                                                     NodeLocation(item.first),
                                                     " (docs/configuration.md lists the keys)"));
    }
    std::string text;
    if (setting->kind == Kind::kDoubleList) {
      if (!value.IsSequence() && !value.IsNull()) {
        return absl::InvalidArgumentError(absl::StrCat(source, ": ", key,
                                                       ": expected a list of numbers, got ",
                                                       NodeTypeName(value), NodeLocation(value)));
      }
      std::vector<std::string> parts;
      for (const auto& element : value) {
        if (!element.IsScalar()) {
          return absl::InvalidArgumentError(absl::StrCat(
              source, ": ", key, ": element ", parts.size(), ": expected a number, got ",
              NodeTypeName(element), NodeLocation(element)));
        }
        parts.push_back(element.Scalar());
      }
      text = absl::StrJoin(parts, ",");
    } else if (value.IsScalar()) {
      text = value.Scalar();
    } else if (value.IsNull() && setting->kind == Kind::kString) {
      text = "";
    } else {
      return absl::InvalidArgumentError(absl::StrCat(source, ": ", key, ": expected a ",
                                                     KindName(setting->kind), ", got ",
                                                     NodeTypeName(value), NodeLocation(value)));
    }
    absl::Status st = setting->set(config, text);
    if (!st.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": ", key, ": ", st.message(), NodeLocation(value)));
    }
  }
  return absl::OkStatus();
}

std::string HelpText(const Setting& s, const ServerConfig& defaults) {
  std::string def = s.get(defaults);
  return absl::StrCat(s.help, " [default: ", def.empty() ? "\"\"" : def,
                      "; env: ", ServerConfigEnvName(s.key), "; yaml: ", s.key, "]");
}

}  // namespace

// ---- public helpers -------------------------------------------------------------------------

absl::StatusOr<int64_t> ParseByteSize(std::string_view text_std) {
  absl::string_view text = A(text_std);
  std::string t = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  struct Suffix {
    const char* name;
    double factor;
  };
  // Longest suffixes first so "kib" is not read as "b".
  static constexpr Suffix kSuffixes[] = {
      {"kib", 1024.0}, {"mib", 1048576.0}, {"gib", 1073741824.0}, {"tib", 1099511627776.0},
      {"kb", 1e3},     {"mb", 1e6},        {"gb", 1e9},           {"tb", 1e12},
      {"k", 1024.0},   {"m", 1048576.0},   {"g", 1073741824.0},   {"t", 1099511627776.0},
      {"b", 1.0}};
  double factor = 1.0;
  absl::string_view number = t;
  for (const Suffix& s : kSuffixes) {
    if (absl::EndsWith(t, s.name)) {
      factor = s.factor;
      number = absl::string_view(t).substr(0, t.size() - absl::string_view(s.name).size());
      break;
    }
  }
  number = absl::StripAsciiWhitespace(number);
  absl::StatusOr<double> value = ParseDouble(number);
  if (number.empty() || !value.ok() || *value < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected a byte size such as 4GiB, 512MiB or 1048576, got ", Quote(text)));
  }
  double bytes = std::round(*value * factor);
  if (bytes > 9.0e18) {
    return absl::InvalidArgumentError(absl::StrCat("byte size ", Quote(text), " is too large"));
  }
  return static_cast<int64_t>(bytes);
}

std::vector<std::string> ServerConfigKeys() {
  std::vector<std::string> keys;
  for (const Setting& s : Settings()) keys.push_back(s.key);
  return keys;
}

std::string ServerConfigEnvName(std::string_view key) {
  std::string name = absl::StrCat("DROPKV_", A(key));
  for (char& ch : name) ch = ch == '.' ? '_' : absl::ascii_toupper(ch);
  return name;
}

std::string ServerConfigFlagName(std::string_view key) {
  std::string name = absl::StrCat("--", A(key));
  for (char& ch : name) {
    if (ch == '.' || ch == '_') ch = '-';
  }
  return name;
}

absl::Status ValidateServerConfig(const ServerConfig& c) {
  auto err = [](absl::string_view key, absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(key, ": ", what));
  };
  if (c.demo_model && !c.model_dir.empty()) {
    return err("demo_model", "serves the built-in demo model: do not set model_dir with it");
  }
  if (c.tls_cert_file.empty() != c.tls_key_file.empty()) {
    return err(c.tls_cert_file.empty() ? "tls_cert_file" : "tls_key_file",
               "tls_cert_file and tls_key_file must be set together");
  }
  if (!c.tls_client_ca_file.empty() && c.tls_cert_file.empty()) {
    return err("tls_client_ca_file",
               "client certificates need TLS: set tls_cert_file and tls_key_file");
  }
  if (c.metrics_port != 0 && c.metrics_port == c.port) {
    return err("metrics_port", absl::StrCat("must differ from port (", c.port, ")"));
  }
  if (c.http_port != 0 && (c.http_port == c.port || c.http_port == c.metrics_port)) {
    return err("http_port", absl::StrCat("must differ from port (", c.port, ") and metrics_port (",
                                         c.metrics_port, ")"));
  }
  if (c.max_prompt_tokens != 0 && c.prefill_tokens_per_step < 1) {
    return err("prefill_tokens_per_step", "must be >= 1");
  }
  // Compression's one validator; the model's depth is not known here (the server checks the
  // depth-dependent rules when it loads the model).
  if (absl::Status s = compression::ValidateCompression(c.compression, 0); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("compression.", s.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<ServerConfig> ParseServerConfigYaml(std::string_view yaml_text,
                                                   std::string_view source_name_std,
                                                   const ServerConfig& base) {
  absl::string_view source_name = A(source_name_std);
  ServerConfig config = base;
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml_text));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source_name, ": not valid YAML: ", e.what()));
  }
  if (root.IsNull()) return config;  // an empty file changes nothing
  if (!root.IsMap()) {
    return absl::InvalidArgumentError(absl::StrCat(
        source_name, ": expected a map of settings at the top, got ", NodeTypeName(root)));
  }
  try {
    absl::Status st = ApplyYamlMap(config, root, "", source_name);
    if (!st.ok()) return st;
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source_name, ": ", e.what()));
  }
  return config;
}

std::string ServerConfigToYaml(const ServerConfig& config) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  bool in_compression = false;
  for (const Setting& s : Settings()) {
    absl::string_view key = s.key;
    bool is_compression = absl::ConsumePrefix(&key, "compression.");
    if (is_compression && !in_compression) {
      out << YAML::Key << "compression" << YAML::Value << YAML::BeginMap;
      in_compression = true;
    }
    out << YAML::Key << std::string(key) << YAML::Value;
    std::string value = s.get(config);
    if (s.kind == Kind::kDoubleList) {
      out << YAML::Flow << YAML::BeginSeq;
      if (!value.empty()) {
        for (absl::string_view part : absl::StrSplit(value, ',')) out << std::string(part);
      }
      out << YAML::EndSeq;
    } else if (s.kind == Kind::kString) {
      out << YAML::DoubleQuoted << value;
    } else {
      out << value;
    }
  }
  if (in_compression) out << YAML::EndMap;
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

absl::StatusOr<ServerConfig> LoadServerConfigFrom(const std::vector<std::string>& args,
                                                  const std::map<std::string, std::string>& env,
                                                  std::ostream& out) {
  const ServerConfig defaults;
  CLI::App app{
      "dropkv-server: LLM inference over gRPC with DropKV KV-cache compression.\n"
      "Settings: defaults <- YAML file (--config) <- flags <- DROPKV_* environment variables.",
      "dropkv-server"};
  app.get_formatter()->column_width(40);
  std::string config_file;
  bool print_config = false;
  app.add_option("--config", config_file,
                 "YAML config file (env: DROPKV_CONFIG, used when --config is absent)");
  app.add_flag("--print-config", print_config, "print the effective config as YAML and exit");

  const std::vector<Setting>& settings = Settings();
  std::vector<std::string> flag_values(settings.size());
  std::vector<CLI::Option*> options(settings.size());
  for (size_t i = 0; i < settings.size(); ++i) {
    const Setting& s = settings[i];
    std::string names = ServerConfigFlagName(s.key) + s.alias_flags;
    if (s.kind == Kind::kBool) {
      // "--log-prompts" alone means true; "--log-prompts=false" works too.
      std::string flag = ServerConfigFlagName(s.key) + "{true}" + s.alias_flags;
      options[i] = app.add_flag(flag, flag_values[i], HelpText(s, defaults));
    } else {
      options[i] = app.add_option(names, flag_values[i], HelpText(s, defaults));
    }
  }

  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 wants them reversed
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    out << app.help();
    ServerConfig config;
    config.exit_after_load = true;
    return config;
  } catch (const CLI::ParseError& e) {
    return absl::InvalidArgumentError(absl::StrCat("command line: ", e.what()));
  }

  auto env_value = [&env](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
  // Which file is read is not a setting: --config wins, DROPKV_CONFIG names the file otherwise
  // (so an image can point at its own file and `docker run IMAGE --config other.yaml` still works).
  if (auto v = env_value("DROPKV_CONFIG"); v.has_value() && config_file.empty()) {
    config_file = *v;
  }

  ServerConfig config;
  if (!config_file.empty()) {
    std::string text;
    {
      std::error_code ec;
      if (std::filesystem::exists(config_file, ec) &&
          !std::filesystem::is_regular_file(config_file, ec)) {
        return absl::InvalidArgumentError(
            absl::StrCat("config: '", config_file, "' is not a file (give the YAML file itself)"));
      }
      FILE* f = std::fopen(config_file.c_str(), "rb");
      if (f == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("config: cannot open '", config_file, "': ", std::strerror(errno)));
      }
      char buf[65536];
      size_t n = 0;
      while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
      std::fclose(f);
    }
    absl::StatusOr<ServerConfig> parsed =
        ParseServerConfigYaml(text, absl::StrCat("config file ", config_file), config);
    if (!parsed.ok()) return parsed.status();
    config = *std::move(parsed);
    config.config_file = config_file;
  }
  for (size_t i = 0; i < settings.size(); ++i) {
    if (options[i]->count() == 0) continue;
    absl::Status st = ApplyValue(config, settings[i], flag_values[i],
                                 absl::StrCat("flag ", ServerConfigFlagName(settings[i].key)));
    if (!st.ok()) return st;
  }
  for (const Setting& s : settings) {
    std::string name = ServerConfigEnvName(s.key);
    if (auto v = env_value(name); v.has_value()) {
      absl::Status st = ApplyValue(config, s, *v, absl::StrCat("environment ", name));
      if (!st.ok()) return st;
    }
  }
  // A misspelt DROPKV_* variable would otherwise be ignored without a word. The kernel tuning's
  // variables are read by kernels/tuning.h, not here; a bad value of one is warned about.
  const kernels::KernelTuning tuning = kernels::KernelTuning::FromVariables(env, &config.warnings);
  static const char* kNotSettings[] = {
      "DROPKV_CONFIG",     "DROPKV_SHARED",    "DROPKV_PYTHON", "DROPKV_KVPRESS_PYTHON",
      "DROPKV_SOURCE_DIR", "DROPKV_BUILD_DIR", "DROPKV_VENV",   "DROPKV_CACHE",
      "DROPKV_TEST_JOBS",  "DROPKV_MODELS"};
  for (const auto& entry : env) {
    const std::string& name = entry.first;  // not a structured binding: clang 14 cannot capture one
    if (!absl::StartsWith(name, "DROPKV_")) continue;
    bool known =
        std::any_of(std::begin(kNotSettings), std::end(kNotSettings),
                    [&](const char* n) { return name == n; }) ||
        std::any_of(std::begin(kernels::kTuningVariables), std::end(kernels::kTuningVariables),
                    [&](std::string_view n) { return name == n; });
    for (const Setting& s : settings) known = known || name == ServerConfigEnvName(s.key);
    if (!known) {
      config.warnings.push_back(
          absl::StrCat("environment ", name, " is not a setting and was ignored"));
    }
  }
  absl::Status valid = ValidateServerConfig(config);
  if (!valid.ok()) return absl::InvalidArgumentError(absl::StrCat("config: ", valid.message()));
  if (config.model_dir.empty() && !config.demo_model) config.model_dir = DefaultModelDir(env);
  config.demo_model_dir = DemoModelDir(env);
  if (print_config) {
    out << ServerConfigToYaml(config) << kernels::TuningToYaml(tuning);
    config.exit_after_load = true;
  }
  return config;
}

namespace {

std::string EnvOrEmpty(const std::map<std::string, std::string>& env, const char* name) {
  auto it = env.find(name);
  return it == env.end() ? "" : it->second;
}

// scripts/setup.sh's cache: $DROPKV_CACHE, else ~/.cache/dropkv ("" without either variable).
std::string CacheDir(const std::map<std::string, std::string>& env) {
  if (std::string cache = EnvOrEmpty(env, "DROPKV_CACHE"); !cache.empty()) return cache;
  const std::string home = EnvOrEmpty(env, "HOME");
  return home.empty() ? "" : home + "/.cache/dropkv";
}

}  // namespace

std::string DemoModelDir(const std::map<std::string, std::string>& env) {
  const std::string cache = CacheDir(env);
  return cache.empty() ? "" : cache + "/demo-model";
}

std::string DefaultModelDir(const std::map<std::string, std::string>& env) {
  std::string models = EnvOrEmpty(env, "DROPKV_MODELS");
  if (models.empty() && !CacheDir(env).empty()) models = CacheDir(env) + "/models";
  return models.empty() ? "" : models + "/smollm2-135m-instruct";
}

absl::StatusOr<ServerConfig> LoadServerConfig(int argc, char** argv) {
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    absl::string_view entry(*e);
    if (!absl::StartsWith(entry, "DROPKV_")) continue;
    size_t eq = entry.find('=');
    if (eq == absl::string_view::npos) continue;
    env.emplace(std::string(entry.substr(0, eq)), std::string(entry.substr(eq + 1)));
  }
  for (const char* name : {"HOME", "OMP_NUM_THREADS"}) {
    if (const char* v = std::getenv(name); v != nullptr) env.emplace(name, v);
  }
  return LoadServerConfigFrom(args, env, std::cout);
}

}  // namespace dropkv
