// kernels/fused_gemv.h: the gated-activation-prologue GEMV's instantiations (SiLU, GELU-tanh).
#include "kernels/cuda/fused_gemv_launch.cuh"

namespace dropkv::kernels::cuda::gemv {
FUSED_GEMV_INSTANTIATE(__nv_bfloat16, __nv_bfloat16, Prologue::kSiluMul)
FUSED_GEMV_INSTANTIATE(__nv_bfloat16, __nv_bfloat16, Prologue::kGeluTanhMul)
FUSED_GEMV_INSTANTIATE(__half, __half, Prologue::kSiluMul)
FUSED_GEMV_INSTANTIATE(__half, __half, Prologue::kGeluTanhMul)
}  // namespace dropkv::kernels::cuda::gemv
