// Exact attention for CPU decoding: softmax(q·kᵀ·scale + mask)·v in float32 with every sum in a fixed order.
// Built with the GGUF kernels by ragspec/runtime/gguf_kernel.py.
//
// Why: greedy draft-and-verify equals plain greedy only if a position's logits are the same bits alone (a decode
// step), in a prompt, or as one row of a draft tree. Here each output row [b, i, h, :] is computed by the same
// instruction sequence from row i of the query, the keys that row sees and its mask row, whatever else runs
// beside it: batch-invariant by construction (PyTorch's kernels change their summation order with the shapes, which
// is why exact_attention.py's fallback runs in float64). It reads the float32 cache in place; the float64 ops
// converted the whole key/value cache at every step.
//
// Shapes: q [B, H, Q, D] float32, k and v [B, Hkv, K, D] float32 (any strides but the last: the KV cache's
// buffer views are read in place), mask [B, 1|H, Q, K] additive float32 (the dtype's minimum where hidden) or an
// empty tensor (all visible). Query head h reads key/value head h / (H / Hkv). Output [B, Q, H, D] float32.
#include <ATen/core/Tensor.h>  // not ATen/ATen.h: a third less to compile on a first ask
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include "kernel_math.h"

namespace {

constexpr int LANES = 16;  // partial sums of a dot product (lane l takes d = l mod 16), added in a fixed tree
constexpr float EXP_MIN = -87.0f;  // exp below it: 0 (2^n would leave float's range; kernel_math.h)

inline float tree16(const float* a) {
  float h[8];
  for (int l = 0; l < 8; ++l) h[l] = a[l] + a[l + 8];
  return ((h[0] + h[4]) + (h[2] + h[6])) + ((h[1] + h[5]) + (h[3] + h[7]));
}

inline float dot(const float* a, const float* b, int64_t D) {
  float acc[LANES] = {};
  for (int64_t d = 0; d < D; ++d) acc[d % LANES] += a[d] * b[d];
  return tree16(acc);
}

inline float exp_neg(float x) { return x >= EXP_MIN ? ragspec_math::exp_in_range(x) : 0.0f; }

#if defined(__AVX2__)
// The same arithmetic eight lanes at a time (D a multiple of 16): bit-identical to the scalar functions above.
inline float dot16(const float* a, const float* b, int64_t D) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d)));
    hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8)));
  }
  // tree16's order in registers: lanes l + (l+8), then + (l+4), then + (l+2), then the last two
  const __m256 h = _mm256_add_ps(lo, hi);
  const __m128 g = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 f = _mm_add_ps(g, _mm_movehl_ps(g, g));
  return _mm_cvtss_f32(_mm_add_ss(f, _mm_movehdup_ps(f)));
}

inline __m256 exp_neg8(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_MIN), _CMP_GE_OQ);
  // dead lanes (and NaN padding) computed on 0, then zeroed
  return _mm256_and_ps(ragspec_math::exp_in_range8(_mm256_and_ps(x, live)), live);
}
#endif

