// GGUF-block linears for CPU decoding: weights as 4-, 5- or 8-bit integers in groups of 32 with an fp16
// scale (and min), activations quantised to int8 per row and group of 32 (llama.cpp's Q8 rule), integer dot
// products per group, float sums in a fixed order. Built once per CPU by ragspec/models/gguf_kernel.py.
//
// Why it is batch-invariant: every output y[m, n] is computed by the same operations in the same order whatever
// the number of rows M or the tile a row falls in (a tile of full rows on AVX-512 runs two blocks of outputs per
// 512-bit register, lane by lane the same operations); row m reads only row m of the activations. So a token's
// logits are bit-identical alone or as one row of a draft tree (tests/test_gguf_linear.py checks it), and the
// AVX-512, AVX2 and plain-C builds give the same bits.
//
// Formats (one per weight tensor): groups of 32 input features, w = d*q + m (s8: w = d*q), q in
//   u4: 0..15, u5: 0..31, s8: -127..127;
//   u4k (Q4_K as it ships): q 0..15, w = (D*sc)*q - Dmin*mn, sc and mn 6-bit per group, D and Dmin fp16 per 8 groups;
//   u6 (Q6_K as it ships): q 0..63, w = (D*sc)*(q - 32), sc int8 per 16 inputs, D fp16 per 8 groups.
// Layout: output rows in blocks of 8, so that SIMD lanes run over 8 outputs and a group's 32 products per output
// accumulate in one int32 lane (no horizontal sums). Per block b and group g, chunk c (0..7) holds 4 inputs
// (k = 32g + 4c .. +3) of each of the 8 outputs: byte 4j + t of a chunk = q[8b + j][32g + 4c + t].
//   u4/u5: w [N/8, G, 128]: chunk c in the low nibbles of bytes 32c..32c+31 (c < 4), chunk c+4 in their high
//          nibbles; u5's bit 4 in wh [N/8, G, 32]: bit (4j + t) of the 4 bytes of chunk c.
//   u6:    w as u4 (the low 4 bits); the top 2 bits in wh [N/8, G, 64]: byte i of the 32 at 32h holds, at bits
//          2k..2k+1, bits 4-5 of byte i of chunk 4h + k.
//   s8:    w [N/8, G, 256], chunk c at bytes 32c..32c+31.
//   d, mn: [N/8, G, 8] fp16 bits (u4, u5, s8);
//          u4k: d [N/8, G/8, 2, 8] fp16 bits (D, Dmin), mn [N/8, G, 2, 8] uint8 (sc, mn);
//          u6:  d [N/8, G/8, 8] fp16 bits (D), mn [N/8, G, 2, 8] int8 (sc of inputs 0-15, of 16-31).
// Activations: xq int8 [M, K] (-127..127), sx float [M, G] (scale), xs float [M, G] (sx * sum of the group's xq).
// y[m, n] = sum over g (in order) of (d*sx) * dot(q, xq) + m * xs; the dot is exact in int32. u6 adds its two
// halves in int32 first: sc0*(dot0 - 32*sum0) + sc1*(dot1 - 32*sum1), sum = the half's xq summed (hs below).
// u4k8 (code 5): Q4_K's weights as u4k, activations with one scale per 256 inputs (llama.cpp's Q8_K rule), so a
// super-block is integers to its end: T = sum over its 8 groups of sc*dot, Tm = sum of mn * (the group's xq
// summed); then y += (D*sx) * T, y += (-Dmin*sx) * Tm, two float operations per 256 inputs instead of two per 32.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/core/Tensor.h>  // not ATen/ATen.h: a third less to compile on a first ask
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "kernel_math.h"

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

// AVX2 without VNNI adds two chunks' pair sums in int16 before widening (dot_acc2 below)
#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512VL__)) && !defined(__AVXVNNI__)
constexpr bool PAIRED = true;
#else
constexpr bool PAIRED = false;
#endif
std::atomic<int> paired_mode{2};  // chunks per widening 1 (0), 2 (1), up to 4 (2); the paired op switches it
std::atomic<int> unpacked_mode{1};  // u5/u6 blocks unpacked once per call on AVX2 builds (1) or per tile (0)

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

// Two chunks into one accumulator. Without VNNI their u8 x s8 pair sums are added in int16 before one widening
// (vpmaddwd): exact while the four products of a lane stay under 2^15, so for weights of at most 6 bits (q <= 63:
// 4 * 63 * 127 = 32004), not for s8. On a Zen 3 core this form does 106-132 GOP/s in registers, the one-chunk
// form 59-74 (vpmaddubsw and vpmaddwd share a unit there).
// (VNNI builds keep one chunk per instruction: vpdpbusd widens as it adds.)
inline __m256i dot_acc2(__m256i acc, __m256i u0, __m256i s0, __m256i u1, __m256i s1) {
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// Four chunks into one accumulator likewise (weights of at most 5 bits: 8 * 31 * 127 = 31496 < 2^15).
inline __m256i dot_acc4(__m256i acc, const __m256i* u, const int32_t* x) {
  const __m256i p01 = _mm256_add_epi16(_mm256_maddubs_epi16(u[0], _mm256_set1_epi32(x[0])),
                                       _mm256_maddubs_epi16(u[1], _mm256_set1_epi32(x[1])));
  const __m256i p23 = _mm256_add_epi16(_mm256_maddubs_epi16(u[2], _mm256_set1_epi32(x[2])),
                                       _mm256_maddubs_epi16(u[3], _mm256_set1_epi32(x[3])));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(p01, p23), _mm256_set1_epi16(1)));
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
          isum[a][r] = dot_acc4(isum[a][r], u + c, f);
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
          isum[a][r] = dot_acc2(isum[a][r], u[c], _mm256_set1_epi32(four0), u[c + 1], _mm256_set1_epi32(four1));
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m256i total;
      if constexpr (FMT == 3) {
        const int32_t* h = hs + (r * G + g) * 2;
        total = _mm256_add_epi32(
            _mm256_mullo_epi32(sc0, _mm256_sub_epi32(isum[0][r], _mm256_set1_epi32(32 * h[0]))),
            _mm256_mullo_epi32(sc1, _mm256_sub_epi32(isum[A - 1][r], _mm256_set1_epi32(32 * h[1]))));
      } else {
        total = A == 2 ? _mm256_add_epi32(isum[0][r], isum[A - 1][r]) : isum[0][r];
      }
      if constexpr (FMT == 5) {
        tsum[r] = _mm256_add_epi32(tsum[r], _mm256_mullo_epi32(sc0, total));
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
        for (int r = 0; r < R; ++r) {
          __m256i msum = _mm256_setzero_si256();
          for (int64_t j = 8 * sb; j < 8 * sb + 8; ++j) {
            const int32_t* h = hs + (r * G + j) * 2;
            msum = _mm256_add_epi32(msum, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                reinterpret_cast<const __m128i*>(mn + j * 16 + 8))), _mm256_set1_epi32(h[0] + h[1])));
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RAGSPEC_BLOCK16 1
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

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__linux__)
#define RAGSPEC_AMX 1
// AMX (Intel Sapphire Rapids and later): a tile instruction computes the integer sums of one group for 16 rows
// and 16 outputs at once (tdpbsud: int8 activations by unsigned weight bytes; tdpbssd for s8), where block16
// issues 8 vpdpbusd per row. The integer sums are exact in any order, and the float operations after them are
// block16's, lane by lane, in its order: the same bits as block16 and block (tests compare the two paths).
struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux hands a process the tile state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA)
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// -1: decide from RAGSPEC_GGUF_AMX (default on) on first use; 0 off; 1 on (the amx op switches it, for tests)
std::atomic<int> amx_mode{-1};

