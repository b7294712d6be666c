#include "engine/model/config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "engine/common/file_util.h"
#include "engine/common/status_macros.h"

namespace dropkv {
namespace {

using json = nlohmann::json;

struct FamilyName {
  const char* architecture;
  const char* model_type;
  ModelFamily family;
};
constexpr FamilyName kFamilies[] = {
    {"LlamaForCausalLM", "llama", ModelFamily::kLlama},
    {"MistralForCausalLM", "mistral", ModelFamily::kMistral},
    {"Qwen2ForCausalLM", "qwen2", ModelFamily::kQwen2},
    {"Qwen3ForCausalLM", "qwen3", ModelFamily::kQwen3},
    {"GemmaForCausalLM", "gemma", ModelFamily::kGemma},
    {"Gemma2ForCausalLM", "gemma2", ModelFamily::kGemma2},
    {"Gemma3ForCausalLM", "gemma3_text", ModelFamily::kGemma3},
};

template <typename T>
bool FitsIn(const json& v) {
  if (!v.is_number_integer()) return false;
  if (v.is_number_unsigned())
    return v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max());
  const int64_t x = v.get<int64_t>();
  return x >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
         x <= static_cast<int64_t>(std::numeric_limits<T>::max());
}

// Reads an optional number field; errors name the file and the field.
template <typename T>
absl::Status Get(const json& j, const char* key, const std::string& path, T* out, bool required) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required)
      return absl::InvalidArgumentError(absl::StrCat(path, ": missing field '", key, "'"));
    return absl::OkStatus();
  }
  if constexpr (std::is_same_v<T, bool>) {
    if (!it->is_boolean())
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": field '", key, "' must be a boolean"));
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!it->is_string())
      return absl::InvalidArgumentError(absl::StrCat(path, ": field '", key, "' must be a string"));
  } else if constexpr (std::is_integral_v<T>) {
    // Integer fields: no floats (their conversion is UB when out of range) and no wrapping.
    if (!it->is_number_integer() || !FitsIn<T>(*it)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": field '", key, "' must be an integer in range"));
    }
  } else {
    if (!it->is_number())
      return absl::InvalidArgumentError(absl::StrCat(path, ": field '", key, "' must be a number"));
  }
  *out = it->get<T>();
  return absl::OkStatus();
}

// One RoPE description (`rope_parameters`, one of its per-layer-type entries, or the older
// `rope_scaling`) into `r`; fields it does not name keep their values.
absl::Status ParseRopeDict(const json& d, const std::string& path, RopeParams* r) {
  RETURN_IF_ERROR(Get(d, "rope_theta", path, &r->theta, false));
  std::string type;
  RETURN_IF_ERROR(Get(d, "type", path, &type, false));
  RETURN_IF_ERROR(Get(d, "rope_type", path, &type, false));
  RETURN_IF_ERROR(Get(d, "factor", path, &r->factor, false));
  RETURN_IF_ERROR(Get(d, "low_freq_factor", path, &r->low_freq_factor, false));
  RETURN_IF_ERROR(Get(d, "high_freq_factor", path, &r->high_freq_factor, false));
  RETURN_IF_ERROR(Get(d, "original_max_position_embeddings", path,
                      &r->original_max_position_embeddings, false));
  RETURN_IF_ERROR(Get(d, "beta_fast", path, &r->beta_fast, false));
  RETURN_IF_ERROR(Get(d, "beta_slow", path, &r->beta_slow, false));
  RETURN_IF_ERROR(Get(d, "truncate", path, &r->truncate, false));
  if (type.empty() || type == "default") {
    r->type = RopeType::kDefault;
  } else if (type == "linear") {
    r->type = RopeType::kLinear;
  } else if (type == "dynamic") {
    r->type = RopeType::kDynamic;
  } else if (type == "llama3") {
    r->type = RopeType::kLlama3;
  } else if (type == "yarn") {
    r->type = RopeType::kYarn;
    // transformers' _compute_yarn_parameters: attention_factor, else from factor (and mscale /
    // mscale_all_dim when both are given).
    auto mscale_of = [](double scale, double m) {
      return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
    };
    double mscale = 0, mscale_all_dim = 0;
    RETURN_IF_ERROR(Get(d, "mscale", path, &mscale, false));
    RETURN_IF_ERROR(Get(d, "mscale_all_dim", path, &mscale_all_dim, false));
    r->attention_factor = mscale != 0 && mscale_all_dim != 0
                              ? mscale_of(r->factor, mscale) / mscale_of(r->factor, mscale_all_dim)
                              : mscale_of(r->factor, 1.0);
    RETURN_IF_ERROR(Get(d, "attention_factor", path, &r->attention_factor, false));
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": rope type '", type,
                     "' is not supported (default, linear, dynamic, llama3, yarn)"));
  }
  if (r->factor <= 0)
    return absl::InvalidArgumentError(absl::StrCat(path, ": rope factor must be > 0"));
  if (r->theta <= 0)
    return absl::InvalidArgumentError(absl::StrCat(path, ": rope_theta must be > 0"));
  return absl::OkStatus();
}

