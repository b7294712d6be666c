// ModelRunner on LibTorch: the Model forward with attention over the BlockPool (see
// model_runner.h for the contract). Prefill stores (or compacts) one layer at a time inside the
// forward, so only one layer's full-length K/V is alive at once.
#include "engine/runner/model_runner.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "allocator/block_pool.h"
#include "engine/common/status_macros.h"
#include "engine/model/attention.h"
#include "engine/model/config.h"
#include "engine/model/log.h"
#include "engine/model/model.h"
#include "engine/runner/demo_model.h"
#include "engine/runner/kv_selector.h"
#include "kernels/paged_attention.h"

namespace dropkv {
namespace {

absl::StatusOr<at::ScalarType> ParseDtype(const std::string& s, bool cuda) {
  if (s == "auto") return cuda ? at::kBFloat16 : at::kFloat;
  if (s == "float32" || s == "fp32") return at::kFloat;
  if (s == "bfloat16" || s == "bf16") return at::kBFloat16;
  if (s == "float16" || s == "fp16") return at::kHalf;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype: '", s, "' is not one of auto, float32, bfloat16, float16"));
}

void SetThreadsFromEnv() {
  static bool done = false;
  if (done) return;
  done = true;
  int threads = 2;
  for (const char* name : {"DROPKV_NUM_THREADS", "OMP_NUM_THREADS"}) {
    if (const char* v = std::getenv(name); v != nullptr && std::atoi(v) > 0) {
      threads = std::atoi(v);
      break;
    }
  }
  at::set_num_threads(threads);
}

class TorchModelRunner;

// Attention over the paged cache for one prefill chunk of one sequence.
class PrefillBackend : public AttentionBackend {
 public:
  PrefillBackend(TorchModelRunner& runner, SequenceId seq, int64_t start_pos, bool is_last_chunk,
                 KvSelector* selector)
      : runner_(runner),
        seq_(seq),
        start_pos_(start_pos),
        is_last_chunk_(is_last_chunk),
        selector_(selector) {}
  absl::StatusOr<at::Tensor> Attend(int32_t layer_idx, const at::Tensor& q, const at::Tensor& k,
                                    const at::Tensor& v) override;
  std::vector<int32_t>& deferred_free() { return deferred_free_; }

 private:
  TorchModelRunner& runner_;
  SequenceId seq_;
  int64_t start_pos_;
  bool is_last_chunk_;
  KvSelector* selector_;
  std::vector<int32_t> deferred_free_;  // old blocks of compacted layers, freed on commit
};

// Attention over the paged cache for one decode step; the per-layer metadata is built once.
class DecodeBackend : public AttentionBackend {
 public:
  DecodeBackend(BlockPool& pool, at::Tensor slots, at::Tensor tables, at::Tensor lens, double scale)
      : pool_(pool),
        slots_(std::move(slots)),
        tables_(std::move(tables)),
        lens_(std::move(lens)),
        scale_(scale) {}
  absl::StatusOr<at::Tensor> Attend(int32_t layer_idx, const at::Tensor& q, const at::Tensor& k,
                                    const at::Tensor& v) override {
    const auto& kc = pool_.key_cache();
    const auto& vc = pool_.value_cache();
    const int64_t hkv = kc.size(2);
    const int64_t d = kc.size(3);
    kc.view({-1, hkv, d}).index_copy_(0, slots_[layer_idx], k);
    vc.view({-1, hkv, d}).index_copy_(0, slots_[layer_idx], v);
    if (kc.is_cuda()) {
      // The split-K CUDA kernel reads the block tables on the device: no host sync per layer.
      kernels::PagedAttentionParams params;
      params.scale = scale_;
      return kernels::PagedDecodeAttention(q, kc, vc, tables_[layer_idx], lens_[layer_idx], params);
    }
    return PagedDecodeAttention(q, kc, vc, tables_[layer_idx], lens_[layer_idx], scale_);
  }

 private:
  BlockPool& pool_;
  at::Tensor slots_;   // int64 [L, B]: where each sequence's new K/V goes
  at::Tensor tables_;  // int32 [L, B, max_blocks]
  at::Tensor lens_;    // int32 [L, B]
  double scale_;
};

class TorchModelRunner : public ModelRunner {
 public:
  TorchModelRunner(RunnerOptions options, std::unique_ptr<Model> model,
                   std::unique_ptr<BlockPool> pool)
      : options_(std::move(options)), model_(std::move(model)), pool_(std::move(pool)) {}