bool amx_on() {
  int mode = amx_mode.load(std::memory_order_relaxed);
  if (mode < 0) {
    const char* env = std::getenv("RAGSPEC_GGUF_AMX");
    mode = (env && std::strcmp(env, "0") == 0) ? 0 : (amx_permitted() ? 1 : 0);
    amx_mode.store(mode, std::memory_order_relaxed);
  }
  return mode == 1;
}

// Tiles: 0 and 1 hold results (16 rows x 16 int32); 2, 3 and 4, 5 two sets of activations (16 rows x 32 bytes:
// a group) and weights (8 rows of 4 inputs x 16 outputs), so that consecutive groups overlap; for u6 (`halves`)
// 2, 3 and 4, 5 are its two half groups (16 inputs each), whose sums it scales apart.
void amx_configure(bool halves) {
  TileConfig c{};
  c.palette = 1;
  c.rows[0] = c.rows[1] = 16;
  c.colsb[0] = c.colsb[1] = 64;
  c.rows[2] = c.rows[4] = 16;
  c.colsb[2] = c.colsb[4] = halves ? 16 : 32;
  c.rows[3] = c.rows[5] = halves ? 4 : 8;
  c.colsb[3] = c.colsb[5] = 64;
  _tile_loadconfig(&c);
}

// u4k8 (amx_super): 0, 1, 2 hold a super-block's sums (16 rows x 16 int32) by the low and high bits of the
// sub-scales and by the mins; 3 a group of activations (16 rows x 32 bytes); 4, 5, 6 the group's weights times
// the low bits, times the high bits, and its mins (8 rows of 4 inputs x 16 outputs each).
void amx_configure_super() {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 3; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  c.rows[3] = 16;
  c.colsb[3] = 32;
  for (int t = 4; t < 7; ++t) c.rows[t] = 8, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// u4k8 on AMX, arguments as amx_pair's: the super-block's integers come out of the tiles whole, so its float
// work is two operations per row and 256 inputs. Each 6-bit sub-scale is split, sc = 16*hi + lo, and the weight
// bytes are taken times lo (<= 15*15) and times hi (<= 15*3): still unsigned bytes, so sum(sc*q*x) over the
// super-block = T_lo + 16*T_hi exactly; the min term sum(mn*x) is a third product against the mins repeated
// over each group's inputs. The same integers as block16's sum of sc*dot and of mn*(group sum), and then its
// float operations in its order: the same bits.
void amx_super(int64_t M, int64_t G, const int8_t* xq, const float* sx, int64_t K, const uint8_t* w,
               const uint16_t* d, const uint8_t* mn, float* y, int64_t N, int64_t wstep, int64_t dstep,
               int64_t mstep) {
  constexpr int R = 16;
  thread_local std::vector<uint8_t> wbytes;
  wbytes.resize(G * 1088 + 64);
  uint8_t* wb = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(wbytes.data()) + 63) & ~uintptr_t(63));
  const __m512i even = _mm512_set1_epi16(0x00FF);
  for (int64_t g = 0; g < G; ++g) {  // per group: 512 bytes q*lo, 512 bytes q*hi, 64 bytes of mins
    const __m512i sc = pair_bytes<false>(mn + g * 16, mstep), mins = pair_bytes<false>(mn + g * 16 + 8, mstep);
    const __m512i lo = _mm512_and_si512(sc, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(sc, 4);
    const __m512i lo2 = _mm512_or_si512(lo, _mm512_slli_epi32(lo, 16)), hi2 = _mm512_or_si512(hi, _mm512_slli_epi32(hi, 16));
    uint8_t* out = wb + g * 1088;
    for (int c = 0; c < 8; ++c) {
      const __m512i u = pair_bytes_of<4>(g, c, w, nullptr, wstep, 0);
      const __m512i ue = _mm512_and_si512(u, even), uo = _mm512_srli_epi16(u, 8);
      const __m512i plo = _mm512_or_si512(_mm512_mullo_epi16(ue, lo2), _mm512_slli_epi16(_mm512_mullo_epi16(uo, lo2), 8));
      const __m512i phi = _mm512_or_si512(_mm512_mullo_epi16(ue, hi2), _mm512_slli_epi16(_mm512_mullo_epi16(uo, hi2), 8));
      _mm512_store_si512(out + 64 * c, plo);
      _mm512_store_si512(out + 512 + 64 * c, phi);
    }
    _mm512_store_si512(out + 1024, _mm512_mullo_epi32(mins, _mm512_set1_epi32(0x01010101)));
  }
  alignas(64) int32_t tsum[3][R * 16];
  alignas(64) float acc[R][16];
  for (int64_t m0 = 0; m0 < M; m0 += R) {
    const int8_t* xt = xq + m0 * K;
    std::memset(acc, 0, sizeof acc);
    for (int64_t sb = 0; sb < G / 8; ++sb) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      for (int64_t g = 8 * sb; g < 8 * sb + 8; ++g) {
        const uint8_t* wg = wb + g * 1088;
        _tile_loadd(3, xt + g * GROUP, K);
        _tile_loadd(4, wg, 64);
        _tile_loadd(5, wg + 512, 64);
        _tile_loadd(6, wg + 1024, 0);  // the mins' 64 bytes for every row of 4 inputs
        _tile_dpbsud(0, 3, 4);
        _tile_dpbsud(1, 3, 5);
        _tile_dpbsud(2, 3, 6);
      }
      _tile_stored(0, tsum[0], 64);
      _tile_stored(1, tsum[1], 64);
      _tile_stored(2, tsum[2], 64);
      const __m512 dd = pair_half(d + sb * 16, dstep);
      const __m512 dm = _mm512_sub_ps(_mm512_setzero_ps(), pair_half(d + sb * 16 + 8, dstep));
      for (int r = 0; r < R; ++r) {
        const __m512i t = _mm512_add_epi32(_mm512_load_si512(tsum[0] + r * 16),
                                           _mm512_slli_epi32(_mm512_load_si512(tsum[1] + r * 16), 4));
        const __m512 s8 = _mm512_set1_ps(sx[(m0 + r) * (G / 8) + sb]);
        __m512 a = _mm512_load_ps(acc[r]);
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dd, s8), a);
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(tsum[2] + r * 16)), _mm512_mul_ps(dm, s8), a);
        _mm512_store_ps(acc[r], a);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (m0 + r) * N, _mm512_add_ps(_mm512_load_ps(acc[r]), _mm512_setzero_ps()));
  }
}

