// The Q4_1 product's inner loops for AVX-512 VNNI (q4_matmul.cpp has the layout and the driver).
// Each row of x is rounded once to 8-bit integers per group of 32 (int8_rows.h: x ~ s * xi,
// s = the group's largest |x| / 127), as llama.cpp does; VPDPBUSD multiplies four unsigned nibbles
// q by four signed xi and adds them to a 32-bit lane, so per group and column
// S = sum over k of xi[k] * q[k] is an exact integer (|S| <= 32 * 127 * 15), the same in any order;
// then y = (s * sum of xi) * m + ((d * s) * S + y) in fp32: the same steps, lane for lane, as the
// AVX2 kernel (q4_avx2.h), so both give the same bits. A VPDPBUSD does 64 multiply-adds, twice
// VDPBF16PS's 32 (the bfloat16 kernel this replaced, 2026-12-04: README's "What changed").
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

#include "int8_rows.h"
#include "q4_ahead.h"

namespace sendlens::q4 {

constexpr const char* ISA = "avx512vnni";
using Expanded = __m512i;           // an expanded panel: K/4 of these (per octet: its low and high quads)
constexpr int64_t MAX_ROWS = 8;     // rows of a tile: each keeps its sums in registers

inline int64_t expanded_size(int64_t K) { return K / 4; }

// The activations as the tiles read them: rounded to 8-bit integers per group (int8_rows.h).
using Rows = Int8Rows;
inline Rows prepare(const at::Tensor& x) { return round_to_int8(x); }

// Octet o of a panel (k = 8o .. 8o + 7): 64 bytes, byte 4c + j holding column c's q at k = 8o + j
// (low nibble) and at k = 8o + 4 + j (high nibble). A mask gives the 16 columns' quads at
// k = 8o .. 8o + 3 (lo), a shift and a mask those at 8o + 4 .. 8o + 7 (hi), as VPDPBUSD reads them.
inline void octet(const uint8_t* nib, int64_t o, __m512i& lo, __m512i& hi) {
  const __m512i low = _mm512_set1_epi8(15);
  const __m512i v = _mm512_loadu_si512(nib + o * 64);
  lo = _mm512_and_si512(v, low);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
}

inline __m512i quad_of(const int8_t* row, int64_t k) { return _mm512_set1_epi32(int8_quad(row, k)); }

// One group's end for 16 columns: y = sum * m + ((d * scale) * S + y), the same steps for every row
// (and as q4_avx2.h's close_group, lane for lane).
inline __m512 close_group(__m512 acc, __m512i S, const at::Half* dm, int64_t g, float scale, float sum) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32)));
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32 + 16)));
  const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(scale));
  return _mm512_fmadd_ps(m, _mm512_set1_ps(sum), _mm512_fmadd_ps(ds, _mm512_cvtepi32_ps(S), acc));
}

// R rows from r0 times one 16-column panel -> y (R, 16), row stride ldy: a few rows read the
// weights straight, without expanding them (q4_matmul.cpp says why one panel at a time). Each
// group's sum runs in two chains (the low quads and the high), added at its end: integers, so the same S.
template <int R>
void tile(const Rows& a, int64_t r0, const uint8_t* nib, const at::Half* dm, float* y, int64_t ldy) {
  const int64_t K = a.K, K32 = K / 32;
  const int8_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = a.row(r0 + r);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K32; ++g) {
    __m512i S[R], T[R];
    for (int r = 0; r < R; ++r) S[r] = T[r] = _mm512_setzero_si512();
    ahead(nib, dm, g);
    for (int64_t o = g * 4; o < g * 4 + 4; ++o) {
      __m512i lo, hi;
      octet(nib, o, lo, hi);
      for (int r = 0; r < R; ++r) {
        S[r] = _mm512_dpbusd_epi32(S[r], lo, quad_of(x[r], 8 * o));
        T[r] = _mm512_dpbusd_epi32(T[r], hi, quad_of(x[r], 8 * o + 4));
      }
    }
    for (int r = 0; r < R; ++r)
      acc[r] = close_group(acc[r], _mm512_add_epi32(S[r], T[r]), dm, g, a.scale[(r0 + r) * K32 + g],
                           a.sum[(r0 + r) * K32 + g]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

// A panel's q as unsigned bytes, once, for every tile of rows that follows.
inline void expand(const uint8_t* nib, int64_t K, Expanded* buffer) {
  for (int64_t o = 0; o < K / 8; ++o) octet(nib, o, buffer[2 * o], buffer[2 * o + 1]);
}

// R rows from r0 times one expanded panel: the same sums (exact) and steps as tile<R>.
template <int R>
void tile_from(const Rows& a, int64_t r0, const Expanded* buffer, const at::Half* dm, float* y, int64_t ldy) {
  const int64_t K = a.K, K32 = K / 32;
  const int8_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = a.row(r0 + r);
  const float* scale = a.scale.data() + r0 * K32;  // (R, K32)
  const float* sum = a.sum.data() + r0 * K32;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K32; ++g) {
    __m512i S[R];
    for (int r = 0; r < R; ++r) S[r] = _mm512_setzero_si512();
    for (int64_t o = g * 4; o < g * 4 + 4; ++o) {
      const __m512i lo = buffer[2 * o], hi = buffer[2 * o + 1];
      for (int r = 0; r < R; ++r) {
        S[r] = _mm512_dpbusd_epi32(S[r], lo, quad_of(x[r], 8 * o));
        S[r] = _mm512_dpbusd_epi32(S[r], hi, quad_of(x[r], 8 * o + 4));
      }
    }
    for (int r = 0; r < R; ++r) acc[r] = close_group(acc[r], S[r], dm, g, scale[r * K32 + g], sum[r * K32 + g]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

}  // namespace sendlens::q4
