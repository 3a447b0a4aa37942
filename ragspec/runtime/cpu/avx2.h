// AVX2 (with F16C and FMA): block(): one block of 8 outputs for R rows, 256-bit lanes; VNNI's dot products where the CPU has them.
// A fragment of gguf_kernel.cpp, included inside its anonymous namespace under the guard that selects this
// instruction set (the build is -march=native: one of these per CPU, chosen at compile time).
#pragma once

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

// Two chunks into one accumulator. Without VNNI their u8 x s8 pair sums are added in int16 before one widening
// (vpmaddwd): exact while the four products of a lane stay under 2^15, so for weights of at most 6 bits (q <= 63:
// 4 * 63 * 127 = 32004), not for s8. On a Zen 3 core this form does 106-132 GOP/s in registers, the one-chunk
// form 59-74 (vpmaddubsw and vpmaddwd share a unit there).
// (VNNI builds keep one chunk per instruction: vpdpbusd widens as it adds.)
// `widen` multiplies the pair sums as they widen: ones, or u4k8's or u6's sub-scale per output in both int16 halves
// of its lane (sc * dot for free, where a separate vpmulld per group and row would cost more than the dot's widening).
inline __m256i dot_acc2(__m256i acc, __m256i u0, __m256i s0, __m256i u1, __m256i s1, __m256i widen) {
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, widen));
}

// Four chunks into one accumulator likewise (weights of at most 5 bits: 8 * 31 * 127 = 31496 < 2^15).
inline __m256i dot_acc4(__m256i acc, const __m256i* u, const int32_t* x, __m256i widen) {
  const __m256i p01 = _mm256_add_epi16(_mm256_maddubs_epi16(u[0], _mm256_set1_epi32(x[0])),
                                       _mm256_maddubs_epi16(u[1], _mm256_set1_epi32(x[1])));
  const __m256i p23 = _mm256_add_epi16(_mm256_maddubs_epi16(u[2], _mm256_set1_epi32(x[2])),
                                       _mm256_maddubs_epi16(u[3], _mm256_set1_epi32(x[3])));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(p01, p23), widen));
}

// Two int16 values in each 32-bit lane, lo in the low half and hi in the high (int32 lanes or values that fit
// int16): the second operand of a vpmaddwd that multiplies and adds two things at once.
inline __m256i pack16(__m256i lo, __m256i hi) {
  return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(hi, 16));
}
inline int32_t pack16(int32_t lo, int32_t hi) {
  return static_cast<int32_t>(static_cast<uint16_t>(lo) | static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16);
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

// Group g of a block's weights as 8 chunks of 32 unsigned bytes u[c] (s8: |w|, its signs in sg[c]).
template <int FMT>
inline void unpack_group(int64_t g, const uint8_t* w, const uint8_t* wh, __m256i* u, __m256i* sg) {
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
    if constexpr (FMT == 3) {  // bits 2k..2k+1 of each byte to bits 4-5: shifts in 16-bit lanes, then a mask
      const __m256i two = _mm256_set1_epi8(0x30);
      for (int h = 0; h < 2; ++h) {
        const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wh + g * 64 + 32 * h));
        u[4 * h + 0] = _mm256_or_si256(u[4 * h + 0], _mm256_and_si256(_mm256_slli_epi16(hv, 4), two));
        u[4 * h + 1] = _mm256_or_si256(u[4 * h + 1], _mm256_and_si256(_mm256_slli_epi16(hv, 2), two));
        u[4 * h + 2] = _mm256_or_si256(u[4 * h + 2], _mm256_and_si256(hv, two));
        u[4 * h + 3] = _mm256_or_si256(u[4 * h + 3], _mm256_and_si256(_mm256_srli_epi16(hv, 2), two));
      }
    }
  }
}

// A block's G groups unpacked into out (G * 256 bytes: chunk c of group g at 256g + 32c), for block<..., true>.
template <int FMT>
void unpack_blocks(int64_t G, const uint8_t* w, const uint8_t* wh, uint8_t* out) {
  for (int64_t g = 0; g < G; ++g) {
    __m256i u[8], sg[8];
    unpack_group<FMT>(g, w, wh, u, sg);
    for (int c = 0; c < 8; ++c) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * 256 + 32 * c), u[c]);
  }
}

