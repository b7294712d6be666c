// kernels/fused_gemv.h: the GEMV's instantiations over bf16 / fp16 weights (own TU: compile time).
#include "kernels/cuda/fused_gemv_launch.cuh"

namespace dropkv::kernels::cuda::gemv {
FUSED_GEMV_INSTANTIATE(__nv_bfloat16, __nv_bfloat16)
FUSED_GEMV_INSTANTIATE(__half, __half)
}  // namespace dropkv::kernels::cuda::gemv
