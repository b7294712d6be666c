// Decode attention over the paged KV cache: one new query per sequence against that sequence's
// stored K/V of one layer (lengths differ per sequence and per layer under DepthKV budgets).
// CPU: one pass over each sequence's blocks in chunks of 256 tokens, every KV head of a slot at
// once, parallel over (sequence, chunk), chunks merged by their log-sum-exp
// (cpu/paged_attention_cpu.cpp); the ATen reference below is the tests' oracle. CUDA: split-K
// (flash-decoding) kernel, the g query heads of a KV head in one CTA (tensor cores for bf16 / fp16
// with head_dim 64 / 128), the LSE merge folded in: one launch for the batch. The merge counts CTAs
// on a small per-stream buffer that every launch leaves at zero, so calls on one stream and replays
// of CUDA graphs captured on it must not overlap (a graph replayed on another stream must be
// ordered after the capture stream's calls).
#pragma once

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace dropkv::kernels {

struct PagedAttentionParams {
  double scale = 0.0;      // 0 = 1/sqrt(D)
  int32_t num_splits = 0;  // CUDA only: 0 = choose from the batch and the longest sequence
  // CUDA only: an upper bound of seq_lens the caller knows on the host (0 = the block tables'
  // capacity), >= every seq_lens[b] (keys past it are not read). Sizes the split-K grid without a
  // device sync; a tighter bound is faster.
  int32_t max_seq_len = 0;
  // CUDA only: true when no kernel queued after block_tables and seq_lens were last copied from
  // the host writes them (the runner's decode inputs, uploaded before the step's first kernel).
  // The kernel, launched with programmatic dependent launch (kernels/cuda/pdl.cuh), then reads
  // them before it waits for the kernel queued before it, off the critical path. False: after.
  bool metadata_uploaded = false;
  // CUDA only, with metadata_uploaded: true when the kernel queued before this call writes no K/V
  // of these sequences but each one's last key (entry seq_lens[b] - 1), as a decode step's RoPE +
  // K/V store: the kernel then starts copying older keys before it waits for that kernel.
  bool older_keys_ready = false;
  // > 0: logits -> softcap * tanh(logits / softcap) before the softmax (Gemma 2). CPU only (the
  // CUDA kernel rejects it).
  double softcap = 0.0;
};

//   q:            [B, Hq, D]
//   k_cache, v_cache: [num_blocks, block_size, Hkv, D], Hq % Hkv == 0
//   block_tables: int32 [B, max_blocks]; entry t of sequence b lives in slot
//                 block_tables[b, t / block_size] * block_size + t % block_size
//   seq_lens:     int32 [B], 0 <= seq_lens[b] <= max_blocks * block_size (0 gives zeros)
//   returns       [B, Hq, D] in q's dtype (softmax and accumulation in fp32)
// CUDA: bf16 / fp16 / fp32, D in {64, 128, 256}, g = Hq / Hkv <= 16. CPU: any D and g; caches
// in fp32 / bf16 / fp16 (fp64 runs the reference). The CPU path validates every block id and
// length; the CUDA path trusts them (checking would need a device sync each decode step): the
// allocator must hand out in-range tables.
absl::StatusOr<at::Tensor> PagedDecodeAttention(const at::Tensor& q, const at::Tensor& k_cache,
                                                const at::Tensor& v_cache,
                                                const at::Tensor& block_tables,
                                                const at::Tensor& seq_lens,
                                                const PagedAttentionParams& params = {});

// The CPU reference, same arguments and checks (CPU tensors only): per sequence, the slots
// gathered with index_select, softmax(q K^T) V by ATen matmuls in fp32 (fp64 for fp64 inputs).
// The oracle of both kernels in the tests; far too slow to serve (a host loop over sequences,
// a gather of every slot).
absl::StatusOr<at::Tensor> PagedDecodeAttentionReference(const at::Tensor& q,
                                                         const at::Tensor& k_cache,
                                                         const at::Tensor& v_cache,
                                                         const at::Tensor& block_tables,
                                                         const at::Tensor& seq_lens,
                                                         const PagedAttentionParams& params = {});

}  // namespace dropkv::kernels
