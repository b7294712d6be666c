// The compression plan (engine/compression/plan.h): chunk schedules, kept tokens and the blocks
// each chunk takes, checked by hand on small geometries. That the runner takes exactly these
// blocks is checked on the real runner in runner_integration_test.
#include "engine/compression/plan.h"

#include <numeric>

#include <gtest/gtest.h>

#include "engine/compression/compression.h"

namespace dropkv::compression {
namespace {

constexpr KvCacheGeometry kTwoLayers{.num_global_layers = 2, .block_size = 4};

CompressionParams DropKv(double keep) {
  CompressionParams p;
  p.method = ScoreMethod::kDropKV;
  p.keep_ratio = keep;
  return p;
}

PlanOptions Options(int64_t step_tokens, int64_t pool_blocks, int64_t decode_reserve_tokens) {
  PlanOptions o;
  o.step_tokens = step_tokens;
  o.pool_blocks = pool_blocks;
  o.decode_reserve_tokens = decode_reserve_tokens;
  return o;
}

std::vector<std::pair<int64_t, int64_t>> Bounds(const CompressionPlan& plan) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const PlannedChunk& c : plan.chunks()) out.emplace_back(c.begin, c.end);
  return out;
}

TEST(CompressionPlan, UncompressedPromptGoesInStepChunks) {
  PlanOptions o = Options(8, 100, 5);
  auto plan = CompressionPlan::Create(CompressionParams{}, 20, kTwoLayers, nullptr, o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Bounds(*plan), (std::vector<std::pair<int64_t, int64_t>>{{0, 8}, {8, 16}, {16, 20}}));
  // 2 layers x 2 new blocks, then 2 x 2, then 2 x 1; 20 + 5 tokens = 7 blocks a layer.
  EXPECT_EQ(plan->chunks()[0].new_blocks, 4);
  EXPECT_EQ(plan->chunks()[2].new_blocks, 2);
  EXPECT_EQ(plan->chunks()[2].blocks_after, 10);
  EXPECT_EQ(plan->blocks_needed(), 14);
  EXPECT_EQ(plan->kept_per_layer(), (std::vector<int64_t>{20, 20}));
}

// A long compressed prompt without a chunk size is split into step chunks under last_chunk when
// its full cache fits the pool; the last chunk keeps at least W = 8 tokens.
TEST(CompressionPlan, LongCompressedPromptIsSplitWhenItFits) {
  PlanOptions o = Options(8, 64, 0);
  auto plan = CompressionPlan::Create(DropKv(0.5), 20, kTwoLayers, nullptr, o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->split_long_prompt());
  EXPECT_EQ(plan->params().chunk_size, 8);
  EXPECT_EQ(plan->params().chunk_policy, ChunkPolicy::kLastChunk);
  EXPECT_EQ(Bounds(*plan), (std::vector<std::pair<int64_t, int64_t>>{{0, 8}, {8, 12}, {12, 20}}));
  // Chunks 1-2 stored in full (3 blocks a layer); the last writes 10 kept tokens (3 blocks) a
  // layer into new blocks while the old 3 are still held: peak 6 + 6.
  EXPECT_FALSE(plan->chunks()[1].evicts);
  EXPECT_TRUE(plan->chunks()[2].evicts);
  EXPECT_EQ(plan->chunks()[2].new_blocks, 6);
  EXPECT_EQ(plan->chunks()[2].blocks_after, 6);
  EXPECT_EQ(plan->blocks_needed(), 12);
  EXPECT_EQ(plan->kept_per_layer(), *KeptTokensPerLayer(DropKv(0.5), 2, 20));

  // Too big for the pool in full: one pass, only the kept tokens are ever stored.
  o.pool_blocks = 11;
  plan = CompressionPlan::Create(DropKv(0.5), 20, kTwoLayers, nullptr, o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->split_long_prompt());
  EXPECT_EQ(Bounds(*plan), (std::vector<std::pair<int64_t, int64_t>>{{0, 20}}));
  EXPECT_EQ(plan->blocks_needed(), 6);
  // The choice made at the first admission holds after a preemption, whatever the pool says.
  o.split_long_prompt = true;
  plan = CompressionPlan::Create(DropKv(0.5), 20, kTwoLayers, nullptr, o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->chunks().size(), 3u);
}

// every_chunk evicts in every chunk to the budget of the tokens seen so far: the peak is a
// chunk on top of the previous budget, far below the full prompt.
TEST(CompressionPlan, EveryChunkPeakIsBudgetPlusChunk) {
  CompressionParams p = DropKv(0.25);
  p.chunk_size = 16;
  p.chunk_policy = ChunkPolicy::kEveryChunk;
  PlanOptions o = Options(512, 1000, 0);
  auto plan = CompressionPlan::Create(p, 128, kTwoLayers, nullptr, o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->chunks().size(), 8u);
  int64_t held = 0, peak = 0;
  for (const PlannedChunk& c : plan->chunks()) {
    peak = std::max(peak, held + c.new_blocks);
    held = c.blocks_after;
  }
  EXPECT_EQ(plan->blocks_needed(), peak);
  EXPECT_EQ(plan->kept_per_layer(), *KeptTokensPerLayer(p, 2, 128));  // 32 a layer: 8 blocks
  // Before the last chunk each layer holds keep(112) = 28 tokens (7 blocks); the chunk makes
  // 44 and the new kept 32 go into 8 fresh blocks while the old 7 are held: 2 x (7 + 8).
  EXPECT_EQ(peak, 30);
  EXPECT_LT(peak, 2 * kTwoLayers.BlocksFor(128));
}

// Sliding-window layers hold their ring whatever the request; decode room counts there too.
TEST(CompressionPlan, SlidingLayersHoldAtMostTheirWindow) {
  const KvCacheGeometry g{
      .num_global_layers = 1, .num_sliding_layers = 2, .sliding_capacity = 8, .block_size = 4};
  PlanOptions o = Options(1000, 100, 4);
  auto plan = CompressionPlan::Create(DropKv(0.5), 40, g, nullptr, o);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // Global: keep(40) = 20 tokens (5 blocks) + 4 decode = 6 blocks; each ring 2 blocks.
  EXPECT_EQ(plan->kept_per_layer(), (std::vector<int64_t>{20}));
  EXPECT_EQ(plan->chunks()[0].new_blocks, 5 + 2 * 2);
  EXPECT_EQ(plan->blocks_needed(), 6 + 2 * 2);
}

TEST(CompressionPlan, InvalidSettingsAreRefusedWithTheirField) {
  CompressionParams p = DropKv(0.5);
  p.window = 0;
  auto plan = CompressionPlan::Create(p, 20, kTwoLayers, nullptr, PlanOptions{});
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(plan.status().message().rfind("window: ", 0), 0u) << plan.status();
  EXPECT_FALSE(CompressionPlan::Create(DropKv(0.5), 0, kTwoLayers, nullptr, PlanOptions{}).ok());
}

}  // namespace
}  // namespace dropkv::compression
