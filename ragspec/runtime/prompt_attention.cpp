// Attention for dtype gguf's prompt rows (the forwards ragspec/runtime/prompt_mode.py marks, with or without the
// int8 prompt copy): softmax(q·kᵀ·scale + mask)·v in float32, each row computed from that row alone, as a
// GEMM-shaped loop. Built with the GGUF kernels by ragspec/runtime/gguf_kernel.py.
//
// Why a second kernel: attention_kernel.cpp computes one query row at a time (a dot product per key, reduced across
// lanes), right for a step's few rows, and a 1,024-token prompt of the 0.5B spent 22-30 % of its prefill there. A
// prompt position is only ever read as a prompt position (such a model reads the prompt's last token, and every
// answer token, as steps), so prompt rows may use other arithmetic than steps as long as a row's bits do not
// depend on the rows or keys beside it. Here they do not, by construction:
//   score(i, j) = fma chain over d = 0 .. D-1 in order, from 0, times scale, plus the mask;
//   the maximum is exact in any order; exp(score - max) is elementwise, 0 below EXP_MIN (hidden keys);
//   the denominator adds the key j into lane j mod 16, keys in order, then a fixed tree;
//   out(i) = fma chain over keys j = 0, 1, ... in order, times 1 / denominator.
// Keys a row does not see add exact zeros (their probability is 0), so computing them for a block of rows that
// sees further changes nothing; keys past the last one any row of the block sees are not computed. The tiles (rows
// of queries by 16 keys for the scores, rows by 64 outputs for the values) only decide which rows run together.
//
// Shapes as attention_kernel.cpp: q [B, H, Q, D] float32, k and v [B, Hkv, K, D] float32 (rows contiguous), mask
// [B, 1|H, Q, >=K] additive float32 or empty; D a multiple of 16. Output [B, Q, H, D] float32. The AVX-512 loops,
// the AVX2 ones (a 16-lane vector as two halves) and the scalar ones compute the same bits (the same fused
// multiply-adds, the same order).
#include <ATen/core/Tensor.h>  // not ATen/ATen.h: a third less to compile on a first ask
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kernel_math.h"

namespace {

constexpr int64_t ROWS = 8;  // query rows per task (times the heads sharing a key/value head)
#if defined(__AVX512F__) || !(defined(__AVX2__) && defined(__FMA__))
constexpr int SCORE_QV = 8;  // query vectors per score tile (16 keys each)
constexpr int VALUE_QV = 6;  // query vectors per value tile (64 outputs each: 24 accumulators)
constexpr int64_t VALUE_KEYS = INT64_MAX;  // keys per value block: all at once
#else
#define RAGSPEC_PROMPT_AVX2 1  // 16 registers of 8 lanes: 16 keys are two halves, 64 outputs two passes of 32
constexpr int SCORE_QV = 8;  // 8 accumulators (one half of the 16 keys at a time)
constexpr int VALUE_QV = 2;  // 8 accumulators and the 4 value vectors in registers
constexpr int64_t VALUE_KEYS = 32;  // 8 KB of values (D 64) per block: read from L1 by every tile of rows
#endif
constexpr float EXP_MIN = -87.0f;
constexpr float HIDDEN = -FLT_MAX;

inline float tree16(const float* a) {
  float h[8];
  for (int l = 0; l < 8; ++l) h[l] = a[l] + a[l + 8];
  return ((h[0] + h[4]) + (h[2] + h[6])) + ((h[1] + h[5]) + (h[3] + h[7]));
}

// scores of `n` query vectors against keys j0 .. j0+15 (kT: the keys transposed in blocks of 16, [Kp / 16, D, 16]),
// scaled, masked, stored to s[r] + j0; keys at or past K are hidden; `top` takes each vector's running maximum.
template <int n>
inline void score_tile(const float* const* qv, const float* const* mv, const float* kT, int64_t Kp,
                       int64_t D, int64_t j0, int64_t K, float scaling, float* const* s, float* top) {
#if defined(__AVX512F__)
  __m512 acc[n];
  for (int r = 0; r < n; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 kt = _mm512_loadu_ps(kT + j0 * D + d * 16);
    for (int r = 0; r < n; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qv[r][d]), kt, acc[r]);
  }
  const int live = static_cast<int>(std::min<int64_t>(16, K - j0));
  const __mmask16 in = static_cast<__mmask16>((1u << live) - 1);
  for (int r = 0; r < n; ++r) {
    __m512 x = _mm512_mul_ps(acc[r], _mm512_set1_ps(scaling));
    if (mv[r]) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(in, mv[r] + j0));
    x = _mm512_mask_blend_ps(in, _mm512_set1_ps(HIDDEN), x);
    _mm512_storeu_ps(s[r] + j0, x);
    top[r] = std::max(top[r], _mm512_reduce_max_ps(x));
  }
