// dtype gguf's int8 prompt copy made from the packed blocks at load, in one pass per block of 8 outputs.
// Built with the GGUF kernels by ragspec/runtime/gguf_kernel.py; the decode steps never run it, so it is not part of
// the digest that names their measurements.
//
// Why: the copy is 1 byte a weight (the 1.5B's: 1.3 GB). Kept on disk beside the blocks it doubled what dtype gguf
// keeps of a model; made in torch (`gguf_formats.int8_copy`: de-quantize, then int8_linear.quantize_rows) it took
// 11.6 s of every load. Here each block of 8 rows is de-quantized into a buffer and quantized from it, with the
// operations of those torch functions in their order, so the bits are theirs:
//   w = q * (D*sc) - (Dmin*mn)  (u4k),  (q - 32) * (D*sc)  (u6),  q * d + m  (u4, u5),  q * d  (s8);
//   scale = max(max_k |w|, FLT_MIN) / 127;  q8 = clamp(round_half_even(w / scale), -127, 127).
// The packed layout is `gguf_formats.pack`'s (and gguf_kernel.cpp's header): per block of 8 outputs and group of 32
// inputs, chunk c (inputs 4c..4c+3) of output j at byte 32c + 4j + t (s8), or its nibble of byte 32(c % 4) + 4j + t
// (high for c >= 4); u5's fifth bits as 4 bytes a chunk, u6's top two bits at bits 2(c % 4) of 32-byte vector c / 4.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "kernel_math.h"

namespace {

constexpr int GROUP = 32;
enum Fmt { U4 = 0, U5 = 1, S8 = 2, U6 = 3, U4K = 4 };  // gguf_formats.FORMATS

#if defined(__F16C__)
inline float half(uint16_t h) { return _cvtsh_ss(h); }
#else
inline float half(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }
#endif

// the weight values q of output j, group g of block b (the kernel's bytes for this block and group) into q[32]
template <int fmt>
inline void unpack_group(const uint8_t* w, const uint8_t* wh, int j, int32_t* q) {
  for (int c = 0; c < 8; ++c) {
    for (int t = 0; t < 4; ++t) {
      const int at = 4 * j + t;
      int32_t v;
      if constexpr (fmt == S8) {
        v = static_cast<int8_t>(w[32 * c + at]);
      } else {
        const uint8_t byte = w[32 * (c % 4) + at];
        v = c < 4 ? (byte & 0x0F) : (byte >> 4);
        if constexpr (fmt == U5) v |= ((wh[4 * c + at / 8] >> (at % 8)) & 1) << 4;
        if constexpr (fmt == U6) v |= ((wh[32 * (c / 4) + at] >> (2 * (c % 4))) & 3) << 4;
      }
      q[4 * c + t] = v;
    }
  }
}

// de-quantize the 8 outputs of block b into rows[8][K] as gguf_formats.dequantize computes them
template <int fmt>
void dequantize_block(int64_t b, int64_t G, const uint8_t* w, const uint8_t* wh, const uint16_t* d,
                      const uint8_t* mn, float* rows, int64_t K) {
  const int64_t wbytes = fmt == S8 ? 256 : 128, hbytes = fmt == U5 ? 32 : fmt == U6 ? 64 : 0;
  int32_t q[GROUP];
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = w + (b * G + g) * wbytes;
    const uint8_t* hg = hbytes ? wh + (b * G + g) * hbytes : nullptr;
    for (int j = 0; j < 8; ++j) {
      unpack_group<fmt>(wg, hg, j, q);
      float* out = rows + j * K + g * GROUP;
      if constexpr (fmt == U4K) {  // d [N/8, G/8, 2, 8] fp16 bits, mn [N/8, G, 2, 8] uint8
        const int64_t s = (b * (G / 8) + g / 8) * 16;
        const float scale = half(d[s + j]) * static_cast<float>(mn[(b * G + g) * 16 + j]);
        const float shift = half(d[s + 8 + j]) * static_cast<float>(mn[(b * G + g) * 16 + 8 + j]);
        for (int i = 0; i < GROUP; ++i) out[i] = static_cast<float>(q[i]) * scale - shift;
      } else if constexpr (fmt == U6) {  // d [N/8, G/8, 8] fp16 bits, mn [N/8, G, 2, 8] int8
        const float sup = half(d[(b * (G / 8) + g / 8) * 8 + j]);
        const int8_t* sc = reinterpret_cast<const int8_t*>(mn) + (b * G + g) * 16;
        const float s0 = sup * static_cast<float>(sc[j]), s1 = sup * static_cast<float>(sc[8 + j]);
        for (int i = 0; i < GROUP; ++i) out[i] = (static_cast<float>(q[i]) - 32.0f) * (i < 16 ? s0 : s1);
      } else {  // d, mn [N/8, G, 8] fp16 bits
        const float dv = half(d[(b * G + g) * 8 + j]);
        if constexpr (fmt == S8) {
          for (int i = 0; i < GROUP; ++i) out[i] = static_cast<float>(q[i]) * dv;
        } else {
          const float mv = half(reinterpret_cast<const uint16_t*>(mn)[(b * G + g) * 8 + j]);
          for (int i = 0; i < GROUP; ++i) out[i] = static_cast<float>(q[i]) * dv + mv;
        }
      }
    }
  }
}

