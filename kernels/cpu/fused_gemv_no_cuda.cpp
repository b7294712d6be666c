// kernels/fused_gemv.h in a build without CUDA: a CUDA tensor cannot exist there, so every op
// reports that it is not built (the model checks FusedGemvBuilt() and keeps its ATen ops).
#include "kernels/fused_gemv.h"

namespace dropkv::kernels {
namespace {
absl::Status NotBuilt() {
  return absl::FailedPreconditionError("dropkv was built without CUDA kernels (DROPKV_CUDA=OFF)");
}
}  // namespace

bool FusedGemvBuilt() {
  return false;
}
int64_t FusedGemvMaxRows(int64_t, at::ScalarType) {
  return 0;
}
absl::StatusOr<at::Tensor> Gemv(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&) {
  return NotBuilt();
}
absl::StatusOr<at::Tensor> GemvRopeWriteKv(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const QkvGeometry&, const at::Tensor&, const at::Tensor&,
                                           at::Tensor&, at::Tensor&, const at::Tensor&,
                                           const at::Tensor&) {
  return NotBuilt();
}

}  // namespace dropkv::kernels