  const ModelConfig& config() const override { return model_->config(); }
  BlockPool& pool() override { return *pool_; }
  const Model* model() const override { return model_.get(); }
  void SetKvSelectorFactory(KvSelectorFactory factory) override { factory_ = std::move(factory); }

  int64_t BlocksForPrompt(int64_t prompt_len, const CompressionParams& c,
                          int64_t decode_reserve_tokens) const override {
    const int64_t num_layers = config().num_layers;
    int64_t peak_per_layer = prompt_len;
    if (c.method != ScoreMethod::kNone) {
      int64_t kept =
          c.budget_tokens
              ? std::min(*c.budget_tokens, prompt_len)
              : static_cast<int64_t>(std::ceil(c.keep_ratio * static_cast<double>(prompt_len)));
      const bool chunked = c.chunk_size > 0 && c.chunk_size < prompt_len;
      if (!chunked) {
        peak_per_layer = kept;
      } else if (c.chunk_policy == ChunkPolicy::kEveryChunk) {
        peak_per_layer = std::min(prompt_len, kept + c.chunk_size);
      } else if (c.chunk_policy == ChunkPolicy::kBudget && c.budget_cap_tokens > 0) {
        peak_per_layer = std::min(prompt_len, std::max(kept, c.budget_cap_tokens) + c.chunk_size);
      }  // kLastChunk: every chunk is stored in full before the last one compresses
      // Per-layer budgets (DepthKV) differ around the mean: one block of slack per layer.
      return num_layers *
             (pool_->BlocksFor(std::max(peak_per_layer, kept + decode_reserve_tokens)) + 1);
    }
    return num_layers * pool_->BlocksFor(peak_per_layer + decode_reserve_tokens);
  }

  absl::StatusOr<at::Tensor> Prefill(SequenceId seq, std::span<const int32_t> chunk,
                                     bool is_last_chunk,
                                     const CompressionParams& compression) override {
    if (compression.method == ScoreMethod::kNone) {
      return PrefillWithSelector(seq, chunk, is_last_chunk, nullptr);
    }
    if (!factory_) {
      return absl::FailedPreconditionError(
          "compression requested but no KvSelector factory is registered");
    }
    // One selector per sequence from its first chunk to its last: scorers that accumulate over
    // the prompt (H2O's column sums) keep their state across chunks.
    auto& selector = selectors_[seq];
    if (!selector) {
      auto created = factory_(compression, config());
      if (!created.ok()) {
        selectors_.erase(seq);
        return created.status();
      }
      selector = std::move(*created);
    }
    auto logits = PrefillWithSelector(seq, chunk, is_last_chunk, selector.get());
    if (logits.ok() && is_last_chunk) selectors_.erase(seq);
    return logits;
  }

  absl::StatusOr<at::Tensor> PrefillWithSelector(SequenceId seq, std::span<const int32_t> chunk,
                                                 bool is_last_chunk,
                                                 KvSelector* selector) override {
    if (chunk.empty()) return absl::InvalidArgumentError("prefill chunk is empty");
    RETURN_IF_ERROR(CheckTokens(chunk));
    c10::InferenceMode guard;
    const bool created = !pool_->HasSequence(seq);
    if (created) RETURN_IF_ERROR(pool_->AddSequence(seq));
    const SequenceBlocks snapshot = pool_->Snapshot(seq);
    const auto positions_snapshot = positions_[seq];
    const int64_t start = pool_->logical_len(seq);
    const int64_t n = static_cast<int64_t>(chunk.size());
    PrefillBackend backend(*this, seq, start, is_last_chunk, selector);
    auto fail = [&](absl::Status st) -> absl::Status {
      pool_->Restore(seq, snapshot);
      positions_[seq] = positions_snapshot;
      if (created) {
        pool_->FreeSequence(seq);
        positions_.erase(seq);
      }
      return st;
    };
    try {
      auto tokens = TokensTensor(chunk);
      auto positions = at::arange(start, start + n,
                                  at::TensorOptions().dtype(at::kLong).device(model_->device()));
      auto hidden = model_->Forward(tokens, positions, start + n - 1, backend);
      if (!hidden.ok()) return fail(hidden.status());
      pool_->FreeBlocks(backend.deferred_free());  // commit
      pool_->set_logical_len(seq, start + n);
      if (!is_last_chunk) return at::Tensor();
      return model_->Logits(hidden->narrow(0, n - 1, 1)).squeeze(0);  // fp32 [vocab]
    } catch (const std::exception& e) {
      return fail(absl::InternalError(absl::StrCat("prefill failed: ", e.what())));
    }
  }