#elif defined(RAGSPEC_PROMPT_AVX2)
  __m256 x[2][n];  // keys j0 .. j0+7, then j0+8 .. j0+15: each lane the same chain as a 16-lane one
  for (int h = 0; h < 2; ++h) {
    __m256 acc[n];
#pragma GCC unroll 8
    for (int r = 0; r < n; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m256 kt = _mm256_loadu_ps(kT + j0 * D + d * 16 + 8 * h);
#pragma GCC unroll 8
      for (int r = 0; r < n; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(qv[r][d]), kt, acc[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < n; ++r) x[h][r] = _mm256_mul_ps(acc[r], _mm256_set1_ps(scaling));
  }
  const bool full = K - j0 >= 16;
  for (int r = 0; r < n; ++r) {
    __m256 x0 = x[0][r], x1 = x[1][r];
    if (full) {
      if (mv[r]) {
        x0 = _mm256_add_ps(x0, _mm256_loadu_ps(mv[r] + j0));
        x1 = _mm256_add_ps(x1, _mm256_loadu_ps(mv[r] + j0 + 8));
      }
      _mm256_storeu_ps(s[r] + j0, x0);
      _mm256_storeu_ps(s[r] + j0 + 8, x1);
      alignas(32) float m[8];
      _mm256_store_ps(m, _mm256_max_ps(x0, x1));
      for (int l = 0; l < 8; ++l) top[r] = std::max(top[r], m[l]);
      continue;
    }
    alignas(32) float t[16];  // the last keys: those at or past K hidden
    _mm256_store_ps(t, x0);
    _mm256_store_ps(t + 8, x1);
    for (int64_t l = 0; l < 16; ++l) {
      const int64_t j = j0 + l;
      float y = t[l];
      if (j >= K) y = HIDDEN;
      else if (mv[r]) y = y + mv[r][j];
      s[r][j] = y;
      top[r] = std::max(top[r], y);
    }
  }
#else
  for (int r = 0; r < n; ++r) {
    for (int64_t l = 0; l < 16; ++l) {
      const int64_t j = j0 + l;
      float acc = 0.0f;
      for (int64_t d = 0; d < D; ++d) acc = std::fmaf(qv[r][d], kT[j0 * D + d * 16 + l], acc);
      float x = acc * scaling;
      if (j >= K) x = HIDDEN;
      else if (mv[r]) x = x + mv[r][j];
      s[r][j] = x;
      top[r] = std::max(top[r], x);
    }
  }
#endif
}

// exp(s - top) in place over keys 0 .. kp (a multiple of 16); returns the sum (lanes j mod 16, then tree16)
inline float softmax_row(float* s, int64_t kp, float top) {
  alignas(64) float lane[16] = {};
#if defined(__AVX512F__)
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < kp; j += 16) {
    const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(top));
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_MIN), _CMP_GE_OQ);
    const __m512 e = _mm512_maskz_mov_ps(live, ragspec_math::exp_in_range16(_mm512_maskz_mov_ps(live, x)));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  _mm512_store_ps(lane, sum);
