// DropKV (algorithms.md section 1): the attention of the last W queries, weighted by the values,
// pooled along the entries at selection.
#include <ATen/ATen.h>

#include <algorithm>
#include <memory>

#include "engine/compression/scorer.h"
#include "kernels/dropkv_score.h"

namespace dropkv::compression {
namespace {

class DropKvScorer final : public Scorer {
 public:
  DropKvScorer(const CompressionParams& params, const PressModelInfo& model)
      : params_(params), scale_(model.attention_scale) {}

  // Scores from the prefill attention's window rows when the runner has them (K/V read once).
  int64_t num_attention_rows() const override { return params_.window; }

  absl::StatusOr<at::Tensor> Score(const ScorerInput& in) override {
    const int64_t n = in.keys.size(2);
    const int64_t num_window = std::min<int64_t>({params_.window, in.chunk_len, n});
    const at::Tensor q_window = in.queries.slice(2, in.chunk_len - num_window, in.chunk_len);
    kernels::DropKvParams dp;
    dp.scale = scale_;
    // bf16/fp16 runs round p like the reference (algorithms.md section 1); fp32 does not.
    if (in.queries.scalar_type() == at::kBFloat16 || in.queries.scalar_type() == at::kHalf) {
      dp.p_round_dtype = in.queries.scalar_type();
    }
    // The runner's window rows cover ours when given (it slices min(W, chunk_len) <= n).
    const at::Tensor& attn = in.view.window_attn_out;
    const at::Tensor& lse = in.view.window_lse;
    if (attn.defined() && lse.defined() && attn.size(1) >= num_window) {
      const int64_t skip = attn.size(1) - num_window;
      return kernels::DropKvScoresFromAttention(q_window, in.keys, in.values,
                                                attn.narrow(1, skip, num_window).unsqueeze(0),
                                                lse.narrow(1, skip, num_window).unsqueeze(0), dp);
    }
    return kernels::DropKvScores(q_window, in.keys, in.values, dp);
  }

  SelectionRule Selection() const override {
    return {params_.window, params_.pooling, params_.pooling_kernel};
  }

 private:
  CompressionParams params_;
  double scale_ = 0;
};

}  // namespace

std::unique_ptr<Scorer> MakeDropKvScorer(const CompressionParams& params,
                                         const PressModelInfo& model) {
  return std::make_unique<DropKvScorer>(params, model);
}

}  // namespace dropkv::compression