absl::Status ParseRope(const json& j, const std::string& path, ModelConfig* c) {
  // transformers >= 5 writes "rope_parameters" (with rope_theta inside; per layer type for
  // Gemma 3); older files write "rope_theta" + "rope_scaling" (+ Gemma 3's
  // "rope_local_base_freq" for its sliding layers, 10000 when absent).
  RETURN_IF_ERROR(Get(j, "rope_theta", path, &c->rope.theta, false));
  double local_theta = 10000.0;
  RETURN_IF_ERROR(Get(j, "rope_local_base_freq", path, &local_theta, false));
  const json* global = nullptr;
  const json* local = nullptr;
  if (auto it = j.find("rope_parameters"); it != j.end() && it->is_object()) {
    if (it->contains("full_attention") || it->contains("sliding_attention")) {
      if (auto g = it->find("full_attention"); g != it->end() && g->is_object()) global = &*g;
      if (auto l = it->find("sliding_attention"); l != it->end() && l->is_object()) local = &*l;
    } else {
      global = &*it;
    }
  }
  if (auto it = j.find("rope_scaling"); it != j.end() && it->is_object()) global = &*it;
  if (global != nullptr) RETURN_IF_ERROR(ParseRopeDict(*global, path, &c->rope));
  if (local != nullptr) {
    RETURN_IF_ERROR(ParseRopeDict(*local, path, &c->rope_local));
  } else if (c->family == ModelFamily::kGemma3) {
    c->rope_local = RopeParams{};  // Gemma 3's scaling (if any) is for its global layers only
    c->rope_local.theta = local_theta;
  } else {
    c->rope_local = c->rope;
  }
  for (RopeParams* r : {&c->rope, &c->rope_local}) {
    if (r->original_max_position_embeddings <= 0)
      r->original_max_position_embeddings = c->max_position_embeddings;
  }
  return absl::OkStatus();
}

// Which layers attend through a sliding window: `layer_types` when given, else each family's rule
// as transformers applies it (Gemma 2: every other layer from the first; Gemma 3: all but every
// sliding_window_pattern-th; Mistral: all; Qwen2/3 with use_sliding_window: from
// max_window_layers on). A window that covers max_position_embeddings is no window.
absl::Status ParseSlidingWindow(const json& j, const std::string& path, ModelConfig* c) {
  std::optional<int64_t> window;
  if (auto it = j.find("sliding_window"); it != j.end() && !it->is_null()) {
    int64_t w = 0;
    RETURN_IF_ERROR(Get(j, "sliding_window", path, &w, true));
    if (w <= 0)
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": field 'sliding_window' must be > 0 or null, got ", w));
    window = w;
  }
  const int32_t n = c->num_layers;
  std::vector<bool> sliding(n, false);
  if (auto it = j.find("layer_types"); it != j.end() && !it->is_null()) {
    if (!it->is_array() || static_cast<int64_t>(it->size()) != n) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": field 'layer_types' must list num_hidden_layers (", n, ") types"));
    }
    for (int32_t i = 0; i < n; ++i) {
      const json& t = (*it)[i];
      if (t == "sliding_attention") {
        sliding[i] = true;
      } else if (t != "full_attention") {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": layer_types[", i, "] must be full_attention or sliding_attention"));
      }
    }
  } else if (c->family == ModelFamily::kGemma2) {
    for (int32_t i = 0; i < n; ++i) sliding[i] = (i + 1) % 2 != 0;
  } else if (c->family == ModelFamily::kGemma3) {
    int32_t pattern = 6;
    RETURN_IF_ERROR(Get(j, "sliding_window_pattern", path, &pattern, false));
    if (pattern <= 0)
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": field 'sliding_window_pattern' must be > 0"));
    for (int32_t i = 0; i < n; ++i) sliding[i] = (i + 1) % pattern != 0;
  } else if (c->family == ModelFamily::kMistral) {
    sliding.assign(n, true);
  } else if (c->family == ModelFamily::kQwen2 || c->family == ModelFamily::kQwen3) {
    bool use = false;
    int32_t max_window_layers = n;
    RETURN_IF_ERROR(Get(j, "use_sliding_window", path, &use, false));
    RETURN_IF_ERROR(Get(j, "max_window_layers", path, &max_window_layers, false));
    for (int32_t i = 0; i < n; ++i) sliding[i] = use && i >= max_window_layers;
  }
  if (!window || *window >= c->max_position_embeddings ||
      std::find(sliding.begin(), sliding.end(), true) == sliding.end()) {
    return absl::OkStatus();  // no sliding layers
  }
  c->sliding_window = *window;
  c->sliding_layers = std::move(sliding);
  return absl::OkStatus();
}

