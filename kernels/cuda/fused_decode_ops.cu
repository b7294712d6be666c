// Fused elementwise ops of the transformer layer on CUDA (kernels/fused_ops.h). Device code
// first (raw pointers, no torch), then the launchers, then the entry points that check the
// tensors and dispatch on the dtype.
//
// Launches: LaunchMaybePdl (kernels/cuda/pdl.cuh). Each kernel waits for the kernel queued before
// it (PdlWaitForPrimary) before its first read of an activation or cache and its first global
// write, and releases its own dependents: AddRmsNorm and GatedActivation before that wait (so the
// next GEMV starts in the previous one's tail; PdlReleaseThenWait), RoPE right after it (its
// dependent is the paged attention, not a GEMV; at batch 1 the qkv GEMV's epilogue does RoPE's
// work anyway). Only model constants (the norm weight, RoPE's inv_freq) are read before the wait:
// no kernel of a decode step writes them.
//
// Rounding: every op rounds to the model dtype exactly where the ATen chain it replaces does
// (fp32 math inside each op, ATen's round-to-nearest-even conversions between ops), so a fused
// decode step computes the same numbers as the unfused one up to the order of RMSNorm's sum.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/check.h"
#include "kernels/cuda/activations.cuh"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/dtype_convert.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/rope.cuh"
#include "kernels/fused_ops.h"
#include "kernels/kv_cache_fp8.h"

// Returns a failed status from the enclosing function (kernels/ does not depend on engine/'s
// macros).
#define FUSED_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::absl::Status fused_status_ = (expr);         \
    if (!fused_status_.ok()) return fused_status_; \
  } while (0)

