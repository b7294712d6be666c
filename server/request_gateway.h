// What every front end (gRPC: server/service.cpp, HTTP: server/http/openai_frontend.cpp) does
// with a generation request between parsing its own wire format and streaming events back: the
// bearer-token check, validation (server/validation.h: the proto is the one request shape both
// share), metrics for refused requests, the per-request metrics tracker, and Scheduler::Submit.
// No gRPC runtime and no LibTorch here: the HTTP front end links it without either.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/scheduler/generation.h"
#include "server/validation.h"

namespace dropkv {

class Scheduler;
class Tokenizer;
class ServerMetrics;
class RequestMetricsTracker;
namespace v1 {
class GenerateRequest;
}

struct GatewayOptions {
  ValidationLimits limits;
  std::string auth_token;            // non-empty: requests need "Bearer <token>"
  ServerMetrics* metrics = nullptr;  // Prometheus (server/metrics); null = request log line only
  bool log_prompts = false;          // the request log line includes the prompt text
};

class RequestGateway {
 public:
  // `scheduler` and `tokenizer` (may be null) outlive the gateway.
  RequestGateway(Scheduler& scheduler, const Tokenizer* tokenizer, GatewayOptions options);

  // True when no token is configured or `authorization` is exactly "Bearer <token>".
  bool Authorized(std::string_view authorization) const;

  // ValidateGenerateRequest with the server's limits; a refusal is counted in the metrics under
  // its code (it never becomes a request, so no tracker will count it).
  absl::StatusOr<GenerationRequest> Validate(const v1::GenerateRequest& request) const;

  // Queues a validated request on `channel`; `tracker` gets its metrics/log tracker (also when
  // Submit refuses it: the tracker has then recorded the refusal). `prompt_text` is logged only
  // with log_prompts.
  absl::Status Submit(GenerationRequest request, std::shared_ptr<RequestChannel> channel,
                      std::string prompt_text, std::unique_ptr<RequestMetricsTracker>* tracker);

  Scheduler& scheduler() const { return scheduler_; }
  const Tokenizer* tokenizer() const { return tokenizer_; }
  const GatewayOptions& options() const { return options_; }

 private:
  Scheduler& scheduler_;
  const Tokenizer* tokenizer_;
  GatewayOptions options_;
};

}  // namespace dropkv
