// kernels/fused_gemv.h: the GEMV's instantiations over FP8 (e4m3) weights (own TU: compile time).
#include <cuda_fp8.h>

#include "kernels/cuda/fused_gemv_launch.cuh"

namespace dropkv::kernels::cuda::gemv {
FUSED_GEMV_INSTANTIATE(__nv_bfloat16, __nv_fp8_e4m3)
FUSED_GEMV_INSTANTIATE(__half, __nv_fp8_e4m3)
}  // namespace dropkv::kernels::cuda::gemv
