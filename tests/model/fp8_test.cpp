// FP8 (e4m3) projection weights (engine/model/fp8.h): the per-channel quantization's error bound,
// zero rows, block scales; and the loader: quantize-at-load, compressed-tensors and `fp8` block
// checkpoints on a tiny Llama, each equal to a plain model holding the dequantized weights, and
// the errors of malformed FP8 folders (naming file and tensor).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/model/config.h"
#include "engine/model/fp8.h"
#include "engine/model/model.h"
#include "engine/model/safetensors.h"
#include "tests/common/test_env.h"

namespace dropkv {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ::testing::HasSubstr;
using Weights = std::vector<std::pair<std::string, at::Tensor>>;

// e4m3 keeps 3 mantissa bits: rounding to nearest errs by at most half an ulp, 2^-4 of the
// value for normal codes. Codes below the smallest normal (2^-6) have a fixed spacing of 2^-9,
// so their error is at most 2^-10 in code units: 2^-10 * scale.
TEST(Fp8Test, PerChannelRoundTripIsWithinE4m3Precision) {
  at::manual_seed(1);
  // 37 x 53 (odd sizes); rows spanning 1e-4 .. 1e3 so that one scale per tensor would
  // underflow the small rows and fail the bound below.
  auto w = at::randn({37, 53}, at::kFloat) * at::logspace(-4, 3, 37, 10.0, at::kFloat).unsqueeze(1);
  auto [w8, scale] = QuantizeFp8PerChannel(w);
  EXPECT_EQ(w8.scalar_type(), at::kFloat8_e4m3fn);
  EXPECT_EQ(scale.scalar_type(), at::kFloat);
  EXPECT_EQ(scale.sizes().vec(), (std::vector<int64_t>{37, 1}));
  auto amax = w.abs().amax(1, true);
  EXPECT_TRUE(at::allclose(scale, amax / 448.0, 1e-6, 0));
  auto back = DequantizeFp8(w8, scale, 0);
  auto err = (back - w).abs();
  auto bound = w.abs() * std::ldexp(1.0, -4) + scale * std::ldexp(1.0, -10);
  EXPECT_TRUE((err <= bound * (1 + 1e-6)).all().item<bool>())
      << "worst excess " << (err - bound).max().item<double>();
  // The relative bound against the channel amax the issue states.
  EXPECT_LE((err / amax).max().item<double>(), std::ldexp(1.0, -4));
  // Each row's largest element maps onto 448 exactly.
  EXPECT_TRUE(at::allclose(back.abs().amax(1, true), amax, 1e-6, 0));
}

TEST(Fp8Test, ZeroRowsKeepScaleOneAndDequantizeToZero) {
  auto w = at::randn({4, 8});
  w[1].zero_();
  auto [w8, scale] = QuantizeFp8PerChannel(w.to(at::kBFloat16));
  EXPECT_EQ(scale[1].item<float>(), 1.0f);
  auto back = DequantizeFp8(w8, scale, 0);
  EXPECT_FALSE(back.isnan().any().item<bool>());
  EXPECT_TRUE(back[1].eq(0).all().item<bool>());
  EXPECT_FALSE(back[0].eq(0).all().item<bool>());
}

// Block scales [out, G] over groups of group_k columns, the last group partial.
TEST(Fp8Test, BlockScalesApplyPerColumnGroup) {
  auto w8 = at::randn({3, 10}).to(at::kFloat8_e4m3fn);
  auto scale = at::rand({3, 3}) + 0.5;  // group_k 4: columns 0-3, 4-7, 8-9
  auto got = DequantizeFp8(w8, scale, 4);
  auto want = w8.to(at::kFloat).clone();
  for (int64_t r = 0; r < 3; ++r) {
    for (int64_t col = 0; col < 10; ++col) want[r][col] *= scale[r][col / 4];
  }
  EXPECT_TRUE(at::equal(got, want));
}

// The CPU dequantization (a table of the 256 codes) gives ATen's fp8 -> fp32 cast times the scale,
// bit for bit, for every finite code (0x7f and 0xff are NaN).
TEST(Fp8Test, CpuDequantizationEqualsAtenCastForEveryCode) {
  auto codes = at::arange(256, at::kInt).to(at::kByte);
  codes = codes.index({codes.bitwise_and(0x7f).ne(0x7f)}).repeat({3}).reshape({3, -1});  // [3, 254]
  auto w8 = codes.view(at::kFloat8_e4m3fn);
  auto scale = at::tensor({0.5f, 3.0f, 1e-3f}).unsqueeze(1);
  auto want = w8.to(at::kFloat) * scale;
  EXPECT_TRUE(at::equal(DequantizeFp8(w8, scale, 0), want));
  // Non-contiguous input takes the ATen path: the same values.
  auto wide = at::cat({codes, codes}, 1).view(at::kFloat8_e4m3fn).narrow(1, 0, 254);
  ASSERT_FALSE(wide.is_contiguous());
  EXPECT_TRUE(at::equal(DequantizeFp8(wide, scale, 0), want));
}

// A tiny Llama (two layers, untied head) whose projections are what a test makes of them.
json TinyConfig() {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"vocab_size", 64},
          {"hidden_size", 32},
          {"intermediate_size", 40},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"tie_word_embeddings", false}};
}

