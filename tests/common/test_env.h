// Where tests find ../shared, the reference Python venvs and scratch space. CTest sets the
// variables (cmake/DropkvHelpers.cmake); the fallbacks let a test binary run by hand too.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace dropkv::testing {

inline std::string EnvOr(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? std::string(v) : fallback;
}
// ../shared beside the checkout.
inline std::filesystem::path SharedDir() {
  return EnvOr("DROPKV_SHARED", "../shared");
}
inline std::filesystem::path SourceDir() {
  return EnvOr("DROPKV_SOURCE_DIR", ".");
}
inline std::filesystem::path BuildDir() {
  return EnvOr("DROPKV_BUILD_DIR", "build");
}
// Python with torch 2.11 + transformers 5.17 + tokenizers (scripts/setup.sh's main venv).
inline std::string ReferencePython() {
  return EnvOr("DROPKV_PYTHON", "python3");
}
// The trained models scripts/setup.sh converts: smollm2-135m-instruct/, gemma-3-270m/.
inline std::filesystem::path ModelsDir() {
  return EnvOr("DROPKV_MODELS", "models");
}
// SmolLM2-135M-Instruct as set-up converts it: the trained model most CPU tests run.
inline std::filesystem::path SmolLm2Dir() {
  return ModelsDir() / "smollm2-135m-instruct";
}
// Python with kvpress (its own venv; it pins an older transformers).
inline std::string KvpressPython() {
  return EnvOr("DROPKV_KVPRESS_PYTHON", "");
}
// A per-test scratch folder under the build tree, created on first use.
inline std::filesystem::path ScratchDir(const std::string& name) {
  auto dir = BuildDir() / "test-scratch" / name;
  std::filesystem::create_directories(dir);
  return dir;
}

// The geometry of a small Llama whose weights the runner draws at random (a folder with only
// config.json).
struct TinyLlamaShape {
  int hidden = 256;
  int intermediate = 512;
  int layers = 3;
  int heads = 8;
  int kv_heads = 2;
  int head_dim = 64;
  int vocab = 512;
  int max_positions = 4096;
};

// Writes ScratchDir(scratch) / "tiny-llama" / config.json for `shape`; returns the folder.
inline std::string WriteTinyLlamaConfig(const std::string& scratch, const TinyLlamaShape& shape) {
  const auto dir = ScratchDir(scratch) / "tiny-llama";
  std::filesystem::create_directories(dir);
  const auto field = [](const char* name, int value) {
    return "\"" + std::string(name) + "\": " + std::to_string(value) + ", ";
  };
  std::ofstream(dir / "config.json")
      << R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", )"
      << field("hidden_size", shape.hidden) << field("intermediate_size", shape.intermediate)
      << field("num_hidden_layers", shape.layers) << field("num_attention_heads", shape.heads)
      << field("num_key_value_heads", shape.kv_heads) << field("head_dim", shape.head_dim)
      << field("vocab_size", shape.vocab) << field("max_position_embeddings", shape.max_positions)
      << R"("rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false, )"
      << R"("hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2})";
  return dir.string();
}

}  // namespace dropkv::testing
