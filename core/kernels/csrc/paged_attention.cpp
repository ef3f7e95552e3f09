// Paged attention (Kwon et al., 2023) that is batch-invariant by construction.
//
// Each query row (one token, one head) is computed by one fixed sequence of float operations that
// depends only on its own query and on its sequence's keys and values 0..position, read in place
// through the block table:
//
//   score_j = (q / sqrt(D)) . k_j   one multiply-add chain over d = 0..D-1; 16 keys at once
//   m       = max_j score_j         exact in any order
//   e_j     = exp(score_j - m)      one polynomial (Cephes' expf), the same in every lane
//   sum     = sum_j e_j             lane j % 16 adds its keys in order, then a fixed tree
//   y       = (sum_j e_j v_j) / sum  key by key in order, 16 dimensions per vector
//
// KV eviction (StreamingLLM, Xiao et al., 2023): with a window w > 0 a row at position p sees the
// first s keys (the attention sinks) and the last w (p - w < j <= p); the others are masked (their
// scores out of the max, their weights exactly 0), so the blocks stay and only the result changes.
//
// Nothing in it depends on the other rows: not on how many queries of the sequence are computed
// in this step (chunked prefill), which other sequences share the step (batching), the threads, or
// where the row falls in a tile. So a request gives the same bits alone, batched or chunked without
// padding queries or keys (the torch path in attention.py needs both). Rows are tiled (a few tokens
// of one sequence and one KV head) only so that a key tile, once in cache, serves many rows.
//
// bf16 (the q4_1 format's attention): q, k, v and the numerators e_j rounded to bfloat16, each row
// still one fixed chain (attention_bf16.h); the denominator sums the rounded e_j. Numbers rounded to
// 8 bits need no 24-bit exp: theirs is a shorter polynomial (vec.h: exp_coarse), a thousandth of a
// bfloat16 step from the exact e^x, and with VDPBF16PS they go straight to the bfloat16 pairs its
// weighted values multiply. The tile loops
// are in attention_tiles.h (fp32) and attention_bf16.h; here, a work item's phases and the driver.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_bf16.h"
#include "attention_tiles.h"
#include "kernels.h"
#include "row_kernels.h"
#include "vec.h"

