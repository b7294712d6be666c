// A Hugging Face config.json parsed into the one struct the model code reads. Supported families:
// Llama 2/3/3.1 (rope_scaling llama3, linear, dynamic, yarn), Mistral (sliding window), Qwen2/2.5
// (q/k/v bias), Qwen3 (q/k norms), Gemma 1 ((1 + w) RMSNorm, GeGLU with tanh GELU, sqrt(hidden)
// embedding scale), Gemma 2 (+ norms after attention and MLP, attention and final-logit
// soft-capping, alternating sliding-window layers), Gemma 3 text (+ q/k norms, a RoPE base of its
// own for the sliding-window layers, no soft-capping). Both config.json styles: transformers 5's
// `rope_parameters` (per layer type for Gemma 3) and the older `rope_theta` + `rope_scaling`.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dropkv {

enum class ModelFamily { kLlama, kMistral, kQwen2, kQwen3, kGemma, kGemma2, kGemma3 };

enum class RopeType { kDefault, kLinear, kDynamic, kLlama3, kYarn };

// What the projection weights (q/k/v/o, gate/up/down) are held as. kFp8: float8 e4m3 with fp32
// scales (engine/model/fp8.h); embeddings, norms and the LM head keep the model dtype.
enum class WeightQuantization { kNone, kFp8 };
// "none" | "fp8"; anything else is INVALID_ARGUMENT naming the value.
absl::StatusOr<WeightQuantization> ParseWeightQuantization(const std::string& name);

// How a published checkpoint stores its projections (config.json `quantization_config`).
enum class CheckpointQuantMethod {
  kNone,
  // quant_method "fp8" (transformers' FineGrainedFP8): `*.weight` e4m3 and `*.weight_scale_inv`
  // [ceil(out / block_n), ceil(in / block_k)] multipliers (a scalar without weight_block_size).
  kFp8,
  // quant_method "compressed-tensors", float 8-bit weights: `*.weight` e4m3 and `*.weight_scale`
  // per output channel [out, 1] or per tensor [1].
  kCompressedTensors,
};

struct RopeParams {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;
  double factor = 1.0;            // linear / dynamic / llama3 / yarn
  double low_freq_factor = 1.0;   // llama3
  double high_freq_factor = 4.0;  // llama3
  // llama3 / dynamic / yarn (0 = max_position_embeddings)
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32.0;  // yarn
  double beta_slow = 1.0;   // yarn
  bool truncate = true;     // yarn: integer correction range
  // yarn: HF multiplies cos and sin by it; here it scales the attention logits by its square
  // instead (the same scores; the fused RoPE kernels need no extra input).
  double attention_factor = 1.0;
};

struct ModelConfig {
  ModelFamily family = ModelFamily::kLlama;
  std::string model_type;  // as in config.json ("llama", "mistral", "qwen2", "gemma")
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int32_t num_layers = 0;
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  double rms_norm_eps = 1e-6;
  RopeParams rope;        // global (full-attention) layers
  RopeParams rope_local;  // sliding-window layers (Gemma 3 gives them a base of their own)
  // Sliding-window attention: a sliding layer's query at position p sees positions
  // (p - sliding_window, p]. sliding_layers[i] marks layer i (empty: no sliding layers).
  int64_t sliding_window = 0;
  std::vector<bool> sliding_layers;
  // Gemma 2/3: the attention scale is query_pre_attn_scalar^-1/2 (0: head_dim^-1/2).
  double query_pre_attn_scalar = 0;
  double attn_logit_softcapping = 0;   // Gemma 2: logits -> cap * tanh(logits / cap) (0 = off)
  double final_logit_softcapping = 0;  // Gemma 2: the same on the LM head's output
  bool qk_norm = false;         // Qwen3, Gemma 3: RMSNorm over head_dim on q and k before RoPE
  bool sandwich_norms = false;  // Gemma 2/3: RMSNorm on the attention and MLP outputs as well
  int64_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v (and for Llama, o) projections carry a bias
  bool mlp_bias = false;
  std::string hidden_act = "silu";  // "silu" or "gelu_pytorch_tanh" (gelu* is tanh-approximated)
  int32_t bos_token_id = -1;        // -1 = none
  std::vector<int32_t> eos_token_ids;
  std::string torch_dtype;  // the checkpoint's dtype, informative
  CheckpointQuantMethod checkpoint_quant = CheckpointQuantMethod::kNone;
  std::vector<int64_t> fp8_block;  // kFp8: weight_block_size {block_n, block_k}; empty = per tensor