absl::Status ParseIds(const json& j, const char* key, std::vector<int32_t>* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (it->is_number_integer()) {
    if (FitsIn<int32_t>(*it)) out->push_back(it->get<int32_t>());
  } else if (it->is_array()) {
    for (const auto& v : *it) {
      if (FitsIn<int32_t>(v)) out->push_back(v.get<int32_t>());
    }
  }
  return absl::OkStatus();
}

// config.json's `quantization_config`: which FP8 layout the projections are stored in. Only FP8
// e4m3 weights are read; the activation scheme does not matter here because the forward
// dequantizes the weights (engine/model/fp8.h), so static input scales are not used.
absl::Status ParseQuantizationConfig(const json& j, const std::string& path, ModelConfig* c) {
  auto it = j.find("quantization_config");
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  const std::string where = absl::StrCat(path, ": quantization_config");
  if (!it->is_object()) return absl::InvalidArgumentError(where + " must be an object");
  std::string method;
  RETURN_IF_ERROR(Get(*it, "quant_method", where, &method, true));
  if (method == "fp8") {
    c->checkpoint_quant = CheckpointQuantMethod::kFp8;
    if (auto b = it->find("weight_block_size"); b != it->end() && !b->is_null()) {
      if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number_integer() ||
          !(*b)[1].is_number_integer() || (*b)[0].get<int64_t>() <= 0 ||
          (*b)[1].get<int64_t>() <= 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": weight_block_size must be two positive integers, got ", b->dump()));
      }
      c->fp8_block = {(*b)[0].get<int64_t>(), (*b)[1].get<int64_t>()};
    }
    return absl::OkStatus();
  }
  if (method == "compressed-tensors") {
    c->checkpoint_quant = CheckpointQuantMethod::kCompressedTensors;
    auto groups = it->find("config_groups");
    if (groups == it->end() || !groups->is_object() || groups->empty())
      return absl::InvalidArgumentError(where + ": compressed-tensors without config_groups");
    for (const auto& [name, group] : groups->items()) {
      const auto w = group.find("weights");
      const bool fp8 = w != group.end() && w->is_object() && w->value("type", "") == "float" &&
                       w->value("num_bits", 0) == 8;
      const std::string strategy =
          w != group.end() && w->is_object() ? w->value("strategy", "") : "";
      if (!fp8 || (strategy != "channel" && strategy != "tensor")) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": config group '", name,
            "': only 8-bit float weights per channel or per tensor are supported, got ",
            w != group.end() ? w->dump() : "no weights"));
      }
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(where, ": quant_method '", method,
                                                 "' is not supported (fp8, compressed-tensors)"));
}

}  // namespace

absl::StatusOr<WeightQuantization> ParseWeightQuantization(const std::string& name) {
  if (name == "none") return WeightQuantization::kNone;
  if (name == "fp8") return WeightQuantization::kFp8;
  return absl::InvalidArgumentError(
      absl::StrCat("quantization: '", name, "' is not one of none, fp8"));
}

absl::StatusOr<TensorParallelLayout> PlanTensorParallel(const ModelConfig& c, int32_t rank,
                                                        int32_t size) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor_parallel_size: rank ", rank, " out of a group of ", size));
  }
  const int32_t hq = c.num_heads, hkv = c.num_kv_heads;
  if (hq % size != 0 || c.intermediate_size % size != 0 || (hkv % size != 0 && size % hkv != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor_parallel_size: ", size, " does not divide this model (", hq, " query heads, ", hkv,
        " KV heads, intermediate_size ", c.intermediate_size,
        "): it must divide the query heads and the MLP width, and divide or be a multiple of the "
        "KV heads"));
  }
  TensorParallelLayout t;
  t.rank = rank;
  t.size = size;
  const int32_t hq_rank = hq / size;
  t.q_head_begin = rank * hq_rank;
  // Query head h reads KV head h / (hq / hkv).
  t.kv_head_begin = t.q_head_begin / (hq / hkv);
  t.kv_replicas = hkv >= size ? 1 : size / hkv;
  t.inter_begin = rank * (c.intermediate_size / size);
  t.vocab_chunk = (c.vocab_size + size - 1) / size;
  t.vocab_begin = std::min<int64_t>(rank * t.vocab_chunk, c.vocab_size);
  t.vocab_rows = std::min<int64_t>(t.vocab_chunk, c.vocab_size - t.vocab_begin);
  if (c.vocab_size - (size - 1) * t.vocab_chunk <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor_parallel_size: ", size,
                                                   " ranks leave one without vocabulary rows of ",
                                                   c.vocab_size));
  }
  t.shard = c;
  t.shard.num_heads = hq_rank;
  t.shard.num_kv_heads = std::max(1, hkv / size);
  t.shard.intermediate_size = c.intermediate_size / size;
  return t;
}

