// x W^T for Q8_0 weights (llama.cpp's format: groups of 32 weights w = d*q, q in -127..127, d in
// fp16): the format q8_0, and the LM head of the q4_1 engine, whose GGUF file keeps the tied
// embedding in Q8_0. Per group of 32 k and output column, in 32-bit integers and so exactly in any
// order, then in fp32 group after group:
//   S = sum over k of xi[k] * q[k],   y = (d * s) * S + y
// with x ~ s * xi rounded once per row and group:
// - AVX-512 VNNI: to 8-bit integers (int8_rows.h, s = the group's largest |x| / 127, llama.cpp's
//   rounding). VPDPBUSD multiplies unsigned by signed bytes, so the weights are stored offset,
//   q + 128 in 1..255, and S = (sum of xi * (q + 128)) - 128 * (sum of xi), exact
//   (|sum| <= 32 * 255 * 127 < 2^31): 64 multiply-adds an instruction.
// - AVX2: to 16-bit integers (int16_rows.h, s = largest |x| / 32767), VPMADDWD pairs
//   (|S| <= 32 * 32767 * 127 < 2^31). 8-bit activations would not pay here: VPMADDUBSW needs an
//   unsigned operand, and the sign trick (|x| times q with x's sign) costs as many instructions
//   per weight as the 16-bit pairs.
// One pass over the 8-bit weights: 30 MB for SmolLM2's 49,152 x 576 head, where the two 4-bit
// passes it replaces (16*d*hi + d*lo, gemm.py) read 35 MB and spent about three times the
// instructions.
//
// Batch-invariant by construction: output (i, j) is one fixed chain of operations over k in order,
// whatever the number of rows, the tile they fall in, or the threads (which split columns only).
//
// Layout (gemm.pack_q8_0_native), per panel of 16 output columns: q (N/16, K/2, 32) int8 and
// d (N/16, K/32, 16) fp16. AVX2: byte b of unit u holds column b/2's q at k = 2u + b%2 (each
// 16-byte half widens to the k pairs of 8 columns that VPMADDWD reads). AVX-512 VNNI: in quads of
// 4 k, 64 bytes each, byte 4c + j holds column c's q + 128 at k = 4u + j, as VPDPBUSD reads them.

#include <ATen/Parallel.h>

#include <algorithm>

#include "kernels.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "int8_rows.h"
#define SENDLENS_Q8 1
#define SENDLENS_Q8_VNNI 1
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>

#include "int16_rows.h"
#define SENDLENS_Q8 1
#endif

