// int8 weights for decoding on AVX2 CPUs: Q8_0 blocks (32 weights of one output row share one
// scale, llama.cpp's format), multiplied with activations quantized the same way on the fly.
// The same product, layout and arguments as cpu_int8.cpp's AVX512-VNNI build (whose comment has
// the format), and the same PyTorch reference (models/quantize.py `q8_linear_reference`).
//
// AVX2 has no u8 x s8 dot product into int32 (VNNI); its VPMADDUBSW multiplies u8 by s8 and
// adds pairs into *saturating* int16, and VPMADDWD adds those pairs into int32. pack_q8 keeps
// the codes + 128 (u8, for VNNI), which would overflow int16 here (255 x 127 x 2): the codes
// are turned back into signed ones (one xor) and multiplied as llama.cpp's AVX2 path does,
// |w| (u8) by x with w's sign (s8): |w| x sign(x, w) = w x, at most 128 x 127 x 2 per pair.
// One 64-byte line holds 4 k of 16 outputs: two vectors of 8 outputs, each row's 4 codes
// broadcast against them; a block's 8 lines give each output's exact int32 dot product, then
// scaled (weight scale x activation scale) into fp32 sums.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

#include "avx2_simd.h"

namespace avx2 {

#include "common.h"

namespace {

// One row's 32-k blocks to codes (x * 127 / max|x| rounded to nearest even, as the AVX512
// build and the reference round) and their scales max|x| / 127.
void quantize_row(const uint16_t* x, int64_t K, int8_t* q, float* scale) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  // packs interleave 128-bit halves: this puts the 4 vectors' 8 codes back in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / kQ8Block; ++b) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(x + b * kQ8Block + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    const float top = hmax(amax);
    const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
    __m256i c[4];
    for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                             _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256((__m256i*)(q + b * kQ8Block), _mm256_permutevar8x32_epi32(words, order));
    scale[b] = top / 127.f;
  }
}

struct Activations {
  std::vector<int8_t> codes;  // [M, K]
  std::vector<float> scales;  // [M, K / 32]
};

Activations quantize_rows(const uint16_t* x, int64_t M, int64_t K) {
  const int64_t nb = K / kQ8Block;
  Activations a{std::vector<int8_t>(M * K), std::vector<float>(M * nb)};
  for (int64_t m = 0; m < M; ++m)
    quantize_row(x + m * K, K, a.codes.data() + m * K, a.scales.data() + m * nb);
  return a;
}

// Each tile's codes are prefetched into L2 this many 64-byte lines ahead (two blocks): 8% more
// tokens/s at 1 row, 4% at 8, over the decode step of SmolLM2 (2-core EPYC; 8 and 32 lines
// in between).
constexpr int64_t kCodesAhead = 16;
// The scales are prefetched this many blocks ahead (a tile's scales are a short stream of
// their own that the hardware prefetchers do not pick up; cpu_int8.cpp measured it).
constexpr int64_t kScalesAhead = 16;

