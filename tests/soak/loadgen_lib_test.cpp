// bench/loadgen/loadgen.h: the pure parts of dropkv-loadgen (percentiles, length specs, loopback
// check, compression specs, Markdown/JSON shape, multi-turn prompt growth). Percentiles are checked
// against a brute-force restatement of the nearest-rank definition on random samples.
#include "bench/loadgen/loadgen.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

namespace dropkv::loadgen {
namespace {

// Nearest rank, by definition: the smallest sample value v with #{x <= v} >= q * n.
double BruteForceRank(const std::vector<double>& xs, double q) {
  double best = INFINITY;
  for (double v : xs) {
    const auto at_or_below = std::count_if(xs.begin(), xs.end(), [&](double x) { return x <= v; });
    if (static_cast<double>(at_or_below) >= q * static_cast<double>(xs.size()) - 1e-9)
      best = std::min(best, v);
  }
  return best;
}

TEST(LoadgenSummarize, MatchesNearestRankDefinition) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 300);
    std::vector<double> xs;
    std::lognormal_distribution<double> dist(3.0, 1.0);
    for (int i = 0; i < n; ++i) xs.push_back(trial % 3 == 0 ? std::round(dist(rng)) : dist(rng));
    const Percentiles p = Summarize(xs);
    EXPECT_EQ(p.count, n);
    EXPECT_DOUBLE_EQ(p.p50, BruteForceRank(xs, 0.50)) << "n=" << n;
    EXPECT_DOUBLE_EQ(p.p90, BruteForceRank(xs, 0.90)) << "n=" << n;
    EXPECT_DOUBLE_EQ(p.p99, BruteForceRank(xs, 0.99)) << "n=" << n;
    EXPECT_DOUBLE_EQ(p.max, *std::max_element(xs.begin(), xs.end()));
    double sum = 0;
    for (double x : xs) sum += x;
    EXPECT_NEAR(p.mean, sum / n, 1e-9 * std::abs(sum));
  }
  EXPECT_EQ(Summarize({}).count, 0);
}

TEST(LoadgenLengths, FixedUniformAndFile) {
  std::mt19937_64 rng(1);
  auto fixed = ParseLengthDist("fixed:17", "--prompt-len");
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  EXPECT_EQ(fixed->Sample(rng), 17);
  auto bare = ParseLengthDist("9", "--prompt-len");
  ASSERT_TRUE(bare.ok());
  EXPECT_EQ(bare->Sample(rng), 9);
  auto uni = ParseLengthDist("uniform:3:6", "--output-len");
  ASSERT_TRUE(uni.ok()) << uni.status();
  std::vector<int> seen(8, 0);
  for (int i = 0; i < 2000; ++i) {
    const int64_t v = uni->Sample(rng);
    ASSERT_GE(v, 3);
    ASSERT_LE(v, 6);
    ++seen[v];
  }
  for (int v = 3; v <= 6; ++v) EXPECT_GT(seen[v], 300) << v;  // ~500 each
  EXPECT_EQ(uni->Max(), 6);

  const auto path = std::filesystem::temp_directory_path() / "dropkv_loadgen_lengths.txt";
  std::ofstream(path) << "# lengths\n5\n\n 40 \n";
  auto file = ParseLengthDist("file:" + path.string(), "--prompt-len");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->values, (std::vector<int64_t>{5, 40}));
  std::ofstream(path) << "5\nlots\n";
  auto bad_file = ParseLengthDist("file:" + path.string(), "--prompt-len");
  ASSERT_FALSE(bad_file.ok());
  EXPECT_NE(bad_file.status().message().find(":2:"), std::string::npos) << bad_file.status();
  std::filesystem::remove(path);
}

TEST(LoadgenLengths, BadSpecsNameTheFlag) {
  for (const char* spec : {"fixed:0", "fixed:x", "uniform:5:2", "uniform:1", "poisson:3", "",
                           "fixed:-4", "file:/nonexistent/lengths"}) {
    auto d = ParseLengthDist(spec, "--output-len");
    ASSERT_FALSE(d.ok()) << spec;
    EXPECT_EQ(d.status().message().rfind("--output-len: ", 0), 0u) << d.status();
  }
}

TEST(LoadgenAddress, OnlyLoopback) {
  for (const char* a :
       {"127.0.0.1:50051", "127.1.2.3:1", "localhost:80", "[::1]:50051", "unix:/tmp/s.sock"})
    EXPECT_TRUE(IsLoopbackAddress(a)) << a;
  for (const char* a : {"10.0.0.1:50051", "0.0.0.0:50051", "128.0.0.1:1", "example.com:443",
                        "[::2]:1", "[::1", "", "1270.0.0.1:1"})
    EXPECT_FALSE(IsLoopbackAddress(a)) << a;
}

TEST(LoadgenCompression, Specs) {
  auto c = ParseCompressionChoice("dropkv:0.25");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->method, "dropkv");
  EXPECT_DOUBLE_EQ(c->keep_ratio, 0.25);
  EXPECT_TRUE(ParseCompressionChoice("none").ok());
  for (const char* bad : {"", "dropkv:0", "dropkv:1.5", "dropkv:x", "a:0.5:1"})
    EXPECT_FALSE(ParseCompressionChoice(bad).ok()) << bad;
}

