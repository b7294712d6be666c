// Float conversions of the element types the kernels take (fp32, fp16, bf16, and e4m3 for the FP8
// KV cache), shared by every CUDA file in kernels/. No torch includes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

namespace dropkv::kernels::cuda {

__device__ __forceinline__ float ToFloat(float x) {
  return x;
}
__device__ __forceinline__ float ToFloat(__half x) {
  return __half2float(x);
}
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
// e4m3 (kernels/kv_cache_fp8.h): one instruction per pair on sm_89+, emulated below.
__device__ __forceinline__ float ToFloat(__nv_fp8_e4m3 x) {
  return static_cast<float>(x);
}
template <typename T>
__device__ __forceinline__ T FromFloat(float x);
template <>
__device__ __forceinline__ float FromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Saturating at +-448, round to nearest even: QuantizeKv's bytes.
template <>
__device__ __forceinline__ __nv_fp8_e4m3 FromFloat<__nv_fp8_e4m3>(float x) {
  return __nv_fp8_e4m3(x);
}

// 16 e4m3 values (16 bytes, element 0 in the lowest byte) as 16 T (bf16 / fp16) in out[0..1]:
// pairs through cvt e4m3x2 -> f16x2 (one instruction on sm_89+), exact (every e4m3 value is an
// fp16 and a bf16 value).
template <typename T>
__device__ __forceinline__ void E4m3x16To(const uint4& raw, uint4 out[2]) {
  const uint32_t in[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t res[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const auto pair = static_cast<__nv_fp8x2_storage_t>((in[i / 2] >> (16 * (i % 2))) & 0xffffu);
    const __half2 h(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3));
    if constexpr (sizeof(T) == 2 && !std::is_same_v<T, __half>) {
      const float2 f = __half22float2(h);
      const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
      res[i] = *reinterpret_cast<const uint32_t*>(&b);
    } else {
      res[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
  }
  out[0] = make_uint4(res[0], res[1], res[2], res[3]);
  out[1] = make_uint4(res[4], res[5], res[6], res[7]);
}

// x rounded to T and back: what an ATen op on T tensors stores between two ops.
template <typename T>
__device__ __forceinline__ float Round(float x) {
  return ToFloat(FromFloat<T>(x));
}

}  // namespace dropkv::kernels::cuda
