// StreamingLLM: the first num_sinks entries and the most recent ones.
#include <memory>

#include "engine/compression/scorer.h"
#include "kernels/scorers.h"

namespace dropkv::compression {
namespace {

class StreamingLlmScorer final : public Scorer {
 public:
  explicit StreamingLlmScorer(const CompressionParams& params)
      : window_(params.window), num_sinks_(params.num_sinks) {}

  absl::StatusOr<at::Tensor> Score(const ScorerInput& in) override {
    return kernels::StreamingLlmScores(in.keys, num_sinks_);
  }

  // The server keeps the last W entries for every method (kvpress does not for this one).
  SelectionRule Selection() const override { return {window_}; }

 private:
  int32_t window_ = 0;
  int32_t num_sinks_ = 0;
};

}  // namespace

std::unique_ptr<Scorer> MakeStreamingLlmScorer(const CompressionParams& params,
                                               const PressModelInfo& /*model*/) {
  return std::make_unique<StreamingLlmScorer>(params);
}

}  // namespace dropkv::compression
