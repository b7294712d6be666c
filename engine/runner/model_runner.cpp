// ModelRunner on LibTorch: the Model forward with attention over the BlockPool (see
// model_runner.h for the contract). Prefill stores (or compacts) one layer at a time inside the
// forward, so only one layer's full-length K/V is alive at once.
#include "engine/runner/model_runner.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "allocator/block_pool.h"
#include "engine/common/status_macros.h"
#include "engine/compression/decode_compression.h"
#include "engine/compression/kv_selector.h"
#include "engine/model/attention.h"
#include "engine/model/config.h"
#include "engine/model/log.h"
#include "engine/model/model.h"
#include "engine/parallel/communicator.h"
#include "engine/runner/cuda_graph.h"
#include "engine/runner/decode_query_ring.h"
#include "engine/runner/demo_model.h"
#include "kernels/cache_ops.h"
#include "kernels/kv_cache_fp8.h"
#include "kernels/paged_attention.h"
#include "kernels/tuning.h"

namespace dropkv {
namespace {

double MicrosSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
      .count();
}

// A host tensor on `device` without a host sync: a plain .to() from pageable memory waits for the
// whole stream (PyTorch synchronizes after a blocking copy), which in prefill meant one stall per
// layer. Pinned (the caching host allocator, which keeps the block until the copy has run) and
// copied in stream order instead. CPU: the tensor itself.
at::Tensor ToDeviceAsync(const at::Tensor& host, const at::Device& device) {
  if (device.is_cpu()) return host;
  return host.pin_memory().to(device, /*non_blocking=*/true);
}

absl::StatusOr<at::ScalarType> ParseDtype(const std::string& s, bool cuda) {
  if (s == "auto") return cuda ? at::kBFloat16 : at::kFloat;
  if (s == "float32" || s == "fp32") return at::kFloat;
  if (s == "bfloat16" || s == "bf16") return at::kBFloat16;
  if (s == "float16" || s == "fp16") return at::kHalf;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype: '", s, "' is not one of auto, float32, bfloat16, float16"));
}

// The pool's storage dtype for kv_cache_dtype `s`: the model's, or float8 e4m3.
absl::StatusOr<at::ScalarType> ParseKvCacheDtype(const std::string& s, at::ScalarType model_dtype) {
  if (s == "auto") return model_dtype;
  if (s == "fp8") return kernels::kFp8KvDtype;
  return absl::InvalidArgumentError(
      absl::StrCat("kv_cache_dtype: '", s, "' is not one of auto, fp8"));
}

void SetCpuThreadsOnce() {
  static const bool done = [] {
    at::set_num_threads(kernels::Tuning().cpu_threads);
    return true;
  }();
  (void)done;
}

class TorchModelRunner;

// Attention over the paged cache for one prefill chunk of one sequence.
class PrefillBackend : public AttentionBackend {
 public:
  PrefillBackend(TorchModelRunner& runner, SequenceId seq, int64_t start_pos, bool is_last_chunk,
                 KvSelector* selector, LayerKvView::Pass pass)
      : runner_(runner),
        seq_(seq),
        start_pos_(start_pos),
        is_last_chunk_(is_last_chunk),
        selector_(selector),
        pass_(pass) {}
  absl::StatusOr<at::Tensor> Attend(int32_t layer_idx, const at::Tensor& q, const at::Tensor& k,
                                    const at::Tensor& v) override;
  std::vector<int32_t>& deferred_free() { return deferred_free_; }
  // Time spent in the selector over this chunk's layers (SequenceCacheInfo::compression_seconds).
  double selection_seconds() { return device_timer_ ? device_timer_->Seconds() : host_seconds_; }

 private:
  TorchModelRunner& runner_;
  SequenceId seq_;
  int64_t start_pos_;
  bool is_last_chunk_;
  KvSelector* selector_;
  LayerKvView::Pass pass_;
  std::vector<int32_t> deferred_free_;         // old blocks of compacted layers, freed on commit
  std::unique_ptr<DeviceTimer> device_timer_;  // CUDA: events around each Select, no host sync
  double host_seconds_ = 0;                    // CPU: wall time of each Select
};

// The inputs of one decode step, packed in one byte buffer so that one host-to-device copy moves
// them all. `batch` rows (a CUDA graph's bucket: rows past the real batch are padding) and
// `max_blocks` block-table columns (its context bucket).
struct DecodeLayout {
  int64_t batch = 0;
  int64_t num_layers = 0;
  int64_t max_blocks = 0;
  bool query_rows = false;  // some row keeps its queries (DecodeQueryRing)

  // int64: tokens [B] | positions [B] | slots [L, B] | query rows [B] (with query_rows); then
  // int32: lens [L, B] | tables [L, B, M].
  int64_t num_int64() const { return (query_rows ? 3 : 2) * batch + num_layers * batch; }
  int64_t num_int32() const { return num_layers * batch * (1 + max_blocks); }
  int64_t num_bytes() const { return 8 * num_int64() + 4 * num_int32(); }
  bool operator==(const DecodeLayout&) const = default;
};

// Typed views into a packed buffer (host or device).
struct DecodeInputs {
  at::Tensor tokens;      // int64 [B]
  at::Tensor positions;   // int64 [B]
  at::Tensor slots;       // int64 [L, B]: where each row's new K/V goes
  at::Tensor query_rows;  // int64 [B]: each row's query ring row (undefined: no ring)
  at::Tensor lens;        // int32 [L, B]: stored entries after this step (0 = padding row)
  at::Tensor tables;      // int32 [L, B, M]

  static DecodeInputs View(const at::Tensor& bytes, const DecodeLayout& lay) {
    const int64_t b = lay.batch, l = lay.num_layers;
    auto i64 = bytes.narrow(0, 0, 8 * lay.num_int64()).view(at::kLong);
    auto i32 = bytes.narrow(0, 8 * lay.num_int64(), 4 * lay.num_int32()).view(at::kInt);
    DecodeInputs in;
    in.tokens = i64.narrow(0, 0, b);
    in.positions = i64.narrow(0, b, b);
    in.slots = i64.narrow(0, 2 * b, l * b).view({l, b});
    if (lay.query_rows) in.query_rows = i64.narrow(0, 2 * b + l * b, b);
    in.lens = i32.narrow(0, 0, l * b).view({l, b});
    in.tables = i32.narrow(0, l * b, l * b * lay.max_blocks).view({l, b, lay.max_blocks});
    return in;
  }
};

// Attention over the paged cache for one decode step; the per-layer metadata is built once.
class DecodeBackend : public AttentionBackend {
 public:
  // use_kernel: kernels::PagedDecodeAttention (on CUDA the split-K kernel, on the CPU the CPU
  // kernel); else the ATen reference on the device (CUDA geometries the kernel lacks).
  // model_stores_kv: the model stores each row's K/V fused with RoPE (kv_slots); off in a mixed
  // step, whose forward also carries prefill rows: Attend stores them.
  // query_ring: DecodeQueryRing::storage(), where each global layer's queries go (rows
  // in.query_rows); undefined without.
  DecodeBackend(BlockPool& pool, const ModelConfig& config, DecodeInputs in, int32_t max_seq_len,
                bool use_kernel, bool model_stores_kv = true, at::Tensor query_ring = {})
      : pool_(pool),
        config_(config),
        in_(std::move(in)),
        max_seq_len_(max_seq_len),
        use_kernel_(use_kernel),
        model_stores_kv_(model_stores_kv),
        query_ring_(in_.query_rows.defined() ? std::move(query_ring) : at::Tensor()) {}
  bool wants_contiguous() const override { return false; }
  std::optional<KvSlots> kv_slots(int32_t layer_idx) override {
    if (!model_stores_kv_) return std::nullopt;
    return KvSlots{pool_.key_cache(), pool_.value_cache(), in_.slots[layer_idx]};
  }
  absl::StatusOr<at::Tensor> Attend(int32_t layer_idx, const at::Tensor& q, const at::Tensor& k,
                                    const at::Tensor& v) override {
    const auto& kc = pool_.key_cache();
    const auto& vc = pool_.value_cache();
    if (query_ring_.defined() && !config_.is_sliding(layer_idx))
      query_ring_[layer_idx].index_copy_(0, in_.query_rows, q);
    if (k.defined()) {  // else the model stored them with RoPE (kv_slots)
      const int64_t hkv = kc.size(2);
      const int64_t d = kc.size(3);
      const auto slots = in_.slots[layer_idx];  // int64 [B]
      auto k_rows = kc.view({-1, hkv, d});
      auto v_rows = vc.view({-1, hkv, d});
      kernels::ScatterRows(k_rows, slots, kernels::ToCacheDtype(k, kc));
      kernels::ScatterRows(v_rows, slots, kernels::ToCacheDtype(v, vc));
    }
    const double scale = config_.attention_scale(layer_idx);
    if (use_kernel_) {
      kernels::PagedAttentionParams params;
      params.scale = scale;
      params.softcap = config_.attn_logit_softcapping;  // 0 on CUDA (UseDecodeKernel)
      // CUDA: the kernel reads the block tables on the device: no host sync per layer; the grid
      // comes from max_seq_len, known on the host (fixed per captured graph).
      params.max_seq_len = max_seq_len_;
      // Both hold for a decode step: its tables and lengths were copied from the host before the
      // step's first kernel, and the op right before this one (RoPE + K/V store, in its own
      // kernel or the qkv GEMV's epilogue, or the index_copy_ above) writes only each sequence's
      // newest entry. That entry is the last one except in a sliding layer's ring, where it
      // overwrites an older entry in place.
      params.metadata_uploaded = true;
      params.older_keys_ready = !config_.is_sliding(layer_idx);
      return kernels::PagedDecodeAttention(q, kc, vc, in_.tables[layer_idx], in_.lens[layer_idx],
                                           params);
    }
    return PagedDecodeAttention(q, kc, vc, in_.tables[layer_idx], in_.lens[layer_idx], scale,
                                config_.attn_logit_softcapping);
  }

