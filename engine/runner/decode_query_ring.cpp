#include "engine/runner/decode_query_ring.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <exception>

#include "absl/strings/str_cat.h"

namespace dropkv {

absl::Status DecodeQueryRing::Add(int64_t seq, int32_t window) {
  if (window < 1) return absl::InvalidArgumentError("decode query ring: window must be >= 1");
  Remove(seq);
  int64_t base = FindFree(window);
  if (base < 0) {
    const int64_t rows = static_cast<int64_t>(used_.size());
    const absl::Status grown = Grow(std::max({2 * rows, rows + window, int64_t{1} + window}));
    if (!grown.ok()) return grown;
    base = FindFree(window);
  }
  std::fill(used_.begin() + base, used_.begin() + base + window, 1);
  owners_[seq] = {base, window};
  return absl::OkStatus();
}

void DecodeQueryRing::Remove(int64_t seq) {
  auto it = owners_.find(seq);
  if (it == owners_.end()) return;
  std::fill(used_.begin() + it->second.base, used_.begin() + it->second.base + it->second.window,
            0);
  owners_.erase(it);
}

int64_t DecodeQueryRing::RowOf(int64_t seq, int64_t position) const {
  auto it = owners_.find(seq);
  if (it == owners_.end()) return 0;
  return it->second.base + position % it->second.window;
}

at::Tensor DecodeQueryRing::Queries(int64_t seq, int32_t layer_idx, int64_t end) const {
  const Range& r = owners_.at(seq);
  std::vector<int64_t> rows;
  for (int64_t p = end - r.window; p < end; ++p) rows.push_back(r.base + p % r.window);
  const auto index = at::tensor(rows, at::kLong).to(storage_.device(), /*non_blocking=*/true);
  return storage_[layer_idx].index_select(0, index).transpose(0, 1);  // [Hq, W, D]
}

int64_t DecodeQueryRing::FindFree(int32_t window) const {
  int64_t run = 0;
  for (int64_t row = 1; row < static_cast<int64_t>(used_.size()); ++row) {
    run = used_[row] ? 0 : run + 1;
    if (run == window) return row - window + 1;
  }
  return -1;
}

absl::Status DecodeQueryRing::Grow(int64_t min_rows) {
  try {
    at::Tensor grown = at::zeros({num_layers_, min_rows, num_q_heads_, head_dim_}, options_);
    if (storage_.defined()) grown.narrow(1, 0, storage_.size(1)).copy_(storage_);
    storage_ = grown;
  } catch (const std::exception& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("decode query ring of ", min_rows, " rows: ", e.what()));
  }
  used_.resize(min_rows, 0);
  used_[0] = 1;
  ++version_;
  return absl::OkStatus();
}

}  // namespace dropkv
