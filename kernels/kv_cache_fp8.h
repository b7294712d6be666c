// The FP8 KV cache (kv_cache_dtype: fp8): the paged pool holds K and V as float8 e4m3 ("fn":
// no infinities, largest finite 448), one byte per element instead of two.
//
// Scale: a fixed 1.0 for every layer and KV head (vLLM's default without calibration), so a stored
// byte is read back by a plain cast. e4m3 is a floating-point format: its relative spacing (2^-3,
// so a rounding error <= 2^-4 relative) is the same for every magnitude in [2^-6, 448]; a scale
// would only move that window. SmolLM2-135M's K after RoPE peak at 24 and V at 11 (1% of K and 4%
// of V below 2^-6, where the absolute error is <= 2^-10); Llama-3.1-8B's are of the same order.
// Values past 448 saturate (a model with larger K outliers needs calibrated scales: not done).
//
// Every write goes through QuantizeKv (CPU, ATen) or its CUDA twin (cuda_fp8.h's saturating
// round-to-nearest-even conversion): the same bytes. Readers convert e4m3 to fp32 and do their
// math there (CUDA decode kernel) or dequantize gathered rows to the model dtype (exact: every
// e4m3 value is a bf16 / fp16 / fp32 value).
#pragma once

#include <ATen/core/Tensor.h>

namespace dropkv::kernels {

inline constexpr at::ScalarType kFp8KvDtype = at::kFloat8_e4m3fn;
inline constexpr double kFp8KvMax = 448.0;  // e4m3fn's largest finite value

inline bool IsFp8Cache(const at::Tensor& cache) {
  return cache.defined() && cache.scalar_type() == kFp8KvDtype;
}

// x (any float dtype, any device) as e4m3: saturated to +-448 (ATen's cast alone gives NaN from
// 464 up), rounded to nearest even.
at::Tensor QuantizeKv(const at::Tensor& x);

// What an FP8 cache gives back for x, in x's dtype: QuantizeKv(x) cast back.
at::Tensor RoundTripKv(const at::Tensor& x);

// x in the cache's storage dtype: QuantizeKv for an FP8 cache, else a cast.
at::Tensor ToCacheDtype(const at::Tensor& x, const at::Tensor& cache);

// Rows `slots` (int64 [n]) of a cache viewed as [num_slots, ...] (index_select; ATen has no
// index_copy_ / CUDA index_select for float8, so FP8 rows move as bytes), converted to `dtype`.
at::Tensor GatherRows(const at::Tensor& cache_rows, const at::Tensor& slots, at::ScalarType dtype);

// cache_rows[slots[i]] = rows[i] (rows already in the cache's dtype; index_copy_, as bytes for
// FP8).
void ScatterRows(at::Tensor& cache_rows, const at::Tensor& slots, const at::Tensor& rows);

}  // namespace dropkv::kernels
