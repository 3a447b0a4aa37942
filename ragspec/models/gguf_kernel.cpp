// GGUF-block linears for CPU decoding: weights as 4-, 5- or 8-bit integers in groups of 32 with an fp16
// scale (and min), activations quantised to int8 per row and group of 32 (llama.cpp's Q8 rule), integer dot
// products per group, float sums in a fixed order. Built once per CPU by ragspec/models/gguf_kernel.py.
//
// Why it is batch-invariant: every output y[m, n] is computed by the same instruction sequence whatever the
// number of rows M or the tile a row falls in; row m reads only row m of the activations. So a token's logits
// are bit-identical alone or as one row of a draft tree (tests/test_gguf_linear.py checks it).
//
// Formats (one per weight tensor): groups of 32 input features, w = d*q + m (s8: w = d*q), q in
//   u4: 0..15, u5: 0..31, s8: -127..127.
// Layout: output rows in blocks of 8, so that SIMD lanes run over 8 outputs and a group's 32 products per output
// accumulate in one int32 lane (no horizontal sums). Per block b and group g, chunk c (0..7) holds 4 inputs
// (k = 32g + 4c .. +3) of each of the 8 outputs: byte 4j + t of a chunk = q[8b + j][32g + 4c + t].
//   u4/u5: w [N/8, G, 128]: chunk c in the low nibbles of bytes 32c..32c+31 (c < 4), chunk c+4 in their high
//          nibbles; u5's bit 4 in wh [N/8, G, 32]: bit (4j + t) of the 4 bytes of chunk c.
//   s8:    w [N/8, G, 256], chunk c at bytes 32c..32c+31.
//   d, mn: [N/8, G, 8] fp16 bits.
// Activations: xq int8 [M, K] (-127..127), sx float [M, G] (scale), xs float [M, G] (sx * sum of the group's xq).
// y[m, n] = sum over g (in order) of (d*sx) * dot(q, xq) + m * xs; the dot is exact in int32.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int GROUP = 32;
#if defined(__AVX512VL__)
constexpr int MT = 8;       // rows computed together: a weight group is unpacked once for up to MT rows (32 registers)
#else
constexpr int MT = 4;       // (16 registers)
#endif
constexpr int64_t NB = 4;   // blocks of 8 outputs whose weights stay in cache while every tile of rows passes

#if defined(__F16C__)
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }
#endif

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
inline __m256i dot_acc(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  // u8 x s8 pairs summed to int16 (|u| <= 128, |s| <= 127: never saturates), then pairs to int32
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

inline __m256i bits_to_bytes(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(0x10));
#else
  // byte i gets byte (i / 8) of the bits, then keeps bit (i % 8): ggml's bytes_from_bits_32
  __m256i v = _mm256_set1_epi32(static_cast<int>(bits));
  v = _mm256_shuffle_epi8(v, _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                                                 0x0303030303030303));
  v = _mm256_or_si256(v, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  v = _mm256_cmpeq_epi8(v, _mm256_set1_epi64x(-1));
  return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
#endif
}

