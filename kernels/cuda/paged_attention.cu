// Paged decode attention on CUDA: PagedDecodeKernel (paged_decode_kernels.cuh: split-K, the g
// query heads of a KV head as the rows of one CTA, cp.async-pipelined K/V), then the LSE merge
// (attention_common.cuh) straight into the output. One launch each for the whole batch.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/check.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/launchers.h"
#include "kernels/cuda/paged_decode_kernels.cuh"

namespace dropkv::kernels::cuda {
namespace {

template <typename T, int D, int RC>
void Launch(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, float scale,
            int requested_splits, int64_t max_len_hint, at::Tensor& out) {
  const int64_t batch = q.size(0), hq = q.size(1);
  const int64_t block_size = k_cache.size(1), hkv = k_cache.size(2);
  const int64_t g = hq / hkv, bh = batch * hkv;
  const int64_t num_chunks = (g + RC - 1) / RC, rows_pad = num_chunks * RC;
  const int64_t max_blocks = block_tables.size(1);
  // Upper bound of the lengths without a device sync; CTAs past a sequence's end exit early.
  // The grid depends only on the shapes and the hint: the same on every CUDA-graph replay.
  const int64_t capacity = max_blocks * block_size;
  const int64_t max_len =
      std::max<int64_t>(1, max_len_hint > 0 ? std::min(max_len_hint, capacity) : capacity);
  constexpr int64_t kMinSplitKeys = 64;  // below this the per-CTA prologue and merge dominate
  int64_t splits = requested_splits;
  auto kernel = PagedDecodeKernel<T, D, RC>;
  constexpr int base_smem = PagedDecodeSmemBytes<T, D, RC>();
  constexpr int max_smem = base_smem + kDecMaxTableEntries * 4;
  // Once per instantiation (host calls on every decode step cost time): the shared-memory limit
  // and how many CTAs fit on an SM at once.
  static const int occupancy = [&] {
    C10_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem));
    int blocks = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kDecThreads,
                                                                 base_smem + 1024));
    return std::max(1, blocks);
  }();
  if (splits <= 0) {
    // About 2 CTAs per SM: 4 (all resident slots, v6) measured slower at 8K x 32 layers (0.86
    // vs 0.79 ms: twice the partials to merge, no faster partial kernel).
    const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    splits = (int64_t{std::min(occupancy, 2)} * num_sms + bh * num_chunks - 1) / (bh * num_chunks);
    splits = std::min<int64_t>(splits, (max_len + kMinSplitKeys - 1) / kMinSplitKeys);
  }
  splits = std::clamp<int64_t>(splits, 1, std::min<int64_t>(kMaxSplits, max_len));
  const int64_t split_len = ((max_len + splits - 1) / splits + 15) / 16 * 16;
  const int64_t table_len = (split_len + block_size - 1) / block_size + 1;
  auto f32 = q.options().dtype(at::kFloat);
  auto part_acc = at::empty({bh, splits, rows_pad, D}, f32);
  auto part_ml = at::empty({2, bh, splits, rows_pad}, f32);
  auto stream = at::cuda::getCurrentCUDAStream();

  PagedDecodeParams<T> pa{};
  pa.q = reinterpret_cast<const T*>(q.data_ptr());
  pa.k = reinterpret_cast<const T*>(k_cache.data_ptr());
  pa.v = reinterpret_cast<const T*>(v_cache.data_ptr());
  pa.block_tables = block_tables.data_ptr<int32_t>();
  pa.seq_lens = seq_lens.data_ptr<int32_t>();
  pa.stride_slot = hkv * D;
  pa.max_blocks = static_cast<int32_t>(max_blocks);
  pa.block_size = static_cast<int32_t>(block_size);
  pa.block_shift = (block_size & (block_size - 1)) == 0
                       ? static_cast<int32_t>(__builtin_ctzll(static_cast<uint64_t>(block_size)))
                       : -1;
  pa.num_kv_heads = static_cast<int32_t>(hkv);
  pa.group = static_cast<int32_t>(g);
  pa.rows_pad = static_cast<int32_t>(rows_pad);
  pa.num_splits = static_cast<int32_t>(splits);
  pa.split_len = static_cast<int32_t>(split_len);
  pa.table_len = table_len <= kDecMaxTableEntries ? static_cast<int32_t>(table_len) : 0;
  pa.scale_log2 = scale * 1.4426950408889634f;
  pa.part_m = part_ml[0].data_ptr<float>();
  pa.part_l = part_ml[1].data_ptr<float>();
  pa.part_acc = part_acc.data_ptr<float>();
  const int smem = base_smem + pa.table_len * 4;
  kernel<<<dim3(bh, splits, num_chunks), kDecThreads, smem, stream>>>(pa);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  MergeKernel<T, D><<<dim3(bh, rows_pad), D, 0, stream>>>(
      pa.part_m, pa.part_l, pa.part_acc, static_cast<int>(splits), static_cast<int>(rows_pad),
      static_cast<int>(g), reinterpret_cast<T*>(out.data_ptr()), nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int D>
void DispatchRows(int64_t g, const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                  const at::Tensor& bt, const at::Tensor& sl, float scale, int splits,
                  int64_t max_len, at::Tensor& out) {
  // Rows per CTA: the group rounded up to a power of two, at most 8 (more: row chunks in z).
  if (g == 1) return Launch<T, D, 1>(q, kc, vc, bt, sl, scale, splits, max_len, out);
  if (g == 2) return Launch<T, D, 2>(q, kc, vc, bt, sl, scale, splits, max_len, out);
  if (g <= 4) return Launch<T, D, 4>(q, kc, vc, bt, sl, scale, splits, max_len, out);
  return Launch<T, D, kDecMaxRows>(q, kc, vc, bt, sl, scale, splits, max_len, out);
}

template <typename T>
absl::Status DispatchHeadDim(int64_t d, int64_t g, const at::Tensor& q, const at::Tensor& kc,
                             const at::Tensor& vc, const at::Tensor& bt, const at::Tensor& sl,
                             float scale, int splits, int64_t max_len, at::Tensor& out) {
  switch (d) {
    case 64:
      DispatchRows<T, 64>(g, q, kc, vc, bt, sl, scale, splits, max_len, out);
      break;
    case 128:
      DispatchRows<T, 128>(g, q, kc, vc, bt, sl, scale, splits, max_len, out);
      break;
    case 256:
      DispatchRows<T, 256>(g, q, kc, vc, bt, sl, scale, splits, max_len, out);
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
  const auto dtype = k_cache.scalar_type();
  if (dtype != at::kFloat && dtype != at::kHalf && dtype != at::kBFloat16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PagedDecodeAttention on CUDA: dtype must be float32, float16 or bfloat16, got ",
        c10::toString(dtype)));
  }
  if (q_in.scalar_type() != dtype) {
    return absl::InvalidArgumentError(
        "PagedDecodeAttention on CUDA: q and the cache must share a dtype");
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
    auto launch = [&](auto type_tag) {
      using T = decltype(type_tag);
      return DispatchHeadDim<T>(d, g, q, k_cache, v_cache, block_tables, seq_lens, scale,
                                params.num_splits, params.max_seq_len, out);
    };
    const absl::Status st = dtype == at::kFloat  ? launch(float{})
                            : dtype == at::kHalf ? launch(__half{})
                                                 : launch(__nv_bfloat16{});
    if (!st.ok()) return st;
    return out;
  });
}

}  // namespace dropkv::kernels::cuda
