#include "server/request_gateway.h"

#include "dropkv/v1/inference.pb.h"
#include "engine/scheduler/scheduler.h"
#include "server/metrics/request_metrics.h"
#include "server/metrics/server_metrics.h"

namespace dropkv {

RequestGateway::RequestGateway(Scheduler& scheduler, const Tokenizer* tokenizer,
                               GatewayOptions options)
    : scheduler_(scheduler), tokenizer_(tokenizer), options_(std::move(options)) {}

bool RequestGateway::Authorized(std::string_view authorization) const {
  if (options_.auth_token.empty()) return true;
  constexpr std::string_view kScheme = "Bearer ";
  if (authorization.size() != kScheme.size() + options_.auth_token.size() ||
      authorization.substr(0, kScheme.size()) != kScheme)
    return false;
  // Compare every byte whatever the first mismatch: the time taken says nothing about the token.
  unsigned char diff = 0;
  const std::string_view given = authorization.substr(kScheme.size());
  for (size_t i = 0; i < given.size(); ++i)
    diff |= static_cast<unsigned char>(given[i] ^ options_.auth_token[i]);
  return diff == 0;
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
