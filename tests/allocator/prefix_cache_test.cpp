// The pool's reference counts and the prefix cache on top of it (allocator/prefix_cache.h): shared
// blocks outlive one holder, a block only the cache holds counts as free and is reclaimed on
// demand, lookups compare tokens exactly.
#include "allocator/prefix_cache.h"

#include <gtest/gtest.h>

#include <vector>

#include "allocator/block_pool.h"

namespace dropkv {
namespace {

constexpr int32_t kBlock = 4;
constexpr int32_t kLayers = 2;

std::unique_ptr<BlockPool> MakePool(int64_t num_blocks) {
  BlockPoolOptions o;
  o.num_blocks = num_blocks;
  o.block_size = kBlock;
  o.num_layers = kLayers;
  o.allocate_storage = false;
  return std::move(*BlockPool::Create(o));
}

std::vector<int32_t> Tokens(int n, int salt) {
  std::vector<int32_t> t;
  for (int i = 0; i < n; ++i) t.push_back(salt * 100 + i);
  return t;
}

// A sequence `seq` that stored `tokens` (uncompressed) in every layer.
void Store(BlockPool& pool, int64_t seq, int64_t num_tokens) {
  ASSERT_TRUE(pool.AddSequence(seq).ok());
  const std::vector<int64_t> ids = {seq};
  ASSERT_TRUE(pool.AppendSlots(ids, num_tokens).ok());
  pool.set_logical_len(seq, num_tokens);
}

TEST(PrefixCacheTest, SharedBlocksAreCountedAndReclaimed) {
  auto pool = MakePool(16);
  PrefixCache cache(*pool, "model|float32");
  const std::vector<int32_t> tokens = Tokens(10, 1);
  Store(*pool, 1, 10);  // 3 blocks a layer, the last one partly filled
  PrefixCache::Cursor cursor;
  cache.Insert(1, tokens, cursor);
  EXPECT_EQ(cursor.num_blocks, 2);  // only full blocks
  EXPECT_EQ(pool->num_cached_blocks(), 4);
  EXPECT_EQ(pool->num_reclaimable_blocks(), 0);  // sequence 1 still holds them
  EXPECT_EQ(pool->num_free_blocks(), 10);

  // Another prompt with the same first 9 tokens: 8 of them (2 blocks) match.
  std::vector<int32_t> other = Tokens(9, 1);
  other.push_back(7);
  PrefixMatch match = cache.Match(other, /*max_tokens=*/9);
  ASSERT_EQ(match.num_tokens, 8);
  ASSERT_EQ(match.layer_blocks.size(), size_t{kLayers});
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_EQ(match.layer_blocks[l], (std::vector<int32_t>{pool->table(1, l).block_ids[0],
                                                           pool->table(1, l).block_ids[1]}));
  }
  EXPECT_EQ(cache.ReclaimableBlocksOf(match), 0);
  ASSERT_TRUE(pool->AddSequenceSharing(2, match.num_tokens, match.layer_blocks).ok());
  EXPECT_EQ(pool->ref_count(match.layer_blocks[0][0]), 3);  // two sequences and the cache
  EXPECT_EQ(pool->logical_len(2), 8);
  EXPECT_EQ(pool->stored_len(2, 1), 8);
  // Sequence 2 appends into a new block, never into the shared ones.
  const std::vector<int64_t> two = {2};
  ASSERT_TRUE(pool->AppendSlots(two, 1).ok());
  EXPECT_EQ(pool->table(2, 0).block_ids.size(), size_t{3});
  EXPECT_NE(pool->table(2, 0).block_ids[2], pool->table(1, 0).block_ids[2]);

  pool->FreeSequence(1);
  pool->FreeSequence(2);
  // The 4 cached blocks are free to take; the rest went back to the free list.
  EXPECT_EQ(pool->num_reclaimable_blocks(), 4);
  EXPECT_EQ(pool->num_free_blocks(), 16);
  EXPECT_EQ(cache.Match(tokens, 10).num_tokens, 8);

