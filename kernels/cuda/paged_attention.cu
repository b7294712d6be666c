// Paged decode attention on CUDA, one launch for the whole batch (paged_decode_kernels.cuh):
// PagedDecodeMmaKernel (tensor cores, bf16 / fp16 with head_dim 64 / 128) or PagedDecodeKernel
// (CUDA cores, the rest), both with the split-K merge folded in, both launched with programmatic
// dependent launch (pdl.cuh; kernels/tuning.h turns it off).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/check.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/paged_decode_kernels.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/kv_cache_fp8.h"

namespace dropkv::kernels::cuda {
namespace {

// Arrival counters of the folded merge (int32, one per (sequence, KV head, row chunk)), one
// buffer per stream: each is 0 between launches (the merging CTA resets its own), so launches in
// stream order and every replay of a graph captured on the stream reuse it with no memset.
// Launches that could overlap (two streams) get different buffers; a graph replayed on another
// stream must not overlap launches on the stream it was captured on. Buffers are never freed (a
// captured graph keeps the pointer), only replaced by a larger one.
int32_t* MergeCounters(int64_t count, const c10::cuda::CUDAStream& stream) {
  struct Buffer {
    int32_t* ptr = nullptr;
    int64_t capacity = 0;
  };
  static std::mutex mu;
  static auto* buffers = new std::map<std::pair<int, cudaStream_t>, Buffer>();
  std::lock_guard<std::mutex> lock(mu);
  Buffer& buf = (*buffers)[{stream.device_index(), stream.stream()}];
  if (buf.capacity < count) {
    const int64_t capacity = std::max<int64_t>(count, int64_t{1} << 14);
    // The stream may be capturing a graph: allocate and zero outside it (relaxed mode lets this
    // thread call cudaMalloc; the memset runs on a private stream and is waited for here).
    c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    int32_t* ptr = nullptr;
    C10_CUDA_CHECK(cudaMalloc(&ptr, capacity * sizeof(int32_t)));
    cudaStream_t zero_stream = nullptr;
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&zero_stream, cudaStreamNonBlocking));
    C10_CUDA_CHECK(cudaMemsetAsync(ptr, 0, capacity * sizeof(int32_t), zero_stream));
    C10_CUDA_CHECK(cudaStreamSynchronize(zero_stream));
    C10_CUDA_CHECK(cudaStreamDestroy(zero_stream));
    buf = {ptr, capacity};
  }
  return buf.ptr;
}

struct DecodeArgs {
  const at::Tensor& q;
  const at::Tensor& k_cache;
  const at::Tensor& v_cache;
  const at::Tensor& block_tables;
  const at::Tensor& seq_lens;
  float scale;
  int requested_splits;
  int64_t max_len_hint;
  bool metadata_uploaded;
  bool older_keys_ready;
  at::Tensor& out;
};