namespace dropkv::kernels {
namespace {

// --- device code ---------------------------------------------------------------------------------

using cuda::FromFloat;
using cuda::GeluTanh;
using cuda::Round;
using cuda::Silu;
using cuda::ToFloat;

// kVec elements moved as one load/store (16 bytes for kVec = 16 / sizeof(T)).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// A reduction over the CTA (blockDim.x a multiple of 32, <= 1024): the warp reduction
// (cuda::WarpSum, cuda::WarpMax) over each warp, then over the warps' results, 0 padding the
// second round (the identity of a sum, and of a max of magnitudes); every thread gets the result.
template <typename WarpReduce>
__device__ float BlockReduce(float x, WarpReduce warp_reduce) {
  __shared__ float warp_results[32];
  x = warp_reduce(x);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_results[warp] = x;
  __syncthreads();
  const int num_warps = blockDim.x / 32;
  return warp_reduce(lane < num_warps ? warp_results[lane] : 0.f);
}

__device__ float BlockSum(float x) {
  return BlockReduce(x, [](float v) { return cuda::WarpSum(v); });
}

// grid (N), block a multiple of 32: CTA n owns row n. Pass 1 adds delta into the residual
// (rounded, stored) and sums the squares of the stored values; pass 2 re-reads the row this thread
// wrote and writes x * rstd * w rounded once.
//   residual: [N, H] contiguous; delta: [N, H] with row stride delta_stride (nullptr: no add)
//   weight: [H] (T or fp32); out: [N, H] contiguous. H % kVec == 0, pointers kVec-aligned.
template <typename T, typename W, int kVec>
__global__ void AddRmsNormKernel(T* __restrict__ residual, const T* __restrict__ delta,
                                 int64_t delta_stride, const W* __restrict__ weight,
                                 T* __restrict__ out, int64_t hidden, float eps) {
  using P = Pack<T, kVec>;
  const int64_t row = blockIdx.x;
  P* r = reinterpret_cast<P*>(residual + row * hidden);
  const P* d = delta != nullptr ? reinterpret_cast<const P*>(delta + row * delta_stride) : nullptr;
  P* o = reinterpret_cast<P*>(out + row * hidden);
  const int64_t num_packs = hidden / kVec;
  // The weight of this thread's first pack (its only one when H <= kVec * blockDim.x, as in
  // every model we run) before the wait: off the critical path after the block reduction.
  const int64_t i_first = threadIdx.x;
  float w_first[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k)
    w_first[k] = i_first < num_packs ? ToFloat(weight[i_first * kVec + k]) : 0.f;
  cuda::PdlReleaseThenWait();
  float sum_sq = 0.f;
  for (int64_t i = threadIdx.x; i < num_packs; i += blockDim.x) {
    P x = r[i];
    if (d != nullptr) {
      const P y = d[i];
#pragma unroll
      for (int k = 0; k < kVec; ++k) x.v[k] = FromFloat<T>(ToFloat(x.v[k]) + ToFloat(y.v[k]));
      r[i] = x;
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float f = ToFloat(x.v[k]);
      sum_sq += f * f;
    }
  }
  const float rstd = rsqrtf(BlockSum(sum_sq) / static_cast<float>(hidden) + eps);
  for (int64_t i = threadIdx.x; i < num_packs; i += blockDim.x) {
    const P x = r[i];
    P y;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float w = i == i_first ? w_first[k] : ToFloat(weight[i * kVec + k]);
      y.v[k] = FromFloat<T>(ToFloat(x.v[k]) * rstd * w);
    }
    o[i] = y;
  }
}

// grid (N, ceil((Hq + 2 Hkv) / blockDim.y)), block (D / 2 / kVec, heads per CTA): thread (x, y)
// owns the pairs (j, j + D/2), j in [x kVec, x kVec + kVec), of head h = blockIdx.y * blockDim.y
// + y of token t = blockIdx.x (kVec 4: 8- or 16-byte loads and stores; 1 where D / 2 % 4 != 0 or
// a row is not aligned). Heads [0, Hq) are q, [Hq, Hq + Hkv) k (both rotated), the rest v
// (copied).
//   qkv: [N, (Hq + 2 Hkv) * D] with row stride qkv_stride; positions int64 [N]; inv_freq fp32 [D/2]
//   q_out: [N, Hq, D]. k_out, v_out: [rows, Hkv, D] with row = slots[t] (skipped when negative),
//   or row = t when slots is nullptr; of type C: T, or e4m3 for an FP8 cache (each element
//   converted from its T value, saturating: kernels/kv_cache_fp8.h).
template <typename T, typename C, int kVec>
__global__ void RopeQkvKernel(const T* __restrict__ qkv, int64_t qkv_stride,
                              const int64_t* __restrict__ positions,
                              const float* __restrict__ inv_freq, int num_heads, int num_kv_heads,
                              int head_dim, const int64_t* __restrict__ slots,
                              T* __restrict__ q_out, C* __restrict__ k_out, C* __restrict__ v_out) {
  using P = Pack<T, kVec>;
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y * blockDim.y + threadIdx.y;
  const int j = threadIdx.x * kVec, half = head_dim / 2;
  float freq[kVec];  // model constants: before the wait
#pragma unroll
  for (int k = 0; k < kVec; ++k) freq[k] = inv_freq[j + k];
  cuda::PdlWaitForPrimary();
  cuda::PdlLaunchDependents();
  if (h >= num_heads + 2 * num_kv_heads) return;
  const T* src = qkv + t * qkv_stride + static_cast<int64_t>(h) * head_dim;
  P x1 = *reinterpret_cast<const P*>(src + j), x2 = *reinterpret_cast<const P*>(src + j + half);
  if (h < num_heads + num_kv_heads) {
    const float position = static_cast<float>(positions[t]);
#pragma unroll
    for (int k = 0; k < kVec; ++k) cuda::RotateHalfPair(x1.v[k], x2.v[k], position, freq[k]);
  }
  if (h < num_heads) {
    T* dst = q_out + (t * num_heads + h) * head_dim;
    *reinterpret_cast<P*>(dst + j) = x1;
    *reinterpret_cast<P*>(dst + j + half) = x2;
    return;
  }
  const int64_t row = slots != nullptr ? slots[t] : t;
  if (row < 0) return;
  const bool is_k = h < num_heads + num_kv_heads;
  const int kv_head = h - num_heads - (is_k ? 0 : num_kv_heads);
  C* dst = (is_k ? k_out : v_out) + (row * num_kv_heads + kv_head) * head_dim;
  if constexpr (std::is_same_v<C, T>) {
    *reinterpret_cast<P*>(dst + j) = x1;
    *reinterpret_cast<P*>(dst + j + half) = x2;
  } else {
    using CP = Pack<C, kVec>;  // kVec bytes of e4m3
    CP y1, y2;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      y1.v[k] = FromFloat<C>(ToFloat(x1.v[k]));
      y2.v[k] = FromFloat<C>(ToFloat(x2.v[k]));
    }
    *reinterpret_cast<CP*>(dst + j) = y1;
    *reinterpret_cast<CP*>(dst + j + half) = y2;
  }
}

