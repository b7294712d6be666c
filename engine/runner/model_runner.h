// The contract between the scheduler and the model runtime: one forward step
// for one prefill chunk or one batched decode step, over the paged KV cache.
// The runner owns the model, the block pool and the per-sequence cache state. It is used from one
// thread only (the engine thread). Nothing here throws: failures are statuses.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "engine/compression/plan.h"
#include "engine/request.h"
#include "engine/runner/runner_options.h"

namespace dropkv {

class BlockPool;
class KvSelector;
class Model;
struct ModelConfig;

using SequenceId = int64_t;

// What the scheduler needs to know about a sequence's cache after a step.
struct SequenceCacheInfo {
  int64_t logical_len = 0;  // next RoPE position
  std::vector<int64_t> stored_len_per_layer;
  int64_t num_blocks = 0;
  // Time the KvSelector spent scoring and selecting over the prefill so far (device time on CUDA,
  // wall time on CPU); 0 without compression.
  double compression_seconds = 0;
  // KV entries (token x layer) compression during decode evicted since the last prefill.
  int64_t decode_evicted_entries = 0;
};

// Compression during decode (CompressionParams::decode_margin), cumulative over the runner's life.
struct DecodeCompressionStats {
  int64_t num_evictions = 0;        // a layer of a sequence compacted back to its budget
  int64_t num_evicted_entries = 0;  // KV entries (token x layer) dropped by them
  double seconds = 0;               // scoring, selection and compaction (host wall time)
};

// The compression hook. The runner asks the registered factory for a selector when a
// Prefill's CompressionParams.method is not kNone; the selector's Select() then runs after each
// layer's attention (see kv_selector.h). A selector passed to PrefillWithSelector wins.
using KvSelectorFactory = std::function<absl::StatusOr<std::unique_ptr<KvSelector>>(
    const CompressionParams& compression, const ModelConfig& config)>;

// One prefill chunk of a Step: prompt tokens at positions [logical_len, logical_len + size) of
// `seq` (created on its first chunk), compressed by `compression` (not null) where its policy
// says so.
struct PrefillChunk {
  SequenceId seq = -1;
  std::span<const int32_t> tokens;
  bool is_last_chunk = false;
  const CompressionParams* compression = nullptr;
  // Also the logprob of each of the chunk's tokens given the tokens before it (the first prompt
  // token has none), with `num_top_logprobs` alternatives, for TakePromptLogprobs. Every chunk of
  // the prompt must ask, from position 0.
  bool return_prompt_logprobs = false;
  int32_t num_top_logprobs = 0;
};

// What the chunks with return_prompt_logprobs computed for a prompt of n tokens: for tokens
// 1..n-1, the log-softmax of the model's logits at the position before, at that token, and the
// best `num_top_logprobs` (token id, logprob) of that position, best first.
struct PromptLogprobs {
  std::vector<float> logprobs;                                       // [n - 1]
  std::vector<std::vector<std::pair<int32_t, float>>> top_logprobs;  // [n - 1][k]
};

class ModelRunner {
 public:
  static absl::StatusOr<std::unique_ptr<ModelRunner>> Create(const RunnerOptions& options);
  virtual ~ModelRunner() = default;

  virtual const ModelConfig& config() const = 0;
  virtual BlockPool& pool() = 0;
  // Blocks of the pool the runner holds for itself (CUDA graphs' padding rows write into one):
  // never free, never a sequence's.
  virtual int64_t num_reserved_blocks() const { return 0; }

  // The paged cache as compression plans count it (engine/compression/plan.h): the scheduler
  // admits a prompt and each of its chunks by the plan's blocks.
  virtual compression::KvCacheGeometry cache_geometry() const = 0;

  // Prefill `chunk` (the prompt tokens at positions [logical_len, logical_len + chunk.size()))
  // of sequence `seq` (created on its first chunk). When `is_last_chunk`, returns the fp32 logits
  // [vocab] of the last position; otherwise an undefined tensor. RESOURCE_EXHAUSTED when the pool
  // has no room (the scheduler checks the plan's blocks first, so that is an error): the sequence
  // is then left exactly as before the call.
  virtual absl::StatusOr<at::Tensor> Prefill(SequenceId seq, std::span<const int32_t> chunk,
                                             bool is_last_chunk,
                                             const CompressionParams& compression) = 0;

  // One forward step over a ragged batch: one decode token for each of `decode_seqs` (as
  // Decode) and the prefill `chunks` (as Prefill; each sequence at most once in the step), so the
  // linear layers read the weights once for all of them. Returns fp32 logits: the decode rows in
  // order, then one row per chunk that is its sequence's last, in order; undefined when there are
  // none. All-or-nothing: a failure leaves every sequence as before the call. Without chunks it
  // is Decode (CUDA graphs); compression runs inside, per chunk, as in Prefill.
  virtual absl::StatusOr<at::Tensor> Step(std::span<const SequenceId> decode_seqs,
                                          std::span<const int32_t> decode_tokens,
                                          std::span<const PrefillChunk> chunks) = 0;

