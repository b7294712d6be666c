// DepthKV layer metrics (algorithms.md section 3): InfoNCE of mean-pooled post-attention hidden
// states between each text and a word-dropout copy, plus spectral entropy and effective rank of
// the token representations. All math in fp64. Used by dropkv-calibrate (tools/calibrate).
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace dropkv::compression {

// Drops each whitespace-separated word independently with probability `p` (deterministic for a
// given seed); keeps at least one word. Words are re-joined with single spaces.
std::string WordDropout(const std::string& text, double p, uint64_t seed);

// Mean over tokens, then L2-normalised, in fp64.  hidden: [T, H] (any float dtype) -> fp64 [H].
at::Tensor MeanPoolNormalized(const at::Tensor& hidden);

// InfoNCE_i = -log( exp(sim(zo_i, za_i)/tau) / sum_j exp(sim(zo_i, zo_j)/tau) ), averaged over i,
// sim = cosine (rows are re-normalised here).  z_orig, z_aug: [N, H] -> fp64 scalar.
// The denominator runs over the originals zo_j (j = 1..N, including i), as the spec writes it.
// Computed with log-sum-exp. N >= 1, tau > 0, else INVALID_ARGUMENT.
absl::StatusOr<double> InfoNce(const at::Tensor& z_orig, const at::Tensor& z_aug, double tau);

// Of the singular values s of `x` ([T, H], rows = tokens, centred over tokens first):
// spectral entropy  = -sum_i p_i log p_i with p_i = s_i^2 / sum s^2 (eigenvalues of the
// covariance); effective rank    = exp(-sum_i q_i log q_i) with q_i = s_i / sum s (Roy & Vetterli
// 2007).
struct SpectralStats {
  double spectral_entropy = 0.0;
  double effective_rank = 0.0;
};
SpectralStats Spectral(const at::Tensor& x);

}  // namespace dropkv::compression
