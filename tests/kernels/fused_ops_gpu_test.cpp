// kernels/fused_ops.h on CUDA against the unfused ATen ops the model runs without them (label
// gpu; skips without a GPU). Fresh random inputs per case, odd sizes (vector and scalar paths),
// strided inputs, bf16 / fp16 / fp32; free blocks of the caching allocator hold NaN before each
// call, so an output element a kernel forgot to write shows up.
//
// Tolerance: the fused ops round where the ATen chain rounds, so elementwise results may differ
// only where a libm call (cosf, expf, tanhf) or RMSNorm's sum order lands on the other side of
// a rounding boundary: one unit in the last place of the dtype (at most 2^-7 relative in bf16,
// 2^-10 in fp16; fp32: 2e-6, a few units, for the sum order), plus the same fraction of 1/16 of
// the output's largest value (RoPE's sum of two rounded products can cancel).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kernels/fused_ops.h"

namespace dropkv::kernels {
namespace {

const at::TensorOptions kCuda = at::TensorOptions().device(at::kCUDA);

class FusedOpsGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount returned 0 or failed)";
    ASSERT_TRUE(FusedOpsBuilt());
  }
};

void Poison() {
  for (int64_t mib : {1, 4, 16, 64}) {
    auto t = at::full({mib << 18}, NAN, kCuda.dtype(at::kFloat));
  }
}

// One unit in the last place, relative, of each dtype.
double Ulp(at::ScalarType t) {
  return t == at::kBFloat16 ? std::ldexp(1.0, -7) : t == at::kHalf ? std::ldexp(1.0, -10) : 2e-6;
}

// Every |got - want| <= ulp * (|want| + 2^-4 * max |want|), no NaN.
void ExpectWithinUlp(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  auto g = got.to(at::kCPU, at::kDouble), w = want.to(at::kCPU, at::kDouble);
  ASSERT_FALSE(g.isnan().any().item<bool>()) << what << ": NaN in the output (unwritten?)";
  const double ulp = Ulp(want.scalar_type());
  const double scale = w.abs().max().item<double>();
  auto excess = (g - w).abs() - ulp * (w.abs() + scale / 16);
  EXPECT_LE(excess.max().item<double>(), 0.0)
      << what << ": max |diff| " << (g - w).abs().max().item<double>() << ", scale " << scale
      << ", differing elements " << g.ne(w).sum().item<int64_t>() << " of " << g.numel();
}

std::string Name(at::ScalarType t) {
  return c10::toString(t);
}

// --- AddRmsNorm ----------------------------------------------------------------------------------

TEST_F(FusedOpsGpuTest, AddRmsNormMatchesAddThenRmsNorm) {
  struct Case {
    int64_t n, hidden;
    bool strided_delta;
  };
  const std::vector<Case> cases = {{1, 4096, false}, {3, 3584, true}, {17, 3072, false},
                                   {2, 100, true},   {5, 7, false},   {64, 4096, true}};
  for (auto dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    for (const Case& c : cases) {
      for (bool fp32_weight : {false, true}) {
        for (bool with_delta : {true, false}) {
          const std::string what =
              Name(dtype) + " n=" + std::to_string(c.n) + " h=" + std::to_string(c.hidden) +
              (fp32_weight ? " fp32 weight" : "") + (with_delta ? "" : " no delta");
          auto opts = kCuda.dtype(dtype);
          auto residual = at::randn({c.n, c.hidden}, opts) * 3;
          at::Tensor delta;
          if (with_delta) {
            delta = c.strided_delta ? at::randn({c.n, c.hidden + 24}, opts).narrow(1, 8, c.hidden)
                                    : at::randn({c.n, c.hidden}, opts);
          }
          // Gemma's folded 1 + w is fp32; Llama's weight is in the model dtype.
          auto weight = fp32_weight ? at::randn({c.hidden}, kCuda.dtype(at::kFloat)) + 1.0
                                    : at::randn({c.hidden}, opts);
          const double eps = 1e-5;
          // The unfused path: at::add, then RMSNorm in fp32 rounded once.
          auto want_residual = with_delta ? residual + delta : residual.clone();
          auto xf = want_residual.to(at::kFloat);
          auto want =
              (xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps) * weight.to(at::kFloat)).to(dtype);
          Poison();
          auto got = AddRmsNorm(residual, delta, weight, eps);
          ASSERT_TRUE(got.ok()) << what << ": " << got.status();
          EXPECT_TRUE(at::equal(residual, want_residual)) << what << ": residual differs";
          ExpectWithinUlp(*got, want, what);
          if (!fp32_weight) {
            ExpectWithinUlp(*got, at::rms_norm(want_residual, {c.hidden}, weight, eps),
                            what + " vs at::rms_norm");
          }
        }
      }
    }
  }
}