 private:
  BlockPool& pool_;
  const ModelConfig& config_;
  DecodeInputs in_;
  int32_t max_seq_len_;
  bool use_kernel_;
  bool model_stores_kv_;
  at::Tensor query_ring_;
};

// Attention of a mixed step (ModelRunner::Step): rows [0, num_decode) are decode rows, then each
// prefill chunk's rows in order; each part goes to its own backend, so a step's linear layers read
// the weights once for every sequence in it.
class MixedBackend : public AttentionBackend {
 public:
  struct Segment {
    AttentionBackend* backend;
    int64_t num_rows;
  };
  explicit MixedBackend(std::vector<Segment> segments) : segments_(std::move(segments)) {}
  absl::StatusOr<at::Tensor> Attend(int32_t layer_idx, const at::Tensor& q, const at::Tensor& k,
                                    const at::Tensor& v) override {
    std::vector<at::Tensor> outs;
    int64_t row = 0;
    for (const Segment& s : segments_) {
      ASSIGN_OR_RETURN(at::Tensor out, s.backend->Attend(layer_idx, q.narrow(0, row, s.num_rows),
                                                         k.narrow(0, row, s.num_rows),
                                                         v.narrow(0, row, s.num_rows)));
      outs.push_back(std::move(out));
      row += s.num_rows;
    }
    return outs.size() == 1 ? outs[0] : at::cat(outs, 0);
  }

 private:
  std::vector<Segment> segments_;
};

// Graph buckets. Batch: powers of two to 8, then multiples of 16 to 64, then of 64 (a decode
// GEMV reads the weights once whatever the rows, so padding rows cost little). Context (block
// table columns): at least 16, then four steps per doubling (<= 25% padding of the table).
int64_t BatchBucket(int64_t batch) {
  if (batch <= 8) return int64_t{1} << static_cast<int>(std::ceil(std::log2(batch)));
  if (batch <= 64) return (batch + 15) / 16 * 16;
  return (batch + 63) / 64 * 64;
}
int64_t BlocksBucket(int64_t blocks) {
  if (blocks <= 16) return 16;
  int64_t p = 16;
  while (p * 2 < blocks) p *= 2;
  const int64_t step = p / 4;
  return (blocks + step - 1) / step * step;
}
constexpr int64_t kMaxGraphBatch = 512;
constexpr int64_t kMaxGraphInputBytes = int64_t{64} << 20;  // per graph's packed inputs
constexpr size_t kMaxGraphs = 64;  // more: drop them all and capture again as needed

// One captured decode step and its input buffers.
struct DecodeGraph {
  DecodeLayout layout;
  std::unique_ptr<StagedUpload> inputs;
  std::unique_ptr<CapturedGraph> graph;
};

class TorchModelRunner : public ModelRunner {
 public:
  TorchModelRunner(RunnerOptions options, std::unique_ptr<Model> model,
                   std::unique_ptr<BlockPool> pool, int32_t scratch_block)
      : options_(std::move(options)),
        model_(std::move(model)),
        pool_(std::move(pool)),
        query_ring_(config().num_layers, config().num_heads, config().head_dim,
                    at::TensorOptions().dtype(model_->dtype()).device(model_->device())),
        scratch_block_(scratch_block) {
    for (int32_t l = 0, g = 0; l < config().num_layers; ++l)
      global_index_.push_back(config().is_sliding(l) ? -1 : g++);
  }

  const ModelConfig& config() const override { return model_->config(); }
  BlockPool& pool() override { return *pool_; }
  int64_t num_reserved_blocks() const override { return scratch_block_ >= 0 ? 1 : 0; }
  int64_t BlocksToDecode(std::span<const SequenceId> seqs) const override {
    const std::vector<int64_t> ids(seqs.begin(), seqs.end());
    return pool_->BlocksToAppend(ids, 1);
  }
  const Model* model() const override { return model_.get(); }
  void SetKvSelectorFactory(KvSelectorFactory factory) override { factory_ = std::move(factory); }
  void SetCudaGraphs(bool on) override { options_.cuda_graphs = on; }

  compression::KvCacheGeometry cache_geometry() const override {
    compression::KvCacheGeometry g;
    g.num_global_layers = config().num_global_layers();
    g.num_sliding_layers = config().num_sliding_layers();
    g.sliding_capacity = g.num_sliding_layers > 0 ? config().sliding_window : 0;
    g.block_size = pool_->block_size();
    return g;
  }

  absl::StatusOr<at::Tensor> Prefill(SequenceId seq, std::span<const int32_t> chunk,
                                     bool is_last_chunk,
                                     const CompressionParams& compression) override {
    const PrefillChunk c{seq, chunk, is_last_chunk, &compression};
    ASSIGN_OR_RETURN(at::Tensor logits, Step({}, {}, std::span<const PrefillChunk>(&c, 1)));
    return is_last_chunk ? logits.squeeze(0) : at::Tensor();  // fp32 [vocab]
  }

  absl::StatusOr<at::Tensor> PrefillWithSelector(SequenceId seq, std::span<const int32_t> chunk,
                                                 bool is_last_chunk,
                                                 KvSelector* selector) override {
    const ChunkWork c{seq, chunk, is_last_chunk, selector};
    ASSIGN_OR_RETURN(at::Tensor logits, Forward({}, {}, std::span<const ChunkWork>(&c, 1)));
    return is_last_chunk ? logits.squeeze(0) : at::Tensor();  // fp32 [vocab]
  }

  absl::StatusOr<at::Tensor> Step(std::span<const SequenceId> decode_seqs,
                                  std::span<const int32_t> decode_tokens,
                                  std::span<const PrefillChunk> chunks) override {
    if (chunks.empty()) return Decode(decode_seqs, decode_tokens);
    std::vector<ChunkWork> work;
    for (const PrefillChunk& c : chunks) {
      ASSIGN_OR_RETURN(KvSelector * selector, SelectorFor(c.seq, *c.compression));
      work.push_back({c.seq, c.tokens, c.is_last_chunk, selector, c.return_prompt_logprobs,
                      c.num_top_logprobs});
      if (selector != nullptr && c.compression->scoring_queries == ScoringQueries::kReplay) {
        const std::vector<int32_t>& fed = RecordReplayTokens(c.seq, c.tokens);
        if (c.is_last_chunk) work.back().replay_tokens = &fed;
      }
    }
    const std::vector<int64_t> ids(decode_seqs.begin(), decode_seqs.end());
    auto logits = Forward(ids, decode_tokens, work);
    // A press lives from a sequence's first chunk to its last (H2O sums over every chunk).
    if (logits.ok()) {
      for (const PrefillChunk& c : chunks) {
        if (!c.is_last_chunk) continue;
        selectors_.erase(c.seq);
        replay_tokens_.erase(c.seq);
        SetDecodeCompression(c.seq, *c.compression);
      }
      CompressDuringDecode(ids);
    }
    return logits;
  }

  absl::StatusOr<at::Tensor> Decode(std::span<const SequenceId> seqs,
                                    std::span<const int32_t> tokens) override {
    host_times_ = {};
    const auto start = std::chrono::steady_clock::now();
    if (seqs.size() != tokens.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("decode: ", seqs.size(), " sequences but ", tokens.size(), " tokens"));
    }
    if (seqs.empty()) return absl::InvalidArgumentError("decode: empty batch");
    RETURN_IF_ERROR(CheckTokens(tokens));
    for (SequenceId s : seqs) {
      if (!pool_->HasSequence(s))
        return absl::NotFoundError(absl::StrCat("decode: unknown sequence ", s));
    }
    c10::InferenceMode guard;
    const std::vector<int64_t> ids(seqs.begin(), seqs.end());
    RETURN_IF_ERROR(pool_->AppendSlots(ids, 1));  // all-or-nothing; RESOURCE_EXHAUSTED unchanged
    auto undo = [&](absl::Status st) -> absl::Status {
      pool_->UndoAppendSlots(ids, 1);
      return st;
    };
    try {
      const DecodeExtents ext = ExtentsOf(ids);
      host_times_.prepare_us = MicrosSince(start);
      at::Tensor logits;
      if (UseGraphs(static_cast<int64_t>(ids.size()), ext.max_blocks)) {
        auto graphed = DecodeWithGraph(ids, tokens, ext.max_blocks);
        if (!graphed.ok()) return undo(graphed.status());
        logits = *graphed;
      }
      if (!logits.defined()) {
        DecodeInputs in = UploadDecodeInputs(ids, tokens, ext);
        DecodeBackend backend(*pool_, config(), in, static_cast<int32_t>(ext.max_len),
                              UseDecodeKernel(), /*model_stores_kv=*/true, query_ring_.storage());
        auto hidden = model_->Forward(in.tokens, in.positions, ext.max_pos, backend);
        if (!hidden.ok()) return undo(hidden.status());
        logits = model_->Logits(*hidden);  // fp32 [B, vocab]
      }
      for (int64_t s : ids) pool_->set_logical_len(s, pool_->logical_len(s) + 1);
      host_times_.total_us = MicrosSince(start);
      CompressDuringDecode(ids);
      return logits;
    } catch (const std::exception& e) {
      return undo(absl::InternalError(absl::StrCat("decode failed: ", e.what())));
    }
  }

  DecodeHostTimes last_decode_host_times() const override { return host_times_; }

