// dropkv-server: loads the config (config/server_config.h: defaults <- YAML <- flags <- env),
// builds the engine, serves dropkv.v1.Inference + health + reflection (gRPC) and, with http_port,
// the OpenAI-compatible HTTP API until SIGTERM/SIGINT, then drains gracefully and exits 0.
#include <sys/resource.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include <google/protobuf/stubs/logging.h>
#include <grpc/support/log.h>
#include <spdlog/spdlog.h>

#include "absl/strings/ascii.h"
#include "config/logging.h"
#include "config/server_config.h"
#include "engine/common/file_util.h"
#include "engine/scheduler/scheduler.h"
#include "server/engine_setup.h"
#include "server/grpc_server.h"
#include "server/http/metrics_http_server.h"
#include "server/http/openai_frontend.h"
#include "server/metrics/request_metrics.h"
#include "server/metrics/server_metrics.h"
#include "server/service.h"

namespace {

std::chrono::milliseconds StallTimeout(const dropkv::ServerConfig& config) {
  return std::chrono::milliseconds(static_cast<int64_t>(config.write_stall_seconds * 1e3));
}

// gRPC's and protobuf's own messages go through our logger, so that with --log-format json every
// line on stderr is one JSON object (they print raw text otherwise).
void RouteLibraryLogging() {
  gpr_set_log_function([](gpr_log_func_args* args) {
    const spdlog::level::level_enum level =
        args->severity == GPR_LOG_SEVERITY_ERROR  ? spdlog::level::err
        : args->severity == GPR_LOG_SEVERITY_INFO ? spdlog::level::info
                                                  : spdlog::level::debug;
    spdlog::log(level, "grpc: {} ({}:{})", args->message, args->file, args->line);
  });
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel level, const char* file, int line, const std::string& message) {
        const spdlog::level::level_enum spd_level =
            level >= google::protobuf::LOGLEVEL_ERROR     ? spdlog::level::err
            : level == google::protobuf::LOGLEVEL_WARNING ? spdlog::level::warn
                                                          : spdlog::level::info;
        spdlog::log(spd_level, "protobuf: {} ({}:{})", message, file, line);
      });
}

volatile std::sig_atomic_t g_signal = 0;
void OnSignal(int signal) {
  g_signal = signal;
}

// Each HTTP stream holds a socket: allow as many descriptors as the hard limit permits.
void RaiseOpenFileLimit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &limit);
  }
}

// A tensor-parallel rank other than 0: "--tp-rank R --tp-store DIR", which rank 0 adds to the
// command line of the processes it starts (engine/parallel/group.h). Not settings.
struct FollowerRank {
  int32_t rank = 0;
  std::string store_dir;
};

// `--model DIR` is the documented short form of the config's `--model-dir DIR`; the follower
// rank's two arguments are taken out.
std::vector<std::string> AliasArgs(int argc, char** argv, FollowerRank& follower) {
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (i + 1 < argc && (a == "--tp-rank" || a == "--tp-store")) {
      if (a == "--tp-rank")
        follower.rank = std::atoi(argv[++i]);
      else
        follower.store_dir = argv[++i];
      continue;
    }
    if (a == "--model")
      a = "--model-dir";
    else if (a.rfind("--model=", 0) == 0)
      a = "--model-dir=" + a.substr(8);
    args.push_back(std::move(a));
  }
  return args;
}