// --- RoPE ----------------------------------------------------------------------------------------

struct RopeCase {
  int64_t n, hq, hkv, d;
};
const std::vector<RopeCase> kRopeCases = {{1, 32, 8, 128}, {5, 28, 4, 128}, {3, 16, 16, 256},
                                          {16, 8, 2, 64},  {2, 4, 1, 32},   {7, 3, 1, 80}};

// The frequencies of default RoPE at theta 500000 ([D/2] fp32), positions up to 128K.
at::Tensor InvFreq(int64_t d) {
  auto e = at::arange(0, d, 2, at::kLong).to(at::kFloat) / static_cast<double>(d);
  return (1.0 / at::pow(500000.0, e)).to(at::kCUDA);
}

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// The model's unfused RoPE: cos/sin tables in the model dtype, then q * cos + rotate_half(q) *
// sin as ATen ops. Returns q, k after RoPE and v, each [N, H, D].
std::vector<at::Tensor> UnfusedRope(const at::Tensor& qkv, const RopeCase& c,
                                    const at::Tensor& positions, const at::Tensor& inv_freq) {
  auto freqs = positions.to(at::kFloat).unsqueeze(1) * inv_freq.unsqueeze(0);
  auto emb = at::cat({freqs, freqs}, -1);
  auto cos = emb.cos().to(qkv.scalar_type()).unsqueeze(1);
  auto sin = emb.sin().to(qkv.scalar_type()).unsqueeze(1);
  auto qk = qkv.narrow(1, 0, (c.hq + c.hkv) * c.d).reshape({c.n, c.hq + c.hkv, c.d});
  qk = qk * cos + RotateHalf(qk) * sin;
  return {qk.narrow(1, 0, c.hq), qk.narrow(1, c.hq, c.hkv),
          qkv.narrow(1, (c.hq + c.hkv) * c.d, c.hkv * c.d).reshape({c.n, c.hkv, c.d})};
}

at::Tensor RandomQkv(const RopeCase& c, at::ScalarType dtype, bool strided) {
  const int64_t width = (c.hq + 2 * c.hkv) * c.d;
  auto opts = kCuda.dtype(dtype);
  return strided ? at::randn({c.n, width + 40}, opts).narrow(1, 16, width)
                 : at::randn({c.n, width}, opts);
}

TEST_F(FusedOpsGpuTest, RopeSplitQkvMatchesUnfusedRope) {
  for (auto dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    for (const RopeCase& c : kRopeCases) {
      const std::string what = Name(dtype) + " n=" + std::to_string(c.n) + " " +
                               std::to_string(c.hq) + "/" + std::to_string(c.hkv) +
                               " d=" + std::to_string(c.d);
      auto qkv = RandomQkv(c, dtype, c.n % 2 == 1);
      auto positions = at::randint(0, 131072, {c.n}, kCuda.dtype(at::kLong));
      auto inv_freq = InvFreq(c.d);
      auto want = UnfusedRope(qkv, c, positions, inv_freq);
      Poison();
      auto got = RopeSplitQkv(qkv, QkvGeometry{c.hq, c.hkv, c.d}, positions, inv_freq);
      ASSERT_TRUE(got.ok()) << what << ": " << got.status();
      ExpectWithinUlp(std::get<0>(*got), want[0], what + " q");
      ExpectWithinUlp(std::get<1>(*got), want[1], what + " k");
      EXPECT_TRUE(at::equal(std::get<2>(*got), want[2])) << what << ": v is not a plain copy";
    }
  }
}

