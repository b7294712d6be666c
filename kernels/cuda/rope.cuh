// RoPE's rotate-half step on one pair (j, j + D/2), shared by the RoPE kernel of
// kernels/fused_ops.h and the decode GEMV's RoPE epilogue (kernels/fused_gemv.h), so that both
// round exactly as the ATen chain of the model does. No torch includes.
#pragma once

#include "kernels/cuda/dtype_convert.cuh"

namespace dropkv::kernels::cuda {

// (x1, x2) <- (x1 cos a - x2 sin a, x2 cos a + x1 sin a), a = position * freq. The model's cos/sin
// tables hold cos a and sin a rounded to T; (x * cos) and (rotate_half(x) * sin) are rounded
// before the add, as separate ATen ops round them.
template <typename T>
__device__ __forceinline__ void RotateHalfPair(T& x1, T& x2, float position, float freq) {
  const float angle = position * freq;
  const float c = Round<T>(cosf(angle)), s = Round<T>(sinf(angle));
  const float a = ToFloat(x1), b = ToFloat(x2);
  x1 = FromFloat<T>(Round<T>(a * c) + Round<T>(-b * s));
  x2 = FromFloat<T>(Round<T>(b * c) + Round<T>(a * s));
}

}  // namespace dropkv::kernels::cuda
