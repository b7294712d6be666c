#include "engine/compression/budget.h"

#include <algorithm>
#include <cfenv>
#include <cmath>
#include <fstream>
#include <numeric>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/common/file_util.h"
#include "engine/compression/params.h"
#include "nlohmann/json.hpp"

namespace dropkv::compression {
namespace {

using Real = long double;

absl::Status Invalid(const std::string& msg) {
  return absl::InvalidArgumentError(msg);
}

// Integers in [lo, hi] summing to `total`, closest to `x` by largest remainder: floor everything,
// then hand the missing units to the largest fractional parts (ties: lower layer first). Values
// outside [lo, hi] are clamped first and the difference is spread the same way.
// Precondition: L*lo <= total <= L*hi.
std::vector<int64_t> RoundToTotal(const std::vector<Real>& x, int64_t lo, int64_t hi,
                                  int64_t total) {
  const size_t num_layers = x.size();
  std::vector<int64_t> out(num_layers);
  std::vector<Real> frac(num_layers);
  int64_t sum = 0;
  for (size_t l = 0; l < num_layers; ++l) {
    Real v = std::clamp<Real>(x[l], lo, hi);
    // 1e-9 absorbs float drift so that 151.9999999 counts as 152.
    Real f = std::floor(v + 1e-9L);
    out[l] = std::clamp<int64_t>(static_cast<int64_t>(f), lo, hi);
    frac[l] = std::max<Real>(0, v - out[l]);
    sum += out[l];
  }
  std::vector<size_t> order(num_layers);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return frac[a] > frac[b]; });
  while (sum < total) {  // largest remainders first; cycles only after clamping
    bool moved = false;
    for (size_t l : order) {
      if (sum == total) break;
      if (out[l] < hi) ++out[l], ++sum, moved = true;
    }
    if (!moved) break;
  }
  while (sum > total) {  // smallest remainders lose first
    bool moved = false;
    for (auto it = order.rbegin(); it != order.rend(); ++it) {
      if (sum == total) break;
      if (out[*it] > lo) --out[*it], --sum, moved = true;
    }
    if (!moved) break;
  }
  return out;
}

// Water-filling: x_l = clamp(lambda * w_l, lo, hi) with lambda such that sum x_l = total
// (sum is monotone in lambda; bisection in long double). Precondition: L*lo <= total <= L*hi.
std::vector<Real> WaterFill(const std::vector<Real>& weights, Real lo, Real hi, Real total) {
  auto fill = [&](Real lambda) {
    std::vector<Real> x(weights.size());
    Real sum = 0;
    for (size_t l = 0; l < weights.size(); ++l) {
      x[l] = std::clamp<Real>(lambda * weights[l], lo, hi);
      sum += x[l];
    }
    return std::pair{x, sum};
  };
  Real min_w = *std::min_element(weights.begin(), weights.end());
  Real lambda_lo = 0, lambda_hi = hi / min_w + 1;
  for (int it = 0; it < 200; ++it) {
    Real mid = (lambda_lo + lambda_hi) / 2;
    if (fill(mid).second < total)
      lambda_lo = mid;
    else
      lambda_hi = mid;
  }
  return fill(lambda_hi).first;
}

// MGA importance s_l over the given layers (algorithms.md section 4).
std::vector<Real> MgaWeights(const BudgetOptions& o, const std::vector<int32_t>& layers) {
  std::vector<Real> w;
  for (int32_t l : layers) w.push_back(1.0L / o.profile_values[l]);
  if (o.mga_importance == MgaImportance::kRank) {
    // Rank by InfoNCE ascending: the lowest InfoNCE (most important) gets weight |P|.
    std::vector<size_t> order(layers.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return o.profile_values[layers[a]] < o.profile_values[layers[b]];
    });
    for (size_t r = 0; r < order.size(); ++r) w[order[r]] = static_cast<Real>(order.size() - r);
  }
  return w;
}

