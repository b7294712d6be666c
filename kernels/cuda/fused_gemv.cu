// kernels/fused_gemv.h on CUDA: the entry points check the tensors, fill the raw Params and
// dispatch on the dtypes to the launchers instantiated in fused_gemv_plain.cu (bf16 / fp16
// weights) and fused_gemv_fp8.cu (e4m3 weights).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/check.h"
#include "kernels/cuda/fused_gemv_params.h"
#include "kernels/fused_gemv.h"
#include "kernels/kv_cache_fp8.h"

#define GEMV_RETURN_IF_ERROR(expr)               \
  do {                                           \
    ::absl::Status gemv_status_ = (expr);        \
    if (!gemv_status_.ok()) return gemv_status_; \
  } while (0)

namespace dropkv::kernels {
namespace {

using cuda::gemv::Params;

constexpr int64_t kMaxTokens = 16;  // two 8-token mma tiles
constexpr int64_t kMaxK = int64_t{1} << 20;

// The weight stages for m tokens at inner dimension k on the current device.
int StreamStages(int64_t m, int64_t k, int64_t elem_bytes, int ctas_per_sm) {
  const auto* props = at::cuda::getCurrentDeviceProperties();
  return cuda::gemv::StreamStages(
      static_cast<int>(m), static_cast<int>(k), static_cast<size_t>(elem_bytes),
      props->sharedMemPerMultiprocessor, props->reservedSharedMemPerBlock,
      props->sharedMemPerBlockOptin, ctas_per_sm);
}

// The kernel's CTAs per SM for an [m, k] x [n, k]^T call: 3 where one wave of three per SM takes
// fewer group-times per SM than waves of two (cuda::gemv::PreferThreeCtasPerSm: Llama-3.1-8B's qkv)
// and three CTAs still get >= 3 stages each, else 2.
int CtasPerSm(int64_t m, int64_t n, int64_t k, int64_t elem_bytes) {
  const int groups = static_cast<int>((n + cuda::gemv::kRowsPerCta - 1) / cuda::gemv::kRowsPerCta);
  const auto* props = at::cuda::getCurrentDeviceProperties();
  const int three_share = cuda::gemv::StagesPerSharedSm(
      static_cast<int>(m), static_cast<int>(k), static_cast<size_t>(elem_bytes),
      props->sharedMemPerMultiprocessor, props->reservedSharedMemPerBlock, 3);
  return cuda::gemv::PreferThreeCtasPerSm(groups, props->multiProcessorCount) && three_share >= 3
             ? 3
             : 2;
}

bool IsHalfType(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf;
}

bool Aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

bool IsFp8Weight(const at::Tensor& weight) {
  return weight.scalar_type() == at::kFloat8_e4m3fn;
}

// The dtype of x, the bias and y: the weight's, or x's for an FP8 weight.
at::ScalarType ActivationDtype(const at::Tensor& x, const at::Tensor& weight) {
  return IsFp8Weight(weight) ? x.scalar_type() : weight.scalar_type();
}

absl::Status CheckCudaHalf(const at::Tensor& t, const char* name, const at::Tensor& weight,
                           at::ScalarType dtype) {
  if (!t.is_cuda()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": fused GEMVs take CUDA tensors, got one on ", t.device().str()));
  }
  if (t.device() != weight.device())
    return absl::InvalidArgumentError(absl::StrCat(name, ": not on the weight's device"));
  if (t.scalar_type() != dtype) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": dtype ", c10::toString(t.scalar_type()),
                                                   ", expected ", c10::toString(dtype)));
  }
  return absl::OkStatus();
}

// rows [M, width]: inner dim contiguous, rows 16-byte aligned (the prologue's vector loads).
absl::Status CheckRows(const at::Tensor& t, const char* name, int64_t m, int64_t width,
                       const at::Tensor& weight, at::ScalarType dtype) {
  GEMV_RETURN_IF_ERROR(internal::CheckDim(t, name, 2, "[M, width]"));
  GEMV_RETURN_IF_ERROR(CheckCudaHalf(t, name, weight, dtype));
  GEMV_RETURN_IF_ERROR(internal::CheckSize(t, name, 0, m, "M"));
  GEMV_RETURN_IF_ERROR(internal::CheckSize(t, name, 1, width, "width"));
  if (m > 0 && (t.stride(1) != 1 || t.stride(0) % 8 != 0 || !Aligned16(t.data_ptr()))) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": rows must be contiguous and 16-byte aligned (strides ", t.stride(0),
                     ", ", t.stride(1), ")"));
  }
  return absl::OkStatus();
}

