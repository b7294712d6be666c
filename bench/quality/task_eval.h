// Long-context task evaluation: the prompts of bench/quality/tasks.py run through our
// engine, one prefill per prompt feeding every press (fanout.h), each followed by its own greedy
// decode; scored by the answer strings in the output, as RULER does. Used by
// dropkv-quality-tasks and tests/quality.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "bench/quality/kvpress_scorers.h"
#include "engine/compression/press.h"
#include "engine/request.h"
#include "engine/runner/model_runner.h"

namespace dropkv::quality {

// One line of tasks.py's output.
struct TaskPrompt {
  std::string task;
  int64_t length = 0;  // the target length (the prompt has at most this many tokens)
  int64_t idx = 0;
  std::string format;  // "raw" or "chat"
  std::vector<int32_t> input_ids;
  std::vector<std::string> answers;
  std::string match;  // "all": fraction of the answers found; "any": 1 if one is found
  int32_t max_new_tokens = 0;
};

absl::StatusOr<std::vector<TaskPrompt>> LoadTaskPrompts(const std::string& path);

// RULER's string match, case-insensitive: `all` = the fraction of `answers` found in `text`,
// `any` = 1 when one of them is.
double AnswerScore(const std::string& text, const std::vector<std::string>& answers,
                   const std::string& match);

// The greedy continuation (max_new_tokens ids, the first from the prefill logits) of `prompt`
// under each of `configs` (method kNone = the full cache), from one prefill: every press selects
// from the same layer views, and each compressed copy of the full cache decodes on its own (all
// copies as one batch). Configurations must use a single pass or the last_chunk policy (anything
// else is INVALID_ARGUMENT: those policies need their own prefill). Cuts nothing at EOS.
// `kept_fraction` (optional): each configuration's entries kept over those seen, over its global
// layers after the prefill (1 for the full cache).
absl::StatusOr<std::vector<std::vector<int32_t>>> GreedyUnderEveryPress(
    ModelRunner& runner, const std::vector<int32_t>& prompt,
    const std::vector<CompressionParams>& configs, int32_t max_new_tokens,
    const KvpressOptions& options = {}, std::vector<double>* kept_fraction = nullptr);

// `ids` up to (not including) the first of `eos_ids`.
std::vector<int32_t> CutAtEos(const std::vector<int32_t>& ids, const std::vector<int32_t>& eos_ids);

// Pool blocks GreedyUnderEveryPress needs for a prompt of `prompt_len` tokens under `configs`.
int64_t BlocksNeeded(const ModelRunner& runner, int64_t prompt_len,
                     const std::vector<CompressionParams>& configs, int32_t max_new_tokens);

struct MeanSe {
  double mean = 0, se = 0;
};
// Mean and standard error of the mean (sample standard deviation / sqrt(n)).
MeanSe Summarise(const std::vector<double>& x);

}  // namespace dropkv::quality