// y[r][8b .. 8b+16) for rows [0, M) (M a multiple of 16) of blocks b and b + 1, arguments as block16's. The
// pair's weights are unpacked to bytes (and its scales to floats) once for all the tiles of rows.
template <int FMT>
void amx_pair(int64_t M, int64_t G, const int8_t* xq, const float* sx, const float* xs, const int32_t* hs,
              int64_t K, const uint8_t* w, const uint8_t* wh, const uint16_t* d, const uint8_t* mn, float* y,
              int64_t N, int64_t wstep, int64_t hstep, int64_t dstep, int64_t mstep) {
  constexpr int R = 16, GC = 8;  // rows of a tile; groups whose integer sums are taken before their float sums
  thread_local std::vector<uint8_t> wbytes;
  thread_local std::vector<float> scales;
  wbytes.resize(G * 512 + 64);
  scales.resize(G * 64 + 16);
  uint8_t* wb = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(wbytes.data()) + 63) & ~uintptr_t(63));
  float* dvs = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scales.data()) + 63) & ~uintptr_t(63));
  float* mvs = dvs + G * 16;
  int32_t* sc0s = reinterpret_cast<int32_t*>(mvs + G * 16);
  int32_t* sc1s = sc0s + G * 16;
  for (int64_t g = 0; g < G; ++g) {
    __m512 dv, mv;
    __m512i sc0, sc1;
    pair_scales<FMT>(g, d, mn, dstep, mstep, dv, mv, sc0, sc1);
    _mm512_store_ps(dvs + g * 16, dv);
    _mm512_store_ps(mvs + g * 16, mv);
    if constexpr (FMT == 3) {
      _mm512_store_si512(sc0s + g * 16, sc0);
      _mm512_store_si512(sc1s + g * 16, sc1);
    }
    for (int c = 0; c < 8; ++c) {
      __m512i u;
      if constexpr (FMT == 2) {
        u = pair256(w + g * 256 + 32 * c, wstep);  // signed weights as they are (tdpbssd)
      } else {
        u = pair_bytes_of<FMT>(g, c, w, wh, wstep, hstep);
        if constexpr (FMT == 3) u = _mm512_sub_epi8(u, _mm512_set1_epi8(32));  // q - 32 as signed bytes (tdpbssd)
      }
      _mm512_store_si512(wb + g * 512 + 64 * c, u);
    }
  }
  alignas(64) int32_t isum[GC][2][R * 16];
  alignas(64) float acc[R][16], macc[R][16];
  for (int64_t m0 = 0; m0 < M; m0 += R) {
    const int8_t* xt = xq + m0 * K;
    const float* st = sx + m0 * G;
    const float* tt = xs + m0 * G;
    std::memset(acc, 0, sizeof acc);
    std::memset(macc, 0, sizeof macc);
    for (int64_t g0 = 0; g0 < G; g0 += GC) {
      const int gn = static_cast<int>(std::min<int64_t>(GC, G - g0));
      for (int gi = 0; gi < gn; ++gi) {
        const int64_t g = g0 + gi;
        const int8_t* xg = xt + g * GROUP;
        if constexpr (FMT == 3) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_loadd(2, xg, K);
          _tile_loadd(3, wb + g * 512, 64);
          _tile_loadd(4, xg + 16, K);
          _tile_loadd(5, wb + g * 512 + 256, 64);
          _tile_dpbssd(0, 2, 3);
          _tile_dpbssd(1, 4, 5);
          _tile_stored(0, isum[gi][0], 64);
          _tile_stored(1, isum[gi][1], 64);
        } else if (gi % 2 == 0) {
          _tile_zero(0);
          _tile_loadd(2, xg, K);
          _tile_loadd(3, wb + g * 512, 64);
          if constexpr (FMT == 2) _tile_dpbssd(0, 2, 3);
          else _tile_dpbsud(0, 2, 3);
          _tile_stored(0, isum[gi][0], 64);
        } else {
          _tile_zero(1);
          _tile_loadd(4, xg, K);
          _tile_loadd(5, wb + g * 512, 64);
          if constexpr (FMT == 2) _tile_dpbssd(1, 4, 5);
          else _tile_dpbsud(1, 4, 5);
          _tile_stored(1, isum[gi][0], 64);
        }
      }
      for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h+8: their sums stay in registers across the chunk's groups
        __m512 a[8], ma[8];
        for (int r = 0; r < 8; ++r) a[r] = _mm512_load_ps(acc[8 * h + r]), ma[r] = _mm512_load_ps(macc[8 * h + r]);
        for (int gi = 0; gi < gn; ++gi) {
          const int64_t g = g0 + gi;
          const __m512 dv = _mm512_load_ps(dvs + g * 16), mv = _mm512_load_ps(mvs + g * 16);
          __m512 sc0, sc1;
          if constexpr (FMT == 3) {
            sc0 = _mm512_cvtepi32_ps(_mm512_load_si512(sc0s + g * 16));
            sc1 = _mm512_cvtepi32_ps(_mm512_load_si512(sc1s + g * 16));
          }
#pragma GCC unroll 8
          for (int r8 = 0; r8 < 8; ++r8) {
            const int r = 8 * h + r8;
            __m512 total;
            if constexpr (FMT == 3) {
              // sc0 * s0 + sc1 * s1 in floats: every product and the sum are integers below 2^24 (|s| <= 16 * 32 *
              // 127, |sc| <= 128), so exact, the same value block16 takes in integers
              total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(isum[gi][1] + r * 16)), sc1,
                                      _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(isum[gi][0] + r * 16)), sc0));
            } else {
              total = _mm512_cvtepi32_ps(_mm512_load_si512(isum[gi][0] + r * 16));
            }
            a[r8] = _mm512_fmadd_ps(total, _mm512_mul_ps(dv, _mm512_set1_ps(st[r * G + g])), a[r8]);
            if constexpr (FMT != 2 && FMT != 3) ma[r8] = _mm512_fmadd_ps(mv, _mm512_set1_ps(tt[r * G + g]), ma[r8]);
          }
        }
        for (int r = 0; r < 8; ++r) _mm512_store_ps(acc[8 * h + r], a[r]), _mm512_store_ps(macc[8 * h + r], ma[r]);
      }
    }
    for (int r = 0; r < R; ++r)
      _mm512_storeu_ps(y + (m0 + r) * N, _mm512_add_ps(_mm512_load_ps(acc[r]), _mm512_load_ps(macc[r])));
  }
}
#endif
#endif
#else
// Plain C, for CPUs without AVX2/F16C/FMA: the same layout, one output at a time.
template <int FMT, int R>
void block(int64_t G, const int8_t* xq, const float* sx, const float* xs, const int32_t* hs, int64_t K,
           const uint8_t* w, const uint8_t* wh, const uint16_t* d, const uint8_t* mn, float* y, int64_t N) {
  const uint16_t* mh = reinterpret_cast<const uint16_t*>(mn);
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 8; ++j) {
      float total = 0.f, mtotal = 0.f;
      int32_t tsum = 0, msum = 0;  // u4k8
      for (int64_t g = 0; g < G; ++g) {
        int32_t isum[2] = {0, 0};
        for (int c = 0; c < 8; ++c) {
          for (int t = 0; t < 4; ++t) {
            int q;
            if (FMT == 2) {
              q = static_cast<int8_t>(w[g * 256 + 32 * c + 4 * j + t]);
            } else {
              uint8_t b = w[g * 128 + 32 * (c % 4) + 4 * j + t];
              q = c < 4 ? (b & 15) : (b >> 4);
              if (FMT == 1) q |= ((wh[g * 32 + 4 * c + (4 * j + t) / 8] >> ((4 * j + t) % 8)) & 1) << 4;
              if (FMT == 3) q |= ((wh[g * 64 + 32 * (c / 4) + 4 * j + t] >> (2 * (c % 4))) & 3) << 4;
            }
            isum[c / 4] += q * xq[r * K + g * GROUP + 4 * c + t];
          }
        }
        float dv, mv = 0.f;
        int32_t whole = isum[0] + isum[1];
        if (FMT == 5) {  // integers to the super-block's end, then its two float operations
          const int32_t* h = hs + (r * G + g) * 2;
          tsum += mn[g * 16 + j] * whole;
          msum += mn[g * 16 + 8 + j] * (h[0] + h[1]);
          if (g % 8 == 7) {
            const float s8 = sx[r * (G / 8) + g / 8];
            const float dd = half_to_float(d[(g / 8) * 16 + j]), dm = -half_to_float(d[(g / 8) * 16 + 8 + j]);
            total = std::fma(static_cast<float>(tsum), dd * s8, total);
            total = std::fma(static_cast<float>(msum), dm * s8, total);
            tsum = msum = 0;
          }
          continue;
        }
        if (FMT <= 2) {
          dv = half_to_float(d[g * 8 + j]);
          if (FMT != 2) mv = half_to_float(mh[g * 8 + j]);
        } else if (FMT == 4) {
          dv = half_to_float(d[(g / 8) * 16 + j]) * static_cast<float>(mn[g * 16 + j]);
          mv = -(half_to_float(d[(g / 8) * 16 + 8 + j]) * static_cast<float>(mn[g * 16 + 8 + j]));
        } else {
          const int8_t* sc = reinterpret_cast<const int8_t*>(mn) + g * 16;
          const int32_t* h = hs + (r * G + g) * 2;
          dv = half_to_float(d[(g / 8) * 8 + j]);
          whole = sc[j] * (isum[0] - 32 * h[0]) + sc[8 + j] * (isum[1] - 32 * h[1]);
        }
        total = std::fma(static_cast<float>(whole), dv * sx[r * G + g], total);
        if (FMT != 2 && FMT != 3) mtotal = std::fma(mv, xs[r * G + g], mtotal);
      }
      y[r * N + j] = total + mtotal;
    }
  }
}
#endif