namespace sendlens {

bool q8_matmul_available() {
#ifdef SENDLENS_Q8
  return true;
#else
  return false;
#endif
}

#ifdef SENDLENS_Q8_VNNI
namespace {

constexpr int64_t MAX_ROWS = 8;    // rows of a tile: 16 sums in registers
using Rows = Int8Rows;
inline Rows prepare(const at::Tensor& x) { return round_to_int8(x); }

// R rows from r0 times one 16-column panel -> y (R, 16), row stride ldy. Each group's sum runs in
// two chains (even and odd quads), added at its end: integers, so the same S.
template <int R>
void tile(const Rows& a, int64_t r0, const int8_t* q, const at::Half* d, float* y, int64_t ldy) {
  const int64_t K = a.K, K32 = K / 32;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(q);
  const int8_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = a.row(r0 + r);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K32; ++g) {
    __m512i S[R], T[R];
    for (int r = 0; r < R; ++r) S[r] = T[r] = _mm512_setzero_si512();
    for (int64_t u = g * 8; u < g * 8 + 8; u += 2) {
      const __m512i w0 = _mm512_loadu_si512(w + u * 64);
      const __m512i w1 = _mm512_loadu_si512(w + u * 64 + 64);
      for (int r = 0; r < R; ++r) {
        S[r] = _mm512_dpbusd_epi32(S[r], w0, _mm512_set1_epi32(int8_quad(x[r], 4 * u)));
        T[r] = _mm512_dpbusd_epi32(T[r], w1, _mm512_set1_epi32(int8_quad(x[r], 4 * u + 4)));
      }
    }
    const __m512 dg = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g * 16)));
    for (int r = 0; r < R; ++r) {  // S without the weights' offset, then y = (d * s) * S + y
      const __m512i offset = _mm512_set1_epi32(128 * a.isum[(r0 + r) * K32 + g]);
      const __m512i exact = _mm512_sub_epi32(_mm512_add_epi32(S[r], T[r]), offset);
      const __m512 ds = _mm512_mul_ps(dg, _mm512_set1_ps(a.scale[(r0 + r) * K32 + g]));
      acc[r] = _mm512_fmadd_ps(ds, _mm512_cvtepi32_ps(exact), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

}  // namespace
#elif defined(SENDLENS_Q8)
namespace {

constexpr int64_t MAX_ROWS = 4;  // rows of a tile: 8 sums, two weight vectors and a pair in registers
using Rows = Int16Rows;
inline Rows prepare(const at::Tensor& x) { return round_to_int16(x); }

// R rows from r0 times one 16-column panel -> y (R, 16), row stride ldy.
template <int R>
void tile(const Rows& a, int64_t r0, const int8_t* q, const at::Half* d, float* y, int64_t ldy) {
  const int64_t K32 = a.K / 32;
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + r * ldy + 8 * h, _mm256_setzero_ps());
  for (int64_t g = 0; g < K32; ++g) {
    __m256i S[R][2];
    for (int r = 0; r < R; ++r) S[r][0] = S[r][1] = _mm256_setzero_si256();
    for (int64_t u = g * 16; u < g * 16 + 16; ++u) {
      const int8_t* p = q + u * 32;
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
      for (int r = 0; r < R; ++r) {
        const __m256i xp = int16_pair(a.row(r0 + r), 2 * u);
        S[r][0] = _mm256_add_epi32(S[r][0], _mm256_madd_epi16(w0, xp));
        S[r][1] = _mm256_add_epi32(S[r][1], _mm256_madd_epi16(w1, xp));
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 dg = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g * 16 + 8 * h)));
      for (int r = 0; r < R; ++r) {  // y = (d * s) * S + y, the same steps for every row
        float* out = y + r * ldy + 8 * h;
        const __m256 ds = _mm256_mul_ps(dg, _mm256_set1_ps(a.scale[(r0 + r) * K32 + g]));
        _mm256_storeu_ps(out, _mm256_fmadd_ps(ds, _mm256_cvtepi32_ps(S[r][h]), _mm256_loadu_ps(out)));
      }
    }
  }
}

}  // namespace
#endif

#ifdef SENDLENS_Q8
namespace {

template <int R>
void tile_rows(const Rows& a, int64_t r0, const int8_t* q, const at::Half* d, float* y, int64_t ldy,
               int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<R - 1>(a, r0, q, d, y, ldy, rows);
  }
  tile<R>(a, r0, q, d, y, ldy);
}

}  // namespace
#endif

at::Tensor q8_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d) {
  TORCH_CHECK(q8_matmul_available(), "q8_matmul: this build has no AVX2 (use gemm.PackedQ8_0's fallback)");
  TORCH_CHECK(x.dim() == 2 && q.dim() == 3 && q.scalar_type() == at::kChar && q.size(2) == 32 &&
                  d.dim() == 3 && d.scalar_type() == at::kHalf && d.size(2) == 16,
              "q8_matmul: x (M, K), q (N/16, K/2, 32) int8, d (N/16, K/32, 16) half");
  const int64_t M = x.size(0), K = x.size(1), P = q.size(0), N = P * 16;
  TORCH_CHECK(K % 32 == 0 && q.size(1) * 2 == K && d.size(0) == P && d.size(1) * 32 == K,
              "q8_matmul: x has ", K, " columns; the weights were packed for ", q.size(1) * 2);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
#ifdef SENDLENS_Q8
  const Rows a = prepare(x);
  const at::Tensor q_c = q.contiguous(), d_c = d.contiguous();
  const int8_t* qs = q_c.data_ptr<int8_t>();
  const at::Half* ds = d_c.data_ptr<at::Half>();
  float* ys = y.data_ptr<float>();
  const int64_t panel = (K / 2) * 32, panel_d = (K / 32) * 16;
  // threads split panels; each panel's weights stay in L1 while every tile of rows reads them, and
  // a thread reads its panels one after another, as two streams, weights and scales (q4_matmul.cpp
  // says why)
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      for (int64_t r = 0; r < M; r += MAX_ROWS)
        tile_rows<MAX_ROWS>(a, r, qs + c * panel, ds + c * panel_d, ys + r * N + c * 16, N,
                            std::min(MAX_ROWS, M - r));
  });
#endif
  return y;
}

}  // namespace sendlens
