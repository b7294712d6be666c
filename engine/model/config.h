// A Hugging Face config.json parsed into the one struct the model code reads. Supported families:
// Llama 2/3/3.1 (rope_scaling llama3, linear, dynamic), Mistral (no sliding window), Qwen2/2.5
// (q/k/v bias), Gemma 1 ((1 + w) RMSNorm, GeGLU with tanh GELU, sqrt(hidden) embedding scale).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dropkv {

enum class ModelFamily { kLlama, kMistral, kQwen2, kGemma };

enum class RopeType { kDefault, kLinear, kDynamic, kLlama3 };

struct RopeParams {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;
  double factor = 1.0;                           // linear / dynamic / llama3
  double low_freq_factor = 1.0;                  // llama3
  double high_freq_factor = 4.0;                 // llama3
  int64_t original_max_position_embeddings = 0;  // llama3 / dynamic (0 = max_position_embeddings)
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
  RopeParams rope;
  int64_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v (and for Llama, o) projections carry a bias
  bool mlp_bias = false;
  std::string hidden_act = "silu";  // "silu" or "gelu_pytorch_tanh" (gelu* is tanh-approximated)
  int32_t bos_token_id = -1;        // -1 = none
  std::vector<int32_t> eos_token_ids;
  std::string torch_dtype;  // the checkpoint's dtype, informative

  int64_t q_size() const { return int64_t{num_heads} * head_dim; }
  int64_t kv_size() const { return int64_t{num_kv_heads} * head_dim; }
};

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
