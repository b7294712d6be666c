// dropkv-calibrate: per-layer InfoNCE profile of a model (algorithms.md section 3), for the MGA
// and MLMA budget allocators.
//   dropkv-calibrate --model DIR --texts FILE --out PROFILE.json [--tau 0.1] [--dropout 0.1]
// FILE holds one calibration text per line. For each text and a word-dropout copy, the model runs
// one full-cache forward; each layer's attention output (o_proj, before the residual add) is
// mean-pooled and L2-normalised; InfoNCE is computed over the N texts in fp64. Spectral entropy
// and effective rank of the original texts' token representations (averaged over texts) are
// written too, under "spectral_entropy" and "effective_rank".
#include <ATen/ATen.h>

#include <chrono>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "engine/compression/budget.h"
#include "engine/compression/layer_metrics.h"
#include "engine/model/config.h"
#include "engine/runner/model_runner.h"
#include "engine/tokenizer/tokenizer.h"
#include "nlohmann/json.hpp"

namespace {

using dropkv::compression::InfoNce;
using dropkv::compression::MeanPoolNormalized;

std::string NowUtc() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

int Fail(const std::string& msg) {
  std::cerr << "dropkv-calibrate: " << msg << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Per-layer InfoNCE profile for DepthKV budgets (algorithms.md section 3)");
  std::string model_dir, texts_path, out_path, device = "cpu", model_name;
  double tau = 0.1, dropout = 0.1;
  uint64_t seed = 0;
  int64_t max_tokens = 512;
  app.add_option("--model", model_dir, "Hugging Face model folder")->required();
  app.add_option("--texts", texts_path, "Calibration texts, one per line")->required();
  app.add_option("--out", out_path, "Profile JSON to write")->required();
  app.add_option("--tau", tau, "InfoNCE temperature")->capture_default_str();
  app.add_option("--dropout", dropout, "Word dropout probability of the augmented copy")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 0.99));
  app.add_option("--seed", seed, "Word dropout seed")->capture_default_str();
  app.add_option("--max-tokens", max_tokens, "Truncate each text to this many tokens")
      ->capture_default_str();
  app.add_option("--device", device, "cpu or cuda[:N]")->capture_default_str();
  app.add_option("--name", model_name, "Model name written into the profile (default: folder)");
  CLI11_PARSE(app, argc, argv);
  if (!(tau > 0)) return Fail("--tau must be > 0");

  std::ifstream in(texts_path);
  if (!in) return Fail("cannot read --texts " + texts_path);
  std::vector<std::string> texts;
  for (std::string line; std::getline(in, line);) {
    if (line.find_first_not_of(" \t\r") != std::string::npos) texts.push_back(line);
  }
  if (texts.size() < 2) return Fail("--texts needs at least 2 non-empty lines in " + texts_path);

  auto tokenizer = dropkv::Tokenizer::FromDirectory(model_dir);
  if (!tokenizer.ok()) return Fail(std::string(tokenizer.status().message()));
  dropkv::RunnerOptions ro;
  ro.model_dir = model_dir;
  ro.device = device;
  ro.dtype = "float32";
  ro.num_kv_blocks = 1;  // the capture forward does not use the pool
  auto runner = dropkv::ModelRunner::Create(ro);
  if (!runner.ok()) return Fail(std::string(runner.status().message()));
  // The profile covers the global layers (numbered 0..G-1, as the press numbers them): sliding-
  // window layers keep their window and take no part in the budgets.
  std::vector<int32_t> layers;
  for (int32_t l = 0; l < (*runner)->config().num_layers; ++l) {
    if (!(*runner)->config().is_sliding(l)) layers.push_back(l);
  }
  const auto num_layers = static_cast<int32_t>(layers.size());

  // Pooled representations per layer: [N, hidden] for originals and augmented copies.
  std::vector<std::vector<at::Tensor>> z_orig(num_layers), z_aug(num_layers);
  std::vector<double> entropy(num_layers, 0.0), erank(num_layers, 0.0);
  auto run = [&](const std::string& text, bool spectral,
                 std::vector<std::vector<at::Tensor>>* z) -> absl::Status {
    auto ids = (*tokenizer)->Encode(text);
    if (!ids.ok()) return ids.status();
    if (static_cast<int64_t>(ids->size()) > max_tokens) ids->resize(max_tokens);
    auto outs = (*runner)->CaptureAttentionOutputs(*ids);
    if (!outs.ok()) return outs.status();
    for (int32_t l = 0; l < num_layers; ++l) {
      at::Tensor h = (*outs)[layers[l]].to(at::kCPU);  // [T, hidden]
      (*z)[l].push_back(MeanPoolNormalized(h));
      if (spectral) {
        auto s = dropkv::compression::Spectral(h);
        entropy[l] += s.spectral_entropy / texts.size();
        erank[l] += s.effective_rank / texts.size();
      }
    }
    return absl::OkStatus();
  };
  for (size_t i = 0; i < texts.size(); ++i) {
    if (auto s = run(texts[i], true, &z_orig); !s.ok()) {
      return Fail("text " + std::to_string(i + 1) + ": " + std::string(s.message()));
    }
    const std::string aug = dropkv::compression::WordDropout(texts[i], dropout, seed * 1000003 + i);
    if (auto s = run(aug, false, &z_aug); !s.ok()) {
      return Fail("augmented text " + std::to_string(i + 1) + ": " + std::string(s.message()));
    }
  }
  dropkv::compression::LayerProfile profile;
  profile.model =
      model_name.empty() ? std::filesystem::path(model_dir).filename().string() : model_name;
  if (profile.model.empty()) profile.model = model_dir;
  profile.num_layers = num_layers;
  profile.metric = "infonce";
  profile.tau = tau;
  profile.num_texts = static_cast<int64_t>(texts.size());
  profile.created = NowUtc();
  for (int32_t l = 0; l < num_layers; ++l) {
    auto v = InfoNce(at::stack(z_orig[l]), at::stack(z_aug[l]), tau);
    if (!v.ok()) return Fail(std::string(v.status().message()));
    profile.values.push_back(*v);
  }
  if (auto s = dropkv::compression::SaveLayerProfile(profile, out_path); !s.ok()) {
    return Fail(std::string(s.message()));
  }
  // Extra metrics beside the profile's fields (readers ignore unknown keys).
  {
    std::ifstream pin(out_path);
    nlohmann::json j = nlohmann::json::parse(pin);
    j["spectral_entropy"] = entropy;
    j["effective_rank"] = erank;
    j["word_dropout"] = dropout;
    std::ofstream pout(out_path);
    pout << j.dump(2) << "\n";
  }
  std::cout << "layer  infonce  spectral_entropy  effective_rank\n";
  for (int32_t l = 0; l < num_layers; ++l) {
    std::cout << layers[l] << "  " << profile.values[l] << "  " << entropy[l] << "  " << erank[l] << "\n";
  }
  std::cout << "wrote " << out_path << "\n";
  return 0;
}
