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
// same numbers, so the same bits, from half the bytes. They hold their numbers in the very pairs
// VDPBF16PS multiplies (kv_cache.py), so that with it a key tile and a run of value pairs are read
// straight from their block, with no conversion at all.
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

// Where key `key`'s dimension 0 lies in an fp32 key pool (dimension d is d * BS further), and where
// its value row lies in an fp32 value pool.
inline int64_t key_at(const Pools& pool, int64_t seq, int64_t h, int64_t D, int64_t key) {
  return ((pool.block(seq, key / pool.BS) * pool.Hkv + h) * D) * pool.BS + key % pool.BS;
}
inline int64_t value_at(const Pools& pool, int64_t seq, int64_t h, int64_t D, int64_t key) {
  return ((pool.block(seq, key / pool.BS) * pool.Hkv + h) * pool.BS + key % pool.BS) * D;
}

// A bfloat16 pool in pairs, a 32-bit word each, the first number in the low half (kv_cache.py): per
// block and KV head, keys as (D/2, BS) pairs of dimensions (2m, 2m + 1), values as (BS/2, D) pairs
// of slots (2p, 2p + 1).
inline const uint32_t* pair_words(const uint16_t* pool) { return reinterpret_cast<const uint32_t*>(pool); }
// The word of key `key`'s dimensions 0 and 1; dimensions 2m and 2m + 1 are m * BS words further.
inline int64_t key_pair_at(const Pools& pool, int64_t seq, int64_t h, int64_t D, int64_t key) {
  return ((pool.block(seq, key / pool.BS) * pool.Hkv + h) * (D / 2)) * pool.BS + key % pool.BS;
}
// The word of dimension 0 of the pair of slots that holds key `key`'s value (as its half key % 2);
// dimension d is d words further.
inline int64_t value_pair_at(const Pools& pool, int64_t seq, int64_t h, int64_t D, int64_t key) {
  return ((pool.block(seq, key / pool.BS) * pool.Hkv + h) * (pool.BS / 2) + key % pool.BS / 2) * D;
}
// Whether VDPBF16PS reads key tiles in place: a bfloat16 pool whose blocks hold whole tiles of 16.
inline bool key_tiles_in_place(const Pools& pool) { return pool.k16 && pool.BS % LANES == 0; }

// 16 floats rounded to bfloat16 as round_bf16 rounds them, as bits into out: what a bfloat16 pool
// keeps. -> the rounded numbers as floats.
inline Vec to_bf16(Vec a, uint16_t* out) {
#ifdef __AVX512BF16__
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(a.v));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), h);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
#else
  store_bf16(a, out);
  return load_bf16(out);
#endif
}
inline void to_bf16(const float* x, uint16_t* out) { to_bf16(Vec::load(x), out); }
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
  if (BS % LANES == 0 && pool.k16) {
    const uint32_t* words = pair_words(pool.k16) + key_pair_at(pool, seq, h, D, first);
    for (int64_t d = 0; d < D; ++d) load_bf16_half(words + d / 2 * BS, d % 2).store(dst + d * LANES);
    return;
  }
  if (BS % LANES == 0) {
    const int64_t at = key_at(pool, seq, h, D, first);
    for (int64_t d = 0; d < D; ++d) round_bf16(Vec::load(pool.k + at + d * BS)).store(dst + d * LANES);
    return;
  }
  for (int64_t i = 0; i < LANES; ++i) {
    if (i >= n) {
      for (int64_t d = 0; d < D; ++d) dst[d * LANES + i] = 0.0f;
    } else if (pool.k16) {  // dimension d: half d % 2 of word (d / 2) * BS
      const uint16_t* halves = pool.k16 + 2 * key_pair_at(pool, seq, h, D, first + i);
      for (int64_t d = 0; d < D; ++d) dst[d * LANES + i] = load_bf16_one(halves[2 * (d / 2 * BS) + d % 2]);
    } else {
      const int64_t at = key_at(pool, seq, h, D, first + i);
      for (int64_t d = 0; d < D; ++d) dst[d * LANES + i] = pool.k[at + d * BS];
    }
  }
  for (int64_t d = 0; d < D; ++d) round_bf16(Vec::load(dst + d * LANES)).store(dst + d * LANES);
}

