// A ModelRunner stand-in for scheduler and server tests until (and besides) the real runner: the
// real BlockPool does the KV accounting (so out-of-blocks is the pool's own answer), and the
// "model" is a fixed function of a sequence's token history, so a wrong row/sequence mapping, a
// lost token or a wrong replay after preemption changes the output.
// Next-token rule: target = (31 * sum_i (i+1) * token_i + 7) % vocab over prompt + generated;
// logits[v] = -|v - target| (argmax = target; sampling has a real distribution to work on).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include <ATen/ATen.h>

#include "allocator/block_pool.h"
#include "engine/common/status_macros.h"
#include "engine/compression/compression.h"
#include "engine/runner/model_runner.h"

namespace dropkv::testing {

class FakeRunner : public ModelRunner {
 public:
  static constexpr int32_t kVocab = 64;
  static constexpr int32_t kNumLayers = 2;

  FakeRunner(int64_t num_blocks, int32_t block_size) {
    BlockPoolOptions o;
    o.num_blocks = num_blocks;
    o.block_size = block_size;
    o.num_layers = kNumLayers;
    o.num_kv_heads = 1;
    o.head_dim = 4;
    o.allocate_storage = false;
    pool_ = std::move(*BlockPool::Create(o));
  }

  // The reference: what the model predicts after `history`.
  static int32_t NextToken(const std::vector<int32_t>& history) {
    int64_t h = 0;
    for (size_t i = 0; i < history.size(); ++i) h += static_cast<int64_t>(i + 1) * history[i];
    return static_cast<int32_t>((31 * h + 7) % kVocab);
  }
  // Greedy continuation of `prompt` for `n` tokens (the single-request reference).
  static std::vector<int32_t> Greedy(std::vector<int32_t> prompt, int n) {
    std::vector<int32_t> out;
    for (int i = 0; i < n; ++i) {
      out.push_back(NextToken(prompt));
      prompt.push_back(out.back());
    }
    return out;
  }
  // Fixed host times (20 us a step), so the scheduler's decode accounting can be checked.
  DecodeHostTimes last_decode_host_times() const override {
    return {.prepare_us = 10, .fill_us = 2, .upload_us = 3, .launch_us = 5, .total_us = 25};
  }

  const ModelConfig& config() const override { std::abort(); }
  BlockPool& pool() override { return *pool_; }

  compression::KvCacheGeometry cache_geometry() const override {
    return {.num_global_layers = kNumLayers, .block_size = pool_->block_size()};
  }

  // What a layer holding `n` entries (stored + chunk) keeps after a chunk that ends at `seen`
  // prompt tokens: the press's rule (chunk policy, then the DepthKV budget of `seen`).
  static int64_t Kept(const CompressionParams& c, int32_t layer, int64_t n, int64_t seen,
                      bool is_last_chunk) {
    if (c.method == ScoreMethod::kNone) return n;
    const bool compresses = c.chunk_policy == ChunkPolicy::kEveryChunk || is_last_chunk ||
                            (c.chunk_policy == ChunkPolicy::kBudget &&
                             n + std::max<int64_t>(c.chunk_size, 1) > c.budget_cap_tokens);
    if (!compresses) return n;
    return std::min(n, compression::KeptTokensPerLayer(c, kNumLayers, seen).value()[layer]);
  }

  absl::StatusOr<at::Tensor> Prefill(SequenceId seq, std::span<const int32_t> chunk,
                                     bool is_last_chunk, const CompressionParams& c) override {
    ++num_prefill_calls;
    prefill_chunk_lens.push_back(static_cast<int64_t>(chunk.size()));
    last_prefill_params = c;
    const bool is_new = !pool_->HasSequence(seq);
    if (is_new) {
      if (auto st = pool_->AddSequence(seq); !st.ok()) return st;
    }
    const SequenceBlocks before = pool_->Snapshot(seq);
    auto& hist = history_[seq];
    const int64_t new_len = static_cast<int64_t>(hist.size() + chunk.size());
    // As the runner does: an evicting layer writes its kept entries into new blocks and frees
    // the old ones when the whole chunk committed; the others append the chunk.
    std::vector<int32_t> deferred_free;
    for (int32_t l = 0; l < kNumLayers; ++l) {
      const int64_t stored = pool_->stored_len(seq, l);
      const int64_t seen = stored + static_cast<int64_t>(chunk.size());
      const int64_t stored_after = Kept(c, l, seen, new_len, is_last_chunk);
      std::vector<int32_t> old;
      absl::Status st = stored_after == seen ? pool_->AppendLayerSlots(seq, l, seen - stored)
                                             : pool_->ReplaceLayer(seq, l, stored_after, &old);
      deferred_free.insert(deferred_free.end(), old.begin(), old.end());
      if (!st.ok()) {
        ++num_prefill_failures;
        pool_->Restore(seq, before);
        if (is_new) pool_->FreeSequence(seq);
        return st;
      }
    }
    pool_->FreeBlocks(deferred_free);
    hist.insert(hist.end(), chunk.begin(), chunk.end());
    pool_->set_logical_len(seq, new_len);
    if (!is_last_chunk) return at::Tensor();
    return LogitsFor(hist);
  }