TEST_F(FusedOpsGpuTest, RopeWriteKvStoresRotatedKAndVInTheirSlotsOnly) {
  const int64_t num_blocks = 9, block_size = 16;
  for (auto dtype : {at::kBFloat16, at::kFloat}) {
    for (const RopeCase& c : kRopeCases) {
      const std::string what = Name(dtype) + " n=" + std::to_string(c.n) + " " +
                               std::to_string(c.hq) + "/" + std::to_string(c.hkv) +
                               " d=" + std::to_string(c.d);
      auto opts = kCuda.dtype(dtype);
      auto qkv = RandomQkv(c, dtype, c.n % 2 == 0);
      auto positions = at::randint(0, 131072, {c.n}, kCuda.dtype(at::kLong));
      auto inv_freq = InvFreq(c.d);
      // Distinct random slots; the last row of every case with n > 1 is padding (-1).
      auto slots = at::randperm(num_blocks * block_size, kCuda.dtype(at::kLong)).narrow(0, 0, c.n);
      if (c.n > 1) slots[c.n - 1] = -1;
      auto k_cache = at::randn({num_blocks, block_size, c.hkv, c.d}, opts);
      auto v_cache = at::randn({num_blocks, block_size, c.hkv, c.d}, opts);
      auto want = UnfusedRope(qkv, c, positions, inv_freq);
      // The unfused store: index_copy_ of the real rows.
      auto real = slots.ge(0).nonzero().squeeze(1);
      auto want_k = k_cache.clone(), want_v = v_cache.clone();
      want_k.view({-1, c.hkv, c.d})
          .index_copy_(0, slots.index_select(0, real), want[1].index_select(0, real));
      want_v.view({-1, c.hkv, c.d})
          .index_copy_(0, slots.index_select(0, real), want[2].index_select(0, real));
      Poison();
      auto q = RopeWriteKv(qkv, QkvGeometry{c.hq, c.hkv, c.d}, positions, inv_freq, k_cache,
                           v_cache, slots);
      ASSERT_TRUE(q.ok()) << what << ": " << q.status();
      ExpectWithinUlp(*q, want[0], what + " q");
      ExpectWithinUlp(k_cache, want_k, what + " key cache");
      EXPECT_TRUE(at::equal(v_cache, want_v)) << what << ": value cache";
      // Slots not written keep their old values exactly.
      auto written = at::zeros({num_blocks * block_size}, kCuda.dtype(at::kBool));
      written.index_fill_(0, slots.index_select(0, real), true);
      auto keep = written.logical_not().nonzero().squeeze(1);
      EXPECT_TRUE(at::equal(k_cache.view({-1, c.hkv, c.d}).index_select(0, keep),
                            want_k.view({-1, c.hkv, c.d}).index_select(0, keep)))
          << what << ": a key slot outside `slots` changed";
    }
  }
}

// --- GatedActivation -----------------------------------------------------------------------------

TEST_F(FusedOpsGpuTest, GatedActivationMatchesActThenMul) {
  struct Case {
    int64_t n, inter;
    bool strided;
  };
  const std::vector<Case> cases = {
      {1, 14336, false}, {1, 24576, true}, {4, 18944, false}, {3, 100, true}, {9, 7, false}};
  for (auto dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    for (const Case& c : cases) {
      for (auto act : {GateActivation::kSilu, GateActivation::kGeluTanh}) {
        const bool silu = act == GateActivation::kSilu;
        const std::string what = Name(dtype) + " n=" + std::to_string(c.n) +
                                 " i=" + std::to_string(c.inter) + (silu ? " silu" : " gelu");
        auto opts = kCuda.dtype(dtype);
        auto gate_up = c.strided ? at::randn({c.n, 2 * c.inter + 8}, opts).narrow(1, 0, 2 * c.inter)
                                 : at::randn({c.n, 2 * c.inter}, opts);
        gate_up.mul_(4);  // both tails of the activation
        auto gate = gate_up.narrow(1, 0, c.inter), up = gate_up.narrow(1, c.inter, c.inter);
        auto want = (silu ? at::silu(gate) : at::gelu(gate, "tanh")) * up;
        Poison();
        auto got = GatedActivation(gate_up, act);
        ASSERT_TRUE(got.ok()) << what << ": " << got.status();
        ExpectWithinUlp(*got, want, what);
      }
    }
  }
}

// --- argument checks -----------------------------------------------------------------------------

TEST_F(FusedOpsGpuTest, BadArgumentsAreInvalidArgumentNamingTheTensor) {
  auto cpu = at::randn({2, 64});
  auto w = at::randn({64});
  auto st = AddRmsNorm(cpu, at::Tensor(), w, 1e-5).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("residual"), std::string::npos) << st;

  auto qkv = at::randn({2, (4 + 2 * 2) * 64 + 1}, kCuda.dtype(at::kBFloat16));
  auto pos = at::zeros({2}, kCuda.dtype(at::kLong));
  st = RopeSplitQkv(qkv, QkvGeometry{4, 2, 64}, pos, InvFreq(64)).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("qkv"), std::string::npos) << st;

  st = GatedActivation(at::randn({2, 7}, kCuda), GateActivation::kSilu).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("gate_up"), std::string::npos) << st;
}

}  // namespace
}  // namespace dropkv::kernels
