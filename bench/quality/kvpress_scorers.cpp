#include "bench/quality/kvpress_scorers.h"

#include <ATen/ATen.h>

#include <utility>

#include "absl/status/status.h"

namespace dropkv::quality {
namespace {

using compression::Scorer;
using compression::ScorerInput;
using compression::SelectionRule;

// Forwards every call to the scorer it wraps.
class WrappedScorer : public Scorer {
 public:
  explicit WrappedScorer(std::unique_ptr<Scorer> inner) : inner_(std::move(inner)) {}
  int64_t num_attention_rows() const override { return inner_->num_attention_rows(); }
  absl::Status Observe(const ScorerInput& in) override { return inner_->Observe(in); }
  absl::StatusOr<at::Tensor> Score(const ScorerInput& in) override { return inner_->Score(in); }
  void Kept(int32_t layer_idx, const at::Tensor& kept) override { inner_->Kept(layer_idx, kept); }
  SelectionRule Selection() const override { return inner_->Selection(); }

 protected:
  std::unique_ptr<Scorer> inner_;
};

// `inner` is plain H2O (raw sums); the value-norm weighting comes after the division, as in
// kvpress.
class ObservedAttentionScorer final : public WrappedScorer {
 public:
  ObservedAttentionScorer(std::unique_ptr<Scorer> inner, ScoreMethod method)
      : WrappedScorer(std::move(inner)), method_(method) {}

  absl::StatusOr<at::Tensor> Score(const ScorerInput& in) override {
    absl::StatusOr<at::Tensor> s = inner_->Score(in);
    if (!s.ok()) return s;
    // Queries that saw entry j: every prompt position >= its position.
    at::Tensor count = (in.view.logical_len - in.view.positions).clamp_min(1).to(at::kFloat);
    s->div_(count.unsqueeze(0));
    if (method_ != ScoreMethod::kH2O) {
      const int p = method_ == ScoreMethod::kH2OVl1 ? 1 : 2;
      s->mul_(at::linalg_vector_norm(in.values.to(at::kFloat), p, {-1}));
    }
    return s;
  }

 private:
  ScoreMethod method_;
};

class NoWindowScorer final : public WrappedScorer {
 public:
  using WrappedScorer::WrappedScorer;
  SelectionRule Selection() const override {
    SelectionRule rule = inner_->Selection();
    rule.window = 0;
    return rule;
  }
};

bool IsH2o(ScoreMethod m) {
  return m == ScoreMethod::kH2O || m == ScoreMethod::kH2OVl1 || m == ScoreMethod::kH2OVl2;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Scorer>> MakeObservedAttentionScorer(
    const CompressionParams& params, const compression::PressModelInfo& model) {
  if (!IsH2o(params.method)) {
    return absl::InvalidArgumentError("MakeObservedAttentionScorer: not an H2O method");
  }
  CompressionParams raw = params;
  raw.method = ScoreMethod::kH2O;
  absl::StatusOr<std::unique_ptr<Scorer>> inner = compression::CreateScorer(raw, model);
  if (!inner.ok()) return inner.status();
  return std::make_unique<ObservedAttentionScorer>(std::move(*inner), params.method);
}

absl::StatusOr<std::unique_ptr<KvSelector>> CreateKvpressSelector(
    const CompressionParams& params, const compression::PressModelInfo& model,
    const KvpressOptions& options) {
  const bool observed = options.h2o_divide_by_num_queries && IsH2o(params.method);
  const bool no_window = !options.protect_window_all_methods &&
                         params.method != ScoreMethod::kDropKV &&
                         params.method != ScoreMethod::kSnapKV;
  if (params.method == ScoreMethod::kNone ||
      (!observed && !no_window && options.rounding == compression::BudgetRounding::kExactGlobal)) {
    return compression::CreateKvSelector(params, model);
  }
  absl::StatusOr<std::unique_ptr<Scorer>> scorer = observed
                                                       ? MakeObservedAttentionScorer(params, model)
                                                       : compression::CreateScorer(params, model);
  if (!scorer.ok()) return scorer.status();
  if (no_window) *scorer = std::make_unique<NoWindowScorer>(std::move(*scorer));
  return compression::CreateKvSelectorWithScorer(params, model, std::move(*scorer),
                                                 options.rounding);
}

}  // namespace dropkv::quality
