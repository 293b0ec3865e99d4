// int8 weights for decoding on AVX512-VNNI CPUs: Q8_0 blocks (llama.cpp's format: 32 weights
// of one output row share one scale), multiplied with activations quantized the same way on
// the fly, by VNNI's u8 x s8 dot product.
//
// Decoding streams every weight from memory once per step, so bytes per weight set the speed:
// bf16 moves 2 bytes a weight, Q8_0 1 + 2/32 (the scales). The arithmetic stays cheap: one
// VPDPBUSD multiplies 64 weight bytes (16 outputs x 4 k) with one broadcast group of 4
// activation codes per row and adds them into 16 int32 sums; a block of 32 k is 8 of them,
// then the block's int32 sums are scaled (weight scale x activation scale) into fp32.
//
// VPDPBUSD takes one operand unsigned: weights are stored as code + 128 (u8, 1..255) and the
// activations stay signed, so each block's sum carries 128 x (the sum of the row's activation
// codes in the block): the block's int32 sums start from -128 x that sum (computed when the
// activations are quantized, per row, not per output), a broadcast instead of a subtraction per
// output vector, which matters where the kernel is bound by its arithmetic (8 rows).
//
// Layout (pack_q8): for each 16-output tile, for each 32-k block, 8 lines of 64 bytes, line q
// holding k = 4q..4q+3 of the 16 outputs ([16][4] bytes): one tile is one contiguous stream.
// Scales: [tiles][blocks][16] fp16. The PyTorch reference of the whole product is
// models/quantize.py `q8_linear_reference`.
//
// Where the CPU has AMX-INT8, the dot products of 3 or more rows run on tiles instead (below):
// the same layout is AMX's B tile, and one TDPBSUD takes up to 16 rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "bf16_simd.h"

namespace avx512 {

#include "common.h"

namespace {

constexpr int64_t kBlock = 32;         // weights (and activations) per scale
// The codes are not prefetched by hand: the hardware prefetchers follow each tile's stream
// (a prefetch 8 lines ahead was 7-12% slower at 1-8 rows on a Zen 4, SmolLM2's 121 matrices).
// The scales are, this many blocks ahead: a tile's scales are a short stream of their own
// (half a line a block) the hardware does not pick up (-2% at 1 row, -9% at 8).
constexpr int64_t kScalesAhead = 16;

// One row's 32-k blocks to codes (round to nearest), scale = max|x| / 127, and the codes' sum.
void quantize_row(const uint16_t* x, int64_t K, int8_t* q, float* scale, int32_t* sum) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const __m512 lo = load_bf16(x + b * kBlock), hi = load_bf16(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vinv));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vinv));
    _mm_storeu_si128((__m128i*)(q + b * kBlock), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128((__m128i*)(q + b * kBlock + 16), _mm512_cvtsepi32_epi8(qhi));
    scale[b] = amax / 127.f;
    sum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
  }
}

struct Activations {
  std::vector<int8_t> codes;    // [M, K]
  std::vector<float> scales;    // [M, K / 32]
  std::vector<int32_t> sums;    // [M, K / 32]
};

// `rows` >= M: the rows past M are zeros (codes, scales, sums), for whole AMX tiles.
Activations quantize_rows(const uint16_t* x, int64_t M, int64_t K, int64_t rows) {
  const int64_t nb = K / kBlock;
  Activations a{std::vector<int8_t>(rows * K), std::vector<float>(rows * nb),
                std::vector<int32_t>(rows * nb)};
  for (int64_t m = 0; m < M; ++m)
    quantize_row(x + m * K, K, a.codes.data() + m * K, a.scales.data() + m * nb,
                 a.sums.data() + m * nb);
  return a;
}

