// The scorer of each ScoreMethod: a new scorer is its file here, its enum row (params.h), its
// name row and a row below.
#include <array>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/compression/scorer.h"

namespace dropkv::compression {

// Defined each in its scorer's file.
std::unique_ptr<Scorer> MakeDropKvScorer(const CompressionParams& params,
                                         const PressModelInfo& model);
std::unique_ptr<Scorer> MakeSnapKvScorer(const CompressionParams& params,
                                         const PressModelInfo& model);
std::unique_ptr<Scorer> MakeH2oScorer(const CompressionParams& params, const PressModelInfo& model);
std::unique_ptr<Scorer> MakeStreamingLlmScorer(const CompressionParams& params,
                                               const PressModelInfo& model);
std::unique_ptr<Scorer> MakeKNormScorer(const CompressionParams& params,
                                        const PressModelInfo& model);
std::unique_ptr<Scorer> MakeRandomScorer(const CompressionParams& params,
                                         const PressModelInfo& model);

namespace {

using MakeScorer = std::unique_ptr<Scorer> (*)(const CompressionParams&, const PressModelInfo&);

constexpr std::array<std::pair<ScoreMethod, MakeScorer>, 8> kScorers{{
    {ScoreMethod::kDropKV, &MakeDropKvScorer},
    {ScoreMethod::kSnapKV, &MakeSnapKvScorer},
    {ScoreMethod::kH2O, &MakeH2oScorer},
    {ScoreMethod::kH2OVl1, &MakeH2oScorer},
    {ScoreMethod::kH2OVl2, &MakeH2oScorer},
    {ScoreMethod::kStreamingLLM, &MakeStreamingLlmScorer},
    {ScoreMethod::kKNorm, &MakeKNormScorer},
    {ScoreMethod::kRandom, &MakeRandomScorer},
}};

}  // namespace

absl::StatusOr<std::unique_ptr<Scorer>> CreateScorer(const CompressionParams& params,
                                                     const PressModelInfo& model) {
  for (const auto& [method, make] : kScorers) {
    if (method == params.method) return make(params, model);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("no scorer for method ", std::string(ScoreMethodName(params.method))));
}

}  // namespace dropkv::compression
