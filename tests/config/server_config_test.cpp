// ServerConfig loader: every key of config/server.example.yaml parses, each kind of bad input
// gives an error naming the key, and the documented precedence (file < flags < env) holds.
#include "config/server_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_join.h"
#include "kernels/tuning.h"
#include "tests/common/test_env.h"

namespace dropkv {
namespace {

using ::testing::HasSubstr;

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::filesystem::path WriteScratch(const std::string& name, const std::string& text) {
  auto path = testing::ScratchDir("config") / name;
  std::ofstream(path) << text;
  return path;
}

absl::StatusOr<ServerConfig> Load(const std::vector<std::string>& args,
                                  const std::map<std::string, std::string>& env = {}) {
  std::ostringstream out;
  return LoadServerConfigFrom(args, env, out);
}

std::filesystem::path ExampleYaml() {
  return testing::SourceDir() / "config" / "server.example.yaml";
}

// Every key the loader knows appears in the example file, and the file loads cleanly.
TEST(ServerConfigTest, ExampleFileHasEveryKeyAndParses) {
  std::string text = ReadFile(ExampleYaml());
  ASSERT_FALSE(text.empty()) << ExampleYaml();
  absl::StatusOr<ServerConfig> config = ParseServerConfigYaml(text, "server.example.yaml");
  ASSERT_TRUE(config.ok()) << config.status();
  for (const std::string& key : ServerConfigKeys()) {
    std::string leaf = key.substr(key.rfind('.') + 1);
    EXPECT_THAT(text, HasSubstr(leaf + ":")) << "example lacks key " << key;
  }
}

// docs/configuration.md documents every key with its flag and environment variable.
TEST(ServerConfigTest, DocsListEveryKey) {
  std::string doc = ReadFile(testing::SourceDir() / "docs" / "configuration.md");
  ASSERT_FALSE(doc.empty());
  for (const std::string& key : ServerConfigKeys()) {
    EXPECT_THAT(doc, HasSubstr("`" + key + "`")) << key;
    EXPECT_THAT(doc, HasSubstr("`" + ServerConfigFlagName(key) + "`")) << key;
    EXPECT_THAT(doc, HasSubstr("`" + ServerConfigEnvName(key) + "`")) << key;
  }
}

// Each key of the example, set on its own to a non-default value, is read into the struct
// (this catches a key that parses but lands in the wrong field).
TEST(ServerConfigTest, EachKeyReachesItsField) {
  const ServerConfig d;
  struct Case {
    std::string yaml;
    std::function<bool(const ServerConfig&)> check;
  };
  std::vector<Case> cases = {
      {"model_dir: /models/llama",
       [](const ServerConfig& c) { return c.model_dir == "/models/llama"; }},
      {"demo_model: true", [](const ServerConfig& c) { return c.demo_model; }},
      {"device: cuda:1", [](const ServerConfig& c) { return c.device == "cuda:1"; }},
      {"dtype: bfloat16", [](const ServerConfig& c) { return c.dtype == "bfloat16"; }},
      {"quantization: fp8", [](const ServerConfig& c) { return c.quantization == "fp8"; }},
      {"kv_cache_dtype: fp8", [](const ServerConfig& c) { return c.kv_cache_dtype == "fp8"; }},
      {"tensor_parallel_size: 2",
       [](const ServerConfig& c) { return c.tensor_parallel_size == 2; }},
      {"host: 0.0.0.0", [](const ServerConfig& c) { return c.host == "0.0.0.0"; }},
      {"port: 6000", [](const ServerConfig& c) { return c.port == 6000; }},
      {"metrics_port: 0", [](const ServerConfig& c) { return c.metrics_port == 0; }},
      {"http_port: 8000", [](const ServerConfig& c) { return c.http_port == 8000; }},
      {"http_threads: 5", [](const ServerConfig& c) { return c.http_threads == 5; }},
      {"served_model_name: m", [](const ServerConfig& c) { return c.served_model_name == "m"; }},
      {"max_message_bytes: 32MiB",
       [](const ServerConfig& c) { return c.max_message_bytes == 32 << 20; }},
      {"tls_cert_file: a.pem\ntls_key_file: b.pem",
       [](const ServerConfig& c) {
         return c.tls_cert_file == "a.pem" && c.tls_key_file == "b.pem";
       }},
      {"auth_token_file: /t", [](const ServerConfig& c) { return c.auth_token_file == "/t"; }},
      {"shutdown_grace_seconds: 2.5",
       [](const ServerConfig& c) { return c.shutdown_grace_seconds == 2.5; }},
      {"metrics_auth: true", [](const ServerConfig& c) { return c.metrics_auth; }},
      {"tls_client_ca_file: ca.pem",
       [](const ServerConfig& c) { return c.tls_client_ca_file == "ca.pem"; }},
      {"max_open_calls: 12", [](const ServerConfig& c) { return c.max_open_calls == 12; }},
      {"max_concurrent_streams: 13",
       [](const ServerConfig& c) { return c.max_concurrent_streams == 13; }},
      {"write_stall_seconds: 1.5",
       [](const ServerConfig& c) { return c.write_stall_seconds == 1.5; }},
      {"http_unread_stream_bytes: 16KiB",
       [](const ServerConfig& c) { return c.http_unread_stream_bytes == 16 * 1024; }},
      {"max_batch: 7", [](const ServerConfig& c) { return c.max_batch == 7; }},
      {"block_size: 32", [](const ServerConfig& c) { return c.block_size == 32; }},
      {"kv_memory: 1.5GiB", [](const ServerConfig& c) { return c.kv_memory_bytes == 1610612736; }},
      {"kv_blocks: 99", [](const ServerConfig& c) { return c.kv_blocks == 99; }},
      {"max_queue_requests: 3", [](const ServerConfig& c) { return c.max_queue_requests == 3; }},
      {"max_queue_prompt_tokens: 0",
       [](const ServerConfig& c) { return c.max_queue_prompt_tokens == 0; }},
      {"max_new_tokens_limit: 10",
       [](const ServerConfig& c) { return c.max_new_tokens_limit == 10; }},
      {"max_prompt_tokens: 100", [](const ServerConfig& c) { return c.max_prompt_tokens == 100; }},
      {"prefill_tokens_per_step: 64",
       [](const ServerConfig& c) { return c.prefill_tokens_per_step == 64; }},
      {"prefix_cache: false", [](const ServerConfig& c) { return !c.prefix_cache; }},
      {"random_weights: true", [](const ServerConfig& c) { return c.random_weights; }},
      {"log_format: json", [](const ServerConfig& c) { return c.log_format == LogFormat::kJson; }},
      {"log_level: debug", [](const ServerConfig& c) { return c.log_level == "debug"; }},
      {"log_prompts: true", [](const ServerConfig& c) { return c.log_prompts; }},
      {"compression: {method: snapkv}",
       [](const ServerConfig& c) { return c.compression.method == ScoreMethod::kSnapKV; }},
      {"compression: {keep_ratio: 0.1}",
       [](const ServerConfig& c) { return c.compression.keep_ratio == 0.1; }},
      {"compression: {budget_tokens: 512}",
       [](const ServerConfig& c) { return c.compression.budget_tokens == 512; }},
      {"compression: {allocator: explicit, explicit_layer_prune: [0.5, 0.25]}",
       [](const ServerConfig& c) {
         return c.compression.allocator == BudgetAllocator::kExplicit &&
                c.compression.explicit_layer_prune == std::vector<double>{0.5, 0.25};
       }},
      {"compression: {profile_path: p.json}",
       [](const ServerConfig& c) { return c.compression.profile_path == "p.json"; }},
      {"compression: {window: 32}",
       [](const ServerConfig& c) { return c.compression.window == 32; }},
      {"compression: {pooling: avg}",
       [](const ServerConfig& c) { return c.compression.pooling == PoolingType::kAvg; }},
      {"compression: {pooling_kernel: 7}",
       [](const ServerConfig& c) { return c.compression.pooling_kernel == 7; }},
      {"compression: {pooling_lookback: 24}",
       [](const ServerConfig& c) { return c.compression.pooling_lookback == 24; }},
      {"compression: {scoring_queries: replay}",
       [](const ServerConfig& c) {
         return c.compression.scoring_queries == ScoringQueries::kReplay;
       }},
      {"compression: {protect_sinks: yes}",
       [](const ServerConfig& c) { return c.compression.protect_sinks; }},
      {"compression: {num_sinks: 2}",
       [](const ServerConfig& c) { return c.compression.num_sinks == 2; }},
      {"compression: {chunk_policy: every_chunk}",
       [](const ServerConfig& c) {
         return c.compression.chunk_policy == ChunkPolicy::kEveryChunk;
       }},
      {"compression: {chunk_size: 256}",
       [](const ServerConfig& c) { return c.compression.chunk_size == 256; }},
      {"compression: {budget_cap_tokens: 4096}",
       [](const ServerConfig& c) { return c.compression.budget_cap_tokens == 4096; }},
      {"compression: {decode_margin: 64}",
       [](const ServerConfig& c) { return c.compression.decode_margin == 64; }},
      {"compression: {tolerance: 0.05}",
       [](const ServerConfig& c) { return c.compression.tolerance == 0.05; }},
      {"compression: {random_seed: 42}",
       [](const ServerConfig& c) { return c.compression.random_seed == 42u; }},
  };
  for (const Case& tc : cases) {
    absl::StatusOr<ServerConfig> c = ParseServerConfigYaml(tc.yaml, "inline");
    ASSERT_TRUE(c.ok()) << tc.yaml << ": " << c.status();
    EXPECT_TRUE(tc.check(*c)) << tc.yaml;
  }
  // The cases cover every key (a new setting without a case fails here).
  std::string all;
  for (const Case& tc : cases) all += tc.yaml + "\n";
  for (const std::string& key : ServerConfigKeys()) {
    EXPECT_THAT(all, HasSubstr(key.substr(key.rfind('.') + 1) + ":")) << "no case for " << key;
  }
}

TEST(ServerConfigTest, WrongTypeNamesTheKey) {
  auto c = ParseServerConfigYaml("port: fifty", "f.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("port: expected an integer, got 'fifty'"));

  c = ParseServerConfigYaml("compression:\n  keep_ratio: [1, 2]\n", "f.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(),
              HasSubstr("compression.keep_ratio: expected a number, got a list"));
  EXPECT_THAT(c.status().message(), HasSubstr("line 2"));

  c = ParseServerConfigYaml("log_prompts: maybe", "f.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("log_prompts: expected a boolean"));

  c = ParseServerConfigYaml("compression: dropkv", "f.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("compression: expected a map"));

  c = ParseServerConfigYaml("kv_memory: lots", "f.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("kv_memory: expected a byte size"));
}

TEST(ServerConfigTest, UnknownKeyIsAnError) {
  auto c = ParseServerConfigYaml("port: 1234\nmax_batch_size: 8\n", "f.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("unknown key 'max_batch_size'"));
  EXPECT_THAT(c.status().message(), HasSubstr("line 2"));

  c = ParseServerConfigYaml("compression:\n  ratio: 0.5\n", "f.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("unknown key 'compression.ratio'"));

  // Unknown flags are errors too.
  c = Load({"--no-such-flag", "1"});
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("--no-such-flag"));
}

TEST(ServerConfigTest, DuplicateKeyIsAnError) {
  auto c = ParseServerConfigYaml("port: 1\nmax_batch: 2\nport: 3\n", "f.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("duplicate key 'port' (line 3)"));
  c = ParseServerConfigYaml("compression:\n  window: 1\n  window: 2\n", "f.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("duplicate key 'compression.window'"));
}

TEST(ServerConfigTest, MisspeltEnvironmentVariableIsReported) {
  auto c = Load({}, {{"DROPKV_PROT", "1"}, {"DROPKV_SHARED", "/x"}, {"DROPKV_PORT", "5"}});
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->warnings.size(), 1u);
  EXPECT_THAT(c->warnings[0], HasSubstr("DROPKV_PROT"));
}

TEST(ServerConfigTest, OutOfRangeNamesTheKey) {
  auto c = ParseServerConfigYaml("port: 70000", "f.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("port: value 70000 is out of range [0, 65535]"));

  c = ParseServerConfigYaml("compression: {keep_ratio: 0}", "f.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("compression.keep_ratio: must be in (0, 1], got 0"));

  c = ParseServerConfigYaml("compression: {method: dropkvv}", "f.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("compression.method: expected one of none|dropkv"));

  c = Load({"--max-batch", "0"});
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(),
              HasSubstr("flag --max-batch: max_batch: value 0 is out of range"));

  c = Load({}, {{"DROPKV_BLOCK_SIZE", "-4"}});
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(),
              HasSubstr("environment DROPKV_BLOCK_SIZE: block_size: value -4 is out of range"));

  // Cross-field rules name the key too.
  c = Load({"--compression-pooling-kernel", "4"});
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("compression.pooling_kernel: must be odd"));
  c = Load({"--tls-cert-file", "c.pem"});
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("tls_key_file"));
}

TEST(ServerConfigTest, PrecedenceFileThenFlagsThenEnv) {
  auto file = WriteScratch("precedence.yaml",
                           "port: 1111\nmax_batch: 11\nblock_size: 8\n"
                           "compression:\n  keep_ratio: 0.5\n");
  // File alone.
  auto c = Load({"--config", file.string()});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->port, 1111);
  EXPECT_EQ(c->max_batch, 11);
  EXPECT_EQ(c->block_size, 8);
  EXPECT_EQ(c->config_file, file.string());
  // Flags override the file.
  c = Load({"--config", file.string(), "--port", "2222", "--max-batch=22"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->port, 2222);
  EXPECT_EQ(c->max_batch, 22);
  EXPECT_EQ(c->block_size, 8);
  // Environment overrides both; keys it does not name keep the flag / file value.
  c = Load({"--config", file.string(), "--port", "2222", "--max-batch=22"},
           {{"DROPKV_PORT", "3333"},
            {"DROPKV_COMPRESSION_KEEP_RATIO", "0.25"},
            {"DROPKV_SHARED", "/ignored/not/a/setting"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->port, 3333);
  EXPECT_EQ(c->max_batch, 22);
  EXPECT_EQ(c->block_size, 8);
  EXPECT_EQ(c->compression.keep_ratio, 0.25);
  // DROPKV_CONFIG names the file when --config is absent; --config wins over it.
  c = Load({}, {{"DROPKV_CONFIG", file.string()}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->port, 1111);
  auto other = WriteScratch("other.yaml", "port: 4444\n");
  c = Load({"--config", other.string()}, {{"DROPKV_CONFIG", file.string()}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->port, 4444);
  EXPECT_EQ(c->max_batch, 32);
  // A missing file is an error naming it.
  c = Load({"--config", "/nonexistent/x.yaml"});
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("/nonexistent/x.yaml"));
}

TEST(ServerConfigTest, DefaultsMatchTheBrief) {
  auto c = Load({});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->host, "127.0.0.1");
  EXPECT_EQ(c->port, 50051);
  EXPECT_EQ(c->metrics_port, 9400);
  EXPECT_EQ(c->log_format, LogFormat::kText);
  EXPECT_FALSE(c->log_prompts);
  EXPECT_FALSE(c->exit_after_load);
}

TEST(ServerConfigTest, BoolFlagsAndAliases) {
  auto c = Load({"--log-prompts", "--model", "/m", "--log-format", "json"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->log_prompts);
  EXPECT_EQ(c->model_dir, "/m");
  EXPECT_EQ(c->log_format, LogFormat::kJson);
  c = Load({"--log-prompts=false", "--compression-explicit-layer-prune", "0.1,0.2",
            "--compression-allocator", "explicit"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->log_prompts);
  EXPECT_EQ(c->compression.explicit_layer_prune, (std::vector<double>{0.1, 0.2}));
}

// --print-config output reads back as the same config (no field lost or rounded).
TEST(ServerConfigTest, PrintConfigRoundTrips) {
  std::ostringstream out;
  auto c = LoadServerConfigFrom(
      {"--print-config", "--port", "4321", "--compression-keep-ratio", "0.1",
       "--compression-allocator", "explicit", "--compression-explicit-layer-prune", "0.3,0.7",
       "--model-dir", "dir with: colon", "--kv-memory", "3GiB"},
      {}, out);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->exit_after_load);
  auto back = ParseServerConfigYaml(out.str(), "printed");
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << out.str();
  // The config, then the kernel tuning as comments (environment only: not a config key).
  const std::string yaml = ServerConfigToYaml(*back);
  ASSERT_EQ(out.str().substr(0, yaml.size()), yaml);
  EXPECT_EQ(out.str().substr(yaml.size()), kernels::TuningToYaml(kernels::KernelTuning{}));
  EXPECT_EQ(back->port, 4321);
  EXPECT_EQ(back->model_dir, "dir with: colon");
  EXPECT_EQ(back->kv_memory_bytes, 3LL << 30);
  EXPECT_EQ(back->compression.keep_ratio, 0.1);
  EXPECT_EQ(back->compression.explicit_layer_prune, (std::vector<double>{0.3, 0.7}));
}

// The kernel tuning's variables are known (a bad value is named), every other DROPKV_* variable
// is reported as ignored, and --print-config shows the tuning in effect.
TEST(ServerConfigTest, TuningVariablesAreKnownAndPrinted) {
  std::ostringstream out;
  auto c = LoadServerConfigFrom({"--print-config"},
                                {{"DROPKV_PDL", "0"},
                                 {"DROPKV_PREFILL_ATTENTION", "fastest"},
                                 {"DROPKV_GEMV_KERNEL", "ring"}},
                                out);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->warnings.size(), 2u) << absl::StrJoin(c->warnings, "; ");
  EXPECT_THAT(c->warnings, ::testing::Contains(HasSubstr("DROPKV_PREFILL_ATTENTION='fastest'")));
  EXPECT_THAT(c->warnings, ::testing::Contains(
                               HasSubstr("DROPKV_GEMV_KERNEL is not a setting and was ignored")));
  EXPECT_THAT(out.str(), HasSubstr("#   pdl: false  # DROPKV_PDL"));
  EXPECT_THAT(out.str(), HasSubstr("#   prefill_attention: auto"));
}

TEST(ServerConfigTest, HelpListsEveryFlagWithEnvAndDefault) {
  std::ostringstream out;
  auto c = LoadServerConfigFrom({"--help"}, {}, out);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->exit_after_load);
  for (const std::string& key : ServerConfigKeys()) {
    EXPECT_THAT(out.str(), HasSubstr(ServerConfigFlagName(key))) << key;
    EXPECT_THAT(out.str(), HasSubstr(ServerConfigEnvName(key))) << key;
  }
  EXPECT_THAT(out.str(), HasSubstr("default: 50051"));
}

TEST(ServerConfigTest, ByteSizes) {
  EXPECT_EQ(*ParseByteSize("4GiB"), 4LL << 30);
  EXPECT_EQ(*ParseByteSize("512 MiB"), 512LL << 20);
  EXPECT_EQ(*ParseByteSize("1.5GB"), 1500000000LL);
  EXPECT_EQ(*ParseByteSize("4096"), 4096);
  EXPECT_EQ(*ParseByteSize("2k"), 2048);
  EXPECT_FALSE(ParseByteSize("GiB").ok());
  EXPECT_FALSE(ParseByteSize("-1GiB").ok());
  EXPECT_FALSE(ParseByteSize("4 XB").ok());
}

// The environment is read here, once, and the folders reach the engine as options.
TEST(ServerConfigTest, ModelFoldersComeFromTheEnvironment) {
  EXPECT_EQ(DefaultModelDir({{"HOME", "/h"}}), "/h/.cache/dropkv/models/smollm2-135m-instruct");
  EXPECT_EQ(DefaultModelDir({{"HOME", "/h"}, {"DROPKV_CACHE", "/c"}}),
            "/c/models/smollm2-135m-instruct");
  EXPECT_EQ(DefaultModelDir({{"DROPKV_MODELS", "/m"}, {"DROPKV_CACHE", "/c"}}),
            "/m/smollm2-135m-instruct");
  EXPECT_EQ(DemoModelDir({{"HOME", "/h"}}), "/h/.cache/dropkv/demo-model");
  EXPECT_EQ(DemoModelDir({{"HOME", "/h"}, {"DROPKV_CACHE", "/c"}}), "/c/demo-model");
  EXPECT_EQ(DemoModelDir({}), "");
}

}  // namespace
}  // namespace dropkv
