// kv_cache_fp8.h in ATen ops (CPU and CUDA tensors alike).
#include "kernels/kv_cache_fp8.h"

#include <ATen/ATen.h>

namespace dropkv::kernels {
namespace {

at::Tensor AsBytes(const at::Tensor& t) {
  return IsFp8Cache(t) ? t.view(at::kByte) : t;
}

}  // namespace

at::Tensor QuantizeKv(const at::Tensor& x) {
  return x.clamp(-kFp8KvMax, kFp8KvMax).to(kFp8KvDtype);
}

at::Tensor RoundTripKv(const at::Tensor& x) {
  return QuantizeKv(x).to(x.scalar_type());
}

at::Tensor ToCacheDtype(const at::Tensor& x, const at::Tensor& cache) {
  return IsFp8Cache(cache) ? QuantizeKv(x) : x.to(cache.scalar_type());
}

at::Tensor GatherRows(const at::Tensor& cache_rows, const at::Tensor& slots, at::ScalarType dtype) {
  auto rows = AsBytes(cache_rows).index_select(0, slots);
  if (IsFp8Cache(cache_rows)) rows = rows.view(kFp8KvDtype);
  return rows.to(dtype);
}

void ScatterRows(at::Tensor& cache_rows, const at::Tensor& slots, const at::Tensor& rows) {
  AsBytes(cache_rows).index_copy_(0, slots, AsBytes(rows));
}

}  // namespace dropkv::kernels
