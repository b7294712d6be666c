// The queries of the last W decode steps of each sequence that compresses during decode
// (CompressionParams::decode_margin), every layer, for its press to score the cache with.
//
// One tensor [num_layers, rows, Hq, D] in the model dtype. Row 0 is scratch: padding rows and rows
// of sequences without a ring write there. A sequence owns W consecutive rows; its query at
// position p goes to row base + p % W. The decode step writes its rows itself (an index_copy_ per
// layer inside the step, and so inside its CUDA graph), so the tensor must not move under a
// captured graph: it moves only when it grows, and version() then changes.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"

namespace dropkv {

class DecodeQueryRing {
 public:
  DecodeQueryRing(int64_t num_layers, int64_t num_q_heads, int64_t head_dim,
                  at::TensorOptions options)
      : num_layers_(num_layers),
        num_q_heads_(num_q_heads),
        head_dim_(head_dim),
        options_(options) {}

  // Reserves `window` rows for `seq` (its earlier rows, if any, are given back first).
  // RESOURCE_EXHAUSTED when the device cannot hold a larger ring.
  absl::Status Add(int64_t seq, int32_t window);
  void Remove(int64_t seq);
  bool Has(int64_t seq) const { return owners_.contains(seq); }
  bool empty() const { return owners_.empty(); }

  // The row the query of `seq` at `position` goes to; 0 (scratch) for a sequence without rows.
  int64_t RowOf(int64_t seq, int64_t position) const;
  // The queries of layer `layer_idx` at positions [end - W, end), oldest first: [Hq, W, D].
  at::Tensor Queries(int64_t seq, int32_t layer_idx, int64_t end) const;

  // [num_layers, rows, Hq, D]; undefined until the first Add.
  const at::Tensor& storage() const { return storage_; }
  // Changes whenever storage() moves (graphs that write into the old one must be captured again).
  int64_t version() const { return version_; }

 private:
  struct Range {
    int64_t base = 0;
    int32_t window = 0;
  };
  // First row of `window` free consecutive rows, or -1.
  int64_t FindFree(int32_t window) const;
  absl::Status Grow(int64_t min_rows);

  int64_t num_layers_, num_q_heads_, head_dim_;
  at::TensorOptions options_;
  std::unordered_map<int64_t, Range> owners_;
  std::vector<uint8_t> used_;  // per row; row 0 (scratch) always used
  at::Tensor storage_;
  int64_t version_ = 0;
};

}  // namespace dropkv
