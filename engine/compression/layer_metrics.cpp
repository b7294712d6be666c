#include "engine/compression/layer_metrics.h"

#include <ATen/ATen.h>

#include <random>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"

namespace dropkv::compression {

std::string WordDropout(const std::string& text, double p, uint64_t seed) {
  std::istringstream in(text);
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  std::mt19937_64 rng(seed);
  std::bernoulli_distribution drop(p);
  std::string out;
  std::string first_word = words.empty() ? "" : words.front();
  for (const auto& w : words) {
    if (drop(rng)) continue;
    if (!out.empty()) out += ' ';
    out += w;
  }
  return out.empty() ? first_word : out;  // an empty text has no representation
}

at::Tensor MeanPoolNormalized(const at::Tensor& hidden) {
  at::Tensor z = hidden.to(at::kDouble).mean(0);  // [H]
  return z / z.norm().clamp_min(1e-300);
}

absl::StatusOr<double> InfoNce(const at::Tensor& z_orig, const at::Tensor& z_aug, double tau) {
  if (!(tau > 0)) return absl::InvalidArgumentError(absl::StrCat("tau must be > 0, got ", tau));
  if (!z_orig.defined() || z_orig.dim() != 2 || z_orig.size(0) < 1 ||
      z_aug.sizes() != z_orig.sizes()) {
    return absl::InvalidArgumentError("InfoNce: z_orig and z_aug must both be [N, H], N >= 1");
  }
  auto norm = [](const at::Tensor& z) {
    at::Tensor d = z.to(at::kDouble);
    return d / d.norm(2, {1}, /*keepdim=*/true).clamp_min(1e-300);
  };
  const at::Tensor zo = norm(z_orig), za = norm(z_aug);  // [N, H]
  const at::Tensor positive = (zo * za).sum(1) / tau;    // [N]
  const at::Tensor all = at::matmul(zo, zo.t()) / tau;   // [N, N]: sim(zo_i, zo_j)
  return (at::logsumexp(all, 1) - positive).mean().item<double>();
}

SpectralStats Spectral(const at::Tensor& x) {
  at::Tensor d = x.to(at::kDouble);
  d = d - d.mean(0, /*keepdim=*/true);
  at::Tensor s = at::linalg_svdvals(d);  // [min(T, H)]
  s = s.masked_select(s > 1e-12 * s.max().clamp_min(1e-300));
  SpectralStats out;
  if (s.numel() == 0) return out;
  at::Tensor p = s.pow(2) / s.pow(2).sum();
  out.spectral_entropy = -(p * p.log()).sum().item<double>();
  at::Tensor q = s / s.sum();
  out.effective_rank = std::exp(-(q * q.log()).sum().item<double>());
  return out;
}

}  // namespace dropkv::compression