// One span of S floats (a group of 32, or a super-block of 256 for u4k8) -> int8 (-127..127) with its scale, and
// scale * the sum of the int8 values: llama.cpp's Q8 rule (Q8_K's for 256). Every quantisation of activations goes
// through here, so a span's bits never depend on the caller.
template <int S = GROUP>
inline void quantize_group(const float* v, int8_t* q, float* scale_out, float* sum_out) {
#if defined(__AVX512F__)
  // the same operations 16 lanes at a time (max and the integer sum are exact in any order)
  __m512 m = _mm512_setzero_ps();
  for (int i = 0; i < S; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(v + i)));
  const float amax = _mm512_reduce_max_ps(m);
  const float scale = amax / 127.f;
  const __m512 inv = _mm512_set1_ps(scale > 0.f ? 127.f / amax : 0.f);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  constexpr int NEAREST = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m512i total = _mm512_setzero_si512();
  for (int i = 0; i < S; i += 16) {
    const __m512 a = _mm512_loadu_ps(v + i);
    const __m512i qa = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(a, inv), NEAREST)), lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(qa));
    total = _mm512_add_epi32(total, qa);
  }
  *scale_out = scale;
  *sum_out = scale * static_cast<float>(_mm512_reduce_add_epi32(total));
#else
  float amax = 0.f;
  for (int j = 0; j < S; ++j) amax = std::fmax(amax, std::fabs(v[j]));
  const float scale = amax / 127.f;
  const float inv = scale > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int j = 0; j < S; ++j) {
    int v8 = static_cast<int>(std::nearbyint(v[j] * inv));
    v8 = v8 > 127 ? 127 : (v8 < -127 ? -127 : v8);
    q[j] = static_cast<int8_t>(v8);
    sum += v8;
  }
  *scale_out = scale;
  *sum_out = scale * static_cast<float>(sum);
