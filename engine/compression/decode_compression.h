// Compression during decode (CompressionParams::decode_margin): the policy deciding when a
// sequence's layers have grown past their budget. The runner owns the mechanism (the ring of the
// last W decode queries, gathering a layer, storing what the press keeps) and asks this class
// after each decode step which layers to re-score with the press.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "engine/compression/kv_selector.h"
#include "engine/compression/params.h"

namespace dropkv::compression {

class DecodeCompression {
 public:
  // `press` scores and selects (its Budgets give the per-layer targets); a layer is compacted once
  // it holds more than its budget + `margin` entries, and only after `window` decode steps (the
  // queries it is scored with).
  DecodeCompression(std::unique_ptr<KvSelector> press, int32_t margin, int32_t window);

  // Whether `params` asks for compression during decode.
  static bool Enabled(const CompressionParams& params);

  // After one decode step of the sequence, now at `logical_len` tokens, whose global layer g holds
  // stored[g] entries: for each global layer, whether to score it and compact it to its budget
  // (all false when none is due). Budgets grow with the tokens seen, so a check against the
  // budgets of an earlier length is a cheap necessary condition; they are computed again only
  // when it passes.
  std::vector<bool> LayersToCompact(int64_t logical_len, std::span<const int64_t> stored);

  KvSelector& press() { return *press_; }
  int32_t window() const { return window_; }
  void AddEvicted(int64_t entries) { evicted_entries_ += entries; }
  // Entries evicted since the sequence's last prefill chunk.
  int64_t evicted_entries() const { return evicted_entries_; }

 private:
  bool OverBudget(std::span<const int64_t> stored) const;

  std::unique_ptr<KvSelector> press_;
  int32_t margin_ = 0;
  int32_t window_ = 0;
  int64_t num_decoded_ = 0;       // decode steps since the last prefill chunk
  std::vector<int64_t> budgets_;  // per global layer, at the logical length of the last check
  int64_t evicted_entries_ = 0;
};

}  // namespace dropkv::compression
