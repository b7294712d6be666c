#include "allocator/block_pool.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <vector>

namespace dropkv {
namespace {

std::unique_ptr<BlockPool> MakePool(int64_t num_blocks, int32_t block_size = 4,
                                    int32_t num_layers = 3, bool storage = false,
                                    std::vector<int64_t> layer_capacity = {}) {
  BlockPoolOptions o;
  o.num_blocks = num_blocks;
  o.block_size = block_size;
  o.num_layers = num_layers;
  o.num_kv_heads = 2;
  o.head_dim = 8;
  o.allocate_storage = storage;
  o.layer_capacity = std::move(layer_capacity);
  auto pool = BlockPool::Create(o);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return std::move(*pool);
}

TEST(BlockPoolTest, RejectsBadOptions) {
  BlockPoolOptions o;
  o.num_blocks = 0;
  o.num_layers = 1;
  auto r = BlockPool::Create(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("num_blocks"), std::string::npos);
}

TEST(BlockPoolTest, StorageShape) {
  auto pool = MakePool(5, 4, 2, /*storage=*/true);
  EXPECT_EQ(pool->key_cache().sizes(), (std::vector<int64_t>{5, 4, 2, 8}));
  EXPECT_EQ(pool->value_cache().sizes(), (std::vector<int64_t>{5, 4, 2, 8}));
}

TEST(BlockPoolTest, AppendAllocatesPerLayerAndFreeReturnsAll) {
  auto pool = MakePool(20);
  ASSERT_TRUE(pool->AddSequence(7).ok());
  const std::vector<int64_t> seqs = {7};
  EXPECT_EQ(pool->BlocksToAppend(seqs, 5), 3 * 2);
  ASSERT_TRUE(pool->AppendSlots(seqs, 5).ok());
  EXPECT_EQ(pool->num_used_blocks(), 6);
  EXPECT_EQ(pool->num_blocks_of(7), 6);
  for (int l = 0; l < 3; ++l) EXPECT_EQ(pool->stored_len(7, l), 5);
  // 3 more tokens fit in the second block of each layer: no new block.
  EXPECT_EQ(pool->BlocksToAppend(seqs, 3), 0);
  ASSERT_TRUE(pool->AppendSlots(seqs, 3).ok());
  EXPECT_EQ(pool->num_used_blocks(), 6);
  ASSERT_TRUE(pool->AppendSlots(seqs, 1).ok());
  EXPECT_EQ(pool->num_used_blocks(), 9);
  pool->FreeSequence(7);
  EXPECT_EQ(pool->num_free_blocks(), 20);
  EXPECT_FALSE(pool->HasSequence(7));
  pool->FreeSequence(7);  // unknown: ignored
  EXPECT_EQ(pool->num_free_blocks(), 20);
}

TEST(BlockPoolTest, PerLayerLengthsDiffer) {
  auto pool = MakePool(20);
  ASSERT_TRUE(pool->AddSequence(1).ok());
  ASSERT_TRUE(pool->AppendLayerSlots(1, 0, 9).ok());
  ASSERT_TRUE(pool->AppendLayerSlots(1, 2, 1).ok());
  EXPECT_EQ(pool->stored_len(1, 0), 9);
  EXPECT_EQ(pool->stored_len(1, 1), 0);
  EXPECT_EQ(pool->stored_len(1, 2), 1);
  EXPECT_EQ(pool->table(1, 0).block_ids.size(), 3u);
  EXPECT_EQ(pool->table(1, 1).block_ids.size(), 0u);
  EXPECT_EQ(pool->num_blocks_of(1), 4);
  pool->set_logical_len(1, 100);
  EXPECT_EQ(pool->logical_len(1), 100);
  // Slot indices map through the table.
  auto slots = pool->SlotIndices(1, 0, 3, 6);
  const auto& ids = pool->table(1, 0).block_ids;
  EXPECT_EQ(slots[0].item<int64_t>(), ids[0] * 4 + 3);
  EXPECT_EQ(slots[1].item<int64_t>(), ids[1] * 4 + 0);
  EXPECT_EQ(slots[2].item<int64_t>(), ids[1] * 4 + 1);
}

TEST(BlockPoolTest, ExhaustionLeavesStateUnchanged) {
  auto pool = MakePool(5);
  ASSERT_TRUE(pool->AddSequence(1).ok());
  ASSERT_TRUE(pool->AddSequence(2).ok());
  const std::vector<int64_t> s1 = {1};
  ASSERT_TRUE(pool->AppendSlots(s1, 4).ok());  // 3 blocks
  const auto before = pool->Snapshot(1);
  const std::vector<int64_t> both = {1, 2};
  // seq 1 needs 3 more, seq 2 needs 3: 6 > 2 free.
  auto st = pool->AppendSlots(both, 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool->num_free_blocks(), 2);
  EXPECT_EQ(pool->stored_len(1, 0), 4);
  EXPECT_EQ(pool->stored_len(2, 0), 0);
  EXPECT_EQ(pool->table(1, 1).block_ids, before.layers[1].block_ids);
  EXPECT_EQ(pool->AppendLayerSlots(2, 0, 100).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool->stored_len(2, 0), 0);
  EXPECT_EQ(pool->num_free_blocks(), 2);
  auto raw = pool->AllocateBlocks(3);
  EXPECT_EQ(raw.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool->num_free_blocks(), 2);
  EXPECT_FALSE(pool->AppendSlots(std::vector<int64_t>{2, 2}, 1).ok());  // duplicates
  EXPECT_EQ(pool->AddSequence(1).code(), absl::StatusCode::kAlreadyExists);
}

TEST(BlockPoolTest, ReplaceLayerAndRestoreUndo) {
  auto pool = MakePool(12);
  ASSERT_TRUE(pool->AddSequence(3).ok());
  ASSERT_TRUE(pool->AppendSlots(std::vector<int64_t>{3}, 6).ok());  // 2 blocks x 3 layers
  pool->set_logical_len(3, 6);
  const auto snap = pool->Snapshot(3);
  std::vector<int32_t> old;
  ASSERT_TRUE(pool->ReplaceLayer(3, 1, 3, &old).ok());
  EXPECT_EQ(old, snap.layers[1].block_ids);
  EXPECT_EQ(pool->stored_len(3, 1), 3);
  EXPECT_EQ(pool->num_used_blocks(), 7);  // old blocks still held by the caller
  ASSERT_TRUE(pool->AppendLayerSlots(3, 0, 10).ok());
  pool->set_logical_len(3, 16);
  pool->Restore(3, snap);
  EXPECT_EQ(pool->num_used_blocks(), 6);
  EXPECT_EQ(pool->logical_len(3), 6);
  for (int l = 0; l < 3; ++l) {
    EXPECT_EQ(pool->table(3, l).block_ids, snap.layers[l].block_ids);
    EXPECT_EQ(pool->stored_len(3, l), 6);
  }
  // Commit path: replace, then free the old blocks.
  ASSERT_TRUE(pool->ReplaceLayer(3, 2, 1, &old).ok());
  pool->FreeBlocks(old);
  EXPECT_EQ(pool->num_used_blocks(), 5);
  pool->FreeSequence(3);
  EXPECT_EQ(pool->num_free_blocks(), 12);
}

// A fork shares the full blocks and gets a fresh block for each layer's partial one (the caller
// copies it); appends of either side never touch the other's blocks; each side frees only its
// own; an in-place truncation gives the blocks past the new length back.
TEST(BlockPoolTest, ForkSharesFullBlocksAndCopiesThePartialOne) {
  auto pool = MakePool(20);
  ASSERT_TRUE(pool->AddSequence(1).ok());
  ASSERT_TRUE(pool->AppendSlots(std::vector<int64_t>{1}, 6).ok());  // 1 full + 1 partial a layer
  pool->set_logical_len(1, 6);
  std::vector<BlockPool::BlockCopy> copies;
  ASSERT_TRUE(pool->ForkSequence(1, 2, &copies).ok());
  ASSERT_EQ(copies.size(), 3u);
  EXPECT_EQ(pool->num_used_blocks(), 9);
  for (int32_t l = 0; l < 3; ++l) {
    const auto& a = pool->table(1, l).block_ids;
    const auto& b = pool->table(2, l).block_ids;
    EXPECT_EQ(a[0], b[0]);
    EXPECT_EQ(pool->ref_count(a[0]), 2);
    EXPECT_EQ(copies[l].from, a[1]);
    EXPECT_EQ(copies[l].to, b[1]);
    EXPECT_EQ(pool->stored_len(2, l), 6);
  }
  EXPECT_EQ(pool->logical_len(2), 6);
  EXPECT_EQ(pool->ForkSequence(1, 2, &copies).code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(pool->AppendSlots(std::vector<int64_t>{2}, 3).ok());  // fills the copy, then new
  EXPECT_EQ(pool->table(1, 0).block_ids.size(), 2u);
  std::vector<int32_t> dropped;
  ASSERT_TRUE(pool->TruncateLayer(2, 0, 4, &dropped).ok());
  EXPECT_EQ(dropped.size(), 2u);
  pool->FreeBlocks(dropped);
  EXPECT_EQ(pool->TruncateLayer(2, 0, 5, &dropped).code(), absl::StatusCode::kInvalidArgument);
  pool->FreeSequence(1);
  EXPECT_EQ(pool->ref_count(pool->table(2, 1).block_ids[0]), 1);
  pool->FreeSequence(2);
  EXPECT_EQ(pool->num_free_blocks(), 20);
  // Not enough blocks for the copies: nothing changes.
  auto tight = MakePool(6);
  ASSERT_TRUE(tight->AddSequence(1).ok());
  ASSERT_TRUE(tight->AppendSlots(std::vector<int64_t>{1}, 6).ok());
  EXPECT_EQ(tight->ForkSequence(1, 2, &copies).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(tight->HasSequence(2));
  EXPECT_EQ(tight->num_free_blocks(), 0);
}

// The decode step's undo: an append that took new blocks (a block boundary crossed) and one that
// did not, for two sequences at once, each taken back to the exact tables and free count.
TEST(BlockPoolTest, UndoAppendSlotsRestoresTablesAndFreeBlocks) {
  auto pool = MakePool(30);  // block_size 4, 3 layers
  ASSERT_TRUE(pool->AddSequence(1).ok());
  ASSERT_TRUE(pool->AddSequence(2).ok());
  ASSERT_TRUE(pool->AppendSlots(std::vector<int64_t>{1}, 4).ok());  // full blocks: next takes one
  ASSERT_TRUE(pool->AppendSlots(std::vector<int64_t>{2}, 5).ok());  // room for 3 more
  const std::vector<int64_t> both = {1, 2};
  for (int64_t n : {1, 3, 6}) {
    const auto before1 = pool->Snapshot(1), before2 = pool->Snapshot(2);
    const int64_t free_before = pool->num_free_blocks();
    ASSERT_TRUE(pool->AppendSlots(both, n).ok());
    EXPECT_LT(pool->num_free_blocks(), free_before) << n;  // sequence 1 needed a block
    pool->UndoAppendSlots(both, n);
    EXPECT_EQ(pool->num_free_blocks(), free_before) << n;
    for (int l = 0; l < 3; ++l) {
      EXPECT_EQ(pool->table(1, l).block_ids, before1.layers[l].block_ids) << n;
      EXPECT_EQ(pool->table(2, l).block_ids, before2.layers[l].block_ids) << n;
      EXPECT_EQ(pool->stored_len(1, l), 4) << n;
      EXPECT_EQ(pool->stored_len(2, l), 5) << n;
    }
  }
  pool->FreeSequence(1);
  pool->FreeSequence(2);
  EXPECT_EQ(pool->num_free_blocks(), 30);
}

TEST(BlockPoolTest, ManySequencesNoLeak) {
  auto pool = MakePool(64, 2, 4);
  for (int round = 0; round < 5; ++round) {
    for (int64_t s = 0; s < 8; ++s) {
      ASSERT_TRUE(pool->AddSequence(s).ok());
      ASSERT_TRUE(pool->AppendSlots(std::vector<int64_t>{s}, 1 + (s + round) % 3).ok());
    }
    for (int64_t s = 0; s < 8; ++s) pool->FreeSequence(s);
    EXPECT_EQ(pool->num_free_blocks(), 64);
    EXPECT_EQ(pool->num_sequences(), 0);
  }
}

// A fork copies a bounded layer's ring whole (it is rewritten in place) and shares the other
// layers' full blocks: writing either ring never touches the other's.
TEST(BlockPoolTest, ForkCopiesARingWhole) {
  auto pool = MakePool(20, 4, 2, false, {6, 0});
  ASSERT_TRUE(pool->AddSequence(1).ok());
  ASSERT_TRUE(pool->AppendLayerSlots(1, 0, 9).ok());  // a full ring of 6: 2 blocks
  ASSERT_TRUE(pool->AppendLayerSlots(1, 1, 9).ok());  // 2 full blocks + 1 partial
  pool->set_logical_len(1, 9);
  std::vector<BlockPool::BlockCopy> copies;
  ASSERT_TRUE(pool->ForkSequence(1, 2, &copies).ok());
  ASSERT_EQ(copies.size(), 3u);  // the ring's 2 blocks, the partial one
  const auto& ring1 = pool->table(1, 0).block_ids;
  const auto& ring2 = pool->table(2, 0).block_ids;
  ASSERT_EQ(ring2.size(), 2u);
  for (size_t b = 0; b < 2; ++b) {
    EXPECT_NE(ring1[b], ring2[b]);
    EXPECT_EQ(copies[b].from, ring1[b]);
    EXPECT_EQ(copies[b].to, ring2[b]);
    EXPECT_EQ(pool->ref_count(ring1[b]), 1);
  }
  EXPECT_EQ(pool->table(2, 1).block_ids[0], pool->table(1, 1).block_ids[0]);
  EXPECT_EQ(pool->stored_len(2, 0), 6);
  EXPECT_EQ(pool->num_used_blocks(), 5 + 3);
  // Not enough blocks for the copies: nothing changes.
  auto tight = MakePool(6, 4, 2, false, {6, 0});
  ASSERT_TRUE(tight->AddSequence(1).ok());
  ASSERT_TRUE(tight->AppendLayerSlots(1, 0, 9).ok());
  ASSERT_TRUE(tight->AppendLayerSlots(1, 1, 9).ok());
  EXPECT_EQ(tight->ForkSequence(1, 2, &copies).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(tight->HasSequence(2));
}

// A bounded layer (a sliding window's ring) grows to its capacity, then keeps its blocks; the
// others grow; the decode undo of a full ring leaves it full.
TEST(BlockPoolTest, BoundedLayerStopsGrowingAtCapacity) {
  BlockPoolOptions o;
  o.num_blocks = 40;
  o.block_size = 4;
  o.num_layers = 2;
  o.allocate_storage = false;
  o.layer_capacity = {6, 0};
  auto created = BlockPool::Create(o);
  ASSERT_TRUE(created.ok()) << created.status();
  auto& pool = *created;
  ASSERT_TRUE(pool->AddSequence(1).ok());
  ASSERT_TRUE(pool->AppendLayerSlots(1, 0, 5).ok());
  ASSERT_TRUE(pool->AppendLayerSlots(1, 1, 5).ok());
  pool->set_logical_len(1, 5);
  EXPECT_EQ(pool->stored_len(1, 0), 5);
  const std::vector<int64_t> seqs = {1};
  for (int step = 0; step < 7; ++step) {
    ASSERT_TRUE(pool->AppendSlots(seqs, 1).ok());
    EXPECT_EQ(pool->stored_len(1, 0), 6);  // 5 + 1, then full
    EXPECT_EQ(pool->table(1, 0).block_ids.size(), 2u);
    pool->set_logical_len(1, pool->logical_len(1) + 1);
  }
  EXPECT_EQ(pool->stored_len(1, 1), 12);
  EXPECT_EQ(pool->table(1, 1).block_ids.size(), 3u);
  // A 40-token prefill chunk on the bounded layer takes no block beyond its capacity's.
  ASSERT_TRUE(pool->AppendLayerSlots(1, 0, 40).ok());
  EXPECT_EQ(pool->stored_len(1, 0), 6);
  EXPECT_EQ(pool->num_blocks_of(1), 2 + 3);
  // Undo of a step on a full ring: still full; the unbounded layer shrinks back.
  const int64_t used = pool->num_used_blocks();
  ASSERT_TRUE(pool->AppendSlots(seqs, 1).ok());
  EXPECT_EQ(pool->num_used_blocks(), used + 1);  // layer 1 crosses into a 4th block
  pool->UndoAppendSlots(seqs, 1);
  EXPECT_EQ(pool->stored_len(1, 0), 6);
  EXPECT_EQ(pool->stored_len(1, 1), 12);
  EXPECT_EQ(pool->num_used_blocks(), used);
  pool->FreeSequence(1);
  EXPECT_EQ(pool->num_free_blocks(), 40);

  o.layer_capacity = {6};
  EXPECT_EQ(BlockPool::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

// Undo on a ring that was one short of full before the step: back to one short.
TEST(BlockPoolTest, UndoOnRingThatJustFilled) {
  BlockPoolOptions o;
  o.num_blocks = 8;
  o.block_size = 4;
  o.num_layers = 1;
  o.allocate_storage = false;
  o.layer_capacity = {4};
  auto pool = std::move(*BlockPool::Create(o));
  ASSERT_TRUE(pool->AddSequence(3).ok());
  ASSERT_TRUE(pool->AppendLayerSlots(3, 0, 3).ok());
  pool->set_logical_len(3, 3);
  const std::vector<int64_t> seqs = {3};
  ASSERT_TRUE(pool->AppendSlots(seqs, 1).ok());
  EXPECT_EQ(pool->stored_len(3, 0), 4);
  pool->UndoAppendSlots(seqs, 1);
  EXPECT_EQ(pool->stored_len(3, 0), 3);
}

}  // namespace
}  // namespace dropkv