// grid-stride over the N * I / kVec packs of the output: out[n, i] = act(gate[n, i]) * up[n, i],
// act rounded before the product.
//   gate_up: [N, 2 I] with row stride gu_stride (gate | up); out: [N, I] contiguous.
template <typename T, GateActivation kAct, int kVec>
__global__ void GatedActivationKernel(const T* __restrict__ gate_up, int64_t gu_stride,
                                      int64_t inter, int64_t num_rows, T* __restrict__ out) {
  using P = Pack<T, kVec>;
  const int64_t packs_per_row = inter / kVec;
  const int64_t total = num_rows * packs_per_row;
  cuda::PdlReleaseThenWait();
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < total;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = p / packs_per_row, i = p % packs_per_row;
    const T* row = gate_up + n * gu_stride;
    const P g = reinterpret_cast<const P*>(row)[i];
    const P u = reinterpret_cast<const P*>(row + inter)[i];
    P y;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float x = ToFloat(g.v[k]);
      const float a = Round<T>(kAct == GateActivation::kSilu ? Silu(x) : GeluTanh(x));
      y.v[k] = FromFloat<T>(a * ToFloat(u.v[k]));
    }
    reinterpret_cast<P*>(out)[p] = y;
  }
}

// grid (N), block a multiple of 32: CTA n owns row n. Pass 1: amax |x| over the row; scale =
// amax * (1 / 448) (1 for a zero row). Pass 2 (the row again, from L2): x / scale clamped to +-448,
// rounded to e4m3 (nearest even), kVec bytes a store.
//   x: [N, K] with row stride x_stride; out: [N, K] e4m3 contiguous; scales: fp32 [N].
template <typename T, int kVec>
__global__ void QuantizeRowsFp8Kernel(const T* __restrict__ x, int64_t x_stride, int64_t k,
                                      __nv_fp8_e4m3* __restrict__ out, float* __restrict__ scales) {
  using P = Pack<T, kVec>;
  using P8 = Pack<__nv_fp8_e4m3, kVec>;
  const int64_t n = blockIdx.x, packs = k / kVec;
  const P* row = reinterpret_cast<const P*>(x + n * x_stride);
  cuda::PdlReleaseThenWait();
  float amax = 0.f;
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const P v = row[i];
#pragma unroll
    for (int e = 0; e < kVec; ++e) amax = fmaxf(amax, fabsf(ToFloat(v.v[e])));
  }
  amax = BlockReduce(amax, [](float v) { return cuda::WarpMax(v); });
  // amax * (1 / 448), not amax / 448: ATen's CUDA division by a scalar multiplies by the
  // reciprocal, and these scales are the ones that chain computed (the bytes follow them).
  const float scale = amax > 0.f ? amax * (1.f / 448.f) : 1.f;
  if (threadIdx.x == 0) scales[n] = scale;
  P8* dst = reinterpret_cast<P8*>(out + n * k);
  for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
    const P v = row[i];
    P8 q;
#pragma unroll
    for (int e = 0; e < kVec; ++e)
      q.v[e] = FromFloat<__nv_fp8_e4m3>(fminf(fmaxf(ToFloat(v.v[e]) / scale, -448.f), 448.f));
    dst[i] = q;
  }
}