#endif
}

// x [M, K] float32 -> (xq int8 [M, K], sx [M, G], xs [M, G]); each row and span (`span` 32, or 256 for u4k8:
// then G = K / 256) alone.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x_in, int64_t span) {
  TORCH_CHECK(span == GROUP || span == 8 * GROUP, "quantize_rows: span must be 32 or 256");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % span == 0, "quantize_rows: x must be [M, K], K a multiple of ",
              span);
  at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = K / span;
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor sx = at::empty({M, G}, x.options());
  at::Tensor xs = at::empty({M, G}, x.options());
  const float* px = x.data_ptr<float>();
  int8_t* pq = xq.data_ptr<int8_t>();
  float *psx = sx.data_ptr<float>(), *pxs = xs.data_ptr<float>();
  at::parallel_for(0, M * G, 256, [&](int64_t begin, int64_t end) {
    // row i / G, group i % G: rows are contiguous, so groups are too
    for (int64_t i = begin; i < end; ++i) {
      if (span == GROUP) quantize_group<GROUP>(px + i * span, pq + i * span, psx + i, pxs + i);
      else quantize_group<8 * GROUP>(px + i * span, pq + i * span, psx + i, pxs + i);
    }
  });
  return {xq, sx, xs};
}

// A block-quantised weight as qmatmul reads it: pointers and the bytes of each block of 8 outputs (weights, high
// bits, scales (d: fp16 values), second scales (mn: bytes)).
struct Blocks {
  const uint8_t* w;
  const uint8_t* wh;
  const uint16_t* d;
  const uint8_t* mn;
  int64_t wblock, hblock, dblock, mblock, fmt, N, G;
};

Blocks blocks_of(const at::Tensor& w, const at::Tensor& wh, const at::Tensor& d, const at::Tensor& mn, int64_t fmt,
                 int64_t K) {
  TORCH_CHECK(w.is_contiguous() && d.is_contiguous() && mn.is_contiguous() && wh.is_contiguous(),
              "qmatmul: contiguous inputs");
  TORCH_CHECK(fmt >= 0 && fmt <= 5, "qmatmul: fmt must be 0 (u4), 1 (u5), 2 (s8), 3 (u6), 4 (u4k) or 5 (u4k8)");
  const int64_t G = K / GROUP, N = w.size(0) * 8;
  const bool super = fmt >= 3;  // scales per 8 groups (a GGUF super-block of 256 inputs)
  TORCH_CHECK(w.size(1) == G && d.size(0) == N / 8 && d.size(1) == (super ? G / 8 : G) && (!super || G % 8 == 0),
              "qmatmul: weights do not match K");
  Blocks b;
  b.wblock = G * (fmt == 2 ? 256 : 128);
  b.hblock = G * (fmt == 1 ? 32 : fmt == 3 ? 64 : 0);
  b.dblock = fmt >= 4 ? G / 8 * 16 : fmt == 3 ? G : G * 8;
  b.mblock = fmt == 2 ? 0 : G * 16;
  TORCH_CHECK(wh.numel() == N / 8 * b.hblock && d.numel() * d.element_size() == N / 8 * b.dblock * 2 &&
              mn.numel() * mn.element_size() == N / 8 * b.mblock, "qmatmul: scales do not match the format");
  b.w = w.data_ptr<uint8_t>();
  b.wh = b.hblock ? static_cast<const uint8_t*>(wh.data_ptr()) : nullptr;
  b.d = static_cast<const uint16_t*>(d.data_ptr());
  b.mn = b.mblock ? static_cast<const uint8_t*>(mn.data_ptr()) : nullptr;
  b.fmt = fmt;
  b.N = N;
  b.G = G;
  return b;
}

// u6: each row's xq summed over each half group (16 inputs), the -32 of its weights applied in integers
std::vector<int32_t> half_sums(const int8_t* px, int64_t M, int64_t G) {
  std::vector<int32_t> hs(M * G * 2);
  at::parallel_for(0, static_cast<int64_t>(hs.size()), 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int32_t sum = 0;
      for (int t = 0; t < 16; ++t) sum += px[i * 16 + t];
      hs[i] = sum;
    }
  });
  return hs;
}

