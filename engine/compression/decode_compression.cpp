#include "engine/compression/decode_compression.h"

#include <utility>

namespace dropkv::compression {

DecodeCompression::DecodeCompression(std::unique_ptr<KvSelector> press, int32_t margin,
                                     int32_t window)
    : press_(std::move(press)), margin_(margin), window_(window) {}

bool DecodeCompression::Enabled(const CompressionParams& params) {
  return params.method != ScoreMethod::kNone && params.decode_margin > 0;
}

std::vector<bool> DecodeCompression::LayersToCompact(int64_t logical_len,
                                                     std::span<const int64_t> stored) {
  std::vector<bool> due(stored.size(), false);
  if (++num_decoded_ < window_) return due;  // the ring holds fewer than W decode queries
  if (!OverBudget(stored)) return due;
  auto budgets = press_->Budgets(logical_len);
  if (!budgets.ok() || budgets->size() < stored.size()) return due;
  budgets_ = std::move(*budgets);
  if (!OverBudget(stored)) return due;
  for (size_t g = 0; g < stored.size(); ++g) due[g] = stored[g] > budgets_[g];
  return due;
}

bool DecodeCompression::OverBudget(std::span<const int64_t> stored) const {
  if (budgets_.empty()) return true;  // none computed yet
  for (size_t g = 0; g < stored.size(); ++g) {
    if (stored[g] > budgets_[g] + margin_) return true;
  }
  return false;
}

}  // namespace dropkv::compression
