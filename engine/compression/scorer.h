// A scorer rates every cached entry of a layer; the press (press.h) turns the ratings into a
// selection: budgets, rounding, chunk policy, sinks and top-k are the press's. The shape of
// kvpress's ScorerPress. One scorer per press, so per sequence: a scorer may keep per-layer state
// across prefill chunks (H2O's accumulated attention). Each method's scorer is one file in
// scorers/, created by CreateScorer through the table in scorers/registry.cpp.
#pragma once

#include <cstdint>
#include <memory>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/compression/kv_selector.h"
#include "engine/compression/params.h"

namespace dropkv::compression {

// The model geometry a press needs (a subset of the model config).
struct PressModelInfo {
  int32_t num_layers = 0;  // the layers the press compresses (a model's global layers)
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  double attention_scale = 0;  // softmax scale of the logits the scorers rebuild (0 = 1/sqrt(D))
};

// One layer's call, as the scorers read it: the view and batched views of its tensors.
struct ScorerInput {
  const LayerKvView& view;
  at::Tensor queries;  // [1, Hq, chunk_len, D]
  at::Tensor keys;     // [1, Hkv, n, D]
  at::Tensor values;   // [1, Hkv, n, D]
  int64_t chunk_len = 0;
};

// What selection does with a scorer's scores besides top-k: the last `window` entries are kept
// whatever their score; `pooling` smooths the scores along the entries first.
struct SelectionRule {
  int32_t window = 0;
  PoolingType pooling = PoolingType::kNone;
  int32_t pooling_kernel = 1;    // odd; used only with pooling
  int32_t pooling_lookback = 0;  // the entries before one whose pooled score it also takes
};

class Scorer {
 public:
  virtual ~Scorer() = default;
  // How many of the chunk's last attention rows (output + LSE) the scorer can use
  // (KvSelector::num_attention_rows).
  virtual int64_t num_attention_rows() const { return 0; }
  // Every call of a layer, compressing or not, before Score: state that sums over chunks.
  virtual absl::Status Observe(const ScorerInput& /*in*/) { return absl::OkStatus(); }
  // Per-entry scores, fp32 [1, Hkv, n], higher = keep. Only on calls that compress.
  virtual absl::StatusOr<at::Tensor> Score(const ScorerInput& in) = 0;
  // The entries a layer kept after Score (int64 [Hkv, k], ascending): state that follows the cache.
  virtual void Kept(int32_t /*layer_idx*/, const at::Tensor& /*kept*/) {}
  // Replay scoring: the scores of the first `num_entries` entries (the prompt's) by every query of
  // a replay chunk (in.view.pass kReplay), fp32 [1, Hkv, num_entries]; the press sums them over
  // the replay chunks. Only scorers that can score by any queries have it.
  virtual absl::StatusOr<at::Tensor> ReplayScore(const ScorerInput& /*in*/,
                                                 int64_t /*num_entries*/) {
    return absl::UnimplementedError("this scorer has no replay scoring");
  }
  virtual SelectionRule Selection() const = 0;
  // What an automatic budget (CompressionParams::tolerance) measures removals against: the
  // squared norm of the window queries' attention outputs, in the score's units (summed over the
  // window, averaged over each KV head's query heads), fp32 [1, Hkv]. Only scorers whose score is
  // a squared output shift have one.
  virtual absl::StatusOr<at::Tensor> OutputEnergy(const ScorerInput& /*in*/) {
    return absl::UnimplementedError("this scorer's scores are not output shifts");
  }
};

// The scorer of params.method (INVALID_ARGUMENT for kNone, which scores nothing). `params` and
// `model` are assumed valid (CreateKvSelector checks them first).
absl::StatusOr<std::unique_ptr<Scorer>> CreateScorer(const CompressionParams& params,
                                                     const PressModelInfo& model);

}  // namespace dropkv::compression
