// Selection (selection.h): pooling, protection and the gathers are ATen ops on the scores' device;
// the top-k keeps the ties by SelectParams::ties: lower positions (kernels/cuda/select_kernels.cu
// on CUDA: radix select + ordered compaction, no sort, no host sync; the ATen threshold + mask
// below on the CPU) or at::topk's order (then sorted).
#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/check.h"
#include "kernels/selection.h"

namespace dropkv::kernels {
#ifdef DROPKV_CUDA_ENABLED
namespace cuda {
// kernels/cuda/select_kernels.cu: CUDA fp32 [rows, n] contiguous -> int64 [rows, keep] ascending.
absl::StatusOr<at::Tensor> SelectKeptAscending(const at::Tensor& scores, int64_t keep);
}  // namespace cuda
#endif

using internal::CatchTorch;

namespace {

// The top-k with selection.h's tie rule in ATen ops (the CPU path; nonzero syncs on CUDA): the k-th
// largest value t of each row (topk's values), then every score > t and the first (keep - count(>
// t)) scores == t in ascending position. Each row keeps exactly `keep`, so nonzero's row-major
// order reshapes to [rows, keep] ascending.
at::Tensor SelectKeptAscendingAten(const at::Tensor& scores, int64_t keep) {
  auto kth = std::get<0>(at::topk(scores, keep, -1, /*largest=*/true, /*sorted=*/false))
                 .amin(-1, /*keepdim=*/true);
  auto above = scores > kth, equal = scores == kth;
  auto ties_taken = keep - above.sum(-1, /*keepdim=*/true);
  auto kept = above.logical_or(equal.logical_and(equal.cumsum(-1) <= ties_taken));
  return at::nonzero(kept).select(1, 1).reshape({scores.size(0), keep}).contiguous();
}

}  // namespace

absl::StatusOr<at::Tensor> PoolScores(const at::Tensor& scores, PoolType pool, int32_t kernel,
                                      int32_t lookback) {
  if (!scores.defined() || scores.dim() < 1) {
    return absl::InvalidArgumentError("scores: expected a [..., n] tensor");
  }
  if (lookback < 0) {
    return absl::InvalidArgumentError(absl::StrCat("pool_lookback must be >= 0, got ", lookback));
  }
  const bool symmetric = pool != PoolType::kPoolTypeNone && kernel != 1;
  if (!symmetric && lookback == 0) return scores.clone();
  if (symmetric && (kernel < 1 || kernel % 2 == 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool_kernel must be odd and >= 1, got ", kernel));
  }
  return CatchTorch("PoolScores", [&]() -> absl::StatusOr<at::Tensor> {
    const int64_t n = scores.size(-1);
    at::Tensor y = scores.reshape({-1, 1, n});  // [rows, 1, n]
    // torch pools reject padding > kernel/2 only; n < kernel/2 is fine with padding.
    if (symmetric) {
      y = pool == PoolType::kPoolTypeMax
              ? at::max_pool1d(y, {kernel}, {1}, {kernel / 2})
              : at::avg_pool1d(y, {kernel}, {1}, {kernel / 2}, /*ceil_mode=*/false,
                               /*count_include_pad=*/true);
    }
    if (lookback > 0) {  // one-sided: -inf on the left only, so position i sees [i - L, i]
      y = at::max_pool1d(
          at::constant_pad_nd(y, {lookback, 0}, -std::numeric_limits<float>::infinity()),
          {lookback + 1}, {1});
    }
    return y.reshape(scores.sizes());
  });
}

absl::Status ProtectScores(at::Tensor& scores, int32_t window, int32_t num_sinks) {
  if (!scores.defined() || scores.dim() < 1) {
    return absl::InvalidArgumentError("scores: expected a [..., n] tensor");
  }
  if (window < 0 || num_sinks < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("window and num_sinks must be >= 0, got ", window, ", ", num_sinks));
  }
  return CatchTorch("ProtectScores", [&]() -> absl::Status {
    const int64_t n = scores.size(-1);
    if (n == 0) return absl::OkStatus();
    auto top = std::get<0>(scores.max(-1, /*keepdim=*/true)) + 1.0;  // [..., 1]
    const int64_t w = std::min<int64_t>(window, n), s = std::min<int64_t>(num_sinks, n);
    if (w > 0) scores.slice(-1, n - w, n).copy_(top.expand_as(scores.slice(-1, n - w, n)));
    if (s > 0) scores.slice(-1, 0, s).copy_(top.expand_as(scores.slice(-1, 0, s)));
    return absl::OkStatus();
  });
}

int64_t KeepCount(int64_t n, double keep_ratio, int32_t window) {
  const auto by_ratio = static_cast<int64_t>(std::floor(keep_ratio * static_cast<double>(n)));
  return std::min<int64_t>(n, std::max<int64_t>({by_ratio, window, 1}));
}

absl::StatusOr<at::Tensor> SelectTopK(const at::Tensor& scores, int64_t keep,
                                      const SelectParams& params) {
  if (!scores.defined() || scores.dim() != 3) {
    return absl::InvalidArgumentError("scores: expected [B, Hkv, n]");
  }
  const int64_t n = scores.size(2);
  if (keep < 1 || keep > n) {
    return absl::InvalidArgumentError(absl::StrCat("keep must be in [1, ", n, "], got ", keep));
  }
  auto pooled =
      PoolScores(scores.to(at::kFloat), params.pool, params.pool_kernel, params.pool_lookback);
  if (!pooled.ok()) return pooled.status();
  if (auto s = ProtectScores(*pooled, params.window, params.num_sinks); !s.ok()) return s;
  auto rows = CatchTorch("SelectTopK", [&]() -> absl::StatusOr<at::Tensor> {
    return pooled->reshape({-1, n}).contiguous();
  });
  if (!rows.ok()) return rows.status();
  TieOrder ties = params.ties;
  if (ties == TieOrder::kDeviceDefault)
    ties = rows->is_cuda() ? TieOrder::kLowerPosition : TieOrder::kTorchTopk;
  absl::StatusOr<at::Tensor> idx;
#ifdef DROPKV_CUDA_ENABLED
  // The kernel's grid holds up to 65535 rows and int32 positions; beyond, the ATen path below
  // (same rule; its nonzero syncs with the host).
  if (ties == TieOrder::kLowerPosition && rows->is_cuda() && rows->size(0) <= 65535 &&
      n <= std::numeric_limits<int32_t>::max() / 2) {
    idx = cuda::SelectKeptAscending(*rows, keep);
  } else
#endif
  {
    idx = CatchTorch("SelectTopK", [&]() -> absl::StatusOr<at::Tensor> {
      if (ties == TieOrder::kLowerPosition) return SelectKeptAscendingAten(*rows, keep);
      auto top = std::get<1>(at::topk(*rows, keep, -1, /*largest=*/true, /*sorted=*/false));
      return std::get<0>(top.sort(-1));
    });
  }
  if (!idx.ok()) return idx.status();
  return idx->view({scores.size(0), scores.size(1), keep});
}

absl::StatusOr<at::Tensor> GatherKept(const at::Tensor& x, const at::Tensor& idx) {
  if (!x.defined() || !idx.defined() || x.dim() != idx.dim() + 1 || x.dim() < 3) {
    return absl::InvalidArgumentError(
        "GatherKept: x must be [..., Hkv, n, D] and idx [..., Hkv, k] with the same leading dims");
  }
  if (idx.scalar_type() != at::kLong) {
    return absl::InvalidArgumentError("GatherKept: idx must be int64");
  }
  for (int64_t i = 0; i + 1 < idx.dim(); ++i) {
    if (x.size(i) != idx.size(i)) {
      return absl::InvalidArgumentError(
          absl::StrCat("GatherKept: dim ", i, " of x is ", x.size(i), " but of idx ", idx.size(i)));
    }
  }
  return CatchTorch("GatherKept", [&]() -> absl::StatusOr<at::Tensor> {
    std::vector<int64_t> sizes(idx.sizes().begin(), idx.sizes().end());
    sizes.push_back(x.size(-1));
    return at::gather(x, -2, idx.unsqueeze(-1).expand(sizes));
  });
}

}  // namespace dropkv::kernels
