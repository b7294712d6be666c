#include "bench/quality/task_eval.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "bench/quality/fanout.h"
#include "engine/model/config.h"
#include "nlohmann/json.hpp"

namespace dropkv::quality {

absl::StatusOr<std::vector<TaskPrompt>> LoadTaskPrompts(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::vector<TaskPrompt> out;
  std::string line;
  for (int64_t lineno = 1; std::getline(in, line); ++lineno) {
    if (line.empty()) continue;
    try {
      const auto j = nlohmann::json::parse(line);
      TaskPrompt p;
      p.task = j.at("task").get<std::string>();
      p.length = j.at("length").get<int64_t>();
      p.idx = j.at("idx").get<int64_t>();
      p.format = j.at("format").get<std::string>();
      p.input_ids = j.at("input_ids").get<std::vector<int32_t>>();
      p.answers = j.at("answers").get<std::vector<std::string>>();
      p.match = j.at("match").get<std::string>();
      p.max_new_tokens = j.at("max_new_tokens").get<int32_t>();
      out.push_back(std::move(p));
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", lineno, ": ", e.what()));
    }
  }
  return out;
}

namespace {
std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}
}  // namespace

double AnswerScore(const std::string& text, const std::vector<std::string>& answers,
                   const std::string& match) {
  if (answers.empty()) return 0;
  const std::string t = Lower(text);
  int found = 0;
  for (const auto& a : answers) found += t.find(Lower(a)) != std::string::npos ? 1 : 0;
  if (match == "any") return found > 0 ? 1.0 : 0.0;
  return static_cast<double>(found) / static_cast<double>(answers.size());
}

std::vector<int32_t> CutAtEos(const std::vector<int32_t>& ids,
                              const std::vector<int32_t>& eos_ids) {
  auto it = std::find_if(ids.begin(), ids.end(), [&](int32_t t) {
    return std::find(eos_ids.begin(), eos_ids.end(), t) != eos_ids.end();
  });
  return {ids.begin(), it};
}

int64_t BlocksNeeded(const ModelRunner& runner, int64_t prompt_len,
                     const std::vector<CompressionParams>& configs, int32_t max_new_tokens) {
  // The full prefill, one uncompacted copy at a time, and every configuration's cache.
  // (A configuration the plan refuses counts nothing here: its prefill reports why.)
  auto blocks_of = [&](const CompressionParams& c) {
    return compression::BlocksNeeded(c, prompt_len, runner.cache_geometry(), max_new_tokens)
        .value_or(0);
  };
  int64_t blocks = 2 * blocks_of(CompressionParams{});
  for (const auto& c : configs) blocks += blocks_of(c);
  return blocks;
}

absl::StatusOr<std::vector<std::vector<int32_t>>> GreedyUnderEveryPress(
    ModelRunner& runner, const std::vector<int32_t>& prompt,
    const std::vector<CompressionParams>& configs, int32_t max_new_tokens,
    const KvpressOptions& options, std::vector<double>* kept_fraction) {
  const ModelConfig& config = runner.config();
  const compression::PressModelInfo info = compression::PressModelInfoFor(config);
  std::vector<std::unique_ptr<KvSelector>> presses;
  std::vector<int> press_of(configs.size(), -1);  // -1: the full cache
  for (size_t c = 0; c < configs.size(); ++c) {
    if (configs[c].method == ScoreMethod::kNone) continue;
    if (configs[c].chunk_size != 0 && configs[c].chunk_policy != ChunkPolicy::kLastChunk) {
      return absl::InvalidArgumentError(
          "GreedyUnderEveryPress: every_chunk and budget policies need a prefill of their own");
    }
    if (configs[c].scoring_queries == ScoringQueries::kReplay) {
      // Its scores come from a second forward (ModelRunner's replay), not from this prefill's.
      return absl::InvalidArgumentError(
          "GreedyUnderEveryPress: scoring_queries replay needs a prefill of its own");
    }
    auto press = CreateKvpressSelector(configs[c], info, options);
    if (!press.ok()) return press.status();
    press_of[c] = static_cast<int>(presses.size());
    presses.push_back(std::move(*press));
  }
  FanOutSelector fan_out(std::move(presses), info.num_layers);

  // Sequence ids: the full prefill, then one per configuration.
  const SequenceId base = 1'000'000;
  auto release_all = [&] {
    runner.Release(base);
    for (size_t c = 0; c < configs.size(); ++c) runner.Release(base + 1 + c);
  };
  auto logits = runner.PrefillWithSelector(base, prompt, true, &fan_out);
  if (!logits.ok()) return release_all(), logits.status();
  const int32_t first = static_cast<int32_t>(logits->argmax().item<int64_t>());
  std::vector<SequenceId> seqs(configs.size());
  for (size_t c = 0; c < configs.size(); ++c) {
    seqs[c] = base + 1 + c;
    absl::Status s = ForkSequence(runner, base, seqs[c]);
    if (s.ok() && press_of[c] >= 0) s = CompactToSelection(runner, seqs[c], fan_out, press_of[c]);
    if (!s.ok()) return release_all(), s;
  }
  runner.Release(base);
  if (kept_fraction != nullptr) {
    kept_fraction->assign(configs.size(), 1.0);
    for (size_t c = 0; c < configs.size(); ++c) {
      const std::vector<int64_t> stored = runner.CacheInfo(seqs[c]).stored_len_per_layer;
      int64_t kept = 0, seen = 0;
      const bool every_layer = static_cast<int32_t>(stored.size()) == config.num_layers;
      for (int32_t l = 0; l < static_cast<int32_t>(stored.size()); ++l) {
        if (every_layer && config.is_sliding(l)) continue;
        kept += stored[l];
        seen += static_cast<int64_t>(prompt.size());
      }
      if (seen > 0) (*kept_fraction)[c] = static_cast<double>(kept) / static_cast<double>(seen);
    }
  }

  std::vector<std::vector<int32_t>> out(configs.size());
  std::vector<int32_t> next(configs.size(), first);
  for (int32_t step = 0; step < max_new_tokens; ++step) {
    for (size_t c = 0; c < configs.size(); ++c) out[c].push_back(next[c]);
    if (step + 1 == max_new_tokens) break;
    auto l = runner.Decode(seqs, next);
    if (!l.ok()) return release_all(), l.status();
    at::Tensor arg = l->argmax(-1).to(at::kCPU);
    for (size_t c = 0; c < configs.size(); ++c) {
      next[c] = static_cast<int32_t>(arg[static_cast<int64_t>(c)].item<int64_t>());
    }
  }
  release_all();
  return out;
}

MeanSe Summarise(const std::vector<double>& x) {
  MeanSe r;
  const double n = static_cast<double>(x.size());
  if (x.empty()) return r;
  for (double v : x) r.mean += v / n;
  if (x.size() < 2) return r;
  double ss = 0;
  for (double v : x) ss += (v - r.mean) * (v - r.mean);
  r.se = std::sqrt(ss / (n - 1) / n);
  return r;
}

}  // namespace dropkv::quality
