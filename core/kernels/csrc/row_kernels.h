// The kernels one row at a time (one token, or one token and head), for the C++ decoder's step of
// a few tokens (decode_step.cpp), which runs every layer in one parallel region. Each is
// the very function its tensor kernel (kernels.h) runs for every row, so the step's bits are the
// batch's bits.
#pragma once

#include <c10/util/Exception.h>

#include "int8_rows.h"

#include <cstdint>
#include <vector>

namespace sendlens {

// One layer's paged KV pools (kv_cache.py's layout, kernels.h) and a batch's block tables.
struct KvPools {
  const float* k;               // (blocks, Hkv, D, BS)
  const float* v;               // (blocks, Hkv, BS, D)
  const int64_t* tables;        // (S, nb)
  int64_t num_blocks, nb, BS, Hkv;
  int64_t sink_tokens, window;  // KV eviction: window > 0 hides keys sink_tokens <= j <= position - window
  bool bf16 = false;            // q, k, v and the softmax's numerators rounded to bfloat16 (paged_attention)
  const uint16_t* k16 = nullptr;  // the pools in bfloat16 pairs (kv_cache.py, kv_cache_dtype "bf16"), k and v then
  const uint16_t* v16 = nullptr;  // null: only with bf16 operands, whose keys and values they hold rounded

  int64_t block(int64_t seq, int64_t index) const {
    TORCH_CHECK(index < nb, "a key's block ", index, " is beyond the block table (", nb, " blocks)");
    const int64_t id = tables[seq * nb + index];
    TORCH_CHECK(id >= 0 && id < num_blocks, "block ", id, " is outside the pool");
    return id;
  }
};

// RMSNorm of one row of C (rms_norm.cpp).
void rms_norm_row(const float* x, const float* w, int64_t C, float eps, float* out);

// Rotary embedding of one token's heads (rotary.cpp): x's heads head_stride apart, c and s the
// tables' rows at its position -> out (heads, D).
void rotary_row(const float* x, int64_t heads, int64_t head_stride, int64_t D, const float* c, const float* s,
                float* out);

// silu(gate) * up of one float row (silu_mul.cpp), its columns from .. to - 1 (multiples of 16):
// gate_up (2I,) -> out (I,).
void silu_mul_row(const float* gate_up, int64_t I, int64_t from, int64_t to, float* out);

// One token's key and value (D each) of KV head h into its slot of one layer's pools (write_kv);
// into bfloat16 pools rounded to nearest even, as bf16 attention rounds them (attention_bf16.h).
void write_kv_head(float* k_pool, float* v_pool, int64_t BS, int64_t Hkv, int64_t D, int64_t slot, int64_t h,
                   const float* k, const float* v);
void write_kv_head(uint16_t* k_pool, uint16_t* v_pool, int64_t BS, int64_t Hkv, int64_t D, int64_t slot, int64_t h,
                   const float* k, const float* v);

// One token's attention (paged_attention) for query heads h * G + g0 .. h * G + g0 + Gs - 1, those
// of KV head h: q (H, D) at `position` of sequence `seq` -> out (H, D), those heads' rows.
void attend_token(const KvPools& pools, const float* q, float* out, int64_t H, int64_t D, int64_t h, int64_t g0,
                  int64_t Gs, int64_t seq, int64_t position, std::vector<float>& scratch);

// Panels p0 .. p1 - 1 (16 output columns each) of M rows' Q4_1 product, by the tiles q4_matmul
// takes for M rows (so the same bits), for weights packed by gemm.pack_q4_1_native: a, the rows
// rounded (int8_rows.h); y, the whole output rows, ldy apart. Only where q4_matmul_isa() is not empty.
void q4_row_panels(const Int8Rows& a, int64_t M, const uint8_t* nib, const at::Half* dm, int64_t p0, int64_t p1,
                   float* y, int64_t ldy);

}  // namespace sendlens
