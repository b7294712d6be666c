#include "server/grpc_server.h"

#include <chrono>
#include <thread>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"
#include "engine/common/file_util.h"
#include "engine/scheduler/scheduler.h"
#include "server/service.h"

namespace dropkv {

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(const GrpcServerOptions& options,
                                                              InferenceService& service) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  std::shared_ptr<grpc::ServerCredentials> creds;
  if (options.tls_cert_file.empty() != options.tls_key_file.empty())
    return absl::InvalidArgumentError("tls: set both the certificate and the key file, or neither");
  if (!options.tls_cert_file.empty()) {
    auto cert = ReadFileToString(options.tls_cert_file);
    if (!cert.ok()) return cert.status();
    auto key = ReadFileToString(options.tls_key_file);
    if (!key.ok()) return key.status();
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({*key, *cert});
    creds = grpc::SslServerCredentials(ssl);
  } else {
    creds = grpc::InsecureServerCredentials();
  }

  auto server = std::unique_ptr<GrpcServer>(new GrpcServer());
  grpc::ServerBuilder builder;
  const std::string address = absl::StrCat(options.host.find(':') != std::string::npos
                                               ? absl::StrCat("[", options.host, "]")
                                               : options.host,
                                           ":", options.port);
  builder.AddListeningPort(address, creds, &server->port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  builder.RegisterService(&service);
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0)
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address));
  server->service_ = &service;
  server->SetServing(false);
  return server;
}

GrpcServer::~GrpcServer() {
  if (server_) server_->Shutdown(std::chrono::system_clock::now());
}

void GrpcServer::SetServing(bool serving) {
  if (auto* health = server_->GetHealthCheckService()) {
    health->SetServingStatus(serving);  // every service name, "" included
    health->SetServingStatus("dropkv.v1.Inference", serving);
  }
}

void GrpcServer::Shutdown(Scheduler& scheduler, double grace_seconds,
                          const std::function<int64_t()>& num_other_active) {
  SetServing(false);
  scheduler.BeginDrain();
  auto num_active = [&] {
    return service_->num_active_calls() + (num_other_active ? num_other_active() : 0);
  };
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(grace_seconds));
  while (num_active() > 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (num_active() > 0) {
    scheduler.CancelAll();  // the engine sends each a final CANCELLED event at its next step
    const auto cancel_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (num_active() > 0 && std::chrono::steady_clock::now() < cancel_deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

void GrpcServer::Wait() {
  server_->Wait();
}

}  // namespace dropkv
