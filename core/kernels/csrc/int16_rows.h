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

#include "int8_rows.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace sendlens {

using Int16Rows = IntRows<int16_t>;     // int8_rows.h's rows, 16 bits wide

inline Int16Rows round_to_int16(const at::Tensor& x) { return round_rows<int16_t>(x, 32767); }

#ifdef __AVX2__
// xi[k], xi[k + 1] of a row in every 32-bit lane: the pair VPMADDWD multiplies with two weights.
inline __m256i int16_pair(const int16_t* row, int64_t k) {
  int32_t pair;
  std::memcpy(&pair, row + k, sizeof pair);
  return _mm256_set1_epi32(pair);
}
#endif

}  // namespace sendlens
