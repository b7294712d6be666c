#include "allocator/block_pool.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <unordered_set>

#include "absl/strings/str_cat.h"

namespace dropkv {

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::Create(const BlockPoolOptions& options) {
  if (options.num_blocks <= 0 || options.num_blocks > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_blocks must be in [1, 2^31), got ", options.num_blocks));
  }
  if (options.block_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_size must be > 0, got ", options.block_size));
  }
  if (options.num_layers <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_layers must be > 0, got ", options.num_layers));
  }
  if (!options.layer_capacity.empty() &&
      (static_cast<int64_t>(options.layer_capacity.size()) != options.num_layers ||
       *std::min_element(options.layer_capacity.begin(), options.layer_capacity.end()) < 0)) {
    return absl::InvalidArgumentError(absl::StrCat("layer_capacity must list num_layers (",
                                                   options.num_layers, ") capacities >= 0, got ",
                                                   options.layer_capacity.size()));
  }
  if (options.allocate_storage && (options.num_kv_heads <= 0 || options.head_dim <= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("num_kv_heads and head_dim must be > 0, got ",
                                                   options.num_kv_heads, " and ",
                                                   options.head_dim));
  }
  std::unique_ptr<BlockPool> pool(new BlockPool(options));
  pool->ref_count_.assign(options.num_blocks, 0);
  pool->cached_.assign(options.num_blocks, 0);
  pool->free_list_.resize(options.num_blocks);
  // Pop from the back: block 0 is handed out first.
  for (int64_t i = 0; i < options.num_blocks; ++i) {
    pool->free_list_[i] = static_cast<int32_t>(options.num_blocks - 1 - i);
  }
  if (options.allocate_storage) {
    try {
      auto opts = at::TensorOptions().dtype(options.dtype).device(options.device);
      // [num_blocks, block_size, Hkv, D]; zeroed so unwritten slots are finite.
      pool->key_cache_ = at::zeros(
          {options.num_blocks, options.block_size, options.num_kv_heads, options.head_dim}, opts);
      pool->value_cache_ = at::zeros_like(pool->key_cache_);
    } catch (const std::exception& e) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate the KV pool (",
                                                       options.num_blocks, " blocks): ", e.what()));
    }
  }
  return pool;
}

int64_t BlockPool::BlocksFor(int64_t num_tokens) const {
  return (num_tokens + options_.block_size - 1) / options_.block_size;
}

absl::StatusOr<std::vector<int32_t>> BlockPool::AllocateBlocks(int64_t num_blocks) {
  if (num_blocks < 0) return absl::InvalidArgumentError("negative block count");
  if (!CanAllocate(num_blocks)) {
    return absl::ResourceExhaustedError(absl::StrCat("KV pool: need ", num_blocks, " blocks, ",
                                                     num_free_blocks(), " free of ",
                                                     this->num_blocks()));
  }
  const int64_t missing = num_blocks - static_cast<int64_t>(free_list_.size());
  if (missing > 0 && reclaimer_) reclaimer_(missing);
  if (static_cast<int64_t>(free_list_.size()) < num_blocks) {
    return absl::InternalError(absl::StrCat("KV pool: the prefix cache released too few blocks (",
                                            free_list_.size(), " free, need ", num_blocks, ")"));
  }
  std::vector<int32_t> out(num_blocks);
  for (int64_t i = 0; i < num_blocks; ++i) {
    out[i] = free_list_.back();
    free_list_.pop_back();
    ref_count_[out[i]] = 1;
  }
  return out;
}

void BlockPool::FreeBlocks(std::span<const int32_t> block_ids) {
  for (int32_t b : block_ids) {
    if (b < 0 || b >= num_blocks() || ref_count_[b] == 0)
      continue;  // double free: ignore, keep list sound
    CountReclaimable(b, -1);
    if (--ref_count_[b] == 0) {
      free_list_.push_back(b);
    } else {
      CountReclaimable(b, +1);
    }
  }
}

void BlockPool::RetainBlocks(std::span<const int32_t> block_ids) {
  for (int32_t b : block_ids) {
    CountReclaimable(b, -1);
    ++ref_count_[b];
  }
}