// --- launchers -----------------------------------------------------------------------------------

bool Aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Threads for a row of `num_packs` packs: one pack each up to 1024, whole warps.
int RowThreads(int64_t num_packs) {
  return static_cast<int>(std::clamp<int64_t>((num_packs + 31) / 32 * 32, 32, 1024));
}

template <typename T, typename W>
void LaunchAddRmsNorm(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                      at::Tensor& out, float eps) {
  const int64_t rows = residual.size(0), hidden = residual.size(1);
  T* r = static_cast<T*>(residual.data_ptr());
  const T* d = delta.defined() ? static_cast<const T*>(delta.data_ptr()) : nullptr;
  const int64_t d_stride = delta.defined() ? delta.stride(0) : 0;
  const W* w = static_cast<const W*>(weight.data_ptr());
  T* o = static_cast<T*>(out.data_ptr());
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = hidden % kVec == 0 && Aligned(r, 16) && Aligned(o, 16) &&
                   (d == nullptr || (Aligned(d, 16) && (d_stride * sizeof(T)) % 16 == 0));
  auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(rows));
  C10_CUDA_CHECK(vec ? cuda::LaunchMaybePdl(AddRmsNormKernel<T, W, kVec>, grid,
                                            RowThreads(hidden / kVec), 0, stream, r, d, d_stride, w,
                                            o, hidden, eps)
                     : cuda::LaunchMaybePdl(AddRmsNormKernel<T, W, 1>, grid, RowThreads(hidden), 0,
                                            stream, r, d, d_stride, w, o, hidden, eps));
}

template <typename T, typename C = T>
void LaunchRopeQkv(const at::Tensor& qkv, const QkvGeometry& geo, const at::Tensor& positions,
                   const at::Tensor& inv_freq, const int64_t* slots, at::Tensor& q_out,
                   at::Tensor& k_out, at::Tensor& v_out) {
  const int64_t rows = qkv.size(0);
  const int half = static_cast<int>(geo.head_dim / 2);
  constexpr int kVec = 4;
  // Rows, heads and the halves of a head on 4-element boundaries (the outputs are contiguous).
  const bool vec = half % kVec == 0 && Aligned(qkv.data_ptr(), kVec * sizeof(T)) &&
                   qkv.stride(0) % kVec == 0 && Aligned(q_out.data_ptr(), kVec * sizeof(T)) &&
                   Aligned(k_out.data_ptr(), kVec * sizeof(C)) &&
                   Aligned(v_out.data_ptr(), kVec * sizeof(C));
  const int threads_per_head = vec ? half / kVec : half;
  const int heads_per_cta = std::max(1, 256 / threads_per_head);
  const int64_t total_heads = geo.num_heads + 2 * geo.num_kv_heads;
  const dim3 grid(static_cast<unsigned>(rows),
                  static_cast<unsigned>((total_heads + heads_per_cta - 1) / heads_per_cta));
  const dim3 block(threads_per_head, heads_per_cta);
  const auto launch = [&](auto kernel) {
    return cuda::LaunchMaybePdl(
        kernel, grid, block, 0, at::cuda::getCurrentCUDAStream(),
        static_cast<const T*>(qkv.data_ptr()), qkv.stride(0), positions.data_ptr<int64_t>(),
        inv_freq.data_ptr<float>(), static_cast<int>(geo.num_heads),
        static_cast<int>(geo.num_kv_heads), static_cast<int>(geo.head_dim), slots,
        static_cast<T*>(q_out.data_ptr()), static_cast<C*>(k_out.data_ptr()),
        static_cast<C*>(v_out.data_ptr()));
  };
  C10_CUDA_CHECK(vec ? launch(RopeQkvKernel<T, C, kVec>) : launch(RopeQkvKernel<T, C, 1>));
}