using BlockFn = void (*)(int64_t, int64_t, const uint8_t*, const uint8_t*, const uint16_t*, const uint8_t*, float*,
                         int64_t);
constexpr BlockFn BLOCK[5] = {dequantize_block<U4>, dequantize_block<U5>, dequantize_block<S8>, dequantize_block<U6>,
                              dequantize_block<U4K>};

// (int8 [n, k], float32 scale [n]) from the packed blocks of an n x k linear
std::tuple<at::Tensor, at::Tensor> int8_copy(const at::Tensor& w, const at::Tensor& wh, const at::Tensor& d,
                                             const at::Tensor& mn, int64_t fmt, int64_t n, int64_t k) {
  TORCH_CHECK(fmt >= 0 && fmt <= 4, "int8_copy: format code ", fmt, " is not one of the five");
  TORCH_CHECK(k % GROUP == 0 && w.is_contiguous() && wh.is_contiguous() && d.is_contiguous() && mn.is_contiguous(),
              "int8_copy: packed blocks must be contiguous with K a multiple of 32");
  const int64_t G = k / GROUP, nb = (n + 7) / 8;
  TORCH_CHECK(w.numel() == nb * G * (fmt == S8 ? 256 : 128), "int8_copy: w holds ", w.numel(), " bytes, not the ",
              nb, "x", G, " blocks of an ", n, "x", k, " linear");
  at::Tensor q = at::empty({n, k}, w.options().dtype(at::kChar));
  at::Tensor scale = at::empty({n}, w.options().dtype(at::kFloat));
  const uint8_t* pw = static_cast<const uint8_t*>(w.data_ptr());
  const uint8_t* ph = wh.numel() ? static_cast<const uint8_t*>(wh.data_ptr()) : nullptr;
  const uint16_t* pd = static_cast<const uint16_t*>(d.data_ptr());
  const uint8_t* pm = mn.numel() ? static_cast<const uint8_t*>(mn.data_ptr()) : nullptr;
  int8_t* pq = q.data_ptr<int8_t>();
  float* ps = scale.data_ptr<float>();
  at::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> rows(8 * k);
    for (int64_t b = begin; b < end; ++b) {
      BLOCK[fmt](b, G, pw, ph, pd, pm, rows.data(), k);
      for (int64_t j = 0; j < 8 && b * 8 + j < n; ++j) ps[b * 8 + j] = ragspec_math::quantize_row(rows.data() + j * k, k, pq + (b * 8 + j) * k);
    }
  });
  return {q, scale};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ragspec_gguf, m) {
  m.def("int8_copy(Tensor w, Tensor wh, Tensor d, Tensor mn, int fmt, int n, int k) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ragspec_gguf, CPU, m) { m.impl("int8_copy", &int8_copy); }
