// K-norm: entries whose keys have the smallest L2 norm score highest.
#include <memory>

#include "engine/compression/scorer.h"
#include "kernels/scorers.h"

namespace dropkv::compression {
namespace {

class KNormScorer final : public Scorer {
 public:
  explicit KNormScorer(const CompressionParams& params) : window_(params.window) {}

  absl::StatusOr<at::Tensor> Score(const ScorerInput& in) override {
    return kernels::KNormScores(in.keys);
  }

  // The server keeps the last W entries for every method (kvpress does not for this one).
  SelectionRule Selection() const override { return {window_}; }

 private:
  int32_t window_ = 0;
};

}  // namespace

std::unique_ptr<Scorer> MakeKNormScorer(const CompressionParams& params,
                                        const PressModelInfo& /*model*/) {
  return std::make_unique<KNormScorer>(params);
}

}  // namespace dropkv::compression