  // What a decode batch's inputs are sized by: the longest block table, the largest position
  // and the most entries any layer of its sequences holds (after this step's append).
  struct DecodeExtents {
    int64_t max_blocks = 1, max_pos = 0, max_len = 1;
  };
  DecodeExtents ExtentsOf(std::span<const int64_t> ids) const {
    DecodeExtents e;
    for (int64_t s : ids) {
      const SequenceBlocks& seq = pool_->sequence(s);
      e.max_pos = std::max(e.max_pos, seq.logical_len);
      for (const auto& t : seq.layers) {
        e.max_blocks = std::max<int64_t>(e.max_blocks, t.block_ids.size());
        e.max_len = std::max(e.max_len, t.stored_len);
      }
    }
    return e;
  }
  // An eager decode batch's inputs: packed on the host, one copy to the device.
  DecodeInputs UploadDecodeInputs(std::span<const int64_t> ids, std::span<const int32_t> tokens,
                                  const DecodeExtents& ext) const {
    const DecodeLayout lay{static_cast<int64_t>(ids.size()), config().num_layers, ext.max_blocks,
                           KeepsQueries(ids)};
    auto host = at::empty({lay.num_bytes()}, at::kByte);
    FillDecodeInputs(host.data_ptr<uint8_t>(), lay, ids, tokens);
    return DecodeInputs::View(ToDeviceAsync(host, model_->device()), lay);
  }

  // One prefill chunk of a forward, with its press (nullptr: keep everything).
  struct ChunkWork {
    SequenceId seq;
    std::span<const int32_t> tokens;
    bool is_last_chunk;
    KvSelector* selector;
    bool return_prompt_logprobs = false;
    int32_t num_top_logprobs = 0;
    LayerKvView::Pass pass = LayerKvView::Pass::kPrompt;
    // A last chunk whose press scores by a replay (CompressionParams::scoring_queries): the
    // tokens to replay, the ones this sequence's prefill fed.
    const std::vector<int32_t>* replay_tokens = nullptr;
  };

  // A prompt's logprobs so far, on the device: per chunk the logprobs of its tokens (from the
  // second prompt token) and their top alternatives; `carry` is the log-softmax row of the last
  // position seen, which scores the next chunk's first token.
  struct PromptLogprobParts {
    std::vector<at::Tensor> logprobs, top_values, top_ids;
    at::Tensor carry;  // fp32 [vocab]
  };

  // Scores `tokens` (one chunk, `hidden` its final hidden states [n, hidden]) into `parts`. The
  // logits of every position are projected in slices: a whole 512-token chunk at a 150K
  // vocabulary would be 300 MB at once.
  void ScorePromptChunk(const at::Tensor& hidden, std::span<const int32_t> tokens, int32_t top_k,
                        PromptLogprobParts& parts) const {
    constexpr int64_t kSliceRows = 128;
    const int64_t n = hidden.size(0);
    const at::Tensor ids = TokensTensor(tokens);
    for (int64_t begin = 0; begin < n; begin += kSliceRows) {
      const int64_t len = std::min(kSliceRows, n - begin);
      at::Tensor lp = model_->Logits(hidden.narrow(0, begin, len)).log_softmax(1);  // [len, V]
      // Row r predicts token begin + r + 1; the carried row predicts token begin.
      at::Tensor pred = parts.carry.defined()
                            ? at::cat({parts.carry.unsqueeze(0), lp.narrow(0, 0, len - 1)})
                            : lp.narrow(0, 0, len - 1);
      const int64_t first = parts.carry.defined() ? begin : begin + 1;
      parts.carry = lp[len - 1].clone();  // not a view that keeps the whole slice alive
      if (pred.size(0) == 0) continue;
      at::Tensor targets = ids.narrow(0, first, begin + len - first).unsqueeze(1);
      parts.logprobs.push_back(pred.gather(1, targets).squeeze(1));
      if (top_k > 0) {
        auto [values, top_ids] = pred.topk(std::min<int64_t>(top_k, pred.size(1)), 1);
        parts.top_values.push_back(values);
        parts.top_ids.push_back(top_ids);
      }
    }
  }

  // The press of `seq` for `compression` (nullptr for none), created at its first chunk.
  absl::StatusOr<KvSelector*> SelectorFor(SequenceId seq, const CompressionParams& compression) {
    if (compression.method == ScoreMethod::kNone) return nullptr;
    if (!factory_) {
      return absl::FailedPreconditionError(
          "compression requested but no KvSelector factory is registered");
    }
    auto& selector = selectors_[seq];
    if (!selector) {
      auto created = factory_(compression, config());
      if (!created.ok()) {
        selectors_.erase(seq);
        return created.status();
      }
      selector = std::move(*created);
    }
    return selector.get();
  }

  // --- replay scoring (CompressionParams::scoring_queries kReplay) ------------------------------

  // Appends a chunk to the tokens `seq`'s prefill fed (a chunk fed again after a failed step
  // replaces what it fed); returns them.
  const std::vector<int32_t>& RecordReplayTokens(SequenceId seq, std::span<const int32_t> chunk) {
    const int64_t start = pool_->HasSequence(seq) ? pool_->logical_len(seq) : 0;
    FedTokens& fed = replay_tokens_[seq];
    if (fed.tokens.empty() || start < fed.begin) {
      fed.begin = start;
      fed.tokens.clear();
    }
    fed.tokens.resize(static_cast<size_t>(start - fed.begin));
    fed.tokens.insert(fed.tokens.end(), chunk.begin(), chunk.end());
    return fed.tokens;
  }

  // The press of `seq` scores its stored entries by `tokens` fed again after them (in chunks of
  // kReplayChunkTokens, each on a scratch copy of the sequence that is dropped after), then each
  // global layer keeps what the press selects from the summed scores. The old blocks of the
  // compacted layers go to `old` (freed by the caller on commit). Nothing to do when every layer
  // is within its budget.
  absl::Status ReplayAndSelect(SequenceId seq, KvSelector& press,
                               const std::vector<int32_t>& tokens, std::vector<int32_t>& old) {
    ASSIGN_OR_RETURN(std::vector<int64_t> budgets, press.Budgets(pool_->logical_len(seq)));
    bool evicts = false;
    for (int32_t l = 0; l < config().num_layers; ++l) {
      const int32_t g = global_index(l);
      if (g >= 0 && static_cast<size_t>(g) < budgets.size())
        evicts |= budgets[g] < pool_->stored_len(seq, l);
    }
    if (!evicts || tokens.empty()) return absl::OkStatus();
    constexpr SequenceId kScratch = std::numeric_limits<SequenceId>::min();
    for (size_t begin = 0; begin < tokens.size(); begin += kReplayChunkTokens) {
      const size_t len = std::min<size_t>(kReplayChunkTokens, tokens.size() - begin);
      if (absl::Status st = ForkSequence(seq, kScratch); !st.ok()) {
        return absl::Status(st.code(), absl::StrCat("scoring_queries replay: ", st.message()));
      }
      ChunkWork replay{kScratch, std::span<const int32_t>(tokens).subspan(begin, len),
                       /*is_last_chunk=*/false, &press};
      replay.pass = LayerKvView::Pass::kReplay;
      absl::StatusOr<at::Tensor> done = Forward({}, {}, std::span<const ChunkWork>(&replay, 1));
      Release(kScratch);
      RETURN_IF_ERROR(done.status());
    }
    const at::Tensor no_queries =
        at::empty({config().num_heads, 0, config().head_dim},
                  at::TensorOptions().dtype(model_->dtype()).device(model_->device()));
    for (int32_t l = 0; l < config().num_layers; ++l) {
      if (config().is_sliding(l)) continue;
      ASSIGN_OR_RETURN(LayerKvView view, StoredLayerView(seq, l, no_queries));
      view.pass = LayerKvView::Pass::kReplaySelect;
      ASSIGN_OR_RETURN(std::optional<at::Tensor> kept, press.Select(view));
      if (!kept) continue;
      std::vector<int32_t> replaced;  // StoreKept hands back this layer's old blocks
      RETURN_IF_ERROR(StoreKept(seq, l, view.keys, view.values, view.positions, *kept,
                                /*in_place=*/false, &replaced));
      old.insert(old.end(), replaced.begin(), replaced.end());
    }
    return absl::OkStatus();
  }

  // --- compression during decode (CompressionParams::decode_margin) ----------------------------
  // The policy (when, which layers) is compression::DecodeCompression's; here: the query ring,
  // gathering a layer and storing what the press keeps.

  bool KeepsQueries(std::span<const int64_t> ids) const {
    if (query_ring_.empty()) return false;
    return std::any_of(ids.begin(), ids.end(), [&](int64_t s) { return query_ring_.Has(s); });
  }

  // At a sequence's last prefill chunk: compression during decode on (with a press of its own
  // and W query rows) when `compression` asks for it, else off.
  void SetDecodeCompression(SequenceId seq, const CompressionParams& compression) {
    decode_presses_.erase(seq);
    query_ring_.Remove(seq);
    if (!compression::DecodeCompression::Enabled(compression)) return;
    // Decode steps score with their own last W queries: a window press whatever the prefill's.
    CompressionParams decode_compression = compression;
    decode_compression.scoring_queries = ScoringQueries::kWindow;
    auto press = factory_(decode_compression, config());  // SelectorFor made one: a factory
    absl::Status st = press.ok() ? query_ring_.Add(seq, compression.window) : press.status();
    if (!st.ok()) {
      LogWarn(absl::StrCat("sequence ", seq, ": no compression during decode: ", st.ToString()));
      return;
    }
    decode_presses_.try_emplace(seq, std::move(*press), compression.decode_margin,
                                compression.window);
  }