  // Blocks the next Decode of `seqs` takes from the pool (each grows by one token in every
  // layer): the scheduler asks before the step and preempts until it fits.
  virtual int64_t BlocksToDecode(std::span<const SequenceId> seqs) const = 0;

  // One decode step for a batch: tokens[i] is appended to seqs[i] at its next position; returns
  // fp32 logits [batch, vocab]. RESOURCE_EXHAUSTED when a block cannot be allocated (the
  // scheduler's BlocksToDecode check makes that an internal error): nothing is changed for any
  // sequence.
  virtual absl::StatusOr<at::Tensor> Decode(std::span<const SequenceId> seqs,
                                            std::span<const int32_t> tokens) = 0;

  // Where the last Decode's host time went, in microseconds (with the previous step's ids just
  // read back, the device waits for the host until the step's first kernel is queued): checks and
  // slot allocation; packing the inputs, their upload and the graph launch (CUDA-graph steps
  // only); the whole call. Zeros where not measured.
  struct DecodeHostTimes {
    double prepare_us = 0, fill_us = 0, upload_us = 0, launch_us = 0, total_us = 0;
  };
  virtual DecodeHostTimes last_decode_host_times() const { return {}; }
  virtual DecodeCompressionStats decode_compression_stats() const { return {}; }

  // Starts `seq` from a cached prefix (allocator/prefix_cache.h): `tokens`, whole blocks, whose
  // K/V every layer l holds in the pool blocks `layer_blocks[l]` (shared: a reference is taken).
  // Its first prefill chunk then continues at position tokens.size(). ALREADY_EXISTS when `seq`
  // is known, INVALID_ARGUMENT when the blocks do not hold `tokens`.
  virtual absl::Status AdoptPrefix(SequenceId seq, std::span<const int32_t> tokens,
                                   std::span<const std::vector<int32_t>> layer_blocks) = 0;

  // Starts `dst` holding what `src` holds (a compressed conversation shared by several requests):
  // the full blocks shared, each layer's last partial block copied, the entries' positions the
  // same; either then goes on alone. NOT_FOUND / ALREADY_EXISTS; RESOURCE_EXHAUSTED (nothing
  // changed) without blocks for the copies; UNIMPLEMENTED where the runner cannot.
  virtual absl::Status ForkSequence(SequenceId src, SequenceId dst) {
    return absl::UnimplementedError("ForkSequence");
  }

  // The prompt logprobs of `seq`'s chunks so far (see PrefillChunk), moved out. UNIMPLEMENTED
  // where the runner cannot compute them.
  virtual absl::StatusOr<PromptLogprobs> TakePromptLogprobs(SequenceId seq) {
    return absl::UnimplementedError("prompt logprobs are not supported by this runner");
  }

  virtual SequenceCacheInfo CacheInfo(SequenceId seq) const = 0;
  // Drops `seq` and its references to its blocks; unknown ids are ignored.
  virtual void Release(SequenceId seq) = 0;

  // --- extensions; defaults keep test doubles of this interface compiling ----------------------
  virtual const Model* model() const { return nullptr; }
  // Turns CUDA-graph decode on or off from the next Decode (RunnerOptions.cuda_graphs at start);
  // benchmarks time both in one run. No effect on CPU.
  virtual void SetCudaGraphs(bool on) {}
  // Registers the selector factory used by Prefill (nullptr-like empty function = none).
  // Without one, a Prefill asking for compression is FAILED_PRECONDITION.
  virtual void SetKvSelectorFactory(KvSelectorFactory factory) {}
  // Prefill with an explicit selector (nullptr = keep everything), whatever compression.method is.
  // Chunked prefill: each chunk is stored in full unless the selector compacts the layer; when
  // it does, the layer's table is rewritten with the kept entries (per KV head), and later
  // chunks append after them. RoPE positions always continue from the logical length.
  virtual absl::StatusOr<at::Tensor> PrefillWithSelector(SequenceId seq,
                                                         std::span<const int32_t> chunk,
                                                         bool is_last_chunk, KvSelector* selector) {
    return absl::UnimplementedError("PrefillWithSelector");
  }
  // Keeps only entries `kept` (int64 [Hkv, k], indices into the layer's stored entries, sorted
  // per head) of one layer of `seq`. All-or-nothing; RESOURCE_EXHAUSTED leaves it unchanged.
  virtual absl::Status CompactLayer(SequenceId seq, int32_t layer_idx, const at::Tensor& kept) {
    return absl::UnimplementedError("CompactLayer");
  }
  // Positions (int64 [Hkv, stored_len]) of the entries a layer of `seq` holds.
  virtual absl::StatusOr<at::Tensor> StoredPositions(SequenceId seq, int32_t layer_idx) const {
    return absl::UnimplementedError("StoredPositions");
  }
  // For calibration: a full-cache causal forward of `tokens` from position 0 that does
  // not touch the pool; returns each layer's attention output (o_proj output, before the residual
  // add), [num_tokens, hidden] per layer, in the model dtype.
  virtual absl::StatusOr<std::vector<at::Tensor>> CaptureAttentionOutputs(
      std::span<const int32_t> tokens) {
    return absl::UnimplementedError("CaptureAttentionOutputs");
  }
};

}  // namespace dropkv
