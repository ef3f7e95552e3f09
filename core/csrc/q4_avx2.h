// The Q4_1 product's inner loops for AVX2 (q4_matmul.cpp has the layout and the driver), where the
// CPU lacks AVX-512 BF16. Each row of x is rounded once to 16-bit integers per group of 32
// (x ~ s * xi, s = the group's largest |x| / 32767: an error of at most 2^-16 of that, finer than
// bfloat16's rounding of every value); then per group and column, in integers and so exactly in
// any order, S = sum over k of xi[k] * q[k] (VPMADDWD pairs, at most 32 * 32767 * 15 < 2^24, so
// also exact as a float), and y = (s * sum of xi) * m + ((d * s) * S + y) in fp32.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "int16_rows.h"

namespace sendlens::q4 {

constexpr const char* ISA = "avx2";
using Expanded = __m256i;          // an expanded panel: K of these (k pairs; columns 0-7, 8-15)
constexpr int64_t MAX_ROWS = 4;    // rows of a tile: 8 sums and the weights in registers
constexpr int PANELS_ONE_ROW = 2;  // panels a tile of one row takes at once (a decode step)
constexpr int PANELS_TWO_ROWS = 1; // and of two rows (more would spill registers)

inline int64_t expanded_size(int64_t K) { return K; }

// The activations as the tiles read them: rounded to 16-bit integers per group (int16_rows.h).
using Rows = Int16Rows;
inline Rows prepare(const at::Tensor& x) { return round_to_int16(x); }

// Unit u of a panel (k = 4u .. 4u + 3): q[p][h], the pairs k = 4u + 2p, 4u + 2p + 1 as 16-bit
// integers for columns 8h .. 8h + 7 (one 32-bit lane each). Byte 2c + e holds column c's q at
// k = 4u + e (low nibble) and 4u + 2 + e (high nibble).
inline void unit(const uint8_t* nib, int64_t u, __m256i q[2][2]) {
  const __m256i low = _mm256_set1_epi8(15);
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nib + u * 32));
  const __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
  q[0][0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo));
  q[0][1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1));
  q[1][0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi));
  q[1][1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1));
}

// One group's end for 8 columns: y = sum * m + ((d * scale) * S + y), the same steps for every row.
inline void close_group(float* y, __m256i S, const at::Half* dm, int64_t g, int h, float scale, float sum) {
  const at::Half* p = dm + g * 32 + 8 * h;
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(scale));
  const __m256 acc = _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(S), _mm256_loadu_ps(y));
  _mm256_storeu_ps(y, _mm256_fmadd_ps(m, _mm256_set1_ps(sum), acc));
}

inline void zero(float* y, int64_t ldy, int rows, int cols) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; c += 8) _mm256_storeu_ps(y + r * ldy + c, _mm256_setzero_ps());
}

// Group g of the np panels from nib, dm into L1: those of the tile this thread takes next, while
// this one computes. A panel is only a few KB, and the hardware prefetcher stops at every 4 KB
// page, so one-row products, which spend a few instructions per byte, otherwise wait on memory
// at each panel's start (SmolLM2's 120 one-row layer products: 1.3x faster here). Prefetching past the
// last panel is harmless: a prefetch never faults.
inline void prefetch_group(const uint8_t* nib, const at::Half* dm, int64_t K, int64_t g, int np) {
  for (int c = 0; c < np; ++c) {
    const char* next = reinterpret_cast<const char*>(nib + c * (K / 4) * 32 + g * 256);
    for (int line = 0; line < 256; line += 64) _mm_prefetch(next + line, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(dm + c * (K / 32) * 32 + g * 32), _MM_HINT_T0);
  }
}

// R rows from r0 times NP adjacent 16-column panels -> y (R, 16 NP), row stride ldy. Several
// panels give a few rows independent chains.
template <int R, int NP>
void tile(const Rows& a, int64_t r0, const uint8_t* nib, const at::Half* dm, float* y, int64_t ldy) {
  const int64_t K = a.K, K32 = K / 32;
  zero(y, ldy, R, 16 * NP);
  for (int64_t g = 0; g < K32; ++g) {
    __m256i S[R][NP][2];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NP; ++c) S[r][c][0] = S[r][c][1] = _mm256_setzero_si256();
    prefetch_group(nib + NP * (K / 4) * 32, dm + NP * K32 * 32, K, g, NP);  // the next tile's
    for (int64_t u = g * 8; u < g * 8 + 8; ++u) {
      for (int c = 0; c < NP; ++c) {
        __m256i q[2][2];
        unit(nib + c * (K / 4) * 32, u, q);
        for (int p = 0; p < 2; ++p)
          for (int r = 0; r < R; ++r) {
            const __m256i xp = int16_pair(a.row(r0 + r), 4 * u + 2 * p);
            S[r][c][0] = _mm256_add_epi32(S[r][c][0], _mm256_madd_epi16(q[p][0], xp));
            S[r][c][1] = _mm256_add_epi32(S[r][c][1], _mm256_madd_epi16(q[p][1], xp));
          }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NP; ++c)
        for (int h = 0; h < 2; ++h)
          close_group(y + r * ldy + c * 16 + 8 * h, S[r][c][h], dm + c * K32 * 32, g, h,
                      a.scale[(r0 + r) * K32 + g], a.sum[(r0 + r) * K32 + g]);
  }
}

// A panel's q as 16-bit pairs, once, for every tile of rows that follows.
inline void expand(const uint8_t* nib, int64_t K, Expanded* buffer) {
  for (int64_t u = 0; u < K / 4; ++u) {
    __m256i q[2][2];
    unit(nib, u, q);
    for (int p = 0; p < 2; ++p)
      for (int h = 0; h < 2; ++h) buffer[2 * (2 * u + p) + h] = q[p][h];
  }
}

// R rows from r0 times one expanded panel: the same sums (exact) and steps as tile<R, 1>.
template <int R>
void tile_from(const Rows& a, int64_t r0, const Expanded* buffer, const at::Half* dm, float* y, int64_t ldy) {
  const int64_t K = a.K, K32 = K / 32;
  zero(y, ldy, R, 16);
  for (int64_t g = 0; g < K32; ++g) {
    __m256i S[R][2];
    for (int r = 0; r < R; ++r) S[r][0] = S[r][1] = _mm256_setzero_si256();
    for (int64_t p = g * 16; p < g * 16 + 16; ++p) {
      const __m256i w0 = buffer[2 * p], w1 = buffer[2 * p + 1];
      for (int r = 0; r < R; ++r) {
        const __m256i xp = int16_pair(a.row(r0 + r), 2 * p);
        S[r][0] = _mm256_add_epi32(S[r][0], _mm256_madd_epi16(w0, xp));
        S[r][1] = _mm256_add_epi32(S[r][1], _mm256_madd_epi16(w1, xp));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        close_group(y + r * ldy + 8 * h, S[r][h], dm, g, h, a.scale[(r0 + r) * K32 + g], a.sum[(r0 + r) * K32 + g]);
  }
}

}  // namespace sendlens::q4
