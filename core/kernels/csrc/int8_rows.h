// Activations rounded to 8-bit integers per group of 32, for the integer products of the Q4_1
// kernels (q4_avx512.h: VPDPBUSD; q4_avx2.h: VPMADDUBSW), as llama.cpp rounds them for its Q4_1 and
// Q8_0 dot products (its Q8_1 activations): x ~ s * xi with s = the group's largest |x| / 127, xi in
// -127..127, an error of at most s / 2 each. Each row is rounded on its own, so a row's integers
// never depend on the batch; the sums with the weights are then exact integers, the same in any
// order and any tile.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <ATen/Parallel.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

namespace sendlens {

// An allocator that leaves new elements uninitialized: a row's buffers are written whole by
// round_row before anything reads them, so zeroing them first (std::vector's value-initialization)
// would be one more pass over memory, on one thread, before every product.
template <typename T>
struct Uninitialized : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = Uninitialized<U>;
  };
  Uninitialized() = default;
  template <typename U>
  Uninitialized(const Uninitialized<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;  // default-initialized: no value for trivial types
  }
  template <typename U, typename... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};

template <typename T>
using Buffer = std::vector<T, Uninitialized<T>>;

// A row's integers of any width: int8_t here, int16_t in int16_rows.h.
template <typename T>
struct IntRows {
  int64_t K;
  Buffer<T> xi;         // (M, K): x ~ scale * xi, per group of 32
  Buffer<float> scale;  // (M, K/32)
  Buffer<float> sum;    // (M, K/32): scale * (the group's sum of xi), for Q4_1's m term
  Buffer<int32_t> isum; // (M, K/32): the group's sum of xi (Q8_0's offset weights, q8_matmul.cpp)
  const T* row(int64_t r) const { return xi.data() + r * K; }
};

// One group of 32 values rounded, -> its integers' sum: s = the group's largest |x| / limit, then
// each x * (limit / largest) rounded to the nearest integer (ties to even) and clamped. Written
// three times with the same arithmetic (the same fp32 products, the same rounding, exact integer
// sums; the largest |x| is the same in any order), so every CPU gives the same integers.
template <typename T>
int32_t round_group(const float* v, int32_t limit, T* q, float& s) {
  const float top = static_cast<float>(limit);
#if defined(__AVX512F__)
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  s = amax / top;
  const __m512 inv = _mm512_set1_ps(amax > 0.0f ? top / amax : 0.0f);
  const __m512i lo = _mm512_set1_epi32(-limit), hi = _mm512_set1_epi32(limit);
  auto to_int = [&](__m512 x) {
    const __m512i i = _mm512_cvt_roundps_epi32(_mm512_mul_ps(x, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_min_epi32(_mm512_max_epi32(i, lo), hi);
  };
  const __m512i ia = to_int(a), ib = to_int(b);
  if constexpr (sizeof(T) == 1) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(ia));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(ib));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtepi32_epi16(ia));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm512_cvtepi32_epi16(ib));
  }
  return _mm512_reduce_add_epi32(_mm512_add_epi32(ia, ib));
#elif defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 x[4], m = _mm256_setzero_ps();
  for (int c = 0; c < 4; ++c) {
    x[c] = _mm256_loadu_ps(v + 8 * c);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, x[c]));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, m);
  float amax = 0.0f;
  for (float l : lanes) amax = std::max(amax, l);
  s = amax / top;
  const __m256 inv = _mm256_set1_ps(amax > 0.0f ? top / amax : 0.0f);
  alignas(32) int32_t ints[32];
  for (int c = 0; c < 4; ++c)  // the product rounded by the current mode: to nearest, ties to even
    _mm256_store_si256(reinterpret_cast<__m256i*>(ints + 8 * c), _mm256_cvtps_epi32(_mm256_mul_ps(x[c], inv)));
  int32_t total = 0;
  for (int k = 0; k < 32; ++k) {
    const int32_t i = std::clamp(ints[k], -limit, limit);
    q[k] = static_cast<T>(i);
    total += i;
  }
  return total;
#else
  float amax = 0.0f;
  for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(v[k]));
  s = amax / top;
  const float inv = amax > 0.0f ? top / amax : 0.0f;
  int32_t total = 0;
  for (int k = 0; k < 32; ++k) {
    const int32_t i = std::clamp(static_cast<int32_t>(std::nearbyint(v[k] * inv)), -limit, limit);
    q[k] = static_cast<T>(i);
    total += i;
  }
  return total;
#endif
}

// One row of K values rounded per group of 32 (round_group). xi: (K,); scale, sum, isum: (K/32,).
template <typename T>
void round_row(const float* x, int64_t K, int32_t limit, T* xi, float* scale, float* sum, int32_t* isum) {
  for (int64_t g = 0; g < K / 32; ++g) {
    float s;
    const int32_t total = round_group<T>(x + g * 32, limit, xi + g * 32, s);
    scale[g] = s;
    sum[g] = s * static_cast<float>(total);
    isum[g] = total;
  }
}

// Room for M rows of K, uninitialized (round_into writes every row before it is read).
template <typename T>
IntRows<T> empty_rows(int64_t M, int64_t K) {
  return {K, Buffer<T>(M * K), Buffer<float>(M * (K / 32)), Buffer<float>(M * (K / 32)),
          Buffer<int32_t>(M * (K / 32))};
}

// Row r of `rows` rounded from x (K,).
template <typename T>
void round_into(IntRows<T>& rows, int64_t r, const float* x, int32_t limit) {
  const int64_t K = rows.K, K32 = K / 32;
  round_row<T>(x, K, limit, rows.xi.data() + r * K, rows.scale.data() + r * K32, rows.sum.data() + r * K32,
               rows.isum.data() + r * K32);
}

// x (M, K) rounded row by row (round_row).
template <typename T>
IntRows<T> round_rows(const at::Tensor& x_in, int32_t limit) {
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  IntRows<T> rows = empty_rows<T>(M, K);
  const float* xs = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) round_into<T>(rows, r, xs + r * K, limit);
  });
  return rows;
}

using Int8Rows = IntRows<int8_t>;

inline Int8Rows round_to_int8(const at::Tensor& x) { return round_rows<int8_t>(x, 127); }

// xi[k .. k + 3] of a row as one 32-bit value: the quad VPDPBUSD / VPMADDUBSW multiply with four
// weights of each column.
inline int32_t int8_quad(const int8_t* row, int64_t k) {
  int32_t quad;
  std::memcpy(&quad, row + k, sizeof quad);
  return quad;
}

}  // namespace sendlens
