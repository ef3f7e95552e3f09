// Activations rounded to 16-bit integers per group of 32, for the integer products (VPMADDWD) of
// the AVX2 Q8_0 kernel (q8_matmul.cpp; the Q4_1 kernels and the VNNI Q8_0 one take 8-bit
// integers, int8_rows.h): x ~ s * xi with
// s = the group's largest |x| / 32767, an error of at most 2^-16 of that (finer than bfloat16's
// rounding of every value). Each row is rounded on its own, so a row's integers never depend on
// the batch.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace sendlens {

struct Int16Rows {
  int64_t K;
  std::vector<int16_t> xi;   // (M, K): x ~ scale * xi, per group of 32
  std::vector<float> scale;  // (M, K/32)
  std::vector<float> sum;    // (M, K/32): scale * (the group's sum of xi), for Q4_1's m term
  const int16_t* row(int64_t r) const { return xi.data() + r * K; }
};

inline Int16Rows round_to_int16(const at::Tensor& x_in) {
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), K32 = K / 32;
  Int16Rows rows{K, std::vector<int16_t>(M * K), std::vector<float>(M * K32), std::vector<float>(M * K32)};
  const float* xs = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < K32; ++g) {
        const float* v = xs + r * K + g * 32;
        int16_t* q = rows.xi.data() + r * K + g * 32;
        float amax = 0.0f;
        for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(v[k]));
        const float scale = amax / 32767.0f, inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        int32_t total = 0;
        for (int k = 0; k < 32; ++k) {
          const int32_t i = std::clamp(static_cast<int32_t>(std::nearbyint(v[k] * inv)), -32767, 32767);
          q[k] = static_cast<int16_t>(i);
          total += i;
        }
        rows.scale[r * K32 + g] = scale;
        rows.sum[r * K32 + g] = scale * static_cast<float>(total);
      }
  });
  return rows;
}

#ifdef __AVX2__
// xi[k], xi[k + 1] of a row in every 32-bit lane: the pair VPMADDWD multiplies with two weights.
inline __m256i int16_pair(const int16_t* row, int64_t k) {
  int32_t pair;
  std::memcpy(&pair, row + k, sizeof pair);
  return _mm256_set1_epi32(pair);
}
#endif

}  // namespace sendlens
