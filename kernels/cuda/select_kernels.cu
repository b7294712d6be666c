// Top-k selection without a sort (selection.h, issue 5): one CTA per row finds the row's k-th
// largest score by radix select on order-preserving uint32 keys (4 passes of 8 bits), then writes
// the kept positions in ascending order with a warp-ballot stream compaction: every score above
// the threshold, plus the first (k - count_above) scores equal to it in ascending position (the
// tie rule of selection.h). No sort, no atomics on global memory, no host sync; deterministic.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/check.h"

namespace dropkv::kernels::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 256;

// Larger float -> larger key; -0 and +0 map to the same key (they compare equal).
__device__ __forceinline__ uint32_t OrderedKey(float x) {
  const uint32_t u = __float_as_uint(x == 0.0f ? 0.0f : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// scores fp32 [rows, n] (row stride n), out int64 [rows, keep]; 1 <= keep <= n.
__global__ void __launch_bounds__(kThreads)
    SelectKeptKernel(const float* __restrict__ scores, int64_t* __restrict__ out, int32_t n,
                     int32_t keep) {
  __shared__ uint32_t hist[kWarps][kBins];  // per-warp histograms: no cross-warp contention
  __shared__ uint32_t suffix[kBins + 1];
  __shared__ uint32_t sel_prefix, sel_remaining;
  __shared__ uint32_t warp_above[kWarps], warp_equal[kWarps];
  const float* row = scores + static_cast<int64_t>(blockIdx.x) * n;
  int64_t* out_row = out + static_cast<int64_t>(blockIdx.x) * keep;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // Radix select, most significant byte first: after each pass `prefix` holds the k-th largest
  // key's known bytes and `remaining` its rank among the keys that share them.
  uint32_t prefix = 0, mask = 0, remaining = static_cast<uint32_t>(keep);
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < kWarps * kBins; i += kThreads) (&hist[0][0])[i] = 0;
    __syncthreads();
    for (int base = 0; base < n; base += kThreads) {
      const int i = base + tid;
      uint32_t digit = kBins;  // sentinel: out of range or another prefix
      if (i < n) {
        const uint32_t key = OrderedKey(row[i]);
        if ((key & mask) == prefix) digit = (key >> shift) & 0xffu;
      }
      // Lanes with the same digit add once (max pooling makes many equal scores).
      const uint32_t group = __match_any_sync(0xffffffffu, digit);
      if (digit < kBins && lane == __ffs(group) - 1) atomicAdd(&hist[warp][digit], __popc(group));
    }
    __syncthreads();
    if (tid < kBins) {
      uint32_t total = 0;
      for (int w = 0; w < kWarps; ++w) total += hist[w][tid];
      suffix[tid] = total;
      if (tid == 0) suffix[kBins] = 0;
    }
    __syncthreads();
    // Inclusive suffix sums over the bins (Hillis-Steele), then the bin holding rank `remaining`.
    for (int step = 1; step < kBins; step <<= 1) {
      uint32_t add = 0;
      if (tid < kBins && tid + step < kBins) add = suffix[tid + step];
      __syncthreads();
      if (tid < kBins) suffix[tid] += add;
      __syncthreads();
    }
    if (tid < kBins && suffix[tid + 1] < remaining && remaining <= suffix[tid]) {
      sel_prefix = prefix | (static_cast<uint32_t>(tid) << shift);
      sel_remaining = remaining - suffix[tid + 1];
    }
    __syncthreads();
    prefix = sel_prefix;
    remaining = sel_remaining;
    mask |= 0xffu << shift;
    __syncthreads();  // sel_* are rewritten by the next pass
  }
  const uint32_t threshold = prefix;      // key of the k-th largest score
  const uint32_t ties_taken = remaining;  // how many keys equal to it are kept (lowest positions)

  // Ordered compaction: warp w owns the contiguous segment [begin, end); count, scan, write.
  const int segment = ((n + kWarps - 1) / kWarps + 31) / 32 * 32;
  const int begin = min(n, warp * segment), end = min(n, begin + segment);
  const uint32_t lanes_below = (1u << lane) - 1u;
  uint32_t above = 0, equal = 0;
  for (int base = begin; base < end; base += 32) {
    const int i = base + lane;
    const uint32_t key = i < end ? OrderedKey(row[i]) : 0u;
    above += __popc(__ballot_sync(0xffffffffu, i < end && key > threshold));
    equal += __popc(__ballot_sync(0xffffffffu, i < end && key == threshold));
  }
  if (lane == 0) {
    warp_above[warp] = above;
    warp_equal[warp] = equal;
  }
  __syncthreads();
  uint32_t above_before = 0, equal_before = 0;  // exclusive prefix over the earlier warps
  for (int w = 0; w < warp; ++w) {
    above_before += warp_above[w];
    equal_before += warp_equal[w];
  }
  for (int base = begin; base < end; base += 32) {
    const int i = base + lane;
    const uint32_t key = i < end ? OrderedKey(row[i]) : 0u;
    const uint32_t is_above = __ballot_sync(0xffffffffu, i < end && key > threshold);
    const uint32_t is_equal = __ballot_sync(0xffffffffu, i < end && key == threshold);
    const uint32_t a = above_before + __popc(is_above & lanes_below);
    const uint32_t e = equal_before + __popc(is_equal & lanes_below);  // tie rank of this lane
    const bool kept = ((is_above >> lane) & 1u) || (((is_equal >> lane) & 1u) && e < ties_taken);
    if (kept) out_row[a + min(e, ties_taken)] = i;
    above_before += __popc(is_above);
    equal_before += __popc(is_equal);
  }
}

}  // namespace

// scores: CUDA fp32 [rows, n], contiguous; 1 <= keep <= n -> int64 [rows, keep] ascending.
absl::StatusOr<at::Tensor> SelectKeptAscending(const at::Tensor& scores, int64_t keep) {
  if (!scores.is_cuda() || scores.scalar_type() != at::kFloat || scores.dim() != 2 ||
      !scores.is_contiguous()) {
    return absl::InvalidArgumentError(
        absl::StrCat("SelectKeptAscending: expected contiguous CUDA fp32 [rows, n], got ",
                     internal::ShapeStr(scores)));
  }
  const int64_t rows = scores.size(0), n = scores.size(1);
  if (keep < 1 || keep > n || n > INT32_MAX || rows > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("SelectKeptAscending: keep ", keep, " outside [1, ", n, "]"));
  }
  return internal::CatchTorch("SelectKeptAscending", [&]() -> absl::StatusOr<at::Tensor> {
    const c10::cuda::CUDAGuard guard(scores.device());
    auto out = at::empty({rows, keep}, scores.options().dtype(at::kLong));
    if (rows == 0) return out;
    SelectKeptKernel<<<static_cast<unsigned>(rows), kThreads, 0,
                       at::cuda::getCurrentCUDAStream()>>>(
        scores.data_ptr<float>(), out.data_ptr<int64_t>(), static_cast<int32_t>(n),
        static_cast<int32_t>(keep));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
  });
}

}  // namespace dropkv::kernels::cuda