// M rows x R consecutive tiles (16 outputs each) over all K.
template <int M, int R>
inline void q8_tiles(const uint8_t* w, const uint16_t* ws, int64_t nb, const int8_t* xq,
                     const float* xs, int64_t K, const uint16_t* bias, at::BFloat16* y, int64_t N,
                     int64_t tile) {
  __m256 acc[M][R][2];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r][0] = acc[m][r][1] = _mm256_setzero_ps();
  const __m256i flip = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i dot[M][R][2];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) dot[m][r][0] = dot[m][r][1] = _mm256_setzero_si256();
    for (int64_t q = 0; q < kQ8Block / 4; ++q) {
      __m256i xb[M];
      for (int m = 0; m < M; ++m) {
        int32_t group;
        std::memcpy(&group, xq + m * K + b * kQ8Block + q * 4, 4);
        xb[m] = _mm256_set1_epi32(group);
      }
      for (int r = 0; r < R; ++r)
        for (int half = 0; half < 2; ++half) {
          const uint8_t* line = w + (((tile + r) * nb + b) * 8 + q) * 64 + 32 * half;
          if (half == 0)  // an address, not a pointer: it may pass the end (never faults)
            _mm_prefetch(reinterpret_cast<const char*>(uintptr_t(line) + kCodesAhead * 64),
                         _MM_HINT_T1);
          const __m256i code = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)line), flip);
          const __m256i size = _mm256_abs_epi8(code);
          for (int m = 0; m < M; ++m) {
            const __m256i pairs = _mm256_maddubs_epi16(size, _mm256_sign_epi8(xb[m], code));
            dot[m][r][half] = _mm256_add_epi32(dot[m][r][half], _mm256_madd_epi16(pairs, ones));
          }
        }
    }
    for (int r = 0; r < R; ++r) {  // an address, not a pointer: it may pass the end (never faults)
      const uintptr_t ahead = uintptr_t(ws) + ((tile + r) * nb + b + kScalesAhead) * 32;
      _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r)
      for (int half = 0; half < 2; ++half) {
        const uint16_t* s = ws + ((tile + r) * nb + b) * 16 + 8 * half;
        const __m256 sw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s));
        for (int m = 0; m < M; ++m) {
          const __m256 scale = _mm256_mul_ps(sw, _mm256_set1_ps(xs[m * nb + b]));
          acc[m][r][half] =
              _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][r][half]), scale, acc[m][r][half]);
        }
      }
  }
  for (int r = 0; r < R; ++r)
    for (int half = 0; half < 2; ++half) {
      const int64_t n0 = (tile + r) * 16 + 8 * half;
      if (n0 >= N) continue;
      const __m256 bv = bias ? load8_any(bias + n0, N - n0) : _mm256_setzero_ps();
      for (int m = 0; m < M; ++m)
        store8_any(y + m * N + n0, _mm256_add_ps(acc[m][r][half], bv), N - n0);
    }
}

// Rows per pass over a tile: M x 2 int32 sums, M broadcasts and the line's vectors within the
// 16 vector registers (the fp32 sums, touched once a block, may live in memory).
constexpr int kQ8Rows = 4;

template <typename F>
void with_q8_rows(int64_t M, F&& f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// Any M: one row alone takes two tiles a pass (two weight streams); more go in chunks of
// kQ8Rows *within* each tile, whose 16 outputs' codes come from memory for the first chunk and
// from L1/L2 for the others.
void q8_run(const uint8_t* w, const uint16_t* ws, int64_t nb, const Activations& a, int64_t M,
            int64_t K, const uint16_t* bias, at::BFloat16* y, int64_t N) {
  const int64_t tiles = (N + 15) / 16;
  if (M == 1) {
    constexpr int R = 2;
    const int64_t groups = (tiles + R - 1) / R;
    at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t tile = g * R;
        if (tile + R <= tiles) {
          q8_tiles<1, R>(w, ws, nb, a.codes.data(), a.scales.data(), K, bias, y, N, tile);
        } else {
          for (int64_t t = tile; t < tiles; ++t)
            q8_tiles<1, 1>(w, ws, nb, a.codes.data(), a.scales.data(), K, bias, y, N, t);
        }
      }
    });
    return;
  }
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile)
      for (int64_t m0 = 0; m0 < M; m0 += kQ8Rows)
        with_q8_rows(std::min<int64_t>(kQ8Rows, M - m0), [&](auto m) {
          constexpr int rows = decltype(m)::value;
          q8_tiles<rows, 1>(w, ws, nb, a.codes.data() + m0 * K, a.scales.data() + m0 * nb, K,
                            bias, y + m0 * N, N, tile);
        });
  });
}

}  // namespace

// y [M, N] bf16 = x [M, K] bf16 @ W^T (+ bias bf16 [N]) with W as pack_q8 gives it; any M >= 1.
torch::Tensor linear_q8(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t N,
                        c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "contiguous bf16 [M, K] input");
  const int64_t M = x.size(0), K = x.size(1), nb = K / kQ8Block;
  TORCH_CHECK(M >= 1 && K % kQ8Block == 0, "at least one row, K a multiple of 32");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == torch::kUInt8 &&
                  packed.size(0) == (N + 15) / 16 && packed.size(1) == nb,
              "packed weight does not match x or N");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat16 && scales.numel() == packed.size(0) * nb * 16,
              "fp16 scales of the packed weight");
  const uint16_t* b = bias_ptr(bias, N);
  const Activations a =
      quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K);
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  q8_run(w, ws, nb, a, M, K, b, y.data_ptr<at::BFloat16>(), N);
  return y;
}

}  // namespace avx2
