// x W^T for fp32 or bfloat16 weights, summed in fp32: the engine's own product for the fp32 format
// (and for bf16 where oneDNN cannot pack bfloat16 weights, gemm.py). Each output is
//   y[i][j] = fma(x[i][K-1], w[j][K-1], ... fma(x[i][1], w[j][1], x[i][0] * w[j][0] + 0) ...)
// one chain of fused multiply-adds over k in order, in one vector lane, whatever the number of rows,
// the tile they fall in, or the threads (which split columns only): batch-invariant by
// construction, so no row is ever padded. The classic GEMM micro-kernel (a row's x[k] broadcast
// against 16 columns' w[k], as in BLIS and GotoBLAS) already sums in exactly this order; what it
// adds here is a tile for every number of rows, from a decode step's one to a prompt's hundreds.
//
// One row (a decode step) is one multiply-add per weight, so it runs at the speed memory streams
// the weights: 4 panels at once keep 8 chains going to hide the multiply-add's latency. Three rows
// or more take tiles of up to 5 rows by one panel (10 sums, the panel's two vectors and a
// broadcast in AVX2's 16 registers), each panel read by every tile a slice of k at a time from L1
// (bfloat16 panels widened to fp32 once first: widening in every tile cost 40% of the speed).
//
// Layout (gemm.pack_f32_native), per panel of 16 output columns: (N/16, K, 16), the 16 columns'
// weights at k contiguous (one 64-byte line in fp32, 32 bytes in bfloat16).

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SENDLENS_F32 1
#endif

namespace sendlens {

bool f32_matmul_available() {
#ifdef SENDLENS_F32
  return true;
#else
  return false;
#endif
}

#ifdef SENDLENS_F32
namespace {

constexpr int64_t MAX_ROWS = 5;    // rows of a many-row tile (10 sums in registers)
constexpr int PANELS_ONE_ROW = 4;  // panels a tile of one row takes at once (8 chains)
constexpr int PANELS_TWO_ROWS = 2; // and of two rows (8 chains)
// Many-row tiles take the panel a slice of k at a time: 8 KB of it in fp32, which stays in L1
// while every tile of rows reads it, where a whole panel (36 KB and more) spilled to L2 and each
// tile waited on it. SmolLM2's 120 body products at 64 rows: 1.2-1.3x faster, the same bits (a
// sum stored to y between slices and loaded back is the same fp32 value).
constexpr int64_t SLICE_K = 128;

// Columns 0-7 and 8-15 of a panel at one k, as fp32.
inline void load16(const float* p, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(p);
  hi = _mm256_loadu_ps(p + 8);
}
inline void load16(const at::BFloat16* p, __m256& lo, __m256& hi) {  // bfloat16 is fp32's top half
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16));
  hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), 16));
}

// R rows (R <= 2) times NP adjacent panels: y (R, 16 NP), row strides K and ldy.
template <int R, int NP, typename W>
void tile_wide(const float* x, int64_t K, const W* w, float* y, int64_t ldy) {
  __m256 acc[R][NP][2];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    for (int p = 0; p < NP; ++p) {
      __m256 lo, hi;
      load16(w + (p * K + k) * 16, lo, hi);
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(x + r * K + k);
        acc[r][p][0] = _mm256_fmadd_ps(a, lo, acc[r][p][0]);
        acc[r][p][1] = _mm256_fmadd_ps(a, hi, acc[r][p][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < NP; ++p) {
      _mm256_storeu_ps(y + r * ldy + 16 * p, acc[r][p][0]);
      _mm256_storeu_ps(y + r * ldy + 16 * p + 8, acc[r][p][1]);
    }
}

// R rows (R <= 5) times one panel, over k = 0 .. Kc - 1 of x (row stride ldx) and w: the sums
// start from zero, or from y where an earlier slice of k left them (the same fp32 values, so the
// same chain). The sums are named variables, not an array: GCC keeps an array of ten vectors in
// memory and stores it on every k (a third of the speed).
template <int R, typename W>
void tile_tall(const float* x, int64_t ldx, int64_t Kc, const W* w, float* y, int64_t ldy, bool first) {
  const __m256 z = _mm256_setzero_ps();
  __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z, c40 = z, c41 = z;
  if (!first) {
#define SENDLENS_ROW(r)                                                      \
  if constexpr (R > r) {                                                     \
    c##r##0 = _mm256_loadu_ps(y + r * ldy);                                  \
    c##r##1 = _mm256_loadu_ps(y + r * ldy + 8);                              \
  }
    SENDLENS_ROW(0) SENDLENS_ROW(1) SENDLENS_ROW(2) SENDLENS_ROW(3) SENDLENS_ROW(4)
#undef SENDLENS_ROW
  }
  const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx;
  for (int64_t k = 0; k < Kc; ++k) {
    __m256 lo, hi, a;
    load16(w + k * 16, lo, hi);
#define SENDLENS_ROW(r)                                                      \
  if constexpr (R > r) {                                                     \
    a = _mm256_broadcast_ss(x##r + k);                                       \
    c##r##0 = _mm256_fmadd_ps(a, lo, c##r##0);                               \
    c##r##1 = _mm256_fmadd_ps(a, hi, c##r##1);                               \
  }
    SENDLENS_ROW(0) SENDLENS_ROW(1) SENDLENS_ROW(2) SENDLENS_ROW(3) SENDLENS_ROW(4)
#undef SENDLENS_ROW
  }
  const __m256 out[5][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}};
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * ldy, out[r][0]);
    _mm256_storeu_ps(y + r * ldy + 8, out[r][1]);
  }
}

