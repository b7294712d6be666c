// The server's one typed configuration: every setting with its default, and the loader that
// layers defaults <- YAML file (--config) <- command-line flags <- DROPKV_* environment variables.
// Environment wins over flags on purpose: a deployment (ConfigMap + env in a Pod spec)
// can pin a value whatever the container's command line says. docs/configuration.md lists all keys.
// No LibTorch, no gRPC: main() loads this once and hands each module the fields it needs.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/compression/params.h"  // the compression settings and their names

namespace dropkv {

enum class LogFormat { kText, kJson };

struct ServerConfig {
  // --- model ---
  // Hugging Face model folder; empty = the default model, SmolLM2-135M-Instruct as
  // scripts/setup.sh installs it (DefaultModelDir), filled in when the config is loaded.
  std::string model_dir;
  bool demo_model = false;  // the built-in random-weight demo model instead (tests, smoke checks)
  std::string device = "auto";  // auto | cpu | cuda | cuda:N (auto = cuda:0 when present, else cpu)
  std::string dtype =
      "auto";  // auto | float32 | bfloat16 | float16 (auto = bf16 on GPU, fp32 on CPU)
  std::string quantization = "none";    // none | fp8 (projection weights in FP8 e4m3, per channel)
  std::string kv_cache_dtype = "auto";  // auto | fp8 (the paged KV pool in FP8 e4m3, scale 1.0)
  // Ranks the model is split over (tensor parallelism), one process each: on GPUs device, device
  // + 1, ...; on the CPU over Gloo. 1 = the whole model in this process.
  int32_t tensor_parallel_size = 1;

  // --- network ---
  std::string host = "127.0.0.1";  // gRPC bind address (0.0.0.0 to serve other hosts)
  int32_t port = 50051;            // gRPC port; 0 = any free port (tests)
  int32_t metrics_port = 9400;     // Prometheus /metrics port; 0 = no endpoint
  bool metrics_auth = false;       // /metrics with the gRPC port's TLS files and bearer token
  int32_t http_port = 0;           // OpenAI-compatible HTTP API port (binds host); 0 = off
  int32_t http_threads = 2;        // HTTP I/O threads (asynchronous: each holds many connections)
  // The model's name in the HTTP API (`model`, /v1/models); empty = the model folder's base name
  // ("demo" for the demo model).
  std::string served_model_name;
  int64_t max_message_bytes = 16 * 1024 * 1024;  // gRPC max receive/send message size
  std::string tls_cert_file;                     // PEM certificate chain; set with tls_key_file
  std::string tls_key_file;                      // PEM private key; empty both = plaintext
  std::string tls_client_ca_file;        // PEM CA; set: clients need a certificate it signed (mTLS)
  std::string auth_token_file;           // file holding the bearer token; empty = no auth
  double shutdown_grace_seconds = 30.0;  // SIGTERM: drain this long, then cancel the rest
  // Connection bounds (docs/reliability.md): each open call or connection holds buffers.
  int32_t max_open_calls = 4096;          // gRPC generation calls; also HTTP connections
  int32_t max_concurrent_streams = 1024;  // per gRPC (HTTP/2) connection
  double write_stall_seconds = 30.0;      // an answer nobody reads this long is cancelled
  // An HTTP stream whose client leaves this many bytes unread is paused: its sequences give their
  // decode slots to waiting requests until it reads again. 0 = never.
  int64_t http_unread_stream_bytes = 64 * 1024;

