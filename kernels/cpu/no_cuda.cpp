// Stand-ins for the CUDA launchers in a build without CUDA: a CUDA tensor cannot exist there
// either, so reaching these means a caller bypassed the device check.
#include "kernels/cuda/launchers.h"

namespace dropkv::kernels::cuda {
namespace {
absl::Status NotBuilt() {
  return absl::FailedPreconditionError("dropkv was built without CUDA kernels (DROPKV_CUDA=OFF)");
}
}  // namespace

bool Built() {
  return false;
}
absl::StatusOr<at::Tensor> DropKvScores(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        const std::optional<at::Tensor>&, const DropKvParams&) {
  return NotBuilt();
}
absl::StatusOr<at::Tensor> DropKvScoresFromAttention(const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, const DropKvParams&) {
  return NotBuilt();
}
bool H2oKernelApplies(const at::Tensor&, const at::Tensor&) {
  return false;
}
absl::StatusOr<at::Tensor> H2oColumnSums(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         double) {
  return NotBuilt();
}
absl::Status WriteKv(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&) {
  return NotBuilt();
}
absl::Status WriteKeptKv(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, const at::Tensor&) {
  return NotBuilt();
}
absl::StatusOr<at::Tensor> PagedDecodeAttention(const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, const PagedAttentionParams&) {
  return NotBuilt();
}

}  // namespace dropkv::kernels::cuda