// Split-K geometry from the shapes, the hint and the SM count only (no device sync): the same
// grid on every CUDA-graph replay. CTAs past a sequence's end exit at once.
struct SplitPlan {
  int64_t max_len, splits, split_len, table_len;
};
// Default split counts. CUDA cores: about 2 CTAs per SM and >= 64 keys per split; 4
// (all resident slots) measured slower at 8K x 32 layers (0.86 vs 0.79 ms: twice the
// partials to merge, no faster partial kernel). Tensor cores (kTensorCores): one CTA per SM
// when that still gives every KV head 2 splits, and >= 128 keys per split; measured 2026-12-01,
// graphs of 32 layers: batch 1 x 8K 16 splits 0.506 ms vs 0.556 at 33 (2 per SM) and 0.569 at 20
// (a second CTA on some SMs only); 819 keys: 7 splits 0.242 ms vs 0.261 at 13. More heads (batch
// 16 x 2K: 3 splits, 1.46 ms) keep the CUDA-core rule: not swept.
enum class SplitRule { kCudaCores, kTensorCores };
SplitPlan PlanSplits(const DecodeArgs& a, int64_t ctas_per_split, int occupancy, SplitRule rule) {
  const int64_t block_size = a.k_cache.size(1);
  const int64_t capacity = a.block_tables.size(1) * block_size;
  SplitPlan plan{};
  plan.max_len =
      std::max<int64_t>(1, a.max_len_hint > 0 ? std::min(a.max_len_hint, capacity) : capacity);
  int64_t splits = a.requested_splits;
  if (splits <= 0) {
    const int64_t num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    int64_t min_split_keys = 64;  // below this the per-CTA prologue and merge dominate
    if (rule == SplitRule::kTensorCores && 2 * ctas_per_split <= num_sms) {
      splits = num_sms / ctas_per_split;
      min_split_keys = 128;
    } else {
      splits = (int64_t{std::min(occupancy, 2)} * num_sms + ctas_per_split - 1) / ctas_per_split;
    }
    splits = std::min<int64_t>(splits, (plan.max_len + min_split_keys - 1) / min_split_keys);
  }
  plan.splits = std::clamp<int64_t>(splits, 1, std::min<int64_t>(kMaxSplits, plan.max_len));
  plan.split_len = ((plan.max_len + plan.splits - 1) / plan.splits + 15) / 16 * 16;
  plan.table_len = (plan.split_len + block_size - 1) / block_size + 1;
  return plan;
}

// Kernel parameters; `part` receives the partials' scratch (kept alive by the caller until the
// launch is queued; none when there is one split).
template <typename T, typename C = T>
PagedDecodeParams<T, C> BaseParams(const DecodeArgs& a, int64_t rows_pad, int64_t num_chunks,
                                   const SplitPlan& plan, at::Tensor& part) {
  const int64_t block_size = a.k_cache.size(1), hkv = a.k_cache.size(2), d = a.q.size(2);
  PagedDecodeParams<T, C> pa{};
  pa.q = reinterpret_cast<const T*>(a.q.data_ptr());
  pa.k = reinterpret_cast<const C*>(a.k_cache.data_ptr());
  pa.v = reinterpret_cast<const C*>(a.v_cache.data_ptr());
  pa.block_tables = a.block_tables.data_ptr<int32_t>();
  pa.seq_lens = a.seq_lens.data_ptr<int32_t>();
  pa.stride_slot = hkv * d;
  pa.max_blocks = static_cast<int32_t>(a.block_tables.size(1));
  pa.block_size = static_cast<int32_t>(block_size);
  pa.block_shift = (block_size & (block_size - 1)) == 0
                       ? static_cast<int32_t>(__builtin_ctzll(static_cast<uint64_t>(block_size)))
                       : -1;
  pa.num_kv_heads = static_cast<int32_t>(hkv);
  pa.group = static_cast<int32_t>(a.q.size(1) / hkv);
  pa.rows_pad = static_cast<int32_t>(rows_pad);
  pa.num_splits = static_cast<int32_t>(plan.splits);
  pa.split_len = static_cast<int32_t>(plan.split_len);
  pa.table_len = plan.table_len <= kDecMaxTableEntries ? static_cast<int32_t>(plan.table_len) : 0;
  pa.scale_log2 = a.scale * 1.4426950408889634f;
  pa.num_chunks = static_cast<int32_t>(num_chunks);
  pa.metadata_before_wait = a.metadata_uploaded ? 1 : 0;
  pa.older_keys_before_wait = pa.metadata_before_wait && a.older_keys_ready ? 1 : 0;
  pa.out = reinterpret_cast<T*>(a.out.data_ptr());
  const int64_t bh = a.q.size(0) * hkv;
  pa.counters = MergeCounters(bh * num_chunks, at::cuda::getCurrentCUDAStream());
  if (plan.splits == 1) return pa;
  // Partials [acc | m | l] in one allocation.
  part = at::empty({bh * plan.splits * rows_pad * (d + 2)}, a.q.options().dtype(at::kFloat));
  pa.part_acc = part.data_ptr<float>();
  pa.part_m = pa.part_acc + bh * plan.splits * rows_pad * d;
  pa.part_l = pa.part_m + bh * plan.splits * rows_pad;
  return pa;
}