// Values of keys [from, to) rounded, into dst (to - from rounded up to even, D); a last odd one's
// partner zero.
inline void round_values(const Pools& pool, int64_t seq, int64_t h, int64_t D, int64_t from, int64_t to, float* dst) {
  for (int64_t j = from; j < to; ++j) {
    float* row = dst + (j - from) * D;
    if (pool.v16) {
      const uint32_t* words = pair_words(pool.v16) + value_pair_at(pool, seq, h, D, j);
      for (int64_t c = 0; c < D; c += LANES) load_bf16_half(words + c, j % 2).store(row + c);
    } else {
      const int64_t at = value_at(pool, seq, h, D, j);
      for (int64_t c = 0; c < D; c += LANES) round_bf16(Vec::load(pool.v + at + c)).store(row + c);
    }
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
inline uint32_t pair_bits(float lo, float hi) {  // two bfloat16 values held in floats
  uint32_t a, b;
  std::memcpy(&a, &lo, 4);
  std::memcpy(&b, &hi, 4);
  return (a >> 16) | (b & 0xFFFF0000u);
}

// A bfloat16 pool's pair of slots (D words) whose second slot lies past a sequence's last key, with
// that half zeroed: the pair pack_pairs makes with a zero partner.
inline void first_of_pair(const uint32_t* words, int64_t D, uint32_t* out) {
  const __m512i first = _mm512_set1_epi32(0xFFFF);
  for (int64_t c = 0; c < D; c += LANES)
    _mm512_storeu_si512(out + c, _mm512_and_si512(_mm512_loadu_si512(words + c), first));
}

// The values of keys [from, to) (from even) as pairs of keys (pairs, D): a last odd key's partner zero.
inline void pack_value_pairs(const Pools& pool, int64_t seq, int64_t h, int64_t D, int64_t from, int64_t to,
                             float* zeros, uint32_t* out) {
  std::fill(zeros, zeros + D, 0.0f);
  for (int64_t j = from; j < to; j += 2) {
    uint32_t* dst = out + (j - from) / 2 * D;
    if (pool.v16) {  // already pairs: a copy, or the first half alone
      const uint32_t* words = pair_words(pool.v16) + value_pair_at(pool, seq, h, D, j);
      if (j + 1 == to) first_of_pair(words, D, dst);
      else std::copy_n(words, D, dst);
      continue;
    }
    const int64_t lo = value_at(pool, seq, h, D, j), hi = j + 1 == to ? -1 : value_at(pool, seq, h, D, j + 1);
    const float* odd = hi < 0 ? zeros : pool.v + hi;
    for (int64_t c = 0; c < D; c += LANES) _mm512_storeu_si512(dst + c, pack_pairs(pool.v + lo + c, odd + c));
  }
}

// Keys [first, first + 16) of those below n as pairs of dimensions (D/2, 16), lanes from n on as
// round_key_tile leaves them; kt: scratch (D, 16) for a tile read through round_key_tile (one that a
// block does not hold whole, or any tile of a bfloat16 pool, whose tiles VDPBF16PS reads in place).
inline void pack_key_tile(const Pools& pool, int64_t seq, int64_t h, int64_t D, int64_t first, int64_t n, float* kt,
                          uint32_t* out) {
  const int64_t BS = pool.BS;
  if (BS % LANES == 0 && !pool.k16) {  // straight from the pool (a last tile too), rounded by the conversion
    const int64_t at = key_at(pool, seq, h, D, first);
    for (int64_t m = 0; m < D / 2; ++m) {
      const int64_t even = at + 2 * m * BS, odd = even + BS;
      _mm512_storeu_si512(out + m * LANES, pack_pairs(pool.k + even, pool.k + odd));
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

// Scores of MR rows against a tile of 16 keys in pairs: qp (MR, D/2) query pairs, kp (D/2, 16) key
// pairs, ld words apart (16 in a packed tile, BS in a bfloat16 pool's block). tops (MR, 16): each
// row's largest score so far, lane by lane, as softmax_rows' pass over the stored scores takes it.
template <int MR>
inline void score_pairs(const uint32_t* qp, int64_t D, const uint32_t* kp, int64_t ld, float* scores, int64_t width,
                        const int64_t* keys, int64_t first_key, float* tops) {
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t m = 0; m < D / 2; ++m) {
    const __m512bh k = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kp + m * ld));
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
      acc[i] = _mm512_dpbf16_ps(acc[i], reinterpret_cast<__m512bh>(_mm512_set1_epi32(qp[i * D / 2 + m])), k);
  }
  for (int i = 0; i < MR; ++i)
    if (keys[i] > first_key) {
      const Vec s = first(Vec{acc[i]}, keys[i] - first_key, NEG_INF);
      s.store(scores + i * width + first_key);
      max(Vec::load(tops + i * LANES), s).store(tops + i * LANES);
    }
}
template <int MR>
void score_pair_rows(int64_t rows, const uint32_t* qp, int64_t D, const uint32_t* kp, int64_t ld, float* scores,
                     int64_t width, const int64_t* keys, int64_t first_key, float* tops) {
  if constexpr (MR > 1) {
    if (rows < MR) return score_pair_rows<MR - 1>(rows, qp, D, kp, ld, scores, width, keys, first_key, tops);
  }
  score_pairs<MR>(qp, D, kp, ld, scores, width, keys, first_key, tops);
}

// Where the value pairs of a run of keys lie: pair p's D words at runs[(p - first) / per_run] +
// ((p - first) % per_run) * D. A packed buffer is one run; a bfloat16 pool, one run per block.
struct PairRuns {
  const uint32_t* const* runs;
  int64_t first, per_run;
};

// acc_i += e_i,2p v_2p + e_i,2p+1 v_2p+1 for NR rows and pairs p in [p0, p1), in order: ep (NR rows
// of pairs, ld pairs apart), vp the value pairs. The sums stay in registers from run to run.
template <int64_t ND, int NR>
inline void weigh_pairs(const uint32_t* ep, int64_t ld, const PairRuns& vp, int64_t p0, int64_t p1,
                        float* acc_rows) {
  constexpr int64_t D = LANES * ND;
  __m512 acc[NR][ND];
  for (int i = 0; i < NR; ++i)
    for (int64_t c = 0; c < ND; ++c) acc[i][c] = _mm512_loadu_ps(acc_rows + i * D + c * LANES);
  for (int64_t p = p0; p < p1;) {
    const int64_t run = (p - vp.first) / vp.per_run, end = std::min(p1, vp.first + (run + 1) * vp.per_run);
    const uint32_t* row = vp.runs[run] + (p - vp.first - run * vp.per_run) * D;
    for (; p < end; ++p, row += D) {
      __m512bh v[ND];
      for (int64_t c = 0; c < ND; ++c) v[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(row + c * LANES));
#pragma GCC unroll 8
      for (int i = 0; i < NR; ++i) {
        const __m512bh w = reinterpret_cast<__m512bh>(_mm512_set1_epi32(ep[i * ld + p]));
        for (int64_t c = 0; c < ND; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], w, v[c]);
      }
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
// scratch and read there by every group of up to NR rows. e (R, width): the rounded numerators as
// floats; with VDPBF16PS, e16 (R, width): the same numbers as bfloat16, neighbouring keys a pair.
template <int64_t ND, int NR>
void weigh_bf16(const Pools& pool, int64_t seq, int64_t h, int64_t R, const int64_t* keys, int64_t max_keys,
                const float* e, const uint16_t* e16, int64_t width, float* acc, const SharedPairs& shared) {
  constexpr int64_t D = LANES * ND;
  thread_local std::vector<float> block;
  block.resize((KEY_BLOCK + 1) * D);
#ifdef __AVX512BF16__
  thread_local std::vector<uint32_t> vpairs;
  thread_local std::vector<const uint32_t*> runs;  // where a KEY_BLOCK's value pairs lie (PairRuns)
  const uint32_t* epairs = reinterpret_cast<const uint32_t*>(e16);  // (R, width / 2) pairs
  const int64_t half = width / 2;
  vpairs.resize(KEY_BLOCK / 2 * D);
  runs.resize(KEY_BLOCK / 2 + 2);
  std::vector<int64_t> pairs(R);
  for (int64_t r = 0; r < R; ++r) pairs[r] = (keys[r] + 1) / 2;
#else
  (void)e16;
#endif
  for (int64_t from = 0; from < max_keys; from += KEY_BLOCK) {
    const int64_t to = std::min(max_keys, from + KEY_BLOCK);
    int64_t r0 = 0;
    while (r0 < R && keys[r0] <= from) ++r0;
#ifdef __AVX512BF16__
    // pairs [a, b) of the keys' value pairs vp, for every row that reads them
    auto weigh = [&](const PairRuns& vp, int64_t a, int64_t b) {
      for (int64_t r = r0; r < R; r += NR)
        weigh_groups(std::min<int64_t>(NR, R - r), pairs.data() + r, a, b,
                     [&](auto rows, int64_t i, int64_t x, int64_t y) {
                       weigh_pairs<ND, decltype(rows)::value>(epairs + (r + i) * half, half, vp, x, y,
                                                              acc + (r + i) * D);
                     });
    };
    const int64_t p0 = from / 2, p1 = (to + 1) / 2;  // the pairs of keys [from, to)
    if (pool.v16 && !shared.v) {  // a bfloat16 pool holds the pairs: read in place, a run per block
      const int64_t start = from - from % pool.BS;  // the first block's first key
      for (int64_t a = start, n = 0; a < to; a += pool.BS, ++n)
        runs[n] = pair_words(pool.v16) + value_pair_at(pool, seq, h, D, a);
      const PairRuns vp{runs.data(), start / 2, pool.BS / 2};
      const int64_t whole = to % 2 ? p1 - 1 : p1;  // a last odd key pairs with the slot past it:
      weigh(vp, p0, whole);
      if (whole < p1) {                             // that pair from a copy, the slot zeroed
        const int64_t run = (whole - vp.first) / vp.per_run;
        first_of_pair(runs[run] + (whole - vp.first - run * vp.per_run) * D, D, vpairs.data());
        const uint32_t* last = vpairs.data();
        weigh(PairRuns{&last, whole, 1}, whole, p1);
      }
    } else {
      if (!shared.v) pack_value_pairs(pool, seq, h, D, from, to, block.data(), vpairs.data());
      const uint32_t* run = shared.v ? shared.v + p0 * D : vpairs.data();
      weigh(PairRuns{&run, p0, p1 - p0}, p0, p1);
    }
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
// -> tops (R, 16), each row's largest scores lane by lane (score_pairs), or null where they were
// not kept (without VDPBF16PS).
template <int MR>
const float* score_bf16(const Pools& pool, int64_t seq, int64_t h, int64_t D, int64_t R, const float* qs,
                        const int64_t* keys, int64_t tiles, int64_t max_keys, float* kt, float* scores, int64_t width,
                        const SharedPairs& shared, float* tops) {
#ifdef __AVX512BF16__
  std::fill(tops, tops + R * LANES, NEG_INF);
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
    const uint32_t* tile = kp.data();
    int64_t ld = LANES;
    if (shared.k) {
      tile = shared.k + t * (D / 2 * LANES);
    } else if (key_tiles_in_place(pool)) {  // the pairs where their block holds them
      tile = pair_words(pool.k16) + key_pair_at(pool, seq, h, D, first_key);
      ld = pool.BS;
    } else {
      pack_key_tile(pool, seq, h, D, first_key, max_keys, kt, kp.data());
    }
    for (; r0 < R; r0 += MR)
      score_pair_rows<MR>(std::min<int64_t>(MR, R - r0), qp.data() + r0 * D / 2, D, tile, ld, scores + r0 * width,
                          width, keys + r0, first_key, tops + r0 * LANES);
#else
    round_key_tile(pool, seq, h, D, first_key, std::min<int64_t>(LANES, max_keys - first_key), kt);
    for (; r0 < R; r0 += MR)
      score_rows<MR>(std::min<int64_t>(MR, R - r0), qs + r0 * D, D, kt, LANES, scores + r0 * width, width, keys + r0,
                     first_key);
#endif
  }
#ifdef __AVX512BF16__
  return tops;
#else
  (void)tops;
  return nullptr;
#endif
}

}  // namespace sendlens::attention
