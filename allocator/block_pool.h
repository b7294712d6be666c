// The paged KV block pool: one pool of blocks shared by every layer of one model, a block table
// per (sequence, layer), stored lengths per layer and a logical length (next RoPE position) per
// sequence. A block holds `block_size` slots x num_kv_heads x head_dim for K and for V.
// No model knowledge. Not thread-safe: the engine thread owns it.
//
// Failure is a value: every allocating call is all-or-nothing and returns RESOURCE_EXHAUSTED with
// the state unchanged when the free list is too short (ask CanAllocate first, then commit).
//
// Blocks are reference counted: a sequence's table holds one reference per block, and a block
// may be shared (a cached prompt prefix, allocator/prefix_cache.h). Shared blocks are full and
// never written again: appends go to new blocks. A block the prefix cache pins and nobody else
// holds is "reclaimable": it counts as free, and an allocation that finds the free list short
// asks the reclaimer (the cache) to unpin some first.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dropkv {

struct BlockPoolOptions {
  int64_t num_blocks = 0;   // > 0
  int32_t block_size = 16;  // slots per block, > 0
  int32_t num_layers = 0;   // block tables per sequence, > 0
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  // Per layer, the most slots a sequence's table holds (0 = no bound; empty = none bounded). A
  // bounded layer grows to its capacity and then keeps its slots: appends past it reuse them (the
  // caller decides which slot a new token overwrites, e.g. a ring by position for a sliding-window
  // layer).
  std::vector<int64_t> layer_capacity;
  // Storage tensors are allocated only when true (accounting-only pools keep tests cheap).
  bool allocate_storage = true;
  at::ScalarType dtype = at::kFloat;
  at::Device device = at::Device(at::kCPU);
};

// One layer's cache of one sequence: slot j lives at block_ids[j / block_size], offset
// j % block_size. stored_len <= block_ids.size() * block_size.
struct LayerBlockTable {
  std::vector<int32_t> block_ids;
  int64_t stored_len = 0;
};

// Everything the pool knows about one sequence (also the snapshot type of Snapshot/Restore).
struct SequenceBlocks {
  int64_t logical_len = 0;
  std::vector<LayerBlockTable> layers;  // [num_layers]
};

class BlockPool {
 public:
  static absl::StatusOr<std::unique_ptr<BlockPool>> Create(const BlockPoolOptions& options);

  const BlockPoolOptions& options() const { return options_; }
  int32_t block_size() const { return options_.block_size; }
  int32_t num_layers() const { return options_.num_layers; }
  int64_t num_blocks() const { return options_.num_blocks; }
  // Blocks an allocation can take: the free list and the reclaimable cached blocks.
  int64_t num_free_blocks() const {
    return static_cast<int64_t>(free_list_.size()) + num_reclaimable_;
  }
  int64_t num_used_blocks() const { return num_blocks() - num_free_blocks(); }
  // Blocks the prefix cache pins (held by sequences too, or reclaimable).
  int64_t num_cached_blocks() const { return num_cached_; }
  int64_t num_reclaimable_blocks() const { return num_reclaimable_; }
  bool CanAllocate(int64_t num_blocks) const { return num_blocks <= num_free_blocks(); }
  // Blocks needed to hold `num_tokens` slots.
  int64_t BlocksFor(int64_t num_tokens) const;
  // Layer `layer_idx`'s slot bound (0 = none).
  int64_t capacity(int32_t layer_idx) const {
    return options_.layer_capacity.empty() ? 0 : options_.layer_capacity[layer_idx];
  }

  // Storage: [num_blocks, block_size, num_kv_heads, head_dim] each (undefined without storage).
  const at::Tensor& key_cache() const { return key_cache_; }
  const at::Tensor& value_cache() const { return value_cache_; }

  // --- raw blocks -------------------------------------------------------------------------------
  // `num_blocks` free blocks (one reference each), or RESOURCE_EXHAUSTED with nothing taken.
  absl::StatusOr<std::vector<int32_t>> AllocateBlocks(int64_t num_blocks);
  // Drops one reference of each block; a block nobody holds returns to the free list.
  // Precondition: the caller holds those references (no table does). Unallocated ids are ignored.
  void FreeBlocks(std::span<const int32_t> block_ids);
  // One more reference to each (allocated) block.
  void RetainBlocks(std::span<const int32_t> block_ids);
  int32_t ref_count(int32_t block_id) const { return ref_count_[block_id]; }
  bool is_cached(int32_t block_id) const { return cached_[block_id] != 0; }

  // --- the prefix cache's pins -------------------------------------------------------------------
  // Pin: the cache takes a reference and marks the block cached; Unpin drops both. A block is
  // pinned at most once.
  void PinForCache(std::span<const int32_t> block_ids);
  void UnpinFromCache(std::span<const int32_t> block_ids);
  // Called with the number of blocks missing when an allocation finds the free list short (it
  // never asks for more than num_reclaimable_blocks()); it must unpin at least that many
  // reclaimable blocks. Empty: none.
  using Reclaimer = std::function<void(int64_t num_blocks)>;
  void set_reclaimer(Reclaimer reclaimer) { reclaimer_ = std::move(reclaimer); }