namespace sendlens {
namespace {

using namespace attention;  // attention_tiles.h, attention_bf16.h

// Query tokens of one sequence per work item: more with bf16 operands, whose keys and values are
// converted to bfloat16 pairs once per item (the conversion then serves more rows).
constexpr int64_t TILE_TOKENS = 8, TILE_TOKENS_BF16 = 16;

// The scores of a work item's R rows in fp32, a tile of 16 keys at a time, for every row that reads
// into it (MR rows at a time); ktile: scratch (D, 16) for a tile gathered when BS % 16 != 0.
template <int MR>
void score_fp32(const Pools& pool, int64_t seq, int64_t h, int64_t D, int64_t R, const float* qs, const int64_t* keys,
                int64_t tiles, int64_t max_keys, float* ktile, float* scores, int64_t width, bool stream) {
  const int64_t BS = pool.BS;
  for (int64_t kt = 0; kt < tiles; ++kt) {
    const int64_t first_key = kt * LANES;
    const float* tile;
    int64_t ld;
    if (BS % LANES == 0) {
      const int64_t id = pool.block(seq, first_key / BS);
      tile = pool.k + ((id * pool.Hkv + h) * D) * BS + first_key % BS;
      ld = BS;
    } else {
      for (int64_t i = 0; i < LANES; ++i) {
        const int64_t key = first_key + i;
        if (key >= max_keys) {
          for (int64_t d = 0; d < D; ++d) ktile[d * LANES + i] = 0.0f;
          continue;
        }
        const float* src = pool.k + ((pool.block(seq, key / BS) * pool.Hkv + h) * D) * BS + key % BS;
        for (int64_t d = 0; d < D; ++d) ktile[d * LANES + i] = src[d * BS];
      }
      tile = ktile;
      ld = LANES;
    }
    if (stream && BS % LANES == 0 && kt + 1 < tiles && (first_key + LANES) % BS == 0)  // the next block's keys
      prefetch(pool.k + ((pool.block(seq, (first_key + LANES) / BS) * pool.Hkv + h) * D) * BS, D * BS);
    int64_t r0 = 0;
    while (r0 < R && keys[r0] <= first_key) ++r0;  // rows are in token order: earlier ones end first
    for (; r0 < R; r0 += MR)
      score_rows<MR>(std::min<int64_t>(MR, R - r0), qs + r0 * D, D, tile, ld, scores + r0 * width, width,
                     keys + r0, first_key);
  }
}

// A row's softmax numerators e_j = exp(s_j - top) for its n keys (keys n.. of the last tile 0), in
// place as floats, rounded to bfloat16 in bf16 mode (BF16, whose numbers take exp_coarse); or, where
// out16 is given (bf16 mode on VDPBF16PS), as bfloat16 into out16, the pairs weigh_bf16 multiplies.
// -> their sum, lane j % 16 adding its keys in order, then reduce_add's tree.
template <bool BF16>
float numerators(float* row, int64_t n, Vec top, uint16_t* out16) {
  Vec sum = Vec::set1(0.0f);
  for (int64_t kt = 0; kt * LANES < n; ++kt) {
    const Vec x = Vec::load(row + kt * LANES) - top;
    Vec e = BF16 ? exp_coarse(x) : exp(x);
    if (n - kt * LANES < LANES) e = first(e, n - kt * LANES, 0.0f);  // the last tile's keys past n
    if (BF16 && out16) {
      e = to_bf16(e, out16 + kt * LANES);
    } else {
      if (BF16) e = round_bf16(e);
      e.store(row + kt * LANES);
    }
    sum = sum + e;
  }
  return reduce_add(sum);
}

// The sum of a row's n numerators as they lie (as floats, or as bfloat16): the chain of numerators().
template <class T>
float sum_numerators(const T* row, int64_t n) {
  Vec sum = Vec::set1(0.0f);
  for (int64_t kt = 0; kt * LANES < n; ++kt) {
    if constexpr (std::is_same_v<T, uint16_t>) sum = sum + load_bf16(row + kt * LANES);
    else sum = sum + Vec::load(row + kt * LANES);
  }
  return reduce_add(sum);
}

// Softmax's numerators over each row's scores (rounded to bfloat16 in bf16 mode), and their sums,
// the denominators: in place as floats, or, where e16 is given (bf16 mode on VDPBF16PS), as
// bfloat16 into e16 (R, width), neighbouring keys the pairs weigh_bf16 multiplies. tops (R, 16),
// where given: each row's largest scores lane by lane, kept while scoring (for rows that evict
// nothing: the same maximum as a pass over the stored scores).
void softmax_rows(const Pools& pool, int64_t R, const int64_t* keys, float* scores, int64_t width, const float* tops,
                  float* sums, uint16_t* e16) {
  for (int64_t r = 0; r < R; ++r) {
    float* row = scores + r * width;
    uint16_t* row16 = e16 ? e16 + r * width : nullptr;
    const int64_t n = keys[r], row_tiles = (n + LANES - 1) / LANES;
    // Evicted keys (a sliding window after the sinks): out of the max, then weight exactly 0.
    const int64_t hide_from = pool.sink_tokens, hide_to = pool.window > 0 ? n - pool.window : 0;
    const bool evicts = hide_to > hide_from;
    for (int64_t j = hide_from; j < hide_to; ++j) row[j] = NEG_INF;
    Vec m = tops && !evicts ? Vec::load(tops + r * LANES) : Vec::load(row);
    if (!tops || evicts)
      for (int64_t kt = 1; kt < row_tiles; ++kt) m = max(m, Vec::load(row + kt * LANES));
    const Vec top = Vec::set1(reduce_max(m));
    sums[r] = pool.bf16 ? numerators<true>(row, n, top, row16) : numerators<false>(row, n, top, nullptr);
    if (evicts) {  // their weights zeroed where they lie, and the sum again, of what is left
      if (row16) {
        std::fill(row16 + hide_from, row16 + hide_to, uint16_t{0});
        sums[r] = sum_numerators(row16, n);
      } else {
        std::fill(row + hide_from, row + hide_to, 0.0f);
        sums[r] = sum_numerators(row, n);
      }
    }
  }
}

// The values of a work item's R rows weighted in fp32, key by key: KEY_BLOCK keys at a time (they
// stay in cache) for every group of up to NR rows (they share each value vector's load).
template <int64_t ND, int NR>
void weigh_fp32(const Pools& pool, int64_t seq, int64_t h, int64_t R, const int64_t* keys, int64_t max_keys,
                const float* e, int64_t width, float* acc, bool stream) {
  constexpr int64_t D = LANES * ND;
  for (int64_t from = 0; from < max_keys; from += KEY_BLOCK) {
    int64_t r0 = 0;
    while (r0 < R && keys[r0] <= from) ++r0;
    for (; r0 < R; r0 += NR)
      weigh_rows<ND>(std::min<int64_t>(NR, R - r0), pool, seq, h, e + r0 * width, width, keys + r0, from,
                     from + KEY_BLOCK, acc + r0 * D, stream);
  }
}

// One work item: query tokens [t0, t1) of sequence `seq`, query heads g0 .. g0 + Gs - 1 of the G
// that read KV head `h`.
template <int64_t ND>  // D = 16 * ND
void attend_tile(const Pools& pool, const float* q, int64_t q_token_stride, float* out, int64_t H, int64_t G,
                 int64_t g0, int64_t Gs, int64_t seq, int64_t h, int64_t t0, int64_t t1, const int64_t* positions,
                 std::vector<float>& scratch, const SharedPairs& shared) {
  constexpr int64_t D = LANES * ND;
  // Rows scored together (one accumulator each) and rows weighing values together (ND each), as
  // many as stay in registers: AVX-512 8 and 6, AVX2 6 and 1 for D = 64 (a spilled accumulator
  // costs a load and a store per multiply-add). Tiling never changes a row's bits.
  constexpr int MR = std::min(8, ACC_VECS);
  constexpr int NR = static_cast<int>(std::clamp<int64_t>(ACC_VECS / ND, 1, 6));
  const int64_t R = (t1 - t0) * Gs;  // rows (token i, head g0 + g) = i * Gs + g
  // A few rows (a decode) read each block once, from memory: ask for the next one ahead. Many
  // rows read it again from cache, where asking would only cost instructions.
  const bool stream = R <= MR;
  int64_t max_keys = 0;
  for (int64_t t = t0; t < t1; ++t) max_keys = std::max(max_keys, positions[t] + 1);
  const int64_t tiles = (max_keys + LANES - 1) / LANES, width = tiles * LANES;
  scratch.resize(R * (width + 2 * D + 1 + LANES) + D * LANES);
  float* scores = scratch.data();            // (R, width): scores, then exp(score - max)
  float* qs = scores + R * width;            // (R, D): queries times 1/sqrt(D)
  float* ktile = qs + R * D;                 // (D, 16): a key tile gathered when BS % 16 != 0
  float* sums = ktile + D * LANES;           // (R,) softmax denominators
  float* tops = sums + R + R * D;            // (R, 16): each row's largest scores, lane by lane (after acc)
  std::vector<int64_t> keys(R);              // (R,) how many keys each row reads
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / Gs, head = h * G + g0 + r % Gs;
    keys[r] = positions[t] + 1;
    const float* src = q + t * q_token_stride + head * D;
    for (int64_t d = 0; d < D; ++d) qs[r * D + d] = src[d] * scale;
    if (pool.bf16)
      for (int64_t c = 0; c < D; c += LANES) round_bf16(Vec::load(qs + r * D + c)).store(qs + r * D + c);
  }
  // Scores, softmax, then the weighted values: each phase for all of the item's rows.
  const float* top_lanes = nullptr;  // kept while scoring, where the scoring keeps them
  if (pool.bf16)
    top_lanes =
        score_bf16<MR>(pool, seq, h, D, R, qs, keys.data(), tiles, max_keys, ktile, scores, width, shared, tops);
  else score_fp32<MR>(pool, seq, h, D, R, qs, keys.data(), tiles, max_keys, ktile, scores, width, stream);
  uint16_t* e16 = nullptr;  // (R, width): the numerators as bfloat16, where VDPBF16PS weighs them
#ifdef __AVX512BF16__
  thread_local std::vector<uint32_t> epairs;
  if (pool.bf16) {
    epairs.resize(R * width / 2);
    e16 = reinterpret_cast<uint16_t*>(epairs.data());
  }
#endif
  softmax_rows(pool, R, keys.data(), scores, width, top_lanes, sums, e16);
  float* acc = sums + R;                     // (R, D): sum_j e_j v_j
  std::fill(acc, acc + R * D, 0.0f);
  if (pool.bf16) weigh_bf16<ND, NR>(pool, seq, h, R, keys.data(), max_keys, scores, e16, width, acc, shared);
  else weigh_fp32<ND, NR>(pool, seq, h, R, keys.data(), max_keys, scores, width, acc, stream);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = t0 + r / Gs, head = h * G + g0 + r % Gs;
    const Vec denom = Vec::set1(sums[r]);
    for (int64_t c = 0; c < ND; ++c)
      (Vec::load(acc + r * D + c * LANES) / denom).store(out + (t * H + head) * D + c * LANES);
  }
}

