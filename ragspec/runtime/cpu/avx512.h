// AVX-512 (F, BW, VL): block16(): two blocks of 8 outputs in one 512-bit register, the same bits as block().
// A fragment of gguf_kernel.cpp, included inside its anonymous namespace under the guard that selects this
// instruction set (the build is -march=native: one of these per CPU, chosen at compile time).
#pragma once

// Two blocks at once, 16 outputs in a 512-bit register: per output lane the same integer sums and the same float
// operations in the same order as block() above, so its bits are block()'s; half the instructions (a 2-core
// Zen 4 runs a many-row tile at the rate it issues them, not at its multiply units' rate).
inline __m512i dot_acc16(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

// acc + the dot of u with the 4 bytes at p repeated over the 16 lanes: the bytes read by the instruction itself
// (an embedded broadcast), not by a separate vpbroadcastd that GCC will not fold (a quarter of the tile's
// instructions on a Zen 4).
inline __m512i dot_acc16_at(__m512i acc, __m512i u, const int8_t* p) {
#if defined(__AVX512VNNI__)
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
#else
  int32_t four;
  std::memcpy(&four, p, 4);
  return dot_acc16(acc, u, _mm512_set1_epi32(four));
#endif
}

// 32 bytes of block b (p) and of block b + 1 (p + stride) as one register
inline __m512i pair256(const uint8_t* p, int64_t stride) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + stride)), 1);
}

// 8 fp16 of block b and 8 of block b + 1 (strides in uint16) as 16 floats
inline __m512 pair_half(const uint16_t* p, int64_t stride) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + stride)), 1));
}

// 8 bytes of block b and 8 of block b + 1 as 16 int32 (unsigned or signed bytes)
template <bool SIGNED>
inline __m512i pair_bytes(const uint8_t* p, int64_t stride) {
  const __m128i v = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)),
                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + stride)));
  return SIGNED ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
}

// Group g's scales for blocks b and b + 1 (16 lanes): dv (D*sc for the K-quants), mv (the min term; 0 for s8 and
// u6) and u6's int8 sub-scales sc0, sc1 of its two half groups. Exact: fp16 values, and products of 11 by 6 bits.
template <int FMT>
inline void pair_scales(int64_t g, const uint16_t* d, const uint8_t* mn, int64_t dstep, int64_t mstep, __m512& dv,
                        __m512& mv, __m512i& sc0, __m512i& sc1) {
  mv = _mm512_setzero_ps();
  if constexpr (FMT <= 2) {
    dv = pair_half(d + g * 8, dstep);
    if constexpr (FMT != 2) mv = pair_half(reinterpret_cast<const uint16_t*>(mn) + g * 8, mstep / 2);
  } else if constexpr (FMT == 5) {
    sc0 = pair_bytes<false>(mn + g * 16, mstep);
  } else if constexpr (FMT == 4) {
    const uint16_t* dd = d + (g / 8) * 16;
    dv = _mm512_mul_ps(pair_half(dd, dstep), _mm512_cvtepi32_ps(pair_bytes<false>(mn + g * 16, mstep)));
    mv = _mm512_sub_ps(_mm512_setzero_ps(),
                       _mm512_mul_ps(pair_half(dd + 8, dstep), _mm512_cvtepi32_ps(pair_bytes<false>(mn + g * 16 + 8, mstep))));
  } else {
    dv = pair_half(d + (g / 8) * 8, dstep);
    sc0 = pair_bytes<true>(mn + g * 16, mstep);
    sc1 = pair_bytes<true>(mn + g * 16 + 8, mstep);
  }
}

// Chunk c (4 inputs) of group g of blocks b and b + 1 as unsigned weight bytes q (u4, u5, u6, u4k; not s8), byte
// 4j + t of each half the input t of output j, as vpdpbusd and the AMX tiles read them.
template <int FMT>
inline __m512i pair_bytes_of(int64_t g, int c, const uint8_t* w, const uint8_t* wh, int64_t wstep, int64_t hstep) {
  const __m512i b = pair256(w + g * 128 + 32 * (c % 4), wstep);
  __m512i u = _mm512_and_si512(c < 4 ? b : _mm512_srli_epi16(b, 4), _mm512_set1_epi8(0x0F));
  if constexpr (FMT == 1) {
    const uint64_t bits = *reinterpret_cast<const uint32_t*>(wh + g * 32 + 4 * c) |
                          static_cast<uint64_t>(*reinterpret_cast<const uint32_t*>(wh + hstep + g * 32 + 4 * c)) << 32;
    u = _mm512_or_si512(u, _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(0x10)));
  }
  if constexpr (FMT == 3) {
    const __m512i hv = pair256(wh + g * 64 + 32 * (c / 4), hstep);
    const int k = c % 4;
    const __m512i t = k == 0 ? _mm512_slli_epi16(hv, 4) : k == 1 ? _mm512_slli_epi16(hv, 2)
                      : k == 2 ? hv : _mm512_srli_epi16(hv, 2);
    u = _mm512_or_si512(u, _mm512_and_si512(t, _mm512_set1_epi8(0x30)));
  }
  return u;
}

