// The dropkv.v1.Inference gRPC service (callback API). Handlers validate, submit to the Scheduler
// and stream its events back; they never touch tensors or the runner (DESIGN.md decision 8).
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "dropkv/v1/inference.grpc.pb.h"
#include "server/request_gateway.h"
#include "server/validation.h"

namespace dropkv {

class Scheduler;
class Tokenizer;
class ServerMetrics;
class RequestMetricsTracker;

struct ServiceOptions {
  ValidationLimits limits;
  v1::ModelInfo model_info;          // answered by GetModelInfo
  std::string auth_token;            // non-empty: every RPC needs "authorization: Bearer <token>"
  ServerMetrics* metrics = nullptr;  // Prometheus (server/metrics); null = request log line only
  bool log_prompts = false;          // the request log line includes the prompt text
  // Generate / GenerateUnary calls open at once; more get RESOURCE_EXHAUSTED at once.
  int64_t max_open_calls = 4096;
  // A call whose answer waits this long on a client that reads nothing is cancelled (its request
  // leaves the scheduler and its KV blocks return; the output it buffered is freed).
  double write_stall_seconds = 30.0;

  // The part every front end shares (server/request_gateway.h).
  GatewayOptions gateway() const { return {limits, auth_token, metrics, log_prompts}; }
};

class InferenceService final : public v1::Inference::CallbackService {
 public:
  // `scheduler` and `tokenizer` (may be null) outlive the service.
  InferenceService(Scheduler& scheduler, const Tokenizer* tokenizer, ServiceOptions options);
  ~InferenceService() override;

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* GenerateUnary(grpc::CallbackServerContext* context,
                                          const v1::GenerateRequest* request,
                                          v1::GenerateResponse* response) override;
  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* context,
                                     const v1::TokenizeRequest* request,
                                     v1::TokenizeResponse* response) override;
  grpc::ServerUnaryReactor* Detokenize(grpc::CallbackServerContext* context,
                                       const v1::DetokenizeRequest* request,
                                       v1::DetokenizeResponse* response) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request,
                                         v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* GetServerStats(grpc::CallbackServerContext* context,
                                           const v1::GetServerStatsRequest* request,
                                           v1::ServerStats* response) override;

  // Number of Generate / GenerateUnary calls not finished yet (graceful shutdown waits on it).
  int64_t num_active_calls() const;
  // Cancels every open Generate / GenerateUnary call (shutdown, once its grace period is over):
  // each ends now, whatever its client reads.
  void CancelAllCalls();

  // The open generation calls (service.cpp): counted, watched for stalled writes, cancellable.
  class OpenCalls;

 private:
  // OK, or UNAUTHENTICATED when a token is configured and the call does not carry it.
  grpc::Status CheckAuth(const grpc::CallbackServerContext* context) const;
  // Generate / GenerateUnary: auth, validation and Submit, then attach `reactor` to the request
  // (or finish it at once with the error).
  template <typename Reactor>
  Reactor* StartReactor(grpc::CallbackServerContext* context, const v1::GenerateRequest& request,
                        Reactor* reactor);
  // The unary RPCs: auth, then finish with what `body` returns.
  template <typename Body>
  grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* context, Body&& body);
  // Validation + Submit; on success the request is queued on `channel`.
  // `tracker` gets the request's metrics/log tracker once validation passed.
  absl::Status Start(grpc::CallbackServerContext* context, const v1::GenerateRequest& request,
                     std::shared_ptr<RequestChannel> channel, std::string* request_id,
                     std::unique_ptr<RequestMetricsTracker>* tracker);

  RequestGateway gateway_;
  const Tokenizer* tokenizer_;
  ServiceOptions options_;
  std::shared_ptr<OpenCalls> open_calls_;
  // Every 100 ms: cancels the calls whose answer waited longer than write_stall_seconds.
  std::thread stall_watch_;
  std::mutex stall_watch_mu_;
  std::condition_variable stall_watch_cv_;
  bool stop_stall_watch_ = false;
};

// Fills the final message's fields from an event (shared by the streaming and unary paths).
void FillFinal(const GenerationEvent& event, v1::GenerateResponse* response);

}  // namespace dropkv