using TileFn = decltype(&attend_tile<1>);

// One KEY_BLOCK of one sequence's keys and values for one KV head, converted for the whole step.
struct PackJob {
  int64_t seq, h, from, n;
  uint32_t* k;
  uint32_t* v;
};

// With bfloat16 operands on VDPBF16PS: the sequences that more than one work item reads (a prefill
// chunk's) have their keys and values converted to pairs once for the step, into `buffer`, instead
// of once per item. -> shared (S * Hkv) per sequence and KV head (null where an item converts its
// own), and the conversion jobs. The same conversion either way: the same bits.
std::vector<PackJob> plan_shared_pairs(const Pools& pool, int64_t S, int64_t D, const std::vector<int64_t>& starts,
                                       const int64_t* seq_of, const int64_t* pos, std::vector<uint32_t>& buffer,
                                       std::vector<SharedPairs>& shared) {
  std::vector<int64_t> items(S, 0), keys(S, 0);
  for (size_t i = 0; i + 1 < starts.size(); ++i) {
    const int64_t s = seq_of[starts[i]];
    ++items[s];
    for (int64_t t = starts[i]; t < starts[i + 1]; ++t) keys[s] = std::max(keys[s], pos[t] + 1);
  }
  shared.assign(S * pool.Hkv, SharedPairs{});
  std::vector<int64_t> offset(S * pool.Hkv, -1);
  int64_t total = 0;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t h = 0; h < pool.Hkv && items[s] > 1; ++h) {
      offset[s * pool.Hkv + h] = total;
      total += (keys[s] + LANES - 1) / LANES * LANES * (D / 2) + (keys[s] + 1) / 2 * D;
    }
  buffer.resize(total);
  std::vector<PackJob> jobs;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t h = 0; h < pool.Hkv && items[s] > 1; ++h) {
      uint32_t* k = buffer.data() + offset[s * pool.Hkv + h];
      uint32_t* v = k + (keys[s] + LANES - 1) / LANES * LANES * (D / 2);
      shared[s * pool.Hkv + h] = SharedPairs{k, v};
      for (int64_t from = 0; from < keys[s]; from += KEY_BLOCK) jobs.push_back({s, h, from, keys[s], k, v});
    }
  return jobs;
}

