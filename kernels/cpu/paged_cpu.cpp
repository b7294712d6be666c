// CPU reference of the paged KV cache ops (cache_ops.h) and paged decode attention
// (paged_attention.h), plus device dispatch to the CUDA kernels and the CPU decode kernel.
#include <ATen/ATen.h>

#include <cmath>

#include "kernels/cache_ops.h"
#include "kernels/check.h"
#include "kernels/cpu/paged_attention_cpu.h"
#include "kernels/cuda/launchers.h"
#include "kernels/kv_cache_fp8.h"
#include "kernels/paged_attention.h"

namespace dropkv::kernels {
namespace {

using internal::CatchTorch;
using internal::CheckDim;
using internal::CheckSize;

absl::Status CheckCache(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  if (auto s = CheckDim(k_cache, "k_cache", 4, "[num_blocks, block_size, Hkv, D]"); !s.ok()) {
    return s;
  }
  if (!v_cache.defined() || v_cache.sizes() != k_cache.sizes() ||
      v_cache.scalar_type() != k_cache.scalar_type() || v_cache.device() != k_cache.device()) {
    return absl::InvalidArgumentError("v_cache: must match k_cache in shape, dtype and device");
  }
  return absl::OkStatus();
}

absl::Status CheckSlots(const at::Tensor& slot_mapping, int64_t want_len, int64_t num_slots) {
  if (auto s = CheckDim(slot_mapping, "slot_mapping", 1, "[T]"); !s.ok()) return s;
  if (auto s = CheckSize(slot_mapping, "slot_mapping", 0, want_len, "tokens"); !s.ok()) return s;
  if (slot_mapping.scalar_type() != at::kLong) {
    return absl::InvalidArgumentError("slot_mapping: must be int64");
  }
  if (!slot_mapping.is_cuda() && slot_mapping.numel() > 0 &&
      slot_mapping.max().item<int64_t>() >= num_slots) {
    return absl::InvalidArgumentError(absl::StrCat("slot_mapping: slot ",
                                                   slot_mapping.max().item<int64_t>(),
                                                   " out of range (", num_slots, " slots)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteKv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k_new,
                     const at::Tensor& v_new, const at::Tensor& slot_mapping) {
  if (auto s = CheckCache(k_cache, v_cache); !s.ok()) return s;
  if (auto s = CheckDim(k_new, "k_new", 3, "[T, Hkv, D]"); !s.ok()) return s;
  if (v_new.sizes() != k_new.sizes()) {
    return absl::InvalidArgumentError("v_new: must have k_new's shape");
  }
  if (k_new.size(1) != k_cache.size(2) || k_new.size(2) != k_cache.size(3)) {
    return absl::InvalidArgumentError(
        absl::StrCat("k_new: [T, Hkv, D] = ", internal::ShapeStr(k_new),
                     " does not match the cache ", internal::ShapeStr(k_cache)));
  }
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  if (auto s = CheckSlots(slot_mapping, k_new.size(0), num_slots); !s.ok()) return s;
  if (k_new.device() != k_cache.device() || v_new.device() != k_cache.device() ||
      slot_mapping.device() != k_cache.device()) {
    return absl::InvalidArgumentError(
        "WriteKv: k_new, v_new, slot_mapping must be on the cache's device");
  }
  if (k_cache.is_cuda()) return cuda::WriteKv(k_cache, v_cache, k_new, v_new, slot_mapping);
  return CatchTorch("WriteKv", [&]() -> absl::Status {
    auto valid = (slot_mapping >= 0).nonzero().squeeze(1);  // [T']
    auto slots = slot_mapping.index_select(0, valid);
    auto kf = k_cache.view({num_slots, k_cache.size(2), k_cache.size(3)});
    auto vf = v_cache.view({num_slots, v_cache.size(2), v_cache.size(3)});
    ScatterRows(kf, slots, ToCacheDtype(k_new.index_select(0, valid), k_cache));
    ScatterRows(vf, slots, ToCacheDtype(v_new.index_select(0, valid), v_cache));
    return absl::OkStatus();
  });
}

absl::Status WriteKeptKv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& kept_idx,
                         const at::Tensor& slot_mapping) {
  if (auto s = CheckCache(k_cache, v_cache); !s.ok()) return s;
  if (auto s = CheckDim(k, "k", 3, "[Hkv, n, D]"); !s.ok()) return s;
  if (v.sizes() != k.sizes()) return absl::InvalidArgumentError("v: must have k's shape");
  if (auto s = CheckDim(kept_idx, "kept_idx", 2, "[Hkv, k]"); !s.ok()) return s;
  if (kept_idx.scalar_type() != at::kLong) {
    return absl::InvalidArgumentError("kept_idx: must be int64");
  }
  if (auto s = CheckSize(kept_idx, "kept_idx", 0, k.size(0), "Hkv"); !s.ok()) return s;
  if (k.size(0) != k_cache.size(2) || k.size(2) != k_cache.size(3)) {
    return absl::InvalidArgumentError(absl::StrCat("k: [Hkv, n, D] = ", internal::ShapeStr(k),
                                                   " does not match the cache ",
                                                   internal::ShapeStr(k_cache)));
  }
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  if (auto s = CheckSlots(slot_mapping, kept_idx.size(1), num_slots); !s.ok()) return s;
  if (k.device() != k_cache.device() || v.device() != k_cache.device() ||
      kept_idx.device() != k_cache.device() || slot_mapping.device() != k_cache.device()) {
    return absl::InvalidArgumentError(
        "WriteKeptKv: k, v, kept_idx, slot_mapping must be on the cache's device");
  }
  if (!kept_idx.is_cuda() && kept_idx.numel() > 0 &&
      (kept_idx.min().item<int64_t>() < 0 || kept_idx.max().item<int64_t>() >= k.size(1))) {
    return absl::InvalidArgumentError(
        absl::StrCat("kept_idx: values must be in [0, ", k.size(1), ")"));
  }
  if (k_cache.is_cuda()) {
    return cuda::WriteKeptKv(k_cache, v_cache, k, v, kept_idx, slot_mapping);
  }
  return CatchTorch("WriteKeptKv", [&]() -> absl::Status {
    const int64_t hkv = k.size(0), d = k.size(2);
    auto idx = kept_idx.unsqueeze(-1).expand({hkv, kept_idx.size(1), d});
    auto k_kept = at::gather(k, 1, idx).transpose(0, 1);  // [k, Hkv, D]
    auto v_kept = at::gather(v, 1, idx).transpose(0, 1);
    auto kf = k_cache.view({num_slots, hkv, d});
    auto vf = v_cache.view({num_slots, hkv, d});
    ScatterRows(kf, slot_mapping, ToCacheDtype(k_kept, k_cache));
    ScatterRows(vf, slot_mapping, ToCacheDtype(v_kept, v_cache));
    return absl::OkStatus();
  });
}

namespace {

// The checks both entry points share (shapes, dtypes, devices, params), and on the CPU every
// length and block id (the CUDA launcher trusts the allocator's tables: no device sync).
absl::Status CheckPagedDecode(const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, const PagedAttentionParams& params) {
  if (auto s = CheckDim(q, "q", 3, "[B, Hq, D]"); !s.ok()) return s;
  if (auto s = CheckCache(k_cache, v_cache); !s.ok()) return s;
  if (auto s = CheckDim(block_tables, "block_tables", 2, "[B, max_blocks]"); !s.ok()) return s;
  if (auto s = CheckDim(seq_lens, "seq_lens", 1, "[B]"); !s.ok()) return s;
  if (block_tables.scalar_type() != at::kInt || seq_lens.scalar_type() != at::kInt) {
    return absl::InvalidArgumentError("block_tables and seq_lens: must be int32");
  }
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), hkv = k_cache.size(2);
  if (auto s = CheckSize(block_tables, "block_tables", 0, b, "batch"); !s.ok()) return s;
  if (auto s = CheckSize(seq_lens, "seq_lens", 0, b, "batch"); !s.ok()) return s;
  if (auto s = CheckSize(k_cache, "k_cache", 3, d, "head_dim"); !s.ok()) return s;
  if (hkv == 0 || hq % hkv != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num query heads ", hq, " is not a multiple of num kv heads ", hkv));
  }
  if (q.device() != k_cache.device() || block_tables.device() != q.device() ||
      seq_lens.device() != q.device()) {
    return absl::InvalidArgumentError("q, caches, block_tables, seq_lens: on different devices");
  }
  if (!(params.scale >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("scale must be >= 0, got ", params.scale));
  }
  if (!(params.softcap >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("softcap must be >= 0, got ", params.softcap));
  }
  if (params.max_seq_len < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_seq_len must be >= 0, got ", params.max_seq_len));
  }
  if (q.is_cuda()) return absl::OkStatus();
  auto lens = seq_lens.contiguous();
  auto tables = block_tables.contiguous();
  const int64_t max_blocks = tables.size(1), num_blocks = k_cache.size(0);
  for (int64_t i = 0; i < b; ++i) {
    const int64_t len = lens.data_ptr<int32_t>()[i];
    if (len < 0 || len > max_blocks * block_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("seq_lens[", i, "] = ", len, " outside [0, ", max_blocks * block_size, "]"));
    }
    for (int64_t blk = 0; blk < (len + block_size - 1) / block_size; ++blk) {
      const int32_t id = tables.data_ptr<int32_t>()[i * max_blocks + blk];
      if (id < 0 || id >= num_blocks) {
        return absl::InvalidArgumentError(absl::StrCat("block_tables[", i, ", ", blk, "] = ", id,
                                                       " outside [0, ", num_blocks, ")"));
      }
    }
  }
  return absl::OkStatus();
}

// An FP8 cache for the CPU kernel: the blocks the tables name, dequantized to q's dtype
// ([used_blocks, block_size, Hkv, D] each), and the tables renumbered into them. One pass over the
// batch's blocks per call (the kernel itself reads bf16 / fp16 / fp32).
struct DequantizedBlocks {
  at::Tensor k, v, tables;
};
DequantizedBlocks DequantizeUsedBlocks(const at::Tensor& q, const at::Tensor& k_cache,
                                       const at::Tensor& v_cache, const at::Tensor& block_tables) {
  auto [ids, inverse, counts] =
      at::_unique2(block_tables, /*sorted=*/true, /*return_inverse=*/true);
  (void)counts;
  const auto ids64 = ids.to(at::kLong);
  return {GatherRows(k_cache, ids64, q.scalar_type()), GatherRows(v_cache, ids64, q.scalar_type()),
          inverse.to(at::kInt)};
}

double ScaleOf(const at::Tensor& q, const PagedAttentionParams& params) {
  return params.scale > 0 ? params.scale : 1.0 / std::sqrt(static_cast<double>(q.size(2)));
}

}  // namespace

absl::StatusOr<at::Tensor> PagedDecodeAttention(const at::Tensor& q, const at::Tensor& k_cache,
                                                const at::Tensor& v_cache,
                                                const at::Tensor& block_tables,
                                                const at::Tensor& seq_lens,
                                                const PagedAttentionParams& params) {
  if (auto s = CheckPagedDecode(q, k_cache, v_cache, block_tables, seq_lens, params); !s.ok()) {
    return s;
  }
  if (q.is_cuda()) {
    if (params.softcap > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("softcap ", params.softcap, ": the CUDA kernel does not cap logits"));
    }
    return cuda::PagedDecodeAttention(q, k_cache, v_cache, block_tables, seq_lens, params);
  }
  if (IsFp8Cache(k_cache)) {
    return CatchTorch("PagedDecodeAttention(fp8)", [&]() -> absl::StatusOr<at::Tensor> {
      const DequantizedBlocks d = DequantizeUsedBlocks(q, k_cache, v_cache, block_tables);
      return cpu::PagedDecodeAttention(q, d.k, d.v, d.tables, seq_lens, ScaleOf(q, params),
                                       params.softcap);
    });
  }
  if (!cpu::PagedDecodeKernelApplies(k_cache, v_cache)) {
    return PagedDecodeAttentionReference(q, k_cache, v_cache, block_tables, seq_lens, params);
  }
  return CatchTorch("PagedDecodeAttention", [&]() -> absl::StatusOr<at::Tensor> {
    return cpu::PagedDecodeAttention(q, k_cache, v_cache, block_tables, seq_lens,
                                     ScaleOf(q, params), params.softcap);
  });
}

absl::StatusOr<at::Tensor> PagedDecodeAttentionReference(const at::Tensor& q,
                                                         const at::Tensor& k_cache,
                                                         const at::Tensor& v_cache,
                                                         const at::Tensor& block_tables,
                                                         const at::Tensor& seq_lens,
                                                         const PagedAttentionParams& params) {
  if (auto s = CheckPagedDecode(q, k_cache, v_cache, block_tables, seq_lens, params); !s.ok()) {
    return s;
  }
  if (!q.is_cpu()) {
    return absl::InvalidArgumentError("PagedDecodeAttentionReference: CPU tensors only");
  }
  return CatchTorch("PagedDecodeAttentionReference", [&]() -> absl::StatusOr<at::Tensor> {
    const int64_t b = q.size(0), hq = q.size(1), d = q.size(2);
    const int64_t block_size = k_cache.size(1), hkv = k_cache.size(2);
    auto lens = seq_lens.contiguous();
    auto tables = block_tables.contiguous();
    const double scale = ScaleOf(q, params);
    const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const int64_t g = hq / hkv;
    auto out = at::zeros({b, hq, d}, q.options());
    auto kf = k_cache.view({-1, hkv, d});
    auto vf = v_cache.view({-1, hkv, d});
    for (int64_t i = 0; i < b; ++i) {
      const int64_t len = lens.data_ptr<int32_t>()[i];
      if (len == 0) continue;
      auto t = at::arange(len, tables.options().dtype(at::kLong));
      auto slots =
          tables[i].to(at::kLong).index_select(0, t.div(block_size, "floor")) * block_size +
          t.remainder(block_size);                                   // [len]
      auto ks = kf.index_select(0, slots).to(acc).transpose(0, 1);   // [Hkv, len, D]
      auto vs = vf.index_select(0, slots).to(acc).transpose(0, 1);   // [Hkv, len, D]
      auto qi = q[i].to(acc).view({hkv, g, d});                      // [Hkv, g, D]
      auto logits = at::matmul(qi, ks.transpose(1, 2)).mul_(scale);  // [Hkv, g, len]
      if (params.softcap > 0) logits = at::tanh(logits / params.softcap) * params.softcap;
      out[i].copy_(at::matmul(at::softmax(logits, -1), vs).reshape({hq, d}));
    }
    return out;
  });
}

}  // namespace dropkv::kernels
