#include "engine/compression/adaptive_budget.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "engine/compression/params.h"

namespace dropkv::compression {

absl::StatusOr<std::vector<int64_t>> AdaptiveLayerBudgets(std::span<const at::Tensor> pooled,
                                                          std::span<const int64_t> uniform,
                                                          int32_t window, int32_t num_sinks) {
  if (pooled.size() != uniform.size() || pooled.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("adaptive budgets: ", pooled.size(),
                                                   " layers' scores for ", uniform.size(),
                                                   " layers' budgets"));
  }
  const size_t num_layers = pooled.size();
  std::vector<int64_t> keep(num_layers), protect(num_layers);
  std::vector<at::Tensor> candidates;  // per layer: the gains of its entries past its floor
  int64_t total = 0, floors = 0;
  for (size_t l = 0; l < num_layers; ++l) {
    const at::Tensor& p = pooled[l];
    if (!p.defined() || p.dim() != 3 || p.size(0) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("adaptive budgets: layer ", l, "'s scores must be [1, Hkv, n]"));
    }
    const int64_t n = p.size(2);
    const int64_t u = std::min(uniform[l], n);
    protect[l] = std::min<int64_t>(n, int64_t{window} + num_sinks);
    const int64_t floor_share = static_cast<int64_t>(std::ceil(kAdaptiveFloorShare * u));
    keep[l] = std::min(n, std::max({protect[l], floor_share, int64_t{1}}));
    total += u;
    floors += keep[l];
    // Shares of each head's unprotected scores; the protected entries count for nothing here.
    at::Tensor s = p[0].to(at::kDouble);  // [Hkv, n]
    if (protect[l] > 0) {
      s = s.clone();
      if (num_sinks > 0) s.narrow(1, 0, std::min<int64_t>(n, num_sinks)).zero_();
      if (window > 0)
        s.narrow(1, n - std::min<int64_t>(n, window), std::min<int64_t>(n, window)).zero_();
    }
    s = s.clamp_min(0);
    s = s / s.sum(1, /*keepdim=*/true).clamp_min(1e-300);
    const at::Tensor gains = std::get<0>(s.sort(1, /*descending=*/true)).sum(0);  // [n]
    const int64_t first = keep[l] - protect[l];  // gains already taken by the floor
    candidates.push_back(gains.narrow(0, first, n - protect[l] - first));
  }
  const int64_t rest = total - floors;
  if (rest < 0) {
    return absl::InvalidArgumentError(absl::StrCat("adaptive budgets: the layers' floors need ",
                                                   floors, " entries, more than the budget ",
                                                   total));
  }
  if (rest == 0) return keep;
  const at::Tensor all = at::cat(candidates);
  const at::Tensor taken = std::get<1>(all.topk(rest)).cpu();  // indices into `all`
  std::vector<int64_t> begin(num_layers + 1, 0);
  for (size_t l = 0; l < num_layers; ++l) begin[l + 1] = begin[l] + candidates[l].size(0);
  const int64_t* idx = taken.data_ptr<int64_t>();
  for (int64_t i = 0; i < rest; ++i) {
    const size_t l = std::upper_bound(begin.begin(), begin.end(), idx[i]) - begin.begin() - 1;
    ++keep[l];
  }
  return keep;
}

}  // namespace dropkv::compression