  int64_t q_size() const { return int64_t{num_heads} * head_dim; }
  int64_t kv_size() const { return int64_t{num_kv_heads} * head_dim; }
  // Gemma families: (1 + w) RMSNorm in fp32 and the sqrt(hidden) embedding scale.
  bool gemma_norms() const {
    return family == ModelFamily::kGemma || family == ModelFamily::kGemma2 ||
           family == ModelFamily::kGemma3;
  }
  bool is_sliding(int32_t layer_idx) const {
    return !sliding_layers.empty() && sliding_layers[layer_idx];
  }
  int32_t num_sliding_layers() const {
    return static_cast<int32_t>(std::count(sliding_layers.begin(), sliding_layers.end(), true));
  }
  // Layers whose cache grows with the context: the ones KV compression and DepthKV budgets act on.
  int32_t num_global_layers() const { return num_layers - num_sliding_layers(); }
  const RopeParams& rope_of(int32_t layer_idx) const {
    return is_sliding(layer_idx) ? rope_local : rope;
  }
  // Softmax scale of a layer's attention logits (query_pre_attn_scalar, YaRN's attention factor).
  double attention_scale(int32_t layer_idx) const {
    const double f = rope_of(layer_idx).attention_factor;
    const double base = query_pre_attn_scalar > 0 ? query_pre_attn_scalar : head_dim;
    return f * f / std::sqrt(base);
  }
};

// One rank's part of a model split over `size` ranks (tensor parallelism, Megatron style): the
// query heads, the MLP width and the vocabulary divided; the KV heads divided too, or, with fewer
// KV heads than ranks, a copy on each rank of the one its query heads read.
struct TensorParallelLayout {
  int32_t rank = 0;
  int32_t size = 1;
  int32_t q_head_begin = 0;   // this rank's first query head (global numbering)
  int32_t kv_head_begin = 0;  // this rank's first KV head
  int32_t kv_replicas = 1;    // ranks holding a copy of each of this rank's KV heads
  int64_t inter_begin = 0;    // this rank's first MLP column
  // Vocabulary rows [vocab_begin, vocab_begin + vocab_rows) of the embedding and the LM head;
  // every rank's slice is padded to vocab_chunk rows for the logits' all-gather.
  int64_t vocab_begin = 0;
  int64_t vocab_rows = 0;
  int64_t vocab_chunk = 0;
  // The config this rank's shard runs with: num_heads, num_kv_heads and intermediate_size are
  // the rank's own (vocab_size and hidden_size stay the model's).
  ModelConfig shard;
};

// The layout of rank `rank` of `size`; INVALID_ARGUMENT naming tensor_parallel_size when the heads
// or the MLP width do not divide.
absl::StatusOr<TensorParallelLayout> PlanTensorParallel(const ModelConfig& config, int32_t rank,
                                                        int32_t size);

// The supported `architectures` / `model_type` values, for error messages.
std::string SupportedArchitectures();

// Parses config.json text; `path` only names the file in errors. Unknown architecture/model_type
// is INVALID_ARGUMENT listing the supported ones; missing or invalid fields name the field.
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text, const std::string& path);
// Reads DIR/config.json (NOT_FOUND naming the file when absent).
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir);
// Adds eos ids from DIR/generation_config.json when present (missing file = no change).
void MergeGenerationConfig(const std::string& model_dir, ModelConfig* config);

}  // namespace dropkv
