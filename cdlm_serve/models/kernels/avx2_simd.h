// bf16 <-> fp32 in AVX2 registers, 8 lanes at a time, and the few reductions the AVX2 kernel
// files share (avx2_decode.cpp, avx2_int8.cpp). AVX2 has no bf16 instructions: a bf16 is the
// high half of an fp32, widened by a 16-bit shift, and fp32 is rounded to bf16 (to nearest,
// ties to even, NaN kept quiet) with integer ops, exactly as c10::BFloat16 rounds. Tails are
// handled by copying them through a small zeroed buffer (AVX2 has no 16-bit masked loads).
// Header-only; each file gets its own copies.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

// 8 bf16 -> 8 fp32.
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// The first n (< 8) of 8 bf16, zeros past them.
inline __m256 load8_part(const uint16_t* p, int64_t n) {
  alignas(16) uint16_t t[8] = {};
  std::memcpy(t, p, n * sizeof(uint16_t));
  return load8(t);
}

inline __m256 load8_any(const uint16_t* p, int64_t left) {
  return left >= 8 ? load8(p) : load8_part(p, left);
}

// 8 fp32 -> 8 bf16, rounded to nearest even (c10::BFloat16's rounding; NaN -> 0x7FC0).
inline __m128i bf16x8(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // 32 -> 16 bits per 128-bit half (values fit: no saturation), halves in order.
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// fp32 rounded to bf16 and back (the value a bf16 store then load gives).
inline __m256 round_bf16(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16x8(v)), 16));
}

inline void store8(at::BFloat16* p, __m256 v) { _mm_storeu_si128((__m128i*)p, bf16x8(v)); }

inline void store8_part(at::BFloat16* p, __m256 v, int64_t n) {
  alignas(16) uint16_t t[8];
  _mm_store_si128((__m128i*)t, bf16x8(v));
  std::memcpy(p, t, n * sizeof(uint16_t));
}

inline void store8_any(at::BFloat16* p, __m256 v, int64_t left) {
  if (left >= 8) store8(p, v);
  else store8_part(p, v, left);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// [s_0 .. s_7] where s_i is the sum of the 8 lanes of a[i]: one transposing reduction for 8
// dot products instead of 8 horizontal sums.
inline __m256 sum8(const __m256 a[8]) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  // u0 = [s0..s3 of the low halves | s0..s3 of the high halves], u1 the same for s4..s7.
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// exp(x) for 8 floats, as cpu_decode.cpp's exp_ps: x = n ln2 + r, Cephes' degree-6 polynomial
// for exp(r) (relative error ~1e-7), times 2^n built in the exponent bits. Inputs clamped to
// [-87, 88], where expf neither overflows nor goes subnormal.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // n in [-126, 127]: 2^n is the float with exponent field n + 127.
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Bit i set where lane i of a comparison result is true.
inline uint32_t lanes(__m256 mask) { return uint32_t(_mm256_movemask_ps(mask)); }

// x [M, K] bf16 -> fp32 rows of `ld` floats (K rounded up to 8, zeros past K): the activations
// the AVX2 matrix kernels broadcast from.
inline std::vector<float> widen_rows(const uint16_t* x, int64_t M, int64_t K, int64_t ld) {
  std::vector<float> out(M * ld, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += 8) {
      const int64_t left = K - k;
      if (left >= 8) _mm256_storeu_ps(out.data() + m * ld + k, load8(x + m * K + k));
      else _mm256_storeu_ps(out.data() + m * ld + k, load8_part(x + m * K + k, left));
    }
  return out;
}

}  // namespace