TileFn tile_function(int64_t D) {
  switch (D) {
    case 16: return &attend_tile<1>;
    case 32: return &attend_tile<2>;
    case 48: return &attend_tile<3>;
    case 64: return &attend_tile<4>;
    case 80: return &attend_tile<5>;
    case 96: return &attend_tile<6>;
    case 128: return &attend_tile<8>;
    default: return nullptr;
  }
}

}  // namespace

bool supports_head_dim(int64_t D) { return tile_function(D) != nullptr; }

void write_kv(const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& slots, const at::Tensor& k,
              const at::Tensor& v) {
  const bool half = k_pool.scalar_type() == at::kBFloat16;
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && v_pool.scalar_type() == k_pool.scalar_type() &&
              (half || k_pool.scalar_type() == at::kFloat) && k.scalar_type() == at::kFloat &&
              v.scalar_type() == at::kFloat,
              "write_kv: float or bfloat16 pools (both alike), float keys and values");
  TORCH_CHECK(slots.is_contiguous() && slots.scalar_type() == at::kLong && slots.size(0) == k.size(0),
              "write_kv: one int64 slot per token");
  const int64_t T = k.size(0), Hkv = k.size(1), D = k.size(2);
  const int64_t BS = pool_block_size(k_pool.sizes(), v_pool.sizes(), Hkv, D, half, "write_kv");
  const int64_t num_slots = k_pool.size(0) * BS;
  const at::Tensor kc = k.stride(2) == 1 ? k : k.contiguous(), vc = v.stride(2) == 1 ? v : v.contiguous();
  TORCH_CHECK(!half || D % LANES == 0, "write_kv: a bfloat16 pool takes heads of a multiple of ", LANES);
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  uint16_t *k16 = bf16_words(k_pool), *v16 = bf16_words(v_pool);
  float* kpool = half ? nullptr : k_pool.data_ptr<float>();
  float* vpool = half ? nullptr : v_pool.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " is outside the pool");
    for (int64_t h = 0; h < Hkv; ++h) {
      const float* kt = kp + t * kc.stride(0) + h * kc.stride(1);
      const float* vt = vp + t * vc.stride(0) + h * vc.stride(1);
      if (half) write_kv_head(k16, v16, BS, Hkv, D, slot[t], h, kt, vt);
      else write_kv_head(kpool, vpool, BS, Hkv, D, slot[t], h, kt, vt);
    }
  }
}

