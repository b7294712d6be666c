// The decode GEMV of kernels/fused_gemv.h: W streamed through shared memory. Raw pointers, no
// torch.
//
// Why: a register ring (each lane holding 16 registers' worth of W in flight, each warp load
// touching 8 rows x 64 bytes) streamed 7-8% slower than cuBLAS. Here W goes through a ring of
// shared-memory stages of 16 rows x 1 KB: each warp instruction copies 512 contiguous bytes
// of a row (cp.async, 16 bytes a thread, zeros past N and K), and no registers wait on the loads.
// (Filling the stages with cp.async.bulk, one copy per 1 KB row segment completing on an
// mbarrier, measured 2.0-2.1 TB/s at one CTA per SM, slower than cp.async; that variant and the
// register ring are deleted, their figures are in docs/benchmarks.md.)
//
// Mapping (fused_gemv_kernels.cuh): a CTA of 8 warps owns 16 rows of W at a time (mma.sync
// m16n8k16's A operand; the tokens are its n, 1 or 2 tiles of 8). Warp w takes the w-th eighth of
// each stage's k in 32-wide steps with the permuted k (lane (g, q) reads 8 consecutive k of rows
// g and g + 8 and the same 8 k of x). Each warp sums its share over the
// stages of a group in order, then the CTA sums the warps' fp32 partials in warp order:
// deterministic, no atomics. Grid: one wave of ctas_per_sm CTAs per SM (default 2; one CTA alone
// measured ~22 GB/s, whatever its depth: the per-stage wait + barrier bounds it), each looping
// over groups b, b + grid, ... with the ring running on from one group into the next.
//
// FP8 weights (W = e4m3, with per-row scales): the same stages hold 1024 k a row, a lane reads
// 16 k of rows g and g + 8 at once and converts them to fp16 pairs (exact: every e4m3 value is an
// fp16 value) for four fp16 mmas against the same 16 k of x, which the prologue scaled per token
// into fp16 (ScaleXToHalf); the epilogue undoes the token's power of two and applies the row's
// scale to the fp32 sum once, before the bias. (x quantized to e4m3 for e4m3 mmas instead lost:
// docs/benchmarks.md.)
//
// PDL (kernels/cuda/pdl.cuh): the first stages are requested before PdlWaitForPrimary() (no kernel
// writes W), and PdlLaunchDependents() follows right after, so that the next GEMV's CTAs start
// (and request their own first stages) as soon as this one's CTAs leave their SMs. After the
// wait, the prologue builds x in shared memory while those first stages arrive.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/dtype_convert.cuh"
#include "kernels/cuda/fused_gemv_kernels.cuh"
#include "kernels/cuda/pdl.cuh"

namespace dropkv::kernels::cuda::gemv {

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// W is read once per step: evict it from L2 first, so the activations and the KV cache stay.
__device__ __forceinline__ uint64_t EvictFirstPolicy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// 16 bytes global -> shared by this thread (cp.async, L1 bypassed), zeros when !valid.
__device__ __forceinline__ void CopyAsync16(uint32_t dst, const void* src, bool valid,
                                            uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;" ::"r"(dst),
               "l"(src), "r"(valid ? 16 : 0), "l"(policy)
               : "memory");
}

__device__ __forceinline__ uint4 LoadShared128(uint32_t addr) {
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "r"(addr));
  return r;
}

// cp.async.wait_group with a run-time count (the ring's depth - 2).
__device__ __forceinline__ void CopyAsyncWaitAllBut(int pending) {
  switch (pending) {
    case 0:
      CpAsyncWait<0>();
      break;
    case 1:
      CpAsyncWait<1>();
      break;
    case 2:
      CpAsyncWait<2>();
      break;
    case 3:
      CpAsyncWait<3>();
      break;
    case 4:
      CpAsyncWait<4>();
      break;
    case 5:
      CpAsyncWait<5>();
      break;
    default:
      CpAsyncWait<6>();
      break;
  }
}