  // --- sequences -------------------------------------------------------------------------------
  bool HasSequence(int64_t seq) const { return seqs_.contains(seq); }
  // Registers `seq` with empty tables; ALREADY_EXISTS when known.
  absl::Status AddSequence(int64_t seq);
  // Registers `seq` holding `num_tokens` tokens (stored and logical) in the full blocks
  // `layer_blocks[l]` of each layer l (a reference is taken to each): a shared prefix, so every
  // layer unbounded with num_tokens / block_size blocks. ALREADY_EXISTS / INVALID_ARGUMENT.
  absl::Status AddSequenceSharing(int64_t seq, int64_t num_tokens,
                                  std::span<const std::vector<int32_t>> layer_blocks);
  // A block whose slots a fork must copy (ForkSequence).
  struct BlockCopy {
    int32_t from = -1, to = -1;
  };
  // Registers `dst` holding what `src` holds (same lengths): an unbounded layer's full blocks
  // shared (a reference is taken) and its last partial block replaced by a fresh one, a bounded
  // layer's ring (rewritten in place) replaced by fresh blocks whole; the caller fills the fresh
  // blocks with `copies` (from -> to) before either sequence writes again, so writes of either
  // never touch a block the other holds. All-or-nothing (RESOURCE_EXHAUSTED for the fresh blocks).
  absl::Status ForkSequence(int64_t src, int64_t dst, std::vector<BlockCopy>* copies);
  // Drops `seq`'s reference to each of its blocks and forgets it; unknown ids are ignored.
  void FreeSequence(int64_t seq);
  int64_t num_sequences() const { return static_cast<int64_t>(seqs_.size()); }

  // Precondition for the accessors below: HasSequence(seq).
  const SequenceBlocks& sequence(int64_t seq) const;
  const LayerBlockTable& table(int64_t seq, int32_t layer_idx) const;
  int64_t stored_len(int64_t seq, int32_t layer_idx) const;
  int64_t logical_len(int64_t seq) const;
  void set_logical_len(int64_t seq, int64_t logical_len);
  // Blocks held by `seq` over all layers.
  int64_t num_blocks_of(int64_t seq) const;

  // Blocks AppendSlots would take for these sequences (all layers, `num_tokens` each).
  int64_t BlocksToAppend(std::span<const int64_t> seqs, int64_t num_tokens) const;
  // Grows every layer of every listed sequence by `num_tokens` slots (stored_len += num_tokens, up
  // to a bounded layer's capacity). All-or-nothing. Duplicated ids are INVALID_ARGUMENT.
  absl::Status AppendSlots(std::span<const int64_t> seqs, int64_t num_tokens);
  // Takes back the AppendSlots(seqs, num_tokens) that succeeded last for these sequences, with
  // nothing else changed since: each layer loses those slots and the blocks the append added
  // (the blocks past what the remaining slots need). The decode step's undo, without a Snapshot
  // of every table (~100 us per step at batch 16). A bounded layer must have held
  // min(logical_len, capacity) slots before the append (as a sliding-window layer does).
  void UndoAppendSlots(std::span<const int64_t> seqs, int64_t num_tokens);
  // Grows one layer by `num_tokens` slots. All-or-nothing.
  absl::Status AppendLayerSlots(int64_t seq, int32_t layer_idx, int64_t num_tokens);
  // Gives one layer fresh blocks for `stored_len` slots and hands the previous blocks to the
  // caller in `old_block_ids`: they stay allocated until the caller frees them (or a Restore puts
  // them back), so a compaction can read the old slots while writing the new ones and can still
  // be undone. All-or-nothing.
  absl::Status ReplaceLayer(int64_t seq, int32_t layer_idx, int64_t stored_len,
                            std::vector<int32_t>* old_block_ids);

  // Shrinks one layer to its first `stored_len` slots; the blocks past them go to the caller in
  // `dropped_block_ids` (to free). INVALID_ARGUMENT when stored_len is not in [0, stored_len].
  absl::Status TruncateLayer(int64_t seq, int32_t layer_idx, int64_t stored_len,
                             std::vector<int32_t>* dropped_block_ids);
  // A copy of `seq`'s tables; Restore(seq, snapshot) puts them back and frees every block the
  // current tables hold that the snapshot does not. Together they undo a failed multi-step update.
  SequenceBlocks Snapshot(int64_t seq) const { return sequence(seq); }
  void Restore(int64_t seq, SequenceBlocks snapshot);

  // Flat slot indices (block_id * block_size + offset) of slots [begin, end) of a layer:
  // int64 [end - begin] on the CPU.
  at::Tensor SlotIndices(int64_t seq, int32_t layer_idx, int64_t begin, int64_t end) const;

 private:
  explicit BlockPool(const BlockPoolOptions& options) : options_(options) {}
  SequenceBlocks& mutable_sequence(int64_t seq);
  // stored_len of layer `layer_idx`'s table `t` after appending num_tokens.
  int64_t Grown(const LayerBlockTable& t, int32_t layer_idx, int64_t num_tokens) const;
  int64_t ExtraBlocks(const LayerBlockTable& t, int32_t layer_idx, int64_t num_tokens) const;
  // num_reclaimable_ += delta when block b is pinned and held by the cache alone.
  void CountReclaimable(int32_t b, int64_t delta) {
    if (cached_[b] && ref_count_[b] == 1) num_reclaimable_ += delta;
  }

  BlockPoolOptions options_;
  std::vector<int32_t> free_list_;  // LIFO: recently freed blocks are reused first
  std::vector<int32_t> ref_count_;  // [num_blocks]; 0 = free
  std::vector<uint8_t> cached_;     // [num_blocks]; pinned by the prefix cache
  int64_t num_cached_ = 0;
  int64_t num_reclaimable_ = 0;
  Reclaimer reclaimer_;
  std::unordered_map<int64_t, SequenceBlocks> seqs_;
  at::Tensor key_cache_;
  at::Tensor value_cache_;
};

}  // namespace dropkv