// y[r][8b .. 8b+8) for R rows of one block of 8 outputs. d, mn and hs as the format says (see the top). UNPACKED:
// w holds the block's groups already unpacked (256 bytes each, unpack_blocks), for u5 and u6.
template <int FMT, int R, bool UNPACKED = false>
void block(int64_t G, const int8_t* xq, const float* sx, const float* xs, const int32_t* hs, int64_t K,
           const uint8_t* w, const uint8_t* wh, const uint16_t* d, const uint8_t* mn, float* y, int64_t N) {
  __m256 acc[R], macc[R];
  __m256i tsum[R];  // u4k8: the super-block's integer sum so far
  for (int r = 0; r < R; ++r) acc[r] = macc[r] = _mm256_setzero_ps(), tsum[r] = _mm256_setzero_si256();
  // chunks per widening: 1, 2, or 4 where weights have at most 5 bits; the same bits whichever
  const int mode = FMT != 2 && PAIRED ? paired_mode.load(std::memory_order_relaxed) : 0;
  const bool two = mode == 1 || (mode == 2 && FMT == 3), four = mode == 2 && FMT != 3;
  for (int64_t g = 0; g < G; ++g) {
    __m256i u[8], sg[8];
    if constexpr (UNPACKED) {  // unpacked once for every tile of rows (unpack_blocks)
      for (int c = 0; c < 8; ++c) u[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 256 + 32 * c));
    } else {
      unpack_group<FMT>(g, w, wh, u, sg);
    }
    __m256 dv, mv = _mm256_setzero_ps();
    __m256i sc0, sc1;
    if constexpr (FMT <= 2) {
      dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g * 8)));
      if constexpr (FMT != 2) mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn) + g));
    } else if constexpr (FMT == 5) {
      sc0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + g * 16)));
    } else if constexpr (FMT == 4) {  // D*sc and Dmin*mn are exact in float32 (11 by 6 bits)
      const uint16_t* ds = d + (g / 8) * 16;
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + g * 16))));
      const __m256 mq = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + g * 16 + 8))));
      dv = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ds))), sc);
      mv = _mm256_sub_ps(_mm256_setzero_ps(),
                         _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ds + 8))), mq));
    } else {  // FMT 3
      dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + (g / 8) * 8)));
      sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + g * 16)));
      sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + g * 16 + 8)));
    }
    // u4k8 on the paired paths: sc (6 bits) in both halves of each lane, so the widening yields sc * dot (pair
    // sums of 4-bit weights stay under 2^14: a super-block's at most 32 widenings add under 32 * 2 * 2^14 * 63)
    __m256i widen = _mm256_set1_epi16(1), widen1 = widen, scs = widen;
    if constexpr (FMT == 5) widen = pack16(sc0, sc0);
    // u6 on the paired paths likewise: each half's sc (int8) in both int16 halves of its lanes, so the widening
    // yields sc * dot without a vpmulld; scs holds (sc0, sc1) per lane for the -32 term (|half sum| <= 2032)
    if constexpr (FMT == 3) {
      if (two) widen = pack16(sc0, sc0), widen1 = pack16(sc1, sc1), scs = pack16(sc0, sc1);
    }
    // R rows side by side; one or two rows get two integer accumulators each: independent dot-product chains
    // keep the units busy (one chain of 8 dependent vpdpbusd would wait on its latency). Integer sums are exact
    // in any order, so the chains a tile uses never change a row's bits. u6 always keeps its two halves apart.
    constexpr int A = (R <= 2 || FMT == 3) ? 2 : 1;
    __m256i isum[A][R];
    for (int a = 0; a < A; ++a)
      for (int r = 0; r < R; ++r) isum[a][r] = _mm256_setzero_si256();
    if (!two && !four) {  // s8 one chunk at a time: its pair sums need the whole int16 range
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const int a = FMT == 3 ? c / 4 : c % A;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, xq + r * K + g * GROUP + 4 * c, 4);
          __m256i xb = _mm256_set1_epi32(four);
          if constexpr (FMT == 2) xb = _mm256_sign_epi8(xb, sg[c]);
          isum[a][r] = dot_acc(isum[a][r], u[c], xb);
        }
      }
    } else if (four) {  // u4, u5, u4k: eight products per lane, at most 8 * 31 * 127 = 31496
#pragma GCC unroll 2
      for (int c = 0; c < 8; c += 4) {
        const int a = (c / 4) % A;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t f[4];
          std::memcpy(f, xq + r * K + g * GROUP + 4 * c, 16);
          isum[a][r] = dot_acc4(isum[a][r], u + c, f, widen);
        }
      }
    } else {  // chunks two by two (both in one half of a u6 group: c / 4 names the half)
#pragma GCC unroll 4
      for (int c = 0; c < 8; c += 2) {
        const int a = FMT == 3 ? c / 4 : (c / 2) % A;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t four0, four1;
          std::memcpy(&four0, xq + r * K + g * GROUP + 4 * c, 4);
          std::memcpy(&four1, xq + r * K + g * GROUP + 4 * c + 4, 4);
          isum[a][r] = dot_acc2(isum[a][r], u[c], _mm256_set1_epi32(four0), u[c + 1], _mm256_set1_epi32(four1),
                                FMT == 3 && c >= 4 ? widen1 : widen);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m256i total;
      if constexpr (FMT == 3) {
        const int32_t* h = hs + (r * G + g) * 2;
        if (two) {  // sc0 * dot0 + sc1 * dot1 - 32 * (sc0 * sum0 + sc1 * sum1): the same integer as below
          const __m256i m = _mm256_madd_epi16(scs, _mm256_set1_epi32(pack16(h[0], h[1])));
          total = _mm256_sub_epi32(_mm256_add_epi32(isum[0][r], isum[1][r]), _mm256_slli_epi32(m, 5));
        } else {
          total = _mm256_add_epi32(
              _mm256_mullo_epi32(sc0, _mm256_sub_epi32(isum[0][r], _mm256_set1_epi32(32 * h[0]))),
              _mm256_mullo_epi32(sc1, _mm256_sub_epi32(isum[A - 1][r], _mm256_set1_epi32(32 * h[1]))));
        }
      } else {
        total = A == 2 ? _mm256_add_epi32(isum[0][r], isum[A - 1][r]) : isum[0][r];
      }
      if constexpr (FMT == 5) {  // sc * dot: already scaled where the widening took sc
        tsum[r] = _mm256_add_epi32(tsum[r], two || four ? total : _mm256_mullo_epi32(sc0, total));
        continue;
      }
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(dv, _mm256_set1_ps(sx[r * G + g])), acc[r]);
      if constexpr (FMT != 2 && FMT != 3) macc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[r * G + g]), macc[r]);
    }
    if constexpr (FMT == 5) {
      if (g % 8 == 7) {  // the super-block's end: its min term in integers, then its two float operations
        const int64_t sb = g / 8;
        const __m256 dd = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + sb * 16)));
        const __m256 dm = _mm256_sub_ps(_mm256_setzero_ps(),
                                        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + sb * 16 + 8))));
        // Tm = sum over the 8 groups of mn * (the group's xq summed), two groups per vpmaddwd: each lane holds its
        // output's mins of groups j and j + 1 as int16 (6 bits), the row's two sums (|sum| <= 32 * 127) beside
        __m256i mins[4];
        for (int p = 0; p < 4; ++p) {
          const int64_t j = 8 * sb + 2 * p;
          mins[p] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + j * 16 + 8)),
                                                           _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + j * 16 + 24))));
        }
        for (int r = 0; r < R; ++r) {
          __m256i msum = _mm256_setzero_si256();
          for (int p = 0; p < 4; ++p) {
            const int32_t* h = hs + (r * G + 8 * sb + 2 * p) * 2;
            msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mins[p], _mm256_set1_epi32(pack16(h[0] + h[1], h[2] + h[3]))));
          }
          const __m256 s8 = _mm256_set1_ps(sx[r * (G / 8) + sb]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tsum[r]), _mm256_mul_ps(dd, s8), acc[r]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dm, s8), acc[r]);
          tsum[r] = _mm256_setzero_si256();
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * N, _mm256_add_ps(acc[r], macc[r]));
}