// y[r][8b .. 8b+8) for R rows of one block of 8 outputs.
template <int FMT, int R>
void block(int64_t G, const int8_t* xq, const float* sx, const float* xs, int64_t K, const uint8_t* w,
           const uint8_t* wh, const uint16_t* d, const uint16_t* mn, float* y, int64_t N) {
  __m256 acc[R], macc[R];
  for (int r = 0; r < R; ++r) acc[r] = macc[r] = _mm256_setzero_ps();
  const __m128i* dp = reinterpret_cast<const __m128i*>(d);
  const __m128i* mp = reinterpret_cast<const __m128i*>(mn);
  for (int64_t g = 0; g < G; ++g) {
    __m256i u[8], sg[8];
    if constexpr (FMT == 2) {
      for (int c = 0; c < 8; ++c) {
        sg[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 256 + 32 * c));
        u[c] = _mm256_sign_epi8(sg[c], sg[c]);  // |w| as unsigned bytes; the sign moves onto x
      }
    } else {
      const __m256i low = _mm256_set1_epi8(0x0F);
      for (int c = 0; c < 4; ++c) {
        __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 128 + 32 * c));
        u[c] = _mm256_and_si256(b, low);
        u[c + 4] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
      }
      if constexpr (FMT == 1) {
        const uint32_t* hb = reinterpret_cast<const uint32_t*>(wh + g * 32);
        for (int c = 0; c < 8; ++c) u[c] = _mm256_or_si256(u[c], bits_to_bytes(hb[c]));
      }
    }
    const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(dp + g));
    __m256 mv = _mm256_setzero_ps();
    if constexpr (FMT != 2) mv = _mm256_cvtph_ps(_mm_loadu_si128(mp + g));
    // R rows side by side; one or two rows get two integer accumulators each: independent dot-product chains
    // keep the units busy (one chain of 8 dependent vpdpbusd would wait on its latency). Integer sums are exact
    // in any order, so the chains a tile uses never change a row's bits.
    constexpr int A = R <= 2 ? 2 : 1;
    __m256i isum[A][R];
    for (int a = 0; a < A; ++a)
      for (int r = 0; r < R; ++r) isum[a][r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * K + g * GROUP + 4 * c, 4);
        __m256i xb = _mm256_set1_epi32(four);
        if constexpr (FMT == 2) xb = _mm256_sign_epi8(xb, sg[c]);
        isum[c % A][r] = dot_acc(isum[c % A][r], u[c], xb);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256i total = A == 2 ? _mm256_add_epi32(isum[0][r], isum[A - 1][r]) : isum[0][r];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(dv, _mm256_set1_ps(sx[r * G + g])), acc[r]);
      if constexpr (FMT != 2) macc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[r * G + g]), macc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * N, _mm256_add_ps(acc[r], macc[r]));
}
#else
// Plain C, for CPUs without AVX2/F16C/FMA: the same layout, one output at a time.
template <int FMT, int R>
void block(int64_t G, const int8_t* xq, const float* sx, const float* xs, int64_t K, const uint8_t* w,
           const uint8_t* wh, const uint16_t* d, const uint16_t* mn, float* y, int64_t N) {
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 8; ++j) {
      float total = 0.f, mtotal = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t isum = 0;
        for (int c = 0; c < 8; ++c) {
          for (int t = 0; t < 4; ++t) {
            int q;
            if (FMT == 2) {
              q = static_cast<int8_t>(w[g * 256 + 32 * c + 4 * j + t]);
            } else {
              uint8_t b = w[g * 128 + 32 * (c % 4) + 4 * j + t];
              q = c < 4 ? (b & 15) : (b >> 4);
              if (FMT == 1) q |= ((wh[g * 32 + 4 * c + (4 * j + t) / 8] >> ((4 * j + t) % 8)) & 1) << 4;
            }
            isum += q * xq[r * K + g * GROUP + 4 * c + t];
          }
        }
        total = std::fma(static_cast<float>(isum), half_to_float(d[g * 8 + j]) * sx[r * G + g], total);
        if (FMT != 2) mtotal = std::fma(half_to_float(mn[g * 8 + j]), xs[r * G + g], mtotal);
      }
      y[r * N + j] = total + mtotal;
    }
  }
}
#endif

// x [M, K] float32 -> (xq int8 [M, K], sx [M, G], xs [M, G]); each row and group alone.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % GROUP == 0, "quantize_rows: x must be [M, K], K a multiple of 32");
  at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = K / GROUP;
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor sx = at::empty({M, G}, x.options());
  at::Tensor xs = at::empty({M, G}, x.options());
  const float* px = x.data_ptr<float>();
  int8_t* pq = xq.data_ptr<int8_t>();
  float *psx = sx.data_ptr<float>(), *pxs = xs.data_ptr<float>();
  at::parallel_for(0, M * G, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* v = px + i * GROUP;  // row i / G, group i % G: rows are contiguous, so groups are too
      float amax = 0.f;
      for (int j = 0; j < GROUP; ++j) amax = std::fmax(amax, std::fabs(v[j]));
      const float scale = amax / 127.f;
      const float inv = scale > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int j = 0; j < GROUP; ++j) {
        int q = static_cast<int>(std::nearbyint(v[j] * inv));
        q = q > 127 ? 127 : (q < -127 ? -127 : q);
        pq[i * GROUP + j] = static_cast<int8_t>(q);
        sum += q;
      }
      psx[i] = scale;
      pxs[i] = scale * static_cast<float>(sum);
    }
  });
  return {xq, sx, xs};
}

