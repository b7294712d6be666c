#include "engine/model/llama2c.h"

#include <ATen/ATen.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "engine/common/file_util.h"
#include "engine/common/status_macros.h"
#include "engine/model/log.h"
#include "engine/model/safetensors.h"
#include "engine/tokenizer/llama2c_tokenizer.h"

namespace dropkv {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

absl::Status WriteText(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::trunc);
  out << text;
  if (!out) return absl::PermissionDeniedError(absl::StrCat(p.string(), ": cannot write"));
  return absl::OkStatus();
}

// HF's convert_llama_weights_to_hf.py permute(): [n_heads * head_dim, in] rows from Meta's
// interleaved pairs (2i, 2i+1) to rotate_half's halves (i, i + head_dim / 2), per head.
at::Tensor PermuteRope(const at::Tensor& w, int64_t n_heads) {
  const int64_t rows = w.size(0);
  const int64_t cols = w.size(1);
  return w.view({n_heads, rows / n_heads / 2, 2, cols}).transpose(1, 2).reshape({rows, cols});
}

}  // namespace

absl::Status ConvertLlama2c(const std::string& model_bin, const std::string& tokenizer_bin,
                            const std::string& out_dir) {
  ASSIGN_OR_RETURN(auto file, MappedFile::Open(model_bin));
  if (file->size_bytes() < 28) {
    return absl::DataLossError(
        absl::StrCat(model_bin, ": truncated llama2.c header (", file->size_bytes(), " bytes)"));
  }
  int32_t h[7];
  std::memcpy(h, file->data(), sizeof(h));
  const int64_t dim = h[0], hidden = h[1], n_layers = h[2], n_heads = h[3], n_kv_heads = h[4];
  const bool shared_classifier = h[5] > 0;
  const int64_t vocab = shared_classifier ? h[5] : -int64_t{h[5]};
  const int64_t seq_len = h[6];
  if (dim <= 0 || hidden <= 0 || n_layers <= 0 || n_heads <= 0 || n_kv_heads <= 0 || vocab <= 0 ||
      dim % n_heads != 0 || n_heads % n_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(model_bin, ": implausible llama2.c header dim=", dim, " hidden=", hidden,
                     " layers=", n_layers, " heads=", n_heads, "/", n_kv_heads));
  }
  const int64_t head_dim = dim / n_heads;
  const int64_t kv_dim = n_kv_heads * head_dim;
  const float* data = reinterpret_cast<const float*>(file->data() + 28);
  const int64_t num_floats = static_cast<int64_t>((file->size_bytes() - 28) / 4);
  int64_t offset = 0;
  // Takes the next tensor of `shape`, in file order.
  auto take = [&](const char* what, std::vector<int64_t> shape) -> absl::StatusOr<at::Tensor> {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    if (offset + n > num_floats) {
      return absl::DataLossError(absl::StrCat(model_bin, ": truncated at tensor '", what,
                                              "' (needs ", n, " floats at float offset ", offset,
                                              ", file has ", num_floats, ")"));
    }
    at::Tensor t = at::empty(shape, at::kFloat);
    std::memcpy(t.data_ptr<float>(), data + offset, n * 4);
    offset += n;
    return t;
  };
  ASSIGN_OR_RETURN(auto emb, take("token_embedding_table", {vocab, dim}));
  ASSIGN_OR_RETURN(auto rms_att, take("rms_att_weight", {n_layers, dim}));
  ASSIGN_OR_RETURN(auto wq, take("wq", {n_layers, dim, dim}));
  ASSIGN_OR_RETURN(auto wk, take("wk", {n_layers, kv_dim, dim}));
  ASSIGN_OR_RETURN(auto wv, take("wv", {n_layers, kv_dim, dim}));
  ASSIGN_OR_RETURN(auto wo, take("wo", {n_layers, dim, dim}));
  ASSIGN_OR_RETURN(auto rms_ffn, take("rms_ffn_weight", {n_layers, dim}));
  ASSIGN_OR_RETURN(auto w1, take("w1", {n_layers, hidden, dim}));
  ASSIGN_OR_RETURN(auto w2, take("w2", {n_layers, dim, hidden}));
  ASSIGN_OR_RETURN(auto w3, take("w3", {n_layers, hidden, dim}));
  ASSIGN_OR_RETURN(auto rms_final, take("rms_final_weight", {dim}));
  ASSIGN_OR_RETURN(auto freq_cis, take("freq_cis_real+imag", {seq_len, head_dim}));  // unused
  at::Tensor wcls;
  if (!shared_classifier) {
    ASSIGN_OR_RETURN(wcls, take("wcls", {vocab, dim}));
  }

  std::vector<std::pair<std::string, at::Tensor>> w;
  w.emplace_back("model.embed_tokens.weight", emb);
  w.emplace_back("model.norm.weight", rms_final);
  if (!shared_classifier) w.emplace_back("lm_head.weight", wcls);
  for (int64_t l = 0; l < n_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    w.emplace_back(p + "input_layernorm.weight", rms_att[l].contiguous());
    w.emplace_back(p + "post_attention_layernorm.weight", rms_ffn[l].contiguous());
    w.emplace_back(p + "self_attn.q_proj.weight", PermuteRope(wq[l], n_heads).contiguous());
    w.emplace_back(p + "self_attn.k_proj.weight", PermuteRope(wk[l], n_kv_heads).contiguous());
    w.emplace_back(p + "self_attn.v_proj.weight", wv[l].contiguous());
    w.emplace_back(p + "self_attn.o_proj.weight", wo[l].contiguous());
    w.emplace_back(p + "mlp.gate_proj.weight", w1[l].contiguous());
    w.emplace_back(p + "mlp.down_proj.weight", w2[l].contiguous());
    w.emplace_back(p + "mlp.up_proj.weight", w3[l].contiguous());
  }
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec)
    return absl::PermissionDeniedError(absl::StrCat(out_dir, ": cannot create: ", ec.message()));
  const fs::path out(out_dir);
  RETURN_IF_ERROR(WriteSafetensors((out / "model.safetensors").string(), w));
  json config = {{"architectures", {"LlamaForCausalLM"}},
                 {"model_type", "llama"},
                 {"vocab_size", vocab},
                 {"hidden_size", dim},
                 {"intermediate_size", hidden},
                 {"num_hidden_layers", n_layers},
                 {"num_attention_heads", n_heads},
                 {"num_key_value_heads", n_kv_heads},
                 {"head_dim", head_dim},
                 {"max_position_embeddings", seq_len},
                 {"rms_norm_eps", 1e-5},
                 {"rope_theta", 10000.0},
                 {"hidden_act", "silu"},
                 {"tie_word_embeddings", shared_classifier},
                 {"attention_bias", false},
                 {"mlp_bias", false},
                 {"bos_token_id", 1},
                 {"eos_token_id", 2},
                 {"torch_dtype", "float32"}};
  RETURN_IF_ERROR(WriteText(out / "config.json", config.dump(2) + "\n"));
  RETURN_IF_ERROR(WriteText(out / "generation_config.json",
                            json{{"bos_token_id", 1}, {"eos_token_id", 2}}.dump(2) + "\n"));
  if (!tokenizer_bin.empty()) {
    ASSIGN_OR_RETURN(std::string tok_json,
                     Tok512ToTokenizerJson(tokenizer_bin, static_cast<int32_t>(vocab)));
    RETURN_IF_ERROR(WriteText(out / "tokenizer.json", tok_json));
    RETURN_IF_ERROR(WriteText(out / "tokenizer_config.json", Tok512TokenizerConfigJson()));
  }
  LogInfo(absl::StrCat("convert: ", model_bin, " -> ", out_dir, " (", n_layers, " layers, dim ",
                       dim, ", vocab ", vocab, ")"));
  return absl::OkStatus();
}

}  // namespace dropkv
