// RMSNorm (Zhang & Sennrich, 2019), one row at a time: the sum of squares in 16 lanes, each lane
// adding its columns in order, then a fixed tree; 1 / sqrt(sum / C + eps); then (x * that) * w.
// A row's bits depend on that row alone. torch's own rms_norm is about ten small operations, and
// a decode step runs 61 of them on one row each; this is one pass. add_rms_norm adds the residual
// first, in the same pass (vLLM's fused_add_rms_norm).

#include <ATen/Parallel.h>

#include "kernels.h"
#include "vec.h"

namespace sendlens {

void rms_norm_row(const float* row, const float* w, int64_t C, float eps, float* out) {
  const float inv_c = 1.0f / static_cast<float>(C);
  Vec sq = Vec::set1(0.0f);
  for (int64_t c = 0; c < C; c += LANES) {
    const Vec v = Vec::load(row + c);
    sq = fma(v, v, sq);
  }
  const Vec scale = Vec::set1(1.0f / std::sqrt(reduce_add(sq) * inv_c + eps));
  for (int64_t c = 0; c < C; c += LANES) ((Vec::load(row + c) * scale) * Vec::load(w + c)).store(out + c);
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
              weight.is_contiguous() && weight.numel() == x.size(1) && x.size(1) % LANES == 0,
              "rms_norm: x (T, C) float with C a multiple of ", LANES, ", weight (C,)");
  const int64_t T = x.size(0), C = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rms_norm_row(xp + t * C, w, C, e, op + t * C);
  });
  return out;
}

at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& delta_in, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == x.size(1) &&
                  x.size(1) % LANES == 0,
              "add_rms_norm: x (T, C) contiguous float with C a multiple of ", LANES, ", weight (C,)");
  TORCH_CHECK(delta_in.sizes() == x.sizes(), "add_rms_norm: delta has the shape of x");
  const at::Tensor delta = delta_in.to(at::kFloat).contiguous();  // exact, as x + delta promotes it
  const int64_t T = x.size(0), C = x.size(1);
  at::Tensor out = at::empty_like(x);
  float* xp = x.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = xp + t * C;
      for (int64_t c = 0; c < C; c += LANES) (Vec::load(row + c) + Vec::load(dp + t * C + c)).store(row + c);
      rms_norm_row(row, w, C, e, op + t * C);
    }
  });
  return out;
}

}  // namespace sendlens