// PyramidKV (kvpress 0.5.5 PyramidKVPress.get_layer_budget, window = W): real-valued budget per
// layer, linear in depth, mean n*keep. Returns an empty vector when kvpress falls back to a
// uniform budget (the pyramid would not fit in [W, n - W]).
std::vector<Real> PyramidShares(const BudgetOptions& o, int32_t num_layers, int64_t n) {
  const Real window = static_cast<Real>(o.window);
  const Real q_len = static_cast<Real>(n);
  // Double, not long double: matches Python float arithmetic so parity rounds identically.
  const double max_capacity = static_cast<double>(o.window) + n * o.keep_ratio;
  double min_num = (max_capacity - o.window) / o.pyramid_beta;
  double max_num = (max_capacity - o.window) * 2 - min_num;
  if (max_num >= n - o.window) {
    max_num = static_cast<double>(n - o.window);
    min_num = (max_capacity - o.window) * 2 - max_num;
  }
  if (!(q_len >= max_num && max_num >= min_num && min_num >= window)) return {};
  const double steps = num_layers > 1 ? (max_num - min_num) / (num_layers - 1) : 0.0;
  std::vector<Real> x(num_layers);
  for (int32_t l = 0; l < num_layers; ++l) x[l] = max_num - l * steps;
  return x;
}

}  // namespace

absl::StatusOr<double> KeepRatioFromCompressionRatio(double compression_ratio) {
  if (!(compression_ratio >= 0.0 && compression_ratio < 1.0)) {
    return Invalid(absl::StrCat("compression_ratio: must be in [0, 1), got ", compression_ratio));
  }
  return 1.0 - compression_ratio;  // the same double kvpress computes as (1 - cr)
}

absl::StatusOr<double> KeepRatioFromBudgetTokens(int64_t budget_tokens, int64_t num_tokens) {
  if (budget_tokens <= 0) {
    return Invalid(absl::StrCat("budget_tokens: must be > 0, got ", budget_tokens));
  }
  if (num_tokens <= 0) return 1.0;
  return std::min(1.0, static_cast<double>(budget_tokens) / static_cast<double>(num_tokens));
}

std::vector<int32_t> ProtectedLayers(BudgetAllocator allocator, int32_t num_layers) {
  int32_t k = 0;
  switch (allocator) {
    case BudgetAllocator::kMLP:
    case BudgetAllocator::kMLMA2:
      k = 2;
      break;
    case BudgetAllocator::kMLMA4:
      k = 4;
      break;
    case BudgetAllocator::kMLMA6:
      k = 6;
      break;
    default:
      return {};
  }
  const int32_t mid = num_layers / 2;
  std::vector<int32_t> out;
  for (int32_t l = mid - k / 2 + 1; l <= mid + k / 2; ++l) {
    if (l >= 0 && l < num_layers) out.push_back(l);
  }
  return out;
}