  // Taking every block reclaims the cache's, whose entries then miss.
  auto all = pool->AllocateBlocks(16);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(pool->num_cached_blocks(), 0);
  EXPECT_EQ(cache.stats().num_entries, 0);
  EXPECT_EQ(cache.stats().num_evicted_entries, 2);
  EXPECT_EQ(cache.Match(tokens, 10).num_tokens, 0);
  EXPECT_FALSE(pool->AllocateBlocks(1).ok());
  pool->FreeBlocks(*all);
  EXPECT_EQ(pool->num_free_blocks(), 16);
}

// Keys are the exact tokens and the chain before them: the same block of tokens after another
// prefix is another entry, and a different salt (model, dtype) never matches.
TEST(PrefixCacheTest, KeysAreExactPrefixes) {
  auto pool = MakePool(32);
  PrefixCache cache(*pool, "a");
  std::vector<int32_t> x = Tokens(8, 1);
  std::vector<int32_t> y = Tokens(4, 2);
  y.insert(y.end(), x.begin() + 4, x.end());  // same second block, other first block
  Store(*pool, 1, 8);
  PrefixCache::Cursor cx;
  cache.Insert(1, x, cx);
  EXPECT_EQ(cache.Match(y, 8).num_tokens, 0);
  Store(*pool, 2, 8);
  PrefixCache::Cursor cy;
  cache.Insert(2, y, cy);
  EXPECT_EQ(cache.stats().num_entries, 4);
  EXPECT_EQ(cache.Match(y, 8).layer_blocks[0][1], pool->table(2, 0).block_ids[1]);
  EXPECT_EQ(cache.Match(x, 8).layer_blocks[0][1], pool->table(1, 0).block_ids[1]);
  // One token off in the second block: the first still matches.
  std::vector<int32_t> z = x;
  z[6] += 1;
  EXPECT_EQ(cache.Match(z, 8).num_tokens, 4);
  // Inserting the same prefix from another sequence keeps the first one's blocks.
  Store(*pool, 3, 8);
  PrefixCache::Cursor c3;
  cache.Insert(3, x, c3);
  EXPECT_EQ(cache.stats().num_entries, 4);
  EXPECT_EQ(c3.num_blocks, 2);
  for (int64_t s : {1, 2, 3}) pool->FreeSequence(s);
  EXPECT_EQ(pool->num_free_blocks(), 32);
  EXPECT_EQ(pool->num_cached_blocks(), 8);
  cache.Clear();
  EXPECT_EQ(pool->num_cached_blocks(), 0);
  EXPECT_EQ(pool->num_reclaimable_blocks(), 0);
  EXPECT_EQ(pool->num_free_blocks(), 32);
}

TEST(PrefixCacheTest, SharingChecksItsBlocks) {
  auto pool = MakePool(8);
  std::vector<std::vector<int32_t>> one_layer = {{0}};
  EXPECT_EQ(pool->AddSequenceSharing(1, 4, one_layer).code(), absl::StatusCode::kInvalidArgument);
  std::vector<std::vector<int32_t>> free_blocks = {{0}, {1}};
  EXPECT_EQ(pool->AddSequenceSharing(1, 4, free_blocks).code(), absl::StatusCode::kInvalidArgument);
  auto blocks = pool->AllocateBlocks(2);
  std::vector<std::vector<int32_t>> held = {{(*blocks)[0]}, {(*blocks)[1]}};
  EXPECT_EQ(pool->AddSequenceSharing(1, 3, held).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(pool->AddSequenceSharing(1, 4, held).ok());
  pool->FreeBlocks(*blocks);  // the allocation's references: the sequence still holds them
  EXPECT_EQ(pool->num_free_blocks(), 6);
  pool->FreeSequence(1);
  EXPECT_EQ(pool->num_free_blocks(), 8);
}

}  // namespace
}  // namespace dropkv
