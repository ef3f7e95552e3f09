// x W^T for Q4_1 weights (llama.cpp's format: groups of 32 weights w = d*q + m, q in 0..15, d and
// m in fp16), with AVX-512 BF16 dot products. Per group of 32 k and output column j:
//   S = sum over k of x[k] * q[j][k]    (VDPBF16PS: bfloat16 pairs, products exact, fp32 sums)
//   y[j] += d * S + m * sum over k of x[k]
// with x rounded to bfloat16 (as PyTorch's int4 kernel rounds it) and q exact in bfloat16, so the
// weights themselves are never rounded. A nibble becomes its bfloat16 value by one table lookup
// (VPERMW): a decode step spends a few instructions per 64 weights, and streams them at half a
// byte each (plus d and m per 32) at close to the memory bandwidth, where PyTorch's int4 kernel
// dequantizes every weight to fp32 and is bound by that arithmetic.
//
// Batch-invariant by construction: output (i, j) is one fixed chain of operations over k in order,
// whatever the number of rows, the tile they fall in, or the threads (which split columns only).
// A few rows take four 16-column panels at once (independent chains, to hide VDPBF16PS's latency);
// more rows expand each panel's q once into a buffer that tiles of up to 8 rows read.
//
// Layout (gemm.pack_q4_1_native), per panel of 16 output columns: nibbles (N/16, K/4, 32) uint8,
// byte b of unit u holding column b/2's q at k = 4u + b%2 in its low nibble and at k = 4u + 2 + b%2
// in its high one (so the two halves are the VNNI pairs VDPBF16PS reads); dm (N/16, K/32, 2, 16)
// fp16: each group's d, then m, for the 16 columns.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SENDLENS_Q4 1
#endif

namespace sendlens {

bool has_q4_matmul() {
#ifdef SENDLENS_Q4
  return true;
#else
  return false;
#endif
}

#ifdef SENDLENS_Q4
namespace {

constexpr int64_t MAX_ROWS = 8;  // rows of a tile: each keeps its accumulators in registers

// bfloat16 0, 1, ... 15 (twice: VPERMW reads 32 words by 5-bit index): a nibble's weight, exactly.
inline __m512i nibble_values() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const float v = static_cast<float>(i % 16);
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    t[i] = static_cast<uint16_t>(bits >> 16);
  }
  return _mm512_load_si512(t);
}

// Unit u of a panel (k = 4u .. 4u + 3): the 16 columns' q as bfloat16 pairs, for k = 4u, 4u + 1
// (first) and 4u + 2, 4u + 3 (second); lane c holds column c's pair.
inline void unit(const uint8_t* nib, int64_t u, __m512i values, __m512bh& first, __m512bh& second) {
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(nib + u * 32)));
  first = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(b, _mm512_set1_epi16(15)), values);
  second = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), values);
}

inline __m512bh pair_of(const uint16_t* row, int64_t k) {  // x[k], x[k + 1] in every lane
  int32_t pair;
  std::memcpy(&pair, row + k, sizeof pair);
  return (__m512bh)_mm512_set1_epi32(pair);
}

// One group's end: acc += d * S + m * (the group's sum of x), the same two steps for every row.
inline __m512 close_group(__m512 acc, __m512 S, const at::Half* dm, int64_t g, float x_sum) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32)));
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + g * 32 + 16)));
  return _mm512_fmadd_ps(m, _mm512_set1_ps(x_sum), _mm512_fmadd_ps(d, S, acc));
}

// R rows of x (bfloat16, row stride K; sums: (R, K/32) per-group sums of x) times NP adjacent
// 16-column panels -> y (R, 16 NP), row stride ldy. Several panels at once give a few rows several
// independent accumulator chains.
template <int R, int NP>
void tile(const uint16_t* x, const float* sums, int64_t K, const uint8_t* nib, const at::Half* dm, float* y,
          int64_t ldy) {
  const __m512i values = nibble_values();
  __m512 acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NP; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / 32; ++g) {
    __m512 S[R][NP];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NP; ++c) S[r][c] = _mm512_setzero_ps();
    for (int64_t u = g * 8; u < g * 8 + 8; ++u) {
      for (int c = 0; c < NP; ++c) {
        __m512bh first, second;
        unit(nib + c * (K / 4) * 32, u, values, first, second);
        for (int r = 0; r < R; ++r) {
          S[r][c] = _mm512_dpbf16_ps(S[r][c], first, pair_of(x + r * K, 4 * u));
          S[r][c] = _mm512_dpbf16_ps(S[r][c], second, pair_of(x + r * K, 4 * u + 2));
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < NP; ++c)
        acc[r][c] = close_group(acc[r][c], S[r][c], dm + c * (K / 32) * 32, g, sums[r * (K / 32) + g]);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NP; ++c) _mm512_storeu_ps(y + r * ldy + c * 16, acc[r][c]);
}

