// Bad model folders: each case fails at load with one error naming the file and the tensor.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "engine/common/file_util.h"
#include "engine/model/config.h"
#include "engine/model/model.h"
#include "engine/model/safetensors.h"
#include "tests/common/test_env.h"

namespace dropkv {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ::testing::HasSubstr;

json TinyConfig() {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"vocab_size", 32},
          {"hidden_size", 16},
          {"intermediate_size", 24},
          {"num_hidden_layers", 1},
          {"num_attention_heads", 2},
          {"num_key_value_heads", 1},
          {"tie_word_embeddings", true}};
}

std::vector<std::pair<std::string, at::Tensor>> TinyWeights() {
  std::vector<std::pair<std::string, at::Tensor>> w;
  w.emplace_back("model.embed_tokens.weight", at::randn({32, 16}));
  w.emplace_back("model.norm.weight", at::ones({16}));
  const std::string p = "model.layers.0.";
  w.emplace_back(p + "input_layernorm.weight", at::ones({16}));
  w.emplace_back(p + "post_attention_layernorm.weight", at::ones({16}));
  w.emplace_back(p + "self_attn.q_proj.weight", at::randn({16, 16}));
  w.emplace_back(p + "self_attn.k_proj.weight", at::randn({8, 16}));
  w.emplace_back(p + "self_attn.v_proj.weight", at::randn({8, 16}));
  w.emplace_back(p + "self_attn.o_proj.weight", at::randn({16, 16}));
  w.emplace_back(p + "mlp.gate_proj.weight", at::randn({24, 16}));
  w.emplace_back(p + "mlp.up_proj.weight", at::randn({24, 16}));
  w.emplace_back(p + "mlp.down_proj.weight", at::randn({16, 24}));
  return w;
}

fs::path MakeFolder(const std::string& name, const json& config,
                    const std::vector<std::pair<std::string, at::Tensor>>& weights) {
  const fs::path dir = testing::ScratchDir("model_loader") / name;
  std::error_code ec;  // not fs::remove_all: libtorch.so exports a broken copy of it
  for (const auto& e : fs::directory_iterator(dir, ec)) fs::remove(e.path(), ec);
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << config.dump();
  EXPECT_TRUE(WriteSafetensors((dir / "model.safetensors").string(), weights).ok());
  return dir;
}

absl::Status Load(const fs::path& dir) {
  auto config = LoadModelConfig(dir.string());
  if (!config.ok()) return config.status();
  return Model::Load(dir.string(), *config, at::Device(at::kCPU), at::kFloat).status();
}

TEST(ModelLoaderTest, ValidFolderLoadsInEachDtype) {
  const auto dir = MakeFolder("valid", TinyConfig(), TinyWeights());
  auto config = LoadModelConfig(dir.string());
  ASSERT_TRUE(config.ok()) << config.status();
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    auto m = Model::Load(dir.string(), *config, at::Device(at::kCPU), dtype);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ((*m)->dtype(), dtype);
  }
  // bf16 on disk converts to fp32 on load.
  auto w = TinyWeights();
  for (auto& [n, t] : w) t = t.to(at::kBFloat16);
  const auto dir16 = MakeFolder("valid_bf16", TinyConfig(), w);
  EXPECT_TRUE(Load(dir16).ok());
}

TEST(ModelLoaderTest, MissingConfig) {
  const auto dir = MakeFolder("no_config", TinyConfig(), TinyWeights());
  fs::remove(dir / "config.json");
  auto st = Load(dir);
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(st.message()), HasSubstr((dir / "config.json").string()));
}

TEST(ModelLoaderTest, UnknownArchitectureListsSupported) {
  json c = TinyConfig();
  c["architectures"] = {"FooForCausalLM"};
  c["model_type"] = "foo";
  const auto dir = MakeFolder("unknown_arch", c, TinyWeights());
  auto st = Load(dir);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("FooForCausalLM"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("config.json"));
  for (const char* a :
       {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GemmaForCausalLM"}) {
    EXPECT_THAT(std::string(st.message()), HasSubstr(a));
  }
}

TEST(ModelLoaderTest, MissingShard) {
  const auto dir = MakeFolder("missing_shard", TinyConfig(), TinyWeights());
  fs::rename(dir / "model.safetensors", dir / "model-00001-of-00002.safetensors");
  json index = {{"metadata", json::object()}, {"weight_map", json::object()}};
  for (const auto& [name, t] : TinyWeights())
    index["weight_map"][name] = "model-00001-of-00002.safetensors";
  index["weight_map"]["model.layers.0.mlp.down_proj.weight"] = "model-00002-of-00002.safetensors";
  std::ofstream(dir / "model.safetensors.index.json") << index.dump();
  auto st = Load(dir);
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(st.message()), HasSubstr("model-00002-of-00002.safetensors"));
}