template <typename T, GateActivation kAct>
void LaunchGatedActivation(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), inter = out.size(1);
  const T* gu = static_cast<const T*>(gate_up.data_ptr());
  T* o = static_cast<T*>(out.data_ptr());
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = inter % kVec == 0 && Aligned(gu, 16) && Aligned(o, 16) &&
                   (gate_up.stride(0) * sizeof(T)) % 16 == 0;
  const int vec_len = vec ? kVec : 1;
  const int64_t total = rows * inter / vec_len;
  constexpr int kThreads = 256;
  // Enough CTAs to fill the chip a few times over; the loop covers the rest.
  const int64_t max_ctas = int64_t{8} * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const auto ctas =
      static_cast<unsigned>(std::clamp<int64_t>((total + kThreads - 1) / kThreads, 1, max_ctas));
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t gu_stride = gate_up.stride(0);
  C10_CUDA_CHECK(vec ? cuda::LaunchMaybePdl(GatedActivationKernel<T, kAct, kVec>, dim3(ctas),
                                            kThreads, 0, stream, gu, gu_stride, inter, rows, o)
                     : cuda::LaunchMaybePdl(GatedActivationKernel<T, kAct, 1>, dim3(ctas), kThreads,
                                            0, stream, gu, gu_stride, inter, rows, o));
}

template <typename T>
void LaunchQuantizeRowsFp8(const at::Tensor& x, at::Tensor& out, at::Tensor& scales) {
  const int64_t rows = x.size(0), k = x.size(1);
  const T* src = static_cast<const T*>(x.data_ptr());
  auto* dst = static_cast<__nv_fp8_e4m3*>(out.data_ptr());
  float* s = scales.data_ptr<float>();
  constexpr int kVec = 16 / sizeof(T);
  const bool vec = k % kVec == 0 && Aligned(src, 16) && (x.stride(0) * sizeof(T)) % 16 == 0;
  auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(rows));
  C10_CUDA_CHECK(vec ? cuda::LaunchMaybePdl(QuantizeRowsFp8Kernel<T, kVec>, grid,
                                            RowThreads(k / kVec), 0, stream, src, x.stride(0), k,
                                            dst, s)
                     : cuda::LaunchMaybePdl(QuantizeRowsFp8Kernel<T, 1>, grid, RowThreads(k), 0,
                                            stream, src, x.stride(0), k, dst, s));
}

// Calls f with the CUDA element type of `dtype` as a value of that type (bf16, fp16, fp32).
template <typename F>
absl::Status DispatchDtype(at::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case at::kBFloat16:
      f(__nv_bfloat16{});
      return absl::OkStatus();
    case at::kHalf:
      f(__half{});
      return absl::OkStatus();
    case at::kFloat:
      f(float{});
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": dtype ", c10::toString(dtype), " is not bf16, fp16 or fp32"));
  }
}

// --- entry-point checks --------------------------------------------------------------------------

absl::Status CheckCuda(const at::Tensor& t, const char* name) {
  if (!t.is_cuda()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": fused ops take CUDA tensors, got one on ", t.device().str()));
  }
  return absl::OkStatus();
}

absl::Status CheckDtype(const at::Tensor& t, const char* name, at::ScalarType want) {
  if (t.scalar_type() != want) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": dtype ", c10::toString(t.scalar_type()),
                                                   ", expected ", c10::toString(want)));
  }
  return absl::OkStatus();
}

absl::Status CheckInnerContiguous(const at::Tensor& t, const char* name) {
  if (t.stride(1) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": the last dim must be contiguous, stride is ", t.stride(1)));
  }
  return absl::OkStatus();
}

