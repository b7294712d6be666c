// Layer metrics (layer_metrics.h) against a NumPy fp64 reference (layer_metrics_ref.py run with
// $DROPKV_PYTHON), plus word dropout properties.
#include "engine/compression/layer_metrics.h"

#include <ATen/ATen.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>

#include <gtest/gtest.h>

#include "nlohmann/json.hpp"
#include "tests/common/test_env.h"

namespace dropkv::compression {
namespace {

void WriteF64(const std::filesystem::path& path, const at::Tensor& t) {
  at::Tensor c = t.to(at::kDouble).contiguous();
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(c.data_ptr<double>()),
            static_cast<std::streamsize>(c.nbytes()));
}

std::string RunCommand(const std::string& cmd) {
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(cmd.c_str(), "r"), pclose);
  if (!pipe) return "";
  std::string out;
  std::array<char, 4096> buf;
  while (fgets(buf.data(), buf.size(), pipe.get()) != nullptr) out += buf.data();
  return out;
}

TEST(LayerMetrics, MatchesNumpyFp64Reference) {
  const auto dir = dropkv::testing::ScratchDir("layer_metrics");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
  // Correlated pairs, as augmented copies are: za = zo + noise.
  at::Tensor zo = at::randn({12, 24}, gen, at::kDouble);
  at::Tensor za = zo + 0.3 * at::randn({12, 24}, gen, at::kDouble);
  at::Tensor x = at::randn({40, 24}, gen, at::kDouble) * at::linspace(0.1, 3.0, 24, at::kDouble);
  WriteF64(dir / "z_orig.bin", zo);
  WriteF64(dir / "z_aug.bin", za);
  WriteF64(dir / "x.bin", x);
  std::ofstream(dir / "shapes.json") << R"({"z": [12, 24], "x": [40, 24]})";
  for (double tau : {0.1, 0.5}) {
    const std::string cmd =
        dropkv::testing::ReferencePython() + " " +
        (dropkv::testing::SourceDir() / "tests/compression/layer_metrics_ref.py").string() + " " +
        dir.string() + " " + std::to_string(tau);
    const std::string out = RunCommand(cmd);
    ASSERT_FALSE(out.empty()) << "reference failed: " << cmd;
    nlohmann::json ref = nlohmann::json::parse(out);
    auto v = InfoNce(zo, za, tau);
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_NEAR(*v, ref["infonce"].get<double>(), 1e-10 * std::abs(ref["infonce"].get<double>()));
    SpectralStats s = Spectral(x);
    EXPECT_NEAR(s.spectral_entropy, ref["spectral_entropy"].get<double>(), 1e-10);
    EXPECT_NEAR(s.effective_rank, ref["effective_rank"].get<double>(), 1e-9);
  }
  EXPECT_FALSE(InfoNce(zo, za, 0.0).ok());
  EXPECT_FALSE(InfoNce(zo, za.slice(0, 0, 5), 0.1).ok());
}

TEST(LayerMetrics, IdenticalCopiesGiveLowerInfoNceThanNoise) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  at::Tensor zo = at::randn({16, 32}, gen, at::kDouble);
  const double same = *InfoNce(zo, zo, 0.1);
  const double noisy = *InfoNce(zo, at::randn({16, 32}, gen, at::kDouble), 0.1);
  EXPECT_LT(same, noisy);
}

TEST(LayerMetrics, WordDropout) {
  const std::string text = "one two three four five six seven eight nine ten";
  EXPECT_EQ(WordDropout(text, 0.0, 1), text);
  EXPECT_EQ(WordDropout(text, 0.5, 7), WordDropout(text, 0.5, 7));  // seeded
  EXPECT_EQ(WordDropout(text, 0.999999, 7), "one");                 // never empty
  int dropped = 0;
  for (uint64_t seed = 0; seed < 200; ++seed) {
    std::istringstream in(WordDropout(text, 0.1, seed));
    int words = 0;
    for (std::string w; in >> w;) ++words;
    dropped += 10 - words;
  }
  EXPECT_NEAR(dropped / 2000.0, 0.1, 0.03);  // about 10% of words
}

}  // namespace
}  // namespace dropkv::compression