constexpr const char* kProjections[] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                        "self_attn.o_proj", "mlp.gate_proj",    "mlp.up_proj",
                                        "mlp.down_proj"};

Weights TinyWeights() {
  at::manual_seed(7);
  Weights w;
  w.emplace_back("model.embed_tokens.weight", at::randn({64, 32}));
  w.emplace_back("lm_head.weight", at::randn({64, 32}) * 0.2);
  w.emplace_back("model.norm.weight", at::ones({32}));
  for (int i = 0; i < 2; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    w.emplace_back(p + "input_layernorm.weight", at::ones({32}));
    w.emplace_back(p + "post_attention_layernorm.weight", at::ones({32}));
    // Rows of different magnitudes, so that a scale on the wrong row shows.
    auto proj = [](int64_t out, int64_t in) {
      return at::randn({out, in}) * 0.2 * at::linspace(0.1, 2.0, out).unsqueeze(1);
    };
    w.emplace_back(p + "self_attn.q_proj.weight", proj(32, 32));
    w.emplace_back(p + "self_attn.k_proj.weight", proj(16, 32));
    w.emplace_back(p + "self_attn.v_proj.weight", proj(16, 32));
    w.emplace_back(p + "self_attn.o_proj.weight", proj(32, 32));
    w.emplace_back(p + "mlp.gate_proj.weight", proj(40, 32));
    w.emplace_back(p + "mlp.up_proj.weight", proj(40, 32));
    w.emplace_back(p + "mlp.down_proj.weight", proj(32, 40));
  }
  return w;
}

bool IsProjection(const std::string& name) {
  for (const char* p : kProjections) {
    if (name.find(std::string(p) + ".weight") != std::string::npos) return true;
  }
  return false;
}

fs::path MakeFolder(const std::string& name, const json& config, const Weights& weights) {
  const fs::path dir = testing::ScratchDir("fp8") / name;
  std::error_code ec;  // not fs::remove_all: libtorch.so exports a broken copy of it
  for (const auto& e : fs::directory_iterator(dir, ec)) fs::remove(e.path(), ec);
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << config.dump();
  EXPECT_TRUE(WriteSafetensors((dir / "model.safetensors").string(), weights).ok());
  return dir;
}

absl::StatusOr<std::unique_ptr<Model>> LoadFolder(
    const fs::path& dir, WeightQuantization quant = WeightQuantization::kNone) {
  auto config = LoadModelConfig(dir.string());
  if (!config.ok()) return config.status();
  return Model::Load(dir.string(), *config, at::Device(at::kCPU), at::kFloat, quant);
}

// fp32 logits [N, vocab] of one 9-token sequence.
at::Tensor Logits(const Model& m) {
  FullAttentionBackend backend(m.config());
  auto tokens = at::tensor({1, 5, 9, 33, 2, 17, 63, 40, 8}, at::kLong);
  auto hidden = m.Forward(tokens, at::arange(9, at::kLong), 8, backend);
  EXPECT_TRUE(hidden.ok()) << hidden.status();
  return hidden.ok() ? m.Logits(*hidden) : at::Tensor();
}

// The weights with every projection replaced by `f(name, w)`.
template <typename F>
Weights MapProjections(const Weights& in, F f) {
  Weights out;
  for (const auto& [name, w] : in) {
    if (IsProjection(name)) {
      for (auto& e : f(name, w)) out.push_back(std::move(e));
    } else {
      out.emplace_back(name, w);
    }
  }
  return out;
}

// A plain model whose projections are already w8 * scale: what every FP8 path must equal.
at::Tensor DequantizedReferenceLogits() {
  auto weights = MapProjections(TinyWeights(), [](const std::string& name, const at::Tensor& w) {
    auto [w8, s] = QuantizeFp8PerChannel(w);
    return Weights{{name, w8.to(at::kFloat) * s}};  // ATen's cast, not the code under test
  });
  auto m = LoadFolder(MakeFolder("dequantized", TinyConfig(), weights));
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? Logits(**m) : at::Tensor();
}

json CompressedTensorsConfig(const std::string& strategy) {
  json c = TinyConfig();
  c["quantization_config"] = {
      {"quant_method", "compressed-tensors"},
      {"format", "float-quantized"},
      {"config_groups",
       {{"group_0",
         {{"targets", {"Linear"}},
          {"weights", {{"num_bits", 8}, {"type", "float"}, {"strategy", strategy}}}}}}},
      {"ignore", {"lm_head"}}};
  return c;
}

