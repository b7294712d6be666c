// dropkv-bench-score [--n N ...] [--runs R] [--json] [--no-decode] [--decode-only] [--h2o]
// One layer of Llama-3.1-8B geometry (Hq 32, Hkv 8, D 128), W = 8, bf16:
//  - fused DropKV scoring (kernels/dropkv_score.h) vs a naive LibTorch version that materialises
//    the window attention and the differences a_t - v_j, as a PyTorch user would write it;
//  - scratch bytes of each (peak allocated beyond inputs and output, caching-allocator stats);
//  - fraction of the HBM roofline: (K twice + V once) / device-to-device copy bandwidth measured
//    in the same run (bytes read + written);
//  - the score pass alone (DropKvScoresFromAttention: the window rows' attention output and LSE
//    given, as the prefill attention would hand them over), against the same roofline;
//  - selection: pool + protect + top-k (keep 10%) + gather of K and V, the indices alone, and the
//    previous ATen path (topk + sort) as the peer in the same run;
//  - paged decode attention, batch 1, 8K context, all 32 layers (one call per layer), and
//    batch 16 x 2K, eager and as a CUDA graph of the 32 calls; split-count sweeps of the graphs
//    (DROPKV_DECODE_KERNELS=v7 / v11 selects an older kernel for an A/B run).
//  - --h2o (alone): H2O column sums over the prompt rows, the row-chunked ATen H2oScores (and the
//    old single [g*nq, n] block per head) vs the fused H2oScoresFromLse, at nq 2048 over n 32768
//    and nq = n = 8192: ms, scratch, tensor-core TFLOP/s of the fused kernel (visible logits).
// Median of `runs` timed runs with CUDA events after warm-up, L2 flushed (256 MiB memset) before
// each run.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "kernels/dropkv_score.h"
#include "kernels/paged_attention.h"
#include "kernels/scorers.h"
#include "kernels/selection.h"
#include "kernels/tuning.h"

