// H2O (heavy hitters): every prompt query's attention summed per entry, over all chunks; the
// VL1 / VL2 variants weight the sums by each value's L1 / L2 norm.
#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "engine/compression/scorer.h"
#include "kernels/scorers.h"

namespace dropkv::compression {
namespace {

class H2oScorer final : public Scorer {
 public:
  H2oScorer(const CompressionParams& params, const PressModelInfo& model)
      : method_(params.method),
        window_(params.window),
        scale_(model.attention_scale),
        layers_(std::max(model.num_layers, 0)) {}

  // The LSE of every chunk row (kernels::H2oScoresFromLse; the output rows are a free view).
  int64_t num_attention_rows() const override { return KvSelector::kAllAttentionRows; }

  // Accumulates every chunk's attention, compressing or not (H2O sums over all prompt queries).
  absl::Status Observe(const ScorerInput& in) override {
    const LayerKvView& v = in.view;
    const int64_t n = in.keys.size(2);
    kernels::H2oParams hp;  // raw sums; normalisation and V norm are applied at selection
    hp.scale = scale_;
    // With every chunk row's LSE from the prefill attention, the column sums need no softmax
    // (and on CUDA no [rows, n] block).
    const bool have_lse = v.window_lse.defined() && v.window_lse.size(1) == in.chunk_len;
    absl::StatusOr<at::Tensor> s = have_lse
                                       ? kernels::H2oScoresFromLse(in.queries, in.keys, in.values,
                                                                   v.window_lse.unsqueeze(0), hp)
                                       : kernels::H2oScores(in.queries, in.keys, in.values, hp);
    if (!s.ok()) return s.status();
    at::Tensor chunk_sum = (*s)[0];  // [Hkv, n]
    const int64_t n_prev = n - in.chunk_len;
    const int64_t chunk_start = v.logical_len - in.chunk_len;
    LayerState& state = layers_[v.layer_idx];
    const at::Tensor base = Base(state, chunk_start, n_prev);  // [Hkv, n_prev] or undefined
    if (base.defined()) chunk_sum.slice(1, 0, n_prev).add_(base);
    state.staged = {chunk_sum, chunk_start, v.logical_len};
    return absl::OkStatus();
  }

  absl::StatusOr<at::Tensor> Score(const ScorerInput& in) override {
    at::Tensor s = layers_[in.view.layer_idx].staged.sum.unsqueeze(0).clone();  // [1, Hkv, n]
    if (method_ != ScoreMethod::kH2O) {
      const int p = method_ == ScoreMethod::kH2OVl1 ? 1 : 2;
      s.mul_(at::linalg_vector_norm(in.values.to(at::kFloat), p, {-1}));
    }
    return s;
  }

  void Kept(int32_t layer_idx, const at::Tensor& kept) override {
    H2oSums& staged = layers_[layer_idx].staged;
    if (staged.sum.defined()) staged.sum = staged.sum.gather(1, kept);
  }

  // The server keeps the last W entries for every method (kvpress does not for this one).
  SelectionRule Selection() const override { return {window_}; }

 private:
  // The attention mass per stored entry, kept transactionally: a chunk whose prefill fails
  // (RESOURCE_EXHAUSTED: the runner restores the cache and the scheduler replays the chunk later)
  // must not leave its column sums behind. The runner gives no commit call, so a chunk's sums are
  // staged under its logical range [start, end) and committed when the next chunk starts at
  // `end`; a chunk that starts at the staged `start` again is a replay and replaces them.
  struct H2oSums {
    at::Tensor sum;     // fp32 [Hkv, n_stored]: raw sums over every query of [0, end)
    int64_t start = 0;  // logical range of the chunk that produced `sum`
    int64_t end = 0;
  };
  struct LayerState {
    H2oSums committed;  // the cache as stored after the last chunk known to have succeeded
    H2oSums staged;     // the latest chunk, not yet known to have been stored
  };

  // The sums over the stored entries as of logical position `chunk_start` (commits or drops the
  // staged chunk first). Undefined when there is nothing to add to (first chunk, or a history that
  // does not match the runner's cache: the sums then restart from this chunk).
  static at::Tensor Base(LayerState& state, int64_t chunk_start, int64_t n_prev) {
    if (state.staged.sum.defined()) {
      if (state.staged.end == chunk_start) {
        state.committed = std::move(state.staged);  // the next chunk began: the staged one stuck
      }
      state.staged = {};  // committed, or a replay / stale chunk: dropped either way
    }
    const H2oSums& c = state.committed;
    if (c.sum.defined() && c.end == chunk_start && c.sum.size(1) == n_prev) return c.sum;
    return {};
  }

  ScoreMethod method_;
  int32_t window_ = 0;
  double scale_ = 0;
  std::vector<LayerState> layers_;
};

}  // namespace

std::unique_ptr<Scorer> MakeH2oScorer(const CompressionParams& params,
                                      const PressModelInfo& model) {
  return std::make_unique<H2oScorer>(params, model);
}

}  // namespace dropkv::compression
