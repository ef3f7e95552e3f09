// The Q4_1 product's inner loops for AVX-512 BF16 (q4_matmul.cpp has the layout and the driver).
// x is rounded to bfloat16 (as PyTorch's int4 kernel rounds it); a nibble becomes its bfloat16
// value, exactly, by one table lookup (VPERMW); per group of 32 k, VDPBF16PS sums bfloat16 pairs
// (products exact, fp32 sums): S = sum of x[k] * q[k], then acc = m * sum(x) + (d * S + acc).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace sendlens::q4 {

constexpr const char* ISA = "avx512bf16";
using Expanded = __m512bh;                         // an expanded panel: K/2 of these
constexpr int64_t MAX_ROWS = 8;                    // rows of a tile: each keeps its sums in registers
constexpr int PANELS_ONE_ROW = 4;   // panels a tile of one row takes at once (a decode step)
constexpr int PANELS_TWO_ROWS = 4;  // and of two rows

inline int64_t expanded_size(int64_t K) { return K / 2; }

// The activations as the tiles read them.
struct Rows {
  int64_t K;
  at::Tensor x;            // (M, K) bfloat16
  std::vector<float> sum;  // (M, K/32): each group's sum of x, for the m term
  const uint16_t* data = nullptr;  // x's, taken once (data_ptr checks the tensor on every call)
  const uint16_t* row(int64_t r) const { return data + r * K; }
};

inline Rows prepare(const at::Tensor& x_in) {
  const int64_t M = x_in.size(0), K = x_in.size(1), K32 = K / 32;
  Rows rows{K, x_in.to(at::kBFloat16).contiguous(), std::vector<float>(M * K32)};
  rows.data = reinterpret_cast<const uint16_t*>(rows.x.data_ptr());
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* v = rows.row(r);
      for (int64_t g = 0; g < K32; ++g) {  // in order, one value at a time
        float t = 0.0f;
        for (int64_t k = g * 32; k < g * 32 + 32; ++k) {
          const uint32_t bits = static_cast<uint32_t>(v[k]) << 16;
          float f;
          std::memcpy(&f, &bits, sizeof f);
          t += f;
        }
        rows.sum[r * K32 + g] = t;
      }
    }
  });
  return rows;
}

// bfloat16 0, 1, ... 15 (twice: VPERMW reads 32 words by 5-bit index): a nibble's weight, exactly.
inline __m512i nibble_values() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const float v = static_cast<float>(i % 16);
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    t[i] = static_cast<uint16_t>(bits >> 16);
  }
  return _mm512_load_si512(t);
}

// Unit u of a panel (k = 4u .. 4u + 3): the 16 columns' q as bfloat16 pairs, for k = 4u, 4u + 1
// (first) and 4u + 2, 4u + 3 (second); lane c holds column c's pair.
inline void unit(const uint8_t* nib, int64_t u, __m512i values, __m512bh& first, __m512bh& second) {
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(nib + u * 32)));
  first = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(b, _mm512_set1_epi16(15)), values);
  second = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), values);
}

inline __m512bh pair_of(const uint16_t* row, int64_t k) {  // x[k], x[k + 1] in every lane
  int32_t pair;
  std::memcpy(&pair, row + k, sizeof pair);
  return (__m512bh)_mm512_set1_epi32(pair);
}

// One group's end: acc += d * S + m * (the group's sum of x), the same two steps for every row.
inline __m512 close_group(__m512 acc, __m512 S, const at::Half* dm, int64_t g, float x_sum) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32)));
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32 + 16)));
  return _mm512_fmadd_ps(m, _mm512_set1_ps(x_sum), _mm512_fmadd_ps(d, S, acc));
}

// R rows from r0 times NP adjacent 16-column panels -> y (R, 16 NP), row stride ldy. Several
// panels give a few rows independent chains.
template <int R, int NP>
void tile(const Rows& a, int64_t r0, const uint8_t* nib, const at::Half* dm, float* y, int64_t ldy) {
  const int64_t K = a.K;
  const __m512i values = nibble_values();
  __m512 acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NP; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / 32; ++g) {
    __m512 S[R][NP];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NP; ++c) S[r][c] = _mm512_setzero_ps();
    for (int64_t u = g * 8; u < g * 8 + 8; ++u) {
      for (int c = 0; c < NP; ++c) {
        __m512bh first, second;
        unit(nib + c * (K / 4) * 32, u, values, first, second);
        for (int r = 0; r < R; ++r) {
          S[r][c] = _mm512_dpbf16_ps(S[r][c], first, pair_of(a.row(r0 + r), 4 * u));
          S[r][c] = _mm512_dpbf16_ps(S[r][c], second, pair_of(a.row(r0 + r), 4 * u + 2));
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NP; ++c)
        acc[r][c] = close_group(acc[r][c], S[r][c], dm + c * (K / 32) * 32, g, a.sum[(r0 + r) * (K / 32) + g]);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NP; ++c) _mm512_storeu_ps(y + r * ldy + c * 16, acc[r][c]);
}

// A panel's q as bfloat16 pairs, once, for every tile of rows that follows.
inline void expand(const uint8_t* nib, int64_t K, Expanded* buffer) {
  const __m512i values = nibble_values();
  for (int64_t u = 0; u < K / 4; ++u) unit(nib, u, values, buffer[2 * u], buffer[2 * u + 1]);
}

// R rows from r0 times one expanded panel: the same operations in the same order as tile<R, 1>.
template <int R>
void tile_from(const Rows& a, int64_t r0, const Expanded* buffer, const at::Half* dm, float* y, int64_t ldy) {
  const int64_t K = a.K;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / 32; ++g) {
    __m512 S[R];
    for (int r = 0; r < R; ++r) S[r] = _mm512_setzero_ps();
    for (int64_t p = g * 16; p < g * 16 + 16; ++p) {
      const __m512bh w = buffer[p];
      for (int r = 0; r < R; ++r) S[r] = _mm512_dpbf16_ps(S[r], w, pair_of(a.row(r0 + r), 2 * p));
    }
    for (int r = 0; r < R; ++r) acc[r] = close_group(acc[r], S[r], dm, g, a.sum[(r0 + r) * (K / 32) + g]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

}  // namespace sendlens::q4
