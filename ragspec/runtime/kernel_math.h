// Shared arithmetic of ragspec's C++ CPU kernels (the SiLU of gguf_kernel.cpp and int8_rows.cpp, the softmax of the
// attention kernels, the int8 row quantization of int8_rows.cpp and int8_copy.cpp).
//
// exp: Cephes' expf, x = n·ln2 + r with |r| <= ln2/2, a degree-7 polynomial of r (relative error ~1e-7); one
// scalar, an 8-lane and a 16-lane version of the same operations, so a value's bits never depend on where in a row it
// falls. The callers bound x first (SiLU clamps it to float's range, softmax zeroes what lies below EXP_MIN).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace ragspec_math {

constexpr float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float EXP_C[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                            1.6666665459e-1f, 5.0000001201e-1f};

// exp(x) for x whose 2^n stays in float's range (about -87 .. 88)
inline float exp_in_range(float x) {
  const float n = std::nearbyint(x * LOG2E);
  const float r = (x - n * LN2_HI) - n * LN2_LO;
  float p = EXP_C[0];
  for (int c = 1; c < 6; ++c) p = p * r + EXP_C[c];
  p = (p * (r * r) + r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#if defined(__AVX2__)
inline __m256 exp_in_range8(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HI))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(LN2_LO)));
  __m256 p = _mm256_set1_ps(EXP_C[0]);
  for (int c = 1; c < 6; ++c) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(EXP_C[c]));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

#if defined(__AVX512F__)
inline __m512 exp_in_range16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(LN2_HI))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(LN2_LO)));
  __m512 p = _mm512_set1_ps(EXP_C[0]);
  for (int c = 1; c < 6; ++c) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(EXP_C[c]));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

// exp for SiLU, the argument clamped to float's range
constexpr float EXP_HI = 88.3762626647949f, EXP_LO = -87.3365447504f;

inline float exp1(float x) { return exp_in_range(std::fmin(std::fmax(x, EXP_LO), EXP_HI)); }

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp8(__m256 x) {
  return exp_in_range8(_mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI)));
}
#endif

// h[c] = silu(g[c]) * u[c] for c < n; sixteen or eight lanes at a time where the CPU has them, each lane with the
// operations of the scalar loop, so an element's bits never depend on where the call starts.
inline void silu_mul(const float* g, const float* u, float* h, int64_t n) {
  int64_t c = 0;
#if defined(__AVX512F__)
  for (; c + 16 <= n; c += 16) {
    const __m512 a = _mm512_loadu_ps(g + c);
    const __m512 x = _mm512_sub_ps(_mm512_setzero_ps(), a);
    const __m512 e = exp_in_range16(
        _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI)));
    _mm512_storeu_ps(h + c, _mm512_mul_ps(_mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), _mm512_loadu_ps(u + c)));
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  for (; c + 8 <= n; c += 8) {
    const __m256 a = _mm256_loadu_ps(g + c);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), a));
    _mm256_storeu_ps(h + c, _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), _mm256_loadu_ps(u + c)));
  }
#endif
  for (; c < n; ++c) h[c] = g[c] / (1.0f + exp1(-g[c])) * u[c];
}

constexpr float INT8_MAX_F = 127.0f;

// int8_linear.quantize_rows on one row, from a float row the caller holds (the prompt copy's activations in
// int8_rows.cpp, its weights made at load in int8_copy.cpp): a maximum is exact in any order, and each lane divides
// and rounds as the scalar loop does; returns the row's scale
inline float quantize_row(const float* r, int64_t K, int8_t* o) {
  float top = 0.0f;
  int64_t k = 0;
#if defined(__AVX512F__)
  __m512 tv = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) tv = _mm512_max_ps(tv, _mm512_abs_ps(_mm512_loadu_ps(r + k)));
  top = _mm512_reduce_max_ps(tv);
#endif
  for (; k < K; ++k) top = std::max(top, std::fabs(r[k]));
  const float s = std::max(top, FLT_MIN) / INT8_MAX_F;
  k = 0;
#if defined(__AVX512F__)
  const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-INT8_MAX_F), hi = _mm512_set1_ps(INT8_MAX_F);
  for (; k + 16 <= K; k += 16) {
    __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(r + k), sv),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + k), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
  }
#endif
  for (; k < K; ++k) o[k] = static_cast<int8_t>(std::min(std::max(std::nearbyint(r[k] / s), -INT8_MAX_F), INT8_MAX_F));
  return s;
}

}  // namespace ragspec_math
