#include "engine/model/config.h"

#include <filesystem>
#include <limits>

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
    {"GemmaForCausalLM", "gemma", ModelFamily::kGemma},
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

absl::Status ParseRope(const json& j, const std::string& path, ModelConfig* c) {
  // transformers >= 5 writes "rope_parameters" (with rope_theta inside); older files write
  // "rope_theta" + "rope_scaling".
  RETURN_IF_ERROR(Get(j, "rope_theta", path, &c->rope.theta, false));
  const json* scaling = nullptr;
  if (auto it = j.find("rope_parameters"); it != j.end() && it->is_object()) scaling = &*it;
  if (auto it = j.find("rope_scaling"); it != j.end() && it->is_object()) scaling = &*it;
  if (scaling == nullptr) return absl::OkStatus();
  RETURN_IF_ERROR(Get(*scaling, "rope_theta", path, &c->rope.theta, false));
  std::string type = "default";
  if (scaling->contains("rope_type")) {
    RETURN_IF_ERROR(Get(*scaling, "rope_type", path, &type, false));
  } else if (scaling->contains("type")) {
    RETURN_IF_ERROR(Get(*scaling, "type", path, &type, false));
  }
  RETURN_IF_ERROR(Get(*scaling, "factor", path, &c->rope.factor, false));
  RETURN_IF_ERROR(Get(*scaling, "low_freq_factor", path, &c->rope.low_freq_factor, false));
  RETURN_IF_ERROR(Get(*scaling, "high_freq_factor", path, &c->rope.high_freq_factor, false));
  RETURN_IF_ERROR(Get(*scaling, "original_max_position_embeddings", path,
                      &c->rope.original_max_position_embeddings, false));
  if (type == "default") {
    c->rope.type = RopeType::kDefault;
  } else if (type == "linear") {
    c->rope.type = RopeType::kLinear;
  } else if (type == "dynamic") {
    c->rope.type = RopeType::kDynamic;
  } else if (type == "llama3") {
    c->rope.type = RopeType::kLlama3;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": rope_scaling type '", type,
                     "' is not supported (default, linear, dynamic, llama3)"));
  }
  if (c->rope.factor <= 0)
    return absl::InvalidArgumentError(absl::StrCat(path, ": rope factor must be > 0"));
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

}  // namespace

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
  c.tie_word_embeddings = c.family == ModelFamily::kGemma;
  RETURN_IF_ERROR(Get(j, "tie_word_embeddings", path, &c.tie_word_embeddings, false));
  c.attention_bias = c.family == ModelFamily::kQwen2;  // Qwen2 always has q/k/v bias
  if (c.family == ModelFamily::kLlama) {
    RETURN_IF_ERROR(Get(j, "attention_bias", path, &c.attention_bias, false));
    RETURN_IF_ERROR(Get(j, "mlp_bias", path, &c.mlp_bias, false));
  }
  if (c.family == ModelFamily::kGemma) c.hidden_act = "gelu_pytorch_tanh";
  RETURN_IF_ERROR(Get(j, "hidden_act", path, &c.hidden_act, false));
  if (c.family == ModelFamily::kGemma) {
    // Gemma 1 checkpoints say "gelu" but were trained with the tanh approximation (HF uses
    // hidden_activation when given, and warns to use gelu_pytorch_tanh otherwise).
    std::string act;
    RETURN_IF_ERROR(Get(j, "hidden_activation", path, &act, false));
    c.hidden_act = act.empty() ? "gelu_pytorch_tanh" : act;
  }
  if (c.hidden_act != "silu" && c.hidden_act != "gelu_pytorch_tanh" && c.hidden_act != "gelu") {
    return absl::InvalidArgumentError(absl::StrCat(path, ": hidden_act '", c.hidden_act,
                                                   "' is not supported (silu, gelu_pytorch_tanh)"));
  }
  RETURN_IF_ERROR(ParseRope(j, path, &c));
  if (c.rope.original_max_position_embeddings <= 0)
    c.rope.original_max_position_embeddings = c.max_position_embeddings;
  if (auto it = j.find("bos_token_id"); it != j.end() && FitsIn<int32_t>(*it))
    c.bos_token_id = it->get<int32_t>();
  RETURN_IF_ERROR(ParseIds(j, "eos_token_id", &c.eos_token_ids));
  RETURN_IF_ERROR(Get(j, "torch_dtype", path, &c.torch_dtype, false));
  RETURN_IF_ERROR(Get(j, "dtype", path, &c.torch_dtype, false));

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
