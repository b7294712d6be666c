#include "engine/runner/demo_model.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "engine/common/file_util.h"
#include "engine/common/status_macros.h"
#include "engine/model/log.h"
#include "engine/model/safetensors.h"

namespace dropkv {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

constexpr int kDemoVocab = 258;  // 256 bytes + <s> (256) + </s> (257)
constexpr int kDemoHidden = 64;
constexpr int kDemoInter = 172;
constexpr int kDemoLayers = 4;
constexpr int kDemoHeads = 8;
constexpr int kDemoKvHeads = 4;
constexpr uint64_t kDemoSeed = 20260101;

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to U+0100 upwards.
std::string ByteToUnicode(int b) {
  int cp = b;
  const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
  if (!printable) {
    int n = 0;
    for (int x = 0; x < b; ++x) {
      const bool p = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255);
      if (!p) ++n;
    }
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}

absl::Status WriteText(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::trunc);
  out << text;
  if (!out) return absl::PermissionDeniedError(absl::StrCat(p.string(), ": cannot write"));
  return absl::OkStatus();
}

}  // namespace

std::string DefaultDemoModelDir() {
  std::error_code ec;
  const fs::path temp = fs::temp_directory_path(ec);
  return ((ec ? fs::path("/tmp") : temp) / "dropkv-demo-model").string();
}

std::string DemoModelDir(const std::string& requested) {
  return requested.empty() ? DefaultDemoModelDir() : requested;
}

std::string DemoTokenizerJson() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[ByteToUnicode(b)] = b;
  auto special = [](int id, const char* content) {
    return json{{"id", id},        {"content", content},  {"single_word", false}, {"lstrip", false},
                {"rstrip", false}, {"normalized", false}, {"special", true}};
  };
  json tok = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", {special(256, "<s>"), special(257, "</s>")}},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "ByteLevel"},
        {"add_prefix_space", false},
        {"trim_offsets", true},
        {"use_regex", false}}},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single",
         {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"pair",
         {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}}},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {256}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder",
       {{"type", "ByteLevel"},
        {"add_prefix_space", false},
        {"trim_offsets", true},
        {"use_regex", false}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", json::array()}}}};
  return tok.dump(2);
}

absl::StatusOr<std::string> EnsureDemoModel(const std::string& dir) {
  const fs::path out(dir);
  if (fs::exists(out / "config.json") && fs::exists(out / "model.safetensors") &&
      fs::exists(out / "tokenizer.json")) {
    return dir;
  }
  LogInfo(absl::StrCat("demo model: writing a random-weight demo model (not a real LLM) to ", dir));
  std::error_code ec;
  const fs::path tmp = out.string() + ".tmp-" + std::to_string(::getpid());
  fs::create_directories(tmp, ec);
  if (ec)
    return absl::PermissionDeniedError(
        absl::StrCat(tmp.string(), ": cannot create: ", ec.message()));
  json config = {{"architectures", {"LlamaForCausalLM"}},
                 {"model_type", "llama"},
                 {"vocab_size", kDemoVocab},
                 {"hidden_size", kDemoHidden},
                 {"intermediate_size", kDemoInter},
                 {"num_hidden_layers", kDemoLayers},
                 {"num_attention_heads", kDemoHeads},
                 {"num_key_value_heads", kDemoKvHeads},
                 {"head_dim", kDemoHidden / kDemoHeads},
                 {"max_position_embeddings", 4096},
                 {"rms_norm_eps", 1e-5},
                 {"rope_theta", 10000.0},
                 {"hidden_act", "silu"},
                 {"tie_word_embeddings", false},
                 {"bos_token_id", 256},
                 {"eos_token_id", 257},
                 {"torch_dtype", "float32"},
                 {"dropkv_demo_model", true}};
  RETURN_IF_ERROR(WriteText(tmp / "config.json", config.dump(2)));
  RETURN_IF_ERROR(WriteText(tmp / "generation_config.json",
                            json{{"bos_token_id", 256}, {"eos_token_id", 257}}.dump(2)));
  RETURN_IF_ERROR(WriteText(tmp / "tokenizer.json", DemoTokenizerJson()));
  RETURN_IF_ERROR(
      WriteText(tmp / "tokenizer_config.json", json{{"bos_token", "<s>"},
                                                    {"eos_token", "</s>"},
                                                    {"add_bos_token", true},
                                                    {"tokenizer_class", "PreTrainedTokenizerFast"}}
                                                   .dump(2)));
  try {
    auto gen = at::detail::createCPUGenerator(kDemoSeed);
    auto randn = [&](std::vector<int64_t> shape, double std) {
      return at::randn(shape, gen) * std;
    };
    std::vector<std::pair<std::string, at::Tensor>> w;
    w.emplace_back("model.embed_tokens.weight", randn({kDemoVocab, kDemoHidden}, 1.0));
    // An untied head with std 0.5 keeps the logits peaked (stable greedy output) without
    // making every step repeat its input token, as a tied one would.
    w.emplace_back("lm_head.weight", randn({kDemoVocab, kDemoHidden}, 0.5));
    w.emplace_back("model.norm.weight", at::ones({kDemoHidden}));
    const int64_t d = kDemoHidden / kDemoHeads;
    for (int i = 0; i < kDemoLayers; ++i) {
      const std::string p = absl::StrCat("model.layers.", i, ".");
      w.emplace_back(p + "input_layernorm.weight", at::ones({kDemoHidden}));
      w.emplace_back(p + "post_attention_layernorm.weight", at::ones({kDemoHidden}));
      w.emplace_back(p + "self_attn.q_proj.weight", randn({kDemoHeads * d, kDemoHidden}, 0.1));
      w.emplace_back(p + "self_attn.k_proj.weight", randn({kDemoKvHeads * d, kDemoHidden}, 0.1));
      w.emplace_back(p + "self_attn.v_proj.weight", randn({kDemoKvHeads * d, kDemoHidden}, 0.1));
      w.emplace_back(p + "self_attn.o_proj.weight", randn({kDemoHidden, kDemoHeads * d}, 0.1));
      w.emplace_back(p + "mlp.gate_proj.weight", randn({kDemoInter, kDemoHidden}, 0.1));
      w.emplace_back(p + "mlp.up_proj.weight", randn({kDemoInter, kDemoHidden}, 0.1));
      w.emplace_back(p + "mlp.down_proj.weight", randn({kDemoHidden, kDemoInter}, 0.1));
    }
    RETURN_IF_ERROR(WriteSafetensors((tmp / "model.safetensors").string(), w));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("demo model: ", e.what()));
  }
  fs::create_directories(out.parent_path(), ec);
  // An incomplete earlier attempt: remove its files.
  RemoveFlatFolder(out.string());
  ec.clear();
  fs::rename(tmp, out, ec);
  if (ec)
    return absl::PermissionDeniedError(
        absl::StrCat(dir, ": cannot move the demo model in place: ", ec.message()));
  return dir;
}

}  // namespace dropkv
