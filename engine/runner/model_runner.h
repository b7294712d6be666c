// The contract between the scheduler (issue 7) and the model runtime (issue 3): one forward step
// for one prefill chunk or one batched decode step, over the paged KV cache.
// The runner owns the model, the block pool and the per-sequence cache state. It is used from one
// thread only (the engine thread). Nothing here throws: failures are statuses.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "engine/request.h"

namespace dropkv {

class BlockPool;
struct ModelConfig;

using SequenceId = int64_t;

struct RunnerOptions {
  std::string model_dir;           // Hugging Face folder; empty = the built-in demo model
  std::string device = "cpu";      // "cpu" or "cuda[:N]"
  std::string dtype = "auto";      // "auto" (bf16 on CUDA, fp32 on CPU), "float32", "bfloat16", "float16"
  int32_t block_size = 16;         // KV slots per block
  int64_t kv_cache_bytes = 0;      // 0 = a default (CPU: 1 GiB; CUDA: 90% of free memory after weights)
  int64_t num_kv_blocks = 0;       // > 0 overrides kv_cache_bytes (tests use tiny pools)
};

// What the scheduler needs to know about a sequence's cache after a step.
struct SequenceCacheInfo {
  int64_t logical_len = 0;                  // next RoPE position
  std::vector<int64_t> stored_len_per_layer;
  int64_t num_blocks = 0;
};

class ModelRunner {
 public:
  static absl::StatusOr<std::unique_ptr<ModelRunner>> Create(const RunnerOptions& options);
  virtual ~ModelRunner() = default;

  virtual const ModelConfig& config() const = 0;
  virtual BlockPool& pool() = 0;

  // Blocks a prompt of `prompt_len` tokens will hold after prefill under `compression`, plus
  // `decode_reserve_tokens` of decode room per layer. Admission control uses it.
  virtual int64_t BlocksForPrompt(int64_t prompt_len, const CompressionParams& compression,
                                  int64_t decode_reserve_tokens) const = 0;

  // Prefill `chunk` (the prompt tokens at positions [logical_len, logical_len + chunk.size()))
  // of sequence `seq` (created on its first chunk). When `is_last_chunk`, returns the fp32 logits
  // [vocab] of the last position; otherwise an undefined tensor. RESOURCE_EXHAUSTED when the pool
  // has no room: the sequence is then left exactly as before the call.
  virtual absl::StatusOr<at::Tensor> Prefill(SequenceId seq, std::span<const int32_t> chunk,
                                             bool is_last_chunk,
                                             const CompressionParams& compression) = 0;

  // One decode step for a batch: tokens[i] is appended to seqs[i] at its next position; returns
  // fp32 logits [batch, vocab]. RESOURCE_EXHAUSTED when a block cannot be allocated: nothing is
  // changed for any sequence, and the scheduler preempts and retries.
  virtual absl::StatusOr<at::Tensor> Decode(std::span<const SequenceId> seqs,
                                            std::span<const int32_t> tokens) = 0;

  virtual SequenceCacheInfo CacheInfo(SequenceId seq) const = 0;
  // Frees every block of `seq`; unknown ids are ignored.
  virtual void Release(SequenceId seq) = 0;
};

}  // namespace dropkv
