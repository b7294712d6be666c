// What the server and the scheduler need from compression without pulling in tensors (the
// settings and their names are in params.h): validation of a request's CompressionParams, the
// canonical budget conversion and the kept-token count per layer (admission control).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/compression/budget.h"
#include "engine/compression/schema.h"  // the fields' rows and bounds
#include "engine/request.h"

namespace dropkv::compression {

// The one validator of compression settings (the server's requests, the config file, the tools'
// flags): INVALID_ARGUMENT whose message starts with the field ("window: must be in [1, 1024],
// got 0"; callers prefix "compression."). The fields' ranges (their schema rows) and their consistency (chunk_size >=
// window, chunk_policy budget with a cap, a profile for the allocators that read one) are checked
// whatever the method; with a method and num_layers > 0 also what depends on the model's depth
// (explicit list length, the allocator's feasibility). It reads no file: a profile's values are
// checked where it is loaded (LoadLayerProfile + ValidateBudgetOptions, once at start-up).
absl::Status ValidateCompression(const CompressionParams& params, int32_t num_layers);

// The canonical budget of `params` for a sequence that has seen `num_tokens` tokens: the
// allocator options with keep_ratio resolved (budget_tokens wins over keep_ratio) and the profile
// loaded. `profile` may carry an already loaded profile (skips the file read).
absl::StatusOr<BudgetOptions> ResolveBudgetOptions(const CompressionParams& params,
                                                   int32_t num_layers, int64_t num_tokens,
                                                   const LayerProfile* profile = nullptr);

// Tokens each layer stores after the prefill of a `prompt_len`-token prompt (every chunk policy
// ends at the same final budget keep_l(prompt_len)); kNone keeps prompt_len everywhere.
absl::StatusOr<std::vector<int64_t>> KeptTokensPerLayer(const CompressionParams& params,
                                                        int32_t num_layers, int64_t prompt_len);

// Whether the method protects the first num_sinks tokens (StreamingLLM always; others when
// params.protect_sinks).
int32_t ProtectedSinks(const CompressionParams& params);

}  // namespace dropkv::compression