// grid <= num_sms * ctas_per_sm, block 256 = 8 warps. Dynamic shared memory: the ring of
// p.stages stages [16 rows][kStageRowBytes], two buffers of partials [8 warps][kTiles * 8
// tokens][16 rows] (fp32, alternating by group), then x [M][x_smem_stride] (T). Every thread
// fills the stages with 16-byte cp.async (a warp copies 512 contiguous bytes of a row per
// instruction; p.stages - 1 in flight).
// kRope: the RoPE epilogue (p.rope): groups of RoPE pairs.
template <typename T, typename W, int kTiles, bool kRope>
__global__ void __launch_bounds__(kThreads, 2) StreamGemvKernel(const Params p) {
  constexpr bool kFp8 = sizeof(W) == 1;
  constexpr int kStageElems = kStageK<W>;
  // k a lane reads per row and step (one 16-byte load): 8 T elements, or 16 e4m3 ones.
  constexpr int kLaneK = 16 / static_cast<int>(sizeof(W));
  constexpr int kStepK = 4 * kLaneK;
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kPartialFloats = kWarps * kTiles * 8 * kRowsPerCta;  // one buffer
  const int stages = p.stages;
  const uint32_t ring = SharedAddress(smem);
  float* partials = reinterpret_cast<float*>(smem + static_cast<size_t>(stages) * kStageBytes);
  T* xs = reinterpret_cast<T*>(reinterpret_cast<unsigned char*>(partials) +
                               2 * kPartialFloats * sizeof(float));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, q = lane % 4;
  const int num_groups = (p.n + kRowsPerCta - 1) / kRowsPerCta;
  const int my_groups =
      (num_groups - static_cast<int>(blockIdx.x) + gridDim.x - 1) / static_cast<int>(gridDim.x);
  const int stages_per_group = (p.k + kStageElems - 1) / kStageElems;
  const int my_stages = my_groups * stages_per_group;
  const W* weight = static_cast<const W*>(p.weight);

  const uint64_t policy = EvictFirstPolicy();
  // Every thread requests stage i into slot i % stages (16-byte pieces, zeros past N and K), and
  // commits a group even when there is none left, so that the group count stays uniform.
  auto request_async = [&](int i) {
    if (i < my_stages) {
      const int slot = i % stages, gi = i / stages_per_group, ks = i % stages_per_group;
      const int group = static_cast<int>(blockIdx.x) + gi * static_cast<int>(gridDim.x);
      constexpr int kPiecesPerRow = kStageRowPayload / 16;
#pragma unroll
      for (int pass = 0; pass < kRowsPerCta * kPiecesPerRow / kThreads; ++pass) {
        const int idx = pass * kThreads + static_cast<int>(threadIdx.x);
        const int r = idx / kPiecesPerRow, piece = idx % kPiecesPerRow;
        const int kk = ks * kStageElems + piece * (16 / static_cast<int>(sizeof(W)));
        const int row = GroupRow<kRope>(p, group, r);
        const bool valid = row < p.n && kk < p.k;
        const W* src = valid ? weight + static_cast<int64_t>(row) * p.k + kk : weight;
        CopyAsync16(ring + slot * kStageBytes + r * kStageRowBytes + piece * 16, src, valid,
                    policy);
      }
    }
    CpAsyncCommit();
  };

  for (int i = 0; i < stages - 1; ++i) request_async(i);
  PdlLaunchDependents();
  PdlWaitForPrimary();  // x is the previous kernel's output

  PlainPrologue<T, kPrologueBatch>(p, xs);
  __syncthreads();
  __shared__ float token_scale[16];  // FP8 weights: each token's power of two (ScaleXToHalf)
  if constexpr (kFp8) ScaleXToHalf<T>(p, xs, token_scale);
  using MmaT = std::conditional_t<kFp8, __half, T>;  // the type x has in shared memory

  const uint4 zero = make_uint4(0, 0, 0, 0);
  const uint32_t xs_addr = SharedAddress(xs);
  int i = 0;  // this CTA's stage index
  for (int gi = 0; gi < my_groups; ++gi) {
    float acc[kTiles][4];
#pragma unroll
    for (int tile = 0; tile < kTiles; ++tile)
      for (int e = 0; e < 4; ++e) acc[tile][e] = 0.f;
    float* buffer = partials + (gi % 2) * kPartialFloats;
    for (int ks = 0; ks < stages_per_group; ++ks, ++i) {
      const int slot = i % stages;
      // This thread's pieces of stage i have landed; the barrier makes everyone's visible and
      // frees slot (i - 1) % stages, which the next request refills.
      CopyAsyncWaitAllBut(stages - 2);
      __syncthreads();
      request_async(i + stages - 1);
      const uint32_t stage = ring + slot * kStageBytes;
#pragma unroll
      for (int c = 0; c < kStageElems / (kWarps * kStepK); ++c) {
        const int k_in_stage = warp * (kStageElems / kWarps) + c * kStepK;
        // Warp-uniform: mma.sync is .aligned. Lanes past K (K % kStepK != 0) take part with zeros
        // for both W (the slot holds stale data there) and x.
        if (ks * kStageElems + k_in_stage >= p.k) break;
        const int kl = k_in_stage + q * kLaneK;
        const int kx = ks * kStageElems + kl;  // the same k in x
        const bool in = kx < p.k;
        const uint32_t w_offset = kl * static_cast<int>(sizeof(W));
        const uint4 lo = in ? LoadShared128(stage + g * kStageRowBytes + w_offset) : zero;
        const uint4 hi = in ? LoadShared128(stage + (g + 8) * kStageRowBytes + w_offset) : zero;
        if constexpr (kFp8) {
          uint4 lo2[2], hi2[2];
          E4m3x16To<__half>(lo, lo2);
          E4m3x16To<__half>(hi, hi2);
#pragma unroll
          for (int tile = 0; tile < kTiles; ++tile) {
            const int token = tile * 8 + g;
            const uint32_t xa = xs_addr + (token * p.x_smem_stride + kx) * 2;
            const bool xin = in && token < p.m;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const uint4 xv = xin ? LoadShared128(xa + h * 16) : zero;
              Mma16816<MmaT>(acc[tile], lo2[h].x, hi2[h].x, lo2[h].y, hi2[h].y, xv.x, xv.y);
              Mma16816<MmaT>(acc[tile], lo2[h].z, hi2[h].z, lo2[h].w, hi2[h].w, xv.z, xv.w);
            }
          }
        } else {
#pragma unroll
          for (int tile = 0; tile < kTiles; ++tile) {
            const int token = tile * 8 + g;
            const uint4 xv = in && token < p.m
                                 ? LoadShared128(xs_addr + (token * p.x_smem_stride + kx) * 2)
                                 : zero;
            Mma16816<T>(acc[tile], lo.x, hi.x, lo.y, hi.y, xv.x, xv.y);
            Mma16816<T>(acc[tile], lo.z, hi.z, lo.w, hi.w, xv.z, xv.w);
          }
        }
      }
      if (ks == stages_per_group - 1) StorePartials<kTiles>(buffer, warp, g, q, acc);
    }
    // The partials of every warp are written. (The other buffer is written next, and this one
    // again only after the next group's barrier, which the threads reducing it pass once done.)
    __syncthreads();
    const int group = static_cast<int>(blockIdx.x) + gi * static_cast<int>(gridDim.x);
    if constexpr (kRope) {
      ReduceRopeAndStore<T, kTiles>(p, buffer, token_scale, group);
    } else {
      ReduceAndStoreRows<T, kTiles>(p, buffer, token_scale, group * kRowsPerCta);
    }
  }
}

}  // namespace dropkv::kernels::cuda::gemv