// y [M, N] float32 = quantised x times the block-quantised weight, in the layout above (wh, mn empty where
// the format has none).
at::Tensor qmatmul(const at::Tensor& xq, const at::Tensor& sx, const at::Tensor& xs, const at::Tensor& w,
                   const at::Tensor& wh, const at::Tensor& d, const at::Tensor& mn, int64_t fmt) {
  TORCH_CHECK(xq.is_contiguous() && w.is_contiguous() && d.is_contiguous(), "qmatmul: contiguous inputs");
  TORCH_CHECK(fmt >= 0 && fmt <= 2, "qmatmul: fmt must be 0 (u4), 1 (u5) or 2 (s8)");
  const int64_t M = xq.size(0), K = xq.size(1), G = K / GROUP, N = w.size(0) * 8;
  TORCH_CHECK(w.size(1) == G && d.size(0) == N / 8 && d.size(1) == G, "qmatmul: weights do not match K");
  at::Tensor y = at::empty({M, N}, sx.options());
  const int8_t* px = xq.data_ptr<int8_t>();
  const float *psx = sx.data_ptr<float>(), *pxs = xs.data_ptr<float>();
  const uint8_t* pw = w.data_ptr<uint8_t>();
  const uint8_t* pwh = fmt == 1 ? wh.data_ptr<uint8_t>() : nullptr;
  const uint16_t* pd = reinterpret_cast<const uint16_t*>(d.data_ptr<int16_t>());
  const uint16_t* pm = fmt != 2 ? reinterpret_cast<const uint16_t*>(mn.data_ptr<int16_t>()) : nullptr;
  const int64_t wblock = G * (fmt == 2 ? 256 : 128), hblock = G * 32;
  float* py = y.data_ptr<float>();
  // blocks of outputs per thread; each streams its part of the weight once for all M rows
  at::parallel_for(0, N / 8, NB, [&](int64_t begin, int64_t end) {
    for (int64_t b0 = begin; b0 < end; b0 += NB) {
      for (int64_t m0 = 0; m0 < M; m0 += MT) {
        const int rows = static_cast<int>(std::min<int64_t>(MT, M - m0));
        for (int64_t b = b0; b < std::min(end, b0 + NB); ++b) {
          const uint8_t* wb = pw + b * wblock;
          const uint8_t* hb = pwh ? pwh + b * hblock : nullptr;
          const uint16_t* db = pd + b * G * 8;
          const uint16_t* mb = pm ? pm + b * G * 8 : nullptr;
          const int8_t* x0 = px + m0 * K;
          const float* s0 = psx + m0 * G;
          const float* t0 = pxs + m0 * G;
          float* y0 = py + m0 * N + 8 * b;
          switch (fmt * 16 + rows) {
#define RAGSPEC_CASE(F, R) \
  case F * 16 + R: block<F, R>(G, x0, s0, t0, K, wb, hb, db, mb, y0, N); break;
#if defined(__AVX512VL__)
#define RAGSPEC_ROWS(F) RAGSPEC_CASE(F, 1) RAGSPEC_CASE(F, 2) RAGSPEC_CASE(F, 3) RAGSPEC_CASE(F, 4) \
  RAGSPEC_CASE(F, 5) RAGSPEC_CASE(F, 6) RAGSPEC_CASE(F, 7) RAGSPEC_CASE(F, 8)
#else
#define RAGSPEC_ROWS(F) RAGSPEC_CASE(F, 1) RAGSPEC_CASE(F, 2) RAGSPEC_CASE(F, 3) RAGSPEC_CASE(F, 4)
#endif
            RAGSPEC_ROWS(0) RAGSPEC_ROWS(1) RAGSPEC_ROWS(2)
#undef RAGSPEC_ROWS
#undef RAGSPEC_CASE
          }
        }
      }
    }
  });
  return y;
}

// A whole linear in one call (a decode step runs ~170 of them: one dispatch instead of three or four):
// x [..., K] float32 → y [..., out] = qmatmul(quantize_rows(x)) (+ bias), the padding outputs cut.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& wh, const at::Tensor& d,
                  const at::Tensor& mn, const at::Tensor& bias, int64_t fmt, int64_t out) {
  const int64_t K = x.size(-1);
  auto [xq, sx, xs] = quantize_rows(x.reshape({-1, K}));
  at::Tensor y = qmatmul(xq, sx, xs, w, wh, d, mn, fmt);
  if (y.size(1) != out) y = y.narrow(1, 0, out).contiguous();
  if (bias.numel()) y.add_(bias);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  return y.view(shape);
}

}  // namespace

TORCH_LIBRARY(ragspec_gguf, m) {
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("qmatmul(Tensor xq, Tensor sx, Tensor xs, Tensor w, Tensor wh, Tensor d, Tensor mn, int fmt) -> Tensor");
  m.def("linear(Tensor x, Tensor w, Tensor wh, Tensor d, Tensor mn, Tensor bias, int fmt, int out) -> Tensor");
}

TORCH_LIBRARY_IMPL(ragspec_gguf, CPU, m) {
  m.impl("quantize_rows", &quantize_rows);
  m.impl("qmatmul", &qmatmul);
  m.impl("linear", &linear);
}
