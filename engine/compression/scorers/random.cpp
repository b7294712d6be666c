// Random scores: the baseline every scorer should beat.
#include <cstdint>
#include <memory>

#include "engine/compression/scorer.h"
#include "kernels/scorers.h"

namespace dropkv::compression {
namespace {

class RandomScorer final : public Scorer {
 public:
  explicit RandomScorer(const CompressionParams& params)
      : window_(params.window), seed_(params.random_seed) {}

  absl::StatusOr<at::Tensor> Score(const ScorerInput& in) override {
    // Reproducible per (seed, layer, tokens seen).
    return kernels::RandomScores(in.keys, seed_ * 1000003ULL +
                                              static_cast<uint64_t>(in.view.layer_idx) * 7919ULL +
                                              static_cast<uint64_t>(in.view.logical_len));
  }

  // The server keeps the last W entries for every method (kvpress does not for this one).
  SelectionRule Selection() const override { return {window_}; }

 private:
  int32_t window_ = 0;
  uint64_t seed_ = 0;
};

}  // namespace

std::unique_ptr<Scorer> MakeRandomScorer(const CompressionParams& params,
                                         const PressModelInfo& /*model*/) {
  return std::make_unique<RandomScorer>(params);
}

}  // namespace dropkv::compression
