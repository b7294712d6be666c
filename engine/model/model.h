// The decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3 / Gemma 1, 2, 3) on ATen ops. One
// forward works on N flat tokens (one prefill chunk, or one token per sequence of a decode batch);
// attention is delegated to an AttentionBackend so that the runner decides where K/V live (paged
// cache, compression hook). The model itself holds no cache.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "engine/model/config.h"

namespace dropkv {

class Communicator;

// Where a layer's attention reads and writes K/V.
class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  // q: [N, Hq, D]; k, v: [N, Hkv, D] of this forward's tokens, keys and queries after RoPE.
  // Returns the attention output [N, Hq, D] in q's dtype.
  virtual absl::StatusOr<at::Tensor> Attend(int32_t layer_idx, const at::Tensor& q,
                                            const at::Tensor& k, const at::Tensor& v) = 0;
  // false: q, k, v may be strided views of the fused projection (saves copies in decode).
  virtual bool wants_contiguous() const { return true; }

  // A paged cache this forward's K/V of a layer go to (see kernels/cache_ops.h for the layout).
  struct KvSlots {
    at::Tensor key_cache, value_cache;  // [num_blocks, block_size, Hkv, D]
    at::Tensor slots;                   // int64 [N]: token t's slot; negative = padding, skipped
  };
  // When set, the model may store K (after RoPE) and V there itself, fused with RoPE in one
  // kernel (CUDA decode); Attend then gets undefined k and v. nullopt: Attend gets them.
  virtual std::optional<KvSlots> kv_slots(int32_t layer_idx) { return std::nullopt; }
};

// Sees each layer's attention output (o_proj output, before the residual add): [N, hidden].
// For calibration (dropkv-calibrate). Called in layer order.
using AttentionObserver = std::function<void(int32_t layer_idx, const at::Tensor& attn_out)>;

// Contiguous in-forward attention: every token sees the earlier tokens of the same forward
// (one sequence, positions 0..N-1, no cache). For references and calibration.
class FullAttentionBackend : public AttentionBackend {
 public:
  explicit FullAttentionBackend(const ModelConfig& config) : config_(config) {}
  absl::StatusOr<at::Tensor> Attend(int32_t layer_idx, const at::Tensor& q, const at::Tensor& k,
                                    const at::Tensor& v) override;

 private:
  const ModelConfig& config_;
};

class Model {
 public:
  // Loads DIR's safetensors per `config` onto `device` in `dtype`. Errors name file and tensor.
  // kFp8 quantizes the projection weights per output channel (engine/model/fp8.h); an FP8
  // checkpoint (config.quantization_config) keeps its FP8 projections whatever `quant` says.
  // With `comm` (tensor parallelism), only this rank's shard (PlanTensorParallel) is kept, and
  // the forward calls the group's collectives: every rank must run the same forwards.
  static absl::StatusOr<std::unique_ptr<Model>> Load(
      const std::string& model_dir, const ModelConfig& config, at::Device device,
      at::ScalarType dtype, WeightQuantization quant = WeightQuantization::kNone,
      Communicator* comm = nullptr);
  // The same model with every weight drawn on `device` from normal(0, 0.02) (seeded): real
  // geometry for benchmarks without a checkpoint. Under tensor parallelism each rank draws the
  // whole tensor and keeps its shard, so the shards are those of the one-rank model.
  static absl::StatusOr<std::unique_ptr<Model>> CreateRandom(
      const ModelConfig& config, at::Device device, at::ScalarType dtype, uint64_t seed,
      WeightQuantization quant = WeightQuantization::kNone, Communicator* comm = nullptr);
  ~Model();

  // Under tensor parallelism this rank's shard config (its heads and MLP width; see
  // TensorParallelLayout::shard).
  const ModelConfig& config() const { return config_; }
  const TensorParallelLayout& tensor_parallel() const { return tp_; }
  Communicator* communicator() const { return comm_; }
  at::Device device() const;
  at::ScalarType dtype() const { return dtype_; }
  // Projection weights held as FP8 e4m3 with fp32 scales (quantized at load or read so).
  bool fp8_weights() const;
  // The softmax scale of layer `layer_idx`'s attention logits (ModelConfig::attention_scale).
  double attention_scale(int32_t layer_idx) const { return config_.attention_scale(layer_idx); }

