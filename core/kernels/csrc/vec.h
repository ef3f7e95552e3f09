// Sixteen floats and the operations the kernels use: AVX-512 where the compiler targets it
// (native.py builds with -march=native), else two AVX2 halves, else the same arithmetic lane by
// lane. The AVX2 and lane-by-lane versions give the same bits (reduce_add sums in the same tree).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace sendlens {

constexpr int64_t LANES = 16;

#ifdef __AVX512F__
constexpr int ACC_VECS = 24;  // Vecs a loop can keep as accumulators in registers (32 zmm)
struct Vec {
  __m512 v;
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec set1(float x) { return {_mm512_set1_ps(x)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
};
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec round(Vec a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline Vec scale2(Vec a, Vec n) { return {_mm512_scalef_ps(a.v, n.v)}; }  // a * 2^n
inline Vec first(Vec a, int64_t n, float fill) {  // lanes n.. set to fill
  const __mmask16 keep = n >= LANES ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
  return {_mm512_mask_blend_ps(keep, _mm512_set1_ps(fill), a.v)};
}
inline float reduce_max(Vec a) { return _mm512_reduce_max_ps(a.v); }
inline float reduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int ACC_VECS = 6;   // 12 of the 16 ymm registers, two per Vec; more spill to the stack
struct Vec {  // lanes 0-7 in lo, 8-15 in hi
  __m256 lo, hi;
  static Vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static Vec set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  void store(float* p) const { _mm256_storeu_ps(p, lo); _mm256_storeu_ps(p + 8, hi); }
};
#define SENDLENS_HALVES(op) return {op(a.lo, b.lo), op(a.hi, b.hi)};
inline Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline Vec operator+(Vec a, Vec b) { SENDLENS_HALVES(_mm256_add_ps) }
inline Vec operator-(Vec a, Vec b) { SENDLENS_HALVES(_mm256_sub_ps) }
inline Vec operator*(Vec a, Vec b) { SENDLENS_HALVES(_mm256_mul_ps) }
inline Vec operator/(Vec a, Vec b) { SENDLENS_HALVES(_mm256_div_ps) }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(b.lo, a.lo), _mm256_max_ps(b.hi, a.hi)}; }  // as std::max(a, b)
#undef SENDLENS_HALVES
inline Vec round(Vec a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
// a * 2^n for whole n >= -126 (exp() keeps it there): powers of two built from their exponent
// bits, 2^min(n, 127) and then 2^min(n - that, 127), each product exact or rounded once (as ldexp
// rounds a subnormal result; a * 2^n beyond 2^254 is infinite for the a exp() has, as in ldexp).
inline __m256 scale2_half(__m256 a, __m256 n) {
  const auto pow2 = [](__m256 m) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(m), _mm256_set1_epi32(127)), 23));
  };
  const __m256 most = _mm256_set1_ps(127.0f), first = _mm256_min_ps(n, most);
  return _mm256_mul_ps(_mm256_mul_ps(a, pow2(first)), pow2(_mm256_min_ps(_mm256_sub_ps(n, first), most)));
}
inline Vec scale2(Vec a, Vec n) { return {scale2_half(a.lo, n.lo), scale2_half(a.hi, n.hi)}; }
inline Vec first(Vec a, int64_t n, float fill) {  // lanes n.. set to fill
  const __m256i count = _mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(n, LANES)));
  const __m256i lo = _mm256_cmpgt_epi32(count, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i hi = _mm256_cmpgt_epi32(count, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15));
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, a.lo, _mm256_castsi256_ps(lo)), _mm256_blendv_ps(f, a.hi, _mm256_castsi256_ps(hi))};
}
inline float reduce_max(Vec a) {
  __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
inline float reduce_add(Vec a) {  // a fixed tree, halves first (the lane-by-lane one's order)
  const __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
constexpr int ACC_VECS = 6;
struct Vec {  // the same arithmetic, lane by lane, where AVX-512 is not available
  float f[LANES];
  static Vec load(const float* p) { Vec r; for (int i = 0; i < LANES; ++i) r.f[i] = p[i]; return r; }
  static Vec set1(float x) { Vec r; for (int i = 0; i < LANES; ++i) r.f[i] = x; return r; }
  void store(float* p) const { for (int i = 0; i < LANES; ++i) p[i] = f[i]; }
};
#define SENDLENS_LANEWISE(expr) Vec r; for (int i = 0; i < LANES; ++i) r.f[i] = (expr); return r;
inline Vec fma(Vec a, Vec b, Vec c) { SENDLENS_LANEWISE(std::fma(a.f[i], b.f[i], c.f[i])) }
inline Vec operator+(Vec a, Vec b) { SENDLENS_LANEWISE(a.f[i] + b.f[i]) }
inline Vec operator-(Vec a, Vec b) { SENDLENS_LANEWISE(a.f[i] - b.f[i]) }
inline Vec operator*(Vec a, Vec b) { SENDLENS_LANEWISE(a.f[i] * b.f[i]) }
inline Vec operator/(Vec a, Vec b) { SENDLENS_LANEWISE(a.f[i] / b.f[i]) }
inline Vec max(Vec a, Vec b) { SENDLENS_LANEWISE(std::max(a.f[i], b.f[i])) }
inline Vec round(Vec a) { SENDLENS_LANEWISE(std::nearbyint(a.f[i])) }
inline Vec scale2(Vec a, Vec n) { SENDLENS_LANEWISE(std::ldexp(a.f[i], static_cast<int>(n.f[i]))) }
inline Vec first(Vec a, int64_t n, float fill) { SENDLENS_LANEWISE(i < n ? a.f[i] : fill) }
#undef SENDLENS_LANEWISE
inline float reduce_max(Vec a) { float m = a.f[0]; for (int i = 1; i < LANES; ++i) m = std::max(m, a.f[i]); return m; }
inline float reduce_add(Vec a) {  // a fixed tree, halves first
  for (int w = LANES / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) a.f[i] += a.f[i + w];
  return a.f[0];
}
#endif

// e^x (Cephes' expf: x = n ln2 + r, e^r by a degree-5 polynomial, times 2^n): about 0 below -87.3,
// infinity above 88.7.
inline Vec exp(Vec x) {
  x = max(x, Vec::set1(-87.3365f));
  const Vec n = round(x * Vec::set1(1.44269504088896341f));
  x = fma(n, Vec::set1(-0.693359375f), x);
  x = fma(n, Vec::set1(2.12194440e-4f), x);
  Vec p = Vec::set1(1.9875691500e-4f);
  p = fma(p, x, Vec::set1(1.3981999507e-3f));
  p = fma(p, x, Vec::set1(8.3334519073e-3f));
  p = fma(p, x, Vec::set1(4.1665795894e-2f));
  p = fma(p, x, Vec::set1(1.6666665459e-1f));
  p = fma(p, x, Vec::set1(5.0000001201e-1f));
  const Vec y = fma(p, x * x, x) + Vec::set1(1.0f);
  return scale2(y, n);
}

// e^x for a number rounded to bfloat16 next (the softmax numerators of bf16 operands): x = n ln2 + r
// with ln2 in one float, e^r = 1 + r q(r) with q of degree 3 (a least-relative-error fit on
// |r| <= ln2 / 2), times 2^n. Relative error below 3.2e-6, a thousandth of a bfloat16 step (2^-8):
// rounded, it differs from the exact e^x in about 3 of 10,000 numbers, by one step. Five
// multiply-adds where exp() takes nine; e^0 is exactly 1 (a row's largest score weighs 1).
inline Vec exp_coarse(Vec x) {
  x = max(x, Vec::set1(-87.3365f));
  const Vec n = round(x * Vec::set1(1.44269504088896341f));
  x = fma(n, Vec::set1(-0.693147182464599609375f), x);
  Vec q = Vec::set1(0.041513849049806595f);
  q = fma(q, x, Vec::set1(0.16787473857402802f));
  q = fma(q, x, Vec::set1(0.5000301599502563f));
  q = fma(q, x, Vec::set1(0.9999668598175049f));
  return scale2(fma(q, x, Vec::set1(1.0f)), n);
}

// Sixteen bfloat16 values (the top halves of floats) to floats, exactly; and back, rounding to
// nearest even, as torch does.
#ifdef __AVX512F__
inline Vec load_bf16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
// Sixteen 32-bit pairs of bfloat16 (a bfloat16 pool's, kv_cache.py) -> the first of each pair
// (half 0, the low 16 bits) or the second (half 1) as floats, exactly.
inline Vec load_bf16_half(const uint32_t* p, int half) {
  const __m512i w = _mm512_loadu_si512(p);
  return {_mm512_castsi512_ps(half ? _mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))
                                   : _mm512_slli_epi32(w, 16))};
}
inline void store_bf16(Vec a, uint16_t* p) {
  const __m512i bits = _mm512_castps_si512(a.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline Vec load_bf16(const uint16_t* p) {
  const auto half = [](const uint16_t* q) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  };
  return {half(p), half(p + 8)};
}
inline Vec load_bf16_half(const uint32_t* p, int which) {
  const auto half = [which](const uint32_t* q) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    return _mm256_castsi256_ps(which ? _mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)))
                                     : _mm256_slli_epi32(w, 16));
  };
  return {half(p), half(p + 8)};
}
inline void store_bf16(Vec a, uint16_t* p) {
  const auto rounded = [](__m256 h) {
    const __m256i bits = _mm256_castps_si256(h);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  };
  // packus interleaves the halves by 128-bit lane; the permute puts lanes 0-7 before 8-15
  const __m256i packed = _mm256_packus_epi32(rounded(a.lo), rounded(a.hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
}
#else
inline Vec load_bf16(const uint16_t* p) {
  Vec r;
  for (int i = 0; i < LANES; ++i) {
    const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
    std::memcpy(&r.f[i], &bits, sizeof(float));
  }
  return r;
}
inline Vec load_bf16_half(const uint32_t* p, int half) {
  Vec r;
  for (int i = 0; i < LANES; ++i) {
    const uint32_t bits = half ? p[i] & 0xFFFF0000u : p[i] << 16;
    std::memcpy(&r.f[i], &bits, sizeof(float));
  }
  return r;
}
inline void store_bf16(Vec a, uint16_t* p) {
  for (int i = 0; i < LANES; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &a.f[i], sizeof(float));
    p[i] = static_cast<uint16_t>((bits + ((bits >> 16) & 1) + 0x7FFF) >> 16);
  }
}
#endif

}  // namespace sendlens