// Resident CTAs per SM of `kernel` with `smem` bytes, after raising its dynamic shared-memory
// limit to `max_smem`. Once per instantiation: host calls on every decode step cost time.
template <typename Kernel>
int Occupancy(Kernel kernel, int threads, int smem, int max_smem) {
  C10_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem));
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem));
  return std::max(1, blocks);
}

// CUDA cores, RC query heads per CTA (row chunks in z); C: the cache's element type.
template <typename T, int D, int RC, typename C = T>
void LaunchCudaCores(const DecodeArgs& a) {
  const int64_t hkv = a.k_cache.size(2), g = a.q.size(1) / hkv, bh = a.q.size(0) * hkv;
  const int64_t num_chunks = (g + RC - 1) / RC, rows_pad = num_chunks * RC;
  auto kernel = PagedDecodeKernel<T, D, RC, C>;
  constexpr int base_smem = PagedDecodeSmemBytes<C, D, RC>();
  static const int occupancy =
      Occupancy(kernel, kDecThreads, base_smem + 1024, base_smem + kDecMaxTableEntries * 4);
  const SplitPlan plan = PlanSplits(a, bh * num_chunks, occupancy, SplitRule::kCudaCores);
  at::Tensor part;
  const PagedDecodeParams<T, C> pa = BaseParams<T, C>(a, rows_pad, num_chunks, plan, part);
  const int smem = base_smem + pa.table_len * 4;
  const dim3 grid(bh, plan.splits, num_chunks);
  C10_CUDA_CHECK(
      LaunchMaybePdl(kernel, grid, kDecThreads, smem, at::cuda::getCurrentCUDAStream(), pa));
}

// Tensor cores: the g <= 16 query heads of a KV head in one m16 tile; C: the cache's elements.
template <typename T, int D, bool kHigh, typename C = T>
void LaunchMma(const DecodeArgs& a) {
  const int64_t hkv = a.k_cache.size(2), g = a.q.size(1) / hkv, bh = a.q.size(0) * hkv;
  auto kernel = PagedDecodeMmaKernel<T, D, kHigh, C>;
  constexpr int base_smem = PagedDecodeMmaSmemBytes<T, D, C>();
  static const int occupancy =
      Occupancy(kernel, kDecMmaThreads, base_smem + 1024, base_smem + kDecMaxTableEntries * 4);
  const SplitPlan plan = PlanSplits(a, bh, occupancy, SplitRule::kTensorCores);
  at::Tensor part;
  const PagedDecodeParams<T, C> pa = BaseParams<T, C>(a, g, 1, plan, part);
  const int smem = base_smem + pa.table_len * 4;
  C10_CUDA_CHECK(LaunchMaybePdl(kernel, dim3(bh, plan.splits), kDecMmaThreads, smem,
                                at::cuda::getCurrentCUDAStream(), pa));
}

template <typename T, int D, typename C = T>
void DispatchRows(int64_t g, const DecodeArgs& a) {
  // (An e4m3 cache too: the tensor-core kernel converts its slabs to T in shared memory.)
  if constexpr (sizeof(T) == 2 && D <= 128) {
    return g > 8 ? LaunchMma<T, D, true, C>(a) : LaunchMma<T, D, false, C>(a);
  }
  // CUDA cores: rows per CTA = the group rounded up to a power of two, at most 8 (more: row
  // chunks in z).
  if (g == 1) return LaunchCudaCores<T, D, 1, C>(a);
  if (g == 2) return LaunchCudaCores<T, D, 2, C>(a);
  if (g <= 4) return LaunchCudaCores<T, D, 4, C>(a);
  return LaunchCudaCores<T, D, kDecMaxRows, C>(a);
}

