// SwiGLU's middle (Shazeer, 2020): silu(gate) * up = gate / (1 + e^-gate) * up, from the fused
// gate_up product's output (T, 2I), in one pass, in its dtype (float, or bfloat16 rounded once at the
// end). Each element on its own, so no result depends on the batch. torch needs a chunk, a silu and
// a product, each rounding to bfloat16.

#include <ATen/Parallel.h>

#include "kernels.h"
#include "vec.h"

namespace sendlens {
namespace {

// Lanes i .. i + 15 of one float row's silu(gate) * up into out.
inline void silu_mul_lanes(const float* row, int64_t I, int64_t i, float* out) {
  const Vec g = Vec::load(row + i), u = Vec::load(row + I + i);
  (g / (Vec::set1(1.0f) + exp(g * Vec::set1(-1.0f))) * u).store(out + i);
}

}  // namespace

void silu_mul_row(const float* gate_up, int64_t I, int64_t from, int64_t to, float* out) {
  for (int64_t i = from; i < to; i += LANES) silu_mul_lanes(gate_up, I, i, out);
}

at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  const at::Tensor gate_up = gate_up_in.contiguous();
  const bool bf16 = gate_up.scalar_type() == at::kBFloat16;
  TORCH_CHECK(gate_up.dim() == 2 && (bf16 || gate_up.scalar_type() == at::kFloat) &&
              gate_up.size(1) % (2 * LANES) == 0,
              "silu_mul: gate_up (T, 2I) float or bfloat16, I a multiple of ", LANES);
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gate_up.options());
  const Vec one = Vec::set1(1.0f), minus = Vec::set1(-1.0f);
  // the pointers once: data_ptr checks the tensor on every call, and this loop is per 16 values
  const void* in = gate_up.data_ptr();
  void* o = out.data_ptr();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < I; i += LANES) {
        if (bf16) {
          const uint16_t* row = static_cast<const uint16_t*>(in) + t * 2 * I;
          const Vec g = load_bf16(row + i), u = load_bf16(row + I + i);
          store_bf16(g / (one + exp(g * minus)) * u, static_cast<uint16_t*>(o) + t * I + i);
        } else {
          silu_mul_lanes(static_cast<const float*>(in) + t * 2 * I, I, i, static_cast<float*>(o) + t * I);
        }
      }
    }
  });
  return out;
}

}  // namespace sendlens