  // After a decode step of `ids` (logical lengths moved on): each layer the policy finds over its
  // budget is scored with the queries of its last W decode steps and compacted to the budget. A
  // failed eviction leaves the layer as it was (the next step tries again).
  void CompressDuringDecode(std::span<const int64_t> ids) {
    if (decode_presses_.empty()) return;
    const int32_t num_global = config().num_global_layers();
    std::vector<int64_t> stored(num_global);
    for (int64_t seq : ids) {
      auto it = decode_presses_.find(seq);
      if (it == decode_presses_.end()) continue;
      compression::DecodeCompression& d = it->second;
      for (int32_t l = 0; l < config().num_layers; ++l) {
        if (const int32_t g = global_index(l); g >= 0) stored[g] = pool_->stored_len(seq, l);
      }
      const std::vector<bool> due = d.LayersToCompact(pool_->logical_len(seq), stored);
      if (std::none_of(due.begin(), due.end(), [](bool b) { return b; })) continue;
      const auto start = std::chrono::steady_clock::now();
      for (int32_t l = 0; l < config().num_layers; ++l) {
        const int32_t g = global_index(l);
        if (g < 0 || !due[g]) continue;
        absl::StatusOr<int64_t> evicted = EvictDuringDecode(seq, l, d.press());
        if (!evicted.ok()) {
          LogWarn(
              absl::StrCat("sequence ", seq, " layer ", l,
                           ": compression during decode failed: ", evicted.status().ToString()));
          continue;
        }
        d.AddEvicted(*evicted);
        ++decode_stats_.num_evictions;
        decode_stats_.num_evicted_entries += *evicted;
      }
      decode_stats_.seconds += MicrosSince(start) * 1e-6;
    }
  }

  // Whether no other sequence or the prefix cache holds a block of this layer of `seq`.
  bool OwnsEveryBlock(SequenceId seq, int32_t layer_idx) const {
    for (int32_t b : pool_->table(seq, layer_idx).block_ids) {
      if (pool_->ref_count(b) != 1 || pool_->is_cached(b)) return false;
    }
    return true;
  }

  // A selector's view of what a layer of `seq` holds after a forward, scored by `queries`
  // ([Hq, rows, D]): the decode eviction's and the replay's selection read it.
  absl::StatusOr<LayerKvView> StoredLayerView(SequenceId seq, int32_t layer_idx,
                                              at::Tensor queries) const {
    LayerKvView view;
    view.layer_idx = global_index(layer_idx);
    view.num_layers = config().num_global_layers();
    view.logical_len = pool_->logical_len(seq);
    view.queries = std::move(queries);
    std::tie(view.keys, view.values) = GatherLayer(seq, layer_idx);
    ASSIGN_OR_RETURN(view.positions, StoredPositions(seq, layer_idx));
    view.is_last_chunk = true;
    view.reduce_scores = score_reducer();
    view.max_over_ranks = rank_max();
    return view;
  }

  // One layer of `seq` scored by its press with the last W decode queries and compacted to what
  // the press keeps (in place when it owns its blocks, as a compressed sequence does: no free
  // block is needed); returns the entries dropped.
  absl::StatusOr<int64_t> EvictDuringDecode(SequenceId seq, int32_t layer_idx, KvSelector& press) {
    c10::InferenceMode guard;
    try {
      ASSIGN_OR_RETURN(
          LayerKvView view,
          StoredLayerView(seq, layer_idx,
                          query_ring_.Queries(seq, layer_idx, pool_->logical_len(seq))));
      ASSIGN_OR_RETURN(std::optional<at::Tensor> kept, press.Select(view));
      if (!kept) return 0;
      const int64_t before = pool_->stored_len(seq, layer_idx);
      std::vector<int32_t> old;
      RETURN_IF_ERROR(StoreKept(seq, layer_idx, view.keys, view.values, view.positions, *kept,
                                OwnsEveryBlock(seq, layer_idx), &old));
      pool_->FreeBlocks(old);
      return before - pool_->stored_len(seq, layer_idx);
    } catch (const std::exception& e) {
      return absl::InternalError(e.what());
    }
  }

  // One forward over decode rows (one token each, appended at each sequence's next position) and
  // prefill chunks (positions continuing from each sequence's logical length; a sequence is
  // created at its first chunk). Returns fp32 logits for the decode rows, then one row per last
  // chunk (undefined when there are none). All-or-nothing: on any failure every sequence is left
  // as before the call.
  absl::StatusOr<at::Tensor> Forward(std::span<const int64_t> decode_ids,
                                     std::span<const int32_t> decode_tokens,
                                     std::span<const ChunkWork> chunks) {
    if (decode_ids.size() != decode_tokens.size()) {
      return absl::InvalidArgumentError(absl::StrCat("step: ", decode_ids.size(), " sequences but ",
                                                     decode_tokens.size(), " decode tokens"));
    }
    RETURN_IF_ERROR(CheckTokens(decode_tokens));
    std::unordered_set<int64_t> seen;
    for (int64_t s : decode_ids) {
      if (!pool_->HasSequence(s))
        return absl::NotFoundError(absl::StrCat("decode: unknown sequence ", s));
      if (!seen.insert(s).second)
        return absl::InvalidArgumentError(absl::StrCat("step: sequence ", s, " appears twice"));
    }
    for (const ChunkWork& c : chunks) {
      if (c.tokens.empty()) return absl::InvalidArgumentError("prefill chunk is empty");
      RETURN_IF_ERROR(CheckTokens(c.tokens));
      if (!seen.insert(c.seq).second)
        return absl::InvalidArgumentError(absl::StrCat("step: sequence ", c.seq, " appears twice"));
    }
    c10::InferenceMode guard;
    struct Undo {
      SequenceId seq;
      bool created;
      SequenceBlocks blocks;
      std::vector<at::Tensor> positions;
    };
    std::vector<Undo> undo;
    bool decode_appended = false;
    auto fail = [&](absl::Status st) -> absl::Status {
      for (Undo& u : undo) {
        pool_->Restore(u.seq, std::move(u.blocks));
        positions_[u.seq] = std::move(u.positions);
        if (u.created) {
          pool_->FreeSequence(u.seq);
          positions_.erase(u.seq);
        }
      }
      if (decode_appended) pool_->UndoAppendSlots(decode_ids, 1);
      return st;
    };
    try {
      const auto dev = model_->device();
      const auto long_opts = at::TensorOptions().dtype(at::kLong).device(dev);
      const int64_t num_decode = static_cast<int64_t>(decode_ids.size());
      std::vector<at::Tensor> tokens, positions;
      std::vector<MixedBackend::Segment> segments;
      std::optional<DecodeBackend> decode;
      int64_t max_pos = 0;
      if (num_decode > 0) {
        RETURN_IF_ERROR(pool_->AppendSlots(decode_ids, 1));  // all-or-nothing
        decode_appended = true;
        const DecodeExtents ext = ExtentsOf(decode_ids);
        max_pos = ext.max_pos;
        DecodeInputs in = UploadDecodeInputs(decode_ids, decode_tokens, ext);
        tokens.push_back(in.tokens);
        positions.push_back(in.positions);
        decode.emplace(*pool_, config(), in, static_cast<int32_t>(ext.max_len), UseDecodeKernel(),
                       /*model_stores_kv=*/false, query_ring_.storage());
        segments.push_back({&*decode, num_decode});
      }
      std::vector<std::unique_ptr<PrefillBackend>> prefills;
      std::vector<int64_t> starts;
      for (const ChunkWork& c : chunks) {
        const bool created = !pool_->HasSequence(c.seq);
        if (created) {
          if (absl::Status st = pool_->AddSequence(c.seq); !st.ok()) return fail(st);
        }
        undo.push_back({c.seq, created, pool_->Snapshot(c.seq), positions_[c.seq]});
        const int64_t start = pool_->logical_len(c.seq);
        const int64_t n = static_cast<int64_t>(c.tokens.size());
        tokens.push_back(TokensTensor(c.tokens));
        positions.push_back(at::arange(start, start + n, long_opts));
        max_pos = std::max(max_pos, start + n - 1);
        starts.push_back(start);
        prefills.push_back(std::make_unique<PrefillBackend>(*this, c.seq, start, c.is_last_chunk,
                                                            c.selector, c.pass));
        segments.push_back({prefills.back().get(), n});
      }
      MixedBackend mixed(segments);
      AttentionBackend& backend =
          segments.size() == 1 ? *segments[0].backend : static_cast<AttentionBackend&>(mixed);
      auto hidden = model_->Forward(tokens.size() == 1 ? tokens[0] : at::cat(tokens),
                                    positions.size() == 1 ? positions[0] : at::cat(positions),
                                    max_pos, backend);
      if (!hidden.ok()) return fail(hidden.status());
      // Prompt logprobs, into copies: nothing is kept unless the whole step succeeds.
      std::vector<std::pair<SequenceId, PromptLogprobParts>> scored;
      for (size_t i = 0, offset = num_decode; i < chunks.size(); ++i) {
        const int64_t n = static_cast<int64_t>(chunks[i].tokens.size());
        if (chunks[i].return_prompt_logprobs) {
          auto it = prompt_logprobs_.find(chunks[i].seq);
          PromptLogprobParts parts =
              it != prompt_logprobs_.end() ? it->second : PromptLogprobParts{};
          ScorePromptChunk(hidden->narrow(0, static_cast<int64_t>(offset), n), chunks[i].tokens,
                           chunks[i].num_top_logprobs, parts);
          scored.emplace_back(chunks[i].seq, std::move(parts));
        }
        offset += static_cast<size_t>(n);
      }
      for (auto& [seq, parts] : scored) prompt_logprobs_[seq] = std::move(parts);
      // Replay scoring, over the prompt as stored (its logical length moved on; a failure
      // restores it with the rest): the old blocks of the layers it compacts go at commit.
      for (size_t i = 0; i < chunks.size(); ++i) {
        if (chunks[i].replay_tokens == nullptr) continue;
        pool_->set_logical_len(chunks[i].seq,
                               starts[i] + static_cast<int64_t>(chunks[i].tokens.size()));
        absl::Status st = ReplayAndSelect(chunks[i].seq, *chunks[i].selector,
                                          *chunks[i].replay_tokens, prefills[i]->deferred_free());
        if (!st.ok()) return fail(st);
      }
      // Commit: the old blocks of compacted layers go, lengths move on.
      std::vector<int64_t> rows(decode_ids.size());
      std::iota(rows.begin(), rows.end(), int64_t{0});
      int64_t row_end = num_decode;
      for (size_t i = 0; i < chunks.size(); ++i) {
        const int64_t n = static_cast<int64_t>(chunks[i].tokens.size());
        pool_->FreeBlocks(prefills[i]->deferred_free());
        pool_->set_logical_len(chunks[i].seq, starts[i] + n);
        if (chunks[i].selector != nullptr)
          compression_seconds_[chunks[i].seq] += prefills[i]->selection_seconds();
        row_end += n;
        if (chunks[i].is_last_chunk) rows.push_back(row_end - 1);
      }
      for (int64_t s : decode_ids) pool_->set_logical_len(s, pool_->logical_len(s) + 1);
      if (rows.empty()) return at::Tensor();
      if (static_cast<int64_t>(rows.size()) == hidden->size(0)) return model_->Logits(*hidden);
      return model_->Logits(hidden->index_select(0, at::tensor(rows, at::kLong).to(dev)));
    } catch (const std::exception& e) {
      return fail(absl::InternalError(absl::StrCat("step failed: ", e.what())));
    }
  }

