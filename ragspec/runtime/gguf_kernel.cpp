// GGUF-block linears for CPU decoding: weights as 4-, 5- or 8-bit integers in groups of 32 with an fp16
// scale (and min), activations quantised to int8 per row and group of 32 (llama.cpp's Q8 rule), integer dot
// products per group, float sums in a fixed order. Built once per CPU by ragspec/runtime/gguf_kernel.py.
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

// One instruction set per file under cpu/, chosen by the compiler flags (-march=native):
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include "cpu/avx2.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RAGSPEC_BLOCK16 1
#include "cpu/avx512.h"
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__linux__)
#define RAGSPEC_AMX 1
#include "cpu/amx.h"
#endif
#endif
#else
#include "cpu/plain.h"
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
