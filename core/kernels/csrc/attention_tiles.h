// The fp32 tile loops of paged attention (paged_attention.cpp): scores of a few query rows against
// a tile of 16 keys, and the weighted values of a few rows over a range of keys. Each row's chain
// is fixed by the row alone (the order of d, or of keys), whatever other rows share the tile.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "row_kernels.h"
#include "vec.h"

namespace sendlens::attention {

using Pools = KvPools;  // row_kernels.h

// Keys whose weighted values a row group sums before the next group of rows takes them (they stay
// in cache meanwhile): even, so that bf16's pairs of keys never straddle two blocks of them.
constexpr int64_t KEY_BLOCK = 128;

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// Ask for n floats from p to be brought into cache (a block's keys or values: 4 KB in SmolLM2),
// so that reading them overlaps the arithmetic on the block before.
inline void prefetch(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / sizeof(float)) __builtin_prefetch(p + i);
}


// Scores of MR rows against one tile of 16 keys: one multiply-add chain per row over d = 0..D-1
// (the tile's vector for d, times the row's q[d]), MR chains in flight so that none waits.
template <int MR>
inline void score_tile(const float* qs, int64_t D, const float* tile, int64_t ld, float* scores, int64_t width,
                       const int64_t* keys, int64_t first_key) {
  Vec acc[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc[i] = Vec::set1(0.0f);
  for (int64_t d = 0; d < D; ++d) {
    const Vec kd = Vec::load(tile + d * ld);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) acc[i] = fma(Vec::set1(qs[i * D + d]), kd, acc[i]);
  }
  for (int i = 0; i < MR; ++i)
    if (keys[i] > first_key) first(acc[i], keys[i] - first_key, NEG_INF).store(scores + i * width + first_key);
}

template <int MR>
void score_rows(int64_t rows, const float* qs, int64_t D, const float* tile, int64_t ld, float* scores,
                int64_t width, const int64_t* keys, int64_t first_key) {
  if constexpr (MR > 1) {
    if (rows < MR) return score_rows<MR - 1>(rows, qs, D, tile, ld, scores, width, keys, first_key);
  }
  score_tile<MR>(qs, D, tile, ld, scores, width, keys, first_key);
}

// acc_i += e_ij v_j for NR rows i and keys j in [from, to), key by key in order. acc: (NR, D),
// loaded and stored here, so that it stays in registers in between.
template <int64_t ND, int NR>
inline void weigh_range(const Pools& pool, int64_t seq, int64_t h, const float* e, int64_t width,
                        int64_t from, int64_t to, float* acc_rows, bool stream) {
  constexpr int64_t D = LANES * ND;
  const int64_t BS = pool.BS;
  Vec acc[NR][ND];
#pragma GCC unroll 16
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 16
    for (int64_t c = 0; c < ND; ++c) acc[i][c] = Vec::load(acc_rows + i * D + c * LANES);
  for (int64_t j = from; j < to;) {
    const int64_t b = j / BS, end = std::min(to, (b + 1) * BS);
    const float* vj = pool.v + ((pool.block(seq, b) * pool.Hkv + h) * BS + j - b * BS) * D;
    if (stream && end < to) prefetch(pool.v + ((pool.block(seq, b + 1) * pool.Hkv + h) * BS) * D, BS * D);
    for (; j < end; ++j, vj += D) {
      Vec v[ND];
#pragma GCC unroll 16
      for (int64_t c = 0; c < ND; ++c) v[c] = Vec::load(vj + c * LANES);
#pragma GCC unroll 16
      for (int i = 0; i < NR; ++i) {
        const Vec w = Vec::set1(e[i * width + j]);
#pragma GCC unroll 16
        for (int64_t c = 0; c < ND; ++c) acc[i][c] = fma(w, v[c], acc[i][c]);
      }
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < NR; ++i)
#pragma GCC unroll 16
    for (int64_t c = 0; c < ND; ++c) acc[i][c].store(acc_rows + i * D + c * LANES);
}

// Rows [0, NR) of a group over units [from, to) of one value block (keys, or pairs of keys with
// VDPBF16PS): together while every row reads them, then each row its own last ones; own[i]: row
// i's units. run(rows, i, a, b): rows (an integral_constant) from row i over units [a, b).
template <int NR, class Run>
void weigh_group(const int64_t* own, int64_t from, int64_t to, Run run) {
  int64_t fewest = own[0];
  for (int i = 1; i < NR; ++i) fewest = std::min(fewest, own[i]);
  const int64_t shared = std::min(to, fewest);
  if (shared > from) run(std::integral_constant<int, NR>{}, 0, from, shared);
  for (int i = 0; i < NR; ++i) {
    const int64_t a = std::max(from, fewest), b = std::min(to, own[i]);
    if (b > a) run(std::integral_constant<int, 1>{}, i, a, b);
  }
}
template <class Run>
void weigh_groups(int64_t rows, const int64_t* own, int64_t from, int64_t to, Run run) {
  switch (rows) {
    case 1: return weigh_group<1>(own, from, to, run);
    case 2: return weigh_group<2>(own, from, to, run);
    case 3: return weigh_group<3>(own, from, to, run);
    case 4: return weigh_group<4>(own, from, to, run);
    case 5: return weigh_group<5>(own, from, to, run);
    default: return weigh_group<6>(own, from, to, run);
  }
}

// The keys [from, to) for a group of up to 6 rows of fp32 numerators e (rows, width).
template <int64_t ND>
void weigh_rows(int64_t rows, const Pools& pool, int64_t seq, int64_t h, const float* e, int64_t width,
                const int64_t* keys, int64_t from, int64_t to, float* acc_rows, bool stream) {
  weigh_groups(rows, keys, from, to, [&](auto n, int64_t i, int64_t a, int64_t b) {
    weigh_range<ND, decltype(n)::value>(pool, seq, h, e + i * width, width, a, b, acc_rows + i * LANES * ND, stream);
  });
}

}  // namespace sendlens::attention
