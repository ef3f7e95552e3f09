// The stream a Q4_1 tile of one or two rows asks for ahead, shared by both instruction sets'
// inner loops (q4_avx512.h, q4_avx2.h), which read the same layout (q4_matmul.cpp): per group of
// 32 k, a panel holds 256 bytes of nibbles and 64 of scales (d, then m, for 16 columns in fp16).
#pragma once

#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>

namespace sendlens::q4 {

constexpr int64_t AHEAD = 8192;  // bytes of nibbles a one- or two-row tile asks for ahead (ahead())

// Group g's nibbles AHEAD bytes on, and their scales (a quarter as far: 64 bytes of them per 256
// of nibbles), into L2 while the tile computes: the thread's panels lie next to each other, so
// this reaches into the panels it takes next, and a prefetch past the weights' end never faults.
// The hardware prefetcher alone keeps fewer reads in flight than a faster memory can serve
// (README: what changed, 2026-12-05).
inline void ahead(const uint8_t* nib, const at::Half* dm, int64_t g) {
  const char* n = reinterpret_cast<const char*>(nib) + g * 256 + AHEAD;
  for (int line = 0; line < 256; line += 64) _mm_prefetch(n + line, _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(dm + g * 32) + AHEAD / 4, _MM_HINT_T1);
}

}  // namespace sendlens::q4