namespace {

using dropkv::kernels::DropKvParams;

constexpr int64_t kHq = 32, kHkv = 8, kD = 128, kW = 8;

at::Tensor& FlushBuffer() {
  static at::Tensor buf =
      at::empty({256ll << 20}, at::TensorOptions().dtype(at::kByte).device(at::kCUDA));
  return buf;
}

// Median milliseconds of fn over `runs` timed runs (3 warm-ups), L2 flushed before each.
double TimeMs(const std::function<void()>& fn, int runs, bool flush = true) {
  for (int i = 0; i < 3; ++i) fn();
  std::vector<double> ms;
  auto stream = at::cuda::getCurrentCUDAStream();
  for (int i = 0; i < runs; ++i) {
    if (flush) FlushBuffer().zero_();
    at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
    start.record(stream);
    fn();
    stop.record(stream);
    stop.synchronize();
    ms.push_back(start.elapsed_time(stop));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int64_t AllocatedBytes() {
  auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(at::cuda::current_device());
  return stats.allocated_bytes[0].current;
}
int64_t PeakBytes() {
  auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(at::cuda::current_device());
  return stats.allocated_bytes[0].peak;
}
// Peak bytes allocated by fn beyond what was live before it and what it returns.
int64_t ScratchBytes(const std::function<at::Tensor()>& fn) {
  at::cuda::getCurrentCUDAStream().synchronize();
  const int64_t before = AllocatedBytes();
  c10::cuda::CUDACachingAllocator::resetPeakStats(at::cuda::current_device());
  at::Tensor out = fn();
  at::cuda::getCurrentCUDAStream().synchronize();
  return PeakBytes() - before - static_cast<int64_t>(out.nbytes());
}

// What a PyTorch user writes: repeat K/V over the group, full window attention in fp32, then the
// [Hq, W, n, D] differences a_t - v_j.
at::Tensor NaiveScores(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t n = k.size(2), g = kHq / kHkv;
  auto qf = q.to(at::kFloat);
  auto kf = k.to(at::kFloat).repeat_interleave(g, 1);  // [1, Hq, n, D]
  auto vf = v.to(at::kFloat).repeat_interleave(g, 1);
  auto logits = at::matmul(qf, kf.transpose(2, 3)) / std::sqrt(double(kD));  // [1, Hq, W, n]
  auto rows = at::arange(kW, q.options().dtype(at::kLong)).unsqueeze(1) + (n - kW);
  auto cols = at::arange(n, q.options().dtype(at::kLong)).unsqueeze(0);
  logits = logits.masked_fill(cols > rows, -std::numeric_limits<float>::infinity());
  auto p = at::softmax(logits, -1);              // [1, Hq, W, n]
  auto a = at::matmul(p, vf);                    // [1, Hq, W, D]
  auto diff = a.unsqueeze(3) - vf.unsqueeze(2);  // [1, Hq, W, n, D]
  auto d2 = diff.square().sum(-1);               // [1, Hq, W, n]
  auto w = (p / (1 - p + 1e-6)).square();
  return (w * d2).sum(2).view({1, kHkv, g, n}).sum(2) / double(g);  // [1, Hkv, n]
}

// The window rows' attention output [1, Hq, W, D] and LSE [1, Hq, W] in fp32 (what a prefill
// attention kernel returns for the last W rows), computed per KV head group.
std::pair<at::Tensor, at::Tensor> WindowAttention(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v) {
  const int64_t n = k.size(2), g = kHq / kHkv;
  auto qf = q.to(at::kFloat).view({1, kHkv, g * kW, kD});
  auto logits = at::matmul(qf, k.to(at::kFloat).transpose(2, 3)) / std::sqrt(double(kD));
  auto rows = (at::arange(g * kW, q.options().dtype(at::kLong)) % kW).unsqueeze(1) + (n - kW);
  auto cols = at::arange(n, q.options().dtype(at::kLong)).unsqueeze(0);
  logits = logits.masked_fill(cols > rows, -std::numeric_limits<float>::infinity());
  auto lse = at::logsumexp(logits, -1);                            // [1, Hkv, g*W]
  auto a = at::matmul(at::softmax(logits, -1), v.to(at::kFloat));  // [1, Hkv, g*W, D]
  return {a.view({1, kHq, kW, kD}), lse.view({1, kHq, kW})};
}

struct ScoreRow {
  int64_t n;
  double fused_ms, naive_ms, roofline_frac, select_ms, cuda_core_ms, pass3_ms, pass3_frac;
  int64_t fused_scratch, naive_scratch;
  bool naive_run;
  double select_idx_ms = 0, select_aten_ms = 0, select_aten_idx_ms = 0;  // indices; ATen peer
};

void PrintSelection(const std::vector<ScoreRow>& rows) {
  for (const auto& r : rows) {
    std::printf(
        "selection n %lld: %.4f ms (indices %.4f ms); ATen topk + sort peer %.4f ms (indices "
        "%.4f ms)\n",
        static_cast<long long>(r.n), r.select_ms, r.select_idx_ms, r.select_aten_ms,
        r.select_aten_idx_ms);
  }
}

std::string Human(int64_t bytes) {
  char buf[32];
  if (bytes < 0) return "-";
  if (bytes >= (1ll << 30))
    std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / double(1ll << 30));
  else
    std::snprintf(buf, sizeof buf, "%.2f MiB", bytes / double(1ll << 20));
  return buf;
}

// H2O: each row's LSE of its causally masked fp32 logits (the prefill attention's), per query
// head so that setup stays within one [nq, n] fp32 block. q [1, Hq, nq, D], k [1, Hkv, n, D].
at::Tensor H2oRowLse(const at::Tensor& q, const at::Tensor& k) {
  const int64_t nq = q.size(2), n = k.size(2), g = q.size(1) / k.size(1);
  auto lse = at::empty({1, q.size(1), nq}, q.options().dtype(at::kFloat));
  auto rows = at::arange(nq, q.options().dtype(at::kLong)).unsqueeze(1) + (n - nq);
  auto cols = at::arange(n, q.options().dtype(at::kLong)).unsqueeze(0);
  auto mask = cols > rows;
  for (int64_t h = 0; h < q.size(1); ++h) {
    auto logits = at::matmul(q[0][h].to(at::kFloat), k[0][h / g].to(at::kFloat).t()) /
                  std::sqrt(double(q.size(3)));
    lse[0][h].copy_(at::logsumexp(logits.masked_fill_(mask, -INFINITY), -1));
  }
  return lse;
}

int RunH2o(int runs) {
  namespace kn = dropkv::kernels;
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  auto* props = at::cuda::getCurrentDeviceProperties();
  std::printf("H2O column sums, Llama-3.1-8B layer (Hq 32, Hkv 8, D 128, bf16), %s, median of %d\n",
              props->name, runs);
  std::printf("%6s %6s %11s %11s %11s %9s %11s %11s %11s %8s %9s\n", "nq", "n", "aten ms",
              "1-block ms", "fused ms", "speedup", "aten scr", "1-block scr", "fused scr",
              "TFLOP/s", "rel L2");
  for (auto [nq, n] : {std::pair<int64_t, int64_t>{2048, 32768}, {8192, 8192}}) {
    auto q = at::randn({1, kHq, nq, kD}, bf16);
    auto k = at::randn({1, kHkv, n, kD}, bf16);
    auto v = at::randn({1, kHkv, n, kD}, bf16);
    auto lse = H2oRowLse(q, k);
    kn::H2oParams params;
    at::Tensor aten, fused;
    const double aten_ms = TimeMs([&] { aten = *kn::H2oScores(q, k, v, params); }, runs);
    const double block_ms = TimeMs(
        [&] {
          (void)*kn::internal::H2oScoresAten(q, k, v, at::Tensor(), params,
                                             std::numeric_limits<int64_t>::max());
        },
        runs);
    const double fused_ms =
        TimeMs([&] { fused = *kn::H2oScoresFromLse(q, k, v, lse, params); }, runs);
    const int64_t aten_scr = ScratchBytes([&] { return *kn::H2oScores(q, k, v, params); });
    const int64_t block_scr = ScratchBytes([&] {
      return *kn::internal::H2oScoresAten(q, k, v, at::Tensor(), params,
                                          std::numeric_limits<int64_t>::max());
    });
    const int64_t fused_scr =
        ScratchBytes([&] { return *kn::H2oScoresFromLse(q, k, v, lse, params); });
    // Logits each query head computes that some row sees: nq (n - nq) + nq (nq + 1) / 2.
    const double visible = double(nq) * double(n - nq) + double(nq) * double(nq + 1) / 2;
    const double tflops = 2.0 * kHq * kD * visible / (fused_ms * 1e-3) / 1e12;
    const double rel =
        ((fused.to(at::kDouble) - aten.to(at::kDouble)).norm() / aten.to(at::kDouble).norm())
            .item<double>();
    std::printf("%6lld %6lld %11.3f %11.3f %11.3f %8.1fx %11s %11s %11s %8.1f %9.2e\n",
                static_cast<long long>(nq), static_cast<long long>(n), aten_ms, block_ms, fused_ms,
                aten_ms / fused_ms, Human(aten_scr).c_str(), Human(block_scr).c_str(),
                Human(fused_scr).c_str(), tflops, rel);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> ns;
  int runs = 20;
  bool json = false, decode = true, score = true, h2o = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--n") && i + 1 < argc) {
      while (i + 1 < argc && argv[i + 1][0] != '-') ns.push_back(std::atoll(argv[++i]));
    } else if (!std::strcmp(argv[i], "--runs") && i + 1 < argc) {
      runs = std::max(1, std::atoi(argv[++i]));
    } else if (!std::strcmp(argv[i], "--json")) {
      json = true;
    } else if (!std::strcmp(argv[i], "--no-decode")) {
      decode = false;
    } else if (!std::strcmp(argv[i], "--decode-only")) {
      score = false;
    } else if (!std::strcmp(argv[i], "--h2o")) {
      h2o = true;
    } else {
      std::printf(
          "usage: %s [--n N ...] [--runs R (20)] [--json] [--no-decode] [--decode-only] [--h2o "
          "(the H2O table alone)]\n",
          argv[0]);
      return std::strcmp(argv[i], "--help") ? 2 : 0;
    }
  }
  if (ns.empty()) ns = {4096, 16384, 32768, 65536, 131072, 524288};
  if (!score) ns.clear();
  if (!at::hasCUDA()) {
    std::fprintf(stderr, "dropkv-bench-score: no CUDA device\n");
    return 1;
  }
  try {
    if (h2o) return RunH2o(runs);
    const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
    auto* props = at::cuda::getCurrentDeviceProperties();
    // Device-to-device copy bandwidth, bytes read + written.
    auto src = at::empty({1ll << 30}, bf16.dtype(at::kByte)).fill_(1);
    auto dst = at::empty_like(src);
    const double copy_ms = TimeMs([&] { dst.copy_(src); }, runs, false);
    const double copy_gbs = 2.0 * src.nbytes() / (copy_ms * 1e-3) / 1e9;
    src = dst = at::Tensor();

    std::vector<ScoreRow> rows;
    for (int64_t n : ns) {
      auto q = at::randn({1, kHq, kW, kD}, bf16);
      auto k = at::randn({1, kHkv, n, kD}, bf16);
      auto v = at::randn({1, kHkv, n, kD}, bf16);
      DropKvParams params;
      params.p_round_dtype = at::kBFloat16;
      ScoreRow row{n, 0, -1, 0, 0, 0, 0, 0, 0, -1, false};
      at::Tensor scores;
      row.fused_ms =
          TimeMs([&] { scores = *dropkv::kernels::DropKvScores(q, k, v, params); }, runs);
      DropKvParams cuda_cores = params;  // v1 path: all products on fp32 CUDA cores
      cuda_cores.use_tensor_cores = false;
      row.cuda_core_ms =
          TimeMs([&] { (void)*dropkv::kernels::DropKvScores(q, k, v, cuda_cores); }, runs);
      row.fused_scratch =
          ScratchBytes([&] { return *dropkv::kernels::DropKvScores(q, k, v, params); });
      const double bytes = 3.0 * k.nbytes();  // K twice + V once
      row.roofline_frac = (bytes / (copy_gbs * 1e9) * 1e3) / row.fused_ms;
      {
        auto [attn, lse] = WindowAttention(q, k, v);
        row.pass3_ms = TimeMs(
            [&] { (void)*dropkv::kernels::DropKvScoresFromAttention(q, k, v, attn, lse, params); },
            runs);
        row.pass3_frac = (bytes / (copy_gbs * 1e9) * 1e3) / row.pass3_ms;
      }
      const int64_t keep = dropkv::kernels::KeepCount(n, 0.1, kW);
      row.select_ms = TimeMs(
          [&] {
            auto idx = *dropkv::kernels::SelectTopK(scores, keep);
            auto kk = *dropkv::kernels::GatherKept(k, idx);
            auto vv = *dropkv::kernels::GatherKept(v, idx);
          },
          runs);
      row.select_idx_ms = TimeMs([&] { (void)*dropkv::kernels::SelectTopK(scores, keep); }, runs);
      // The previous path (ATen topk + sort of the indices) after the same pool + protect.
      dropkv::kernels::SelectParams topk_order;
      topk_order.ties = dropkv::kernels::TieOrder::kTorchTopk;
      auto aten_indices = [&] { return *dropkv::kernels::SelectTopK(scores, keep, topk_order); };
      row.select_aten_idx_ms = TimeMs([&] { (void)aten_indices(); }, runs);
      row.select_aten_ms = TimeMs(
          [&] {
            auto idx = aten_indices();
            auto kk = *dropkv::kernels::GatherKept(k, idx);
            auto vv = *dropkv::kernels::GatherKept(v, idx);
          },
          runs);
      // Naive: fp32 K/V repeated over the group (2 x Hq n D), the differences (Hq W n D) and a
      // few [Hq, W, n] temporaries; run it when that fits in 80% of the free memory.
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      const double naive_need =
          4.0 * (2.0 * kHq * n * kD + 2.0 * kHq * kW * n * kD + 8.0 * kHq * kW * n);
      if (naive_need < 0.8 * static_cast<double>(free_b)) {
        row.naive_run = true;
        row.naive_ms = TimeMs([&] { NaiveScores(q, k, v); }, runs);
        row.naive_scratch = ScratchBytes([&] { return NaiveScores(q, k, v); });
      } else {
        std::fprintf(stderr, "naive skipped at n=%lld: needs about %s, %s free\n",
                     static_cast<long long>(n), Human(int64_t(naive_need)).c_str(),
                     Human(int64_t(free_b)).c_str());
      }
      rows.push_back(row);
      c10::cuda::CUDACachingAllocator::emptyCache();
    }

    if (!decode) {
      std::printf("device %s; d2d copy %.0f GB/s; median of %d runs\n", props->name, copy_gbs,
                  runs);
      std::printf("%8s %10s %9s %12s %9s %10s\n", "n", "fused ms", "roofline", "pass3 ms",
                  "roofline", "naive ms");
      for (const auto& r : rows) {
        std::printf("%8lld %10.4f %8.1f%% %12.4f %8.1f%% %10.4f\n", static_cast<long long>(r.n),
                    r.fused_ms, 100 * r.roofline_frac, r.pass3_ms, 100 * r.pass3_frac, r.naive_ms);
      }
      PrintSelection(rows);
      return 0;
    }
    // Paged decode: batch 1, context 8192 (and 819 = keep 10%), 32 layers, block size 16.
    const int64_t layers = 32, block_size = 16, ctx = 8192;
    const int64_t blocks_per_layer = ctx / block_size;
    auto k_pool = at::randn({layers * blocks_per_layer, block_size, kHkv, kD}, bf16);
    auto v_pool = at::randn({layers * blocks_per_layer, block_size, kHkv, kD}, bf16);
    auto q1 = at::randn({1, kHq, kD}, bf16);
    std::vector<at::Tensor> tables;
    auto perm = at::randperm(layers * blocks_per_layer, bf16.dtype(at::kInt));
    for (int64_t l = 0; l < layers; ++l) {
      tables.push_back(perm.slice(0, l * blocks_per_layer, (l + 1) * blocks_per_layer)
                           .view({1, -1})
                           .contiguous());
    }
    // Batch 16 x 2K context (the end-to-end HF comparison's decode row), 32 layer calls cycling
    // over 8 disjoint sets of block tables (each layer's 134 MB of K/V is past the L2 anyway).
    const int64_t batch16 = 16, ctx16 = 2048, blocks16 = ctx16 / block_size;
    std::vector<at::Tensor> tables16;
    for (int64_t l = 0; l < 8; ++l) {
      tables16.push_back(perm.slice(0, l * batch16 * blocks16, (l + 1) * batch16 * blocks16)
                             .view({batch16, blocks16})
                             .contiguous());
    }
    auto q16 = at::randn({batch16, kHq, kD}, bf16);
    // The 32 layer calls of one decode step: batch 1 (lengths `len`) or batch 16 x 2K.
    auto step = [&](int64_t batch, int64_t len, const dropkv::kernels::PagedAttentionParams& pr) {
      // Copied from the host, as the runner's decode inputs (metadata_uploaded below).
      auto lens = at::full({batch}, len, at::kInt).to(bf16.device());
      return [&, batch, lens, pr] {
        for (int64_t l = 0; l < layers; ++l) {
          if (batch == 1) {
            (void)*dropkv::kernels::PagedDecodeAttention(q1, k_pool, v_pool, tables[l], lens, pr);
          } else {
            (void)*dropkv::kernels::PagedDecodeAttention(q16, k_pool, v_pool, tables16[l % 8], lens,
                                                         pr);
          }
        }
      };
    };
    // The same 32 calls captured in a CUDA graph (how a decode step replays them), after one
    // eager step (lazy initialisation stays out of the capture, as in the runner).
    auto graph_time = [&](const std::function<void()>& fn) {
      try {
        fn();
        at::cuda::CUDAGraph graph;
        auto side = at::cuda::getStreamFromPool();
        {
          c10::cuda::CUDAStreamGuard guard(side);
          graph.capture_begin();
          fn();
          graph.capture_end();
        }
        return TimeMs([&] { graph.replay(); }, runs);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "graph capture failed: %s\n", e.what());
        return -1.0;
      }
    };
    auto hint = [](int64_t len, int splits = 0) {
      dropkv::kernels::PagedAttentionParams pr;  // the runner knows its lengths on the host
      pr.max_seq_len = static_cast<int32_t>(len);
      pr.num_splits = splits;
      // No kernel writes the tables, lengths or K/V in the timed loops.
      pr.metadata_uploaded = true;
      pr.older_keys_ready = true;
      return pr;
    };
    double decode_ms[2], decode_graph_ms[2];
    const int64_t lens[2] = {ctx, ctx / 10};
    for (int c = 0; c < 2; ++c) {
      decode_ms[c] = TimeMs(step(1, lens[c], hint(lens[c])), runs);
      decode_graph_ms[c] = graph_time(step(1, lens[c], hint(lens[c])));
    }
    // 8K without a hint: the tables' capacity (here equal) sizes the grid.
    const double graph_nohint_ms = graph_time(step(1, ctx, hint(0)));
    const double decode16_ms = TimeMs(step(batch16, ctx16, hint(ctx16)), runs);
    const double graph16_ms = graph_time(step(batch16, ctx16, hint(ctx16)));
    // Diagnostic: the same bytes and grid as batch 1 x 8K with 8 KV heads, but 8 sequences of one
    // KV head (the pool viewed as [blocks * 8, 16, 1, D]): every head row of a block is adjacent
    // (4 KB runs) instead of 256 bytes every 2 KB. What the pool layout costs the kernel.
    double graph_contig_ms = -1;
    {
      auto k1 = k_pool.view({-1, block_size, 1, kD}), v1 = v_pool.view({-1, block_size, 1, kD});
      auto perm1 = at::randperm(k1.size(0), bf16.dtype(at::kInt));
      std::vector<at::Tensor> tables1;
      for (int64_t l = 0; l < layers; ++l) {
        tables1.push_back(
            perm1.slice(0, l * kHkv * blocks_per_layer, (l + 1) * kHkv * blocks_per_layer)
                .view({kHkv, blocks_per_layer})
                .contiguous());
      }
      auto q8 = at::randn({kHkv, kHq / kHkv, kD}, bf16);
      auto lens8 = at::full({kHkv}, ctx, at::kInt).to(bf16.device());
      const auto pr = hint(ctx);
      graph_contig_ms = graph_time([&] {
        for (int64_t l = 0; l < layers; ++l)
          (void)*dropkv::kernels::PagedDecodeAttention(q8, k1, v1, tables1[l], lens8, pr);
      });
    }
    // Split-count sweeps of the graphs (the default picks about 2 CTAs per SM): where the merge
    // and the per-CTA prologue stop paying for more parallel streams.
    std::vector<std::pair<int, double>> sweep8k, sweep819;
    for (int splits : {8, 12, 16, 20, 24, 33, 48, 66})
      sweep8k.emplace_back(splits, graph_time(step(1, ctx, hint(ctx, splits))));
    for (int splits : {2, 4, 7, 13, 20, 26})
      sweep819.emplace_back(splits, graph_time(step(1, lens[1], hint(lens[1], splits))));
    const double decode16_bytes = 2.0 * layers * batch16 * ctx16 * kHkv * kD * 2;
    // Peer: SDPA over a dense contiguous cache of one layer, x32 (GQA expanded to Hq heads).
    auto kd = at::randn({1, kHq, ctx, kD}, bf16), vd = at::randn({1, kHq, ctx, kD}, bf16);
    auto qd = at::randn({1, kHq, 1, kD}, bf16);
    const double sdpa_ms = TimeMs(
        [&] {
          for (int64_t l = 0; l < layers; ++l) at::scaled_dot_product_attention(qd, kd, vd);
        },
        runs);
    const double decode_bytes = 2.0 * layers * ctx * kHkv * kD * 2;  // K + V of 32 layers
    const double roofline_ms = decode_bytes / (copy_gbs * 1e9) * 1e3;
    const double roofline16_ms = decode16_bytes / (copy_gbs * 1e9) * 1e3;
    const char* pdl = dropkv::kernels::Tuning().pdl ? "on" : "off";

    if (json) {
      std::printf("{\"device\":\"%s\",\"copy_gbs\":%.1f,\"scoring\":[", props->name, copy_gbs);
      for (size_t i = 0; i < rows.size(); ++i) {
        const auto& r = rows[i];
        std::printf(
            "%s{\"n\":%lld,\"fused_ms\":%.4f,\"naive_ms\":%.4f,\"speedup\":%.2f,"
            "\"fused_scratch_bytes\":%lld,\"naive_scratch_bytes\":%lld,"
            "\"roofline_frac\":%.3f,\"select_ms\":%.4f,\"cuda_core_ms\":%.4f,"
            "\"pass3_only_ms\":%.4f,\"pass3_only_roofline_frac\":%.3f,\"select_idx_ms\":%.4f,"
            "\"select_aten_ms\":%.4f,\"select_aten_idx_ms\":%.4f}",
            i ? "," : "", static_cast<long long>(r.n), r.fused_ms, r.naive_ms,
            r.naive_run ? r.naive_ms / r.fused_ms : -1.0, static_cast<long long>(r.fused_scratch),
            static_cast<long long>(r.naive_scratch), r.roofline_frac, r.select_ms, r.cuda_core_ms,
            r.pass3_ms, r.pass3_frac, r.select_idx_ms, r.select_aten_ms, r.select_aten_idx_ms);
      }
      std::printf(
          "],\"decode\":{\"pdl\":\"%s\",\"ctx\":%lld,\"layers\":%lld,\"paged_ms\":%.4f,"
          "\"paged_keep10_ms\":%.4f,\"paged_graph_ms\":%.4f,\"paged_graph_nohint_ms\":%.4f,"
          "\"sdpa_dense_ms\":%.4f,\"roofline_ms\":%.4f,\"batch16_ctx2k_ms\":%.4f,"
          "\"batch16_graph_ms\":%.4f,\"batch16_roofline_ms\":%.4f,\"paged_keep10_graph_ms\":%.4f}}"
          "\n",
          pdl, static_cast<long long>(ctx), static_cast<long long>(layers), decode_ms[0],
          decode_ms[1], decode_graph_ms[0], graph_nohint_ms, sdpa_ms, roofline_ms, decode16_ms,
          graph16_ms, roofline16_ms, decode_graph_ms[1]);
    } else {
      std::printf("device %s, %d SMs; d2d copy %.0f GB/s (read + write); median of %d runs\n",
                  props->name, props->multiProcessorCount, copy_gbs, runs);
      if (!rows.empty()) {
        std::printf("%8s %10s %10s %8s %12s %12s %9s %10s %10s %10s %9s\n", "n", "fused ms",
                    "naive ms", "speedup", "fused scr", "naive scr", "roofline", "select ms",
                    "v1 cc ms", "pass3 ms", "roofline");
      }
      for (const auto& r : rows) {
        std::printf("%8lld %10.4f %10s %8s %12s %12s %8.1f%% %10.4f %10.4f %10.4f %8.1f%%\n",
                    static_cast<long long>(r.n), r.fused_ms,
                    r.naive_run ? std::to_string(r.naive_ms).c_str() : "skipped",
                    r.naive_run ? std::to_string(r.naive_ms / r.fused_ms).c_str() : "-",
                    Human(r.fused_scratch).c_str(), Human(r.naive_scratch).c_str(),
                    100 * r.roofline_frac, r.select_ms, r.cuda_core_ms, r.pass3_ms,
                    100 * r.pass3_frac);
      }
      PrintSelection(rows);
      std::printf("paged decode (PDL %s), %lld layers, ms per step:\n", pdl,
                  static_cast<long long>(layers));
      std::printf("  %-28s %9s %9s %9s\n", "case", "eager", "graph", "roofline");
      std::printf("  %-28s %9.4f %9.4f %9.4f\n", "batch 1, ctx 8192", decode_ms[0],
                  decode_graph_ms[0], roofline_ms);
      std::printf("  %-28s %9s %9.4f %9s\n", "batch 1, ctx 8192, no hint", "-", graph_nohint_ms,
                  "");
      std::printf("  %-28s %9.4f %9.4f %9.4f\n", "batch 1, ctx 819 (keep 10%)", decode_ms[1],
                  decode_graph_ms[1], roofline_ms / 10);
      std::printf("  %-28s %9.4f %9.4f %9.4f\n", "batch 16, ctx 2048", decode16_ms, graph16_ms,
                  roofline16_ms);
      std::printf("  %-28s %9s %9.4f %9.4f\n", "8 seqs x 1 KV head, ctx 8192", "-", graph_contig_ms,
                  roofline_ms);
      std::printf("  dense SDPA peer (ctx 8192, GQA expanded, eager): %.4f ms\n", sdpa_ms);
      std::printf("  graph by num_splits, ctx 8192:");
      for (const auto& [splits, ms] : sweep8k) std::printf(" %d: %.4f;", splits, ms);
      std::printf("\n  graph by num_splits, ctx 819:");
      for (const auto& [splits, ms] : sweep819) std::printf(" %d: %.4f;", splits, ms);
      std::printf("\n");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dropkv-bench-score: %s\n", e.what());
    return 1;
  }
  return 0;
}