void BlockPool::PinForCache(std::span<const int32_t> block_ids) {
  for (int32_t b : block_ids) {
    if (cached_[b]) continue;
    ++ref_count_[b];
    cached_[b] = 1;
    ++num_cached_;
    CountReclaimable(b, +1);
  }
}

void BlockPool::UnpinFromCache(std::span<const int32_t> block_ids) {
  for (int32_t b : block_ids) {
    if (!cached_[b]) continue;
    CountReclaimable(b, -1);
    cached_[b] = 0;
    --num_cached_;
    if (--ref_count_[b] == 0) free_list_.push_back(b);
  }
}

absl::Status BlockPool::AddSequence(int64_t seq) {
  if (HasSequence(seq)) return absl::AlreadyExistsError(absl::StrCat("sequence ", seq, " exists"));
  SequenceBlocks s;
  s.layers.resize(options_.num_layers);
  seqs_.emplace(seq, std::move(s));
  return absl::OkStatus();
}

absl::Status BlockPool::AddSequenceSharing(int64_t seq, int64_t num_tokens,
                                           std::span<const std::vector<int32_t>> layer_blocks) {
  if (HasSequence(seq)) return absl::AlreadyExistsError(absl::StrCat("sequence ", seq, " exists"));
  if (static_cast<int32_t>(layer_blocks.size()) != num_layers() || num_tokens % block_size() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared prefix: ", layer_blocks.size(), " layers and ", num_tokens,
        " tokens; the pool has ", num_layers(), " layers of ", block_size(), "-token blocks"));
  }
  const auto n = static_cast<size_t>(num_tokens / block_size());
  for (int32_t l = 0; l < num_layers(); ++l) {
    if (layer_blocks[l].size() != n || capacity(l) > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shared prefix: layer ", l, " is bounded or holds another block count"));
    }
    for (int32_t b : layer_blocks[l]) {
      if (b < 0 || b >= num_blocks() || ref_count_[b] == 0)
        return absl::InvalidArgumentError(absl::StrCat("shared prefix: block ", b, " is free"));
    }
  }
  SequenceBlocks s;
  s.logical_len = num_tokens;
  s.layers.resize(num_layers());
  for (int32_t l = 0; l < num_layers(); ++l) {
    RetainBlocks(layer_blocks[l]);
    s.layers[l].block_ids = layer_blocks[l];
    s.layers[l].stored_len = s.logical_len;
  }
  seqs_.emplace(seq, std::move(s));
  return absl::OkStatus();
}

absl::Status BlockPool::ForkSequence(int64_t src, int64_t dst, std::vector<BlockCopy>* copies) {
  if (!HasSequence(src)) return absl::NotFoundError(absl::StrCat("unknown sequence ", src));
  if (HasSequence(dst)) return absl::AlreadyExistsError(absl::StrCat("sequence ", dst, " exists"));
  SequenceBlocks s = sequence(src);
  // A ring (sliding layer) is rewritten in place: it is copied whole. Other layers share their
  // full blocks and copy the last partial one.
  int64_t num_fresh = 0;
  for (int32_t l = 0; l < num_layers(); ++l) {
    const LayerBlockTable& t = s.layers[l];
    num_fresh += capacity(l) > 0 ? static_cast<int64_t>(t.block_ids.size())
                                 : t.stored_len % block_size() != 0;
  }
  auto fresh = AllocateBlocks(num_fresh);
  if (!fresh.ok()) return fresh.status();
  copies->clear();
  size_t next = 0;
  for (int32_t l = 0; l < num_layers(); ++l) {
    LayerBlockTable& t = s.layers[l];
    if (capacity(l) > 0) {
      for (int32_t& b : t.block_ids) {
        copies->push_back({b, (*fresh)[next]});
        b = (*fresh)[next++];
      }
      continue;
    }
    const auto num_full = static_cast<size_t>(t.stored_len / block_size());
    t.block_ids.resize(BlocksFor(t.stored_len));  // (a table may hold an empty block past them)
    RetainBlocks(std::span(t.block_ids).first(num_full));
    if (num_full < t.block_ids.size()) {
      copies->push_back({t.block_ids.back(), (*fresh)[next]});
      t.block_ids.back() = (*fresh)[next++];
    }
  }
  seqs_.emplace(dst, std::move(s));
  return absl::OkStatus();
}

