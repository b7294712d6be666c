#include "allocator/prefix_cache.h"

#include <algorithm>

#include "absl/hash/hash.h"
#include "allocator/block_pool.h"

namespace dropkv {

size_t PrefixCache::KeyHash::operator()(const Key& k) const {
  return absl::HashOf(salt, k.parent, k.tokens);
}

PrefixCache::PrefixCache(BlockPool& pool, const std::string& salt)
    : pool_(pool), index_(0, KeyHash{absl::HashOf(salt)}) {
  pool_.set_reclaimer([this](int64_t n) { Reclaim(n); });
}

PrefixCache::~PrefixCache() {
  pool_.set_reclaimer(nullptr);
  Clear();
}

int64_t PrefixCache::CacheOnlyBlocks(std::span<const int32_t> blocks) const {
  int64_t n = 0;
  for (int32_t b : blocks) n += pool_.ref_count(b) == 1 ? 1 : 0;
  return n;
}

void PrefixCache::Touch(Entry& e, uint64_t tick) {
  lru_.erase(LruOf(e));
  e.last_used = tick;
  lru_.emplace(LruOf(e), e.id);
}

PrefixMatch PrefixCache::Match(std::span<const int32_t> tokens, int64_t max_tokens) {
  PrefixMatch match;
  match.layer_blocks.resize(pool_.num_layers());
  const int64_t bs = pool_.block_size();
  const int64_t limit = std::min<int64_t>(max_tokens, static_cast<int64_t>(tokens.size()));
  const uint64_t tick = ++tick_;
  Key key;
  for (int64_t begin = 0; begin + bs <= limit; begin += bs) {
    key.tokens.assign(tokens.begin() + begin, tokens.begin() + begin + bs);
    auto it = index_.find(key);
    if (it == index_.end()) break;
    Entry& e = entries_.at(it->second);
    Touch(e, tick);
    for (int32_t l = 0; l < pool_.num_layers(); ++l) match.layer_blocks[l].push_back(e.blocks[l]);
    match.entries.push_back(e.id);
    match.num_tokens = begin + bs;
    key.parent = e.id;
  }
  return match;
}

int64_t PrefixCache::ReclaimableBlocksOf(const PrefixMatch& match) const {
  int64_t n = 0;
  for (const auto& blocks : match.layer_blocks) n += CacheOnlyBlocks(blocks);
  return n;
}

void PrefixCache::Insert(int64_t seq, std::span<const int32_t> tokens, Cursor& cursor) {
  if (!pool_.HasSequence(seq)) return;
  const int64_t bs = pool_.block_size();
  int64_t num_full = static_cast<int64_t>(tokens.size()) / bs;
  for (int32_t l = 0; l < pool_.num_layers(); ++l)
    num_full = std::min(num_full, pool_.stored_len(seq, l) / bs);
  const uint64_t tick = ++tick_;
  Key key;
  key.parent = cursor.parent;
  for (int64_t i = cursor.num_blocks; i < num_full; ++i) {
    key.tokens.assign(tokens.begin() + i * bs, tokens.begin() + (i + 1) * bs);
    if (auto it = index_.find(key); it != index_.end()) {
      Entry& e = entries_.at(it->second);
      Touch(e, tick);
      key.parent = e.id;
      cursor = {i + 1, e.id};
      continue;
    }
    std::vector<int32_t> blocks;
    for (int32_t l = 0; l < pool_.num_layers(); ++l)
      blocks.push_back(pool_.table(seq, l).block_ids[i]);
    // A block already pinned belongs to another entry (a chain whose parent was evicted): one
    // entry per block, or unpinning one would free a block the other still lists.
    if (std::any_of(blocks.begin(), blocks.end(), [&](int32_t b) { return pool_.is_cached(b); }))
      break;
    pool_.PinForCache(blocks);
    Entry e;
    e.id = next_id_++;
    e.blocks = std::move(blocks);
    e.depth = static_cast<int32_t>(i);
    auto [it, inserted] = index_.emplace(key, e.id);
    e.key = &it->first;
    const int64_t id = e.id;
    entries_.emplace(id, std::move(e));
    Touch(entries_.at(id), tick);
    key.parent = id;
    cursor = {i + 1, id};
  }
  stats_.num_entries = static_cast<int64_t>(entries_.size());
}

void PrefixCache::Evict(int64_t id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  Entry& e = it->second;
  lru_.erase(LruOf(e));
  index_.erase(index_.find(*e.key));  // by iterator: e.key points into the node erased
  pool_.UnpinFromCache(e.blocks);
  entries_.erase(it);
  ++stats_.num_evicted_entries;
  stats_.num_entries = static_cast<int64_t>(entries_.size());
}

int64_t PrefixCache::Reclaim(int64_t num_blocks) {
  int64_t freed = 0;
  for (auto it = lru_.begin(); it != lru_.end() && freed < num_blocks;) {
    const int64_t id = it->second;
    ++it;  // Evict erases this element
    const int64_t reclaimable = CacheOnlyBlocks(entries_.at(id).blocks);
    if (reclaimable == 0) continue;  // a running sequence holds it
    Evict(id);
    freed += reclaimable;
  }
  return freed;
}

void PrefixCache::Clear() {
  while (!lru_.empty()) Evict(lru_.begin()->second);
}

}  // namespace dropkv
