// bf16 <-> fp32 in AVX512 registers, 16 lanes at a time: the helpers every kernel file uses
// (cpu_decode.cpp, cpu_int8.cpp). Header-only; each file gets its own copies.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>

namespace {

inline __m512 load_bf16(const uint16_t* p) {
  // bf16 -> fp32 is a 16-bit left shift.
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

inline __m512 load_bf16_masked(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

inline void store_bf16_masked(at::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, to_bf16(v));
}

// The lanes of a 16-wide step that `left` remaining elements fill.
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
}

// A 16-output tile's fp32 sums for M rows ([row][output], e.g. a stored AMX C tile) + bias ->
// y[m, n0 .. n0 + 16) in bf16 for each row m, nothing past N (the AMX paths of both files).
inline void store_tile_bf16(const float (*sums)[16], int64_t M, const uint16_t* bias,
                            at::BFloat16* y, int64_t N, int64_t n0) {
  const __mmask16 mask = tail_mask(N - n0);
  const __m512 b = bias ? load_bf16_masked(bias + n0, mask) : _mm512_setzero_ps();
  for (int64_t m = 0; m < M; ++m)
    store_bf16_masked(y + m * N + n0, _mm512_add_ps(_mm512_load_ps(sums[m]), b), mask);
}

}  // namespace