void BlockPool::FreeSequence(int64_t seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  for (const auto& t : it->second.layers) FreeBlocks(t.block_ids);
  seqs_.erase(it);
}

const SequenceBlocks& BlockPool::sequence(int64_t seq) const {
  return seqs_.at(seq);
}
SequenceBlocks& BlockPool::mutable_sequence(int64_t seq) {
  return seqs_.at(seq);
}
const LayerBlockTable& BlockPool::table(int64_t seq, int32_t layer_idx) const {
  return sequence(seq).layers.at(layer_idx);
}
int64_t BlockPool::stored_len(int64_t seq, int32_t layer_idx) const {
  return table(seq, layer_idx).stored_len;
}
int64_t BlockPool::logical_len(int64_t seq) const {
  return sequence(seq).logical_len;
}
void BlockPool::set_logical_len(int64_t seq, int64_t logical_len) {
  mutable_sequence(seq).logical_len = logical_len;
}
int64_t BlockPool::num_blocks_of(int64_t seq) const {
  int64_t n = 0;
  for (const auto& t : sequence(seq).layers) n += static_cast<int64_t>(t.block_ids.size());
  return n;
}

int64_t BlockPool::Grown(const LayerBlockTable& t, int32_t layer_idx, int64_t num_tokens) const {
  const int64_t cap = capacity(layer_idx);
  const int64_t grown = t.stored_len + num_tokens;
  return cap > 0 ? std::min(grown, std::max(cap, t.stored_len)) : grown;
}

int64_t BlockPool::ExtraBlocks(const LayerBlockTable& t, int32_t layer_idx,
                               int64_t num_tokens) const {
  return std::max<int64_t>(
      0, BlocksFor(Grown(t, layer_idx, num_tokens)) - static_cast<int64_t>(t.block_ids.size()));
}

int64_t BlockPool::BlocksToAppend(std::span<const int64_t> seqs, int64_t num_tokens) const {
  int64_t n = 0;
  for (int64_t s : seqs) {
    const auto& layers = sequence(s).layers;
    for (int32_t l = 0; l < num_layers(); ++l) n += ExtraBlocks(layers[l], l, num_tokens);
  }
  return n;
}

absl::Status BlockPool::AppendSlots(std::span<const int64_t> seqs, int64_t num_tokens) {
  if (num_tokens < 0) return absl::InvalidArgumentError("negative token count");
  std::unordered_set<int64_t> seen;
  for (int64_t s : seqs) {
    if (!HasSequence(s)) return absl::NotFoundError(absl::StrCat("unknown sequence ", s));
    if (!seen.insert(s).second)
      return absl::InvalidArgumentError(absl::StrCat("sequence ", s, " listed twice"));
  }
  const int64_t need = BlocksToAppend(seqs, num_tokens);
  if (!CanAllocate(need)) {
    return absl::ResourceExhaustedError(absl::StrCat("KV pool: need ", need, " blocks, ",
                                                     num_free_blocks(), " free of ", num_blocks()));
  }
  for (int64_t s : seqs) {
    auto& layers = mutable_sequence(s).layers;
    for (int32_t l = 0; l < num_layers(); ++l) {
      auto& t = layers[l];
      auto blocks = AllocateBlocks(ExtraBlocks(t, l, num_tokens));  // cannot fail: checked above
      t.block_ids.insert(t.block_ids.end(), blocks->begin(), blocks->end());
      t.stored_len = Grown(t, l, num_tokens);
    }
  }
  return absl::OkStatus();
}

