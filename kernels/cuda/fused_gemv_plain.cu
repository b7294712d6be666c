// kernels/fused_gemv.h: the plain GEMV's instantiations (own TU: compile time).
#include "kernels/cuda/fused_gemv_launch.cuh"

namespace dropkv::kernels::cuda::gemv {
FUSED_GEMV_INSTANTIATE(__nv_bfloat16, __nv_bfloat16, Prologue::kPlain)
FUSED_GEMV_INSTANTIATE(__half, __half, Prologue::kPlain)
}  // namespace dropkv::kernels::cuda::gemv
