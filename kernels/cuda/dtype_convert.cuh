// Float conversions of the element types the kernels take (fp32, fp16, bf16), shared by every
// CUDA file in kernels/. No torch includes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

// x rounded to T and back: what an ATen op on T tensors stores between two ops.
template <typename T>
__device__ __forceinline__ float Round(float x) {
  return ToFloat(FromFloat<T>(x));
}

}  // namespace dropkv::kernels::cuda
