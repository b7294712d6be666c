// kernels/cpu_gemv.h: y = x W^T (+ bias) for at most 8 rows x, reading W once.
//
// Thread grid: at::parallel_for over output columns n (W's rows) in blocks of kColumnsPerTask;
// within a task, pairs of W rows against groups of up to 4 x rows, one 8-lane accumulator per
// (W row, x row): 2 x 4 accumulators + 2 W vectors + 1 x vector fit the 16 AVX registers, every
// W vector loaded from memory once and used for all x rows of the group (a second group re-reads
// the pair from L1).
#include "kernels/cpu_gemv.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "kernels/check.h"
#include "kernels/cpu/avx2_math.h"

namespace dropkv::kernels {
namespace {

using internal::CheckDim;

// Output columns per task: 256 rows of W at K 576 are 576 KB, ~70 us of reading.
constexpr int64_t kColumnsPerTask = 256;

// The operands of one call: x [M, K] with row stride x_stride, W [N, K] dense, y [M, N] dense.
struct GemvArgs {
  const float* x;
  int64_t x_stride;
  const float* w;
  const float* bias;  // nullptr: none
  float* y;
  int64_t m, n, k;
};

// Columns [n0, n1) of y. Eight partial sums per dot product, as the AVX2 lanes: the rounding
// error grows with K / 8, not K.
void GemvColumnsPortable(const GemvArgs& a, int64_t n0, int64_t n1) {
  const int64_t k8 = a.k / 8 * 8;
  for (int64_t col = n0; col < n1; ++col) {
    const float* w = a.w + col * a.k;
    for (int64_t row = 0; row < a.m; ++row) {
      const float* x = a.x + row * a.x_stride;
      float lanes[8] = {};
      for (int64_t j = 0; j < k8; j += 8) {
        for (int l = 0; l < 8; ++l) lanes[l] += x[j + l] * w[j + l];
      }
      float s = 0;
      for (float lane : lanes) s += lane;
      for (int64_t j = k8; j < a.k; ++j) s += x[j] * w[j];
      a.y[row * a.n + col] = s + (a.bias != nullptr ? a.bias[col] : 0.0f);
    }
  }
}

#ifdef DROPKV_CPU_X86
using cpu::CpuHasAvx2;
using cpu::Sum8;

// kRows x rows (from `x`) against kCols W rows starting at column `col`: y[row, col + c].
template <int kRows, int kCols>
DROPKV_AVX2 void MicroKernel(const GemvArgs& a, const float* x, int64_t first_row, int64_t col) {
  __m256 acc[kCols][kRows];
#pragma GCC unroll 4
  for (int c = 0; c < kCols; ++c) {
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) acc[c][r] = _mm256_setzero_ps();
  }
  const float* w = a.w + col * a.k;
  const int64_t k8 = a.k / 8 * 8;
  for (int64_t j = 0; j < k8; j += 8) {
    __m256 wv[kCols];
#pragma GCC unroll 4
    for (int c = 0; c < kCols; ++c) wv[c] = _mm256_loadu_ps(w + c * a.k + j);
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * a.x_stride + j);
#pragma GCC unroll 4
      for (int c = 0; c < kCols; ++c) acc[c][r] = _mm256_fmadd_ps(wv[c], xv, acc[c][r]);
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < kCols; ++c) {
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      float s = Sum8(acc[c][r]);
      for (int64_t j = k8; j < a.k; ++j) s += x[r * a.x_stride + j] * w[c * a.k + j];
      if (a.bias != nullptr) s += a.bias[col + c];
      a.y[(first_row + r) * a.n + col + c] = s;
    }
  }
}

// All rows of x against kCols W rows, in groups of up to 4 x rows.
template <int kCols>
DROPKV_AVX2 void AllRows(const GemvArgs& a, int64_t col) {
  int64_t row = 0;
  for (; row + 4 <= a.m; row += 4) MicroKernel<4, kCols>(a, a.x + row * a.x_stride, row, col);
  const float* x = a.x + row * a.x_stride;
  switch (a.m - row) {
    case 3:
      MicroKernel<3, kCols>(a, x, row, col);
      break;
    case 2:
      MicroKernel<2, kCols>(a, x, row, col);
      break;
    case 1:
      MicroKernel<1, kCols>(a, x, row, col);
      break;
    default:
      break;
  }
}

DROPKV_AVX2 void GemvColumnsAvx2(const GemvArgs& a, int64_t n0, int64_t n1) {
  int64_t col = n0;
  for (; col + 2 <= n1; col += 2) AllRows<2>(a, col);
  if (col < n1) AllRows<1>(a, col);
}

#endif  // DROPKV_CPU_X86

}  // namespace

bool CpuGemvApplies(const at::Tensor& x, const at::Tensor& weight) {
  return x.defined() && weight.defined() && x.is_cpu() && weight.is_cpu() && !weight.is_mkldnn() &&
         x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.dim() == 2 &&
         x.size(0) >= 1 && x.size(0) <= kCpuGemvMaxRows;
}

absl::StatusOr<at::Tensor> CpuGemv(const at::Tensor& x, const at::Tensor& weight,
                                   const at::Tensor& bias, bool simd) {
  if (auto s = CheckDim(x, "x", 2, "[M, K]"); !s.ok()) return s;
  if (auto s = CheckDim(weight, "weight", 2, "[N, K]"); !s.ok()) return s;
  if (!CpuGemvApplies(x, weight)) {
    return absl::InvalidArgumentError(
        absl::StrCat("CpuGemv: needs CPU fp32 x [M, K] with 1 <= M <= ", kCpuGemvMaxRows,
                     " and a plain fp32 weight, got x ", internal::ShapeStr(x), " ",
                     x.scalar_type(), " on ", x.device().str(), ", weight ", weight.scalar_type()));
  }
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  if (weight.size(1) != k) {
    return absl::InvalidArgumentError(absl::StrCat("CpuGemv: weight ", internal::ShapeStr(weight),
                                                   " does not match x ", internal::ShapeStr(x)));
  }
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != n || !bias.is_cpu() ||
                         bias.scalar_type() != at::kFloat)) {
    return absl::InvalidArgumentError(
        absl::StrCat("CpuGemv: bias must be CPU fp32 [", n, "], got ", internal::ShapeStr(bias)));
  }
  return internal::CatchTorch("CpuGemv", [&]() -> absl::StatusOr<at::Tensor> {
    auto xs = x.stride(1) == 1 ? x : x.contiguous();
    auto w = weight.contiguous();
    auto b = bias.defined() ? bias.contiguous() : bias;
    auto y = at::empty({m, n}, x.options());
    const GemvArgs args{xs.data_ptr<float>(),
                        xs.stride(0),
                        w.data_ptr<float>(),
                        b.defined() ? b.data_ptr<float>() : nullptr,
                        y.data_ptr<float>(),
                        m,
                        n,
                        k};
    auto columns = &GemvColumnsPortable;
#ifdef DROPKV_CPU_X86
    if (simd && CpuHasAvx2()) columns = &GemvColumnsAvx2;
#endif
    at::parallel_for(0, n, kColumnsPerTask,
                     [&](int64_t begin, int64_t end) { columns(args, begin, end); });
    return y;
  });
}

}  // namespace dropkv::kernels