void BlockPool::UndoAppendSlots(std::span<const int64_t> seqs, int64_t num_tokens) {
  std::vector<int32_t> to_free;
  for (int64_t s : seqs) {
    if (!HasSequence(s)) continue;
    SequenceBlocks& seq = mutable_sequence(s);
    for (int32_t l = 0; l < num_layers(); ++l) {
      auto& t = seq.layers[l];
      const int64_t cap = capacity(l);
      if (cap > 0 && t.stored_len >= cap) {
        t.stored_len = std::min(cap, seq.logical_len);  // a full ring stayed full
      } else {
        t.stored_len = std::max<int64_t>(0, t.stored_len - num_tokens);
      }
      // AppendSlots fills the last block before taking a new one, so the blocks it took are
      // exactly those past the ones the remaining slots need.
      const auto keep = static_cast<size_t>(BlocksFor(t.stored_len));
      while (t.block_ids.size() > keep) {
        to_free.push_back(t.block_ids.back());
        t.block_ids.pop_back();
      }
    }
  }
  FreeBlocks(to_free);
}

absl::Status BlockPool::AppendLayerSlots(int64_t seq, int32_t layer_idx, int64_t num_tokens) {
  if (!HasSequence(seq)) return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
  if (num_tokens < 0) return absl::InvalidArgumentError("negative token count");
  auto& t = mutable_sequence(seq).layers.at(layer_idx);
  auto blocks = AllocateBlocks(ExtraBlocks(t, layer_idx, num_tokens));
  if (!blocks.ok()) return blocks.status();
  t.block_ids.insert(t.block_ids.end(), blocks->begin(), blocks->end());
  t.stored_len = Grown(t, layer_idx, num_tokens);
  return absl::OkStatus();
}

absl::Status BlockPool::ReplaceLayer(int64_t seq, int32_t layer_idx, int64_t stored_len,
                                     std::vector<int32_t>* old_block_ids) {
  if (!HasSequence(seq)) return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
  if (stored_len < 0) return absl::InvalidArgumentError("negative stored length");
  auto blocks = AllocateBlocks(BlocksFor(stored_len));
  if (!blocks.ok()) return blocks.status();
  auto& t = mutable_sequence(seq).layers.at(layer_idx);
  *old_block_ids = std::move(t.block_ids);
  t.block_ids = std::move(*blocks);
  t.stored_len = stored_len;
  return absl::OkStatus();
}

absl::Status BlockPool::TruncateLayer(int64_t seq, int32_t layer_idx, int64_t stored_len,
                                      std::vector<int32_t>* dropped_block_ids) {
  if (!HasSequence(seq)) return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
  auto& t = mutable_sequence(seq).layers.at(layer_idx);
  if (stored_len < 0 || stored_len > t.stored_len) {
    return absl::InvalidArgumentError(absl::StrCat("truncate layer ", layer_idx, " to ", stored_len,
                                                   " of ", t.stored_len, " entries"));
  }
  const auto keep = static_cast<size_t>(BlocksFor(stored_len));
  dropped_block_ids->assign(t.block_ids.begin() + keep, t.block_ids.end());
  t.block_ids.resize(keep);
  t.stored_len = stored_len;
  return absl::OkStatus();
}

void BlockPool::Restore(int64_t seq, SequenceBlocks snapshot) {
  auto& cur = mutable_sequence(seq);
  std::unordered_set<int32_t> keep;
  for (const auto& t : snapshot.layers) keep.insert(t.block_ids.begin(), t.block_ids.end());
  std::vector<int32_t> to_free;
  for (const auto& t : cur.layers) {
    for (int32_t b : t.block_ids) {
      if (!keep.contains(b)) to_free.push_back(b);
    }
  }
  FreeBlocks(to_free);
  cur = std::move(snapshot);
}

at::Tensor BlockPool::SlotIndices(int64_t seq, int32_t layer_idx, int64_t begin,
                                  int64_t end) const {
  const auto& t = table(seq, layer_idx);
  auto out = at::empty({end - begin}, at::kLong);
  int64_t* p = out.data_ptr<int64_t>();
  const int64_t bs = options_.block_size;
  for (int64_t j = begin; j < end; ++j) p[j - begin] = int64_t{t.block_ids[j / bs]} * bs + j % bs;
  return out;
}

}  // namespace dropkv
