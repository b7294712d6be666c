// CPU reference of the scorers (dropkv_score.h, scorers.h) and the device dispatch.
// The reference materialises one KV head's [g*W, n] attention block at a time (H2O: a bounded
// chunk of its rows): fine on the CPU, and the exact definition the CUDA kernels are tested
// against.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/check.h"
#include "kernels/cuda/launchers.h"
#include "kernels/dropkv_score.h"
#include "kernels/scorers.h"

namespace dropkv::kernels {
namespace {

using internal::CatchTorch;
using internal::CheckDim;
using internal::CheckSize;

at::ScalarType AccType(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

double Scale(double scale, int64_t head_dim) {
  return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

// Checks q [B, Hq, Wq, D] against k (and v) [B, Hkv, n, D].
absl::Status CheckQkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor* v,
                      const char* qname) {
  if (auto s = CheckDim(q, qname, 4, "[B, Hq, W, D]"); !s.ok()) return s;
  if (auto s = CheckDim(k, "k", 4, "[B, Hkv, n, D]"); !s.ok()) return s;
  if (auto s = CheckSize(k, "k", 0, q.size(0), "batch"); !s.ok()) return s;
  if (auto s = CheckSize(k, "k", 3, q.size(3), "head_dim"); !s.ok()) return s;
  if (k.size(1) == 0 || q.size(1) % k.size(1) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num query heads ", q.size(1), " is not a multiple of num kv heads ", k.size(1)));
  }
  if (v != nullptr) {
    if (auto s = CheckDim(*v, "v", 4, "[B, Hkv, n, D]"); !s.ok()) return s;
    if (v->sizes() != k.sizes()) {
      return absl::InvalidArgumentError(absl::StrCat("v: shape ", internal::ShapeStr(*v),
                                                     " differs from k's ", internal::ShapeStr(k)));
    }
  }
  if (q.device() != k.device() || (v != nullptr && v->device() != k.device())) {
    return absl::InvalidArgumentError(absl::StrCat(qname, ", k, v: on different devices"));
  }
  return absl::OkStatus();
}

// Causal visibility of window rows: row i (of w) sits at position n - w + i. [w, n] bool.
at::Tensor CausalWindowMask(int64_t w, int64_t n, const at::Device& device) {
  auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  auto rows = at::arange(w, opts).unsqueeze(1) + (n - w);  // [w, 1]
  auto cols = at::arange(n, opts).unsqueeze(0);            // [1, n]
  return cols <= rows;                                     // [w, n]
}

// One sequence. q [Hq, W, D], k/v [Hkv, n, D] -> [Hkv, n] in the accumulation dtype.
// given_a [Hq, W, D] and given_lse [Hq, W] (both or neither): the window rows' attention output
// and log-sum-exp from the caller instead of the softmax here.
at::Tensor DropKvOneSequence(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const DropKvParams& params, const at::Tensor* given_a = nullptr,
                             const at::Tensor* given_lse = nullptr) {
  const int64_t hq = q.size(0), w = q.size(1), d = q.size(2);
  const int64_t hkv = k.size(0), n = k.size(1);
  const int64_t g = hq / hkv;
  const auto acc = AccType(q);
  auto out = at::zeros({hkv, n}, k.options().dtype(acc));
  if (n == 0) return out;
  const double scale = Scale(params.scale, d);
  // Rows at positions < 1 (n <= W) see at most one key, whose removal is undefined: drop them.
  const int64_t first_row = std::max<int64_t>(0, w - n + 1);
  if (first_row >= w) return out;
  auto mask = CausalWindowMask(w, n, k.device()).slice(0, first_row).repeat({g, 1});  // [g*w', n]
  for (int64_t h = 0; h < hkv; ++h) {
    auto qg = q.slice(0, h * g, (h + 1) * g).slice(1, first_row).to(acc).reshape({-1, d});
    auto kh = k[h].to(acc);                            // [n, D]
    auto vh = v[h].to(acc);                            // [n, D]
    auto logits = at::matmul(qg, kh.t()).mul_(scale);  // [rows, n]
    logits.masked_fill_(mask.logical_not(), -std::numeric_limits<double>::infinity());
    at::Tensor p, a;  // [rows, n], [rows, D]
    if (given_a != nullptr) {
      auto rows_of = [&](const at::Tensor& t) {  // this head group's rows, in q's row order
        return t.slice(0, h * g, (h + 1) * g).slice(1, first_row).to(acc);
      };
      a = rows_of(*given_a).reshape({-1, d});
      p = (logits - rows_of(*given_lse).reshape({-1, 1})).exp_();
    } else {
      p = at::softmax(logits, -1);
      a = at::matmul(p, vh);
    }
    auto pw = params.p_round_dtype ? p.to(*params.p_round_dtype).to(acc) : p;
    auto wgt = (pw / (1.0 - pw + params.eps)).square_();                             // [rows, n]
    auto vn2 = vh.square().sum(-1);                                                  // [n]
    auto an2 = a.square().sum(-1, /*keepdim=*/true);                                 // [rows, 1]
    auto d2 = (vn2.unsqueeze(0) - 2.0 * at::matmul(a, vh.t()) + an2).clamp_min_(0);  // [rows, n]
    out[h].copy_((wgt * d2).sum(0) / static_cast<double>(g));
  }
  return out;
}

absl::Status CheckParams(const DropKvParams& params) {
  if (!(params.eps >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("eps must be >= 0, got ", params.eps));
  }
  if (!(params.scale >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("scale must be >= 0, got ", params.scale));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<at::Tensor> DropKvScores(const at::Tensor& q_window, const at::Tensor& k,
                                        const at::Tensor& v, const DropKvParams& params) {
  if (auto s = CheckQkv(q_window, k, &v, "q_window"); !s.ok()) return s;
  if (auto s = CheckParams(params); !s.ok()) return s;
  if (k.is_cuda()) return cuda::DropKvScores(q_window, k, v, std::nullopt, params);
  return CatchTorch("DropKvScores", [&]() -> absl::StatusOr<at::Tensor> {
    const int64_t b = q_window.size(0);
    auto out = at::empty({b, k.size(1), k.size(2)}, k.options().dtype(AccType(q_window)));
    for (int64_t i = 0; i < b; ++i) {
      out[i].copy_(DropKvOneSequence(q_window[i], k[i], v[i], params));
    }
    return out;
  });
}

absl::StatusOr<at::Tensor> DropKvScoresFromAttention(const at::Tensor& q_window,
                                                     const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& attn_out,
                                                     const at::Tensor& lse,
                                                     const DropKvParams& params) {
  if (auto s = CheckQkv(q_window, k, &v, "q_window"); !s.ok()) return s;
  if (auto s = CheckParams(params); !s.ok()) return s;
  if (attn_out.sizes() != q_window.sizes()) {
    return absl::InvalidArgumentError(absl::StrCat("attn_out: shape ", internal::ShapeStr(attn_out),
                                                   " differs from q_window's ",
                                                   internal::ShapeStr(q_window)));
  }
  if (auto s = CheckDim(lse, "lse", 3, "[B, Hq, W]"); !s.ok()) return s;
  for (int64_t i = 0; i < 3; ++i) {
    if (auto s = CheckSize(lse, "lse", i, q_window.size(i), "q_window's"); !s.ok()) return s;
  }
  if (k.is_cuda()) return cuda::DropKvScoresFromAttention(q_window, k, v, attn_out, lse, params);
  return CatchTorch("DropKvScoresFromAttention", [&]() -> absl::StatusOr<at::Tensor> {
    const int64_t b = q_window.size(0);
    auto out = at::empty({b, k.size(1), k.size(2)}, k.options().dtype(AccType(q_window)));
    for (int64_t i = 0; i < b; ++i) {
      auto a_i = attn_out[i], lse_i = lse[i];
      out[i].copy_(DropKvOneSequence(q_window[i], k[i], v[i], params, &a_i, &lse_i));
    }
    return out;
  });
}

absl::StatusOr<at::Tensor> DropKvScoresVarlen(const at::Tensor& q_window, const at::Tensor& k,
                                              const at::Tensor& v, const at::Tensor& cu_seqlens,
                                              const DropKvParams& params) {
  if (auto s = CheckDim(q_window, "q_window", 4, "[B, Hq, W, D]"); !s.ok()) return s;
  if (auto s = CheckDim(k, "k", 3, "[total_n, Hkv, D]"); !s.ok()) return s;
  if (auto s = CheckDim(cu_seqlens, "cu_seqlens", 1, "[B + 1]"); !s.ok()) return s;
  if (v.sizes() != k.sizes()) {
    return absl::InvalidArgumentError(absl::StrCat("v: shape ", internal::ShapeStr(v),
                                                   " differs from k's ", internal::ShapeStr(k)));
  }
  if (auto s = CheckSize(cu_seqlens, "cu_seqlens", 0, q_window.size(0) + 1, "B + 1"); !s.ok()) {
    return s;
  }
  if (auto s = CheckSize(k, "k", 2, q_window.size(3), "head_dim"); !s.ok()) return s;
  if (k.size(1) == 0 || q_window.size(1) % k.size(1) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num query heads ", q_window.size(1), " is not a multiple of num kv heads ", k.size(1)));
  }
  if (cu_seqlens.scalar_type() != at::kLong || cu_seqlens.is_cuda()) {
    return absl::InvalidArgumentError("cu_seqlens: must be an int64 CPU tensor");
  }
  auto cu = cu_seqlens.contiguous();
  const int64_t* cu_ptr = cu.data_ptr<int64_t>();
  if (cu_ptr[0] != 0 || cu_ptr[cu.size(0) - 1] != k.size(0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cu_seqlens: must start at 0 and end at total_n ", k.size(0), ", got ",
                     cu_ptr[0], " .. ", cu_ptr[cu.size(0) - 1]));
  }
  for (int64_t i = 0; i + 1 < cu.size(0); ++i) {
    if (cu_ptr[i + 1] < cu_ptr[i]) {
      return absl::InvalidArgumentError(absl::StrCat("cu_seqlens: decreasing at index ", i + 1));
    }
  }
  if (auto s = CheckParams(params); !s.ok()) return s;
  if (k.is_cuda()) return cuda::DropKvScores(q_window, k, v, cu, params);
  return CatchTorch("DropKvScoresVarlen", [&]() -> absl::StatusOr<at::Tensor> {
    auto out = at::empty({k.size(1), k.size(0)}, k.options().dtype(AccType(q_window)));
    for (int64_t b = 0; b < q_window.size(0); ++b) {
      auto kb = k.slice(0, cu_ptr[b], cu_ptr[b + 1]).transpose(0, 1);  // [Hkv, n_b, D]
      auto vb = v.slice(0, cu_ptr[b], cu_ptr[b + 1]).transpose(0, 1);
      out.slice(1, cu_ptr[b], cu_ptr[b + 1]).copy_(DropKvOneSequence(q_window[b], kb, vb, params));
    }
    return out;
  });
}

namespace {

absl::Status CheckH2o(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const H2oParams& params) {
  if (auto s = CheckQkv(q, k, &v, "q"); !s.ok()) return s;
  if (q.size(2) > k.size(2)) {
    return absl::InvalidArgumentError(
        absl::StrCat("q: ", q.size(2), " queries exceed the ", k.size(2), " keys"));
  }
  if (params.value_norm_p < 0 || params.value_norm_p > 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("value_norm_p must be 0, 1 or 2, got ", params.value_norm_p));
  }
  if (!(params.scale >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("scale must be >= 0, got ", params.scale));
  }
  return absl::OkStatus();
}

// One sequence's raw column sums / g. q [Hq, nq, D], k [Hkv, n, D], lse [Hq, nq] or undefined
// (then a softmax per row) -> [Hkv, n] in the accumulation dtype. Rows go in chunks whose
// [g * rows, keys] block stays within block_bytes; a chunk's rows see only the keys before
// n - nq + its last row, so the block is cut there too.
at::Tensor H2oOneSequence(const at::Tensor& q, const at::Tensor& k, const at::Tensor& lse,
                          double scale, int64_t block_bytes) {
  const int64_t hq = q.size(0), nq = q.size(1), d = q.size(2);
  const int64_t hkv = k.size(0), n = k.size(1), g = hq / hkv;
  const auto acc = AccType(q);
  auto out = at::zeros({hkv, n}, k.options().dtype(acc));
  if (n == 0 || nq == 0) return out;
  const int64_t elem_bytes = acc == at::kDouble ? 8 : 4;
  const int64_t chunk_rows = std::clamp<int64_t>(block_bytes / (g * n * elem_bytes), 1, nq);
  for (int64_t h = 0; h < hkv; ++h) {
    auto kh = k[h].to(acc);  // [n, D]
    auto qh = q.slice(0, h * g, (h + 1) * g);
    for (int64_t r0 = 0; r0 < nq; r0 += chunk_rows) {
      const int64_t r1 = std::min(nq, r0 + chunk_rows), rows = r1 - r0;
      const int64_t num_keys = n - nq + r1;                    // keys the chunk's last row sees
      auto qg = qh.slice(1, r0, r1).to(acc).reshape({-1, d});  // [g*rows, D]
      auto logits = at::matmul(qg, kh.slice(0, 0, num_keys).t()).mul_(scale);  // [g*rows, keys]
      // In place from here on, so that the block is the only one of its size. Row i of the
      // chunk sits at position num_keys - rows + i; the mask broadcasts over the g heads.
      auto hidden = CausalWindowMask(rows, num_keys, k.device()).logical_not_();  // [rows, keys]
      logits.view({g, rows, num_keys})
          .masked_fill_(hidden, -std::numeric_limits<double>::infinity());
      if (lse.defined()) {
        auto lse_rows = lse.slice(0, h * g, (h + 1) * g).slice(1, r0, r1).to(acc).reshape({-1, 1});
        logits.sub_(lse_rows).exp_();
      } else {  // the row's softmax (at::softmax and at::logsumexp would allocate a second block)
        logits.sub_(logits.amax(-1, /*keepdim=*/true)).exp_();
        logits.div_(logits.sum(-1, /*keepdim=*/true));
      }
      out[h].slice(0, 0, num_keys).add_(logits.sum(0));
    }
  }
  return out.div_(static_cast<double>(g));
}

// divide_by_num_queries and the ||v||_p factor on the raw sums / g, [B, Hkv, n] in place.
void H2oFinish(at::Tensor& out, const at::Tensor& v, int64_t nq, const H2oParams& params) {
  const int64_t n = out.size(2);
  if (params.divide_by_num_queries) {
    // Query i (position n - nq + i) sees key j iff j <= n - nq + i: count = nq - max(0,
    // j - (n - nq)).
    auto j = at::arange(n, out.options());
    auto count = (nq - (j - (n - nq)).clamp_min(0)).clamp_min(1);
    out.div_(count);
  }
  if (params.value_norm_p > 0) {
    out.mul_(at::linalg_vector_norm(v.to(out.scalar_type()), params.value_norm_p, {-1}));
  }
}

absl::Status CheckLse(const at::Tensor& lse, const at::Tensor& q) {
  if (auto s = CheckDim(lse, "lse", 3, "[B, Hq, nq]"); !s.ok()) return s;
  for (int64_t i = 0; i < 3; ++i) {
    if (auto s = CheckSize(lse, "lse", i, q.size(i), "q's"); !s.ok()) return s;
  }
  if (lse.device() != q.device()) {
    return absl::InvalidArgumentError("lse: on a different device than q");
  }
  if (!at::isFloatingType(lse.scalar_type())) {
    return absl::InvalidArgumentError("lse: must be a floating-point tensor");
  }
  return absl::OkStatus();
}

}  // namespace

namespace internal {
absl::StatusOr<at::Tensor> H2oScoresAten(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& lse,
                                         const H2oParams& params, int64_t block_bytes) {
  if (auto s = CheckH2o(q, k, v, params); !s.ok()) return s;
  if (lse.defined()) {
    if (auto s = CheckLse(lse, q); !s.ok()) return s;
  }
  return CatchTorch("H2oScores", [&]() -> absl::StatusOr<at::Tensor> {
    const int64_t b = q.size(0);
    const double scale = Scale(params.scale, q.size(3));
    auto out = at::empty({b, k.size(1), k.size(2)}, k.options().dtype(AccType(q)));
    for (int64_t i = 0; i < b; ++i) {
      out[i].copy_(
          H2oOneSequence(q[i], k[i], lse.defined() ? lse[i] : at::Tensor(), scale, block_bytes));
    }
    H2oFinish(out, v, q.size(2), params);
    return out;
  });
}
}  // namespace internal

absl::StatusOr<at::Tensor> H2oScores(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const H2oParams& params) {
  return internal::H2oScoresAten(q, k, v, at::Tensor(), params, kH2oBlockBytes);
}

absl::StatusOr<at::Tensor> H2oScoresFromLse(const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, const at::Tensor& lse,
                                            const H2oParams& params) {
  if (!lse.defined()) return absl::InvalidArgumentError("lse: undefined");
  if (auto s = CheckH2o(q, k, v, params); !s.ok()) return s;
  if (auto s = CheckLse(lse, q); !s.ok()) return s;
  if (k.is_cuda() && cuda::H2oKernelApplies(q, k)) {
    auto sums = cuda::H2oColumnSums(q, k, lse, Scale(params.scale, q.size(3)));
    if (!sums.ok()) return sums.status();
    return CatchTorch("H2oScoresFromLse", [&]() -> absl::StatusOr<at::Tensor> {
      H2oFinish(*sums, v, q.size(2), params);
      return std::move(*sums);
    });
  }
  return internal::H2oScoresAten(q, k, v, lse, params, kH2oBlockBytes);
}

absl::StatusOr<at::Tensor> SnapKvScores(const at::Tensor& q_window, const at::Tensor& k,
                                        const SnapKvParams& params) {
  if (auto s = CheckQkv(q_window, k, nullptr, "q_window"); !s.ok()) return s;
  const int64_t w = q_window.size(2), n = k.size(2);
  if (w >= n) {
    return absl::InvalidArgumentError(
        absl::StrCat("SnapKV: window ", w, " must be smaller than the ", n, " keys"));
  }
  if (params.pool_kernel < 1 || params.pool_kernel % 2 == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool_kernel must be odd and >= 1, got ", params.pool_kernel));
  }
  return CatchTorch("SnapKvScores", [&]() -> absl::StatusOr<at::Tensor> {
    const int64_t b = q_window.size(0), hq = q_window.size(1), d = q_window.size(3);
    const int64_t hkv = k.size(1), g = hq / hkv;
    const double scale = Scale(params.scale, d);
    auto qf = q_window.to(at::kFloat);
    auto kf = k.to(at::kFloat).repeat_interleave(g, 1);            // [B, Hq, n, D]
    auto logits = at::matmul(qf, kf.transpose(2, 3)).mul_(scale);  // [B, Hq, w, n]
    logits.masked_fill_(CausalWindowMask(w, n, k.device()).logical_not(),
                        -std::numeric_limits<double>::infinity());
    // kvpress casts the fp32 softmax back to the query dtype.
    auto attn = at::softmax(logits, -1).to(q_window.scalar_type()).slice(3, 0, n - w);
    auto scores = attn.mean(-2).to(at::kFloat);  // [B, Hq, n-w]
    const int64_t kern = params.pool_kernel;
    scores = at::avg_pool1d(scores.reshape({b * hq, 1, n - w}), {kern}, {1}, {kern / 2})
                 .reshape({b, hkv, g, n - w})
                 .mean(2);  // [B, Hkv, n-w]
    const double top = scores.max().item<double>() + 1.0;
    return at::cat({scores, at::full({b, hkv, w}, top, scores.options())}, -1);
  });
}

absl::StatusOr<at::Tensor> KNormScores(const at::Tensor& k) {
  if (auto s = CheckDim(k, "k", 4, "[B, Hkv, n, D]"); !s.ok()) return s;
  return CatchTorch("KNormScores", [&]() -> absl::StatusOr<at::Tensor> {
    return at::linalg_vector_norm(k.to(at::kFloat), 2, {-1}).neg_();
  });
}

absl::StatusOr<at::Tensor> StreamingLlmScores(const at::Tensor& like, int64_t num_sinks) {
  if (!like.defined() || like.dim() < 3) {
    return absl::InvalidArgumentError("like: expected a [B, Hkv, n, ...] tensor");
  }
  if (num_sinks < 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_sinks must be >= 0, got ", num_sinks));
  }
  return CatchTorch("StreamingLlmScores", [&]() -> absl::StatusOr<at::Tensor> {
    const int64_t n = like.size(2);
    auto opts = at::TensorOptions().dtype(at::kFloat).device(like.device());
    auto pos = at::arange(n, opts);
    pos.slice(0, 0, std::min(num_sinks, n)).fill_(2.0 * static_cast<double>(n));
    return pos.expand({like.size(0), like.size(1), n}).contiguous();
  });
}

absl::StatusOr<at::Tensor> RandomScores(const at::Tensor& like, uint64_t seed) {
  if (!like.defined() || like.dim() < 3) {
    return absl::InvalidArgumentError("like: expected a [B, Hkv, n, ...] tensor");
  }
  return CatchTorch("RandomScores", [&]() -> absl::StatusOr<at::Tensor> {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    auto r = at::rand({like.size(0), like.size(1), like.size(2)}, gen, at::kFloat);
    return r.to(like.device());
  });
}

}  // namespace dropkv::kernels
