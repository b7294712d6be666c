#include "server/grpc_server.h"

#include <chrono>
#include <thread>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <openssl/bio.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include "absl/strings/str_cat.h"
#include "engine/common/file_util.h"
#include "engine/scheduler/scheduler.h"
#include "server/service.h"

namespace dropkv {
namespace {

// gRPC reports a key that does not belong to its certificate only as a failure to listen.
absl::Status CheckKeyMatchesCertificate(const std::string& cert_pem, const std::string& key_pem) {
  std::unique_ptr<BIO, decltype(&BIO_free)> cert_bio(
      BIO_new_mem_buf(cert_pem.data(), static_cast<int>(cert_pem.size())), &BIO_free);
  std::unique_ptr<X509, decltype(&X509_free)> cert(
      PEM_read_bio_X509(cert_bio.get(), nullptr, nullptr, nullptr), &X509_free);
  if (cert == nullptr) return absl::InvalidArgumentError("the certificate is not PEM X.509");
  std::unique_ptr<BIO, decltype(&BIO_free)> key_bio(
      BIO_new_mem_buf(key_pem.data(), static_cast<int>(key_pem.size())), &BIO_free);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr), &EVP_PKEY_free);
  if (key == nullptr) return absl::InvalidArgumentError("the key is not a PEM private key");
  if (X509_check_private_key(cert.get(), key.get()) != 1)
    return absl::InvalidArgumentError("the private key does not match the certificate");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(const GrpcServerOptions& options,
                                                              InferenceService& service) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  std::shared_ptr<grpc::ServerCredentials> creds;
  if (options.tls_cert_file.empty() != options.tls_key_file.empty())
    return absl::InvalidArgumentError("tls: set both the certificate and the key file, or neither");
  if (!options.tls_client_ca_file.empty() && options.tls_cert_file.empty())
    return absl::InvalidArgumentError(
        "tls: client certificates (mTLS) need the server's TLS files");
  if (!options.tls_cert_file.empty()) {
    auto cert = ReadFileToString(options.tls_cert_file);
    if (!cert.ok()) return cert.status();
    auto key = ReadFileToString(options.tls_key_file);
    if (!key.ok()) return key.status();
    if (absl::Status pair = CheckKeyMatchesCertificate(*cert, *key); !pair.ok())
      return absl::InvalidArgumentError(absl::StrCat("tls_key_file ", options.tls_key_file,
                                                     " with tls_cert_file ", options.tls_cert_file,
                                                     ": ", pair.message()));
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back({*key, *cert});
    if (!options.tls_client_ca_file.empty()) {  // mTLS: no verified client certificate, no call
      auto ca = ReadFileToString(options.tls_client_ca_file);
      if (!ca.ok()) return ca.status();
      ssl.pem_root_certs = *ca;
      ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
    }
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
  // Exclusive: with SO_REUSEPORT (gRPC's default) a second server, or any process of the same
  // user, could bind the port too and take a share of the connections.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_concurrent_streams);
  builder.AddListeningPort(address, creds, &server->port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  builder.RegisterService(&service);
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0)
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", address,
        " (another process holds the port, or the host is not an address of this machine)"));
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
  auto wait_until_idle = [&](std::chrono::steady_clock::duration at_most) {
    const auto until = std::chrono::steady_clock::now() + at_most;
    while (num_active() > 0 && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  };
  wait_until_idle(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(grace_seconds)));
  // The margin, in thirds: the engine's final CANCELLED events, then cutting off the gRPC calls of
  // clients that read nothing, then the server's own stop.
  const auto third =
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(kShutdownMargin / 3.0);
  if (num_active() > 0) {
    scheduler.CancelAll();  // the engine sends each a final CANCELLED event at its next step
    wait_until_idle(third);
  }
  if (num_active() > 0) {
    service_->CancelAllCalls();
    wait_until_idle(third);
  }
  server_->Shutdown(std::chrono::system_clock::now() + third);
}

void GrpcServer::Wait() {
  server_->Wait();
}

}  // namespace dropkv
