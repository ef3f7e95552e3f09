// Paged attention with bfloat16 operands (Pools::bf16: the q4_1 format's, core/model/attention.py):
// the query (times 1/sqrt(D)), the keys, the values and the softmax's numerators are rounded to
// bfloat16, to nearest even; their products are exact in fp32 and are summed in fp32. Where the CPU
// has AVX-512 BF16, VDPBF16PS takes two dimensions of a score, or two keys of a weighted value, per
// multiply-add: a fixed chain of pairs per row (each adds its odd product, then its even one).
// Elsewhere the same rounded numbers go through the fp32 chains of attention_tiles.h. Keys and
// values are converted once for all the rows that read them: by the step for a prefill chunk's
// work items (SharedPairs), by the work item itself otherwise, by the same functions. Each row's
// chain is still fixed by the row alone, so invariance holds as it does in fp32. Pools kept in
// bfloat16 (Pools::k16, v16: written rounded, by the same rounding) are read without rounding: the
// same numbers, so the same bits, from half the bytes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_tiles.h"

namespace sendlens::attention {

// A sequence's keys and values [0, n) for KV head h, as the work items read them: k (n/16 tiles, D/2, 16)
// and v (n/2 pairs, D), converted once by the step for all of its items that read them (or null:
// each item converts its own).
struct SharedPairs {
  const uint32_t* k = nullptr;
  const uint32_t* v = nullptr;
};

// a rounded to bfloat16 (to nearest even), kept as floats.
inline Vec round_bf16(Vec a) {
#ifdef __AVX512BF16__
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(a.v));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
#else
  uint16_t h[LANES];
  store_bf16(a, h);
  return load_bf16(h);
#endif
}

// Where key `key`'s dimension 0 lies in the key pool (dimension d is d * BS further), and where its
// value row lies in the value pool: the same places in fp32 pools and in bfloat16 ones.
inline int64_t key_at(const Pools& pool, int64_t seq, int64_t h, int64_t D, int64_t key) {
  return ((pool.block(seq, key / pool.BS) * pool.Hkv + h) * D) * pool.BS + key % pool.BS;
}
inline int64_t value_at(const Pools& pool, int64_t seq, int64_t h, int64_t D, int64_t key) {
  return ((pool.block(seq, key / pool.BS) * pool.Hkv + h) * pool.BS + key % pool.BS) * D;
}

// 16 floats from pool index i on, rounded to bfloat16 (already so in a bfloat16 pool).
inline Vec rounded_key(const Pools& pool, int64_t i) {
  return pool.k16 ? load_bf16(pool.k16 + i) : round_bf16(Vec::load(pool.k + i));
}
inline Vec rounded_value(const Pools& pool, int64_t i) {
  return pool.v16 ? load_bf16(pool.v16 + i) : round_bf16(Vec::load(pool.v + i));
}

// 16 floats rounded to bfloat16 as round_bf16 rounds them, as bits: what a bfloat16 pool keeps.
inline void to_bf16(const float* x, uint16_t* out) {
#ifdef __AVX512BF16__
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x))));
#else
  store_bf16(Vec::load(x), out);
