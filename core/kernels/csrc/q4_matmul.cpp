// x W^T for Q4_1 weights (llama.cpp's format: groups of 32 weights w = d*q + m, q in 0..15, d and
// m in fp16). Each row of x is rounded once to 8-bit integers per group of 32 (int8_rows.h:
// x ~ s * xi, s = the group's largest |x| / 127, as llama.cpp rounds activations for its Q4_1 dot
// products), and per group of 32 k and output column j:
//   S = sum over k of xi[k] * q[j][k]      (an exact integer: the weights are never rounded)
//   y[j] = (s * sum of xi) * m + ((d * s) * S + y[j])      in fp32
// The inner loops exist for two instruction sets, chosen when the extension is compiled for this
// CPU (-march=native): AVX-512 VNNI (q4_avx512.h: VPDPBUSD, 64 multiply-adds an instruction) and
// AVX2 (q4_avx2.h: VPMADDUBSW, then VPMADDWD once per group). Their integer sums are exact and their
// fp32 steps the same, lane for lane, so the two give the same bits. Either streams the weights
// at half a byte each (plus d and m per 32) and spends a few instructions per 64 of them, where
// PyTorch's int4 kernel dequantizes every weight to fp32 and is bound by that arithmetic.
//
// Batch-invariant by construction: output (i, j) is one fixed chain of operations over k in order,
// whatever the number of rows, the tile they fall in, or the threads (which split columns only):
// the row's rounding to integers is its own, the integer sums are exact in any order, and the
// fp32 steps are the same in every tile. One or two rows (a decode step) read each 16-column
// panel straight from the weights; more rows expand each panel's q once into a buffer that tiles
// of rows read.
//
// A thread takes its panels one after another, so that it reads its share of the weights in two
// sequential streams, the nibbles and the scales (a thread's panels lie next to each other),
// which the hardware prefetcher follows from one panel into the next, and which the tiles of one
// or two rows also ask for 8 KB ahead (ahead()). Tiles of several panels at once, meant to give
// one row independent chains, read eight streams of a few KB each, each stopping at its panel's
// end, and waited on memory (README: what changed, 2026-12-05).
//
// Layout (gemm.pack_q4_1_native), per panel of 16 output columns: nibbles (N/16, K/4, 32) uint8,
// in octets of 8 k, 64 bytes each: byte 4c + j holds column c's q at k = 8o + j (low nibble) and
// at k = 8o + 4 + j (high nibble), the quads VPDPBUSD and VPMADDUBSW read (AVX2 reads each octet's
// 32-byte halves, columns 0-7 and 8-15); dm (N/16, K/32, 2, 16) fp16: each group's d, then m, for
// the 16 columns.

#include <ATen/Parallel.h>

#include <algorithm>
#include <string>
#include <vector>

#include "kernels.h"
#include "row_kernels.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include "q4_avx512.h"
#define SENDLENS_Q4 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "q4_avx2.h"
#define SENDLENS_Q4 1
#endif

namespace sendlens {

std::string q4_matmul_isa() {
#ifdef SENDLENS_Q4
  return q4::ISA;
#else
  return "";
#endif
}

#ifdef SENDLENS_Q4
namespace {

template <int R>
void tile_rows(const q4::Rows& a, int64_t r0, const q4::Expanded* buffer, const at::Half* dm, float* y, int64_t ldy,
               int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<R - 1>(a, r0, buffer, dm, y, ldy, rows);
  }
  q4::tile_from<R>(a, r0, buffer, dm, y, ldy);
}

}  // namespace
#endif

void q4_row_panels(const Int8Rows& a, int64_t M, const uint8_t* nib, const at::Half* dm, int64_t p0, int64_t p1,
                   float* y, int64_t ldy) {
#ifdef SENDLENS_Q4
  const int64_t K = a.K, panel_bytes = (K / 4) * 32, panel_scales = (K / 32) * 32;
  if (M <= 2) {  // one or two rows (a decode step): panel after panel, straight from the weights
    for (int64_t c = p0; c < p1; ++c) {
      if (M == 1) q4::tile<1>(a, 0, nib + c * panel_bytes, dm + c * panel_scales, y + c * 16, ldy);
      else q4::tile<2>(a, 0, nib + c * panel_bytes, dm + c * panel_scales, y + c * 16, ldy);
    }
    return;
  }
  // more rows: each panel expanded once, then every tile of rows reads it. Meanwhile the next
  // panel's nibbles are asked for, a share with each tile: the expansion reads a panel once, and
  // the hardware prefetcher, idle through the tiles, would leave it to wait on memory.
  thread_local std::vector<q4::Expanded> buffer;
  buffer.resize(q4::expanded_size(K));
  const int64_t tiles = (M + q4::MAX_ROWS - 1) / q4::MAX_ROWS;
  const int64_t lines = panel_bytes / 64, scale_lines = panel_scales * 2 / 64;  // (a line: 64 bytes)
  for (int64_t c = p0; c < p1; ++c) {
    q4::expand(nib + c * panel_bytes, K, buffer.data());
    const char* next = reinterpret_cast<const char*>(nib + (c + 1) * panel_bytes);
    const char* next_dm = reinterpret_cast<const char*>(dm + (c + 1) * panel_scales);
    for (int64_t t = 0, r = 0; r < M; ++t, r += q4::MAX_ROWS) {
      if (c + 1 < p1) {
        for (int64_t line = t * lines / tiles; line < (t + 1) * lines / tiles; ++line)
          _mm_prefetch(next + 64 * line, _MM_HINT_T0);
        for (int64_t line = t * scale_lines / tiles; line < (t + 1) * scale_lines / tiles; ++line)
          _mm_prefetch(next_dm + 64 * line, _MM_HINT_T0);
      }
      tile_rows<q4::MAX_ROWS>(a, r, buffer.data(), dm + c * panel_scales, y + r * ldy + c * 16, ldy,
                              std::min(q4::MAX_ROWS, M - r));
    }
  }
#endif
}

at::Tensor q4_matmul(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& dm) {
  TORCH_CHECK(!q4_matmul_isa().empty(), "q4_matmul: this build has neither AVX-512 VNNI nor AVX2 (use gemm.linear_q4)");
  TORCH_CHECK(x.dim() == 2 && nibbles.dim() == 3 && nibbles.scalar_type() == at::kByte &&
                  nibbles.size(2) == 32 && dm.dim() == 4 && dm.scalar_type() == at::kHalf,
              "q4_matmul: x (M, K), nibbles (N/16, K/4, 32) uint8, dm (N/16, K/32, 2, 16) half");
  const int64_t M = x.size(0), K = x.size(1), P = nibbles.size(0);
  TORCH_CHECK(K % 32 == 0 && nibbles.size(1) * 4 == K && dm.size(0) == P && dm.size(1) * 32 == K,
              "q4_matmul: x has ", K, " columns; the weights were packed for ", nibbles.size(1) * 4);
  at::Tensor y = at::empty({M, P * 16}, x.options().dtype(at::kFloat));
#ifdef SENDLENS_Q4
  const q4::Rows a = q4::prepare(x);  // x as the tiles read it, one row at a time
  const at::Tensor nib_c = nibbles.contiguous(), dm_c = dm.contiguous();
  const uint8_t* nib = nib_c.data_ptr<uint8_t>();
  const at::Half* scales = dm_c.data_ptr<at::Half>();
  float* ys = y.data_ptr<float>();
  const int64_t N = P * 16;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {  // threads split panels
    q4_row_panels(a, M, nib, scales, begin, end, ys, N);
  });
#endif
  return y;
}

}  // namespace sendlens
