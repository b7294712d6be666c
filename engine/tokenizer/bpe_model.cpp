#include "engine/tokenizer/bpe_model.h"

#include <cstdio>
#include <queue>

namespace dropkv {
namespace {

struct Symbol {
  int32_t id;
  int32_t prev;
  int32_t next;
  bool alive;
};

struct Candidate {
  int32_t rank;
  int32_t pos;
  int32_t new_id;
  // std::priority_queue pops the largest: invert so the lowest rank, then leftmost, comes first.
  bool operator<(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
};

size_t Utf8Len(unsigned char lead) {
  return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
}

}  // namespace

void BpeModel::Finalize() {
  for (int b = 0; b < 256; ++b) {
    std::string key;
    if (byte_level) {
      key.assign(1, static_cast<char>(b));
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
      key = buf;
    }
    auto it = vocab.find(key);
    byte_ids_[b] = it == vocab.end() ? -1 : it->second;
  }
}

void BpeModel::Tokenize(std::string_view word, std::vector<int32_t>* ids) const {
  if (word.empty()) return;
  if (word.size() > kMaxCachedWordBytes) {
    TokenizeUncached(word, ids);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(cache_mu_);
    auto it = cache_.find(absl::string_view(word.data(), word.size()));
    if (it != cache_.end()) {
      ids->insert(ids->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> word_ids;
  TokenizeUncached(word, &word_ids);
  ids->insert(ids->end(), word_ids.begin(), word_ids.end());
  std::lock_guard<std::mutex> lock(cache_mu_);
  if (cache_.size() >= kMaxCacheEntries) cache_.clear();
  cache_.emplace(std::string(word), std::move(word_ids));
}

void BpeModel::TokenizeUncached(std::string_view word, std::vector<int32_t>* ids) const {
  if (ignore_merges) {
    auto it = vocab.find(absl::string_view(word.data(), word.size()));
    if (it != vocab.end()) {
      ids->push_back(it->second);
      return;
    }
  }
  // Initial symbols: bytes (byte-level) or characters, with byte fallback / unk for unknown ones.
  std::vector<Symbol> syms;
  syms.reserve(word.size());
  bool last_was_unk = false;
  auto push = [&](int32_t id) {
    const auto n = static_cast<int32_t>(syms.size());
    syms.push_back({id, n - 1, n + 1, true});
  };
  size_t i = 0;
  while (i < word.size()) {
    const size_t len =
        byte_level ? 1 : std::min(Utf8Len(static_cast<unsigned char>(word[i])), word.size() - i);
    const std::string_view piece = word.substr(i, len);
    i += len;
    int32_t id = -1;
    if (byte_level) {
      id = byte_ids_[static_cast<unsigned char>(piece[0])];
    } else {
      auto it = vocab.find(absl::string_view(piece.data(), piece.size()));
      if (it != vocab.end()) id = it->second;
    }
    if (id >= 0) {
      push(id);
      last_was_unk = false;
      continue;
    }
    if (byte_fallback && !byte_level) {
      bool all = true;
      for (char c : piece) all = all && byte_ids_[static_cast<unsigned char>(c)] >= 0;
      if (all) {
        for (char c : piece) push(byte_ids_[static_cast<unsigned char>(c)]);
        last_was_unk = false;
        continue;
      }
    }
    if (!unk_id) continue;  // HF drops characters it cannot represent when there is no unk
    if (fuse_unk && last_was_unk) continue;
    push(*unk_id);
    last_was_unk = true;
  }
  if (syms.empty()) return;
  syms.back().next = -1;
  if (syms.size() > 1) {
    std::priority_queue<Candidate> queue;
    auto pair_of = [&](int32_t a, int32_t b) -> const std::pair<int32_t, int32_t>* {
      auto it = merges.find((static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) |
                            static_cast<uint32_t>(b));
      return it == merges.end() ? nullptr : &it->second;
    };
    for (size_t k = 0; k + 1 < syms.size(); ++k) {
      if (const auto* m = pair_of(syms[k].id, syms[k + 1].id)) {
        queue.push({m->first, static_cast<int32_t>(k), m->second});
      }
    }
    while (!queue.empty()) {
      const Candidate top = queue.top();
      queue.pop();
      Symbol& cur = syms[top.pos];
      if (!cur.alive || cur.next < 0) continue;
      Symbol& right = syms[cur.next];
      const auto* m = pair_of(cur.id, right.id);
      if (m == nullptr || m->second != top.new_id) continue;  // stale entry
      cur.id = top.new_id;
      right.alive = false;
      cur.next = right.next;
      if (cur.next >= 0) syms[cur.next].prev = top.pos;
      if (cur.prev >= 0) {
        if (const auto* pm = pair_of(syms[cur.prev].id, cur.id)) {
          queue.push({pm->first, cur.prev, pm->second});
        }
      }
      if (cur.next >= 0) {
        if (const auto* nm = pair_of(cur.id, syms[cur.next].id)) {
          queue.push({nm->first, top.pos, nm->second});
        }
      }
    }
  }
  for (int32_t k = 0; k >= 0; k = syms[k].next) ids->push_back(syms[k].id);
}

}  // namespace dropkv