TEST(ModelLoaderTest, TruncatedSafetensorsNamesTensor) {
  const auto dir = MakeFolder("truncated", TinyConfig(), TinyWeights());
  const auto path = dir / "model.safetensors";
  fs::resize_file(path, fs::file_size(path) - 10);
  auto st = Load(dir);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(st.message()), HasSubstr(path.string()));
  // The writer lays data out in the given order: the last tensor is the one cut short.
  EXPECT_THAT(std::string(st.message()), HasSubstr("model.layers.0.mlp.down_proj.weight"));
  fs::resize_file(path, 4);
  st = Load(dir);
  EXPECT_THAT(std::string(st.message()), HasSubstr("truncated"));
}

TEST(ModelLoaderTest, WrongDtypeNamesTensor) {
  const auto dir = MakeFolder("wrong_dtype", TinyConfig(), TinyWeights());
  const auto path = dir / "model.safetensors";
  auto bytes = ReadFileToString(path.string());
  ASSERT_TRUE(bytes.ok());
  std::string data = *bytes;
  const auto key = data.find("\"model.norm.weight\"");
  ASSERT_NE(key, std::string::npos);
  const auto f32 = data.find("\"F32\"", key);
  data.replace(f32, 5, "\"I32\"");  // same element size: only the dtype is wrong
  std::ofstream(path, std::ios::binary | std::ios::trunc) << data;
  auto st = Load(dir);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr(path.string()));
  EXPECT_THAT(std::string(st.message()), HasSubstr("model.norm.weight"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("I32"));
}

TEST(ModelLoaderTest, ShapeMismatchNamesTensorAndShapes) {
  auto w = TinyWeights();
  for (auto& [n, t] : w) {
    if (n == "model.layers.0.self_attn.k_proj.weight") t = at::randn({16, 16});
  }
  const auto dir = MakeFolder("shape", TinyConfig(), w);
  auto st = Load(dir);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr((dir / "model.safetensors").string()));
  EXPECT_THAT(std::string(st.message()), HasSubstr("model.layers.0.self_attn.k_proj.weight"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("[16, 16]"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("[8, 16]"));
}

TEST(ModelLoaderTest, MissingTensorNamesTensorAndFile) {
  auto w = TinyWeights();
  w.erase(w.begin() + 4);  // q_proj
  const auto dir = MakeFolder("missing_tensor", TinyConfig(), w);
  auto st = Load(dir);
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(st.message()), HasSubstr("model.layers.0.self_attn.q_proj.weight"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("model.safetensors"));
}

TEST(ModelLoaderTest, BadConfigFieldIsNamed) {
  json c = TinyConfig();
  c.erase("hidden_size");
  const auto dir = MakeFolder("bad_field", c, TinyWeights());
  auto st = Load(dir);
  EXPECT_THAT(std::string(st.message()), HasSubstr("hidden_size"));
  c = TinyConfig();
  c["num_key_value_heads"] = 3;
  const auto dir2 = MakeFolder("bad_heads", c, TinyWeights());
  EXPECT_THAT(std::string(Load(dir2).message()), HasSubstr("num_key_value_heads"));
}

}  // namespace
}  // namespace dropkv

namespace dropkv {
namespace {

TEST(ModelConfigTest, OutOfRangeIntegerFieldsAreErrorsNotWraps) {
  for (const char* value : {"4294967301", "51111111111111111111111111", "2.5"}) {
    const std::string text =
        std::string(R"({"model_type":"llama","vocab_size":32,"hidden_size":16,)") +
        R"("intermediate_size":24,"num_attention_heads":2,"num_hidden_layers":)" + value + "}";
    auto c = ParseModelConfig(text, "config.json");
    ASSERT_FALSE(c.ok()) << value;
    EXPECT_NE(c.status().message().find("num_hidden_layers"), std::string::npos) << c.status();
  }
}

}  // namespace
}  // namespace dropkv