#endif
}
inline float load_bf16_one(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Keys [first, first + n) of sequence `seq`, KV head h, rounded, into dst (D, 16). Where a block
// holds whole tiles the tile comes straight from it, lanes n.. with whatever the block holds there
// (as the fp32 path reads them: their scores are masked, so they never reach a row); else lanes
// n.. are zero.
inline void round_key_tile(const Pools& pool, int64_t seq, int64_t h, int64_t D, int64_t first, int64_t n,
                           float* dst) {
  const int64_t BS = pool.BS;
  if (BS % LANES == 0) {
    const int64_t at = key_at(pool, seq, h, D, first);
    for (int64_t d = 0; d < D; ++d) rounded_key(pool, at + d * BS).store(dst + d * LANES);
    return;
  }
  for (int64_t i = 0; i < LANES; ++i) {
    const int64_t at = i < n ? key_at(pool, seq, h, D, first + i) : -1;
    for (int64_t d = 0; d < D; ++d) {
      const int64_t j = at + d * BS;
      dst[d * LANES + i] = at < 0 ? 0.0f : pool.k16 ? load_bf16_one(pool.k16[j]) : pool.k[j];
    }
  }
  for (int64_t d = 0; d < D; ++d) round_bf16(Vec::load(dst + d * LANES)).store(dst + d * LANES);
}

// Values of keys [from, to) rounded, into dst (to - from rounded up to even, D); a last odd one's
// partner zero.
inline void round_values(const Pools& pool, int64_t seq, int64_t h, int64_t D, int64_t from, int64_t to, float* dst) {
  for (int64_t j = from; j < to; ++j) {
    const int64_t at = value_at(pool, seq, h, D, j);
    for (int64_t c = 0; c < D; c += LANES) rounded_value(pool, at + c).store(dst + (j - from) * D + c);
  }
  if ((to - from) % 2) std::fill(dst + (to - from) * D, dst + (to - from + 1) * D, 0.0f);
}

#ifdef __AVX512BF16__
// Sixteen pairs (lo[i], hi[i]) rounded to bfloat16 pairs (to nearest even), lo in the even half.
inline __m512i pack_pairs(const float* lo, const float* hi) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(hi), _mm512_loadu_ps(lo));
  return _mm512_permutexvar_epi16(order, reinterpret_cast<__m512i>(both));
}
// Sixteen pairs of bfloat16 values already rounded (a bfloat16 pool's), lo in the even half: the
// bits pack_pairs gives for the same numbers.
inline __m512i pairs_of(const uint16_t* lo, const uint16_t* hi) {
  const __m512i l = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo)));
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)));
  return _mm512_or_si512(l, _mm512_slli_epi32(u, 16));
}
inline uint32_t pair_bits(float lo, float hi) {  // two bfloat16 values held in floats
  uint32_t a, b;
  std::memcpy(&a, &lo, 4);
  std::memcpy(&b, &hi, 4);
  return (a >> 16) | (b & 0xFFFF0000u);
}

// The values of keys [from, to) (from even) as pairs of keys (pairs, D): a last odd key's partner zero.
inline void pack_value_pairs(const Pools& pool, int64_t seq, int64_t h, int64_t D, int64_t from, int64_t to,
                             float* zeros, uint32_t* out) {
  std::fill(zeros, zeros + D, 0.0f);
  const uint16_t* zeros16 = reinterpret_cast<const uint16_t*>(zeros);  // the D floats' zero bits: 2D bf16 zeros
  for (int64_t j = from; j < to; j += 2) {
    const int64_t lo = value_at(pool, seq, h, D, j), hi = j + 1 == to ? -1 : value_at(pool, seq, h, D, j + 1);
    uint32_t* dst = out + (j - from) / 2 * D;
    if (pool.v16) {
      const uint16_t* odd = hi < 0 ? zeros16 : pool.v16 + hi;
      for (int64_t c = 0; c < D; c += LANES) _mm512_storeu_si512(dst + c, pairs_of(pool.v16 + lo + c, odd + c));
    } else {
      const float* odd = hi < 0 ? zeros : pool.v + hi;
      for (int64_t c = 0; c < D; c += LANES) _mm512_storeu_si512(dst + c, pack_pairs(pool.v + lo + c, odd + c));
    }
  }
}

// Keys [first, first + 16) of those below n as pairs of dimensions (D/2, 16), lanes from n on as
// round_key_tile leaves them; kt: scratch (D, 16) for a tile that a block does not hold whole.
inline void pack_key_tile(const Pools& pool, int64_t seq, int64_t h, int64_t D, int64_t first, int64_t n, float* kt,
                          uint32_t* out) {
  const int64_t BS = pool.BS;
  if (BS % LANES == 0) {  // straight from the pool (a last tile too), rounded by the conversion
    const int64_t at = key_at(pool, seq, h, D, first);
    for (int64_t m = 0; m < D / 2; ++m) {
      const int64_t even = at + 2 * m * BS, odd = even + BS;
      _mm512_storeu_si512(out + m * LANES, pool.k16 ? pairs_of(pool.k16 + even, pool.k16 + odd)
                                                    : pack_pairs(pool.k + even, pool.k + odd));
    }
    return;
  }
  round_key_tile(pool, seq, h, D, first, std::min<int64_t>(LANES, n - first), kt);
  for (int64_t m = 0; m < D / 2; ++m)
    _mm512_storeu_si512(out + m * LANES, pack_pairs(kt + 2 * m * LANES, kt + (2 * m + 1) * LANES));
}