template <typename T, typename C = T>
absl::Status DispatchHeadDim(int64_t d, int64_t g, const DecodeArgs& a) {
  switch (d) {
    case 64:
      DispatchRows<T, 64, C>(g, a);
      break;
    case 128:
      DispatchRows<T, 128, C>(g, a);
      break;
    case 256:
      DispatchRows<T, 256, C>(g, a);
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("PagedDecodeAttention on CUDA: head_dim must be 64, 128 or 256, got ", d));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<at::Tensor> PagedDecodeAttention(const at::Tensor& q_in, const at::Tensor& k_cache,
                                                const at::Tensor& v_cache,
                                                const at::Tensor& block_tables_in,
                                                const at::Tensor& seq_lens_in,
                                                const PagedAttentionParams& params) {
  // q's dtype; the cache holds it too, or e4m3 (kernels/kv_cache_fp8.h).
  const auto dtype = q_in.scalar_type();
  if (dtype != at::kFloat && dtype != at::kHalf && dtype != at::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PagedDecodeAttention on CUDA: dtype must be float32, float16 or bfloat16, got ",
        c10::toString(dtype)));
  }
  const bool fp8 = IsFp8Cache(k_cache);
  if (k_cache.scalar_type() != dtype && !fp8) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PagedDecodeAttention on CUDA: the cache must hold q's dtype or float8 e4m3, got ",
        c10::toString(k_cache.scalar_type()), " for q in ", c10::toString(dtype)));
  }
  if (fp8 && dtype == at::kFloat) {
    return absl::InvalidArgumentError(
        "PagedDecodeAttention on CUDA: a float8 e4m3 cache takes bf16 or fp16 queries, got fp32");
  }
  if (!k_cache.is_contiguous() || !v_cache.is_contiguous()) {
    return absl::InvalidArgumentError(
        "PagedDecodeAttention on CUDA: k_cache and v_cache must be contiguous");
  }
  const int64_t g = q_in.size(1) / k_cache.size(2), d = q_in.size(2);
  if (g > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("PagedDecodeAttention on CUDA: at most 16 query heads per KV head, got ", g));
  }
  return internal::CatchTorch("PagedDecodeAttention(cuda)", [&]() -> absl::StatusOr<at::Tensor> {
    c10::cuda::CUDAGuard guard(q_in.device());
    auto q = q_in.contiguous();
    auto block_tables = block_tables_in.contiguous();
    auto seq_lens = seq_lens_in.contiguous();
    auto out = at::empty_like(q);
    if (q.size(0) == 0) return out;
    const float scale =
        static_cast<float>(params.scale > 0 ? params.scale : 1.0 / std::sqrt(double(d)));
    // .contiguous() above may have copied them: that copy kernel precedes the launch.
    const bool uploaded =
        params.metadata_uploaded && block_tables_in.is_contiguous() && seq_lens_in.is_contiguous();
    const DecodeArgs args{q,
                          k_cache,
                          v_cache,
                          block_tables,
                          seq_lens,
                          scale,
                          params.num_splits,
                          params.max_seq_len,
                          uploaded,
                          params.older_keys_ready,
                          out};
    auto launch = [&](auto type_tag) {
      using T = decltype(type_tag);
      if constexpr (sizeof(T) == 2) {
        if (fp8) return DispatchHeadDim<T, __nv_fp8_e4m3>(d, g, args);
      }
      return DispatchHeadDim<T>(d, g, args);
    };
    const absl::Status st = dtype == at::kFloat  ? launch(float{})
                            : dtype == at::kHalf ? launch(__half{})
                                                 : launch(__nv_bfloat16{});
    if (!st.ok()) return st;
    return out;
  });
}

}  // namespace dropkv::kernels::cuda