  // tokens, positions: int64 [N] on the model's device; max_position = max(positions) (only
  // dynamic RoPE reads it; the caller knows it on the host). Returns the final-norm hidden
  // states [N, hidden]. Throws nothing.
  absl::StatusOr<at::Tensor> Forward(const at::Tensor& tokens, const at::Tensor& positions,
                                     int64_t max_position, AttentionBackend& backend,
                                     const AttentionObserver* observer = nullptr) const;
  // hidden [N, hidden] -> fp32 logits [N, vocab].
  at::Tensor Logits(const at::Tensor& hidden) const;
  // Weights held in oneDNN's packed layout (CPU fp32, large matrices; see PackForCpu).
  int32_t num_packed_weights() const { return num_packed_weights_; }
  // CUDA: residual + RMSNorm, RoPE (+ the K/V store in decode) and the gated activation run as
  // fused kernels (kernels/fused_ops.h), about 10 fewer launches per layer; off: the ATen ops.
  // No effect on the CPU. On by default.
  void set_fused_cuda_ops(bool on) { fused_cuda_ops_ = on; }
  bool uses_fused_ops(const at::Tensor& x) const;
  // CUDA, with the fused ops, single-token forwards (decode at batch 1): every projection runs
  // as our plain GEMV (kernels/fused_gemv.h) after the fused norm / activation kernels, and qkv's
  // GEMV does RoPE + the K/V store; a matrix whose K leaves too little shared memory uses cuBLAS
  // as before. Larger forwards keep cuBLAS (the GEMV's stages are tuned for one token). Off by
  // default; RunnerOptions::cuda_decode_gemv turns it on.
  void set_fused_gemv(bool on) { fused_gemv_ = on; }
  // CPU fp32: replaces the large projection weights (and an untied LM head) by oneDNN-packed
  // copies; elsewhere nothing. Memory-neutral: the plain ones go. Once, right after loading.
  void PackForCpu();

