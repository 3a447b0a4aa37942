// Plain C: block() one output at a time, for CPUs without AVX2/F16C/FMA.
// A fragment of gguf_kernel.cpp, included inside its anonymous namespace under the guard that selects this
// instruction set (the build is -march=native: one of these per CPU, chosen at compile time).
#pragma once

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
