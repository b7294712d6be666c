#include "server/request_gateway.h"

#include "dropkv/v1/inference.pb.h"
#include "engine/scheduler/scheduler.h"
#include "server/bearer_token.h"
#include "server/metrics/request_metrics.h"
#include "server/metrics/server_metrics.h"

namespace dropkv {

RequestGateway::RequestGateway(Scheduler& scheduler, const Tokenizer* tokenizer,
                               GatewayOptions options)
    : scheduler_(scheduler), tokenizer_(tokenizer), options_(std::move(options)) {}

bool RequestGateway::Authorized(std::string_view authorization) const {
  return BearerTokenMatches(authorization, options_.auth_token);
}

absl::StatusOr<GenerationRequest> RequestGateway::Validate(
    const v1::GenerateRequest& request) const {
  auto validated = ValidateGenerateRequest(request, options_.limits, tokenizer_);
  if (!validated.ok() && options_.metrics != nullptr)
    options_.metrics->OnRequestFinished(validated.status().code(), 0.0);
  return validated;
}

absl::Status RequestGateway::Submit(GenerationRequest request,
                                    std::shared_ptr<RequestChannel> channel,
                                    std::string prompt_text,
                                    std::unique_ptr<RequestMetricsTracker>* tracker) {
  *tracker = std::make_unique<RequestMetricsTracker>(
      options_.metrics, request, options_.log_prompts,
      options_.log_prompts ? std::move(prompt_text) : std::string());
  absl::Status st = scheduler_.Submit(std::move(request), std::move(channel));
  if (!st.ok()) (*tracker)->OnRejected(st);
  return st;
}

}  // namespace dropkv