  absl::StatusOr<at::Tensor> Decode(std::span<const SequenceId> seqs,
                                    std::span<const int32_t> tokens) override {
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
    std::vector<SequenceBlocks> snapshots;
    for (int64_t s : ids) snapshots.push_back(pool_->Snapshot(s));
    RETURN_IF_ERROR(pool_->AppendSlots(ids, 1));  // all-or-nothing; RESOURCE_EXHAUSTED unchanged
    auto undo = [&](absl::Status st) -> absl::Status {
      for (size_t i = 0; i < ids.size(); ++i) pool_->Restore(ids[i], snapshots[i]);
      return st;
    };
    try {
      const int64_t batch = static_cast<int64_t>(ids.size());
      const int32_t num_layers = config().num_layers;
      const int64_t bs = pool_->block_size();
      int64_t max_blocks = 1;
      for (int64_t s : ids) {
        for (int32_t l = 0; l < num_layers; ++l) {
          max_blocks = std::max<int64_t>(max_blocks, pool_->table(s, l).block_ids.size());
        }
      }
      // Host metadata for every layer, then one copy each to the device.
      auto slots = at::empty({num_layers, batch}, at::kLong);
      auto tables = at::zeros({num_layers, batch, max_blocks}, at::kInt);
      auto lens = at::empty({num_layers, batch}, at::kInt);
      auto positions = at::empty({batch}, at::kLong);
      auto* slots_p = slots.data_ptr<int64_t>();
      auto* tables_p = tables.data_ptr<int32_t>();
      auto* lens_p = lens.data_ptr<int32_t>();
      int64_t max_pos = 0;
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t pos = pool_->logical_len(ids[b]);
        positions.data_ptr<int64_t>()[b] = pos;
        max_pos = std::max(max_pos, pos);
        for (int32_t l = 0; l < num_layers; ++l) {
          const auto& t = pool_->table(ids[b], l);
          const int64_t last = t.stored_len - 1;
          slots_p[l * batch + b] = int64_t{t.block_ids[last / bs]} * bs + last % bs;
          lens_p[l * batch + b] = static_cast<int32_t>(t.stored_len);
          std::copy(t.block_ids.begin(), t.block_ids.end(),
                    tables_p + (l * batch + b) * max_blocks);
        }
      }
      const auto dev = model_->device();
      DecodeBackend backend(*pool_, slots.to(dev), tables.to(dev), lens.to(dev),
                            model_->attention_scale());
      auto hidden = model_->Forward(TokensTensor(tokens), positions.to(dev), max_pos, backend);
      if (!hidden.ok()) return undo(hidden.status());
      for (int64_t s : ids) pool_->set_logical_len(s, pool_->logical_len(s) + 1);
      return model_->Logits(*hidden);  // fp32 [B, vocab]
    } catch (const std::exception& e) {
      return undo(absl::InternalError(absl::StrCat("decode failed: ", e.what())));
    }
  }

  SequenceCacheInfo CacheInfo(SequenceId seq) const override {
    SequenceCacheInfo info;
    if (!pool_->HasSequence(seq)) return info;
    info.logical_len = pool_->logical_len(seq);
    for (int32_t l = 0; l < pool_->num_layers(); ++l)
      info.stored_len_per_layer.push_back(pool_->stored_len(seq, l));
    info.num_blocks = pool_->num_blocks_of(seq);
    return info;
  }

  void Release(SequenceId seq) override {
    pool_->FreeSequence(seq);
    positions_.erase(seq);
    selectors_.erase(seq);
  }