// M rows x R consecutive tiles (16 outputs each) over all K.
template <int M, int R>
inline void q8_tiles(const uint8_t* w, const uint16_t* ws, int64_t nb, const Activations& a,
                     int64_t m0, int64_t K, const uint16_t* bias, at::BFloat16* y, int64_t N,
                     int64_t tile) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const int8_t* xq = a.codes.data() + m0 * K;
  const float* xs = a.scales.data() + m0 * nb;
  const int32_t* xsum = a.sums.data() + m0 * nb;
  for (int64_t b = 0; b < nb; ++b) {
    __m512i dot[M][R];
    for (int m = 0; m < M; ++m) {
      const __m512i start = _mm512_set1_epi32(-128 * xsum[m * nb + b]);  // the +128's share
      for (int r = 0; r < R; ++r) dot[m][r] = start;
    }
    for (int64_t q = 0; q < kBlock / 4; ++q) {
      __m512i wv[R];
      for (int r = 0; r < R; ++r) {
        wv[r] = _mm512_loadu_si512(w + (((tile + r) * nb + b) * 8 + q) * 64);
      }
      for (int m = 0; m < M; ++m) {
        int32_t group;
        std::memcpy(&group, xq + m * K + b * kBlock + q * 4, 4);
        const __m512i xb = _mm512_set1_epi32(group);
        for (int r = 0; r < R; ++r) dot[m][r] = _mm512_dpbusd_epi32(dot[m][r], wv[r], xb);
      }
    }
    __m512 sw[R];
    for (int r = 0; r < R; ++r) {  // an address, not a pointer: it may pass the end (never faults)
      const uintptr_t ahead = uintptr_t(ws) + ((tile + r) * nb + b + kScalesAhead) * 32;
      _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
    }
    for (int r = 0; r < R; ++r)
      sw[r] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(ws + ((tile + r) * nb + b) * 16)));
    for (int m = 0; m < M; ++m) {
      const __m512 sx = _mm512_set1_ps(xs[m * nb + b]);
      for (int r = 0; r < R; ++r) {
        const __m512 exact = _mm512_cvtepi32_ps(dot[m][r]);
        acc[m][r] = _mm512_fmadd_ps(exact, _mm512_mul_ps(sw[r], sx), acc[m][r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t n0 = (tile + r) * 16;
    const __mmask16 mask = tail_mask(N - n0);
    const __m512 bv = bias ? load_bf16_masked(bias + n0, mask) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m)
      store_bf16_masked(y + (m0 + m) * N + n0, _mm512_add_ps(acc[m][r], bv), mask);
  }
}

template <int M>
void q8_rows(const uint8_t* w, const uint16_t* ws, int64_t nb, const Activations& a, int64_t m0,
             int64_t K, const uint16_t* bias, at::BFloat16* y, int64_t N) {
  // M x R int32 sums + M x R fp32 sums + R weight lines + R scales within 32 registers.
  constexpr int R = M == 1 ? 6 : (M == 2 ? 4 : (M <= 4 ? 2 : 1));
  const int64_t tiles = (N + 15) / 16, groups = (tiles + R - 1) / R;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t tile = g * R;
      if (tile + R <= tiles) {
        q8_tiles<M, R>(w, ws, nb, a, m0, K, bias, y, N, tile);
      } else {
        for (int64_t t = tile; t < tiles; ++t) q8_tiles<M, 1>(w, ws, nb, a, m0, K, bias, y, N, t);
      }
    }
  });
}

// ---- The same product on AMX-INT8 tiles ----------------------------------------------------
//
// A block of pack_q8 (8 lines of [16 outputs][4 k] bytes) is an AMX B tile for 8-bit dot
// products as it lies: 8 rows of 64 bytes. TDPBSUD multiplies an A tile of up to 16 rows' signed
// activation codes (32 k each, stride K) with it into 16 rows x 16 outputs of int32 sums: every
// row for the price of one, where VNNI needs 8 VPDPBUSD per row per block and tile. The sums
// cannot run on past a block (each block has its own scales), so each block's C tiles are
// stored and scaled into fp32 sums with AVX512 as the VNNI path does, the +128 correction
// included. Measured on SmolLM2's 121 matrices (a 2-core Xeon with AMX, interleaved, against
// VNNI): 8.3 vs 10.6 ms at 8 rows, 10.2 vs 17.7 at 16, 16.8 vs 27.1 at 32, 6.4 vs 6.7 at 3;
// at 2 rows VNNI is faster (6.8 vs 7.0: the weights' bandwidth bounds both).
bool amx_int8_on = false;
constexpr int64_t kAmxInt8MinRows = 3;
std::atomic<int64_t> amx_int8_calls{0};  // products run on the tiles (for the tests)

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
constexpr bool kAmxInt8Built = true;
// Blocks ahead that each tile's stream is prefetched into L1 (the tile loads do not draw the
// hardware prefetchers along as well as vector loads): 4 was 3-8% faster than none at 8-16
// rows, 2 and 8 in between.
constexpr int64_t kAmxAhead = 4;