// A follower rank serves nothing itself: it makes rank 0's runner calls on its shard until rank 0
// stops it. It dies with rank 0 and ignores the terminal's signals (rank 0 drains first).
int RunFollowerRank(const dropkv::ServerConfig& config, const FollowerRank& follower) {
  std::signal(SIGTERM, SIG_IGN);
  std::signal(SIGINT, SIG_IGN);
  spdlog::info("tensor parallelism: rank {} of {} follows rank 0", follower.rank,
               config.tensor_parallel_size);
  absl::Status st = dropkv::Engine::FollowRankZero(dropkv::EngineOptionsFor(config), follower.rank,
                                                   follower.store_dir);
  if (!st.ok()) {
    spdlog::critical("tensor parallelism: rank {}: {}", follower.rank, st.ToString());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace dropkv;
  FollowerRank follower;
  std::vector<std::string> args = AliasArgs(argc, argv, follower);
  std::vector<char*> argv2 = {argv[0]};
  for (auto& a : args) argv2.push_back(a.data());
  auto config_or = LoadServerConfig(static_cast<int>(argv2.size()), argv2.data());
  if (!config_or.ok()) {
    std::cerr << "dropkv-server: " << config_or.status().message() << "\n";
    return 2;
  }
  const ServerConfig& config = *config_or;
  if (config.exit_after_load) return 0;  // --help / --print-config
  if (absl::Status st = SetUpLogging(config); !st.ok()) {
    std::cerr << "dropkv-server: " << st.message() << "\n";
    return 2;
  }
  RouteLibraryLogging();
  if (follower.rank > 0) return RunFollowerRank(config, follower);

  // Signals first: a SIGTERM while the model loads must not kill the process uncleanly.
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGINT, OnSignal);

  std::string auth_token;
  if (!config.auth_token_file.empty()) {
    auto token = ReadFileToString(config.auth_token_file);
    if (!token.ok()) {
      spdlog::critical("auth_token_file: {}", token.status().ToString());
      return 2;
    }
    auth_token = std::string(absl::StripAsciiWhitespace(*token));
    if (auth_token.empty()) {
      spdlog::critical("auth_token_file: {} is empty", config.auth_token_file);
      return 2;
    }
  }

  // The HTTP API listens while the model loads: /health answers 503 "loading" until Attach.
  RaiseOpenFileLimit();
  std::atomic<ServerMetrics*> metrics_for_http{nullptr};
  std::unique_ptr<HttpFrontend> http;
  if (config.http_port > 0) {
    HttpFrontendOptions http_options;
    http_options.host = config.host;
    http_options.port = config.http_port;
    http_options.num_threads = config.http_threads;
    http_options.max_body_bytes = config.max_message_bytes;
    http_options.tls_cert_file = config.tls_cert_file;
    http_options.tls_key_file = config.tls_key_file;
    http_options.tls_client_ca_file = config.tls_client_ca_file;
    http_options.write_stall_timeout = StallTimeout(config);
    http_options.max_connections = config.max_open_calls;
    http_options.auth_token_set = !auth_token.empty();
    http_options.unread_stream_bytes = config.http_unread_stream_bytes;
    if (config.metrics_auth) http_options.metrics_bearer_token = auth_token;
    http_options.render_metrics = [&metrics_for_http] {
      ServerMetrics* m = metrics_for_http.load();
      return m != nullptr ? m->RenderText() : std::string();
    };
    auto started = HttpFrontend::Start(http_options);
    if (!started.ok()) {
      spdlog::critical("{}", started.status().ToString());
      return 1;
    }
    http = std::move(*started);
  }

  auto served_or = CreateServedEngine(config, std::vector<std::string>(argv, argv + argc));
  if (!served_or.ok()) {
    spdlog::critical("cannot load the model: {}", served_or.status().ToString());
    return 1;
  }
  ServedEngine& served = *served_or;
  Engine& engine = *served.engine;

  // Prometheus /metrics on its own port (0 = none).
  ServerMetrics metrics(served.model_info.model_name());
  metrics_for_http = &metrics;
  struct ForgetMetricsOnExit {  // destroyed before `metrics`: /metrics never reads a dead object
    std::atomic<ServerMetrics*>& pointer;
    ~ForgetMetricsOnExit() { pointer = nullptr; }
  } forget_metrics{metrics_for_http};
  std::unique_ptr<MetricsHttpServer> metrics_http;
  if (config.metrics_port > 0) {
    MetricsServerOptions metrics_options;
    metrics_options.host = config.host;
    metrics_options.port = config.metrics_port;
    if (config.metrics_auth) {  // the gRPC port's TLS files and bearer token
      metrics_options.tls_cert_file = config.tls_cert_file;
      metrics_options.tls_key_file = config.tls_key_file;
      metrics_options.tls_client_ca_file = config.tls_client_ca_file;
      metrics_options.bearer_token = auth_token;
    }
    metrics_options.limits.write_stall_timeout = StallTimeout(config);
    auto started =
        MetricsHttpServer::Start(metrics_options, [&metrics] { return metrics.RenderText(); });
    if (!started.ok()) {
      spdlog::critical("metrics_port: {}", started.status().ToString());
      return 1;
    }
    metrics_http = std::move(*started);
  }
  SchedulerStatsPoller poller(&metrics, [&engine] { return engine.scheduler().Stats(); });

  ServiceOptions service_options;
  service_options.metrics = &metrics;
  service_options.log_prompts = config.log_prompts;
  service_options.limits = served.limits;
  service_options.model_info = served.model_info;
  service_options.auth_token = auth_token;
  service_options.max_open_calls = config.max_open_calls;
  service_options.write_stall_seconds = config.write_stall_seconds;
  InferenceService service(engine.scheduler(), engine.tokenizer(), service_options);

  GrpcServerOptions grpc_options;
  grpc_options.host = config.host;
  grpc_options.port = config.port;
  grpc_options.max_message_bytes = config.max_message_bytes;
  grpc_options.tls_cert_file = config.tls_cert_file;
  grpc_options.tls_key_file = config.tls_key_file;
  grpc_options.tls_client_ca_file = config.tls_client_ca_file;
  grpc_options.max_concurrent_streams = config.max_concurrent_streams;
  auto server_or = GrpcServer::Start(grpc_options, service);
  if (!server_or.ok()) {
    spdlog::critical("{}", server_or.status().ToString());
    return 1;
  }
  GrpcServer& server = **server_or;
  // Health stays NOT_SERVING until the warm-up ran.
  if (absl::Status st = engine.WarmUp(); !st.ok()) {
    spdlog::critical("{}", st.ToString());
    return 1;
  }
  engine.scheduler().Start();
  server.SetServing(true);
  if (http) {
    HttpEngine http_engine;
    http_engine.scheduler = &engine.scheduler();
    http_engine.tokenizer = engine.tokenizer();
    http_engine.gateway = service_options.gateway();
    http_engine.served_model_name = served.model_info.model_name();
    // Clients may also name the model by its folder (never listed or reported).
    if (!config.demo_model && config.model_dir != http_engine.served_model_name)
      http_engine.model_aliases.push_back(config.model_dir);
    http_engine.max_context_len = served.model_info.max_context_len();
    http_engine.vocab_size = served.model_info.vocab_size();
    http->Attach(std::move(http_engine));
  }
  spdlog::info(
      "dropkv-server listening on {}:{} (gRPC){} ({} layers, vocab {}, {} KV blocks, TLS {}, "
      "auth {})",
      config.host, server.port(), http ? fmt::format(", {} (HTTP)", http->port()) : "",
      served.model_info.num_layers(), served.model_info.vocab_size(),
      engine.scheduler().Stats().kv_blocks_total, config.tls_cert_file.empty() ? "off" : "on",
      auth_token.empty() ? "off" : "on");
  // The port line on stdout is what scripts and tests wait for: "LISTENING <grpc>" and, with the
  // HTTP API on, " HTTP <port>" after it (readers of the first number are unaffected).
  std::cout << "LISTENING " << server.port();
  if (http) std::cout << " HTTP " << http->port();
  std::cout << std::endl;

  while (g_signal == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  spdlog::info("signal {}: draining (grace {} s)", static_cast<int>(g_signal),
               config.shutdown_grace_seconds);
  if (http) http->SetDraining();
  server.Shutdown(engine.scheduler(), config.shutdown_grace_seconds,
                  [&http] { return http ? http->num_active_requests() : 0; });
  if (http) http->Stop();  // before the engine stops: nothing is left waiting on it
  engine.scheduler().Stop();
  poller.Stop();
  if (metrics_http) metrics_http->Stop();
  spdlog::info("dropkv-server stopped");
  return 0;
}