  absl::Status AdoptPrefix(SequenceId seq, std::span<const int32_t> tokens,
                           std::span<const std::vector<int32_t>> layer_blocks) override {
    RETURN_IF_ERROR(CheckTokens(tokens));
    return pool_->AddSequenceSharing(seq, static_cast<int64_t>(tokens.size()), layer_blocks);
  }

  absl::Status ForkSequence(SequenceId src, SequenceId dst) override {
    std::vector<BlockPool::BlockCopy> copies;
    RETURN_IF_ERROR(pool_->ForkSequence(src, dst, &copies));
    if (!copies.empty()) {
      c10::InferenceMode guard;
      std::vector<int64_t> from, to;
      for (const auto& c : copies) {
        from.push_back(c.from);
        to.push_back(c.to);
      }
      const auto dev = pool_->key_cache().device();
      const auto from_t = ToDeviceAsync(at::tensor(from, at::kLong), dev);
      const auto to_t = ToDeviceAsync(at::tensor(to, at::kLong), dev);
      for (const at::Tensor* cache : {&pool_->key_cache(), &pool_->value_cache()}) {
        at::Tensor bytes = cache->view(at::kByte);  // the blocks' bytes, whatever the KV dtype
        bytes.index_copy_(0, to_t, bytes.index_select(0, from_t));
      }
    }
    if (auto it = positions_.find(src); it != positions_.end()) positions_[dst] = it->second;
    return absl::OkStatus();
  }

  SequenceCacheInfo CacheInfo(SequenceId seq) const override {
    SequenceCacheInfo info;
    if (!pool_->HasSequence(seq)) return info;
    info.logical_len = pool_->logical_len(seq);
    for (int32_t l = 0; l < pool_->num_layers(); ++l)
      info.stored_len_per_layer.push_back(pool_->stored_len(seq, l));
    info.num_blocks = pool_->num_blocks_of(seq);
    if (auto it = compression_seconds_.find(seq); it != compression_seconds_.end())
      info.compression_seconds = it->second;
    if (auto it = decode_presses_.find(seq); it != decode_presses_.end())
      info.decode_evicted_entries = it->second.evicted_entries();
    return info;
  }

