// kernels/fused_gemv.h: the AddRmsNorm-prologue GEMV's instantiations (norm weight in the dtype or
// fp32, Gemma's folded 1 + w).
#include "kernels/cuda/fused_gemv_launch.cuh"

namespace dropkv::kernels::cuda::gemv {
FUSED_GEMV_INSTANTIATE(__nv_bfloat16, __nv_bfloat16, Prologue::kAddRmsNorm)
FUSED_GEMV_INSTANTIATE(__nv_bfloat16, float, Prologue::kAddRmsNorm)
FUSED_GEMV_INSTANTIATE(__half, __half, Prologue::kAddRmsNorm)
FUSED_GEMV_INSTANTIATE(__half, float, Prologue::kAddRmsNorm)
}  // namespace dropkv::kernels::cuda::gemv