absl::Status ValidateBudgetOptions(const BudgetOptions& o, int32_t num_layers) {
  if (num_layers <= 0) return Invalid(absl::StrCat("num_layers must be > 0, got ", num_layers));
  if (o.allocator != BudgetAllocator::kExplicit && !(o.keep_ratio > 0.0 && o.keep_ratio <= 1.0)) {
    return Invalid(absl::StrCat("keep_ratio: must be in (0, 1], got ", o.keep_ratio));
  }
  if (o.window < 1) return Invalid(absl::StrCat("window: must be >= 1, got ", o.window));
  if (o.num_protected_sinks < 0) {
    return Invalid(absl::StrCat("num_sinks: must be >= 0, got ", o.num_protected_sinks));
  }
  if (AllocatorNeedsProfile(o.allocator)) {
    if (static_cast<int32_t>(o.profile_values.size()) != num_layers) {
      return Invalid(
          absl::StrCat("profile_path: allocator ", std::string(BudgetAllocatorName(o.allocator)),
                       " needs one value per layer; the profile has ", o.profile_values.size(),
                       " values but the model has ", num_layers, " layers"));
    }
    for (size_t l = 0; l < o.profile_values.size(); ++l) {
      if (!(o.profile_values[l] > 0.0) || !std::isfinite(o.profile_values[l])) {
        return Invalid(absl::StrCat("profile_path: the value of layer ", l,
                                    " must be finite and > 0, got ", o.profile_values[l]));
      }
    }
  }
  if (o.allocator == BudgetAllocator::kExplicit) {
    if (static_cast<int32_t>(o.explicit_layer_prune.size()) != num_layers) {
      return Invalid(absl::StrCat("explicit_layer_prune: has ", o.explicit_layer_prune.size(),
                                  " values but the model has ", num_layers, " layers"));
    }
    for (size_t l = 0; l < o.explicit_layer_prune.size(); ++l) {
      double rho = o.explicit_layer_prune[l];
      if (!(rho >= 0.0 && rho < 1.0)) {
        return Invalid(absl::StrCat("explicit_layer_prune[", l, "]: must be in [0, 1), got ", rho));
      }
    }
  }
  if (o.allocator == BudgetAllocator::kPyramid && !(o.pyramid_beta >= 1.0)) {
    return Invalid(absl::StrCat("pyramid_beta: must be >= 1, got ", o.pyramid_beta));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> AllocateLayerBudgets(const BudgetOptions& o,
                                                          int32_t num_layers, int64_t n) {
  if (absl::Status s = ValidateBudgetOptions(o, num_layers); !s.ok()) return s;
  if (n < 0) return Invalid(absl::StrCat("num_tokens must be >= 0, got ", n));
  const int64_t num_l = num_layers;

  if (o.rounding == BudgetRounding::kKvpress) {
    std::vector<int64_t> out(num_layers);
    if (o.allocator == BudgetAllocator::kPyramid) {
      std::vector<Real> x = PyramidShares(o, num_layers, n);
      std::fesetround(FE_TONEAREST);  // Python's round(): half to even
      for (int32_t l = 0; l < num_layers; ++l) {
        out[l] = x.empty() ? std::max<int64_t>(1, std::llrint(n * o.keep_ratio))
                           : std::llrint(static_cast<double>(x[l]));
      }
      return out;
    }
    if (o.allocator != BudgetAllocator::kUniform) {
      return Invalid("kvpress rounding is defined for the uniform and pyramid allocators only");
    }
    std::fill(out.begin(), out.end(), std::max<int64_t>(1, static_cast<int64_t>(n * o.keep_ratio)));
    return out;
  }

  // n <= W: nothing to evict (algorithms.md section 1).
  const int64_t min_keep = std::min(n, o.window + o.num_protected_sinks);
  if (n <= o.window) return std::vector<int64_t>(num_layers, n);

  std::vector<Real> x;
  int64_t total = 0;
  if (o.allocator == BudgetAllocator::kExplicit) {
    Real sum = 0;
    for (double rho : o.explicit_layer_prune) {
      x.push_back((1.0L - rho) * n);
      sum += x.back();
    }
    total = std::llround(static_cast<double>(sum));
  } else {
    total = std::llround(static_cast<double>(num_l) * o.keep_ratio * static_cast<double>(n));
  }
  total = std::clamp(total, num_l * min_keep, num_l * n);

  switch (o.allocator) {
    case BudgetAllocator::kUniform:
      x.assign(num_layers, static_cast<Real>(total) / num_l);
      break;
    case BudgetAllocator::kExplicit:
      break;  // x already holds (1 - rho_l) * n
    case BudgetAllocator::kPyramid: {
      x = PyramidShares(o, num_layers, n);
      if (x.empty()) x.assign(num_layers, static_cast<Real>(total) / num_l);  // kvpress fallback
      break;
    }
    case BudgetAllocator::kMGA: {
      std::vector<int32_t> all(num_layers);
      std::iota(all.begin(), all.end(), 0);
      x = WaterFill(MgaWeights(o, all), min_keep, n, total);
      break;
    }
    case BudgetAllocator::kMLP:
    case BudgetAllocator::kMLMA2:
    case BudgetAllocator::kMLMA4:
    case BudgetAllocator::kMLMA6: {
      const std::vector<int32_t> protected_layers = ProtectedLayers(o.allocator, num_layers);
      std::vector<int32_t> rest;
      for (int32_t l = 0; l < num_layers; ++l) {
        if (std::find(protected_layers.begin(), protected_layers.end(), l) ==
            protected_layers.end()) {
          rest.push_back(l);
        }
      }
      const int64_t protected_tokens = static_cast<int64_t>(protected_layers.size()) * n;
      const int64_t rest_tokens = total - protected_tokens;
      const int64_t rest_min = static_cast<int64_t>(rest.size()) * min_keep;
      if (rest_tokens < rest_min) {
        return Invalid(absl::StrCat(
            "allocator: ", std::string(BudgetAllocatorName(o.allocator)), " keeping layers [",
            absl::StrJoin(protected_layers, ", "), "] whole needs ", protected_tokens,
            " tokens, leaving ", rest_tokens, " of the budget ", total, " (keep_ratio ",
            o.keep_ratio, ", n ", n, ", ", num_layers, " layers) for ", rest.size(),
            " other layers that need at least ", min_keep,
            " each (window + sinks): raise keep_ratio or use another allocator"));
      }
      std::vector<Real> w(rest.size(), 1.0L);
      if (o.allocator != BudgetAllocator::kMLP) w = MgaWeights(o, rest);
      std::vector<Real> rest_x;
      if (!rest.empty()) rest_x = WaterFill(w, min_keep, n, rest_tokens);
      x.assign(num_layers, static_cast<Real>(n));
      for (size_t i = 0; i < rest.size(); ++i) x[rest[i]] = rest_x[i];
      // Protected layers keep n exactly; round the others to the exact remainder.
      std::vector<int64_t> rest_int =
          rest.empty() ? std::vector<int64_t>{} : RoundToTotal(rest_x, min_keep, n, rest_tokens);
      std::vector<int64_t> out(num_layers, n);
      for (size_t i = 0; i < rest.size(); ++i) out[rest[i]] = rest_int[i];
      return out;
    }
  }
  return RoundToTotal(x, min_keep, n, total);
}

absl::StatusOr<LayerProfile> LoadLayerProfile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) return text.status();
  LayerProfile p;
  try {
    nlohmann::json j = nlohmann::json::parse(*text);
    p.model = j.value("model", "");
    p.num_layers = j.at("num_layers").get<int32_t>();
    p.metric = j.value("metric", "infonce");
    p.tau = j.value("tau", 0.1);
    p.num_texts = j.value("num_texts", int64_t{0});
    p.values = j.at("values").get<std::vector<double>>();
    p.created = j.value("created", "");
  } catch (const std::exception& e) {
    return Invalid(absl::StrCat("profile ", path, ": ", e.what()));
  }
  if (static_cast<int32_t>(p.values.size()) != p.num_layers) {
    return Invalid(absl::StrCat("profile ", path, ": num_layers is ", p.num_layers,
                                " but values has ", p.values.size(), " entries"));
  }
  return p;
}

absl::Status SaveLayerProfile(const LayerProfile& p, const std::string& path) {
  nlohmann::json j;
  j["model"] = p.model;
  j["num_layers"] = p.num_layers;
  j["metric"] = p.metric;
  j["tau"] = p.tau;
  j["num_texts"] = p.num_texts;
  j["values"] = p.values;
  j["created"] = p.created;
  std::ofstream out(path);
  if (!out) return absl::InternalError(absl::StrCat("cannot write profile ", path));
  out << j.dump(2) << "\n";
  if (!out) return absl::InternalError(absl::StrCat("write failed: ", path));
  return absl::OkStatus();
}

}  // namespace dropkv::compression
