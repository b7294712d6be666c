// kernels/fused_ops.h in a build without CUDA: a CUDA tensor cannot exist there, so every op
// reports that it is not built (the model checks FusedOpsBuilt() and keeps its ATen ops).
#include "kernels/fused_ops.h"

namespace dropkv::kernels {
namespace {
absl::Status NotBuilt() {
  return absl::FailedPreconditionError("dropkv was built without CUDA kernels (DROPKV_CUDA=OFF)");
}
}  // namespace

bool FusedOpsBuilt() {
  return false;
}
absl::StatusOr<at::Tensor> AddRmsNorm(at::Tensor&, const at::Tensor&, const at::Tensor&, double) {
  return NotBuilt();
}
absl::StatusOr<at::Tensor> RopeWriteKv(const at::Tensor&, const QkvGeometry&, const at::Tensor&,
                                       const at::Tensor&, at::Tensor&, at::Tensor&,
                                       const at::Tensor&) {
  return NotBuilt();
}
absl::StatusOr<std::tuple<at::Tensor, at::Tensor, at::Tensor>> RopeSplitQkv(const at::Tensor&,
                                                                            const QkvGeometry&,
                                                                            const at::Tensor&,
                                                                            const at::Tensor&) {
  return NotBuilt();
}
absl::StatusOr<at::Tensor> GatedActivation(const at::Tensor&, GateActivation) {
  return NotBuilt();
}
absl::StatusOr<std::pair<at::Tensor, at::Tensor>> QuantizeRowsFp8(const at::Tensor&) {
  return NotBuilt();
}

}  // namespace dropkv::kernels
