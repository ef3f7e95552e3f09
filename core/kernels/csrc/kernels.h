// The engine's own kernels: paged attention (paged_attention.cpp), RMSNorm (rms_norm.cpp), rotary
// embedding (rotary.cpp), SwiGLU's silu(gate) * up (silu_mul.cpp), fp32, Q4_1 and Q8_0 products
// (f32_matmul.cpp, q4_matmul.cpp, q8_matmul.cpp), each computing every row on its own by construction, so that no
// result depends on the batch.
#pragma once

// ATen's tensor and its two factories only, not <torch/extension.h> (pybind11 and the whole C++ API):
// each kernel file then compiles in seconds rather than most of a minute. decoder.cpp, which binds
// the kernels to Python, includes the rest.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

namespace sendlens {

// A pool's values as 16-bit words where it is bfloat16 (kv_cache.py's kv_cache_dtype bf16), else null.
inline uint16_t* bf16_words(const at::Tensor& pool) {
  return pool.scalar_type() == at::kBFloat16 ? reinterpret_cast<uint16_t*>(pool.data_ptr<at::BFloat16>()) : nullptr;
}

// The pool's layout, per layer (kv_cache.py): keys (blocks, Hkv, D, block_size), each block's keys
// transposed so that dimension d of 16 keys is one vector; values (blocks, Hkv, block_size, D). A
// bfloat16 pool keeps pairs, one 32-bit word each: keys (blocks, Hkv, D/2, block_size, 2), pairs of
// dimensions, and values (blocks, Hkv, block_size/2, D, 2), pairs of neighbouring slots.
// -> the block size, after checking one layer's pools (sizes without the layer) against Hkv and D.
inline int64_t pool_block_size(at::IntArrayRef k, at::IntArrayRef v, int64_t Hkv, int64_t D, bool half,
                               const char* who) {
  if (half) {
    TORCH_CHECK(k.size() == 5 && v.size() == 5 && k[1] == Hkv && k[2] * 2 == D && k[4] == 2 && v[0] == k[0] &&
                    v[1] == Hkv && v[2] * 2 == k[3] && v[3] == D && v[4] == 2,
                who, ": bfloat16 pools in pairs, keys (blocks, Hkv, D/2, BS, 2) and values (blocks, Hkv, BS/2, D, 2)");
  } else {
    TORCH_CHECK(k.size() == 4 && v.size() == 4 && k[1] == Hkv && k[2] == D && v[0] == k[0] && v[1] == Hkv &&
                    v[2] == k[3] && v[3] == D,
                who, ": keys (blocks, Hkv, D, BS) and values (blocks, Hkv, BS, D)");
  }
  return k[3];
}

// The new tokens' keys and values into their slots. k_pool, v_pool: one layer's pools;
// slots: (T,) int64 pool slots; k, v: (T, Hkv, D), any strides.
void write_kv(const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& slots,
              const at::Tensor& k, const at::Tensor& v);

// softmax(q k^T / sqrt(D)) v for each packed query token over the keys 0..position of its sequence.
// q: (T, H, D); block_tables: (S, nb) int64; token_seq, positions: (T,) int64 -> (T, H, D).
// KV eviction (StreamingLLM): with window > 0 a query at position p sees only keys j < sink_tokens
// and p - window < j (the others are masked, their blocks kept); window 0 sees every key.
// bf16: q, k, v and the softmax's numerators rounded to bfloat16, their products summed in fp32
// (VDPBF16PS where the CPU has it).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& block_tables, const at::Tensor& token_seq,
                           const at::Tensor& positions, int64_t sink_tokens = 0, int64_t window = 0,
                           bool bf16 = false);

// Whether the kernel handles this head size (a multiple of 16, at most 128).
bool supports_head_dim(int64_t D);

// x / sqrt(mean(x^2) + eps) * weight for each row of x: (T, C) float, C a multiple of 16.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// x += delta (in place; delta of any float dtype, as x + delta promotes it), -> rms_norm(x, weight, eps).
at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps);

// Rotary embedding of x: (T, heads, D) float (rows may be strided) at positions (T,) int64, with the
// model's tables cos, sin: (max positions, D) -> (T, heads, D) contiguous.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions);

// silu(gate) * up from gate_up: (T, 2I) float or bfloat16 (gate first), I a multiple of 16 -> (T, I).
at::Tensor silu_mul(const at::Tensor& gate_up);

// Whether f32_matmul runs here (it needs AVX2 and FMA).
bool f32_matmul_available();

// x W^T summed in fp32, for weights packed by gemm.pack_f32_native: x (M, K) float or bfloat16,
// w (N/16, K, 16) float or bfloat16 -> (M, N) float.
at::Tensor f32_matmul(const at::Tensor& x, const at::Tensor& w);

// The instruction set q4_matmul is built for here: "avx512vnni" or "avx2" (either way x rounded to
// 8-bit integers per group of 32, the same bits), or "" where the CPU has neither (then
// q4_matmul refuses to run).
std::string q4_matmul_isa();

// x W^T for Q4_1 weights packed by gemm.pack_q4_1_native: x (M, K) float or bfloat16,
// nibbles (N/16, K/4, 32) uint8, dm (N/16, K/32, 2, 16) half -> (M, N) float.
at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& dm);

// Whether q8_matmul runs here (it needs AVX2).
bool q8_matmul_available();

// x W^T for Q8_0 weights packed by gemm.pack_q8_0_native: x (M, K) float or bfloat16,
// q (N/16, K/2, 32) int8, d (N/16, K/32, 16) half -> (M, N) float.
at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d);

// The LM head's candidates (lm_head.cpp): in each row of logits (N, V) float, the k largest
// (ties to the earlier token) replaced in place by their exact fp32 logits, row v of emb (V, C)
// times the row of hidden (N, C).
void rescore_top(const at::Tensor& logits, const at::Tensor& emb, const at::Tensor& hidden, int64_t k);

}  // namespace sendlens
