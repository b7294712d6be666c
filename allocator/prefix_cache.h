// Automatic prefix caching: the KV blocks of prompt (and generated) tokens stay in the pool after
// their request ends, keyed by the exact token prefix they hold, so a later prompt that starts
// with the same tokens attaches them and prefills only the rest (multi-turn chat, shared system
// prompts). Only full-cache sequences take part: an evicting press changes what a block holds.
//
// The unit is a prefix block: token positions [i*B, (i+1)*B) of a sequence, one pool block per
// layer. An entry is keyed by its parent entry (the tokens before it) and its B token ids, so a
// lookup compares tokens exactly (no hash collision can return the wrong KV). The `salt` (model
// and dtype) starts every chain. The cache pins each entry's blocks (one reference); a block it
// alone holds counts as free in the pool, and is unpinned when an allocation needs it: least
// recently used entries first, deeper ones first among equals.
//
// Not thread-safe: the engine thread owns it (as the pool).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

namespace dropkv {

class BlockPool;

struct PrefixMatch {
  int64_t num_tokens = 0;                          // a multiple of the block size
  std::vector<std::vector<int32_t>> layer_blocks;  // [num_layers][num_tokens / block_size]
  std::vector<int64_t> entries;                    // the matched entries, in order
  // Pool blocks over all layers.
  int64_t num_blocks() const { return static_cast<int64_t>(layer_blocks.size() * entries.size()); }
};

struct PrefixCacheStats {
  int64_t num_entries = 0;
  int64_t num_query_tokens = 0;  // prompt tokens looked up (cumulative)
  int64_t num_hit_tokens = 0;    // of which found cached
  int64_t num_evicted_entries = 0;
};

class PrefixCache {
 public:
  // Installs itself as `pool`'s reclaimer; the pool must outlive it. The pool's layers must all
  // be unbounded (a sliding-window ring rewrites its blocks).
  PrefixCache(BlockPool& pool, const std::string& salt);
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  // The longest cached prefix of `tokens` of at most `max_tokens` tokens (whole blocks). Marks
  // the matched entries used.
  PrefixMatch Match(std::span<const int32_t> tokens, int64_t max_tokens);
  // Counts one prompt's lookup in the stats (once per admission, not per Match).
  void RecordLookup(int64_t num_query_tokens, int64_t num_hit_tokens) {
    stats_.num_query_tokens += num_query_tokens;
    stats_.num_hit_tokens += num_hit_tokens;
  }
  // Blocks of `match` only the cache holds now: attaching them takes them out of the free count.
  int64_t ReclaimableBlocksOf(const PrefixMatch& match) const;

  // Where a sequence's registration stopped, so that the next Insert of the same sequence goes on
  // from there instead of walking its chain again.
  struct Cursor {
    int64_t num_blocks = 0;
    int64_t parent = 0;  // the entry of block num_blocks - 1 (0 = the root)
  };
  // The cursor after `match` (a sequence started from it).
  static Cursor CursorAfter(const PrefixMatch& match) {
    return {static_cast<int64_t>(match.entries.size()),
            match.entries.empty() ? 0 : match.entries.back()};
  }
  // Registers the full blocks of sequence `seq` (pool tables, every layer holding slot j = token
  // j of `tokens`, uncompressed) not cached yet, from `cursor` on: blocks up to stored_len / B,
  // where `tokens` covers at least that many tokens. Blocks of a prefix already cached under
  // other blocks stay the sequence's own.
  void Insert(int64_t seq, std::span<const int32_t> tokens, Cursor& cursor);

  // Unpins least recently used entries until `num_blocks` blocks went back to the free list (or
  // nothing reclaimable is left). Returns the blocks freed.
  int64_t Reclaim(int64_t num_blocks);
  // Unpins everything.
  void Clear();

  const PrefixCacheStats& stats() const { return stats_; }

 private:
  struct Key {
    int64_t parent = 0;  // entry id; 0 = the root
    std::vector<int32_t> tokens;
    bool operator==(const Key& o) const { return parent == o.parent && tokens == o.tokens; }
  };
  struct KeyHash {
    uint64_t salt = 0;
    size_t operator()(const Key& k) const;
  };
  struct Entry {
    int64_t id = 0;
    std::vector<int32_t> blocks;  // [num_layers]
    uint64_t last_used = 0;
    int32_t depth = 0;
    const Key* key = nullptr;  // into index_
  };
  // Eviction order: oldest use first, then deepest.
  using LruKey = std::pair<uint64_t, std::pair<int32_t, int64_t>>;  // (tick, (-depth, id))
  LruKey LruOf(const Entry& e) const { return {e.last_used, {-e.depth, e.id}}; }
  // Of `blocks` (cached ones), those only the cache holds: what unpinning them frees.
  int64_t CacheOnlyBlocks(std::span<const int32_t> blocks) const;
  void Touch(Entry& e, uint64_t tick);
  void Evict(int64_t id);

  BlockPool& pool_;
  std::unordered_map<Key, int64_t, KeyHash> index_;  // key -> entry id
  std::unordered_map<int64_t, Entry> entries_;
  std::map<LruKey, int64_t> lru_;
  int64_t next_id_ = 1;
  uint64_t tick_ = 0;
  PrefixCacheStats stats_;
};

}  // namespace dropkv