// Outputs of blocks [b0, bend) for all M rows into y (the first output of block b0 at y[0], rows ldy apart);
// the blocks' weights stay in cache while every tile of rows passes.
void run_blocks(const Blocks& W, const int8_t* px, const float* psx, const float* pxs, const int32_t* hs, int64_t M,
                int64_t K, int64_t b0, int64_t bend, float* y, int64_t ldy) {
  const int64_t G = W.G, SG = W.fmt == 5 ? G / 8 : G;  // activation scales per row
  int64_t m0 = 0;
#if defined(RAGSPEC_AMX)
  // full tiles of 16 rows on AMX, two blocks at a time (an odd last block in tiles of 8 rows); from 32 rows (16 for
  // s8, which has no min term), where it pays for unpacking the weights to bytes (measured on a Sapphire Rapids)
  if (M >= (W.fmt == 2 || W.fmt == 5 ? 16 : 32) && bend - b0 >= 2 && amx_on()) {
    const int64_t M16 = M / 16 * 16;
    if (W.fmt == 5) amx_configure_super();
    else amx_configure(W.fmt == 3);
    for (int64_t b = b0; b < bend;) {
      const uint8_t* wb = W.w + b * W.wblock;
      const uint8_t* hb = W.wh ? W.wh + b * W.hblock : nullptr;
      const uint16_t* db = W.d + b * W.dblock;
      const uint8_t* mb = W.mn ? W.mn + b * W.mblock : nullptr;
      float* y0 = y + 8 * (b - b0);
      const bool pair = b + 1 < bend;
      switch (W.fmt * 2 + pair) {
#define RAGSPEC_AMX_CASE(F) \
  case F * 2 + 1: \
    amx_pair<F>(M16, G, px, psx, pxs, hs, K, wb, hb, db, mb, y0, ldy, W.wblock, W.hblock, W.dblock, W.mblock); break; \
  case F * 2: \
    for (int64_t r0 = 0; r0 < M16; r0 += 8) \
      block<F, 8>(G, px + r0 * K, psx + r0 * SG, pxs + r0 * SG, hs ? hs + r0 * G * 2 : nullptr, K, wb, hb, db, mb, \
                  y0 + r0 * ldy, ldy); \
    break;
        RAGSPEC_AMX_CASE(0) RAGSPEC_AMX_CASE(1) RAGSPEC_AMX_CASE(2) RAGSPEC_AMX_CASE(3) RAGSPEC_AMX_CASE(4)
        case 5 * 2 + 1:
          amx_super(M16, G, px, psx, K, wb, db, mb, y0, ldy, W.wblock, W.dblock, W.mblock);
          break;
        case 5 * 2:
          for (int64_t r0 = 0; r0 < M16; r0 += 8)
            block<5, 8>(G, px + r0 * K, psx + r0 * SG, nullptr, hs + r0 * G * 2, K, wb, hb, db, mb, y0 + r0 * ldy, ldy);
          break;
#undef RAGSPEC_AMX_CASE
      }
      b += pair ? 2 : 1;
    }
    _tile_release();
    m0 = M16;
  }
#endif
  // u5 and u6 where AVX-512's byte masks are missing (their high bits cost 5-6 instructions a chunk to unpack):
  // the blocks unpacked once, then read as bytes by every tile of rows. The same bytes, so the same bits.
  const uint8_t* unpacked = nullptr;
  int64_t per = 0;
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__) && !defined(__AVX512VL__)
  if ((W.fmt == 1 || W.fmt == 3) && M - m0 >= 2 * MT && unpacked_mode.load(std::memory_order_relaxed)) {
    thread_local std::vector<uint8_t> scratch;
    per = G * 256;
    if (static_cast<int64_t>(scratch.size()) < (bend - b0) * per) scratch.resize((bend - b0) * per);
    for (int64_t b = b0; b < bend; ++b) {
      uint8_t* out = scratch.data() + (b - b0) * per;
      if (W.fmt == 1) unpack_blocks<1>(G, W.w + b * W.wblock, W.wh + b * W.hblock, out);
      else unpack_blocks<3>(G, W.w + b * W.wblock, W.wh + b * W.hblock, out);
    }
    unpacked = scratch.data();
  }
#endif
  for (; m0 < M; m0 += MT) {
    const int rows = static_cast<int>(std::min<int64_t>(MT, M - m0));
    for (int64_t b = b0; b < bend;) {
      const uint8_t* wb = unpacked ? unpacked + (b - b0) * per : W.w + b * W.wblock;
      const uint8_t* hb = W.wh && !unpacked ? W.wh + b * W.hblock : nullptr;
      const uint16_t* db = W.d + b * W.dblock;
      const uint8_t* mb = W.mn ? W.mn + b * W.mblock : nullptr;
      const int8_t* x0 = px + m0 * K;
      const float* s0 = psx + m0 * SG;
      const float* t0 = pxs + m0 * SG;
      const int32_t* h0 = hs ? hs + m0 * G * 2 : nullptr;
      float* y0 = y + m0 * ldy + 8 * (b - b0);
#if defined(RAGSPEC_BLOCK16)
      // two blocks in one 512-bit pass (the same bits as one at a time): faster for full tiles of rows, slower
      // for a few rows (measured on a Zen 4)
      const bool pair = rows >= 7 && b + 1 < bend;
#else
      constexpr bool pair = false;
#endif
      switch (W.fmt * 32 + pair * 16 + (unpacked ? 8 : 0) + rows) {  // 8 + rows: the unpacked bytes (rows <= MT = 4)
#define RAGSPEC_CASE(F, R) \
  case F * 32 + R: block<F, R>(G, x0, s0, t0, h0, K, wb, hb, db, mb, y0, ldy); break;
#define RAGSPEC_PAIR(F, R) \
  case F * 32 + 16 + R: \
    block16<F, R>(G, x0, s0, t0, h0, K, wb, hb, db, mb, y0, ldy, W.wblock, W.hblock, W.dblock, W.mblock); break;
#if defined(RAGSPEC_BLOCK16)
#define RAGSPEC_ROWS(F) RAGSPEC_CASE(F, 1) RAGSPEC_CASE(F, 2) RAGSPEC_CASE(F, 3) RAGSPEC_CASE(F, 4) \
  RAGSPEC_CASE(F, 5) RAGSPEC_CASE(F, 6) RAGSPEC_CASE(F, 7) RAGSPEC_CASE(F, 8) RAGSPEC_PAIR(F, 7) RAGSPEC_PAIR(F, 8)
#elif defined(__AVX512VL__)
#define RAGSPEC_ROWS(F) RAGSPEC_CASE(F, 1) RAGSPEC_CASE(F, 2) RAGSPEC_CASE(F, 3) RAGSPEC_CASE(F, 4) \
  RAGSPEC_CASE(F, 5) RAGSPEC_CASE(F, 6) RAGSPEC_CASE(F, 7) RAGSPEC_CASE(F, 8)
#else
#define RAGSPEC_ROWS(F) RAGSPEC_CASE(F, 1) RAGSPEC_CASE(F, 2) RAGSPEC_CASE(F, 3) RAGSPEC_CASE(F, 4)
#endif
        RAGSPEC_ROWS(0) RAGSPEC_ROWS(1) RAGSPEC_ROWS(2) RAGSPEC_ROWS(3) RAGSPEC_ROWS(4) RAGSPEC_ROWS(5)
#undef RAGSPEC_ROWS
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__) && !defined(__AVX512VL__)
#define RAGSPEC_UNPACKED(F, R) \
  case F * 32 + 8 + R: block<F, R, true>(G, x0, s0, t0, h0, K, wb, nullptr, db, mb, y0, ldy); break;
        RAGSPEC_UNPACKED(1, 1) RAGSPEC_UNPACKED(1, 2) RAGSPEC_UNPACKED(1, 3) RAGSPEC_UNPACKED(1, 4)
        RAGSPEC_UNPACKED(3, 1) RAGSPEC_UNPACKED(3, 2) RAGSPEC_UNPACKED(3, 3) RAGSPEC_UNPACKED(3, 4)
#undef RAGSPEC_UNPACKED
#endif
#undef RAGSPEC_PAIR
#undef RAGSPEC_CASE
      }
      b += pair ? 2 : 1;
    }
  }
}