// The weight (bf16 / fp16, or e4m3 with its row scales), the bias and the token count m against
// FusedGemvMaxRows, with x in `dtype`.
absl::Status CheckWeight(const at::Tensor& weight, const at::Tensor& weight_scale,
                         const at::Tensor& bias, int64_t m, at::ScalarType dtype) {
  GEMV_RETURN_IF_ERROR(internal::CheckDim(weight, "weight", 2, "[N, K]"));
  const bool fp8 = IsFp8Weight(weight);
  if (!weight.is_cuda() || !IsHalfType(dtype) || (!fp8 && !IsHalfType(weight.scalar_type()))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weight: must be a bf16, fp16 or float8_e4m3fn CUDA tensor (x bf16 / fp16), got ",
        c10::toString(weight.scalar_type()), " on ", weight.device().str(), " with x ",
        c10::toString(dtype)));
  }
  if (!weight.is_contiguous() || !Aligned16(weight.data_ptr()))
    return absl::InvalidArgumentError("weight: must be contiguous and 16-byte aligned");
  if (weight.size(0) > INT32_MAX - 16)
    return absl::InvalidArgumentError(absl::StrCat("weight: N ", weight.size(0), " too large"));
  const int64_t k = weight.size(1);
  if (fp8 != weight_scale.defined()) {
    return absl::InvalidArgumentError(
        "weight_scale: an e4m3 weight takes its fp32 row scales, a bf16 / fp16 one none");
  }
  if (fp8) {
    if (!weight_scale.is_cuda() || weight_scale.device() != weight.device() ||
        weight_scale.scalar_type() != at::kFloat || !weight_scale.is_contiguous() ||
        weight_scale.dim() < 1 || weight_scale.numel() != weight.size(0) ||
        weight_scale.size(0) != weight.size(0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("weight_scale: fp32 [N] or [N, 1] contiguous on the weight's device, N = ",
                       weight.size(0), " (one scale a row; block scales are not read here)"));
    }
    if (k % 16 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("weight: K = ", k, " must be a multiple of 16 for an e4m3 weight"));
    }
  }
  if (bias.defined()) {
    GEMV_RETURN_IF_ERROR(internal::CheckDim(bias, "bias", 1, "[N]"));
    GEMV_RETURN_IF_ERROR(internal::CheckSize(bias, "bias", 0, weight.size(0), "N"));
    GEMV_RETURN_IF_ERROR(CheckCudaHalf(bias, "bias", weight, dtype));
    if (!bias.is_contiguous()) return absl::InvalidArgumentError("bias: must be contiguous");
  }
  const int64_t max_rows = FusedGemvMaxRows(k, dtype);
  if (max_rows == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weight: K = ", k, " is not supported (a positive multiple of 8, <= ", kMaxK, ")"));
  }
  if (m > max_rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("x: ", m, " rows, the fused GEMV takes at most ", max_rows, " at K = ", k));
  }
  return absl::OkStatus();
}

// x, the weight and its scale, the bias: every check of a call with m rows of x.
absl::Status CheckCall(const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& weight_scale, const at::Tensor& bias) {
  GEMV_RETURN_IF_ERROR(internal::CheckDim(x, "x", 2, "[M, K]"));
  const at::ScalarType dtype = ActivationDtype(x, weight);
  GEMV_RETURN_IF_ERROR(CheckWeight(weight, weight_scale, bias, x.size(0), dtype));
  return CheckRows(x, "x", x.size(0), weight.size(1), weight, dtype);
}

// Fills Params for y = x W^T (+ bias) (the RoPE epilogue aside).
Params GemvParams(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                  const at::Tensor& bias, at::Tensor& y) {
  Params p;
  const int64_t m = x.size(0);
  p.x = x.data_ptr();
  p.x_stride = x.stride(0);
  p.weight = weight.data_ptr();
  p.weight_scale = weight_scale.defined() ? weight_scale.data_ptr<float>() : nullptr;
  p.bias = bias.defined() ? bias.data_ptr() : nullptr;
  p.y = y.data_ptr();
  p.m = static_cast<int>(m);
  p.n = static_cast<int>(weight.size(0));
  p.k = static_cast<int>(weight.size(1));
  p.x_smem_stride = cuda::gemv::XSmemStride(p.k);
  p.ctas_per_sm = CtasPerSm(m, p.n, p.k, x.element_size());
  p.stages = StreamStages(m, p.k, x.element_size(), p.ctas_per_sm);
  return p;
}

absl::Status Launch(const Params& p, at::ScalarType dtype, bool fp8_weight) {
  using cuda::gemv::LaunchStreamGemv;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  cudaError_t err;
  if (dtype == at::kBFloat16) {
    err = fp8_weight ? LaunchStreamGemv<__nv_bfloat16, __nv_fp8_e4m3>(p, num_sms, stream)
                     : LaunchStreamGemv<__nv_bfloat16, __nv_bfloat16>(p, num_sms, stream);
  } else {
    err = fp8_weight ? LaunchStreamGemv<__half, __nv_fp8_e4m3>(p, num_sms, stream)
                     : LaunchStreamGemv<__half, __half>(p, num_sms, stream);
  }
  if (err != cudaSuccess)
    return absl::InternalError(absl::StrCat("fused GEMV launch: ", cudaGetErrorString(err)));
  return absl::OkStatus();
}

}  // namespace