// RoPE's arguments for `rows` tokens on `device`.
absl::Status CheckRopeArgs(const QkvGeometry& geo, int64_t rows, at::Device device,
                           const at::Tensor& positions, const at::Tensor& inv_freq) {
  if (geo.head_dim <= 0 || geo.head_dim % 2 != 0 || geo.head_dim > 2048) {
    return absl::InvalidArgumentError(
        absl::StrCat("RoPE: head_dim must be even and in [2, 2048], got ", geo.head_dim));
  }
  if (geo.num_heads <= 0 || geo.num_kv_heads <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("RoPE: heads must be > 0, got ", geo.num_heads, " / ", geo.num_kv_heads));
  }
  FUSED_RETURN_IF_ERROR(internal::CheckDim(positions, "positions", 1, "[N]"));
  FUSED_RETURN_IF_ERROR(internal::CheckSize(positions, "positions", 0, rows, "N"));
  FUSED_RETURN_IF_ERROR(CheckDtype(positions, "positions", at::kLong));
  FUSED_RETURN_IF_ERROR(internal::CheckDim(inv_freq, "inv_freq", 1, "[D / 2]"));
  FUSED_RETURN_IF_ERROR(internal::CheckSize(inv_freq, "inv_freq", 0, geo.head_dim / 2, "D / 2"));
  FUSED_RETURN_IF_ERROR(CheckDtype(inv_freq, "inv_freq", at::kFloat));
  for (const auto* t : {&positions, &inv_freq}) {
    if (t->device() != device || !t->is_contiguous()) {
      return absl::InvalidArgumentError(
          "RoPE: positions and inv_freq must be contiguous and on qkv's device");
    }
  }
  return absl::OkStatus();
}

// qkv's device and rank, then `other_checks` (the geometry's among them), then its width.
template <typename F>
absl::Status CheckQkv(const at::Tensor& qkv, const QkvGeometry& geo, F&& other_checks) {
  FUSED_RETURN_IF_ERROR(CheckCuda(qkv, "qkv"));
  FUSED_RETURN_IF_ERROR(internal::CheckDim(qkv, "qkv", 2, "[N, (Hq + 2 Hkv) * D]"));
  FUSED_RETURN_IF_ERROR(other_checks());
  FUSED_RETURN_IF_ERROR(internal::CheckSize(
      qkv, "qkv", 1, (geo.num_heads + 2 * geo.num_kv_heads) * geo.head_dim, "(Hq + 2 Hkv) * D"));
  return CheckInnerContiguous(qkv, "qkv");
}

}  // namespace

bool FusedOpsBuilt() {
  return true;
}