// y [M, N] float32 = quantised x times the block-quantised weight, in the layout above (wh, mn empty where
// the format has none).
at::Tensor qmatmul(const at::Tensor& xq, const at::Tensor& sx, const at::Tensor& xs, const at::Tensor& w,
                   const at::Tensor& wh, const at::Tensor& d, const at::Tensor& mn, int64_t fmt) {
  TORCH_CHECK(xq.is_contiguous(), "qmatmul: contiguous inputs");
  const int64_t M = xq.size(0), K = xq.size(1);
  const Blocks W = blocks_of(w, wh, d, mn, fmt, K);
  at::Tensor y = at::empty({M, W.N}, sx.options());
  const int8_t* px = xq.data_ptr<int8_t>();
  TORCH_CHECK(sx.size(0) == M && sx.size(1) == (fmt == 5 ? W.G / 8 : W.G), "qmatmul: activation scales do not "
              "match the format (u4k8: one per 256 inputs)");
  const std::vector<int32_t> hs = fmt == 3 || fmt == 5 ? half_sums(px, M, W.G) : std::vector<int32_t>();
  float* py = y.data_ptr<float>();
  // blocks of outputs per thread; each streams its part of the weight once for all M rows
  at::parallel_for(0, W.N / 8, NB, [&](int64_t begin, int64_t end) {
    for (int64_t b0 = begin; b0 < end; b0 += NB)
      run_blocks(W, px, sx.data_ptr<float>(), xs.data_ptr<float>(), hs.empty() ? nullptr : hs.data(), M, K, b0,
                 std::min(end, b0 + NB), py + 8 * b0, W.N);
  });
  return y;
}

// A whole linear in one call (a decode step runs ~170 of them: one dispatch instead of three or four):
// x [..., K] float32 → y [..., out] = qmatmul(quantize_rows(x)) (+ bias), the padding outputs cut.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& wh, const at::Tensor& d,
                  const at::Tensor& mn, const at::Tensor& bias, int64_t fmt, int64_t out) {
  const int64_t K = x.size(-1);
  auto [xq, sx, xs] = quantize_rows(x.reshape({-1, K}), fmt == 5 ? 8 * GROUP : GROUP);
  at::Tensor y = qmatmul(xq, sx, xs, w, wh, d, mn, fmt);
  if (y.size(1) != out) y = y.narrow(1, 0, out).contiguous();
  if (bias.numel()) y.add_(bias);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  return y.view(shape);
}

using ragspec_math::silu_mul;  // h = silu(g) * u (kernel_math.h)

// g, u [M, n] float32 -> silu(g) * u as mlp computes it (the parts of mlp, for tests that compare it with them).
at::Tensor silu_mul_op(const at::Tensor& g_in, const at::Tensor& u_in) {
  at::Tensor g = g_in.contiguous(), u = u_in.contiguous();
  TORCH_CHECK(g.scalar_type() == at::kFloat && g.sizes() == u.sizes() && g.dim() == 2, "silu_mul: float32 [M, n]");
  at::Tensor h = at::empty_like(g);
  const int64_t n = g.size(1);
  for (int64_t r = 0; r < g.size(0); ++r)
    silu_mul(g.data_ptr<float>() + r * n, u.data_ptr<float>() + r * n, h.data_ptr<float>() + r * n, n);
  return h;
}

// The MLP of Llama/Qwen2 in one call: down(silu(gate(x)) * up(x)), x quantized once for gate and up. Each
// element of the product depends on its own row only, so the rows stay independent. Gate and up run a few
// groups of 32 outputs (groups of down's inputs) for up to 64 rows at a time, and the product is quantised for
// down while it is in cache: the [M, inter] floats of gate, up and their product never go to memory (a
// 353-token prompt's MLP takes 0.8-0.85x the time of the unfused calls on a Zen 4). Each group is the same
// operations as computed apart, so the bits are those of gate, up, silu_mul, quantize_rows and down one by one.
at::Tensor mlp(const at::Tensor& x, const at::Tensor& gw, const at::Tensor& gwh, const at::Tensor& gd,
               const at::Tensor& gmn, int64_t gfmt, const at::Tensor& uw, const at::Tensor& uwh, const at::Tensor& ud,
               const at::Tensor& umn, int64_t ufmt, const at::Tensor& dw, const at::Tensor& dwh, const at::Tensor& dd,
               const at::Tensor& dmn, int64_t dfmt, int64_t inter, int64_t out) {
  const int64_t K = x.size(-1);
  TORCH_CHECK((gfmt == 5) == (ufmt == 5) && dfmt != 5, "mlp: gate and up both u4k8 or neither; down not u4k8 (its "
              "input is quantised a group at a time)");
  auto [xq, sx, xs] = quantize_rows(x.reshape({-1, K}), gfmt == 5 ? 8 * GROUP : GROUP);
  const int64_t M = xq.size(0);
  const Blocks Wg = blocks_of(gw, gwh, gd, gmn, gfmt, K), Wu = blocks_of(uw, uwh, ud, umn, ufmt, K);
  TORCH_CHECK(Wg.N == Wu.N && Wg.N >= inter && inter % GROUP == 0,
              "mlp: gate and up must match, their outputs a multiple of 32");
  const int64_t T = inter / GROUP;
  at::Tensor hq = at::empty({M, inter}, xq.options());
  at::Tensor hsx = at::empty({M, T}, sx.options());
  at::Tensor hxs = at::empty({M, T}, sx.options());
  const int8_t* px = xq.data_ptr<int8_t>();
  const float *psx = sx.data_ptr<float>(), *pxs = xs.data_ptr<float>();
  const int64_t G = K / GROUP;
  const int64_t SG = gfmt == 5 ? G / 8 : G;  // activation scales per row
  const bool gh = gfmt == 3 || gfmt == 5, uh = ufmt == 3 || ufmt == 5;  // formats that read the group sums
  const std::vector<int32_t> hs = gh || uh ? half_sums(px, M, G) : std::vector<int32_t>();
  const int32_t* phs = hs.empty() ? nullptr : hs.data();
  int8_t* phq = hq.data_ptr<int8_t>();
  float *phsx = hsx.data_ptr<float>(), *phxs = hxs.data_ptr<float>();
  // 64 rows of one group of outputs at a time, or fewer rows of several groups (up to 8: a decode step streams
  // each weight in runs long enough for the prefetchers; one group at a time made a one-row step ~10 % slower)
  constexpr int64_t SPAN = 64;
  const int64_t chunk = std::clamp<int64_t>(M, 1, SPAN), width = std::min<int64_t>(8, SPAN / chunk);
  at::parallel_for(0, (T + width - 1) / width, 1, [&](int64_t begin, int64_t end) {
    float gbuf[SPAN * GROUP], ubuf[SPAN * GROUP], h[GROUP];
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t t0 = tile * width, t1 = std::min(T, t0 + width), n = (t1 - t0) * GROUP;
      for (int64_t c0 = 0; c0 < M; c0 += chunk) {
        const int64_t rows = std::min(chunk, M - c0);
        const int8_t* x0 = px + c0 * K;
        const int32_t* h0 = phs ? phs + c0 * G * 2 : nullptr;
        run_blocks(Wg, x0, psx + c0 * SG, pxs + c0 * SG, gh ? h0 : nullptr, rows, K, t0 * GROUP / 8,
                   t1 * GROUP / 8, gbuf, n);
        run_blocks(Wu, x0, psx + c0 * SG, pxs + c0 * SG, uh ? h0 : nullptr, rows, K, t0 * GROUP / 8,
                   t1 * GROUP / 8, ubuf, n);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t m = c0 + r;
          for (int64_t t = t0; t < t1; ++t) {
            silu_mul(gbuf + r * n + (t - t0) * GROUP, ubuf + r * n + (t - t0) * GROUP, h, GROUP);
            quantize_group(h, phq + m * inter + t * GROUP, phsx + m * T + t, phxs + m * T + t);
          }
        }
      }
    }
  });
  at::Tensor y = qmatmul(hq, hsx, hxs, dw, dwh, dd, dmn, dfmt);
  if (y.size(1) != out) y = y.narrow(1, 0, out).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  return y.view(shape);
}