 private:
  struct Layer {
    // Norms (Gemma: 1 + w, fp32): before attention and before the MLP [hidden]; with
    // sandwich_norms also on the attention and MLP outputs; with qk_norm on q and k [head_dim].
    at::Tensor input_norm, post_norm, attn_out_norm, mlp_out_norm, q_norm, k_norm;
    // As stored (freed once fused): [q_size, hidden], [kv_size, hidden] x2; [inter, hidden] x2.
    at::Tensor q_w, k_w, v_w, q_b, k_b, v_b, gate_w, up_w, gate_b, up_b;
    // Fused at load so that one GEMM does q, k and v (and one gate and up): fewer launches, and
    // a decode GEMV streams one weight matrix instead of three.
    at::Tensor qkv_w, qkv_b;          // [q_size + 2 kv_size, hidden], optional bias
    at::Tensor gate_up_w, gate_up_b;  // [2 inter, hidden], optional bias
    at::Tensor o_w, o_b;              // [hidden, q_size], optional bias
    at::Tensor down_w, down_b;        // [hidden, inter], optional bias
    // With FP8 projections: each *_w above is e4m3 and its scales sit here, fp32 [out, G]
    // (engine/model/fp8.h); undefined otherwise.
    at::Tensor q_s, k_s, v_s, gate_s, up_s, qkv_s, gate_up_s, o_s, down_s;
  };
  Model(const TensorParallelLayout& tp, at::ScalarType dtype, Communicator* comm)
      : config_(tp.shard), tp_(tp), comm_(comm), dtype_(dtype) {}
  // Reads the weights from `model_dir`, or draws them when `random_seed` is set.
  static absl::StatusOr<std::unique_ptr<Model>> LoadOrDraw(const std::string& model_dir,
                                                           const ModelConfig& config,
                                                           at::Device device, at::ScalarType dtype,
                                                           std::optional<uint64_t> random_seed,
                                                           WeightQuantization quant,
                                                           Communicator* comm);
  // Token embeddings [N, hidden]; vocabulary-parallel under tensor parallelism (each rank looks
  // up the tokens in its rows, zeros elsewhere, then one all-reduce).
  at::Tensor Embed(const at::Tensor& tokens) const;
  // A row-parallel layer's partial output summed over the ranks (in place), then its bias.
  at::Tensor ReduceRowParallel(at::Tensor y, const at::Tensor& bias) const;
  // Concatenates q/k/v and gate/up into qkv_w / gate_up_w and drops the separate tensors.
  static void FuseProjections(Layer& l);
  at::Tensor Norm(const at::Tensor& x, const at::Tensor& w) const;
  // x += delta (when defined), then Norm(x, w): one kernel when `fused`, else two ATen ops (x is
  // then replaced, not updated in place).
  absl::StatusOr<at::Tensor> AddNorm(at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                                     bool fused) const;
  // fp32 [D/2] frequencies of `rope` (the global or the sliding layers') for a forward whose
  // largest position is max_position (only dynamic RoPE depends on it).
  at::Tensor RopeFrequencies(const RopeParams& rope, const at::Tensor& cached,
                             int64_t max_position) const;
  // RoPE for one forward: the fused kernels take the frequencies, the ATen ops cos/sin tables.
  struct Rope {
    at::Tensor positions;     // int64 [N]
    at::Tensor inv_freq;      // fused: fp32 [D/2]
    at::Tensor cos_h, sin_h;  // unfused: [N, 1, D], model dtype
  };
  // One forward's RoPE for the global layers and for the sliding layers (the same when their
  // parameters are).
  struct Ropes {
    Rope global, local;
    const Rope& of(const ModelConfig& c, int32_t layer_idx) const {
      return c.is_sliding(layer_idx) ? local : global;
    }
  };
  Rope MakeRope(const RopeParams& params, const at::Tensor& cached, const at::Tensor& positions,
                int64_t max_position, bool fused) const;
  // q and k of qkv [N, q_size + 2 kv_size] normed per head in place (qk_norm).
  void NormQk(const at::Tensor& qkv, const Layer& l) const;
  struct QkvHeads {
    at::Tensor q, k, v;  // [N, Hq, D], [N, Hkv, D] x2; k, v undefined once stored by the kernel
  };
  // One layer's q, k, v from its fused projection qkv [N, q_size + 2 kv_size], RoPE applied.
  absl::StatusOr<QkvHeads> SplitHeads(const at::Tensor& qkv, const Rope& rope, bool fused,
                                      int32_t layer_idx, AttentionBackend& backend) const;

  // Which projections of a forward of x run as the GEMV (set_fused_gemv).
  struct GemvPlan {
    bool qkv = false, o = false, gate_up = false, down = false;
  };
  GemvPlan PlanGemvs(const at::Tensor& x, bool fused) const;

  ModelConfig config_;
  TensorParallelLayout tp_;
  Communicator* comm_ = nullptr;  // null: the whole model on one device
  at::ScalarType dtype_;
  at::Tensor embed_;           // [vocab, hidden]
  at::Tensor final_norm_;      // [hidden]
  at::Tensor lm_head_;         // [vocab, hidden] (the embedding when tied)
  at::Tensor inv_freq_;        // fp32 [D/2], global layers
  at::Tensor inv_freq_local_;  // fp32 [D/2], sliding layers
  std::vector<Layer> layers_;
  int32_t num_packed_weights_ = 0;
  int64_t fp8_group_k_ = 0;  // block checkpoints: input columns per scale (fp8.h's group_k)
  bool fused_cuda_ops_ = true;
  bool fused_gemv_ = false;
};

// fp32 [D/2] RoPE inverse frequencies of `rope` for head_dim `head_dim` at sequence length
// `seq_len` (only dynamic scaling depends on it), computed exactly as transformers does.
at::Tensor RopeInvFreq(const RopeParams& rope, int64_t head_dim, int64_t seq_len);

}  // namespace dropkv
