// Gate activations in fp32, as ATen's CUDA kernels compute them (at::silu, at::gelu "tanh"), for
// the fused gated activation (fused_decode_ops.cu). No torch includes.
#pragma once

namespace dropkv::kernels::cuda {

__device__ __forceinline__ float Silu(float x) {
  return x / (1.f + expf(-x));
}

__device__ __forceinline__ float GeluTanh(float x) {
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  const float inner = kBeta * (x + kKappa * x * x * x);
  return 0.5f * x * (1.f + tanhf(inner));
}

}  // namespace dropkv::kernels::cuda