Weights CompressedTensorsWeights() {
  return MapProjections(TinyWeights(), [](const std::string& name, const at::Tensor& w) {
    auto [w8, s] = QuantizeFp8PerChannel(w);
    return Weights{{name, w8}, {name + "_scale", s}};
  });
}

TEST(Fp8LoadTest, QuantizeAtLoadEqualsDequantizedWeights) {
  const auto dir = MakeFolder("plain", TinyConfig(), TinyWeights());
  auto plain = LoadFolder(dir);
  auto fp8 = LoadFolder(dir, WeightQuantization::kFp8);
  ASSERT_TRUE(plain.ok() && fp8.ok());
  EXPECT_FALSE((*plain)->fp8_weights());
  EXPECT_TRUE((*fp8)->fp8_weights());
  // Packing leaves FP8 projections alone (an untied head may still be packed).
  (*fp8)->PackForCpu();
  const auto want = DequantizedReferenceLogits();
  const auto got = Logits(**fp8);
  // The same fp32 weights through the same linear: equal up to the GEMM's summation order.
  EXPECT_LT((got - want).abs().max().item<double>(), 1e-5);
  // ...and measurably not the unquantized model (the test would not see a no-op quantizer).
  EXPECT_GT((Logits(**plain) - want).abs().max().item<double>(), 1e-3);
}

TEST(Fp8LoadTest, CompressedTensorsPerChannelEqualsQuantizeAtLoad) {
  auto ct = LoadFolder(
      MakeFolder("ct_channel", CompressedTensorsConfig("channel"), CompressedTensorsWeights()));
  ASSERT_TRUE(ct.ok()) << ct.status();
  EXPECT_TRUE((*ct)->fp8_weights());
  auto at_load =
      LoadFolder(MakeFolder("plain", TinyConfig(), TinyWeights()), WeightQuantization::kFp8);
  ASSERT_TRUE(at_load.ok());
  EXPECT_TRUE(at::equal(Logits(**ct), Logits(**at_load)));
}

TEST(Fp8LoadTest, CompressedTensorsPerTensorScale) {
  // One scale per tensor (shape [1]), read as that scale on every row.
  Weights per_tensor;
  auto weights = MapProjections(TinyWeights(), [&](const std::string& name, const at::Tensor& w) {
    const auto s = w.abs().max() / 448.0;
    auto w8 = (w / s).clamp(-448, 448).to(at::kFloat8_e4m3fn);
    per_tensor.emplace_back(name, w8.to(at::kFloat) * s);
    return Weights{{name, w8}, {name + "_scale", s.reshape({1})}};
  });
  auto ct = LoadFolder(MakeFolder("ct_tensor", CompressedTensorsConfig("tensor"), weights));
  ASSERT_TRUE(ct.ok()) << ct.status();
  auto want = MapProjections(TinyWeights(), [&](const std::string& name, const at::Tensor&) {
    for (auto& [n, w] : per_tensor)
      if (n == name) return Weights{{n, w}};
    return Weights{};
  });
  auto ref = LoadFolder(MakeFolder("ct_tensor_ref", TinyConfig(), want));
  ASSERT_TRUE(ref.ok());
  EXPECT_LT((Logits(**ct) - Logits(**ref)).abs().max().item<double>(), 1e-5);
}

// quant_method fp8 (transformers' FineGrainedFP8 layout): `weight_scale_inv` multipliers per
// [16, 16] block; 40-row and 40-column matrices end in partial blocks.
TEST(Fp8LoadTest, BlockCheckpointDequantizesPerBlock) {
  json config = TinyConfig();
  config["quantization_config"] = {
      {"quant_method", "fp8"}, {"activation_scheme", "dynamic"}, {"weight_block_size", {16, 16}}};
  Weights dequantized;
  auto weights = MapProjections(TinyWeights(), [&](const std::string& name, const at::Tensor& w) {
    const int64_t out = w.size(0), in = w.size(1);
    const int64_t gr = (out + 15) / 16, gc = (in + 15) / 16;
    auto s = at::empty({gr, gc});
    auto w8 = at::empty({out, in}, at::kFloat8_e4m3fn);
    auto back = at::empty({out, in});
    for (int64_t i = 0; i < gr; ++i) {
      for (int64_t j = 0; j < gc; ++j) {
        auto blk = w.slice(0, i * 16, std::min(out, i * 16 + 16))
                       .slice(1, j * 16, std::min(in, j * 16 + 16));
        auto sij = blk.abs().max() / 448.0;
        s[i][j] = sij;
        auto q = (blk / sij).to(at::kFloat8_e4m3fn);
        w8.slice(0, i * 16, std::min(out, i * 16 + 16))
            .slice(1, j * 16, std::min(in, j * 16 + 16))
            .copy_(q);
        back.slice(0, i * 16, std::min(out, i * 16 + 16))
            .slice(1, j * 16, std::min(in, j * 16 + 16))
            .copy_(q.to(at::kFloat) * sij);
      }
    }
    dequantized.emplace_back(name, back);
    return Weights{{name, w8}, {name + "_scale_inv", s}};
  });
  auto block = LoadFolder(MakeFolder("fp8_block", config, weights));
  ASSERT_TRUE(block.ok()) << block.status();
  EXPECT_TRUE((*block)->fp8_weights());
  auto want = MapProjections(TinyWeights(), [&](const std::string& name, const at::Tensor&) {
    for (auto& [n, w] : dequantized)
      if (n == name) return Weights{{n, w}};
    return Weights{};
  });
  auto ref = LoadFolder(MakeFolder("fp8_block_ref", TinyConfig(), want));
  ASSERT_TRUE(ref.ok());
  EXPECT_LT((Logits(**block) - Logits(**ref)).abs().max().item<double>(), 1e-5);
}

