// Rotary position embedding (Su et al., 2021) in Llama's "rotate half" layout, one pass: for each
// token and head, y[i] = x[i] cos[p][i] + x[i +- D/2] sin[p][i], with model.py's cos and sin
// tables (sin already signed for the first half). Each element on its own, so no result depends on
// the batch. torch needs six small operations for it (two slices, a cat, two products, a sum).

#include <ATen/Parallel.h>

#include "kernels.h"

namespace sendlens {

void rotary_row(const float* x, int64_t heads, int64_t head_stride, int64_t D, const float* c, const float* s,
                float* out) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* in = x + h * head_stride;
    float* y = out + h * D;
    for (int64_t i = 0; i < half; ++i) y[i] = in[i] * c[i] + in[i + half] * s[i];
    for (int64_t i = half; i < D; ++i) y[i] = in[i] * c[i] + in[i - half] * s[i];
  }
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary: x (T, heads, D) float, D even and contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat && cos.sizes() == sin.sizes() && cos.size(1) == x.size(2),
              "rotary: cos and sin (positions, D) float");
  TORCH_CHECK(positions.is_contiguous() && positions.scalar_type() == at::kLong && positions.size(0) == x.size(0),
              "rotary: int64 positions (T,)");
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2), P = cos.size(0);
  at::Tensor out = at::empty({T, heads, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position ", pos[t], " is outside the table");
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      rotary_row(xp + t * st, heads, sh, D, cp + pos[t] * D, sp + pos[t] * D, op + t * heads * D);
  });
  return out;
}

}  // namespace sendlens
