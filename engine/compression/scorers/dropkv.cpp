// DropKV (algorithms.md section 1): the attention of the last W queries, weighted by the values,
// pooled along the entries at selection.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
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
    const kernels::DropKvParams dp = KernelParams(in);
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

  // Every replay query is a window row: in groups of the kernel's largest window, each group
  // seeing the prompt and the replay up to its last row (causal), their scores of the prompt's
  // entries summed.
  absl::StatusOr<at::Tensor> ReplayScore(const ScorerInput& in, int64_t num_entries) override {
    constexpr int64_t kRowsPerCall = 64;  // the CUDA kernels' largest W
    const int64_t prompt_end = in.keys.size(2) - in.chunk_len;
    if (num_entries > prompt_end) {
      return absl::InvalidArgumentError("replay scoring: more prompt entries than keys");
    }
    const kernels::DropKvParams dp = KernelParams(in);
    at::Tensor sum;
    for (int64_t begin = 0; begin < in.chunk_len; begin += kRowsPerCall) {
      const int64_t end = std::min(begin + kRowsPerCall, in.chunk_len);
      const int64_t seen = prompt_end + end;
      absl::StatusOr<at::Tensor> part =
          kernels::DropKvScores(in.queries.slice(2, begin, end), in.keys.narrow(2, 0, seen),
                                in.values.narrow(2, 0, seen), dp);
      if (!part.ok()) return part.status();
      at::Tensor prompt_part = part->narrow(2, 0, num_entries);
      sum = sum.defined() ? sum.add_(prompt_part) : prompt_part.clone();
    }
    return sum;
  }

  // sum_t ||a_t||^2 over the window rows, the mean over each KV head's g query heads: the
  // score's own normalisation (algorithms.md section 1), so that removed score / energy is the
  // squared relative output shift.
  absl::StatusOr<at::Tensor> OutputEnergy(const ScorerInput& in) override {
    const int64_t n = in.keys.size(2), hkv = in.keys.size(1), hq = in.queries.size(1);
    const int64_t num_window = std::min<int64_t>({params_.window, in.chunk_len, n});
    at::Tensor out;  // [Hq, w, D]
    const at::Tensor& attn = in.view.window_attn_out;
    if (attn.defined() && attn.size(1) >= num_window) {
      out = attn.narrow(1, attn.size(1) - num_window, num_window).to(at::kFloat);
    } else {
      // The window rows' attention, rebuilt: row i sits at entry n - w + i and sees entries <= it.
      const at::Tensor q = in.queries[0]
                               .slice(1, in.chunk_len - num_window, in.chunk_len)
                               .to(at::kFloat)
                               .reshape({hkv, hq / hkv, num_window, -1});
      const at::Tensor k = in.keys[0].to(at::kFloat).unsqueeze(1);  // [Hkv, 1, n, D]
      const at::Tensor v = in.values[0].to(at::kFloat).unsqueeze(1);
      const double scale = scale_ > 0 ? scale_ : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
      at::Tensor logits = at::matmul(q, k.transpose(-1, -2)) * scale;  // [Hkv, g, w, n]
      const at::Tensor row = at::arange(num_window, logits.options().dtype(at::kLong));
      const at::Tensor col = at::arange(n, logits.options().dtype(at::kLong));
      const at::Tensor future = col.unsqueeze(0) > (row + (n - num_window)).unsqueeze(1);
      logits = logits.masked_fill(future, -std::numeric_limits<float>::infinity());
      out = at::matmul(at::softmax(logits, -1), v).reshape({hq, num_window, -1});
    }
    return out.pow(2).sum({1, 2}).reshape({1, hkv, hq / hkv}).mean(2);
  }

  SelectionRule Selection() const override {
    return {params_.window, params_.pooling, params_.pooling_kernel, params_.pooling_lookback};
  }

 private:
  kernels::DropKvParams KernelParams(const ScorerInput& in) const {
    kernels::DropKvParams dp;
    dp.scale = scale_;
    // bf16/fp16 runs round p like the reference (algorithms.md section 1); fp32 does not.
    if (in.queries.scalar_type() == at::kBFloat16 || in.queries.scalar_type() == at::kHalf) {
      dp.p_round_dtype = in.queries.scalar_type();
    }
    return dp;
  }

  CompressionParams params_;
  double scale_ = 0;
};

}  // namespace

std::unique_ptr<Scorer> MakeDropKvScorer(const CompressionParams& params,
                                         const PressModelInfo& model) {
  return std::make_unique<DropKvScorer>(params, model);
}

}  // namespace dropkv::compression