void write_kv_head(float* k_pool, float* v_pool, int64_t BS, int64_t Hkv, int64_t D, int64_t slot, int64_t h,
                   const float* k, const float* v) {
  const int64_t b = slot / BS, off = slot % BS;
  float* kd = k_pool + ((b * Hkv + h) * D) * BS + off;
  float* vd = v_pool + ((b * Hkv + h) * BS + off) * D;
  for (int64_t d = 0; d < D; ++d) {
    kd[d * BS] = k[d];
    vd[d] = v[d];
  }
}

void write_kv_head(uint16_t* k_pool, uint16_t* v_pool, int64_t BS, int64_t Hkv, int64_t D, int64_t slot, int64_t h,
                   const float* k, const float* v) {
  const int64_t b = slot / BS, off = slot % BS;
  // in pairs (kv_cache.py): key dimension d is half d % 2 of word (d / 2) * BS + off of its block;
  // the value's dimension d is half off % 2 of word (off / 2) * D + d
  uint16_t* kd = k_pool + 2 * (((b * Hkv + h) * (D / 2)) * BS + off);
  uint16_t* vd = v_pool + 2 * (((b * Hkv + h) * (BS / 2) + off / 2) * D) + off % 2;
  uint16_t bits[LANES];
  for (int64_t c = 0; c < D; c += LANES) {
    to_bf16(k + c, bits);
    for (int64_t i = 0; i < LANES; ++i) kd[2 * ((c + i) / 2 * BS) + (c + i) % 2] = bits[i];
    to_bf16(v + c, bits);
    for (int64_t i = 0; i < LANES; ++i) vd[2 * (c + i)] = bits[i];
  }
}

