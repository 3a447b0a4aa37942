// The per-row int8 steps around `torch._int_mm` (runtime/int8_linear.py) in one pass each, for dtype gguf's int8
// prompt copy. Built with the GGUF kernels by ragspec/runtime/gguf_kernel.py.
//
// Why: PyTorch runs int8_linear.quantize_rows as five passes over the activations (abs, max, divide, round,
// clamp) and a sixth to int8, and the product's scaling as three (to float, times the row scale, times the
// column scale): at 1,024 prompt rows of the 0.5B that was ~15 % of the prefill, against 44 % in the GEMMs
// themselves. Here each is one pass, and the same bits as those ops:
//   quantize_rows_int8(x [M, K] float32) -> (q [M, K] int8, scale [M, 1] float32):
//     scale = max(max_k |x|, FLT_MIN) / 127; q = clamp(round_half_even(x / scale), -127, 127)
//   scale_int32(acc [M, N] int32, row_scale [M, 1], col_scale [1, N], bias [N] or empty) -> [M, N] float32:
//     (float(acc) * row_scale) * col_scale (+ bias)
// Rows are independent (a row's maximum is exact in any order), so a row's bits never depend on the batch.
#include <ATen/core/Tensor.h>  // not ATen/ATen.h: a third less to compile on a first ask
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
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

// one row of scale_int32's steps, into `o`
inline void scale_row(const int32_t* a, float s, const float* pc, const float* pb, int64_t N, float* o) {
  int64_t n = 0;
#if defined(__AVX512F__)
  const __m512 sv = _mm512_set1_ps(s);
  for (; n + 16 <= N; n += 16) {
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(a + n)), sv), _mm512_loadu_ps(pc + n));
    if (pb) v = _mm512_add_ps(v, _mm512_loadu_ps(pb + n));
    _mm512_storeu_ps(o + n, v);
  }
#endif
  for (; n < N; ++n) {
    float v = (static_cast<float>(a[n]) * s) * pc[n];
    if (pb) v = v + pb[n];
    o[n] = v;
  }
}

std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "quantize_rows_int8: x must be [M, K] float32");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({M, 1}, x.options());
  const float* px = x.data_ptr<float>();
  int8_t* pq = q.data_ptr<int8_t>();
  float* ps = scale.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      ps[m] = ragspec_math::quantize_row(px + m * K, K, pq + m * K);
    }
  });
  return {q, scale};
}

at::Tensor scale_int32(const at::Tensor& acc_in, const at::Tensor& row_scale, const at::Tensor& col_scale,
                       const at::Tensor& bias) {
  TORCH_CHECK(acc_in.dim() == 2 && acc_in.scalar_type() == at::kInt, "scale_int32: acc must be [M, N] int32");
  const at::Tensor acc = acc_in.contiguous();
  const int64_t M = acc.size(0), N = acc.size(1);
  const at::Tensor rs = row_scale.contiguous(), cs = col_scale.contiguous();
  TORCH_CHECK(rs.numel() == M && cs.numel() == N && rs.scalar_type() == at::kFloat &&
                  cs.scalar_type() == at::kFloat, "scale_int32: a float32 scale per row and per column");
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.numel() == N && bias.scalar_type() == at::kFloat), "scale_int32: bias [N] float32");
  const at::Tensor bc = has_bias ? bias.contiguous() : bias;
  at::Tensor y = at::empty({M, N}, acc.options().dtype(at::kFloat));
  const int32_t* pa = acc.data_ptr<int32_t>();
  const float* pr = rs.data_ptr<float>();
  const float* pc = cs.data_ptr<float>();
  const float* pb = has_bias ? bc.data_ptr<float>() : nullptr;
  float* py = y.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      scale_row(pa + m * N, pr[m], pc, pb, N, py + m * N);
    }
  });
  return y;
}

// The gated MLP's middle for the int8 copy in one pass over each row: gate's and up's products scaled as scale_int32
// does, h = silu(gate) * up as the GGUF kernels' MLP computes it (kernel_math.h), and h quantized as
// quantize_rows_int8 does, for down: (gate [M, N], up [M, N] int32, ...) -> (h_q [M, N] int8, h_scale [M, 1]).
std::tuple<at::Tensor, at::Tensor> int8_glu(const at::Tensor& gate_in, const at::Tensor& up_in,
                                            const at::Tensor& row_scale, const at::Tensor& gate_scale,
                                            const at::Tensor& up_scale) {
  TORCH_CHECK(gate_in.dim() == 2 && gate_in.scalar_type() == at::kInt && up_in.scalar_type() == at::kInt &&
                  gate_in.sizes() == up_in.sizes(), "int8_glu: gate and up must be [M, N] int32");
  const at::Tensor acc = gate_in.contiguous(), up = up_in.contiguous();
  const int64_t M = acc.size(0), N = acc.size(1);
  const at::Tensor rs = row_scale.contiguous(), gs = gate_scale.contiguous(), us = up_scale.contiguous();
  TORCH_CHECK(rs.numel() == M && gs.numel() == N && us.numel() == N && rs.scalar_type() == at::kFloat &&
                  gs.scalar_type() == at::kFloat && us.scalar_type() == at::kFloat,
              "int8_glu: float32 scales per row, per gate and per up column");
  at::Tensor q = at::empty({M, N}, acc.options().dtype(at::kChar));
  at::Tensor scale = at::empty({M, 1}, acc.options().dtype(at::kFloat));
  const int32_t* pa = acc.data_ptr<int32_t>();
  const int32_t* pb = up.data_ptr<int32_t>();
  const float *pr = rs.data_ptr<float>(), *pg = gs.data_ptr<float>(), *pu = us.data_ptr<float>();
  int8_t* pq = q.data_ptr<int8_t>();
  float* ps = scale.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> g(N), u(N);
    for (int64_t m = begin; m < end; ++m) {
      scale_row(pa + m * N, pr[m], pg, nullptr, N, g.data());
      scale_row(pb + m * N, pr[m], pu, nullptr, N, u.data());
      ragspec_math::silu_mul(g.data(), u.data(), g.data(), N);
      ps[m] = ragspec_math::quantize_row(g.data(), N, pq + m * N);
    }
  });
  return {q, scale};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ragspec_gguf, m) {
  m.def("quantize_rows_int8(Tensor x) -> (Tensor, Tensor)");
  m.def("scale_int32(Tensor acc, Tensor row_scale, Tensor col_scale, Tensor bias) -> Tensor");
  m.def("int8_glu(Tensor gate, Tensor up, Tensor row_scale, Tensor gate_scale, Tensor up_scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ragspec_gguf, CPU, m) {
  m.impl("quantize_rows_int8", &quantize_rows_int8);
  m.impl("scale_int32", &scale_int32);
  m.impl("int8_glu", &int8_glu);
}