template <int R, typename W>
void tile_rows(const float* x, int64_t ldx, int64_t Kc, const W* w, float* y, int64_t ldy, bool first,
               int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<R - 1>(x, ldx, Kc, w, y, ldy, first, rows);
  }
  tile_tall<R>(x, ldx, Kc, w, y, ldy, first);
}

// One or two rows: NP panels at a time, the last few one by one.
template <int R, int NP, typename W>
void few_rows(const float* x, int64_t K, const W* w, int64_t P, float* y, int64_t N) {
  at::parallel_for(0, (P + NP - 1) / NP, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin * NP; c < std::min(P, end * NP); c += NP) {
      if (c + NP <= P) {
        tile_wide<R, NP>(x, K, w + c * K * 16, y + c * 16, N);
      } else {
        for (int64_t e = c; e < P; ++e) tile_wide<R, 1>(x, K, w + e * K * 16, y + e * 16, N);
      }
    }
  });
}

template <typename W>
void matmul(const float* x, int64_t M, int64_t K, const W* w, int64_t P, float* y) {
  const int64_t N = P * 16;
  if (M == 1) return few_rows<1, PANELS_ONE_ROW>(x, K, w, P, y, N);
  if (M == 2) return few_rows<2, PANELS_TWO_ROWS>(x, K, w, P, y, N);
  const int64_t tiles = (M + MAX_ROWS - 1) / MAX_ROWS, panel_bytes = K * 16 * sizeof(W);
  const int64_t passes = tiles * ((K + SLICE_K - 1) / SLICE_K);    // tiles times slices of k
  const int64_t ahead = (panel_bytes / 64 + passes - 1) / passes;  // lines of the next panel per pass
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(std::is_same_v<W, float> ? 0 : K * 16);
    for (int64_t c = begin; c < end; ++c) {  // the panel stays in L2, a slice of it in L1, for every tile
      const char* next = reinterpret_cast<const char*>(w + (c + 1) * K * 16);
      const float* panel;
      if constexpr (std::is_same_v<W, float>) {
        panel = w + c * K * 16;
      } else {  // bfloat16 widened to fp32 once per panel (exact), not once per tile of rows
        for (int64_t k = 0; k < K; ++k) {
          __m256 lo, hi;
          load16(w + (c * K + k) * 16, lo, hi);
          _mm256_storeu_ps(widened.data() + k * 16, lo);
          _mm256_storeu_ps(widened.data() + k * 16 + 8, hi);
        }
        panel = widened.data();
      }
      int64_t pass = 0;
      for (int64_t k0 = 0; k0 < K; k0 += SLICE_K) {  // a slice of the panel stays in L1 for every tile
        const int64_t Kc = std::min(SLICE_K, K - k0);
        for (int64_t t = 0; t < tiles; ++t, ++pass) {
          // the next panel comes from memory a few lines per pass, so that its first tile does not
          // wait for it (the hardware prefetcher stops at each 4 KB page; a panel is 36 KB and more)
          if (c + 1 < end)
            for (int64_t l = pass * ahead; l < std::min(panel_bytes / 64, (pass + 1) * ahead); ++l)
              _mm_prefetch(next + l * 64, _MM_HINT_T1);
          const int64_t r = t * MAX_ROWS;
          tile_rows<MAX_ROWS>(x + r * K + k0, K, Kc, panel + k0 * 16, y + r * N + c * 16, N, k0 == 0,
                              std::min(MAX_ROWS, M - r));
        }
      }
    }
  });
}

}  // namespace
#endif

at::Tensor f32_matmul(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(f32_matmul_available(), "f32_matmul: this build has no AVX2 and FMA (use gemm.linear)");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(2) == 16 &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "f32_matmul: x (M, K), w (N/16, K, 16) float or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), P = w.size(0);
  TORCH_CHECK(w.size(1) == K, "f32_matmul: x has ", K, " columns; the weights were packed for ", w.size(1));
  at::Tensor y = at::empty({M, P * 16}, x.options().dtype(at::kFloat));
#ifdef SENDLENS_F32
  const at::Tensor xf = x.to(at::kFloat).contiguous(), wc = w.contiguous();
  if (wc.scalar_type() == at::kFloat)
    matmul(xf.data_ptr<float>(), M, K, wc.data_ptr<float>(), P, y.data_ptr<float>());
  else
    matmul(xf.data_ptr<float>(), M, K, wc.data_ptr<at::BFloat16>(), P, y.data_ptr<float>());
#endif
  return y;
}

}  // namespace sendlens
