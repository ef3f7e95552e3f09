// The Q4_1 product's inner loops for AVX2 (q4_matmul.cpp has the layout and the driver), where the
// CPU lacks AVX-512 VNNI. Each row of x is rounded once to 8-bit integers per group of 32
// (int8_rows.h: x ~ s * xi, s = the group's largest |x| / 127), as llama.cpp does; VPMADDUBSW
// multiplies pairs of unsigned nibbles q by signed xi into 16-bit sums (each at most
// 2 * 15 * 127 = 3,810, so no saturation), eight of them add up in 16 bits per group (at most
// 30,480 < 2^15: exact), and VPMADDWD by ones widens each column's pairs to its 32-bit S: per group
// and column S = sum over k of xi[k] * q[k], an exact integer, the same in any order; then
// y = (s * sum of xi) * m + ((d * s) * S + y) in fp32, as q4_avx512.h does lane for lane.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "int8_rows.h"
#include "q4_ahead.h"

namespace sendlens::q4 {

constexpr const char* ISA = "avx2";
using Expanded = __m256i;          // an expanded panel: K/2 of these (per octet and half: low, high quads)
constexpr int64_t MAX_ROWS = 4;    // rows of a tile: 8 sums and the weights in registers

inline int64_t expanded_size(int64_t K) { return K / 2; }

// The activations as the tiles read them: rounded to 8-bit integers per group (int8_rows.h).
using Rows = Int8Rows;
inline Rows prepare(const at::Tensor& x) { return round_to_int8(x); }

// Octet o of a panel (k = 8o .. 8o + 7), half h (columns 8h .. 8h + 7): 32 bytes, byte 4c + j
// holding column 8h + c's q at k = 8o + j (low nibble) and at k = 8o + 4 + j (high nibble)
// (q4_avx512.h's layout, read a half at a time). A mask gives the quads at k = 8o .. 8o + 3 (lo),
// a shift and a mask those at 8o + 4 .. 8o + 7 (hi), as VPMADDUBSW reads them.
inline void octet(const uint8_t* nib, int64_t o, int h, __m256i& lo, __m256i& hi) {
  const __m256i low = _mm256_set1_epi8(15);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nib + o * 64 + h * 32));
  lo = _mm256_and_si256(v, low);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
}

inline __m256i quad_of(const int8_t* row, int64_t k) { return _mm256_set1_epi32(int8_quad(row, k)); }

// A group's 16-bit pair sums of one column half -> its 8 columns' S as 32-bit integers.
inline __m256i widen(__m256i pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }

// lo, hi times the quads at k and k + 4, added to the 16-bit sums.
inline __m256i add_octet(__m256i sums, __m256i lo, __m256i hi, __m256i x_lo, __m256i x_hi) {
  return _mm256_add_epi16(sums, _mm256_add_epi16(_mm256_maddubs_epi16(lo, x_lo), _mm256_maddubs_epi16(hi, x_hi)));
}

// Group g's d and m for columns 8h .. 8h + 7, as fp32.
struct GroupScales {
  __m256 d, m;
};
inline GroupScales group_scales(const at::Half* dm, int64_t g, int h) {
  const at::Half* p = dm + g * 32 + 8 * h;
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}

// One group's end for 8 columns: y = sum * m + ((d * scale) * S + y), the same steps for every row.
inline void close_group(float* y, __m256i S, const GroupScales& dm, float scale, float sum) {
  const __m256 ds = _mm256_mul_ps(dm.d, _mm256_set1_ps(scale));
  const __m256 acc = _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(S), _mm256_loadu_ps(y));
  _mm256_storeu_ps(y, _mm256_fmadd_ps(dm.m, _mm256_set1_ps(sum), acc));
}

inline void zero(float* y, int64_t ldy, int rows, int cols) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; c += 8) _mm256_storeu_ps(y + r * ldy + c, _mm256_setzero_ps());
}

// R rows from r0 times one 16-column panel -> y (R, 16), row stride ldy: a few rows read the
// weights straight, without expanding them (q4_matmul.cpp says why one panel at a time).
template <int R>
void tile(const Rows& a, int64_t r0, const uint8_t* nib, const at::Half* dm, float* y, int64_t ldy) {
  const int64_t K = a.K, K32 = K / 32;
  const int8_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = a.row(r0 + r);
  zero(y, ldy, R, 16);
  for (int64_t g = 0; g < K32; ++g) {
    __m256i S[R][2];  // 16-bit pair sums, a column half each
    for (int r = 0; r < R; ++r) S[r][0] = S[r][1] = _mm256_setzero_si256();
    ahead(nib, dm, g);
    for (int64_t o = g * 4; o < g * 4 + 4; ++o)
      for (int h = 0; h < 2; ++h) {
        __m256i lo, hi;
        octet(nib, o, h, lo, hi);
        for (int r = 0; r < R; ++r)
          S[r][h] = add_octet(S[r][h], lo, hi, quad_of(x[r], 8 * o), quad_of(x[r], 8 * o + 4));
      }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        close_group(y + r * ldy + 8 * h, widen(S[r][h]), group_scales(dm, g, h), a.scale[(r0 + r) * K32 + g],
                    a.sum[(r0 + r) * K32 + g]);
  }
}

// A panel's q as unsigned bytes, once, for every tile of rows that follows.
inline void expand(const uint8_t* nib, int64_t K, Expanded* buffer) {
  for (int64_t o = 0; o < K / 8; ++o)
    for (int h = 0; h < 2; ++h) octet(nib, o, h, buffer[4 * o + 2 * h], buffer[4 * o + 2 * h + 1]);
}

// R rows from r0 times one expanded panel: the same sums (exact) and steps as tile<R>. The rows'
// pointers and each group's d and m are read once, not once per row.
template <int R>
void tile_from(const Rows& a, int64_t r0, const Expanded* buffer, const at::Half* dm, float* y, int64_t ldy) {
  const int64_t K = a.K, K32 = K / 32;
  const int8_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = a.row(r0 + r);
  const float* scale = a.scale.data() + r0 * K32;  // (R, K32)
  const float* sum = a.sum.data() + r0 * K32;
  zero(y, ldy, R, 16);
  for (int64_t g = 0; g < K32; ++g) {
    __m256i S[R][2];
    for (int r = 0; r < R; ++r) S[r][0] = S[r][1] = _mm256_setzero_si256();
    for (int64_t o = g * 4; o < g * 4 + 4; ++o) {
      const Expanded* w = buffer + 4 * o;  // half 0's low and high quads, then half 1's
      for (int r = 0; r < R; ++r) {
        const __m256i x_lo = quad_of(x[r], 8 * o), x_hi = quad_of(x[r], 8 * o + 4);
        S[r][0] = add_octet(S[r][0], w[0], w[1], x_lo, x_hi);
        S[r][1] = add_octet(S[r][1], w[2], w[3], x_lo, x_hi);
      }
    }
    const GroupScales group[2] = {group_scales(dm, g, 0), group_scales(dm, g, 1)};
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        close_group(y + r * ldy + 8 * h, widen(S[r][h]), group[h], scale[r * K32 + g], sum[r * K32 + g]);
  }
}

}  // namespace sendlens::q4