void attend_token(const KvPools& pools, const float* q, float* out, int64_t H, int64_t D, int64_t h, int64_t g0,
                  int64_t Gs, int64_t seq, int64_t position, std::vector<float>& scratch) {
  tile_function(D)(pools, q, H * D, out, H, H / pools.Hkv, g0, Gs, seq, h, 0, 1, &position, scratch, SharedPairs{});
}

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& block_tables, const at::Tensor& token_seq,
                           const at::Tensor& positions, int64_t sink_tokens, int64_t window, bool bf16) {
  TORCH_CHECK(sink_tokens >= 0 && window >= 0, "paged_attention: sink_tokens and window must be >= 0");
  const at::Tensor q = q_in.stride(2) == 1 && q_in.stride(1) == q_in.size(2) ? q_in : q_in.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const bool half = k_pool.scalar_type() == at::kBFloat16;
  TORCH_CHECK(v_pool.scalar_type() == k_pool.scalar_type() && (half || k_pool.scalar_type() == at::kFloat),
              "paged_attention: float or bfloat16 pools, both alike");
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  k_pool.dim() >= 2 && H % k_pool.size(1) == 0,
              "paged_attention: q (T, H, D) float, contiguous pools of Hkv KV heads dividing H");
  const int64_t Hkv = k_pool.size(1);
  const int64_t BS = pool_block_size(k_pool.sizes(), v_pool.sizes(), Hkv, D, half, "paged_attention");
  TORCH_CHECK(!half || bf16, "paged_attention: bfloat16 pools hold bf16 operands: pass bf16=True");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong &&
              token_seq.is_contiguous() && token_seq.scalar_type() == at::kLong && token_seq.size(0) == T &&
              positions.is_contiguous() && positions.scalar_type() == at::kLong && positions.size(0) == T,
              "paged_attention: int64 block tables (S, nb), token_seq and positions (T,)");
  const TileFn fn = tile_function(D);
  TORCH_CHECK(fn != nullptr, "paged_attention: head size ", D, " is not supported");
  const Pools pool{half ? nullptr : k_pool.data_ptr<float>(), half ? nullptr : v_pool.data_ptr<float>(),
                   block_tables.data_ptr<int64_t>(), k_pool.size(0), block_tables.size(1), BS, Hkv, sink_tokens,
                   window, bf16, bf16_words(k_pool), bf16_words(v_pool)};
  const int64_t S = block_tables.size(0);
  const int64_t* seq_of = token_seq.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  // Work items: runs of up to TILE_TOKENS consecutive tokens of one sequence, times KV heads.
  const int64_t tile_tokens = bf16 ? TILE_TOKENS_BF16 : TILE_TOKENS;
  std::vector<int64_t> starts;
  int64_t work = 0;
  for (int64_t t = 0; t < T;) {
    TORCH_CHECK(seq_of[t] >= 0 && seq_of[t] < S, "token ", t, " names sequence ", seq_of[t], " of ", S);
    TORCH_CHECK(pos[t] >= 0, "token ", t, " has position ", pos[t]);
    starts.push_back(t);
    int64_t end = t + 1;
    while (end < T && end - t < tile_tokens && seq_of[end] == seq_of[t]) ++end;
    for (int64_t i = t; i < end; ++i) work += pos[i] + 1;
    t = end;
  }
  starts.push_back(T);
  at::Tensor out = at::empty({T, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t tiles = static_cast<int64_t>(starts.size()) - 1, G = H / Hkv;
  // Items run heaviest first (the last tokens of a chunk read the most keys), taken one at a
  // time by whichever thread is free; a tiny step stays on one thread. An item takes every query
  // head of its KV head: a row's chains wait on their own multiply-adds, so a few rows cost about
  // what one does. Only where there are fewer items than threads is an item split, one query head
  // each. Which thread computes a row, and with which other rows, never changes its bits.
  const int threads = work * H < 1024 ? 1 : at::get_num_threads();
  const int64_t parts = tiles * Hkv < threads ? G : 1, per_part = G / parts;
  const int64_t items = tiles * Hkv * parts;
  std::vector<SharedPairs> shared(S * Hkv);
  std::vector<PackJob> jobs;
#ifdef __AVX512BF16__
  thread_local std::vector<uint32_t> pairs;  // grows to the largest step's, then stays
  if (bf16 && !key_tiles_in_place(pool))  // (read in place: nothing to convert)
    jobs = plan_shared_pairs(pool, S, D, starts, seq_of, pos, pairs, shared);
#endif
  const int64_t n_jobs = static_cast<int64_t>(jobs.size());
  std::exception_ptr failure;
  auto keep = [&failure] {
#pragma omp critical
    if (!failure) failure = std::current_exception();
  };
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> scratch(D * (LANES + 1));
#pragma omp for schedule(dynamic, 1)
    for (int64_t j = 0; j < n_jobs; ++j) {
#ifdef __AVX512BF16__
      try {
        pack_block(pool, jobs[j].seq, jobs[j].h, D, jobs[j].from, jobs[j].n, scratch.data(), jobs[j].k, jobs[j].v);
      } catch (...) {
        keep();
      }
#endif
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < items; ++i) {
      const int64_t item = items - 1 - i, tile = item / (Hkv * parts), h = item / parts % Hkv;
      const int64_t t0 = starts[tile], t1 = starts[tile + 1];
      try {
        fn(pool, qp, q.stride(0), op, H, G, item % parts * per_part, per_part, seq_of[t0], h, t0, t1, pos,
           scratch, shared[seq_of[t0] * Hkv + h]);
      } catch (...) {
        keep();
      }
    }
  }
  if (failure) std::rethrow_exception(failure);
  return out;
}

}  // namespace sendlens
