// The "Authorization: Bearer <token>" check shared by the request gateway (gRPC and the OpenAI
// API) and the /metrics endpoint. Header-only: the metrics server links neither.
#pragma once

#include <string_view>

namespace dropkv {

// True when `token` is empty (no token configured) or `authorization` is exactly "Bearer <token>".
inline bool BearerTokenMatches(std::string_view authorization, std::string_view token) {
  if (token.empty()) return true;
  constexpr std::string_view kScheme = "Bearer ";
  if (authorization.size() != kScheme.size() + token.size() ||
      authorization.substr(0, kScheme.size()) != kScheme)
    return false;
  // Compare every byte whatever the first mismatch: the time taken says nothing about the token.
  unsigned char diff = 0;
  const std::string_view given = authorization.substr(kScheme.size());
  for (size_t i = 0; i < given.size(); ++i) diff |= static_cast<unsigned char>(given[i] ^ token[i]);
  return diff == 0;
}

}  // namespace dropkv
