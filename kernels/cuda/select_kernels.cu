// Top-k selection without a sort (selection.h). A row's k-th largest score comes from a
// radix select on order-preserving uint32 keys (4 passes of 8 bits); each pass is one histogram
// kernel over all (row, chunk) CTAs, so a row is spread over the whole GPU (v1, one CTA per row,
// was latency-bound: 0.245 ms at 128K), and one tiny kernel per row that picks the bin. Then the
// kept positions are written in ascending order by a count kernel and a ballot compaction kernel:
// every score above the threshold plus the first (k - count_above) scores equal to it (the tie
// rule of selection.h). No sort, no global atomics on the output, no host sync; deterministic.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/check.h"

namespace dropkv::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBins = 256;
constexpr int kPerThread = 32;                 // scores per thread per chunk, loads in flight
constexpr int kChunk = kThreads * kPerThread;  // 8192 scores per CTA
static_assert(kThreads == kBins, "HistogramKernel and PickBinKernel map one thread to one bin");

// Larger float -> larger key; -0 and +0 map to the same key (they compare equal).
__device__ __forceinline__ uint32_t OrderedKey(float x) {
  const uint32_t u = __float_as_uint(x == 0.0f ? 0.0f : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Bits of the key already fixed before the pass at `shift`.
__device__ __forceinline__ uint32_t KnownMask(int shift) {
  return shift == 24 ? 0u : ~((1u << (shift + 8)) - 1u);
}

// Per-row radix state: the k-th largest key's known bytes and its rank among the keys sharing them.
struct RowState {
  uint32_t prefix, remaining;
};

// grid (chunks, rows): histogram of the next byte of the keys that match the row's prefix.
__global__ void __launch_bounds__(kThreads)
    HistogramKernel(const float* __restrict__ scores, int32_t n, int shift,
                    const RowState* __restrict__ state, uint32_t* __restrict__ hist) {
  __shared__ uint32_t warp_hist[kWarps][kBins];  // per-warp: no cross-warp contention
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int i = tid; i < kWarps * kBins; i += kThreads) (&warp_hist[0][0])[i] = 0;
  const int row = blockIdx.y;
  const float* x = scores + static_cast<int64_t>(row) * n;
  const uint32_t mask = KnownMask(shift), prefix = shift == 24 ? 0u : state[row].prefix;
  const int begin = blockIdx.x * kChunk;
  float v[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {  // all loads first: memory-level parallelism
    const int i = begin + j * kThreads + tid;
    v[j] = i < n ? x[i] : 0.0f;
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int i = begin + j * kThreads + tid;
    uint32_t digit = kBins;  // sentinel: out of range or another prefix
    const uint32_t key = OrderedKey(v[j]);
    if (i < n && (key & mask) == prefix) digit = (key >> shift) & 0xffu;
    // Lanes with the same digit add once (max pooling makes many equal scores).
    const uint32_t group = __match_any_sync(0xffffffffu, digit);
    if (digit < kBins && lane == __ffs(group) - 1)
      atomicAdd(&warp_hist[warp][digit], __popc(group));
  }
  __syncthreads();
  uint32_t total = 0;
  for (int w = 0; w < kWarps; ++w) total += warp_hist[w][tid];
  if (total) atomicAdd(&hist[row * kBins + tid], total);
}

// grid rows, kBins threads: picks the bin holding rank `remaining`, clears the histogram.
__global__ void __launch_bounds__(kBins)
    PickBinKernel(int shift, int32_t keep, RowState* __restrict__ state,
                  uint32_t* __restrict__ hist) {
  __shared__ uint32_t suffix[kBins + 1];
  const int tid = threadIdx.x, row = blockIdx.x;
  const RowState s = shift == 24 ? RowState{0u, static_cast<uint32_t>(keep)} : state[row];
  suffix[tid] = hist[row * kBins + tid];
  hist[row * kBins + tid] = 0;
  if (tid == 0) suffix[kBins] = 0;
  __syncthreads();
  for (int step = 1; step < kBins; step <<= 1) {  // inclusive suffix sums (Hillis-Steele)
    const uint32_t add = tid + step < kBins ? suffix[tid + step] : 0u;
    __syncthreads();
    suffix[tid] += add;
    __syncthreads();
  }
  if (suffix[tid + 1] < s.remaining && s.remaining <= suffix[tid]) {
    state[row] =
        RowState{s.prefix | (static_cast<uint32_t>(tid) << shift), s.remaining - suffix[tid + 1]};
  }
}

// Counts of keys above / equal to the row's threshold in a warp's 32 x kPerThread sub-chunk
// (warp w of CTA c covers [c * kChunk + w * kPerThread * 32, + kPerThread * 32)).
__device__ __forceinline__ void WarpCounts(const float* x, int32_t n, int begin, uint32_t threshold,
                                           uint32_t& above, uint32_t& equal) {
  const int lane = threadIdx.x & 31;
  above = 0;
  equal = 0;
#pragma unroll 8
  for (int j = 0; j < kPerThread; ++j) {
    const int i = begin + j * 32 + lane;
    const uint32_t key = i < n ? OrderedKey(x[i]) : 0u;
    above += __popc(__ballot_sync(0xffffffffu, i < n && key > threshold));
    equal += __popc(__ballot_sync(0xffffffffu, i < n && key == threshold));
  }
}

// grid (chunks, rows): per-CTA counts above / equal to the threshold.
__global__ void __launch_bounds__(kThreads)
    CountKernel(const float* __restrict__ scores, int32_t n, const RowState* __restrict__ state,
                uint2* __restrict__ counts) {
  __shared__ uint32_t warp_above[kWarps], warp_equal[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, row = blockIdx.y;
  const float* x = scores + static_cast<int64_t>(row) * n;
  uint32_t above, equal;
  WarpCounts(x, n, blockIdx.x * kChunk + warp * kPerThread * 32, state[row].prefix, above, equal);
  if (lane == 0) {
    warp_above[warp] = above;
    warp_equal[warp] = equal;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint2 c{0u, 0u};
    for (int w = 0; w < kWarps; ++w) c.x += warp_above[w], c.y += warp_equal[w];
    counts[static_cast<int64_t>(row) * gridDim.x + blockIdx.x] = c;
  }
}

// grid (chunks, rows): ordered compaction. Position of a kept score = scores above before it +
// min(ties before it, ties taken); the CTA's and the warp's bases come from the counts.
__global__ void __launch_bounds__(kThreads)
    WriteKeptKernel(const float* __restrict__ scores, int32_t n, int32_t keep,
                    const RowState* __restrict__ state, const uint2* __restrict__ counts,
                    int64_t* __restrict__ out) {
  __shared__ uint32_t warp_above[kWarps], warp_equal[kWarps], cta_above, cta_equal;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, row = blockIdx.y;
  const float* x = scores + static_cast<int64_t>(row) * n;
  int64_t* out_row = out + static_cast<int64_t>(row) * keep;
  const uint32_t threshold = state[row].prefix, ties_taken = state[row].remaining;
  if (tid < 32) {  // exclusive prefix of the earlier CTAs' counts
    uint32_t a = 0, e = 0;
    for (int c = lane; c < static_cast<int>(blockIdx.x); c += 32) {
      const uint2 v = counts[static_cast<int64_t>(row) * gridDim.x + c];
      a += v.x;
      e += v.y;
    }
    for (int o = 16; o > 0; o >>= 1) {
      a += __shfl_xor_sync(0xffffffffu, a, o);
      e += __shfl_xor_sync(0xffffffffu, e, o);
    }
    if (lane == 0) cta_above = a, cta_equal = e;
  }
  const int begin = blockIdx.x * kChunk + warp * kPerThread * 32;
  uint32_t above, equal;
  WarpCounts(x, n, begin, threshold, above, equal);
  if (lane == 0) {
    warp_above[warp] = above;
    warp_equal[warp] = equal;
  }
  __syncthreads();
  uint32_t above_before = cta_above, equal_before = cta_equal;
  for (int w = 0; w < warp; ++w) above_before += warp_above[w], equal_before += warp_equal[w];
  const uint32_t lanes_below = (1u << lane) - 1u;
#pragma unroll 4
  for (int j = 0; j < kPerThread; ++j) {
    const int i = begin + j * 32 + lane;
    const uint32_t key = i < n ? OrderedKey(x[i]) : 0u;
    const uint32_t is_above = __ballot_sync(0xffffffffu, i < n && key > threshold);
    const uint32_t is_equal = __ballot_sync(0xffffffffu, i < n && key == threshold);
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
  if (keep < 1 || keep > n || n > INT32_MAX - kChunk || rows > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("SelectKeptAscending: keep ", keep,
                                                   " outside [1, ", n, "] or ", rows, " rows"));
  }
  return internal::CatchTorch("SelectKeptAscending", [&]() -> absl::StatusOr<at::Tensor> {
    const c10::cuda::CUDAGuard guard(scores.device());
    auto out = at::empty({rows, keep}, scores.options().dtype(at::kLong));
    if (rows == 0) return out;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    // One int32 workspace: histograms [rows, 256] (zeroed here, cleared by PickBinKernel), the
    // row states [rows, 2] and the chunk counts [rows, chunks, 2].
    auto work = at::zeros({rows * (kBins + 2 + 2 * chunks)}, scores.options().dtype(at::kInt));
    auto* hist = reinterpret_cast<uint32_t*>(work.data_ptr<int32_t>());
    auto* state = reinterpret_cast<RowState*>(hist + rows * kBins);
    auto* counts = reinterpret_cast<uint2*>(hist + rows * (kBins + 2));
    const float* x = scores.data_ptr<float>();
    const auto stream = at::cuda::getCurrentCUDAStream();
    const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(rows));
    const auto n32 = static_cast<int32_t>(n), keep32 = static_cast<int32_t>(keep);
    for (int shift = 24; shift >= 0; shift -= 8) {
      HistogramKernel<<<grid, kThreads, 0, stream>>>(x, n32, shift, state, hist);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      PickBinKernel<<<static_cast<unsigned>(rows), kBins, 0, stream>>>(shift, keep32, state, hist);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    CountKernel<<<grid, kThreads, 0, stream>>>(x, n32, state, counts);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    WriteKeptKernel<<<grid, kThreads, 0, stream>>>(x, n32, keep32, state, counts,
                                                   out.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
  });
}

}  // namespace dropkv::kernels::cuda
