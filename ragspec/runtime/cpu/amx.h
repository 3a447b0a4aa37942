// AMX (INT8 tiles): the tile passes for 16-row tiles, block16's float operations after the exact integer sums.
// A fragment of gguf_kernel.cpp, included inside its anonymous namespace under the guard that selects this
// instruction set (the build is -march=native: one of these per CPU, chosen at compile time).
#pragma once

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

// -1: on where permitted, decided on first use; 0 off; 1 on. The amx op switches it: `runtime.prepare` as the
// runtime options say (`amx`, RAGSPEC_GGUF_AMX read there), tests and benchmarks to compare both paths.
std::atomic<int> amx_mode{-1};

bool amx_on() {
  int mode = amx_mode.load(std::memory_order_relaxed);
  if (mode < 0) {
    mode = amx_permitted() ? 1 : 0;
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