absl::Status internal::CheckRopeWriteKvArgs(const QkvGeometry& geo, int64_t rows,
                                            at::ScalarType dtype, at::Device device,
                                            const at::Tensor& positions, const at::Tensor& inv_freq,
                                            const at::Tensor& key_cache,
                                            const at::Tensor& value_cache,
                                            const at::Tensor& slots) {
  FUSED_RETURN_IF_ERROR(CheckRopeArgs(geo, rows, device, positions, inv_freq));
  const std::pair<const at::Tensor*, const char*> caches[] = {{&key_cache, "key_cache"},
                                                              {&value_cache, "value_cache"}};
  for (const auto& [t, name] : caches) {
    FUSED_RETURN_IF_ERROR(internal::CheckDim(*t, name, 4, "[num_blocks, block_size, Hkv, D]"));
    FUSED_RETURN_IF_ERROR(internal::CheckSize(*t, name, 2, geo.num_kv_heads, "Hkv"));
    FUSED_RETURN_IF_ERROR(internal::CheckSize(*t, name, 3, geo.head_dim, "D"));
    // qkv's dtype, or e4m3 (an FP8 cache, kernels/kv_cache_fp8.h).
    if (t->scalar_type() != kFp8KvDtype) FUSED_RETURN_IF_ERROR(CheckDtype(*t, name, dtype));
    if (!t->is_contiguous() || t->device() != device)
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": must be contiguous, on qkv's device"));
  }
  FUSED_RETURN_IF_ERROR(internal::CheckDim(slots, "slots", 1, "[N]"));
  FUSED_RETURN_IF_ERROR(internal::CheckSize(slots, "slots", 0, rows, "N"));
  FUSED_RETURN_IF_ERROR(CheckDtype(slots, "slots", at::kLong));
  if (!slots.is_contiguous() || slots.device() != device)
    return absl::InvalidArgumentError("slots: must be contiguous, on qkv's device");
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> AddRmsNorm(at::Tensor& residual, const at::Tensor& delta,
                                      const at::Tensor& weight, double eps) {
  FUSED_RETURN_IF_ERROR(CheckCuda(residual, "residual"));
  FUSED_RETURN_IF_ERROR(internal::CheckDim(residual, "residual", 2, "[N, H]"));
  if (!residual.is_contiguous())
    return absl::InvalidArgumentError("residual: must be contiguous (it is updated in place)");
  const int64_t hidden = residual.size(1);
  if (delta.defined()) {
    FUSED_RETURN_IF_ERROR(internal::CheckDim(delta, "delta", 2, "[N, H]"));
    FUSED_RETURN_IF_ERROR(internal::CheckSize(delta, "delta", 0, residual.size(0), "N"));
    FUSED_RETURN_IF_ERROR(internal::CheckSize(delta, "delta", 1, hidden, "H"));
    FUSED_RETURN_IF_ERROR(CheckInnerContiguous(delta, "delta"));
    FUSED_RETURN_IF_ERROR(CheckDtype(delta, "delta", residual.scalar_type()));
    if (delta.device() != residual.device())
      return absl::InvalidArgumentError("delta: not on residual's device");
  }
  FUSED_RETURN_IF_ERROR(internal::CheckDim(weight, "weight", 1, "[H]"));
  FUSED_RETURN_IF_ERROR(internal::CheckSize(weight, "weight", 0, hidden, "H"));
  if (weight.device() != residual.device() || !weight.is_contiguous())
    return absl::InvalidArgumentError("weight: must be contiguous and on residual's device");
  if (weight.scalar_type() != residual.scalar_type() && weight.scalar_type() != at::kFloat) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weight: dtype ", c10::toString(weight.scalar_type()), ", expected residual's (",
        c10::toString(residual.scalar_type()), ") or fp32"));
  }
  return internal::CatchTorch("AddRmsNorm(cuda)", [&]() -> absl::StatusOr<at::Tensor> {
    c10::cuda::CUDAGuard guard(residual.device());
    auto out = at::empty_like(residual);
    if (residual.numel() == 0) return out;
    const bool fp32_weight = weight.scalar_type() == at::kFloat;
    const float e = static_cast<float>(eps);
    FUSED_RETURN_IF_ERROR(DispatchDtype(residual.scalar_type(), "AddRmsNorm", [&](auto x) {
      using T = decltype(x);
      if (fp32_weight)
        LaunchAddRmsNorm<T, float>(residual, delta, weight, out, e);
      else
        LaunchAddRmsNorm<T, T>(residual, delta, weight, out, e);
    }));
    return out;
  });
}

absl::StatusOr<at::Tensor> RopeWriteKv(const at::Tensor& qkv, const QkvGeometry& geo,
                                       const at::Tensor& positions, const at::Tensor& inv_freq,
                                       at::Tensor& key_cache, at::Tensor& value_cache,
                                       const at::Tensor& slots) {
  FUSED_RETURN_IF_ERROR(CheckQkv(qkv, geo, [&] {
    return internal::CheckRopeWriteKvArgs(geo, qkv.size(0), qkv.scalar_type(), qkv.device(),
                                          positions, inv_freq, key_cache, value_cache, slots);
  }));
  return internal::CatchTorch("RopeWriteKv(cuda)", [&]() -> absl::StatusOr<at::Tensor> {
    c10::cuda::CUDAGuard guard(qkv.device());
    auto q = at::empty({qkv.size(0), geo.num_heads, geo.head_dim}, qkv.options());
    if (qkv.size(0) == 0) return q;
    const bool fp8 = IsFp8Cache(key_cache);
    FUSED_RETURN_IF_ERROR(DispatchDtype(qkv.scalar_type(), "RopeWriteKv", [&](auto x) {
      using T = decltype(x);
      if (fp8) {
        LaunchRopeQkv<T, __nv_fp8_e4m3>(qkv, geo, positions, inv_freq, slots.data_ptr<int64_t>(), q,
                                        key_cache, value_cache);
      } else {
        LaunchRopeQkv<T>(qkv, geo, positions, inv_freq, slots.data_ptr<int64_t>(), q, key_cache,
                         value_cache);
      }
    }));
    return q;
  });
}