// Block [from, from + KEY_BLOCK) of SharedPairs' k and v, for keys below n. scratch: D * 17 floats.
inline void pack_block(const Pools& pool, int64_t seq, int64_t h, int64_t D, int64_t from, int64_t n, float* scratch,
                       uint32_t* k, uint32_t* v) {
  const int64_t to = std::min(n, from + KEY_BLOCK);
  for (int64_t first = from; first < to; first += LANES)
    pack_key_tile(pool, seq, h, D, first, n, scratch, k + first / LANES * (D / 2 * LANES));
  pack_value_pairs(pool, seq, h, D, from, to, scratch + D * LANES, v + from / 2 * D);
}

// Scores of MR rows against a tile of 16 keys in pairs: qp (MR, D/2) query pairs, kp (D/2, 16) key pairs.
template <int MR>
inline void score_pairs(const uint32_t* qp, int64_t D, const uint32_t* kp, float* scores, int64_t width,
                        const int64_t* keys, int64_t first_key) {
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t m = 0; m < D / 2; ++m) {
    const __m512bh k = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kp + m * LANES));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
      acc[i] = _mm512_dpbf16_ps(acc[i], reinterpret_cast<__m512bh>(_mm512_set1_epi32(qp[i * D / 2 + m])), k);
  }
  for (int i = 0; i < MR; ++i)
    if (keys[i] > first_key) first(Vec{acc[i]}, keys[i] - first_key, NEG_INF).store(scores + i * width + first_key);
}
template <int MR>
void score_pair_rows(int64_t rows, const uint32_t* qp, int64_t D, const uint32_t* kp, float* scores, int64_t width,
                     const int64_t* keys, int64_t first_key) {
  if constexpr (MR > 1) {
    if (rows < MR) return score_pair_rows<MR - 1>(rows, qp, D, kp, scores, width, keys, first_key);
  }
  score_pairs<MR>(qp, D, kp, scores, width, keys, first_key);
}

// acc_i += e_i,2p v_2p + e_i,2p+1 v_2p+1 for NR rows and pairs p in [p0, p1): ep (NR rows of pairs, ld
// pairs apart), vp (pairs, D) value pairs.
template <int64_t ND, int NR>
inline void weigh_pairs(const uint32_t* ep, int64_t ld, const uint32_t* vp, int64_t p0, int64_t p1, float* acc_rows) {
  constexpr int64_t D = LANES * ND;
  __m512 acc[NR][ND];
  for (int i = 0; i < NR; ++i)
    for (int64_t c = 0; c < ND; ++c) acc[i][c] = _mm512_loadu_ps(acc_rows + i * D + c * LANES);
  for (int64_t p = p0; p < p1; ++p) {
    __m512bh v[ND];
    for (int64_t c = 0; c < ND; ++c) v[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vp + p * D + c * LANES));
#pragma GCC unroll 8
    for (int i = 0; i < NR; ++i) {
      const __m512bh w = reinterpret_cast<__m512bh>(_mm512_set1_epi32(ep[i * ld + p]));
      for (int64_t c = 0; c < ND; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], w, v[c]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int64_t c = 0; c < ND; ++c) _mm512_storeu_ps(acc_rows + i * D + c * LANES, acc[i][c]);
}
#endif