TEST(LoadgenReport, JsonAndMarkdownCarryTheNumbers) {
  RunResult r;
  r.options.concurrency = 4;
  r.measured_s = 2.0;
  r.num_ok = 10;
  r.output_tokens = 320;
  r.errors["DEADLINE_EXCEEDED"] = 2;
  r.ttft_ms = Summarize({1, 2, 3, 4});
  const auto j = ResultToJson(r);
  EXPECT_DOUBLE_EQ(j["requests_per_s"].get<double>(), 5.0);
  EXPECT_DOUBLE_EQ(j["output_tokens_per_s"].get<double>(), 160.0);
  EXPECT_EQ(j["errors"]["DEADLINE_EXCEEDED"].get<int>(), 2);
  EXPECT_EQ(j["config"]["mode"], "closed");
  EXPECT_DOUBLE_EQ(j["ttft_ms"]["p50"].get<double>(), 2.0);
  const std::string md = ResultsToMarkdown({r, r});
  EXPECT_EQ(std::count(md.begin(), md.end(), '\n'), 4);  // header, rule, 2 rows
  EXPECT_NE(md.find("DEADLINE_EXCEEDED 2"), std::string::npos) << md;
}

// --turns: each prompt is the previous prompt, then the answer exactly, then `growth` fresh ids.
TEST(LoadgenTurns, NextPromptExtendsPromptAndAnswer) {
  const int32_t vocab = 50;
  std::mt19937_64 rng(11);
  std::vector<int32_t> prompt;
  AppendRandomTokens(16, vocab, rng, &prompt);
  ASSERT_EQ(prompt.size(), 16u);
  std::vector<std::vector<int32_t>> history = {prompt};
  for (int turn = 2; turn <= 4; ++turn) {
    // Answers hold any id the server may stream, special ids 0-2 included.
    const std::vector<int32_t> answer = {0, 1, 2, 49, turn};
    const int64_t growth = 7 * turn;
    std::mt19937_64 twin = rng;  // the same draws, to restate the growth
    const std::vector<int32_t> next = NextTurnPrompt(prompt, answer, growth, vocab, rng);
    ASSERT_EQ(next.size(), prompt.size() + answer.size() + growth) << "turn " << turn;
    EXPECT_TRUE(std::equal(prompt.begin(), prompt.end(), next.begin())) << "turn " << turn;
    EXPECT_TRUE(std::equal(answer.begin(), answer.end(), next.begin() + prompt.size()));
    std::vector<int32_t> expected_growth;
    AppendRandomTokens(growth, vocab, twin, &expected_growth);
    EXPECT_TRUE(std::equal(expected_growth.begin(), expected_growth.end(), next.end() - growth,
                           next.end()));
    for (auto it = next.end() - growth; it != next.end(); ++it) {
      EXPECT_GE(*it, 3);
      EXPECT_LT(*it, vocab);
    }
    prompt = next;
    history.push_back(next);
  }
  // Every earlier turn's prompt is a prefix of the last one (what a prefix cache can reuse).
  for (const auto& earlier : history)
    EXPECT_TRUE(std::equal(earlier.begin(), earlier.end(), prompt.begin()));
  // No growth: prompt + answer only.
  EXPECT_EQ(NextTurnPrompt({5, 6}, {7}, 0, vocab, rng), (std::vector<int32_t>{5, 6, 7}));
}

TEST(LoadgenTurns, RandomTokensAreUniformDrawsAboveSpecialIds) {
  std::mt19937_64 a(3), b(3);
  std::vector<int32_t> ids;
  AppendRandomTokens(1000, 512, a, &ids);
  std::uniform_int_distribution<int32_t> token(3, 511);
  for (int32_t id : ids) ASSERT_EQ(id, token(b));
  ids.clear();
  AppendRandomTokens(5, 2, a, &ids);  // a vocabulary too small still gives valid ids
  EXPECT_EQ(ids, (std::vector<int32_t>(5, 3)));
}

TEST(LoadgenTurns, ReportsCarryPerTurnRows) {
  RunResult r;
  r.options.concurrency = 2;
  r.options.num_turns = 2;
  r.options.turn_growth = *ParseLengthDist("fixed:8", "--turn-growth");
  r.turns.resize(2);
  r.turns[0] = {.num_ok = 3,
                .mean_prompt_len = 16,
                .mean_cached_prompt_tokens = 0,
                .ttft_ms = Summarize({1, 2, 3})};
  r.turns[1] = {.num_ok = 2,
                .mean_prompt_len = 32,
                .mean_cached_prompt_tokens = 24,
                .ttft_ms = Summarize({4, 6})};
  r.num_conversations_cut = 1;
  const auto j = ResultToJson(r);
  EXPECT_EQ(j["config"]["turns"].get<int>(), 2);
  EXPECT_EQ(j["config"]["turn_growth"], "fixed:8");
  ASSERT_EQ(j["turns"].size(), 2u);
  EXPECT_EQ(j["turns"][1]["turn"].get<int>(), 2);
  EXPECT_EQ(j["turns"][1]["requests_ok"].get<int>(), 2);
  EXPECT_DOUBLE_EQ(j["turns"][1]["mean_prompt_len"].get<double>(), 32.0);
  EXPECT_DOUBLE_EQ(j["turns"][1]["mean_cached_prompt_tokens"].get<double>(), 24.0);
  EXPECT_DOUBLE_EQ(j["turns"][1]["ttft_ms"]["p50"].get<double>(), 4.0);
  EXPECT_EQ(j["conversations_cut"].get<int>(), 1);
  const std::string md = TurnsToMarkdown({r});
  EXPECT_EQ(std::count(md.begin(), md.end(), '\n'), 5) << md;  // header, rule, 2 turns, cut
  EXPECT_NE(md.find("| 1 | 2 | 2 | 2 | 32.0 | 24.0 | 4.0 / 6.0 / 6.0 |"), std::string::npos) << md;
  // Single-turn runs add no table and no JSON keys.
  EXPECT_EQ(TurnsToMarkdown({RunResult{}}), "");
  EXPECT_FALSE(ResultToJson(RunResult{}).contains("turns"));
}

}  // namespace
}  // namespace dropkv::loadgen