  absl::Status CompactLayer(SequenceId seq, int32_t layer_idx, const at::Tensor& kept) override {
    if (!pool_->HasSequence(seq))
      return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
    if (layer_idx < 0 || layer_idx >= config().num_layers) {
      return absl::InvalidArgumentError(absl::StrCat("layer_idx ", layer_idx, " out of range"));
    }
    c10::InferenceMode guard;
    try {
      auto [k, v] = GatherLayer(seq, layer_idx);
      ASSIGN_OR_RETURN(at::Tensor pos, StoredPositions(seq, layer_idx));
      std::vector<int32_t> old;
      RETURN_IF_ERROR(StoreKept(seq, layer_idx, k, v, pos, kept, &old));
      pool_->FreeBlocks(old);
      return absl::OkStatus();
    } catch (const std::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("CompactLayer: ", e.what()));
    }
  }

  absl::StatusOr<at::Tensor> StoredPositions(SequenceId seq, int32_t layer_idx) const override {
    if (!pool_->HasSequence(seq))
      return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
    auto it = positions_.find(seq);
    if (it != positions_.end() && it->second.size() > static_cast<size_t>(layer_idx) &&
        it->second[layer_idx].defined()) {
      return it->second[layer_idx];
    }
    const int64_t s = pool_->stored_len(seq, layer_idx);
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
    FullAttentionBackend backend;
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
  // The stored K, V of a layer: [Hkv, S, D] each.
  std::pair<at::Tensor, at::Tensor> GatherLayer(SequenceId seq, int32_t layer_idx) const {
    const int64_t s = pool_->stored_len(seq, layer_idx);
    const auto& kc = pool_->key_cache();
    const int64_t hkv = kc.size(2);
    const int64_t d = kc.size(3);
    auto slots = pool_->SlotIndices(seq, layer_idx, 0, s).to(kc.device());
    return {kc.view({-1, hkv, d}).index_select(0, slots).transpose(0, 1),
            pool_->value_cache().view({-1, hkv, d}).index_select(0, slots).transpose(0, 1)};
  }

  // Writes new_k/new_v ([m, Hkv, D]) into slots [begin, begin + m) of a layer.
  void WriteSlots(SequenceId seq, int32_t layer_idx, int64_t begin, const at::Tensor& new_k,
                  const at::Tensor& new_v) {
    const auto& kc = pool_->key_cache();
    const int64_t hkv = kc.size(2);
    const int64_t d = kc.size(3);
    auto slots = pool_->SlotIndices(seq, layer_idx, begin, begin + new_k.size(0)).to(kc.device());
    kc.view({-1, hkv, d}).index_copy_(0, slots, new_k.to(kc.scalar_type()));
    pool_->value_cache().view({-1, hkv, d}).index_copy_(0, slots, new_v.to(kc.scalar_type()));
  }

  // Replaces a layer's contents by the kept entries of k/v/pos ([Hkv, n, D], [Hkv, n]); the old
  // blocks go to `old` (the caller frees them on commit).
  absl::Status StoreKept(SequenceId seq, int32_t layer_idx, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& pos, const at::Tensor& kept,
                         std::vector<int32_t>* old) {
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
    RETURN_IF_ERROR(pool_->ReplaceLayer(seq, layer_idx, m, old));
    WriteSlots(seq, layer_idx, 0, kk, vv);
    auto& per_layer = positions_[seq];
    per_layer.resize(config().num_layers);
    per_layer[layer_idx] = pp;
    return absl::OkStatus();
  }

  void AppendPositions(SequenceId seq, int32_t layer_idx,
                       const at::Tensor& chunk_pos /*[Hkv, T]*/) {
    auto it = positions_.find(seq);
    if (it == positions_.end() || it->second.size() <= static_cast<size_t>(layer_idx) ||
        !it->second[layer_idx].defined()) {
      return;  // implicit arange: still valid
    }
    it->second[layer_idx] = at::cat({it->second[layer_idx], chunk_pos}, 1);
  }

  BlockPool& block_pool() { return *pool_; }
  double scale() const { return model_->attention_scale(); }

 private:
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
    return at::tensor(std::vector<int64_t>(tokens.begin(), tokens.end()), at::kLong)
        .to(model_->device());
  }