  absl::StatusOr<PromptLogprobs> TakePromptLogprobs(SequenceId seq) override {
    PromptLogprobs out;
    auto it = prompt_logprobs_.find(seq);
    if (it == prompt_logprobs_.end()) return out;
    PromptLogprobParts parts = std::move(it->second);
    prompt_logprobs_.erase(it);
    try {
      if (parts.logprobs.empty()) return out;
      // One device-to-host copy per tensor, once per prompt.
      const at::Tensor lp = at::cat(parts.logprobs).to(at::kCPU).contiguous();
      out.logprobs.assign(lp.data_ptr<float>(), lp.data_ptr<float>() + lp.numel());
      out.top_logprobs.resize(out.logprobs.size());
      if (!parts.top_values.empty()) {
        const at::Tensor values = at::cat(parts.top_values).to(at::kCPU).contiguous();
        const at::Tensor ids = at::cat(parts.top_ids).to(at::kCPU).contiguous();
        const int64_t k = values.size(1);
        const float* v = values.data_ptr<float>();
        const int64_t* id = ids.data_ptr<int64_t>();
        for (size_t r = 0; r < out.top_logprobs.size(); ++r)
          for (int64_t j = 0; j < k; ++j)
            out.top_logprobs[r].emplace_back(static_cast<int32_t>(id[r * k + j]), v[r * k + j]);
      }
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("prompt logprobs: ", e.what()));
    }
    return out;
  }

  void Release(SequenceId seq) override {
    prompt_logprobs_.erase(seq);
    pool_->FreeSequence(seq);
    positions_.erase(seq);
    selectors_.erase(seq);
    replay_tokens_.erase(seq);
    compression_seconds_.erase(seq);
    decode_presses_.erase(seq);
    query_ring_.Remove(seq);
  }

  DecodeCompressionStats decode_compression_stats() const override { return decode_stats_; }

  absl::Status CompactLayer(SequenceId seq, int32_t layer_idx, const at::Tensor& kept) override {
    if (!pool_->HasSequence(seq))
      return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
    if (layer_idx < 0 || layer_idx >= config().num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("layer_idx ", layer_idx, " out of range"));
    }
    if (config().is_sliding(layer_idx)) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", layer_idx, " is a sliding-window layer: it is not compressed"));
    }
    c10::InferenceMode guard;
    try {
      auto [k, v] = GatherLayer(seq, layer_idx);
      ASSIGN_OR_RETURN(at::Tensor pos, StoredPositions(seq, layer_idx));
      std::vector<int32_t> old;
      RETURN_IF_ERROR(StoreKept(seq, layer_idx, k, v, pos, kept, /*in_place=*/false, &old));
      pool_->FreeBlocks(old);
      return absl::OkStatus();
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("CompactLayer: ", e.what()));
    }
  }

  absl::StatusOr<at::Tensor> StoredPositions(SequenceId seq, int32_t layer_idx) const override {
    if (!pool_->HasSequence(seq))
      return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
    const int64_t s = pool_->stored_len(seq, layer_idx);
    auto it = positions_.find(seq);
    if (it != positions_.end() && it->second.size() > static_cast<size_t>(layer_idx) &&
        it->second[layer_idx].defined()) {
      return WithDecodedPositions(it->second[layer_idx], s, pool_->logical_len(seq));
    }
    return at::arange(s, at::TensorOptions().dtype(at::kLong).device(model_->device()))
        .unsqueeze(0)
        .expand({config().num_kv_heads, s})
        .contiguous();
  }

  absl::StatusOr<std::vector<at::Tensor>> CaptureAttentionOutputs(
      std::span<const int32_t> tokens) override {
    if (tokens.empty()) return absl::InvalidArgumentError("CaptureAttentionOutputs: no tokens");
    RETURN_IF_ERROR(CheckTokens(tokens));
    c10::InferenceMode guard;
    std::vector<at::Tensor> outs(config().num_layers);
    AttentionObserver observer = [&](int32_t layer_idx, const at::Tensor& o) {
      outs[layer_idx] = o;
    };
    FullAttentionBackend backend(config());
    try {
      const int64_t n = static_cast<int64_t>(tokens.size());
      auto positions = at::arange(n, at::TensorOptions().dtype(at::kLong).device(model_->device()));
      RETURN_IF_ERROR(
          model_->Forward(TokensTensor(tokens), positions, n - 1, backend, &observer).status());
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat("CaptureAttentionOutputs: ", e.what()));
    }
    return outs;
  }

  // --- used by PrefillBackend ------------------------------------------------------------------
  // The stored K, V of a layer: [Hkv, S, D] each (a sliding layer's ring in position order).
  std::pair<at::Tensor, at::Tensor> GatherLayer(SequenceId seq, int32_t layer_idx) const {
    const int64_t s = pool_->stored_len(seq, layer_idx);
    const auto& kc = pool_->key_cache();
    const int64_t hkv = kc.size(2);
    const int64_t d = kc.size(3);
    const int64_t end = pool_->logical_len(seq);
    at::Tensor host_slots = pool_->capacity(layer_idx) > 0
                                ? RingSlots(seq, layer_idx, end - s, end)
                                : pool_->SlotIndices(seq, layer_idx, 0, s);
    auto slots = ToDeviceAsync(host_slots, kc.device());
    // In the model dtype (an FP8 cache's entries dequantized): prefill attention and the
    // selectors read them beside the chunk's K/V.
    const at::ScalarType dtype = model_->dtype();
    return {
        kernels::GatherRows(kc.view({-1, hkv, d}), slots, dtype).transpose(0, 1),
        kernels::GatherRows(pool_->value_cache().view({-1, hkv, d}), slots, dtype).transpose(0, 1)};
  }

  // Slot indices (int64 [end - begin], CPU) of positions [begin, end) in a sliding layer's ring,
  // where position p lives in entry p % capacity.
  at::Tensor RingSlots(SequenceId seq, int32_t layer_idx, int64_t begin, int64_t end) const {
    const auto& t = pool_->table(seq, layer_idx);
    const int64_t ring = pool_->capacity(layer_idx);
    const int64_t bs = pool_->block_size();
    auto out = at::empty({end - begin}, at::kLong);
    int64_t* p = out.data_ptr<int64_t>();
    for (int64_t pos = begin; pos < end; ++pos) {
      const int64_t e = pos % ring;
      p[pos - begin] = int64_t{t.block_ids[e / bs]} * bs + e % bs;
    }
    return out;
  }

  // Stores the K/V of positions [start, start + T) (new_k/new_v [T, Hkv, D]) in a sliding
  // layer's ring: only the last `capacity` of them can be seen again (and writing more would
  // write one entry twice in one kernel).
  absl::Status WriteRing(SequenceId seq, int32_t layer_idx, int64_t start, const at::Tensor& new_k,
                         const at::Tensor& new_v) {
    const int64_t t_len = new_k.size(0);
    const int64_t skip = std::max<int64_t>(0, t_len - pool_->capacity(layer_idx));
    RETURN_IF_ERROR(pool_->AppendLayerSlots(seq, layer_idx, t_len));
    at::Tensor kc = pool_->key_cache();
    at::Tensor vc = pool_->value_cache();
    auto slots = ToDeviceAsync(RingSlots(seq, layer_idx, start + skip, start + t_len), kc.device());
    return kernels::WriteKv(kc, vc, new_k.narrow(0, skip, t_len - skip),
                            new_v.narrow(0, skip, t_len - skip), slots);
  }

  // Writes new_k/new_v ([m, Hkv, D]) into slots [begin, begin + m) of a layer.
  // One kernel for K and V (kernels::WriteKv) where ATen's index_copy_ took one each at a third
  // of the copy bandwidth.
  absl::Status WriteSlots(SequenceId seq, int32_t layer_idx, int64_t begin, const at::Tensor& new_k,
                          const at::Tensor& new_v) {
    at::Tensor kc = pool_->key_cache();  // handles on the pool's storage
    at::Tensor vc = pool_->value_cache();
    auto slots = ToDeviceAsync(pool_->SlotIndices(seq, layer_idx, begin, begin + new_k.size(0)),
                               kc.device());
    return kernels::WriteKv(kc, vc, new_k, new_v, slots);
  }

  // Replaces a layer's contents by the kept entries of k/v/pos ([Hkv, n, D], [Hkv, n]): into
  // fresh blocks, the old ones going to `old` (the caller frees them on commit), or `in_place`
  // over the layer's first slots, its blocks past them freed (k and v must be copies, as
  // GatherLayer's are; only for blocks no other sequence or cache holds).
  absl::Status StoreKept(SequenceId seq, int32_t layer_idx, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& pos, const at::Tensor& kept,
                         bool in_place, std::vector<int32_t>* old) {
    const int64_t hkv = k.size(0);
    const int64_t n = k.size(1);
    if (kept.dim() != 2 || kept.size(0) != hkv) {
      return absl::InvalidArgumentError(absl::StrCat("KvSelector: kept indices must be [", hkv,
                                                     ", k], got ", kept.dim(), " dims"));
    }
    auto idx = kept.to(k.device(), at::kLong);
    if (idx.numel() > 0 && (idx.min().item<int64_t>() < 0 || idx.max().item<int64_t>() >= n)) {
      return absl::InvalidArgumentError(absl::StrCat("KvSelector: kept index out of [0, ", n, ")"));
    }
    const int64_t m = idx.size(1);
    auto gather_idx = idx.unsqueeze(2).expand({hkv, m, k.size(2)});
    auto kk = k.gather(1, gather_idx).transpose(0, 1).contiguous();  // [m, Hkv, D]
    auto vv = v.gather(1, gather_idx).transpose(0, 1).contiguous();
    auto pp = pos.gather(1, idx);  // [Hkv, m]
    if (in_place) {
      RETURN_IF_ERROR(WriteSlots(seq, layer_idx, 0, kk, vv));
      std::vector<int32_t> dropped;
      RETURN_IF_ERROR(pool_->TruncateLayer(seq, layer_idx, m, &dropped));
      pool_->FreeBlocks(dropped);
    } else {
      RETURN_IF_ERROR(pool_->ReplaceLayer(seq, layer_idx, m, old));
      RETURN_IF_ERROR(WriteSlots(seq, layer_idx, 0, kk, vv));
    }
    auto& per_layer = positions_[seq];
    per_layer.resize(config().num_layers);
    per_layer[layer_idx] = pp;
    return absl::OkStatus();
  }

  // After AppendLayerSlots of a chunk (stored_len counts it already).
  void AppendPositions(SequenceId seq, int32_t layer_idx,
                       const at::Tensor& chunk_pos /*[Hkv, T]*/) {
    auto it = positions_.find(seq);
    if (it == positions_.end() || it->second.size() <= static_cast<size_t>(layer_idx) ||
        !it->second[layer_idx].defined()) {
      return;  // implicit arange: still valid
    }
    at::Tensor& kept = it->second[layer_idx];
    // Until the chunk commits, the logical length is the chunk's start.
    const int64_t before_chunk = pool_->stored_len(seq, layer_idx) - chunk_pos.size(1);
    kept =
        at::cat({WithDecodedPositions(kept, before_chunk, pool_->logical_len(seq)), chunk_pos}, 1);
  }

  // `kept` ([Hkv, n] recorded positions) extended to `num_entries` columns: decode appends one
  // entry a step at the next position without recording it, so the entries past the recorded
  // ones sit at the last logical positions before `end` (a continued conversation).
  static at::Tensor WithDecodedPositions(const at::Tensor& kept, int64_t num_entries, int64_t end) {
    const int64_t missing = num_entries - kept.size(1);
    if (missing <= 0) return kept;
    return at::cat({kept, at::arange(end - missing, end, kept.options())
                              .unsqueeze(0)
                              .expand({kept.size(0), missing})},
                   1);
  }

  BlockPool& block_pool() { return *pool_; }
  // Index of layer `layer_idx` among the global (compressible) layers; -1 for a sliding layer.
  int32_t global_index(int32_t layer_idx) const { return global_index_[layer_idx]; }

  // LayerKvView::reduce_scores under tensor parallelism with replicated KV heads: every rank's
  // scores gathered, the mean over the ranks holding the same KV heads (in rank order, so the
  // same bits on each). Empty when each KV head lives on one rank.
  std::function<absl::Status(at::Tensor&)> score_reducer() const {
    const TensorParallelLayout& tp = model_->tensor_parallel();
    Communicator* comm = model_->communicator();
    if (comm == nullptr || tp.kv_replicas <= 1) return {};
    const int32_t first = tp.rank - tp.rank % tp.kv_replicas, count = tp.kv_replicas;
    return [comm, first, count](at::Tensor& scores) -> absl::Status {
      ASSIGN_OR_RETURN(at::Tensor all, comm->AllGather(scores.contiguous()));
      scores = all.narrow(0, first, count).mean(0);
      return absl::OkStatus();
    };
  }

  // LayerKvView::max_over_ranks under tensor parallelism: every rank's count gathered, their
  // largest (an automatic budget keeps as many entries on every rank). Empty on one rank.
  std::function<absl::StatusOr<int64_t>(int64_t)> rank_max() const {
    Communicator* comm = model_->communicator();
    if (comm == nullptr) return {};
    // fp32 (what both communicators carry) holds the counts exactly: they stay below 2^24.
    const at::Device device =
        comm->device_type() == at::kCPU ? at::Device(at::kCPU) : model_->device();
    return [comm, device](int64_t count) -> absl::StatusOr<int64_t> {
      const at::Tensor mine = at::full({1}, static_cast<double>(count),
                                       at::TensorOptions().dtype(at::kFloat).device(device));
      ASSIGN_OR_RETURN(at::Tensor all, comm->AllGather(mine));
      return static_cast<int64_t>(all.max().item<float>());
    };
  }

 private:
  // Writes the packed decode inputs of `ids` (after AppendSlots: the new token's slot is the
  // last stored one of each layer, or its ring entry) into `base` (lay.num_bytes()). Rows past
  // ids.size() are padding: token 0 at position 0, length 0 (attention reads nothing), K/V written
  // into the reserved scratch block, so a padded row never touches a live sequence's blocks.
  void FillDecodeInputs(uint8_t* base, const DecodeLayout& lay, std::span<const int64_t> ids,
                        std::span<const int32_t> tokens) const {
    const int64_t batch = lay.batch, num_layers = lay.num_layers, m = lay.max_blocks;
    const int64_t bs = pool_->block_size();
    auto* i64 = reinterpret_cast<int64_t*>(base);
    auto* tok_p = i64;
    auto* pos_p = i64 + batch;
    auto* slots_p = i64 + 2 * batch;
    auto* query_rows_p = lay.query_rows ? slots_p + num_layers * batch : nullptr;
    auto* i32 = reinterpret_cast<int32_t*>(base + 8 * lay.num_int64());
    auto* lens_p = i32;
    auto* tables_p = i32 + num_layers * batch;
    const int64_t real = static_cast<int64_t>(ids.size());
    for (int64_t b = 0; b < batch; ++b) {
      if (b >= real) {
        if (query_rows_p != nullptr) query_rows_p[b] = 0;
        tok_p[b] = 0;
        pos_p[b] = 0;
        for (int64_t l = 0; l < num_layers; ++l) {
          slots_p[l * batch + b] = int64_t{scratch_block_} * bs + b % bs;
          lens_p[l * batch + b] = 0;
          std::memset(tables_p + (l * batch + b) * m, 0, sizeof(int32_t) * m);
        }
        continue;
      }
      tok_p[b] = tokens[b];
      const SequenceBlocks& seq = pool_->sequence(ids[b]);  // one lookup for all layers
      pos_p[b] = seq.logical_len;
      if (query_rows_p != nullptr) query_rows_p[b] = query_ring_.RowOf(ids[b], seq.logical_len);
      for (int64_t l = 0; l < num_layers; ++l) {
        const auto& t = seq.layers[l];
        // The new token's entry: appended last, or in a sliding layer's ring its position's.
        const int64_t ring = pool_->capacity(static_cast<int32_t>(l));
        const int64_t last = ring > 0 ? seq.logical_len % ring : t.stored_len - 1;
        slots_p[l * batch + b] = int64_t{t.block_ids[last / bs]} * bs + last % bs;
        lens_p[l * batch + b] = static_cast<int32_t>(t.stored_len);
        // The row: the table, then zeros (a valid block id) to the bucket's width.
        int32_t* row = tables_p + (l * batch + b) * m;
        const int64_t n = static_cast<int64_t>(t.block_ids.size());
        std::memcpy(row, t.block_ids.data(), sizeof(int32_t) * n);
        std::memset(row + n, 0, sizeof(int32_t) * (m - n));
      }
    }
  }

  // kernels::PagedDecodeAttention takes every CPU geometry; on CUDA only its kernel's: tiny
  // test models outside it run the ATen reference on the device instead (eager only).
  bool UseDecodeKernel() const {
    const auto& c = config();
    if (model_->device().is_cpu()) return true;
    // (The CUDA kernel does not soft-cap logits: Gemma 2 decodes through the reference.)
    return model_->device().is_cuda() && c.attn_logit_softcapping == 0 &&
           (c.head_dim == 64 || c.head_dim == 128 || c.head_dim == 256) &&
           c.num_heads % c.num_kv_heads == 0 && c.num_heads / c.num_kv_heads <= 16;
  }

  bool UseGraphs(int64_t batch, int64_t max_blocks) const {
    if (!options_.cuda_graphs || graphs_disabled_ || scratch_block_ < 0) return false;
    if (!model_->device().is_cuda() || !UseDecodeKernel()) return false;
    // Dynamic RoPE recomputes its frequencies from the host-side length: not capturable.
    if (config().rope.type == RopeType::kDynamic) return false;
    if (batch > kMaxGraphBatch) return false;
    const DecodeLayout lay{BatchBucket(batch), config().num_layers, BlocksBucket(max_blocks)};
    return lay.num_bytes() <= kMaxGraphInputBytes;
  }

  // One decode step through the graph of its bucket (captured on first use). An undefined
  // tensor means "run eagerly": capture failed (graphs are then off for this runner).
  absl::StatusOr<at::Tensor> DecodeWithGraph(std::span<const int64_t> ids,
                                             std::span<const int32_t> tokens, int64_t max_blocks) {
    const int64_t batch = static_cast<int64_t>(ids.size());
    const DecodeLayout lay{BatchBucket(batch), config().num_layers, BlocksBucket(max_blocks),
                           KeepsQueries(ids)};
    const auto key = std::make_tuple(lay.batch, lay.max_blocks, lay.query_rows);
    if (graphs_ring_version_ != query_ring_.version()) {
      // Graphs that keep queries write them into the ring's storage as it was at their capture.
      std::erase_if(graphs_, [](const auto& g) { return std::get<2>(g.first); });
      // The graphs share one memory pool, gone with the last of them: a new capture needs a new
      // one (capturing into a released pool trips the caching allocator's assert).
      if (graphs_.empty()) graph_pool_ = CudaGraphPool{};
      graphs_ring_version_ = query_ring_.version();
    }
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      if (graphs_.size() >= kMaxGraphs) {
        graphs_.clear();
        graph_pool_ = CudaGraphPool{};
      }
      auto entry = std::make_unique<DecodeGraph>();
      entry->layout = lay;
      ASSIGN_OR_RETURN(entry->inputs,
                       CreateStagedUpload(lay.num_bytes(), model_->device().index()));
      it = graphs_.emplace(key, std::move(entry)).first;
    }
    DecodeGraph& g = *it->second;
    auto t = std::chrono::steady_clock::now();
    g.inputs->WaitStagingFree();
    FillDecodeInputs(g.inputs->staging().data_ptr<uint8_t>(), lay, ids, tokens);
    host_times_.fill_us = MicrosSince(t);
    t = std::chrono::steady_clock::now();
    g.inputs->Upload();
    host_times_.upload_us = MicrosSince(t);
    if (!g.graph) {
      DecodeInputs in = DecodeInputs::View(g.inputs->device_buffer(), lay);
      const int32_t max_seq_len = static_cast<int32_t>(lay.max_blocks * pool_->block_size());
      const int64_t max_position = config().max_position_embeddings;  // unused: not dynamic
      auto forward = [this, in, max_seq_len, max_position]() -> absl::StatusOr<at::Tensor> {
        DecodeBackend backend(*pool_, config(), in, max_seq_len, true, /*model_stores_kv=*/true,
                              query_ring_.storage());
        ASSIGN_OR_RETURN(at::Tensor hidden,
                         model_->Forward(in.tokens, in.positions, max_position, backend));
        return model_->Logits(hidden);  // fp32 [B_bucket, vocab]
      };
      auto captured = CaptureCudaGraph(forward, graph_pool_);
      if (!captured.ok()) {
        // The warm-up inside the capture ran this step once; the eager rerun writes the same
        // K/V into the same slots.
        LogWarn(absl::StrCat("decode: CUDA graphs off for this runner: ",
                             captured.status().ToString()));
        graphs_disabled_ = true;
        graphs_.clear();
        return at::Tensor();
      }
      g.graph = std::move(*captured);
      LogInfo(absl::StrCat("decode: captured a CUDA graph for batch ", lay.batch, " x ",
                           lay.max_blocks, " blocks (", graphs_.size(), " graphs)"));
    }
    t = std::chrono::steady_clock::now();
    g.graph->Replay();
    host_times_.launch_us = MicrosSince(t);
    // The graph's output is overwritten by the next replay: the caller gets its own copy.
    return g.graph->output().narrow(0, 0, batch).clone();
  }

  absl::Status CheckTokens(std::span<const int32_t> tokens) const {
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] < 0 || tokens[i] >= config().vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat(
            "token id ", tokens[i], " at index ", i, " is outside [0, ", config().vocab_size, ")"));
      }
    }
    return absl::OkStatus();
  }
  at::Tensor TokensTensor(std::span<const int32_t> tokens) const {
    return ToDeviceAsync(at::tensor(std::vector<int64_t>(tokens.begin(), tokens.end()), at::kLong),
                         model_->device());
  }

  RunnerOptions options_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<BlockPool> pool_;
  KvSelectorFactory factory_;
  std::unordered_map<SequenceId, std::unique_ptr<KvSelector>> selectors_;  // until the last chunk
  // A replay press's sequence: the position of its first fed token and the tokens fed since.
  struct FedTokens {
    int64_t begin = 0;
    std::vector<int32_t> tokens;
  };
  std::unordered_map<SequenceId, FedTokens> replay_tokens_;     // until the last chunk
  std::unordered_map<SequenceId, double> compression_seconds_;  // selector time of committed chunks
  std::unordered_map<SequenceId, PromptLogprobParts> prompt_logprobs_;  // until taken or released
  std::unordered_map<SequenceId, compression::DecodeCompression> decode_presses_;
  DecodeQueryRing query_ring_;
  DecodeCompressionStats decode_stats_;
  // Per sequence, per layer: positions [Hkv, stored] once a layer was compacted (undefined =
  // arange(stored_len), the uncompressed case). Tracked through prefill; decode does not extend
  // them.
  std::unordered_map<SequenceId, std::vector<at::Tensor>> positions_;
  std::vector<int32_t> global_index_;  // see global_index()
  // CUDA graphs of the decode step, by (batch bucket, block-table columns bucket).
  int32_t scratch_block_ = -1;  // reserved block padded rows write into (-1: no graphs)
  bool graphs_disabled_ = false;
  CudaGraphPool graph_pool_;
  // Keyed by (batch bucket, block-table columns bucket, writes query rows).
  std::map<std::tuple<int64_t, int64_t, bool>, std::unique_ptr<DecodeGraph>> graphs_;
  int64_t graphs_ring_version_ = 0;  // the query ring's storage the graphs write into
  DecodeHostTimes host_times_;       // of the last Decode
};