std::string SupportedArchitectures() {
  std::string s;
  for (const auto& f : kFamilies)
    absl::StrAppend(&s, s.empty() ? "" : ", ", f.architecture, " (", f.model_type, ")");
  return s;
}

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& json_text,
                                             const std::string& path) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid JSON: ", e.what()));
  }
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  ModelConfig c;
  RETURN_IF_ERROR(Get(j, "model_type", path, &c.model_type, false));
  std::string arch;
  if (auto it = j.find("architectures");
      it != j.end() && it->is_array() && !it->empty() && (*it)[0].is_string()) {
    arch = (*it)[0].get<std::string>();
  }
  const FamilyName* found = nullptr;
  for (const auto& f : kFamilies) {
    if ((!arch.empty() && arch == f.architecture) || (arch.empty() && c.model_type == f.model_type))
      found = &f;
  }
  if (found == nullptr || (!c.model_type.empty() && c.model_type != found->model_type)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": unsupported model (architectures '",
                                                   arch, "', model_type '", c.model_type,
                                                   "'); supported: ", SupportedArchitectures()));
  }
  c.family = found->family;
  c.model_type = found->model_type;
  RETURN_IF_ERROR(Get(j, "vocab_size", path, &c.vocab_size, true));
  RETURN_IF_ERROR(Get(j, "hidden_size", path, &c.hidden_size, true));
  RETURN_IF_ERROR(Get(j, "intermediate_size", path, &c.intermediate_size, true));
  RETURN_IF_ERROR(Get(j, "num_hidden_layers", path, &c.num_layers, true));
  RETURN_IF_ERROR(Get(j, "num_attention_heads", path, &c.num_heads, true));
  c.num_kv_heads = c.num_heads;
  RETURN_IF_ERROR(Get(j, "num_key_value_heads", path, &c.num_kv_heads, false));
  if (c.num_heads > 0) c.head_dim = static_cast<int32_t>(c.hidden_size / c.num_heads);
  RETURN_IF_ERROR(Get(j, "head_dim", path, &c.head_dim, false));
  RETURN_IF_ERROR(Get(j, "rms_norm_eps", path, &c.rms_norm_eps, false));
  RETURN_IF_ERROR(Get(j, "max_position_embeddings", path, &c.max_position_embeddings, false));
  c.tie_word_embeddings = c.gemma_norms();
  RETURN_IF_ERROR(Get(j, "tie_word_embeddings", path, &c.tie_word_embeddings, false));
  c.attention_bias = c.family == ModelFamily::kQwen2;  // Qwen2 always has q/k/v bias
  if (c.family != ModelFamily::kQwen2) {
    RETURN_IF_ERROR(Get(j, "attention_bias", path, &c.attention_bias, false));
  }
  if (c.family == ModelFamily::kLlama) {
    RETURN_IF_ERROR(Get(j, "mlp_bias", path, &c.mlp_bias, false));
  }
  if (c.gemma_norms()) {
    // Gemma checkpoints may say "gelu" in hidden_act but were trained with the tanh
    // approximation (HF uses hidden_activation when given, and warns to use gelu_pytorch_tanh).
    std::string act;
    RETURN_IF_ERROR(Get(j, "hidden_activation", path, &act, false));
    c.hidden_act = act.empty() ? "gelu_pytorch_tanh" : act;
  } else {
    RETURN_IF_ERROR(Get(j, "hidden_act", path, &c.hidden_act, false));
  }
  if (c.hidden_act != "silu" && c.hidden_act != "gelu_pytorch_tanh" && c.hidden_act != "gelu") {
    return absl::InvalidArgumentError(absl::StrCat(path, ": hidden_act '", c.hidden_act,
                                                   "' is not supported (silu, gelu_pytorch_tanh)"));
  }
  c.qk_norm = c.family == ModelFamily::kQwen3 || c.family == ModelFamily::kGemma3;
  c.sandwich_norms = c.family == ModelFamily::kGemma2 || c.family == ModelFamily::kGemma3;
  if (c.family == ModelFamily::kGemma2 || c.family == ModelFamily::kGemma3) {
    // transformers' defaults for these fields; a null field is off.
    c.query_pre_attn_scalar = 256;
    if (c.family == ModelFamily::kGemma2) {
      c.attn_logit_softcapping = 50.0;
      c.final_logit_softcapping = 30.0;
    }
    auto optional_number = [&](const char* key, double* out) -> absl::Status {
      if (auto it = j.find(key); it != j.end() && it->is_null()) {
        *out = 0;
        return absl::OkStatus();
      }
      RETURN_IF_ERROR(Get(j, key, path, out, false));
      if (*out < 0)
        return absl::InvalidArgumentError(absl::StrCat(path, ": field '", key, "' must be >= 0"));
      return absl::OkStatus();
    };
    RETURN_IF_ERROR(optional_number("query_pre_attn_scalar", &c.query_pre_attn_scalar));
    RETURN_IF_ERROR(optional_number("attn_logit_softcapping", &c.attn_logit_softcapping));
    RETURN_IF_ERROR(optional_number("final_logit_softcapping", &c.final_logit_softcapping));
  }
  RETURN_IF_ERROR(ParseRope(j, path, &c));
  RETURN_IF_ERROR(ParseSlidingWindow(j, path, &c));
  if (auto it = j.find("bos_token_id"); it != j.end() && FitsIn<int32_t>(*it))
    c.bos_token_id = it->get<int32_t>();
  RETURN_IF_ERROR(ParseIds(j, "eos_token_id", &c.eos_token_ids));
  RETURN_IF_ERROR(Get(j, "torch_dtype", path, &c.torch_dtype, false));
  RETURN_IF_ERROR(Get(j, "dtype", path, &c.torch_dtype, false));
  RETURN_IF_ERROR(ParseQuantizationConfig(j, path, &c));

  auto positive = [&](const char* name, int64_t v) -> absl::Status {
    if (v <= 0)
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": field '", name, "' must be > 0, got ", v));
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(positive("vocab_size", c.vocab_size));
  RETURN_IF_ERROR(positive("hidden_size", c.hidden_size));
  RETURN_IF_ERROR(positive("intermediate_size", c.intermediate_size));
  RETURN_IF_ERROR(positive("num_hidden_layers", c.num_layers));
  RETURN_IF_ERROR(positive("num_attention_heads", c.num_heads));
  RETURN_IF_ERROR(positive("num_key_value_heads", c.num_kv_heads));
  RETURN_IF_ERROR(positive("head_dim", c.head_dim));
  RETURN_IF_ERROR(positive("max_position_embeddings", c.max_position_embeddings));
  if (!(c.rms_norm_eps > 0))
    return absl::InvalidArgumentError(absl::StrCat(path, ": field 'rms_norm_eps' must be > 0"));
  if (c.num_heads % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": num_attention_heads ", c.num_heads,
                                                   " is not a multiple of num_key_value_heads ",
                                                   c.num_kv_heads));
  }
  if (c.head_dim % 2 != 0)
    return absl::InvalidArgumentError(absl::StrCat(path, ": head_dim must be even"));
  return c;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir) {
  const std::string path = (std::filesystem::path(model_dir) / "config.json").string();
  if (!std::filesystem::exists(path)) {
    return absl::NotFoundError(absl::StrCat(path, ": missing (not a Hugging Face model folder?)"));
  }
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  ASSIGN_OR_RETURN(ModelConfig c, ParseModelConfig(text, path));
  MergeGenerationConfig(model_dir, &c);
  return c;
}

void MergeGenerationConfig(const std::string& model_dir, ModelConfig* config) {
  const std::string path = (std::filesystem::path(model_dir) / "generation_config.json").string();
  auto text = ReadFileToString(path);
  if (!text.ok()) return;
  try {
    json j = json::parse(*text);
    std::vector<int32_t> ids;
    (void)ParseIds(j, "eos_token_id", &ids);
    for (int32_t id : ids) {
      if (std::find(config->eos_token_ids.begin(), config->eos_token_ids.end(), id) ==
          config->eos_token_ids.end()) {
        config->eos_token_ids.push_back(id);
      }
    }
    if (config->bos_token_id < 0 && j.contains("bos_token_id") &&
        FitsIn<int32_t>(j["bos_token_id"])) {
      config->bos_token_id = j["bos_token_id"].get<int32_t>();
    }
  } catch (const std::exception&) {
    // generation_config.json is advisory: a broken one changes nothing.
  }
}

}  // namespace dropkv
