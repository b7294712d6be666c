// From scores to kept indices (algorithms.md section 1 "Selection"): smooth (max / avg pooling,
// torch's max_pool1d / avg_pool1d semantics), protect the observation window and optional sinks
// with rowmax + 1, per-head top-k of a given budget, indices sorted ascending, gather of the kept
// K/V. Works on CPU and CUDA tensors (ATen ops on the tensors' device).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace dropkv::kernels {

enum class PoolType { kPoolTypeNone, kPoolTypeMax, kPoolTypeAvg };

// Which of the positions tied at a row's keep-th largest pooled score t are kept (max pooling
// makes such plateaus common: one high score spreads over `pool_kernel` positions).
enum class TieOrder {
  // CPU: kTorchTopk (bit-exact with the Python references, which call torch.topk on the CPU);
  // CUDA: kLowerPosition (the sort-free kernel; torch's CUDA topk order is unspecified anyway).
  kDeviceDefault,
  kLowerPosition,  // every position > t, then those == t from the lowest position up; -0 == +0
  kTorchTopk,      // at::topk's order on the scores' device, then sorted ascending
};

struct SelectParams {
  TieOrder ties = TieOrder::kDeviceDefault;
  PoolType pool = PoolType::kPoolTypeMax;  // DropKV evaluation path: max; its cache: avg
  int32_t pool_kernel = 11;                // odd; stride 1, padding kernel / 2
  int32_t pool_lookback = 0;               // then max over the entry and the this-many before it
  int32_t window = 8;                      // last `window` positions protected (0 = none)
  int32_t num_sinks = 0;                   // first `num_sinks` positions protected
};

// Pools along the last axis. scores: fp32 [..., n] -> same shape. Avg counts the zero padding
// (torch's count_include_pad=True default, as kvpress and the DropKV reference call it). With
// lookback L > 0 the pooled row y becomes max(y[i - L], ..., y[i]) (positions before 0 ignored).
absl::StatusOr<at::Tensor> PoolScores(const at::Tensor& scores, PoolType pool, int32_t kernel,
                                      int32_t lookback = 0);

// Sets the last `window` and first `num_sinks` entries of each row to rowmax + 1 (in place).
// scores: fp32 [..., n]. Pooling happens before protection, so it cannot spread the protection.
absl::Status ProtectScores(at::Tensor& scores, int32_t window, int32_t num_sinks);

// keep = min(n, max(floor(keep_ratio * n), window, 1)) (uniform budget of the spec).
int64_t KeepCount(int64_t n, double keep_ratio, int32_t window);

// Pool, protect, top-k per row, positions ascending.
//   scores: fp32 [B, Hkv, n] (not modified, finite); keep in [1, n] -> int64 [B, Hkv, keep]
// Ties: SelectParams::ties. CUDA with kLowerPosition: radix select + ordered compaction (no sort,
// no host sync).
absl::StatusOr<at::Tensor> SelectTopK(const at::Tensor& scores, int64_t keep,
                                      const SelectParams& params = {});

// Gathers kept entries per head. x: [B, Hkv, n, D] (or [Hkv, n, D]), idx: int64 [B, Hkv, k]
// (or [Hkv, k]) -> [B, Hkv, k, D] (or [Hkv, k, D]).
absl::StatusOr<at::Tensor> GatherKept(const at::Tensor& x, const at::Tensor& idx);

}  // namespace dropkv::kernels