absl::StatusOr<at::Tensor> PrefillBackend::Attend(int32_t layer_idx, const at::Tensor& q,
                                                  const at::Tensor& k, const at::Tensor& v) {
  BlockPool& pool = runner_.block_pool();
  const ModelConfig& config = runner_.config();
  const int64_t t_len = q.size(0);
  const int64_t stored = pool.stored_len(seq_, layer_idx);
  // An FP8 cache: the chunk's K/V as the cache will hold them, so that its attention, the
  // selector's scores and every later read (decode, later chunks) see the same values.
  const bool fp8 = kernels::IsFp8Cache(pool.key_cache());
  const at::Tensor k_used = fp8 ? kernels::RoundTripKv(k) : k;
  const at::Tensor v_used = fp8 ? kernels::RoundTripKv(v) : v;
  auto chunk_k = k_used.transpose(0, 1);  // [Hkv, T, D]
  auto chunk_v = v_used.transpose(0, 1);
  at::Tensor all_k = chunk_k;
  at::Tensor all_v = chunk_v;
  if (stored > 0) {
    auto [old_k, old_v] = runner_.GatherLayer(seq_, layer_idx);
    all_k = at::cat({old_k, chunk_k}, 1);  // [Hkv, S + T, D]
    all_v = at::cat({old_v, chunk_v}, 1);
  }
  // [T, Hq, D]; lse fp32 [Hq, T] from the CUDA fused ops, undefined on the SDPA fallback.
  auto [out, lse] =
      PrefillAttentionWithLse(q, all_k, all_v, config.attention_scale(layer_idx),
                              PrefillAttentionImpl::kAuto, LimitsOf(config, layer_idx));
  if (config.is_sliding(layer_idx)) {
    // Outside compression: the ring keeps the window.
    RETURN_IF_ERROR(runner_.WriteRing(seq_, layer_idx, start_pos_, k_used, v_used));
    return out;
  }
  const int64_t hkv = k.size(1);
  auto chunk_pos = at::arange(start_pos_, start_pos_ + t_len,
                              at::TensorOptions().dtype(at::kLong).device(k.device()))
                       .unsqueeze(0)
                       .expand({hkv, t_len});
  std::optional<at::Tensor> kept;
  at::Tensor all_pos;
  if (selector_ != nullptr) {
    ASSIGN_OR_RETURN(at::Tensor old_pos, runner_.StoredPositions(seq_, layer_idx));
    all_pos = at::cat({old_pos, chunk_pos}, 1);  // [Hkv, S + T]
    LayerKvView view;
    // Budgets count the global layers only: the selector sees them numbered 0..G-1.
    view.layer_idx = runner_.global_index(layer_idx);
    view.num_layers = config.num_global_layers();
    view.logical_len = start_pos_ + t_len;
    view.queries = q.transpose(0, 1);  // [Hq, T, D]
    view.keys = all_k;
    view.values = all_v;
    view.positions = all_pos;
    view.is_last_chunk = is_last_chunk_;
    view.pass = pass_;
    if (pass_ == LayerKvView::Pass::kReplay) view.replayed_len = stored;  // the prompt's entries
    view.reduce_scores = runner_.score_reducer();
    view.max_over_ranks = runner_.rank_max();
    if (const int64_t rows = std::min(selector_->num_attention_rows(), t_len);
        rows > 0 && lse.defined()) {
      view.window_attn_out = out.narrow(0, t_len - rows, rows).transpose(0, 1);  // [Hq, w, D]
      view.window_lse = lse.narrow(1, t_len - rows, rows);                       // [Hq, w]
    }
    if (q.is_cuda() && !device_timer_) {
      if (auto timer = CreateCudaTimer(); timer.ok()) device_timer_ = std::move(*timer);
    }
    const auto host_start = std::chrono::steady_clock::now();
    if (device_timer_) device_timer_->Start();
    auto selected = selector_->Select(view);
    if (device_timer_) {
      device_timer_->Stop();
    } else {
      host_seconds_ += MicrosSince(host_start) * 1e-6;
    }
    ASSIGN_OR_RETURN(kept, std::move(selected));
  }
  if (kept) {
    std::vector<int32_t> old;
    RETURN_IF_ERROR(
        runner_.StoreKept(seq_, layer_idx, all_k, all_v, all_pos, *kept, /*in_place=*/false, &old));
    deferred_free_.insert(deferred_free_.end(), old.begin(), old.end());
  } else {
    RETURN_IF_ERROR(pool.AppendLayerSlots(seq_, layer_idx, t_len));
    RETURN_IF_ERROR(runner_.WriteSlots(seq_, layer_idx, stored, k_used, v_used));
    runner_.AppendPositions(seq_, layer_idx, chunk_pos);
  }
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Create(const RunnerOptions& options) {
  SetCpuThreadsOnce();
  c10::InferenceMode guard;
  std::string dir = options.model_dir;
  if (dir.empty()) {
    ASSIGN_OR_RETURN(dir, EnsureDemoModel(DemoModelDir(options.demo_model_dir)));
    LogWarn(absl::StrCat("no model given: serving the built-in DEMO model (random weights) from ",
                         dir));
  }
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));
  at::Device device(at::kCPU);
  try {
    device = at::Device(options.device);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: '", options.device, "' is not cpu or cuda[:N]"));
  }
  if (device.is_cuda() && !at::hasCUDA()) {
    return absl::FailedPreconditionError(
        absl::StrCat("device: '", options.device, "' but no CUDA device is available"));
  }
  if (!device.is_cpu() && !device.is_cuda()) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: '", options.device, "' is not cpu or cuda[:N]"));
  }
  ASSIGN_OR_RETURN(at::ScalarType dtype, ParseDtype(options.dtype, device.is_cuda()));
  ASSIGN_OR_RETURN(WeightQuantization quant, ParseWeightQuantization(options.quantization));
  ASSIGN_OR_RETURN(at::ScalarType kv_dtype, ParseKvCacheDtype(options.kv_cache_dtype, dtype));
  if (kv_dtype == kernels::kFp8KvDtype && device.is_cuda()) {
    // Below sm_89 the kernels' e4m3 conversions are emulated (several instructions per element)
    // and the FP8 KV path is not measured there: refused rather than guessed.
    ASSIGN_OR_RETURN(const int cc, CudaComputeCapability(device.has_index() ? device.index() : 0));
    if (cc < 89) {
      return absl::FailedPreconditionError(absl::StrCat(
          "kv_cache_dtype: fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper), this "
          "one is ",
          cc / 10, ".", cc % 10,
          ": its e4m3 conversions are emulated and the FP8 KV path is not measured there; use "
          "kv_cache_dtype: auto"));
    }
    if (dtype == at::kFloat) {
      return absl::FailedPreconditionError(
          "kv_cache_dtype: fp8 on CUDA needs dtype bfloat16 or float16 (the e4m3 decode kernel "
          "takes 16-bit queries), got float32");
    }
  }
  if (quant == WeightQuantization::kFp8 && device.is_cuda()) {
    LogWarn(
        "quantization fp8 on CUDA: prefill and decode batches up to 4 are faster than bf16, "
        "batches of 8-16 as fast or up to 10% slower (an 8B model on an H200: decode 1.35x "
        "faster at 1 row, 0.91x at 8; docs/model-runtime.md, FP8 weights)");
  }
  if (options.block_size <= 0) return absl::InvalidArgumentError("block_size must be > 0");
  if (options.communicator != nullptr && options.communicator->device_type() != device.type()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor_parallel_size: the group's communicator moves ",
                     c10::DeviceTypeName(options.communicator->device_type()),
                     " tensors, the model runs on ", device.str()));
  }
  std::unique_ptr<Model> model;
  if (options.random_weights) {
    ASSIGN_OR_RETURN(model, Model::CreateRandom(config, device, dtype, options.random_seed, quant,
                                                options.communicator));
  } else {
    ASSIGN_OR_RETURN(model, Model::Load(dir, config, device, dtype, quant, options.communicator));
  }
  // Under tensor parallelism the pool holds this rank's KV heads.
  config = model->config();
  if (options.cpu_packed_weights) model->PackForCpu();
  model->set_fused_cuda_ops(options.cuda_fused_ops);
  model->set_fused_gemv(options.cuda_decode_gemv);
  BlockPoolOptions po;
  po.block_size = options.block_size;
  po.num_layers = config.num_layers;
  po.num_kv_heads = config.num_kv_heads;
  po.head_dim = config.head_dim;
  if (!config.sliding_layers.empty()) {
    // A sliding layer's cache is a ring of its window (RingSlots): it never holds more.
    for (int32_t l = 0; l < config.num_layers; ++l)
      po.layer_capacity.push_back(config.is_sliding(l) ? config.sliding_window : 0);
  }
  po.dtype = kv_dtype;
  po.device = device;
  // K + V of one block in the pool's dtype (FP8: one byte per element).
  const int64_t block_bytes = int64_t{2} * options.block_size * config.num_kv_heads *
                              config.head_dim * static_cast<int64_t>(c10::elementSize(kv_dtype));
  if (options.num_kv_blocks > 0) {
    po.num_blocks = options.num_kv_blocks;
  } else {
    int64_t bytes = options.kv_cache_bytes;
    if (bytes <= 0 && device.is_cuda()) {
      // The free device memory once the weights are resident, less a reserve for activations
      // (prefill's MLP intermediates at long prompts, graph pools, cuBLAS workspaces).
      ASSIGN_OR_RETURN(auto mem, CudaMemoryInfo(device.has_index() ? device.index() : 0));
      const auto [free_bytes, total_bytes] = mem;
      const int64_t reserve = options.kv_reserve_bytes > 0
                                  ? options.kv_reserve_bytes
                                  : std::max<int64_t>(int64_t{4} << 30, total_bytes / 10);
      bytes = free_bytes - reserve;
      LogInfo(absl::StrCat("runner: device has ", free_bytes >> 20, " MiB free of ",
                           total_bytes >> 20, " MiB after the weights; KV pool gets ",
                           std::max<int64_t>(bytes, 0) >> 20, " MiB (reserve ", reserve >> 20,
                           " MiB)"));
      if (bytes < block_bytes) {
        return absl::ResourceExhaustedError(
            absl::StrCat("device: only ", free_bytes >> 20,
                         " MiB free after the weights, less than the ", reserve >> 20,
                         " MiB activation reserve: no room for a KV pool "
                         "(set kv_cache_bytes or kv_reserve_bytes)"));
      }
    } else if (bytes <= 0) {
      bytes = int64_t{1} << 30;
    }
    po.num_blocks = std::max<int64_t>(1, bytes / block_bytes);
  }
  if (options.communicator != nullptr) {
    // Rank 0's scheduler admits by its own pool for every rank: all hold the fewest blocks any
    // rank has room for (as a double: NCCL here moves floating-point tensors).
    at::Tensor count = at::full({1}, static_cast<double>(po.num_blocks),
                                at::TensorOptions(at::kDouble).device(device));
    ASSIGN_OR_RETURN(at::Tensor counts, options.communicator->AllGather(count));
    po.num_blocks = static_cast<int64_t>(counts.min().item<double>());
  }
  ASSIGN_OR_RETURN(auto pool, BlockPool::Create(po));
  LogInfo(absl::StrCat("runner: KV pool of ", po.num_blocks, " blocks x ", po.block_size,
                       " slots (", po.num_blocks * block_bytes / (1 << 20), " MiB, ",
                       c10::toString(kv_dtype), ")"));
  // CUDA graphs pad the batch to a bucket; the padded rows write their K/V into this block.
  int32_t scratch_block = -1;
  if (device.is_cuda() && options.cuda_graphs && po.num_blocks > 1) {
    ASSIGN_OR_RETURN(auto reserved, pool->AllocateBlocks(1));
    scratch_block = reserved[0];
  }
  return std::unique_ptr<ModelRunner>(
      new TorchModelRunner(options, std::move(model), std::move(pool), scratch_block));
}

}  // namespace dropkv