#if defined(__AVX512F__)
// Sixteen keys' dot products at once, each the same bits as dot16: key s's 16 lanes accumulate d = l mod 16 in d
// order (acc[s]), then the lanes of all sixteen are added pairwise at distances 8, 4, 2, 1 (tree16's pairs),
// two keys per register at each level instead of one key per horizontal sum. Returns the sums in key order.
inline __m512 reduce16(const __m512* a) {
  __m512 h[8], g[4], f[2];
  for (int p = 0; p < 8; ++p)  // lanes l + (l+8): [key 2p's 8 | key 2p+1's 8]
    h[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int q = 0; q < 4; ++q)  // + (l+4): a 128-bit block per key, keys 4q .. 4q+3
    g[q] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * q], h[2 * q + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(h[2 * q], h[2 * q + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int r = 0; r < 2; ++r)  // + (l+2): block c holds keys 8r+c and 8r+4+c, two lanes each
    f[r] = _mm512_add_ps(_mm512_shuffle_ps(g[2 * r], g[2 * r + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(g[2 * r], g[2 * r + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // + (l+1): lane 4c+m holds key c+4m; put them in key order
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(f[0], f[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(f[0], f[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, t);
}

// q·k for keys j .. j+15 (rows past `live` read key j's row: computed, never kept); D a multiple of 16
template <bool FULL>
inline __m512 dots16(const float* q, const float* k, int64_t ks, int64_t D, int live) {
  __m512 acc[16];
  for (int s = 0; s < 16; ++s) acc[s] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 qd = _mm512_loadu_ps(q + d);
    for (int s = 0; s < 16; ++s)
      acc[s] = _mm512_add_ps(acc[s], _mm512_mul_ps(qd, _mm512_loadu_ps(k + (FULL || s < live ? s : 0) * ks + d)));
  }
  return reduce16(acc);
}
#endif

at::Tensor exact_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                           double scaling_in) {
  TORCH_CHECK(q_in.dim() == 4 && k.dim() == 4 && v.dim() == 4, "exact_attention: q, k, v must be 4-D");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "exact_attention: float32 q, k, v");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "exact_attention: k and v rows must be contiguous");
  at::Tensor q = q_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), Q = q.size(2), D = q.size(3);
  const int64_t HKV = k.size(1), K = k.size(2);
  TORCH_CHECK(H % HKV == 0 && v.size(2) == K && k.size(3) == D && v.size(3) == D, "exact_attention: shapes");
  const bool has_mask = mask.numel() > 0;
  if (has_mask) {
    TORCH_CHECK(mask.dim() == 4 && mask.scalar_type() == at::kFloat && mask.size(2) == Q && mask.size(3) >= K,
                "exact_attention: mask must be [B, 1|H, Q, >=K] float32");
    TORCH_CHECK(mask.stride(3) == 1 || K == 1, "exact_attention: mask rows must be contiguous");
  }
  const float scaling = static_cast<float>(scaling_in);
  const int64_t groups = H / HKV;
  at::Tensor out = at::empty({B, Q, H, D}, q.options());
  const float* pq = q.data_ptr<float>();
  const float* pk = k.data_ptr<float>();
  const float* pv = v.data_ptr<float>();
  const float* pm = has_mask ? mask.data_ptr<float>() : nullptr;
  float* po = out.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t ms0 = has_mask ? mask.stride(0) : 0, ms1 = has_mask && mask.size(1) > 1 ? mask.stride(1) : 0;
  const int64_t ms2 = has_mask ? mask.stride(2) : 0;
  const float hidden = -FLT_MAX;  // transformers' additive masks put the dtype's minimum where a key is hidden
#if defined(__AVX2__)
  const bool wide = D % 16 == 0;
#endif
  // one task per (batch, key/value head, query row): the query heads that share a key/value head run together over
  // blocks of keys that stay in L1, so the cache is read once for all of them; each (head, row) still runs the
  // same arithmetic in the same key order, whatever else the task or the batch holds.
  constexpr int64_t KB = 32;  // keys per block: 32 keys x D floats of k or v (16 KB at D = 128)
  const int64_t blocks = (K + KB - 1) / KB;
#if defined(__AVX512F__)
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
  at::parallel_for(0, B * HKV * Q, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(groups * (K + 16)), acc(groups * D);
    std::vector<int32_t> seen(groups * (K + 16)), count(groups);
    std::vector<float> top(groups), topw(groups * 16);
    std::vector<double> total(groups);
    std::vector<int32_t> ends(groups * blocks);  // visible keys counted up to the end of each block
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / (HKV * Q), hk = (t / Q) % HKV, i = t % Q;
      const float* kb = pk + b * ks0 + hk * ks1;
      const float* vb = pv + b * vs0 + hk * vs1;
      std::fill(count.begin(), count.end(), 0);
      std::fill(top.begin(), top.end(), -INFINITY);
      std::fill(topw.begin(), topw.end(), -INFINITY);
      for (int64_t j0 = 0; j0 < K; j0 += KB) {
        const int64_t j1 = std::min(K, j0 + KB);
        for (int64_t e = 0; e < groups; ++e) {
          const int64_t h = hk * groups + e;
          const float* qr = pq + ((b * H + h) * Q + i) * D;
          const float* mr = has_mask ? pm + b * ms0 + h * ms1 + i * ms2 : nullptr;
          float* se = s.data() + e * (K + 16);
          int32_t* sn = seen.data() + e * (K + 16);
          int64_t n = count[e];
          float tp = top[e];
          int64_t j = j0;
#if defined(__AVX512F__)
          __m512 tv = _mm512_loadu_ps(topw.data() + e * 16);
          // sixteen keys at a time: the visible ones' scores and indices packed in order, as the loop below does
          for (; wide && j < j1; j += 16) {
            const int live = static_cast<int>(std::min<int64_t>(16, j1 - j));
            const __mmask16 in = static_cast<__mmask16>((1u << live) - 1);
            __mmask16 vis = in;
            __m512 mv = _mm512_setzero_ps();
            if (mr) {
              mv = _mm512_maskz_loadu_ps(in, mr + j);
              vis = _mm512_mask_cmp_ps_mask(in, mv, _mm512_set1_ps(hidden), _CMP_NLE_UQ);
            }
            if (!vis) continue;
            const __m512 dots = live == 16 ? dots16<true>(qr, kb + j * ks2, ks2, D, 16)
                                           : dots16<false>(qr, kb + j * ks2, ks2, D, live);
            __m512 x = _mm512_mul_ps(dots, _mm512_set1_ps(scaling));
            if (mr) x = _mm512_add_ps(x, mv);
            // register compress, then a plain store (s and seen have 16 spare slots): the memory form is slow on Zen 4
            _mm512_storeu_ps(se + n, _mm512_maskz_compress_ps(vis, x));
            _mm512_storeu_si512(sn + n, _mm512_maskz_compress_epi32(
                vis, _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(j)), iota)));
            n += __builtin_popcount(vis);
            tv = _mm512_mask_max_ps(tv, vis, tv, x);  // the maximum is exact: lanes reduced once, after all blocks
          }
          _mm512_storeu_ps(topw.data() + e * 16, tv);
#endif
          for (; j < j1; ++j) {
            if (mr && mr[j] <= hidden) continue;  // a hidden key adds an exact zero: left out
#if defined(__AVX2__)
            float x = (wide ? dot16(qr, kb + j * ks2, D) : dot(qr, kb + j * ks2, D)) * scaling;
#else
            float x = dot(qr, kb + j * ks2, D) * scaling;
#endif
            if (mr) x += mr[j];
            se[n] = x;
            sn[n++] = static_cast<int32_t>(j);
            tp = x > tp ? x : tp;
          }
          count[e] = n;
          top[e] = tp;
          ends[e * blocks + j0 / KB] = static_cast<int32_t>(n);
        }
      }
#if defined(__AVX512F__)
      for (int64_t e = 0; e < groups; ++e) {
        const float m = _mm512_reduce_max_ps(_mm512_loadu_ps(topw.data() + e * 16));
        top[e] = m > top[e] ? m : top[e];
      }
#endif
      // exp(score - max) in place, and the softmax denominator in float64: eight lanes (lane l adds the scores
      // j = l mod 8 in order), then a fixed tree; the lanes keep the sum off one serial chain of n additions
      for (int64_t e = 0; e < groups; ++e) {
        float* se = s.data() + e * (K + 16);
        const int64_t n = count[e];
        if (n == 0 || !std::isfinite(top[e])) continue;
        double lane[8] = {};
#if defined(__AVX2__)
        __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
        for (int64_t j = 0; j < n; j += 8) {  // s has room for 16 more: lanes past n are computed, then zeroed
          __m256 x = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(se + j), _mm256_set1_ps(top[e])));
          if (n - j < 8) {
            const __m256i past = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n - j)),
                                                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            x = _mm256_and_ps(x, _mm256_castsi256_ps(past));
          }
          _mm256_storeu_ps(se + j, x);
          lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
          hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
        }
        _mm256_storeu_pd(lane, lo);
        _mm256_storeu_pd(lane + 4, hi);
#else
        for (int64_t j = 0; j < n; ++j) {
          se[j] = exp_neg(se[j] - top[e]);
          lane[j % 8] += se[j];
        }
#endif
        total[e] = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
      }
      // values: for each head, keys in order; a block's visible keys are those counted up to its end, so the
      // accumulators continue across blocks exactly as one pass would
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j0 = 0; j0 < K; j0 += KB) {
        for (int64_t e = 0; e < groups; ++e) {
          if (count[e] == 0 || !std::isfinite(top[e])) continue;
          const float* se = s.data() + e * (K + 16);
          const int32_t* sn = seen.data() + e * (K + 16);
          float* ae = acc.data() + e * D;
          const int64_t from = j0 ? ends[e * blocks + j0 / KB - 1] : 0, to = ends[e * blocks + j0 / KB];
          if (from == to) continue;
          int64_t d0 = 0;
#if defined(__AVX512F__)
          for (; wide && d0 + 64 <= D; d0 += 64) {  // 64 outputs in four registers, each lane as below
            __m512 a0 = _mm512_loadu_ps(ae + d0), a1 = _mm512_loadu_ps(ae + d0 + 16);
            __m512 a2 = _mm512_loadu_ps(ae + d0 + 32), a3 = _mm512_loadu_ps(ae + d0 + 48);
            for (int64_t j = from; j < to; ++j) {
              const float* vr = vb + sn[j] * vs2 + d0;
              const __m512 p = _mm512_set1_ps(se[j]);
              a0 = _mm512_add_ps(a0, _mm512_mul_ps(p, _mm512_loadu_ps(vr)));
              a1 = _mm512_add_ps(a1, _mm512_mul_ps(p, _mm512_loadu_ps(vr + 16)));
              a2 = _mm512_add_ps(a2, _mm512_mul_ps(p, _mm512_loadu_ps(vr + 32)));
              a3 = _mm512_add_ps(a3, _mm512_mul_ps(p, _mm512_loadu_ps(vr + 48)));
            }
            _mm512_storeu_ps(ae + d0, a0);
            _mm512_storeu_ps(ae + d0 + 16, a1);
            _mm512_storeu_ps(ae + d0 + 32, a2);
            _mm512_storeu_ps(ae + d0 + 48, a3);
          }
#endif
#if defined(__AVX2__)
          for (; d0 + 32 <= D; d0 += 32) {  // 32 outputs in four registers across the block's keys, in key order
            __m256 a0 = _mm256_loadu_ps(ae + d0), a1 = _mm256_loadu_ps(ae + d0 + 8);
            __m256 a2 = _mm256_loadu_ps(ae + d0 + 16), a3 = _mm256_loadu_ps(ae + d0 + 24);
            for (int64_t j = from; j < to; ++j) {
              const float* vr = vb + sn[j] * vs2 + d0;
              const __m256 p = _mm256_set1_ps(se[j]);
              a0 = _mm256_add_ps(a0, _mm256_mul_ps(p, _mm256_loadu_ps(vr)));
              a1 = _mm256_add_ps(a1, _mm256_mul_ps(p, _mm256_loadu_ps(vr + 8)));
              a2 = _mm256_add_ps(a2, _mm256_mul_ps(p, _mm256_loadu_ps(vr + 16)));
              a3 = _mm256_add_ps(a3, _mm256_mul_ps(p, _mm256_loadu_ps(vr + 24)));
            }
            _mm256_storeu_ps(ae + d0, a0);
            _mm256_storeu_ps(ae + d0 + 8, a1);
            _mm256_storeu_ps(ae + d0 + 16, a2);
            _mm256_storeu_ps(ae + d0 + 24, a3);
          }
#endif
          for (int64_t j = from; j < to; ++j) {
            const float* vr = vb + sn[j] * vs2;
            for (int64_t d = d0; d < D; ++d) ae[d] += se[j] * vr[d];
          }
        }
      }
      for (int64_t e = 0; e < groups; ++e) {
        const int64_t h = hk * groups + e;
        float* o = po + ((b * Q + i) * H + h) * D;
        const int64_t n = count[e];
        if (n == 0 || !std::isfinite(top[e])) {  // a fully hidden row (padding): zeros
          std::memset(o, 0, D * sizeof(float));
          continue;
        }
        const float inv = static_cast<float>(1.0 / total[e]);
        const float* ae = acc.data() + e * D;
        for (int64_t d = 0; d < D; ++d) o[d] = ae[d] * inv;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ragspec_gguf, m) {
  m.def("exact_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(ragspec_gguf, CPU, m) {
  m.impl("exact_attention", &exact_attention);
}