#elif defined(RAGSPEC_PROMPT_AVX2)
  __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};  // lanes 0-7 and 8-15 of the 16
  for (int64_t j = 0; j < kp; j += 8) {
    const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(top));
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_MIN), _CMP_GE_OQ);
    const __m256 e = _mm256_and_ps(live, ragspec_math::exp_in_range8(_mm256_and_ps(live, x)));
    _mm256_storeu_ps(s + j, e);
    sum[(j / 8) % 2] = _mm256_add_ps(sum[(j / 8) % 2], e);
  }
  _mm256_store_ps(lane, sum[0]);
  _mm256_store_ps(lane + 8, sum[1]);
#else
  for (int64_t j = 0; j < kp; ++j) {
    const float x = s[j] - top;
    s[j] = x >= EXP_MIN ? ragspec_math::exp_in_range(x) : 0.0f;
    lane[j % 16] += s[j];
  }
#endif
  return tree16(lane);
}

// o[r][c .. c+63] = Σ_j p[r][j] · v[j][c .. c+63], keys in order (fused multiply-adds), then times inv[r]. Keys
// j0 .. j1-1 of them: a block past the first continues the sums the one before left in o (the same chain of
// fused multiply-adds, held in memory between blocks), and the last (j1 == kend) scales them.
template <int n>
inline void value_tile(const float* const* p, const float* vb, int64_t vs, int64_t j0, int64_t j1, int64_t kend,
                       int64_t c, const float* inv, float* const* o) {
  const bool last = j1 == kend;
#if defined(__AVX512F__)
  __m512 acc[n][4];
  for (int r = 0; r < n; ++r)
    for (int u = 0; u < 4; ++u) acc[r][u] = j0 ? _mm512_loadu_ps(o[r] + c + 16 * u) : _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    const float* vr = vb + j * vs + c;
    const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16);
    const __m512 v2 = _mm512_loadu_ps(vr + 32), v3 = _mm512_loadu_ps(vr + 48);
    for (int r = 0; r < n; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r][j]);
      acc[r][0] = _mm512_fmadd_ps(pr, v0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(pr, v1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(pr, v2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(pr, v3, acc[r][3]);
    }
  }
  for (int r = 0; r < n; ++r)
    for (int u = 0; u < 4; ++u)
      _mm512_storeu_ps(o[r] + c + 16 * u, last ? _mm512_mul_ps(acc[r][u], _mm512_set1_ps(inv[r])) : acc[r][u]);
#elif defined(RAGSPEC_PROMPT_AVX2)
  for (int64_t h = c; h < c + 64; h += 32) {  // two passes of 32 outputs
    __m256 acc[n][4];
    for (int r = 0; r < n; ++r)
      for (int u = 0; u < 4; ++u) acc[r][u] = j0 ? _mm256_loadu_ps(o[r] + h + 8 * u) : _mm256_setzero_ps();
    for (int64_t j = j0; j < j1; ++j) {
      const float* vr = vb + j * vs + h;
      const __m256 v0 = _mm256_loadu_ps(vr), v1 = _mm256_loadu_ps(vr + 8);
      const __m256 v2 = _mm256_loadu_ps(vr + 16), v3 = _mm256_loadu_ps(vr + 24);
      for (int r = 0; r < n; ++r) {
        const __m256 pr = _mm256_set1_ps(p[r][j]);
        acc[r][0] = _mm256_fmadd_ps(pr, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(pr, v1, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(pr, v2, acc[r][2]);
        acc[r][3] = _mm256_fmadd_ps(pr, v3, acc[r][3]);
      }
    }
    for (int r = 0; r < n; ++r)
      for (int u = 0; u < 4; ++u)
        _mm256_storeu_ps(o[r] + h + 8 * u, last ? _mm256_mul_ps(acc[r][u], _mm256_set1_ps(inv[r])) : acc[r][u]);
  }
#else
  for (int r = 0; r < n; ++r) {
    float acc[64];
    for (int u = 0; u < 64; ++u) acc[u] = j0 ? o[r][c + u] : 0.0f;
    for (int64_t j = j0; j < j1; ++j)
      for (int u = 0; u < 64; ++u) acc[u] = std::fmaf(p[r][j], vb[j * vs + c + u], acc[u]);
    for (int u = 0; u < 64; ++u) o[r][c + u] = last ? acc[u] * inv[r] : acc[u];
  }
#endif
}

// the tiles with the number of query vectors fixed at compile time (their accumulators stay in registers)
template <int... N>
inline void score_tiles(int n, std::integer_sequence<int, N...>, const float* const* qv, const float* const* mv,
                        const float* kT, int64_t Kp, int64_t D, int64_t j0, int64_t K, float scaling, float* const* s,
                        float* top) {
  ((n == N + 1 ? score_tile<N + 1>(qv, mv, kT, Kp, D, j0, K, scaling, s, top) : void()), ...);
}

template <int... N>
inline void value_tiles(int n, std::integer_sequence<int, N...>, const float* const* p, const float* vb, int64_t vs,
                        int64_t j0, int64_t j1, int64_t kend, int64_t c, const float* inv, float* const* o) {
  ((n == N + 1 ? value_tile<N + 1>(p, vb, vs, j0, j1, kend, c, inv, o) : void()), ...);
}

// the value tile above takes 64 outputs at a time; a D of 16 or 48 runs its last 16-output groups here
inline void value_tail(const float* p, const float* vb, int64_t vs, int64_t kend, int64_t c, int64_t D, float inv,
                       float* o) {
  for (int64_t u0 = c; u0 < D; u0 += 16) {
    float acc[16] = {};
    for (int64_t j = 0; j < kend; ++j)
      for (int u = 0; u < 16; ++u) acc[u] = std::fmaf(p[j], vb[j * vs + u0 + u], acc[u]);
    for (int u = 0; u < 16; ++u) o[u0 + u] = acc[u] * inv;
  }
}

at::Tensor prompt_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                            double scaling_in) {
  TORCH_CHECK(q_in.dim() == 4 && k.dim() == 4 && v.dim() == 4, "prompt_attention: q, k, v must be 4-D");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "prompt_attention: float32 q, k, v");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "prompt_attention: k and v rows must be contiguous");
  at::Tensor q = q_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), D = q.size(3);
  const int64_t HKV = k.size(1), K = k.size(2);
  TORCH_CHECK(H % HKV == 0 && v.size(2) == K && k.size(3) == D && v.size(3) == D && D % 16 == 0,
              "prompt_attention: shapes (D a multiple of 16)");
  const bool has_mask = mask.numel() > 0;
  if (has_mask) {
    TORCH_CHECK(mask.dim() == 4 && mask.scalar_type() == at::kFloat && mask.size(2) == Q && mask.size(3) >= K &&
                    mask.stride(3) == 1,
                "prompt_attention: mask must be [B, 1|H, Q, >=K] float32, rows contiguous");
  }
  const float scaling = static_cast<float>(scaling_in);
  const int64_t groups = H / HKV, Kp = (K + 15) / 16 * 16;
  // the keys transposed in blocks of 16 ([B, Hkv, Kp / 16, D, 16], zero past K): a score tile reads 16 keys' d-th
  // values in one load, its 16 keys' values contiguous
  at::Tensor kT = at::zeros({B, HKV, D, Kp}, q.options());
  float* pkT = kT.data_ptr<float>();
  const float* pk = k.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  at::parallel_for(0, B * HKV, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* kb = pk + (t / HKV) * ks0 + (t % HKV) * ks1;
      float* out = pkT + t * D * Kp;
      for (int64_t j = 0; j < K; ++j)
        for (int64_t d = 0; d < D; ++d) out[(j / 16) * D * 16 + d * 16 + j % 16] = kb[j * ks2 + d];
    }
  });
  const float* pq = q.data_ptr<float>();
  const float* pv = v.data_ptr<float>();
  const float* pm = has_mask ? mask.data_ptr<float>() : nullptr;
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t ms0 = has_mask ? mask.stride(0) : 0, ms1 = has_mask && mask.size(1) > 1 ? mask.stride(1) : 0;
  const int64_t ms2 = has_mask ? mask.stride(2) : 0;
  at::Tensor out = at::empty({B, Q, H, D}, q.options());
  float* po = out.data_ptr<float>();
  const int64_t blocks = (Q + ROWS - 1) / ROWS;
  at::parallel_for(0, B * HKV * blocks, 1, [&](int64_t begin, int64_t end) {
    const int64_t most = groups * ROWS;
    const int64_t Ks = Kp + 16;  // a score row's stride: not a multiple of 4 KB (the rows would share L1 sets)
    std::vector<float> s(most * Ks);
    std::vector<const float*> qv(most), mv(most);
    std::vector<float*> sv(most), ov(most);
    std::vector<float> top(most), inv(most);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / (HKV * blocks), hk = (t / blocks) % HKV, i0 = (t % blocks) * ROWS;
      const int64_t i1 = std::min(Q, i0 + ROWS);
      // the query vectors of this task: every head sharing key/value head hk, for rows i0 .. i1-1
      int64_t n = 0, kend = 0;
      for (int64_t e = 0; e < groups; ++e) {
        const int64_t h = hk * groups + e;
        for (int64_t i = i0; i < i1; ++i, ++n) {
          qv[n] = pq + ((b * H + h) * Q + i) * D;
          mv[n] = has_mask ? pm + b * ms0 + h * ms1 + i * ms2 : nullptr;
          sv[n] = s.data() + n * Ks;
          ov[n] = po + ((b * Q + i) * H + h) * D;
          top[n] = -INFINITY;
          int64_t last = K;  // keys past the last one this row sees are never computed for the task
          if (mv[n]) {
            while (last > 0 && mv[n][last - 1] <= HIDDEN) --last;
          }
          kend = std::max(kend, last);
        }
      }
      const int64_t kp = (kend + 15) / 16 * 16;
      const float* kTb = pkT + (b * HKV + hk) * D * Kp;
      for (int64_t j0 = 0; j0 < kp; j0 += 16)
        for (int64_t r0 = 0; r0 < n; r0 += SCORE_QV)
          score_tiles(static_cast<int>(std::min<int64_t>(SCORE_QV, n - r0)), std::make_integer_sequence<int, SCORE_QV>(),
                      qv.data() + r0, mv.data() + r0, kTb, Kp, D, j0, K, scaling, sv.data() + r0, top.data() + r0);
      for (int64_t r = 0; r < n; ++r) {
        if (!(top[r] > HIDDEN / 2)) {  // a row that sees no key (padding): zeros, as the step kernel gives
          for (int64_t j = 0; j < kp; ++j) sv[r][j] = 0.0f;
          inv[r] = 0.0f;
          continue;
        }
        inv[r] = 1.0f / softmax_row(sv[r], kp, top[r]);
      }
      const float* vb = pv + b * vs0 + hk * vs1;
      int64_t c = 0;
      for (; c + 64 <= D; c += 64)
        for (int64_t j0 = 0; j0 < std::max<int64_t>(kend, 1); j0 += VALUE_KEYS)  // a block of values stays in L1
          for (int64_t r0 = 0; r0 < n; r0 += VALUE_QV)
            value_tiles(static_cast<int>(std::min<int64_t>(VALUE_QV, n - r0)), std::make_integer_sequence<int, VALUE_QV>(),
                        sv.data() + r0, vb, vs2, j0, std::min(kend, j0 + VALUE_KEYS), kend, c, inv.data() + r0,
                        ov.data() + r0);
      for (int64_t r = 0; c < D && r < n; ++r) value_tail(sv[r], vb, vs2, kend, c, D, inv[r], ov[r]);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ragspec_gguf, m) {
  m.def("prompt_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(ragspec_gguf, CPU, m) {
  m.impl("prompt_attention", &prompt_attention);
}