bool FusedGemvBuilt() {
  return true;
}

int64_t FusedGemvMaxRows(int64_t k, at::ScalarType dtype) {
  if (!IsHalfType(dtype) || k <= 0 || k % 8 != 0 || k > kMaxK) return 0;
  if (!at::cuda::is_available()) return 0;
  for (int64_t m = kMaxTokens; m > 0; --m) {
    if (StreamStages(m, k, 2, 2) > 0) return m;
  }
  return 0;
}

absl::StatusOr<at::Tensor> Gemv(const at::Tensor& x, const at::Tensor& weight,
                                const at::Tensor& bias, const at::Tensor& weight_scale) {
  GEMV_RETURN_IF_ERROR(CheckCall(x, weight, weight_scale, bias));
  return internal::CatchTorch("Gemv(cuda)", [&]() -> absl::StatusOr<at::Tensor> {
    c10::cuda::CUDAGuard guard(weight.device());
    auto y = at::empty({x.size(0), weight.size(0)},
                       x.options().memory_format(at::MemoryFormat::Contiguous));
    if (y.numel() == 0) return y;
    const Params p = GemvParams(x, weight, weight_scale, bias, y);
    GEMV_RETURN_IF_ERROR(Launch(p, x.scalar_type(), IsFp8Weight(weight)));
    return y;
  });
}

absl::StatusOr<at::Tensor> GemvRopeWriteKv(const at::Tensor& x, const at::Tensor& weight,
                                           const at::Tensor& bias, const QkvGeometry& geo,
                                           const at::Tensor& positions, const at::Tensor& inv_freq,
                                           at::Tensor& key_cache, at::Tensor& value_cache,
                                           const at::Tensor& slots,
                                           const at::Tensor& weight_scale) {
  GEMV_RETURN_IF_ERROR(CheckCall(x, weight, weight_scale, bias));
  const int64_t m = x.size(0);
  GEMV_RETURN_IF_ERROR(internal::CheckRopeWriteKvArgs(geo, m, x.scalar_type(), weight.device(),
                                                      positions, inv_freq, key_cache, value_cache,
                                                      slots));
  if (weight.size(0) != (geo.num_heads + 2 * geo.num_kv_heads) * geo.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight: ", weight.size(0), " rows, expected (Hq + 2 Hkv) * D = ",
                     (geo.num_heads + 2 * geo.num_kv_heads) * geo.head_dim));
  }
  if (geo.head_dim % cuda::gemv::kRowsPerCta != 0 || geo.head_dim > 128) {
    // The epilogue pairs rows j and j + D/2 in 16-row groups; elsewhere, the two launches. Also
    // at D 256: there the decode step (Gemma-7B, 8K, the CUDA-core paged kernel next) measured
    // 7.99 ms with the epilogue against 7.08 without, though the GEMV alone is 1.6 us faster per
    // layer than GEMV + RoPE (docs/benchmarks.md); at D 128 the epilogue is neutral to faster.
    absl::StatusOr<at::Tensor> qkv = Gemv(x, weight, bias, weight_scale);
    if (!qkv.ok()) return qkv.status();
    return RopeWriteKv(*qkv, geo, positions, inv_freq, key_cache, value_cache, slots);
  }
  return internal::CatchTorch("GemvRopeWriteKv(cuda)", [&]() -> absl::StatusOr<at::Tensor> {
    c10::cuda::CUDAGuard guard(weight.device());
    auto q = at::empty({m, geo.num_heads, geo.head_dim},
                       x.options().memory_format(at::MemoryFormat::Contiguous));
    if (m == 0) return q;
    Params p = GemvParams(x, weight, weight_scale, bias, q);
    p.rope.positions = positions.data_ptr<int64_t>();
    p.rope.inv_freq = inv_freq.data_ptr<float>();
    p.rope.slots = slots.data_ptr<int64_t>();
    p.rope.key_cache = key_cache.data_ptr();
    p.rope.value_cache = value_cache.data_ptr();
    p.rope.cache_fp8 = IsFp8Cache(key_cache) ? 1 : 0;
    p.rope.num_heads = static_cast<int>(geo.num_heads);
    p.rope.num_kv_heads = static_cast<int>(geo.num_kv_heads);
    p.rope.head_dim = static_cast<int>(geo.head_dim);
    GEMV_RETURN_IF_ERROR(Launch(p, x.scalar_type(), IsFp8Weight(weight)));
    return q;
  });
}

}  // namespace dropkv::kernels