  RunnerOptions options_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<BlockPool> pool_;
  KvSelectorFactory factory_;
  std::unordered_map<SequenceId, std::unique_ptr<KvSelector>> selectors_;  // until the last chunk
  // Per sequence, per layer: positions [Hkv, stored] once a layer was compacted (undefined =
  // arange(stored_len), the uncompressed case). Tracked through prefill; decode does not extend
  // them.
  std::unordered_map<SequenceId, std::vector<at::Tensor>> positions_;
};

absl::StatusOr<at::Tensor> PrefillBackend::Attend(int32_t layer_idx, const at::Tensor& q,
                                                  const at::Tensor& k, const at::Tensor& v) {
  BlockPool& pool = runner_.block_pool();
  const int64_t t_len = q.size(0);
  const int64_t stored = pool.stored_len(seq_, layer_idx);
  auto chunk_k = k.transpose(0, 1);  // [Hkv, T, D]
  auto chunk_v = v.transpose(0, 1);
  at::Tensor all_k = chunk_k;
  at::Tensor all_v = chunk_v;
  if (stored > 0) {
    auto [old_k, old_v] = runner_.GatherLayer(seq_, layer_idx);
    all_k = at::cat({old_k, chunk_k}, 1);  // [Hkv, S + T, D]
    all_v = at::cat({old_v, chunk_v}, 1);
  }
  at::Tensor out = PrefillAttention(q, all_k, all_v, runner_.scale());  // [T, Hq, D]
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
    view.layer_idx = layer_idx;
    view.num_layers = runner_.config().num_layers;
    view.logical_len = start_pos_ + t_len;
    view.queries = q.transpose(0, 1);  // [Hq, T, D]
    view.keys = all_k;
    view.values = all_v;
    view.positions = all_pos;
    view.is_last_chunk = is_last_chunk_;
    ASSIGN_OR_RETURN(kept, selector_->Select(view));
  }
  if (kept) {
    std::vector<int32_t> old;
    RETURN_IF_ERROR(runner_.StoreKept(seq_, layer_idx, all_k, all_v, all_pos, *kept, &old));
    deferred_free_.insert(deferred_free_.end(), old.begin(), old.end());
  } else {
    RETURN_IF_ERROR(pool.AppendLayerSlots(seq_, layer_idx, t_len));
    runner_.WriteSlots(seq_, layer_idx, stored, k, v);
    runner_.AppendPositions(seq_, layer_idx, chunk_pos);
  }
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Create(const RunnerOptions& options) {
  SetThreadsFromEnv();
  c10::InferenceMode guard;
  std::string dir = options.model_dir;
  if (dir.empty()) {
    ASSIGN_OR_RETURN(dir, EnsureDemoModel(DefaultDemoModelDir()));
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
  if (options.block_size <= 0) return absl::InvalidArgumentError("block_size must be > 0");
  std::unique_ptr<Model> model;
  if (options.random_weights) {
    ASSIGN_OR_RETURN(model, Model::CreateRandom(config, device, dtype, options.random_seed));
  } else {
    ASSIGN_OR_RETURN(model, Model::Load(dir, config, device, dtype));
  }
  BlockPoolOptions po;
  po.block_size = options.block_size;
  po.num_layers = config.num_layers;
  po.num_kv_heads = config.num_kv_heads;
  po.head_dim = config.head_dim;
  po.dtype = dtype;
  po.device = device;
  const int64_t block_bytes = int64_t{2} * options.block_size * config.num_kv_heads *
                              config.head_dim * static_cast<int64_t>(c10::elementSize(dtype));
  if (options.num_kv_blocks > 0) {
    po.num_blocks = options.num_kv_blocks;
  } else {
    // TODO(issue 3): on CUDA, size from free memory after weights (needs the CUDA runtime API).
    const int64_t bytes = options.kv_cache_bytes > 0
                              ? options.kv_cache_bytes
                              : (device.is_cuda() ? (int64_t{8} << 30) : (int64_t{1} << 30));
    po.num_blocks = std::max<int64_t>(1, bytes / block_bytes);
  }
  ASSIGN_OR_RETURN(auto pool, BlockPool::Create(po));
  LogInfo(absl::StrCat("runner: KV pool of ", po.num_blocks, " blocks x ", po.block_size,
                       " slots (", po.num_blocks * block_bytes / (1 << 20), " MiB)"));
  return std::unique_ptr<ModelRunner>(
      new TorchModelRunner(options, std::move(model), std::move(pool)));
}

}  // namespace dropkv