// Many rows: each panel's q are expanded once into `buffer` (K/2 pairs of 16 columns), then read by
// tiles of up to MAX_ROWS rows: the same operations in the same order as tile<R, 1>.
template <int R>
void tile_from(const uint16_t* x, const float* sums, int64_t K, const __m512bh* buffer, const at::Half* dm,
               float* y, int64_t ldy) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / 32; ++g) {
    __m512 S[R];
    for (int r = 0; r < R; ++r) S[r] = _mm512_setzero_ps();
    for (int64_t p = g * 16; p < g * 16 + 16; ++p) {
      const __m512bh w = buffer[p];
      for (int r = 0; r < R; ++r) S[r] = _mm512_dpbf16_ps(S[r], w, pair_of(x + r * K, 2 * p));
    }
    for (int r = 0; r < R; ++r) acc[r] = close_group(acc[r], S[r], dm, g, sums[r * (K / 32) + g]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

using TileFn = void (*)(const uint16_t*, const float*, int64_t, const __m512bh*, const at::Half*, float*, int64_t);
constexpr TileFn TILES[MAX_ROWS + 1] = {nullptr, tile_from<1>, tile_from<2>, tile_from<3>, tile_from<4>,
                                        tile_from<5>, tile_from<6>, tile_from<7>, tile_from<8>};

}  // namespace
#endif

at::Tensor q4_matmul(const at::Tensor& x_in, const at::Tensor& nibbles, const at::Tensor& dm) {
  TORCH_CHECK(has_q4_matmul(), "q4_matmul: this build has no AVX-512 BF16 (use gemm.linear_q4)");
  TORCH_CHECK(x_in.dim() == 2 && nibbles.dim() == 3 && nibbles.scalar_type() == at::kByte &&
                  nibbles.size(2) == 32 && dm.dim() == 4 && dm.scalar_type() == at::kHalf,
              "q4_matmul: x (M, K), nibbles (N/16, K/4, 32) uint8, dm (N/16, K/32, 2, 16) half");
  const int64_t M = x_in.size(0), K = x_in.size(1), P = nibbles.size(0);
  TORCH_CHECK(K % 32 == 0 && nibbles.size(1) * 4 == K && dm.size(0) == P && dm.size(1) * 32 == K,
              "q4_matmul: x has ", K, " columns; the weights were packed for ", nibbles.size(1) * 4);
  const at::Tensor x = x_in.to(at::kBFloat16).contiguous();
  at::Tensor y = at::empty({M, P * 16}, x_in.options().dtype(at::kFloat));
#ifdef SENDLENS_Q4
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const at::Tensor nib_c = nibbles.contiguous(), dm_c = dm.contiguous();
  const uint8_t* nib = nib_c.data_ptr<uint8_t>();
  const at::Half* scales = dm_c.data_ptr<at::Half>();
  float* ys = y.data_ptr<float>();
  const int64_t N = P * 16;
  const int64_t K32 = K / 32;
  // Each row's per-group sums of x, for the m * sum(x) term: in order, one row at a time.
  std::vector<float> sum_buf(M * K32);
  float* sums = sum_buf.data();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < K32; ++g) {
        float t = 0.0f;
        for (int64_t k = g * 32; k < g * 32 + 32; ++k) {
          const uint32_t bits = static_cast<uint32_t>(xs[r * K + k]) << 16;
          float v;
          std::memcpy(&v, &bits, sizeof v);
          t += v;
        }
        sums[r * K32 + g] = t;
      }
  });
  const int64_t panel_bytes = (K / 4) * 32, panel_scales = K32 * 32;
  if (M <= 2) {  // a decode step: four panels at a time, so that each row has four chains going
    at::parallel_for(0, (P + 3) / 4, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin * 4; c < std::min(P, end * 4); c += 4) {
        const uint8_t* n = nib + c * panel_bytes;
        const at::Half* s = scales + c * panel_scales;
        float* out = ys + c * 16;
        if (c + 4 <= P) {
          if (M == 1) tile<1, 4>(xs, sums, K, n, s, out, N); else tile<2, 4>(xs, sums, K, n, s, out, N);
        } else {
          for (int64_t e = c; e < P; ++e, n += panel_bytes, s += panel_scales, out += 16) {
            if (M == 1) tile<1, 1>(xs, sums, K, n, s, out, N); else tile<2, 1>(xs, sums, K, n, s, out, N);
          }
        }
      }
    });
  } else {  // expand each panel once, then every tile of rows reads it
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      std::vector<__m512bh> buffer(K / 2);
      const __m512i values = nibble_values();
      for (int64_t c = begin; c < end; ++c) {
        const uint8_t* n = nib + c * panel_bytes;
        for (int64_t u = 0; u < K / 4; ++u) unit(n, u, values, buffer[2 * u], buffer[2 * u + 1]);
        for (int64_t r = 0; r < M; r += MAX_ROWS) {
          const int64_t rows = std::min(MAX_ROWS, M - r);
          TILES[rows](xs + r * K, sums + r * K32, K, buffer.data(), scales + c * panel_scales,
                      ys + r * N + c * 16, N);
        }
      }
    });
  }
#endif
  return y;
}

}  // namespace sendlens
