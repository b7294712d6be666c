// Builds and runs the gRPC server around an InferenceService: listening address, message size,
// TLS, the standard grpc.health.v1 service and server reflection, and graceful shutdown.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace grpc {
class Server;
}

namespace dropkv {

class InferenceService;
class Scheduler;

struct GrpcServerOptions {
  std::string host = "127.0.0.1";  // 0.0.0.0 serves other hosts
  int32_t port = 50051;            // 0 = pick a free port (see GrpcServer::port())
  int64_t max_message_bytes = 16 * 1024 * 1024;
  std::string tls_cert_file;  // PEM; both set = TLS, both empty = plaintext
  std::string tls_key_file;
  std::string tls_client_ca_file;  // PEM CA: clients must present a certificate it signed (mTLS)
  int32_t max_concurrent_streams = 1024;  // per HTTP/2 connection
};

// Shutdown ends within its grace period plus this, whatever the clients do (docs/reliability.md).
inline constexpr std::chrono::seconds kShutdownMargin{3};

class GrpcServer {
 public:
  // Starts listening; health reports NOT_SERVING until SetServing(true).
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(const GrpcServerOptions& options,
                                                           InferenceService& service);
  ~GrpcServer();

  int32_t port() const { return port_; }
  // Overall ("") and "dropkv.v1.Inference" health status.
  void SetServing(bool serving);
  // Graceful stop: NOT_SERVING, the scheduler refuses new work (UNAVAILABLE), running calls get
  // `grace_seconds` to finish, then everything left is cancelled and the server stops.
  // `num_other_active` counts the other front ends' requests (HTTP) to wait for as well.
  void Shutdown(Scheduler& scheduler, double grace_seconds,
                const std::function<int64_t()>& num_other_active = nullptr);
  void Wait();

 private:
  GrpcServer() = default;
  std::unique_ptr<grpc::Server> server_;
  InferenceService* service_ = nullptr;
  int32_t port_ = 0;
};

}  // namespace dropkv