  // Decode, then each chunk's Prefill, undone together when any part fails (as the runner's one
  // forward is all-or-nothing).
  absl::StatusOr<at::Tensor> Step(std::span<const SequenceId> decode_seqs,
                                  std::span<const int32_t> decode_tokens,
                                  std::span<const PrefillChunk> chunks) override {
    ++num_step_calls;
    if (chunks.empty()) return Decode(decode_seqs, decode_tokens);
    if (!decode_seqs.empty()) ++num_mixed_steps;
    std::map<SequenceId, std::optional<SequenceBlocks>> before;
    for (SequenceId s : decode_seqs) before[s] = pool_->Snapshot(s);
    for (const PrefillChunk& c : chunks) {
      before[c.seq] =
          pool_->HasSequence(c.seq) ? std::optional(pool_->Snapshot(c.seq)) : std::nullopt;
    }
    const auto history_before = history_;
    auto undo = [&](absl::Status st) -> absl::Status {
      for (auto& [seq, blocks] : before) {
        if (blocks) {
          pool_->Restore(seq, *blocks);
        } else if (pool_->HasSequence(seq)) {
          pool_->FreeSequence(seq);
        }
      }
      history_ = history_before;
      return st;
    };
    std::vector<at::Tensor> rows;
    if (!decode_seqs.empty()) {
      auto logits = Decode(decode_seqs, decode_tokens);
      if (!logits.ok()) return logits.status();  // Decode changed nothing
      rows.push_back(*logits);
    }
    for (const PrefillChunk& c : chunks) {
      auto logits = Prefill(c.seq, c.tokens, c.is_last_chunk, *c.compression);
      if (!logits.ok()) return undo(logits.status());
      if (c.is_last_chunk) rows.push_back(logits->unsqueeze(0));
    }
    return rows.empty() ? at::Tensor() : at::cat(rows);
  }

  int64_t BlocksToDecode(std::span<const SequenceId> seqs) const override {
    const std::vector<int64_t> ids(seqs.begin(), seqs.end());
    return pool_->BlocksToAppend(ids, 1);
  }

  absl::StatusOr<at::Tensor> Decode(std::span<const SequenceId> seqs,
                                    std::span<const int32_t> tokens) override {
    ++num_decode_calls;
    last_decode_batch = static_cast<int32_t>(seqs.size());
    std::vector<int64_t> ids(seqs.begin(), seqs.end());
    if (auto st = pool_->AppendSlots(ids, 1); !st.ok()) {
      ++num_decode_failures;
      return st;
    }
    at::Tensor out = at::empty({static_cast<int64_t>(seqs.size()), kVocab}, at::kFloat);
    for (size_t i = 0; i < seqs.size(); ++i) {
      auto& hist = history_[seqs[i]];
      hist.push_back(tokens[i]);
      pool_->set_logical_len(seqs[i], static_cast<int64_t>(hist.size()));
      out[static_cast<int64_t>(i)].copy_(LogitsFor(hist));
    }
    return out;
  }

  absl::Status AdoptPrefix(SequenceId seq, std::span<const int32_t> tokens,
                           std::span<const std::vector<int32_t>> layer_blocks) override {
    ++num_adopted_prefixes;
    RETURN_IF_ERROR(
        pool_->AddSequenceSharing(seq, static_cast<int64_t>(tokens.size()), layer_blocks));
    history_[seq].assign(tokens.begin(), tokens.end());
    return absl::OkStatus();
  }

  absl::Status ForkSequence(SequenceId src, SequenceId dst) override {
    std::vector<BlockPool::BlockCopy> copies;  // no storage: nothing to copy
    RETURN_IF_ERROR(pool_->ForkSequence(src, dst, &copies));
    history_[dst] = history_.at(src);
    ++num_forks;
    return absl::OkStatus();
  }

  SequenceCacheInfo CacheInfo(SequenceId seq) const override {
    SequenceCacheInfo info;
    if (!pool_->HasSequence(seq)) return info;
    info.logical_len = pool_->logical_len(seq);
    for (int32_t l = 0; l < kNumLayers; ++l)
      info.stored_len_per_layer.push_back(pool_->stored_len(seq, l));
    info.num_blocks = pool_->num_blocks_of(seq);
    return info;
  }

  void Release(SequenceId seq) override {
    pool_->FreeSequence(seq);
    history_.erase(seq);
  }

  int64_t num_live_sequences() const { return static_cast<int64_t>(history_.size()); }
  int num_prefill_calls = 0;
  int num_forks = 0;
  int num_adopted_prefixes = 0;
  std::vector<int64_t> prefill_chunk_lens;  // every Prefill call's chunk length, in order
  CompressionParams last_prefill_params;
  int num_decode_calls = 0;
  int num_prefill_failures = 0;  // Prefill calls the pool could not hold
  int num_step_calls = 0;        // forwards the scheduler asked for (Step)
  int num_mixed_steps = 0;       // of which with decode rows and prefill chunks together
  int num_decode_failures = 0;   // Decode calls the pool could not hold
  int32_t last_decode_batch = 0;

 private:
  static at::Tensor LogitsFor(const std::vector<int32_t>& history) {
    const int32_t target = NextToken(history);
    // [vocab] fp32
    return -(at::arange(kVocab, at::kFloat) - static_cast<float>(target)).abs();
  }

  std::unique_ptr<BlockPool> pool_;
  std::map<SequenceId, std::vector<int32_t>> history_;
};

}  // namespace dropkv::testing