  // --- scheduler and KV cache ---
  int32_t max_batch = 32;   // most sequences in one decode step
  int32_t block_size = 16;  // KV slots per paged block
  // KV pool size (YAML key kv_memory, "4GiB" works); 0 = auto: on a GPU the free memory after the
  // weights less a reserve for activations, on CPU 1 GiB.
  int64_t kv_memory_bytes = 0;
  int64_t kv_blocks = 0;                      // > 0: exact block count, wins over kv_memory
  int32_t max_queue_requests = 256;           // waiting requests beyond this get RESOURCE_EXHAUSTED
  int64_t max_queue_prompt_tokens = 1 << 20;  // prompt tokens waiting beyond this: same; 0 = no cap
  int32_t max_new_tokens_limit = 4096;        // largest max_new_tokens a request may ask for
  int32_t max_prompt_tokens = 0;              // longest prompt accepted; 0 = the model's context
  int32_t prefill_tokens_per_step = 2048;     // prefill token budget of one scheduler step
  // Keep uncompressed prompts' KV blocks for later prompts with the same prefix (off by itself
  // for models with sliding-window layers).
  bool prefix_cache = true;
  // Benchmarks at real geometry with nothing downloaded: weights drawn from normal(0, 0.02)
  // (seeded) instead of read; the model folder then needs config.json and a tokenizer only.
  bool random_weights = false;

  // --- logging ---
  LogFormat log_format = LogFormat::kText;  // text (human-readable) | json (one JSON object a line)
  std::string log_level = "info";           // trace | debug | info | warn | error | critical | off
  bool log_prompts = false;                 // true: request log lines include the prompt text

  // --- compression defaults (a request's own settings win) ---
  CompressionParams compression;

  // --- not settings: how this config came to be ---
  std::string config_file;            // the YAML file read, "" when none
  std::string demo_model_dir;         // where --demo-model's folder is written (DemoModelDir)
  bool exit_after_load = false;       // --help or --print-config was handled: the caller exits 0
  std::vector<std::string> warnings;  // e.g. an unknown DROPKV_* variable; the caller logs them
};

// Where scripts/setup.sh puts the default model (SmolLM2-135M-Instruct): $DROPKV_MODELS, else
// $DROPKV_CACHE/models, else $HOME/.cache/dropkv/models, + /smollm2-135m-instruct. `env` maps
// variable names to values; "" when none of them is set.
std::string DefaultModelDir(const std::map<std::string, std::string>& env);
// Where --demo-model writes the demo model: $DROPKV_CACHE/demo-model, else
// ~/.cache/dropkv/demo-model ("" without either variable: the engine's temp-folder default).
std::string DemoModelDir(const std::map<std::string, std::string>& env);

// Loads defaults <- file <- flags <- environment (the process's own environ), validates, and
// handles --help / --print-config by printing to stdout and setting exit_after_load.
// Errors are INVALID_ARGUMENT and name the key and where the value came from.
absl::StatusOr<ServerConfig> LoadServerConfig(int argc, char** argv);

// The same with explicit inputs (tests): args exclude the program name; env maps names to values.
absl::StatusOr<ServerConfig> LoadServerConfigFrom(const std::vector<std::string>& args,
                                                  const std::map<std::string, std::string>& env,
                                                  std::ostream& out);

// Parses YAML text as a config file over `base` (no flags, no env). source_name is used in errors.
absl::StatusOr<ServerConfig> ParseServerConfigYaml(std::string_view yaml_text,
                                                   std::string_view source_name,
                                                   const ServerConfig& base = ServerConfig{});

// Checks cross-field rules and ranges that the per-key parsers cannot (e.g. TLS cert without key).
absl::Status ValidateServerConfig(const ServerConfig& config);

// The effective config as YAML that ParseServerConfigYaml reads back unchanged.
std::string ServerConfigToYaml(const ServerConfig& config);

// Every setting's key ("port", "compression.keep_ratio"), in documentation order.
std::vector<std::string> ServerConfigKeys();
// "compression.keep_ratio" -> "DROPKV_COMPRESSION_KEEP_RATIO" / "--compression-keep-ratio".
std::string ServerConfigEnvName(std::string_view key);
std::string ServerConfigFlagName(std::string_view key);

// "4GiB" / "512 MiB" / "1.5GB" / "4096" -> bytes (binary suffixes are 1024-based, SI 1000-based).
absl::StatusOr<int64_t> ParseByteSize(std::string_view text);

}  // namespace dropkv
