// The Q4_1 product's inner loops for AVX2 (q4_matmul.cpp has the layout and the driver), where the
// CPU lacks AVX-512 BF16. Each row of x is rounded once to 16-bit integers per group of 32
// (x ~ s * xi, s = the group's largest |x| / 32767: an error of at most 2^-16 of that, finer than
// bfloat16's rounding of every value); then per group and column, in integers and so exactly in
// any order, S = sum over k of xi[k] * q[k] (VPMADDWD pairs, at most 32 * 32767 * 15 < 2^24, so
// also exact as a float), and y = (s * sum of xi) * m + ((d * s) * S + y) in fp32.
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

// Octet o of a panel (k = 8o .. 8o + 7), half h (columns 8h .. 8h + 7): 32 bytes, a 32-bit lane
// per column holding its q at k = 8o + 2j in bits 4j .. 4j + 3 and at k = 8o + 2j + 1 in bits
// 16 + 4j .. 16 + 4j + 3 (j = 0 .. 3). Shifting the lanes by 4j and masking each 16-bit half to its
// low nibble gives pair j as the two 16-bit integers VPMADDWD multiplies: a shift and an AND per
// pair, where widening bytes to words (the layout before) went through the shuffle unit. The sums
// are exact integers either way, so the same bits; a one-row product with its weights in cache
// runs 1.6x as fast (a decode step's come from memory, and there it is no faster).
inline void octet(const uint8_t* nib, int64_t o, int h, __m256i q[4]) {
  const __m256i low = _mm256_set1_epi32(0x000F000F);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nib + o * 64 + h * 32));
  q[0] = _mm256_and_si256(v, low);
  q[1] = _mm256_and_si256(_mm256_srli_epi32(v, 4), low);
  q[2] = _mm256_and_si256(_mm256_srli_epi32(v, 8), low);
  q[3] = _mm256_and_si256(_mm256_srli_epi32(v, 12), low);
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
    for (int64_t o = g * 4; o < g * 4 + 4; ++o) {
      for (int c = 0; c < NP; ++c)
        for (int h = 0; h < 2; ++h) {
          __m256i q[4];
          octet(nib + c * (K / 4) * 32, o, h, q);
          for (int r = 0; r < R; ++r) {
            const int16_t* x = a.row(r0 + r) + 8 * o;
            const __m256i s01 = _mm256_add_epi32(_mm256_madd_epi16(q[0], int16_pair(x, 0)),
                                                 _mm256_madd_epi16(q[1], int16_pair(x, 2)));
            const __m256i s23 = _mm256_add_epi32(_mm256_madd_epi16(q[2], int16_pair(x, 4)),
                                                 _mm256_madd_epi16(q[3], int16_pair(x, 6)));
            S[r][c][h] = _mm256_add_epi32(S[r][c][h], _mm256_add_epi32(s01, s23));
          }
        }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NP; ++c)
        for (int h = 0; h < 2; ++h)
          close_group(y + r * ldy + c * 16 + 8 * h, S[r][c][h], group_scales(dm + c * K32 * 32, g, h),
                      a.scale[(r0 + r) * K32 + g], a.sum[(r0 + r) * K32 + g]);
  }
}

// A panel's q as 16-bit pairs, once, for every tile of rows that follows.
inline void expand(const uint8_t* nib, int64_t K, Expanded* buffer) {
  for (int64_t o = 0; o < K / 8; ++o)
    for (int h = 0; h < 2; ++h) {
      __m256i q[4];
      octet(nib, o, h, q);
      for (int j = 0; j < 4; ++j) buffer[2 * (4 * o + j) + h] = q[j];  // pair 4o + j: k = 8o + 2j, + 1
    }
}

// R rows from r0 times one expanded panel: the same sums (exact) and steps as tile<R, 1>. The rows'
// pointers and each group's d and m are read once, not once per row: the many-row products
// (a batch of decodes, a prompt) ran 1.2x faster for it, the same bits.
template <int R>
void tile_from(const Rows& a, int64_t r0, const Expanded* buffer, const at::Half* dm, float* y, int64_t ldy) {
  const int64_t K = a.K, K32 = K / 32;
  const int16_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = a.row(r0 + r);
  const float* scale = a.scale.data() + r0 * K32;  // (R, K32)
  const float* sum = a.sum.data() + r0 * K32;
  zero(y, ldy, R, 16);
  for (int64_t g = 0; g < K32; ++g) {
    __m256i S[R][2];
    for (int r = 0; r < R; ++r) S[r][0] = S[r][1] = _mm256_setzero_si256();
    const Expanded* w = buffer + g * 32;  // the group's 16 k pairs, two halves each
    for (int64_t p = 0; p < 16; ++p)
      for (int r = 0; r < R; ++r) {
        const __m256i xp = int16_pair(x[r], g * 32 + 2 * p);
        S[r][0] = _mm256_add_epi32(S[r][0], _mm256_madd_epi16(w[2 * p], xp));
        S[r][1] = _mm256_add_epi32(S[r][1], _mm256_madd_epi16(w[2 * p + 1], xp));
      }
    const GroupScales group[2] = {group_scales(dm, g, 0), group_scales(dm, g, 1)};
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        close_group(y + r * ldy + 8 * h, S[r][h], group[h], scale[r * K32 + g], sum[r * K32 + g]);
  }
}

}  // namespace sendlens::q4
