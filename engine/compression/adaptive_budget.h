// The adaptive allocator (BudgetAllocator::kAdaptive): a sequence's uniform budget total split over
// its global layers by the sequence's own scores, once every layer is scored (AdaKV's allocation,
// arXiv 2407.11550, across layers; the paged cache keeps one count for every KV head of a layer).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace dropkv::compression {

// `pooled[l]`: layer l's scores in selection's order before protection, fp32 [1, Hkv, n_l] (what
// kernels::PoolScores gives); its first `num_sinks` and last `window` entries are kept first.
// `uniform[l]`: layer l's uniform budget, <= n_l. Each head's unprotected scores are made shares
// of their sum (a head's scores say how its own output shifts, on its own scale); keeping k
// entries of a layer is worth the sum over its heads of their k largest shares, and the total
// sum(uniform) goes to the layers' largest such gains (exact: each layer's gains fall with k).
// Every layer keeps at least max(protected, ceil(kAdaptiveFloorShare * uniform[l])), at most n_l.
absl::StatusOr<std::vector<int64_t>> AdaptiveLayerBudgets(std::span<const at::Tensor> pooled,
                                                          std::span<const int64_t> uniform,
                                                          int32_t window, int32_t num_sinks);

}  // namespace dropkv::compression
