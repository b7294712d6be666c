// The compression hook: compression implements it (press.h), the runner calls it. During prefill,
// after a layer's attention has used the full K/V, the runner asks the selector which tokens each
// KV head keeps; only those are stored in that layer's paged block table. The model layers know
// nothing of it.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace dropkv {

// One layer's prefill state of one sequence. All tensors live on the model's device.
struct LayerKvView {
  int32_t layer_idx = 0;
  int32_t num_layers = 0;
  int64_t logical_len = 0;  // tokens seen so far (= RoPE position of the next token)
  // Queries of the tokens of this forward (the chunk), after RoPE: [Hq, chunk_len, D].
  at::Tensor queries;
  // Every key/value this layer holds now (stored cache + this chunk), keys after RoPE:
  // [Hkv, n, D] each. Position of entry j of head h: positions[h][j].
  at::Tensor keys;
  at::Tensor values;
  at::Tensor positions;  // int64 [Hkv, n]
  bool is_last_chunk = true;
  // Replay scoring (CompressionParams::scoring_queries kReplay): the prompt's chunks (kPrompt)
  // store everything; then the runner feeds the prompt again after itself, a replay chunk at a
  // time on a scratch copy (kReplay: `queries` are the replay chunk's, keys the prompt's
  // `replayed_len` entries followed by the replay chunk's, nothing is stored from the selection),
  // and last asks each layer's selection over the stored prompt (kReplaySelect: no queries).
  enum class Pass { kPrompt, kReplay, kReplaySelect };
  Pass pass = Pass::kPrompt;
  int64_t replayed_len = 0;  // kReplay: the prompt's entries, the first of `keys`
  // Optional, set only when the selector asks for them (KvSelector::num_attention_rows) and the
  // prefill attention produced an LSE (CUDA: cuDNN or FA2): the chunk's last w = min(asked,
  // chunk_len) rows of this layer's attention output, [Hq, w, D] in the model dtype (a view,
  // strided), and their log-sum-exp, fp32 [Hq, w] (natural log of the scaled logits' exp-sum).
  // Row i is the query at logical position logical_len - w + i, which saw all n entries up to
  // itself. Lets DropKV score with K/V read once (kernels::DropKvScoresFromAttention).
  at::Tensor window_attn_out;
  at::Tensor window_lse;
  // Tensor parallelism with fewer KV heads than ranks: this rank's KV heads are copies that other
  // ranks hold too, each scored with its own query heads only. A selector passes its per-entry
  // scores, fp32 [1, Hkv, n], through this before selecting; it makes them the mean over every
  // copy's query heads, the score one rank would give, the same bits on every copy (which then
  // keep the same entries). Empty otherwise.
  std::function<absl::Status(at::Tensor& scores)> reduce_scores;
  // Tensor parallelism: the largest of every rank's `count` (each rank holds other KV heads, and
  // a layer keeps as many entries on every rank). Empty on one rank.
  std::function<absl::StatusOr<int64_t>(int64_t count)> max_over_ranks;
};

class KvSelector {
 public:
  virtual ~KvSelector() = default;
  // Kept entries per KV head: int64 [Hkv, k] (indices into the n entries of `view`), sorted
  // ascending, the same k for every head of the layer; std::nullopt keeps everything.
  virtual absl::StatusOr<std::optional<at::Tensor>> Select(const LayerKvView& view) = 0;
  // How many of the chunk's last attention rows (output + LSE) Select can use; 0 = none, and the
  // runner then slices nothing; kAllAttentionRows = every row of the chunk (H2O sums over all
  // prompt queries). The runner gives min(this, chunk_len) rows.
  static constexpr int64_t kAllAttentionRows = INT64_MAX;
  virtual int64_t num_attention_rows() const { return 0; }
  // The entries each layer (LayerKvView::layer_idx numbering) keeps for a sequence that has seen
  // `logical_len` tokens, as Select would keep them; empty = no budget (everything is kept).
  // Compression during decode asks it to know when a layer has grown past its budget.
  virtual absl::StatusOr<std::vector<int64_t>> Budgets(int64_t logical_len) const {
    return std::vector<int64_t>();
  }
};

}  // namespace dropkv