TEST(Fp8LoadTest, MissingScaleNamesTensor) {
  auto weights = CompressedTensorsWeights();
  std::erase_if(weights,
                [](const auto& e) { return e.first == "model.layers.1.mlp.up_proj.weight_scale"; });
  auto m = LoadFolder(MakeFolder("no_scale", CompressedTensorsConfig("channel"), weights));
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(m.status().message()),
              HasSubstr("model.layers.1.mlp.up_proj.weight_scale"));
}

TEST(Fp8LoadTest, BadScaleShapeNamesFileAndTensor) {
  auto weights = CompressedTensorsWeights();
  for (auto& [name, t] : weights) {
    if (name == "model.layers.0.self_attn.k_proj.weight_scale") t = at::ones({3});
  }
  const auto dir = MakeFolder("bad_scale", CompressedTensorsConfig("channel"), weights);
  auto m = LoadFolder(dir);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr((dir / "model.safetensors").string()));
  EXPECT_THAT(std::string(m.status().message()),
              HasSubstr("model.layers.0.self_attn.k_proj.weight_scale"));
}

TEST(Fp8LoadTest, Fp8WeightWithoutQuantizationConfigIsAnError) {
  auto m = LoadFolder(MakeFolder("no_qconfig", TinyConfig(), CompressedTensorsWeights()));
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("quantization_config"));
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("model.layers.0.self_attn.q_proj"));
}

TEST(Fp8LoadTest, Fp8OutsideTheProjectionsIsAnError) {
  auto weights = CompressedTensorsWeights();
  for (auto& [name, t] : weights) {
    if (name == "model.embed_tokens.weight") t = t.to(at::kFloat8_e4m3fn);
  }
  const auto dir = MakeFolder("fp8_embed", CompressedTensorsConfig("channel"), weights);
  auto m = LoadFolder(dir);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("model.embed_tokens.weight"));
  EXPECT_THAT(std::string(m.status().message()), HasSubstr((dir / "model.safetensors").string()));
}

TEST(Fp8ConfigTest, QuantizationConfigIsParsedAndCheckedOnce) {
  auto parse = [](const json& q) {
    json c = TinyConfig();
    c["quantization_config"] = q;
    return ParseModelConfig(c.dump(), "x/config.json");
  };
  auto block = parse({{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}});
  ASSERT_TRUE(block.ok()) << block.status();
  EXPECT_EQ(block->checkpoint_quant, CheckpointQuantMethod::kFp8);
  EXPECT_EQ(block->fp8_block, (std::vector<int64_t>{128, 128}));
  auto awq = parse({{"quant_method", "awq"}});
  EXPECT_EQ(awq.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(awq.status().message()), HasSubstr("awq"));
  EXPECT_THAT(std::string(awq.status().message()), HasSubstr("x/config.json"));
  auto int8 = parse(
      {{"quant_method", "compressed-tensors"},
       {"config_groups",
        {{"g", {{"weights", {{"num_bits", 8}, {"type", "int"}, {"strategy", "channel"}}}}}}}});
  EXPECT_EQ(int8.status().code(), absl::StatusCode::kInvalidArgument);
  auto bad_block = parse({{"quant_method", "fp8"}, {"weight_block_size", {128}}});
  EXPECT_THAT(std::string(bad_block.status().message()), HasSubstr("weight_block_size"));
  EXPECT_EQ(*ParseWeightQuantization("fp8"), WeightQuantization::kFp8);
  EXPECT_EQ(*ParseWeightQuantization("none"), WeightQuantization::kNone);
  EXPECT_THAT(std::string(ParseWeightQuantization("int4").status().message()), HasSubstr("int4"));
}

}  // namespace
}  // namespace dropkv
