#include "engine/model/fp8.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <exception>
#include <stdexcept>
#include <string>

#include "engine/model/log.h"
#include "kernels/fused_ops.h"

namespace dropkv {
namespace {

// Every e4m3 code's fp32 value: ATen's CPU fp8 -> fp32 cast is scalar code (about 10 ns per
// element here), which made the per-forward dequantization dominate a CPU decode step.
const std::array<float, 256>& E4m3Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int code = 0; code < 256; ++code) {
      t[code] = static_cast<float>(
          c10::Float8_e4m3fn(static_cast<uint8_t>(code), c10::Float8_e4m3fn::from_bits()));
    }
    return t;
  }();
  return table;
}

// CPU, contiguous: out[r, c] = table[w8[r, c]] * scale[r, c / group_k], the same fp32 products
// as the ATen expression below.
at::Tensor DequantizeFp8Cpu(const at::Tensor& w8, const at::Tensor& scale, int64_t group_k) {
  const int64_t rows = w8.size(0), cols = w8.size(1), groups = scale.size(1);
  if (groups == 1) group_k = cols;
  auto out = at::empty({rows, cols}, at::kFloat);
  const auto* src = reinterpret_cast<const uint8_t*>(w8.data_ptr());
  const float* sc = scale.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const auto& table = E4m3Table();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* in = src + r * cols;
      float* o = dst + r * cols;
      for (int64_t c0 = 0; c0 < cols; c0 += group_k) {
        const float s = sc[r * groups + c0 / group_k];
        const int64_t c1 = std::min(cols, c0 + group_k);
        for (int64_t c = c0; c < c1; ++c) o[c] = table[in[c]] * s;
      }
    }
  });
  return out;
}

}  // namespace

bool IsFp8(const at::Tensor& w) {
  return w.defined() && w.scalar_type() == at::kFloat8_e4m3fn;
}

std::pair<at::Tensor, at::Tensor> QuantizeFp8PerChannel(const at::Tensor& w) {
  auto wf = w.to(at::kFloat);
  auto amax = wf.abs().amax(1, /*keepdim=*/true);  // [out, 1]
  // A zero row keeps scale 1: dividing by 0 would make NaN codes.
  auto scale = at::where(amax > 0, amax / kFp8E4m3Max, at::ones_like(amax));
  // The division, not a multiplication by 1 / scale: the amax element then lands exactly on 448.
  auto w8 = (wf / scale).clamp(-kFp8E4m3Max, kFp8E4m3Max).to(at::kFloat8_e4m3fn);
  return {w8, scale};
}

at::Tensor DequantizeFp8(const at::Tensor& w8, const at::Tensor& scale, int64_t group_k) {
  if (w8.is_cpu() && w8.is_contiguous() && scale.is_contiguous() &&
      scale.scalar_type() == at::kFloat) {
    return DequantizeFp8Cpu(w8, scale, group_k);
  }
  auto wf = w8.to(at::kFloat);
  if (scale.size(1) == 1) return wf * scale;
  const int64_t in = w8.size(1);
  return wf * scale.repeat_interleave(group_k, 1).narrow(1, 0, in);
}

std::optional<at::Tensor> Fp8ScaledMm(const at::Tensor& x, const at::Tensor& w8,
                                      const at::Tensor& scale, const at::Tensor& b) {
  static std::atomic<bool> failed{false};
  const int64_t out = w8.size(0), in = w8.size(1);
  // Row-wise scaled GEMMs write bf16 only; cuBLASLt wants K and N in multiples of 16.
  if (failed.load(std::memory_order_relaxed) || !x.is_cuda() || x.dim() != 2 || x.size(0) < 1 ||
      x.scalar_type() != at::kBFloat16 || scale.size(1) != 1 || in % 16 != 0 || out % 16 != 0) {
    return std::nullopt;
  }
  try {
    auto quantized = kernels::QuantizeRowsFp8(x.stride(1) == 1 ? x : x.contiguous());
    if (!quantized.ok()) throw std::runtime_error(quantized.status().ToString());
    auto& [xq, x_scale] = *quantized;
    // w8^T [in, out] is the column-major operand the GEMM wants; scales [N, 1] and [1, out].
    auto y = at::_scaled_mm(xq, w8.t(), x_scale, scale.reshape({1, out}), std::nullopt,
                            std::nullopt, at::kBFloat16);
    if (b.defined()) y.add_(b);
    return y;
  } catch (const std::exception& e) {
    failed.store(true, std::memory_order_relaxed);
    LogWarn(std::string("model: the FP8 GEMM failed (") + e.what() +
            "); FP8 weights are dequantized per linear from now on");
    return std::nullopt;
  }
}

}  // namespace dropkv