// RMSNorm as Llama/Qwen2 define it, w * (x * rsqrt(mean(x²) + eps)), the mean in a fixed order (16 partial
// sums, a fixed tree): a row's bits never depend on the others.
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm: float32 x and weight");
  const int64_t D = x.size(-1), M = x.numel() / D;
  TORCH_CHECK(weight.numel() == D, "rms_norm: weight does not match x");
  at::Tensor y = at::empty_like(x);
  const float *px = x.data_ptr<float>(), *pw = weight.contiguous().data_ptr<float>();
  float* py = y.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* v = px + r * D;
      float lanes[16] = {};
      for (int64_t d = 0; d < D; ++d) lanes[d % 16] += v[d] * v[d];
      float h[8];
      for (int l = 0; l < 8; ++l) h[l] = lanes[l] + lanes[l + 8];
      const float sum = ((h[0] + h[4]) + (h[2] + h[6])) + ((h[1] + h[5]) + (h[3] + h[7]));
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(D) + static_cast<float>(eps));
      for (int64_t d = 0; d < D; ++d) py[r * D + d] = pw[d] * (v[d] * inv);
    }
  });
  return y;
}

// The AMX path: mode 0 off, 1 on (where the CPU, the build and the kernel allow it), -1 unchanged; returns
// whether it is on. Both paths give the same bits; tests and benchmarks compare them in one process.
int64_t amx_op(int64_t mode) {
#if defined(RAGSPEC_AMX)
  if (mode >= 0) amx_mode.store(mode == 1 && amx_permitted() ? 1 : 0);
  return amx_on() ? 1 : 0;
#else
  (void)mode;
  return 0;
#endif
}

// AVX2 without VNNI: chunks one at a time (0), two by two (1), or four by four where weights have at most 5 bits
// (2, the default); -1 unchanged; returns the mode in use (0 on builds that never pair). All give the same bits;
// tests and benchmarks compare them in one process.
int64_t paired_op(int64_t mode) {
  if (mode >= 0) paired_mode.store(mode > 2 ? 2 : static_cast<int>(mode));
  return PAIRED ? paired_mode.load() : 0;
}

// AVX2 builds without AVX-512: u5 and u6 blocks unpacked once per call for every tile of rows (1, the default) or
// per tile (0); -1 unchanged; returns the mode in use (0 on builds that never do). Both give the same bits.
int64_t unpacked_op(int64_t mode) {
  if (mode >= 0) unpacked_mode.store(mode ? 1 : 0);
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__) && !defined(__AVX512VL__)
  return unpacked_mode.load();
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY(ragspec_gguf, m) {
  m.def("quantize_rows(Tensor x, int span=32) -> (Tensor, Tensor, Tensor)");
  m.def("qmatmul(Tensor xq, Tensor sx, Tensor xs, Tensor w, Tensor wh, Tensor d, Tensor mn, int fmt) -> Tensor");
  m.def("linear(Tensor x, Tensor w, Tensor wh, Tensor d, Tensor mn, Tensor bias, int fmt, int out) -> Tensor");
  m.def("mlp(Tensor x, Tensor gw, Tensor gwh, Tensor gd, Tensor gmn, int gfmt, Tensor uw, Tensor uwh, Tensor ud, "
        "Tensor umn, int ufmt, Tensor dw, Tensor dwh, Tensor dd, Tensor dmn, int dfmt, int inter, int out) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor g, Tensor u) -> Tensor");
  m.def("amx(int mode) -> int");
  m.def("paired(int mode) -> int");
  m.def("unpacked(int mode) -> int");
}

TORCH_LIBRARY_IMPL(ragspec_gguf, CPU, m) {
  m.impl("quantize_rows", &quantize_rows);
  m.impl("qmatmul", &qmatmul);
  m.impl("linear", &linear);
  m.impl("mlp", &mlp);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul_op);
}

TORCH_LIBRARY_IMPL(ragspec_gguf, CatchAll, m) {
  m.impl("amx", &amx_op);
  m.impl("paired", &paired_op);
  m.impl("unpacked", &unpacked_op);
}