absl::StatusOr<std::tuple<at::Tensor, at::Tensor, at::Tensor>> RopeSplitQkv(
    const at::Tensor& qkv, const QkvGeometry& geo, const at::Tensor& positions,
    const at::Tensor& inv_freq) {
  FUSED_RETURN_IF_ERROR(CheckQkv(qkv, geo, [&] {
    return CheckRopeArgs(geo, qkv.size(0), qkv.device(), positions, inv_freq);
  }));
  using Result = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
  return internal::CatchTorch("RopeSplitQkv(cuda)", [&]() -> absl::StatusOr<Result> {
    c10::cuda::CUDAGuard guard(qkv.device());
    const int64_t n = qkv.size(0);
    auto q = at::empty({n, geo.num_heads, geo.head_dim}, qkv.options());
    auto k = at::empty({n, geo.num_kv_heads, geo.head_dim}, qkv.options());
    auto v = at::empty({n, geo.num_kv_heads, geo.head_dim}, qkv.options());
    if (n == 0) return Result{q, k, v};
    FUSED_RETURN_IF_ERROR(DispatchDtype(qkv.scalar_type(), "RopeSplitQkv", [&](auto x) {
      LaunchRopeQkv<decltype(x)>(qkv, geo, positions, inv_freq, nullptr, q, k, v);
    }));
    return Result{q, k, v};
  });
}

absl::StatusOr<std::pair<at::Tensor, at::Tensor>> QuantizeRowsFp8(const at::Tensor& x) {
  FUSED_RETURN_IF_ERROR(CheckCuda(x, "x"));
  FUSED_RETURN_IF_ERROR(internal::CheckDim(x, "x", 2, "[N, K]"));
  FUSED_RETURN_IF_ERROR(CheckInnerContiguous(x, "x"));
  if (x.size(0) > INT32_MAX) return absl::InvalidArgumentError("x: too many rows");
  return internal::CatchTorch(
      "QuantizeRowsFp8(cuda)", [&]() -> absl::StatusOr<std::pair<at::Tensor, at::Tensor>> {
        c10::cuda::CUDAGuard guard(x.device());
        auto out = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
        auto scales = at::empty({x.size(0), 1}, x.options().dtype(at::kFloat));
        if (x.size(0) == 0 || x.size(1) == 0) return std::pair{out, scales.fill_(1.f)};
        FUSED_RETURN_IF_ERROR(DispatchDtype(x.scalar_type(), "QuantizeRowsFp8", [&](auto v) {
          LaunchQuantizeRowsFp8<decltype(v)>(x, out, scales);
        }));
        return std::pair{out, scales};
      });
}

absl::StatusOr<at::Tensor> GatedActivation(const at::Tensor& gate_up, GateActivation act) {
  FUSED_RETURN_IF_ERROR(CheckCuda(gate_up, "gate_up"));
  FUSED_RETURN_IF_ERROR(internal::CheckDim(gate_up, "gate_up", 2, "[N, 2 I]"));
  FUSED_RETURN_IF_ERROR(CheckInnerContiguous(gate_up, "gate_up"));
  if (gate_up.size(1) % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("gate_up: dim 1 (2 I) must be even, got ", gate_up.size(1)));
  }
  return internal::CatchTorch("GatedActivation(cuda)", [&]() -> absl::StatusOr<at::Tensor> {
    c10::cuda::CUDAGuard guard(gate_up.device());
    auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
    if (out.numel() == 0) return out;
    FUSED_RETURN_IF_ERROR(DispatchDtype(gate_up.scalar_type(), "GatedActivation", [&](auto x) {
      using T = decltype(x);
      if (act == GateActivation::kSilu)
        LaunchGatedActivation<T, GateActivation::kSilu>(gate_up, out);
      else
        LaunchGatedActivation<T, GateActivation::kGeluTanh>(gate_up, out);
    }));
    return out;
  });
}

}  // namespace dropkv::kernels