// y[r][8b .. 8b+16) for R rows of blocks b and b + 1; wstep, hstep, dstep, mstep: from one block's weights, high
// bits, scales (in uint16) and second scales (in bytes) to the next block's.
template <int FMT, int R>
void block16(int64_t G, const int8_t* xq, const float* sx, const float* xs, const int32_t* hs, int64_t K,
             const uint8_t* w, const uint8_t* wh, const uint16_t* d, const uint8_t* mn, float* y, int64_t N,
             int64_t wstep, int64_t hstep, int64_t dstep, int64_t mstep) {
  __m512 acc[R], macc[R];
  __m512i tsum[R];  // u4k8: the super-block's integer sum so far
  for (int r = 0; r < R; ++r) acc[r] = macc[r] = _mm512_setzero_ps(), tsum[r] = _mm512_setzero_si512();
  for (int64_t g = 0; g < G; ++g) {
    __m512 dv, mv;
    __m512i sc0, sc1;
    pair_scales<FMT>(g, d, mn, dstep, mstep, dv, mv, sc0, sc1);
    constexpr int A = (R <= 2 || FMT == 3) ? 2 : 1;
    __m512i isum[A][R];
    for (int a = 0; a < A; ++a)
      for (int r = 0; r < R; ++r) isum[a][r] = _mm512_setzero_si512();
    const int8_t* xg = xq + g * GROUP;
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      __m512i u;
      __mmask64 neg = 0;
      if constexpr (FMT == 2) {
        const __m512i sg = pair256(w + g * 256 + 32 * c, wstep);
        u = _mm512_abs_epi8(sg);  // |w| as unsigned bytes; the sign moves onto x
        neg = _mm512_movepi8_mask(sg);
      } else {
        u = pair_bytes_of<FMT>(g, c, w, wh, wstep, hstep);
      }
      const int a = FMT == 3 ? c / 4 : c % A;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        if constexpr (FMT == 2) {
          int32_t four;
          std::memcpy(&four, xg + r * K + 4 * c, 4);
          __m512i xb = _mm512_set1_epi32(four);
          xb = _mm512_mask_sub_epi8(xb, neg, _mm512_setzero_si512(), xb);  // x in -127..127
          isum[a][r] = dot_acc16(isum[a][r], u, xb);
        } else {
          isum[a][r] = dot_acc16_at(isum[a][r], u, xg + r * K + 4 * c);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512i total;
      if constexpr (FMT == 3) {
        const int32_t* h = hs + (r * G + g) * 2;
        total = _mm512_add_epi32(
            _mm512_mullo_epi32(sc0, _mm512_sub_epi32(isum[0][r], _mm512_set1_epi32(32 * h[0]))),
            _mm512_mullo_epi32(sc1, _mm512_sub_epi32(isum[A - 1][r], _mm512_set1_epi32(32 * h[1]))));
      } else {
        total = A == 2 ? _mm512_add_epi32(isum[0][r], isum[A - 1][r]) : isum[0][r];
      }
      if constexpr (FMT == 5) {
        tsum[r] = _mm512_add_epi32(tsum[r], _mm512_mullo_epi32(sc0, total));
        continue;
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(dv, _mm512_set1_ps(sx[r * G + g])), acc[r]);
      if constexpr (FMT != 2 && FMT != 3) macc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * G + g]), macc[r]);
    }
    if constexpr (FMT == 5) {
      if (g % 8 == 7) {  // block()'s super-block end, 16 lanes
        const int64_t sb = g / 8;
        const __m512 dd = pair_half(d + sb * 16, dstep);
        const __m512 dm = _mm512_sub_ps(_mm512_setzero_ps(), pair_half(d + sb * 16 + 8, dstep));
        for (int r = 0; r < R; ++r) {
          __m512i msum = _mm512_setzero_si512();
          for (int64_t j = 8 * sb; j < 8 * sb + 8; ++j) {
            const int32_t* h = hs + (r * G + j) * 2;
            msum = _mm512_add_epi32(msum, _mm512_mullo_epi32(pair_bytes<false>(mn + j * 16 + 8, mstep),
                                                             _mm512_set1_epi32(h[0] + h[1])));
          }
          const __m512 s8 = _mm512_set1_ps(sx[r * (G / 8) + sb]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tsum[r]), _mm512_mul_ps(dd, s8), acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dm, s8), acc[r]);
          tsum[r] = _mm512_setzero_si512();
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 v = _mm512_add_ps(acc[r], macc[r]);
    _mm512_storeu_ps(y + r * N, v);
  }
}
