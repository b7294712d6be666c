// The BPE model of HF tokenizers (models/bpe): ranked merges applied lowest rank first (leftmost on
// ties) with a priority queue, byte fallback, unk fusion, ignore_merges, and a word cache.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace dropkv {

class BpeModel {
 public:
  // Byte-level models (GPT-2 ByteLevel pre-tokenizer) are stored with their tokens translated back
  // to raw bytes, so words are split into bytes, not into characters of the mapped alphabet.
  bool byte_level = false;
  bool byte_fallback = false;
  bool fuse_unk = false;
  bool ignore_merges = false;
  std::optional<int32_t> unk_id;
  // Token (raw bytes when byte_level) -> id. Tokens a byte-level model can never produce are
  // absent.
  absl::flat_hash_map<std::string, int32_t> vocab;
  // (left id << 32 | right id) -> (rank, merged id).
  absl::flat_hash_map<uint64_t, std::pair<int32_t, int32_t>> merges;

  // Call after vocab is filled: caches the single-byte / <0xHH> ids.
  void Finalize();
  // Appends the ids of one pre-tokenized word. Thread-safe.
  void Tokenize(std::string_view word, std::vector<int32_t>* ids) const;

 private:
  void TokenizeUncached(std::string_view word, std::vector<int32_t>* ids) const;
  // byte_level: id of the one-byte token; byte_fallback: id of "<0xHH>". -1 when absent.
  std::array<int32_t, 256> byte_ids_{};
  static constexpr size_t kMaxCachedWordBytes = 64;
  static constexpr size_t kMaxCacheEntries = 1 << 16;
  mutable std::mutex cache_mu_;
  mutable absl::flat_hash_map<std::string, std::vector<int32_t>> cache_;
};

}  // namespace dropkv