// acc_i += e_ij v_j for NR rows and keys j in [j0, j1) of a rounded block vb (keys, D) starting at key
// `from`: the fp32 chain of weigh_range on rounded values.
template <int64_t ND, int NR>
inline void weigh_keys(const float* e, int64_t width, const float* vb, int64_t from, int64_t j0, int64_t j1,
                       float* acc_rows) {
  constexpr int64_t D = LANES * ND;
  Vec acc[NR][ND];
  for (int i = 0; i < NR; ++i)
    for (int64_t c = 0; c < ND; ++c) acc[i][c] = Vec::load(acc_rows + i * D + c * LANES);
  for (int64_t j = j0; j < j1; ++j) {
    Vec v[ND];
    for (int64_t c = 0; c < ND; ++c) v[c] = Vec::load(vb + (j - from) * D + c * LANES);
    for (int i = 0; i < NR; ++i) {
      const Vec w = Vec::set1(e[i * width + j]);
      for (int64_t c = 0; c < ND; ++c) acc[i][c] = fma(w, v[c], acc[i][c]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int64_t c = 0; c < ND; ++c) acc[i][c].store(acc_rows + i * D + c * LANES);
}

// The values of a tile's R rows with bfloat16 operands: KEY_BLOCK keys at a time, rounded once into
// scratch and read there by every group of up to NR rows. e (R, width): the rounded numerators.
template <int64_t ND, int NR>
void weigh_bf16(const Pools& pool, int64_t seq, int64_t h, int64_t R, const int64_t* keys, int64_t max_keys,
                const float* e, int64_t width, float* acc, const SharedPairs& shared) {
  constexpr int64_t D = LANES * ND;
  thread_local std::vector<float> block;
  block.resize((KEY_BLOCK + 1) * D);
#ifdef __AVX512BF16__
  thread_local std::vector<uint32_t> vpairs, epairs;
  const int64_t half = width / 2;
  vpairs.resize(KEY_BLOCK / 2 * D);
  epairs.resize(R * half);
  std::vector<int64_t> pairs(R);
  for (int64_t r = 0; r < R; ++r) {
    pairs[r] = (keys[r] + 1) / 2;
    for (int64_t t = 0; t * LANES < keys[r]; ++t)  // neighbouring keys are a pair: each float to its bfloat16 (exact)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(epairs.data() + r * half + t * LANES / 2),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(e + r * width + t * LANES))));
  }
#endif
  for (int64_t from = 0; from < max_keys; from += KEY_BLOCK) {
    const int64_t to = std::min(max_keys, from + KEY_BLOCK);
    int64_t r0 = 0;
    while (r0 < R && keys[r0] <= from) ++r0;
#ifdef __AVX512BF16__
    const int64_t n_pairs = (to - from + 1) / 2;
    if (!shared.v) pack_value_pairs(pool, seq, h, D, from, to, block.data(), vpairs.data());
    const uint32_t* vp = shared.v ? shared.v : vpairs.data() - from / 2 * D;   // indexed by pair number
    for (; r0 < R; r0 += NR)
      weigh_groups(std::min<int64_t>(NR, R - r0), pairs.data() + r0, from / 2, from / 2 + n_pairs,
                   [&](auto rows, int64_t i, int64_t a, int64_t b) {
                     weigh_pairs<ND, decltype(rows)::value>(epairs.data() + (r0 + i) * half, half, vp, a, b,
                                                            acc + (r0 + i) * D);
                   });
#else
    round_values(pool, seq, h, D, from, to, block.data());
    for (; r0 < R; r0 += NR)
      weigh_groups(std::min<int64_t>(NR, R - r0), keys + r0, from, to, [&](auto rows, int64_t i, int64_t a, int64_t b) {
        weigh_keys<ND, decltype(rows)::value>(e + (r0 + i) * width, width, block.data(), from, a, b, acc + (r0 + i) * D);
      });
#endif
  }
}

// The scores of a tile's R rows with bfloat16 operands: each key tile rounded once into kt (D, 16),
// then scored by every row that reads into it, MR rows at a time. qs (R, D): the rounded queries.
template <int MR>
void score_bf16(const Pools& pool, int64_t seq, int64_t h, int64_t D, int64_t R, const float* qs, const int64_t* keys,
                int64_t tiles, int64_t max_keys, float* kt, float* scores, int64_t width, const SharedPairs& shared) {
#ifdef __AVX512BF16__
  thread_local std::vector<uint32_t> qp, kp;
  qp.resize(R * D / 2);
  kp.resize(D / 2 * LANES);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t m = 0; m < D / 2; ++m) qp[r * D / 2 + m] = pair_bits(qs[r * D + 2 * m], qs[r * D + 2 * m + 1]);
#endif
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t first_key = t * LANES;
    int64_t r0 = 0;
    while (r0 < R && keys[r0] <= first_key) ++r0;
#ifdef __AVX512BF16__
    const uint32_t* tile = shared.k ? shared.k + t * (D / 2 * LANES) : kp.data();
    if (!shared.k) pack_key_tile(pool, seq, h, D, first_key, max_keys, kt, kp.data());
    for (; r0 < R; r0 += MR)
      score_pair_rows<MR>(std::min<int64_t>(MR, R - r0), qp.data() + r0 * D / 2, D, tile, scores + r0 * width, width,
                          keys + r0, first_key);
#else
    round_key_tile(pool, seq, h, D, first_key, std::min<int64_t>(LANES, max_keys - first_key), kt);
    for (; r0 < R; r0 += MR)
      score_rows<MR>(std::min<int64_t>(MR, R - r0), qs + r0 * D, D, kt, LANES, scores + r0 * width, width, keys + r0,
                     first_key);
#endif
  }
}

}  // namespace sendlens::attention