// Rows m0..m0+M (M <= 16; the tiles hold the configured rows, those past M zeros) x R <= 2
// consecutive tiles over all K. tmm0: A = the rows' codes of a block [rows, 32]; tmm1, tmm2: B =
// the tiles' block; C sums in tmm4, tmm5 for even blocks and tmm6, tmm7 for odd ones, so the
// next block's dot products run while this block's sums are scaled (2.5-8% faster than 3 tiles
// a pass with one set of C tiles).
template <int R>
void q8_amx_tiles(const uint8_t* w, const uint16_t* ws, int64_t nb, const Activations& a,
                  int64_t m0, int64_t M, int64_t K, const uint16_t* bias, at::BFloat16* y,
                  int64_t N, int64_t tile) {
  static_assert(R == 1 || R == 2);
  alignas(64) float acc[R][16][16] = {};  // [tile][row][output]
  alignas(64) int32_t dot[R][16][16];
  const int8_t* xq = a.codes.data() + m0 * K;
  const float* xs = a.scales.data() + m0 * nb;
  const int32_t* xsum = a.sums.data() + m0 * nb;
  auto issue = [&](int64_t b, auto odd) {  // block b's dot products into its C tiles
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < 8; ++l) {  // an address, not a pointer: it may pass the end
        const uintptr_t ahead = uintptr_t(w) + ((tile + r) * nb + b + kAmxAhead) * 512 + l * 64;
        _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
      }
    _tile_loadd(0, xq + b * kBlock, K);
    _tile_loadd(1, w + (tile * nb + b) * 512, 64);
    if (R > 1) _tile_loadd(2, w + ((tile + 1) * nb + b) * 512, 64);
    if constexpr (decltype(odd)::value) {  // (tile registers are immediates)
      _tile_zero(6);
      _tile_dpbsud(6, 0, 1);
      if (R > 1) {
        _tile_zero(7);
        _tile_dpbsud(7, 0, 2);
      }
    } else {
      _tile_zero(4);
      _tile_dpbsud(4, 0, 1);
      if (R > 1) {
        _tile_zero(5);
        _tile_dpbsud(5, 0, 2);
      }
    }
  };
  auto finish = [&](int64_t b, auto odd) {  // block b's int32 sums scaled into acc
    if constexpr (decltype(odd)::value) {
      _tile_stored(6, dot[0], 64);
      if (R > 1) _tile_stored(7, dot[1], 64);
    } else {
      _tile_stored(4, dot[0], 64);
      if (R > 1) _tile_stored(5, dot[1], 64);
    }
    __m512 sw[R];
    for (int r = 0; r < R; ++r) {
      const uintptr_t ahead = uintptr_t(ws) + ((tile + r) * nb + b + kScalesAhead) * 32;
      _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
      sw[r] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(ws + ((tile + r) * nb + b) * 16)));
    }
    for (int64_t m = 0; m < M; ++m) {
      const __m512 sx = _mm512_set1_ps(xs[m * nb + b]);
      const __m512i start = _mm512_set1_epi32(-128 * xsum[m * nb + b]);  // the +128's share
      for (int r = 0; r < R; ++r) {
        const __m512i exact = _mm512_add_epi32(_mm512_load_si512(dot[r][m]), start);
        _mm512_store_ps(acc[r][m], _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact),
                                                   _mm512_mul_ps(sw[r], sx),
                                                   _mm512_load_ps(acc[r][m])));
      }
    }
  };
  const std::integral_constant<bool, false> even;
  const std::integral_constant<bool, true> odd;
  issue(0, even);
  for (int64_t b = 0; b < nb; b += 2) {
    if (b + 1 < nb) issue(b + 1, odd);
    finish(b, even);
    if (b + 1 < nb) {
      if (b + 2 < nb) issue(b + 2, even);
      finish(b + 1, odd);
    }
  }
  for (int r = 0; r < R; ++r) store_tile_bf16(acc[r], M, bias, y + m0 * N, N, (tile + r) * 16);
}

