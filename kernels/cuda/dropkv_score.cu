// Launcher of the fused DropKV scoring (algorithms.md section 1, three passes) and the build
// marker of the CUDA kernels. Checks shapes, dtypes and devices, turns head_dim into a template
// constant (64 / 128 / 256 only), uses the current stream and the caching allocator for scratch.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/check.h"
#include "kernels/cuda/dropkv_score_kernels.cuh"
#include "kernels/cuda/dropkv_score_tc.cuh"
#include "kernels/cuda/dropkv_score_warp.cuh"
#include "kernels/cuda/launchers.h"

namespace dropkv::kernels::cuda {

bool Built() {
  return true;
}

namespace {

constexpr int kScoreRowChunk = 16;  // packed window rows per CTA chunk

// 16-byte vector loads need a contiguous last dim, other strides in whole vectors, an aligned base.
bool VectorAligned(const at::Tensor& t) {
  const int64_t vec = 16 / t.element_size();
  if (t.stride(-1) != 1 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int64_t i = 0; i + 1 < t.dim(); ++i) {
    if (t.stride(i) % vec != 0) return false;
  }
  return true;
}

// Pass 1 CTAs: about 8 per SM (4 resident x 2 waves: more loads in flight; 2 per SM
// and was latency-bound), at least 4 key tiles per split, at most 48 splits.
// ctas_per_sm: resident pass-1 CTAs per SM (tensor-core kernel: its occupancy, one wave, since
// each CTA keeps its next tile in flight; CUDA-core kernel: 8, two waves of 4).
int ChooseSplits(int64_t num_heads_total, int64_t num_row_chunks, int64_t max_n, int requested,
                 int key_tile, int ctas_per_sm) {
  // At most 48 splits: the partials (S x rows x (D + 2) floats per KV head) stay under 8 MB at
  // Llama-3.1-8B geometry (64 splits measured 8.25 MiB).
  const int64_t max_splits = std::max<int64_t>(1, std::min<int64_t>(48, max_n / (4 * key_tile)));
  if (requested > 0)
    return static_cast<int>(
        std::min<int64_t>({int64_t{requested}, int64_t{kMaxSplits},
                           std::max<int64_t>(1, (max_n + key_tile - 1) / key_tile)}));
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t want =
      std::max<int64_t>(1, int64_t{ctas_per_sm} * num_sms / (num_heads_total * num_row_chunks));
  return static_cast<int>(std::clamp<int64_t>(want, 1, max_splits));
}

// The window rows' attention from the caller (DropKvScoresFromAttention): fp32, contiguous,
// a [B*Hkv, g*W, D] and lse [B*Hkv, g*W] (views of [B, Hq, W, D] / [B, Hq, W]).
struct GivenAttention {
  const at::Tensor* a = nullptr;
  const at::Tensor* lse = nullptr;
};

// Split count of the warp-streaming pass 1: `requested` if set, else one wave of resident
// CTAs spread over the heads; at most one slab per warp and kMaxSplits.
template <typename T, int D>
int WarpPass1Splits(int64_t bh, int64_t max_n, int requested) {
  static const int occupancy = [] {
    if constexpr (sizeof(T) == 2 && D <= 128) {
      constexpr int smem = PartialAttnWarpSmemBytes<T, D>();
      for (auto kernel : {PartialAttnWarpKernel<T, D, 1>, PartialAttnWarpKernel<T, D, 2>}) {
        C10_CUDA_CHECK(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      }
      int blocks = 0;
      C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &blocks, PartialAttnWarpKernel<T, D, 2>, kScoreWarpThreads, smem));
      return std::max(1, blocks);
    }
    return 1;
  }();
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t num_slabs = (max_n + kSlabKeys - 1) / kSlabKeys;
  const int64_t want = requested > 0 ? int64_t{requested} : int64_t{occupancy} * num_sms / bh;
  return static_cast<int>(std::clamp<int64_t>(
      want, 1, std::min<int64_t>(kMaxSplits, (num_slabs + kScoreWarpWarps - 1) / kScoreWarpWarps)));
}

// Pass 3, warp-streaming: one wave of CTAs spread over the heads (rounded down: a first
// measurement rounded up, 400 CTAs for 396 slots, and the 4 of the second wave doubled the
// time), at most one slab per warp.
template <typename T, int D, int kMTiles>
void LaunchScoreWarp(const ScoreParams& sp, int64_t bh, int64_t max_n, int num_sms,
                     cudaStream_t stream) {
  auto kernel = ScoreWarpKernel<T, D, kMTiles>;
  constexpr int smem = ScoreWarpSmemBytes<T, D, kMTiles>();
  constexpr int kWarps = ScoreWarpCtaWarps<D, kMTiles>(), kThreadsCta = 32 * kWarps;
  static_assert(smem <= 227 * 1024, "pass 3 shared memory over the sm_90 per-CTA limit");
  static const int occupancy = [&] {
    // The attribute first: occupancy of more than 48 KB of dynamic shared memory needs it.
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int blocks = 0;
    C10_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreadsCta, smem));
    return std::max(1, blocks);
  }();
  const int64_t num_slabs = (max_n + kSlabKeys - 1) / kSlabKeys;
  const int64_t ctas_per_head =
      std::clamp<int64_t>(int64_t{occupancy} * num_sms / bh, 1, (num_slabs + kWarps - 1) / kWarps);
  kernel<<<dim3(bh, ctas_per_head), kThreadsCta, smem, stream>>>(sp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Pass 3 on tensor cores: the warp-streaming kernel for up to kScoreWarpMaxRows packed rows per
// KV head, the CTA-tiled one above that.
template <typename T, int D>
void LaunchScoreTc(const ScoreParams& sp, int64_t bh, int64_t max_n, cudaStream_t stream) {
  const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  if (sp.rows_pad <= kScoreWarpMaxRows) {
    switch (ScoreWarpMTiles(sp.rows_pad)) {
      case 1:
        return LaunchScoreWarp<T, D, 1>(sp, bh, max_n, num_sms, stream);
      case 2:
        return LaunchScoreWarp<T, D, 2>(sp, bh, max_n, num_sms, stream);
      default:
        return LaunchScoreWarp<T, D, 4>(sp, bh, max_n, num_sms, stream);
    }
  }
  auto kernel = ScoreTcKernel<T, D>;
  constexpr int smem = ScoreTcSmemBytes<T, D>();
  static const cudaError_t attr =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  C10_CUDA_CHECK(attr);
  // Persistent: as many CTAs as fit at once, spread over the heads.
  static const int occupancy = [&] {
    int blocks = 0;
    const cudaError_t st =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kScoreTcThreads, smem);
    return st == cudaSuccess ? std::max(1, blocks) : 1;
  }();
  const int64_t num_tiles = (max_n + kTcKeys - 1) / kTcKeys;
  const int64_t ctas_per_head =
      std::clamp<int64_t>((int64_t{occupancy} * num_sms + bh - 1) / bh, 1, num_tiles);
  kernel<<<dim3(bh, ctas_per_head), kScoreTcThreads, smem, stream>>>(sp);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int D>
absl::Status Launch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& kv_offset, const at::Tensor& seq_lens,
                    const at::Tensor& out_offset, int64_t out_stride_head, int64_t max_n,
                    int64_t stride_tok, int64_t stride_head, at::Tensor& out,
                    const DropKvParams& params, const GivenAttention& given) {
  const int64_t batch = q.size(0), hq = q.size(1), w = q.size(2);
  const int64_t hkv = k.size(1);  // dense [B, Hkv, n, D] and varlen [total, Hkv, D] alike
  const int64_t g = hq / hkv, rows = g * w;
  constexpr int RC = kScoreRowChunk;
  const int64_t rows_pad = (rows + RC - 1) / RC * RC;
  const int64_t num_chunks = rows_pad / RC;
  const int64_t bh = batch * hkv;
  // bf16 / fp16 go to the tensor-core kernels (64-key tiles) unless asked not to.
  constexpr bool kHalfType = !std::is_same_v<T, float>;
  const bool tc = kHalfType && params.use_tensor_cores;
  const int key_tile = tc ? kTcKeys : kKeyTile;
  int ctas_per_sm = 8;
  if constexpr (kHalfType) {
    if (tc) {
      static const int occupancy = [] {
        int blocks = 0;
        // The attribute first: occupancy of more than 48 KB of dynamic shared memory needs it.
        cudaFuncSetAttribute(PartialAttnTcKernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             PartialAttnTcSmemBytes<T, D>());
        const cudaError_t st = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &blocks, PartialAttnTcKernel<T, D>, kAttnTcThreads, PartialAttnTcSmemBytes<T, D>());
        return st == cudaSuccess ? std::max(1, blocks) : 1;
      }();
      ctas_per_sm = occupancy;
    }
  }
  // The tensor-core pass 1 takes kAttnTcChunks row chunks per CTA.
  const int64_t chunk_ctas = tc ? (num_chunks + kAttnTcChunks - 1) / kAttnTcChunks : num_chunks;
  const float scale =
      static_cast<float>(params.scale > 0 ? params.scale : 1.0 / std::sqrt(double(D)));
  auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor a, lse;  // [B*Hkv, a_rows, D], [B*Hkv, a_rows]
  int64_t a_rows = rows_pad;
  if (given.a != nullptr) {
    a = *given.a;
    lse = *given.lse;
    a_rows = rows;
  } else {
    // Warp-streaming pass 1 when every row's accumulator fits in registers; one split per
    // CTA of 4 warps, one wave of resident CTAs over the heads.
    const bool warp_pass1 = kHalfType && tc && D <= 128 && rows_pad <= kAttnWarpMaxRows;
    const int splits =
        warp_pass1 ? WarpPass1Splits<T, D>(bh, max_n, params.num_splits)
                   : ChooseSplits(bh, chunk_ctas, max_n, params.num_splits, key_tile, ctas_per_sm);
    const int64_t split_len = ((max_n + splits - 1) / splits + key_tile - 1) / key_tile * key_tile;
    auto f32 = q.options().dtype(at::kFloat);
    // Scratch: partials (S x rows x (D + 2)) + merged a and lse: O(n) through S only.
    auto part_acc = at::empty({bh, splits, rows_pad, D}, f32);
    auto part_ml = at::empty({2, bh, splits, rows_pad}, f32);
    a = at::empty({bh, rows_pad, D}, f32);
    lse = at::empty({bh, rows_pad}, f32);

    PartialAttnParams<T> pa{};
    pa.q = reinterpret_cast<const T*>(q.data_ptr());
    pa.k = reinterpret_cast<const T*>(k.data_ptr());
    pa.v = reinterpret_cast<const T*>(v.data_ptr());
    pa.kv_offset = kv_offset.data_ptr<int64_t>();
    pa.seq_lens = seq_lens.data_ptr<int32_t>();
    pa.stride_tok = stride_tok;
    pa.stride_head = stride_head;
    pa.num_kv_heads = static_cast<int32_t>(hkv);
    pa.window = static_cast<int32_t>(w);
    pa.num_rows = static_cast<int32_t>(rows);
    pa.rows_pad = static_cast<int32_t>(rows_pad);
    pa.min_pos = 1;
    pa.num_splits = splits;
    pa.split_len = static_cast<int32_t>(split_len);
    pa.scale = scale;
    pa.part_m = part_ml[0].data_ptr<float>();
    pa.part_l = part_ml[1].data_ptr<float>();
    pa.part_acc = part_acc.data_ptr<float>();
    if constexpr (kHalfType && D <= 128) {
      if (warp_pass1) {
        auto kernel =
            rows_pad <= 16 ? PartialAttnWarpKernel<T, D, 1> : PartialAttnWarpKernel<T, D, 2>;
        constexpr int smem = PartialAttnWarpSmemBytes<T, D>();
        kernel<<<dim3(splits, bh), kScoreWarpThreads, smem, stream>>>(pa);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    }
    if constexpr (kHalfType) {
      if (tc && !warp_pass1) {
        static_assert(RC == kTcRows, "tensor-core kernels use 16-row chunks");
        auto kernel = PartialAttnTcKernel<T, D>;
        constexpr int smem = PartialAttnTcSmemBytes<T, D>();
        static const cudaError_t attr =
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        C10_CUDA_CHECK(attr);
        kernel<<<dim3(chunk_ctas, splits, bh), kAttnTcThreads, smem, stream>>>(pa);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    }
    if (!tc) {
      auto kernel = PartialAttnKernel<T, D, RC, false>;
      constexpr int smem = PartialAttnSmemFloats<D, RC>() * sizeof(float);
      static const cudaError_t attr =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      C10_CUDA_CHECK(attr);
      kernel<<<dim3(bh, splits, num_chunks), kThreads, smem, stream>>>(pa);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    MergeKernel<float, D><<<dim3(bh, rows_pad), D, 0, stream>>>(
        pa.part_m, pa.part_l, pa.part_acc, pa.num_splits, static_cast<int>(rows_pad),
        static_cast<int>(rows_pad), a.data_ptr<float>(), lse.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  ScoreParams sp{};
  sp.q = q.data_ptr();
  sp.k = k.data_ptr();
  sp.v = v.data_ptr();
  sp.kv_offset = kv_offset.data_ptr<int64_t>();
  sp.seq_lens = seq_lens.data_ptr<int32_t>();
  sp.a = a.data_ptr<float>();
  sp.lse = lse.data_ptr<float>();
  sp.out = out.data_ptr<float>();
  sp.out_offset = out_offset.data_ptr<int64_t>();
  sp.out_stride_head = out_stride_head;
  sp.stride_tok = stride_tok;
  sp.stride_head = stride_head;
  sp.num_kv_heads = static_cast<int32_t>(hkv);
  sp.group = static_cast<int32_t>(g);
  sp.window = static_cast<int32_t>(w);
  sp.num_rows = static_cast<int32_t>(rows);
  sp.rows_pad = static_cast<int32_t>(rows_pad);
  sp.min_pos = 1;
  sp.a_rows = static_cast<int32_t>(a_rows);
  sp.scale = scale;
  sp.eps = static_cast<float>(params.eps);
  sp.round_mode = !params.p_round_dtype                    ? 0
                  : *params.p_round_dtype == at::kBFloat16 ? 1
                  : *params.p_round_dtype == at::kHalf     ? 2
                                                           : 0;
  if constexpr (kHalfType) {
    if (tc) LaunchScoreTc<T, D>(sp, bh, max_n, stream);
  }
  if (!tc) {
    auto kernel = ScoreKernel<T, D, RC>;
    constexpr int smem = ScoreSmemFloats<D, RC>() * sizeof(float);
    static const cudaError_t attr =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    C10_CUDA_CHECK(attr);
    kernel<<<dim3(bh, (max_n + kKeyTile - 1) / kKeyTile), kThreads, smem, stream>>>(sp);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return absl::OkStatus();
}

template <typename T, typename... Args>
absl::Status DispatchHeadDim(int64_t d, Args&&... args) {
  switch (d) {
    case 64:
      return Launch<T, 64>(args...);
    case 128:
      return Launch<T, 128>(args...);
    case 256:
      return Launch<T, 256>(args...);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("DropKvScores on CUDA: head_dim must be 64, 128 or 256, got ", d));
  }
}

// DropKvScores, or its pass 3 alone when `given` holds the window rows' attention.
absl::StatusOr<at::Tensor> Scores(const at::Tensor& q_window, const at::Tensor& k_in,
                                  const at::Tensor& v_in,
                                  const std::optional<at::Tensor>& cu_seqlens,
                                  const DropKvParams& params, const GivenAttention& given) {
  const auto dtype = k_in.scalar_type();
  if (dtype != at::kFloat && dtype != at::kHalf && dtype != at::kBFloat16) {
    return absl::InvalidArgumentError(
        absl::StrCat("DropKvScores on CUDA: dtype must be float32, float16 or bfloat16, got ",
                     c10::toString(dtype)));
  }
  if (q_window.scalar_type() != dtype || v_in.scalar_type() != dtype) {
    return absl::InvalidArgumentError("DropKvScores on CUDA: q_window, k, v must share a dtype");
  }
  const int64_t w = q_window.size(2), d = q_window.size(3);
  if (w < 1 || w > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("DropKvScores on CUDA: window must be in [1, 64], got ", w));
  }
  if (params.p_round_dtype && *params.p_round_dtype != at::kBFloat16 &&
      *params.p_round_dtype != at::kHalf) {
    return absl::InvalidArgumentError("DropKvScores on CUDA: p_round_dtype must be bf16 or fp16");
  }
  return internal::CatchTorch("DropKvScores(cuda)", [&]() -> absl::StatusOr<at::Tensor> {
    c10::cuda::CUDAGuard guard(k_in.device());
    // 16-byte vector loads need contiguous head_dim and aligned rows.
    auto k = VectorAligned(k_in) ? k_in : k_in.contiguous();
    auto v = VectorAligned(v_in) && v_in.strides() == k.strides() ? v_in : v_in.contiguous();
    if (v.strides() != k.strides()) k = k.contiguous();
    auto q = q_window.contiguous();
    const int64_t batch = q.size(0);
    std::vector<int64_t> kv_off(batch), out_off(batch);
    std::vector<int32_t> lens(batch);
    int64_t stride_tok, stride_head, out_stride_head, max_n = 0;
    at::Tensor out;
    if (!cu_seqlens) {  // dense [B, Hkv, n, D]
      const int64_t n = k.size(2);
      for (int64_t b = 0; b < batch; ++b) {
        kv_off[b] = b * k.stride(0);
        out_off[b] = b * k.size(1) * n;
        lens[b] = static_cast<int32_t>(n);
      }
      stride_tok = k.stride(2);
      stride_head = k.stride(1);
      out_stride_head = n;
      max_n = n;
      out = at::empty({batch, k.size(1), n}, k.options().dtype(at::kFloat));
    } else {  // varlen [total_n, Hkv, D]
      const int64_t* cu = cu_seqlens->data_ptr<int64_t>();
      for (int64_t b = 0; b < batch; ++b) {
        kv_off[b] = cu[b] * k.stride(0);
        out_off[b] = cu[b];
        lens[b] = static_cast<int32_t>(cu[b + 1] - cu[b]);
        max_n = std::max<int64_t>(max_n, lens[b]);
      }
      stride_tok = k.stride(0);
      stride_head = k.stride(1);
      out_stride_head = k.size(0);
      out = at::zeros({k.size(1), k.size(0)}, k.options().dtype(at::kFloat));
    }
    if (max_n >= (int64_t{1} << 31) / 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("DropKvScores on CUDA: n = ", max_n, " too large"));
    }
    if (max_n == 0 || batch == 0) return out.zero_();
    if (batch * k.size(1) > 65535) {  // pass 1's grid z
      return absl::InvalidArgumentError(absl::StrCat(
          "DropKvScores on CUDA: batch x kv_heads must be <= 65535, got ", batch * k.size(1)));
    }
    auto dev = at::TensorOptions().device(k.device());
    // One pinned host buffer and one async copy for the per-sequence descriptors.
    auto host = at::empty({3 * batch}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    int64_t* h = host.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      h[b] = kv_off[b];
      h[batch + b] = out_off[b];
      h[2 * batch + b] = lens[b];
    }
    auto dev_buf = host.to(dev.dtype(at::kLong), /*non_blocking=*/true);
    auto kv_off_t = dev_buf.slice(0, 0, batch);
    auto out_off_t = dev_buf.slice(0, batch, 2 * batch);
    auto lens_t = dev_buf.slice(0, 2 * batch, 3 * batch).to(at::kInt);
    auto launch = [&](auto type_tag) {
      using T = decltype(type_tag);
      return DispatchHeadDim<T>(d, q, k, v, kv_off_t, lens_t, out_off_t, out_stride_head, max_n,
                                stride_tok, stride_head, out, params, given);
    };
    const absl::Status st = dtype == at::kFloat  ? launch(float{})
                            : dtype == at::kHalf ? launch(__half{})
                                                 : launch(__nv_bfloat16{});
    if (!st.ok()) return st;
    return out;
  });
}

}  // namespace

absl::StatusOr<at::Tensor> DropKvScores(const at::Tensor& q_window, const at::Tensor& k,
                                        const at::Tensor& v,
                                        const std::optional<at::Tensor>& cu_seqlens,
                                        const DropKvParams& params) {
  return Scores(q_window, k, v, cu_seqlens, params, GivenAttention{});
}

absl::StatusOr<at::Tensor> DropKvScoresFromAttention(const at::Tensor& q_window,
                                                     const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& attn_out,
                                                     const at::Tensor& lse,
                                                     const DropKvParams& params) {
  if (!attn_out.is_cuda() || !lse.is_cuda() || attn_out.device() != k.device() ||
      lse.device() != k.device()) {
    return absl::InvalidArgumentError(
        "DropKvScoresFromAttention on CUDA: attn_out and lse must be on k's device");
  }
  return internal::CatchTorch(
      "DropKvScoresFromAttention(cuda)", [&]() -> absl::StatusOr<at::Tensor> {
        c10::cuda::CUDAGuard guard(k.device());
        // [B, Hq, W, D] -> [B*Hkv, g*W, D]: query head h*g + i, window row w is packed row i*W + w.
        const int64_t bh = k.size(0) * k.size(1);
        auto a = attn_out.to(at::kFloat).contiguous().view({bh, -1, attn_out.size(3)});
        auto l = lse.to(at::kFloat).contiguous().view({bh, -1});
        return Scores(q_window, k, v, std::nullopt, params, GivenAttention{&a, &l});
      });
}

}  // namespace dropkv::kernels::cuda
