// One core's arithmetic peaks, in registers: float32 FMA against AVX2's u8 x s8 dot without VNNI, widened one
// chunk at a time (vpmaddubsw, vpmaddwd, vpaddd) or two chunks' int16 pair sums added before one vpmaddwd (what
// ragspec's GGUF kernel does on such CPUs: docs/decoding.md). No loads, no unpacking: a ceiling no kernel passes.
//   g++ -O3 -march=native -o /tmp/avx2_dot_peak examples/avx2_dot_peak.cpp && /tmp/avx2_dot_peak
#include <immintrin.h>
#include <chrono>
#include <cstdio>
int main() {
  const long iters = 200000000;
  {
    __m256 a[10], x = _mm256_set1_ps(1.0001f), y = _mm256_set1_ps(0.9999f);
    for (int i = 0; i < 10; i++) a[i] = _mm256_set1_ps(i);
    auto t0 = std::chrono::steady_clock::now();
    for (long n = 0; n < iters; n++) {
      for (int i = 0; i < 10; i++) a[i] = _mm256_fmadd_ps(a[i], x, y);
      __asm__ volatile("" : "+x"(x));
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    float out = 0; for (int i = 0; i < 10; i++) out += a[i][0];
    std::printf("float32 FMA: %.1f GFLOP/s (%.3g)\n", iters * 10.0 * 16 / s / 1e9, out);
  }
  {
    __m256i acc[6], u[6], w = _mm256_set1_epi8(-3), ones = _mm256_set1_epi16(1);
    for (int i = 0; i < 6; i++) { acc[i] = _mm256_setzero_si256(); u[i] = _mm256_set1_epi8(i + 1); }
    auto t0 = std::chrono::steady_clock::now();
    for (long n = 0; n < iters; n++) {
      for (int i = 0; i < 6; i++) {
        __m256i p = _mm256_maddubs_epi16(u[i], w);
        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(p, ones));
      }
      for (int i = 0; i < 6; i++) __asm__ volatile("" : "+x"(u[i]));
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    int out = 0; for (int i = 0; i < 6; i++) out += _mm256_extract_epi32(acc[i], 0);
    std::printf("int8, one chunk per widening: %.1f GOP/s (%d)\n", iters * 6.0 * 64 / s / 1e9, out);
  }
  {  // two maddubs products summed in int16 before one widening (llama.cpp's trick where sums cannot saturate)
    __m256i acc[6], u[6], w = _mm256_set1_epi8(-3), v = _mm256_set1_epi8(2), ones = _mm256_set1_epi16(1);
    for (int i = 0; i < 6; i++) { acc[i] = _mm256_setzero_si256(); u[i] = _mm256_set1_epi8(i + 1); }
    auto t0 = std::chrono::steady_clock::now();
    for (long n = 0; n < iters; n++) {
      for (int i = 0; i < 6; i++) {
        __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u[i], w), _mm256_maddubs_epi16(u[i], v));
        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(p, ones));
      }
      for (int i = 0; i < 6; i++) __asm__ volatile("" : "+x"(u[i]));
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    int out = 0; for (int i = 0; i < 6; i++) out += _mm256_extract_epi32(acc[i], 0);
    std::printf("int8, two chunks per widening: %.1f GOP/s (%d)\n", iters * 6.0 * 128 / s / 1e9, out);
  }
}