// All M rows in chunks of 16 (a's rows padded to whole chunks past 16); a pair's tiles (2 x
// K/32 x 512 bytes, <= 48 KB for K <= 1,536) stay in L2 across the chunks.
void q8_amx_run(const uint8_t* w, const uint16_t* ws, int64_t nb, const Activations& a,
                int64_t M, int64_t K, const uint16_t* bias, at::BFloat16* y, int64_t N) {
  constexpr int R = 2;  // 1 A + 2 B + 2 x 2 C of the 8 tile registers
  const int64_t chunks = (M + 15) / 16, rows = M <= 16 ? M : 16;
  const int64_t tiles = (N + 15) / 16, groups = (tiles + R - 1) / R;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    amx::TileConfig cfg;  // tile shapes are per thread state
    cfg.rows[0] = uint8_t(rows), cfg.colsb[0] = kBlock;
    for (int t = 1; t <= 2; ++t) cfg.rows[t] = kBlock / 4, cfg.colsb[t] = 64;
    for (int t = 4; t <= 7; ++t) cfg.rows[t] = uint8_t(rows), cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t tile = g * R;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t m0 = c * 16, valid = std::min<int64_t>(16, M - m0);
        if (tile + R <= tiles) {
          q8_amx_tiles<R>(w, ws, nb, a, m0, valid, K, bias, y, N, tile);
        } else {
          q8_amx_tiles<1>(w, ws, nb, a, m0, valid, K, bias, y, N, tile);
        }
      }
    }
    _tile_release();
  });
}
#else
constexpr bool kAmxInt8Built = false;
void q8_amx_run(const uint8_t*, const uint16_t*, int64_t, const Activations&, int64_t, int64_t,
                const uint16_t*, at::BFloat16*, int64_t) {}
#endif

}  // namespace

// Turned on or off by cpu_decode.cpp's set_amx; stays off where the build, the CPU or the OS
// cannot run it.
bool set_amx_int8(bool enabled) {
  amx_int8_on = enabled && kAmxInt8Built && amx::cpu_has(amx::kInt8) && amx::request_tile_state();
  return amx_int8_on;
}

bool amx_int8_enabled() { return amx_int8_on; }

int64_t amx_int8_count() { return amx_int8_calls.load(std::memory_order_relaxed); }

// y [M, N] bf16 = x [M, K] bf16 @ W^T (+ bias bf16 [N]) with W as pack_q8 gives it; any M >= 1
// (8 rows per pass over the weights on VNNI, 16 per tile on AMX).
torch::Tensor linear_q8(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t N,
                        c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "contiguous bf16 [M, K] input");
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  TORCH_CHECK(M >= 1 && K % kBlock == 0, "at least one row, K a multiple of 32");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == torch::kUInt8 &&
                  packed.size(0) == (N + 15) / 16 && packed.size(1) == nb,
              "packed weight does not match x or N");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat16 && scales.numel() == packed.size(0) * nb * 16,
              "fp16 scales of the packed weight");
  const uint16_t* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N, "bf16 [N] bias");
    b = reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>());
  }
  const bool tiles = amx_int8_on && M >= kAmxInt8MinRows;
  const int64_t rows = tiles && M > 16 ? (M + 15) / 16 * 16 : M;
  const Activations a =
      quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, rows);
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  at::BFloat16* out = y.data_ptr<at::BFloat16>();
  if (tiles) {
    amx_int8_calls.fetch_add(1, std::memory_order_relaxed);
    q8_amx_run(w, ws, nb, a, M, K, b, out, N);
    return y;
  }
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    switch (std::min<int64_t>(8, M - m0)) {
      case 1: q8_rows<1>(w, ws, nb, a, m0, K, b, out, N); break;
      case 2: q8_rows<2>(w, ws, nb, a, m0, K, b, out, N); break;
      case 3: q8_rows<3>(w, ws, nb, a, m0, K, b, out, N); break;
      case 4: q8_rows<4>(w, ws, nb, a, m0, K, b, out, N); break;
      case 5: q8_rows<5>(w, ws, nb, a, m0, K, b, out, N); break;
      case 6: q8_rows<6>(w, ws, nb, a, m0, K, b, out, N); break;
      case 7: q8_rows<7>(w, ws, nb, a, m0, K, b, out, N); break;
      default: q8_rows<8>(w, ws, nb, a, m0, K, b, out, N); break;
    }
  }
  return y;
}

}  // namespace avx512
