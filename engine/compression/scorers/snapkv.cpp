// SnapKV: the last W queries' attention, pooled per head (the window itself lifted to the top).
#include <algorithm>
#include <memory>

#include "engine/compression/scorer.h"
#include "kernels/scorers.h"

namespace dropkv::compression {
namespace {

// kvpress SnapKVPress.kernel_size.
constexpr int32_t kSnapKvPoolKernel = 5;

class SnapKvScorer final : public Scorer {
 public:
  SnapKvScorer(const CompressionParams& params, const PressModelInfo& model)
      : window_(params.window), scale_(model.attention_scale) {}

  absl::StatusOr<at::Tensor> Score(const ScorerInput& in) override {
    const int64_t n = in.keys.size(2);
    const int64_t num_window = std::min<int64_t>({window_, in.chunk_len, n});
    const at::Tensor q_window = in.queries.slice(2, in.chunk_len - num_window, in.chunk_len);
    kernels::SnapKvParams sp;
    sp.pool_kernel = kSnapKvPoolKernel;
    sp.scale = scale_;
    return kernels::SnapKvScores(q_window, in.keys, sp);
  }

  // SnapKvScores already lifted the window; protecting it again is harmless.
  SelectionRule Selection() const override { return {window_}; }

 private:
  int32_t window_ = 0;
  double scale_ = 0;
};

}  // namespace

std::unique_ptr<Scorer> MakeSnapKvScorer(const CompressionParams& params,
                                         const PressModelInfo& model) {
  return std::make_unique<SnapKvScorer>(params, model);
}

}  // namespace dropkv::compression
