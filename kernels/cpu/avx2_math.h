// AVX2 building blocks of the CPU kernels (internal to kernels/cpu/). Each function is compiled
// for AVX2 + FMA + F16C whatever the build's -march (every AVX2 CPU has F16C), so one binary still
// runs on older x86 CPUs: the kernels check CpuHasAvx2() at run time and keep portable loops.
// Functions of a kernel that call these carry DROPKV_AVX2 too (a lambda does not inherit it).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#define DROPKV_CPU_X86 1
#define DROPKV_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace dropkv::kernels::cpu {

inline bool CpuHasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

DROPKV_AVX2 inline __m256 Load8(const float* p) {
  return _mm256_loadu_ps(p);
}
DROPKV_AVX2 inline __m256 Load8(const c10::BFloat16* p) {  // bf16 = the high half of an fp32
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
DROPKV_AVX2 inline __m256 Load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

DROPKV_AVX2 inline float Sum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// exp(x) for x <= 0 (Cephes' expf: x = k ln2 + r, a degree-6 polynomial for exp(r), times 2^k):
// within 2 ulp of std::exp; below -88.38 (and for -inf) it gives 0.
DROPKV_AVX2 inline __m256 Exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  const __m256 k = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  // r = x - k ln2, with ln2 in two parts so that k * ln2_hi is exact.
  x = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  // 2^k from the exponent bits (k = -127 gives 0).
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// x[i] = exp(x[i] - shift) for i < n (x[i] <= shift); returns their sum.
DROPKV_AVX2 inline float ExpShiftSum(float* x, int64_t n, float shift) {
  const __m256 s = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = Sum8(acc);
  for (; i < n; ++i) sum += (x[i] = std::exp(x[i] - shift));
  return sum;
}

}  // namespace dropkv::kernels::cpu
#endif  // __x86_64__
