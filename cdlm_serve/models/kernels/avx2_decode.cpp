// Fused bf16 ops for decoding a few tokens at a time on AVX2 CPUs (x86-64-v3: AVX2, FMA, F16C;
// no AVX512): the same ops, arguments and results as cpu_decode.cpp's AVX512 build, picked at
// run time where the CPU lacks AVX512-BF16 (models/kernels/__init__.py).
//
// AVX2 has no bf16 dot product: bf16 weights are widened to fp32 in registers (a bf16 is the
// high half of an fp32) and multiplied with FMA in fp32, so the bytes streamed are bf16's (half
// of fp32's) while the arithmetic is fp32's. Decoding is bound by how fast the weights stream
// from memory at one row and by the FMAs at eight; the kernels are shaped for both: the packed
// layout (pack_bf16, shared with the AVX512 build) puts a k-pair of 16 outputs in one 64-byte
// line, read as two vectors of 8 outputs whose even and odd k come apart with one shift and one
// and; every row's activation pair is broadcast against them.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <functional>
#include <type_traits>
#include <vector>

#include "avx2_simd.h"

namespace avx2 {

constexpr const char* kIsa = "avx2";

#include "common.h"

// ---- Row-major small-M linear ----------------------------------------------------------------
//
// W [N, K] as it lies: 16 consecutive bf16 of a row are one 32-byte load, whose words are
// (k, k + 1) pairs: shifted left by 16 bits they are the even k in fp32, masked to their high
// halves the odd k. The activations are widened once, each 16 k as their 8 even then their 8
// odd values (`widen_pairs`), so one FMA per half multiplies them lane for lane: a load, two
// integer ops and two FMAs per 16 weights and row, as the packed kernel's, plus one horizontal
// sum per output at the end.
namespace {

// Where `widen_pairs` puts activation k within its row.
inline int64_t pair_slot(int64_t k) { return (k / 16) * 16 + (k % 2) * 8 + (k % 16) / 2; }

// x [M, K] bf16 -> fp32 rows of `ld` floats (K rounded up to 16): each 16 k as x[k], x[k + 2],
// ..., x[k + 14], then x[k + 1], ..., x[k + 15]; zeros past K.
std::vector<float> widen_pairs(const uint16_t* x, int64_t M, int64_t K, int64_t ld) {
  std::vector<float> out(M * ld, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k)
      out[m * ld + pair_slot(k)] = bf16_to_float(x[m * K + k]);
  return out;
}

// R outputs (weight rows) x M <= 4 activation rows over all K; activations as `widen_pairs`
// gives them, rows `ldx` apart. The even and odd k sum apart (twice the independent FMA
// chains: at one row, four outputs' chains alone leave the FMA units waiting on latency), in
// the same order whatever M and R: a row's output does not depend on the rows beside it.
// A K that is not a multiple of 16 ends in scalar code (no model's is; it keeps the loop free
// of anything that would send the accumulators to memory).
template <int M, int R>
inline void row_block(const uint16_t* w, int64_t K, const float* x, int64_t ldx, float out[M][R]) {
  const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  __m256 acc[M][R], odd[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = odd[m][r] = _mm256_setzero_ps();
  const int64_t whole = K / 16 * 16;
  for (int64_t k = 0; k < whole; k += 16) {
    __m256 xe[M], xo[M];  // loaded once for the R outputs: the load ports are what bound it
    for (int m = 0; m < M; ++m) {
      xe[m] = _mm256_loadu_ps(x + m * ldx + k);
      xo[m] = _mm256_loadu_ps(x + m * ldx + k + 8);
    }
    for (int r = 0; r < R; ++r) {
      const __m256i wv = _mm256_loadu_si256((const __m256i*)(w + r * K + k));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(wv, high));
      for (int m = 0; m < M; ++m) {
        acc[m][r] = _mm256_fmadd_ps(we, xe[m], acc[m][r]);
        odd[m][r] = _mm256_fmadd_ps(wo, xo[m], odd[m][r]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m][r] = hsum(_mm256_add_ps(acc[m][r], odd[m][r]));
  for (int64_t k = whole; k < K; ++k)  // the scalar tail
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r)
        out[m][r] += bf16_to_float(w[r * K + k]) * x[m * ldx + pair_slot(k)];
}

// Outputs [begin, end) of every row, R at a time. Not inlined into the parallel loop's
// lambda: there GCC kept row_block's accumulators in memory, a store per FMA.
template <int M>
__attribute__((noinline)) void row_range(const uint16_t* w, const float* x, int64_t ldx,
                                         const uint16_t* bias, at::BFloat16* y, int64_t N,
                                         int64_t K, int64_t begin, int64_t end) {
  // The accumulators (2 M R) within the 16 vector registers.
  constexpr int R = M == 1 ? 4 : (M == 2 ? 2 : 1);
  float out[M][R];
  float one[M][1];
  int64_t n = begin;
  for (; n + R <= end; n += R) {
    row_block<M, R>(w + n * K, K, x, ldx, out);
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r)
        y[m * N + n + r] = at::BFloat16(out[m][r] + (bias ? bf16_to_float(bias[n + r]) : 0.f));
  }
  for (; n < end; ++n) {
    row_block<M, 1>(w + n * K, K, x, ldx, one);
    for (int m = 0; m < M; ++m)
      y[m * N + n] = at::BFloat16(one[m][0] + (bias ? bf16_to_float(bias[n]) : 0.f));
  }
}

template <int M>
void row_run(const uint16_t* w, const float* x, int64_t ldx, const uint16_t* bias,
             at::BFloat16* y, int64_t N, int64_t K) {
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    row_range<M>(w, x, ldx, bias, y, N, K, begin, end);
  });
}

inline int64_t padded8(int64_t k) { return (k + 7) / 8 * 8; }

}  // namespace

// x: [M, K] bf16 contiguous, M >= 1 (4 rows per pass); weight: [N, K] bf16 contiguous; bias: [N]
// or empty.
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "shape mismatch");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "bf16 only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous inputs only");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), ld = (K + 15) / 16 * 16;
  TORCH_CHECK(M >= 1, "at least one row");
  auto y = torch::empty({M, N}, x.options());
  auto w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const std::vector<float> xf =
      widen_pairs(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, ld);
  const uint16_t* b = bias_ptr(bias, N);
  auto out = y.data_ptr<at::BFloat16>();
  // 4 rows a pass (their 2 x 4 accumulators fill the registers; more rows stream W again).
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const float* xm = xf.data() + m0 * ld;
    at::BFloat16* ym = out + m0 * N;
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: row_run<1>(w, xm, ld, b, ym, N, K); break;
      case 2: row_run<2>(w, xm, ld, b, ym, N, K); break;
      case 3: row_run<3>(w, xm, ld, b, ym, N, K); break;
      default: row_run<4>(w, xm, ld, b, ym, N, K); break;
    }
  }
  return y;
}

// ---- RMSNorm, SwiGLU, RoPE ---------------------------------------------------------------------
// One row of RMSNorm with HF's rounding order: normalize in fp32, round to bf16, then multiply
// by the bf16 weight and round again.
void norm_row(const uint16_t* x, const uint16_t* w, at::BFloat16* y, int64_t K, float eps) {
  __m256 ss = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 v = load8_any(x + k, K - k);
    ss = _mm256_fmadd_ps(v, v, ss);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(hsum(ss) / K + eps));
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 normed = round_bf16(_mm256_mul_ps(load8_any(x + k, K - k), inv));
    store8_any(y + k, _mm256_mul_ps(normed, load8_any(w + k, K - k)), K - k);
  }
}

// h = x + r (rounded to bf16, as the unfused add would be), y = RMSNorm(h) * w. Returns {y, h}.
std::vector<torch::Tensor> add_rms_norm_bf16(torch::Tensor x, torch::Tensor r, torch::Tensor w,
                                             double eps) {
  check_add_rms_norm(x, r, w);
  auto h = torch::empty_like(x);
  auto y = torch::empty_like(x);
  const int64_t K = x.size(1);
  auto xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto rp = reinterpret_cast<const uint16_t*>(r.data_ptr<at::BFloat16>());
  auto hp = h.data_ptr<at::BFloat16>();
  auto wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto hraw = reinterpret_cast<const uint16_t*>(hp);
  auto yp = y.data_ptr<at::BFloat16>();
  over_rows(x.size(0), [&](int64_t m0, int64_t m1) {
    for (int64_t i = m0 * K, end = m1 * K; i < end; i += 8)
      store8_any(hp + i, _mm256_add_ps(load8_any(xp + i, end - i), load8_any(rp + i, end - i)),
                 end - i);
    for (int64_t m = m0; m < m1; ++m) norm_row(hraw + m * K, wp, yp + m * K, K, float(eps));
  });
  return {y, h};
}

// gu [M, 2I] (gate then up) -> silu(gate) * up [M, I], in fp32, rounded once.
torch::Tensor silu_mul_bf16(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0, "contiguous [M, 2I]");
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  auto y = torch::empty({M, I}, gu.options());
  auto gp = reinterpret_cast<const uint16_t*>(gu.data_ptr<at::BFloat16>());
  auto yp = y.data_ptr<at::BFloat16>();
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* g = gp + m * 2 * I;
    const uint16_t* u = g + I;
    for (int64_t i = 0; i < I; i += 8) {
      const __m256 gv = load8_any(g + i, I - i), uv = load8_any(u + i, I - i);
      const __m256 silu =
          _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
      store8_any(yp + m * I + i, _mm256_mul_ps(silu, uv), I - i);
    }
  }
  return y;
}

// gu [M, 2I] (gate then up) -> gelu_tanh(gate) * up [M, I] (Gemma's GeGLU), in fp32, rounded
// once: gelu_tanh(g) = g / 2 (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), and
// 1 + tanh(z) = 2 - 2 / (exp(2z) + 1), exact at both ends (exp8 clamps, never overflows).
torch::Tensor gelu_mul_bf16(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0, "contiguous [M, 2I]");
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  auto y = torch::empty({M, I}, gu.options());
  auto gp = reinterpret_cast<const uint16_t*>(gu.data_ptr<at::BFloat16>());
  auto yp = y.data_ptr<at::BFloat16>();
  const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
  const __m256 c = _mm256_set1_ps(0.7978845608028654f), k = _mm256_set1_ps(0.044715f);
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* g = gp + m * 2 * I;
    const uint16_t* u = g + I;
    for (int64_t i = 0; i < I; i += 8) {
      const __m256 gv = load8_any(g + i, I - i), uv = load8_any(u + i, I - i);
      const __m256 inner = _mm256_mul_ps(
          c, _mm256_fmadd_ps(_mm256_mul_ps(k, gv), _mm256_mul_ps(gv, gv), gv));  // z
      const __m256 e = exp8(_mm256_add_ps(inner, inner));                      // exp(2z)
      const __m256 plus = _mm256_sub_ps(two, _mm256_div_ps(two, _mm256_add_ps(e, one)));
      const __m256 gelu = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), gv), plus);
      store8_any(yp + m * I + i, _mm256_mul_ps(gelu, uv), I - i);
    }
  }
  return y;
}

// Rotate, in place, the first n_heads heads of each row of qkv [M, W] with "rotate half" RoPE;
// cos/sin [M, D] bf16. Computed in fp32, rounded once.
void rope_inplace_bf16(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t n_heads,
                       int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(),
              "contiguous inputs");
  const int64_t M = qkv.size(0), W = qkv.size(1), half = head_dim / 2;
  TORCH_CHECK(n_heads * head_dim <= W && half % 16 == 0, "head_dim must be a multiple of 32");
  TORCH_CHECK(cos.size(0) == M && sin.size(0) == M, "one cos/sin row per qkv row");
  auto qp = reinterpret_cast<uint16_t*>(qkv.data_ptr<at::BFloat16>());
  auto cp = reinterpret_cast<const uint16_t*>(cos.data_ptr<at::BFloat16>());
  auto sp = reinterpret_cast<const uint16_t*>(sin.data_ptr<at::BFloat16>());
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* c = cp + m * head_dim;
    const uint16_t* s = sp + m * head_dim;
    for (int64_t h = 0; h < n_heads; ++h) {
      uint16_t* x = qp + m * W + h * head_dim;
      for (int64_t i = 0; i < half; i += 8) {
        const __m256 x1 = load8(x + i), x2 = load8(x + half + i);
        // out1 = x1 cos1 - x2 sin1; out2 = x2 cos2 + x1 sin2
        const __m256 o1 = _mm256_fnmadd_ps(x2, load8(s + i), _mm256_mul_ps(x1, load8(c + i)));
        const __m256 o2 =
            _mm256_fmadd_ps(x1, load8(s + half + i), _mm256_mul_ps(x2, load8(c + half + i)));
        _mm_storeu_si128((__m128i*)(x + i), bf16x8(o1));
        _mm_storeu_si128((__m128i*)(x + half + i), bf16x8(o2));
      }
    }
  }
}

// ---- Attention over the KV cache ---------------------------------------------------------------
namespace {

const __m256 kLaneIndex = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);

// The mask vector of the lanes whose bits are set.
inline __m256 mask_of(uint32_t bits) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i set = _mm256_and_si256(_mm256_set1_epi32(int(bits)), bit);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(set, bit));
}

// The lanes below `n` (n <= 8 of them).
inline __m256 first_lanes(int64_t n) {
  return _mm256_cmp_ps(kLaneIndex, _mm256_set1_ps(float(n)), _CMP_LT_OQ);
}

}  // namespace

// Queries against cached keys: query t reads cache row rows[t], slots [0, lens[t]). q [T, H, D]
// (heads contiguous, any row stride); k/v [B, Hkv, S, D] bf16; optional bias [B, Hkv, S] fp32
// added to the scores (Attention Matching's beta). GQA: query head h reads KV head
// h / (H / Hkv). Returns [T, H * D] bf16. Scores and softmax in fp32. Several queries may read
// one row (a prompt's tokens, each up to its own slot: causal attention within the prompt).
torch::Tensor attend_rows(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const std::vector<int64_t>& rows, const std::vector<int64_t>& lens,
                          double scale, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4, "q [T, H, D], k/v [B, Hkv, S, D]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t B = k.size(0), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, "q heads must be contiguous");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && D % 32 == 0, "contiguous cache, D % 32");
  TORCH_CHECK((int64_t)lens.size() == T && (int64_t)rows.size() == T && H % Hkv == 0,
              "one row and one length per query; H % Hkv == 0");
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(rows[t] >= 0 && rows[t] < B && lens[t] >= 1 && lens[t] <= S,
                "rows and lengths within the cache");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->size(0) == B && bias->size(2) == S, "bias [B, Hkv, S] fp32");
    bp = bias->data_ptr<float>();
  }
  TORCH_CHECK(D <= 256, "head_dim <= 256");
  auto out = torch::empty({T, H * D}, q.options());
  auto qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  auto vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  auto op = out.data_ptr<at::BFloat16>();
  const int64_t group = H / Hkv, qstride = q.stride(0);
  const __m256 vscale = _mm256_set1_ps(float(scale));
  at::parallel_for(0, T * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p;
    std::vector<uint8_t> seen;  // per block of 8 keys: those attended to
    alignas(32) float qf[256];
    for (int64_t th = begin; th < end; ++th) {
      const int64_t t = th / H, h = th % H, g = h / group, b = rows[t], L = lens[t];
      const uint16_t* qh = qp + t * qstride + h * D;
      const uint16_t* kh = kp + (b * Hkv + g) * S * D;
      const uint16_t* vh = vp + (b * Hkv + g) * S * D;
      const float* bh = bp ? bp + (b * Hkv + g) * S : nullptr;
      for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(qf + d, load8(qh + d));
      const int64_t blocks = (L + 7) / 8;
      p.resize(blocks * 8);
      seen.resize(blocks);
      // Scores 8 keys at a time, then one transposing reduction for the 8. A key whose bias
      // is -inf is the padding of non-uniform budgets (engine/sessions/ragged.py): its probability is
      // exactly 0, so neither it nor its value is read.
      const __m256 hidden = _mm256_set1_ps(-INFINITY);
      __m256 mx = hidden;
      for (int64_t j0 = 0; j0 < L; j0 += 8) {
        const __m256 live = first_lanes(L - j0);
        const __m256 beta =
            bh ? _mm256_maskload_ps(bh + j0, _mm256_castps_si256(live)) : _mm256_setzero_ps();
        const __m256 shown = bh ? _mm256_and_ps(live, _mm256_cmp_ps(beta, hidden, _CMP_NEQ_UQ)) : live;
        const uint32_t keys = lanes(shown);
        seen[j0 / 8] = uint8_t(keys);
        if (!keys) {
          _mm256_storeu_ps(p.data() + j0, hidden);
          continue;
        }
        __m256 part[8];
        for (int i = 0; i < 8; ++i) {
          __m256 acc = _mm256_setzero_ps();
          if (keys >> i & 1) {
            const uint16_t* key = kh + (j0 + i) * D;
            for (int64_t d = 0; d < D; d += 8)
              acc = _mm256_fmadd_ps(load8(key + d), _mm256_load_ps(qf + d), acc);
          }
          part[i] = acc;
        }
        __m256 sc = _mm256_add_ps(_mm256_mul_ps(sum8(part), vscale), beta);
        sc = _mm256_blendv_ps(hidden, sc, shown);
        _mm256_storeu_ps(p.data() + j0, sc);
        mx = _mm256_max_ps(mx, sc);
      }
      const __m256 top = _mm256_set1_ps(hmax(mx));
      __m256 total = _mm256_setzero_ps();
      for (int64_t j0 = 0; j0 < L; j0 += 8) {
        if (!seen[j0 / 8]) continue;
        const __m256 e = _mm256_and_ps(
            mask_of(seen[j0 / 8]), exp8(_mm256_sub_ps(_mm256_loadu_ps(p.data() + j0), top)));
        _mm256_storeu_ps(p.data() + j0, e);
        total = _mm256_add_ps(total, e);
      }
      // Weighted values, 64 output dims (8 vectors) at a time: each key's probability
      // broadcast once for the 8.
      const __m256 inv = _mm256_set1_ps(1.0f / hsum(total));
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int64_t C = std::min<int64_t>(8, (D - d0) / 8);
        __m256 acc[8];
        for (int64_t c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
        for (int64_t j0 = 0; j0 < L; j0 += 8) {
          for (uint32_t keys = seen[j0 / 8]; keys; keys &= keys - 1) {
            const int64_t j = j0 + __builtin_ctz(keys);
            const __m256 pj = _mm256_set1_ps(p[j]);
            const uint16_t* value = vh + j * D + d0;
            for (int64_t c = 0; c < C; ++c)
              acc[c] = _mm256_fmadd_ps(pj, load8(value + 8 * c), acc[c]);
          }
        }
        for (int64_t c = 0; c < C; ++c)
          store8(op + t * H * D + h * D + d0 + 8 * c, _mm256_mul_ps(acc[c], inv));
      }
    }
  });
  return out;
}

// ---- argmax ------------------------------------------------------------------------------------
namespace {

// First index of the largest of n values, 8 lanes at a time: each lane keeps its first maximum
// (strict >), then the smallest index among the lanes that hold the overall maximum.
template <typename Load>
int64_t argmax_row(int64_t n, Load load, const std::function<float(int64_t)>& at) {
  __m256 best = _mm256_set1_ps(-INFINITY);
  __m256i best_i = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i eight = _mm256_set1_epi32(8);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load(i);
    const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, gt);
    best_i = _mm256_blendv_epi8(best_i, idx, _mm256_castps_si256(gt));
    idx = _mm256_add_epi32(idx, eight);
  }
  alignas(32) float bv[8];
  alignas(32) int32_t bi[8];
  _mm256_store_ps(bv, best);
  _mm256_store_si256((__m256i*)bi, best_i);
  float top = -INFINITY;
  int64_t arg = 0;
  for (int l = 0; l < 8 && l < n; ++l)
    if (bv[l] > top || (bv[l] == top && bi[l] < arg)) top = bv[l], arg = bi[l];
  for (; i < n; ++i)  // the tail comes after every vector index: strict > keeps the first
    if (at(i) > top) top = at(i), arg = i;
  return arg;
}

}  // namespace

// Row-wise argmax of [M, V] bf16 or fp32 (first index on ties, like torch.argmax). NaN-free
// input assumed.
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2, "[M, V]");
  if (x.scalar_type() != at::kBFloat16) x = x.to(at::kFloat);
  x = x.contiguous();
  const int64_t M = x.size(0), V = x.size(1);
  TORCH_CHECK(V >= 1 && V < (int64_t(1) << 31), "1 <= V < 2^31");
  auto out = torch::empty({M}, x.options().dtype(at::kLong));
  auto o = out.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m) {
    if (x.scalar_type() == at::kBFloat16) {
      const uint16_t* row = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + m * V;
      o[m] = argmax_row(V, [&](int64_t i) { return load8(row + i); },
                        [&](int64_t i) { return bf16_to_float(row[i]); });
    } else {
      const float* row = x.data_ptr<float>() + m * V;
      o[m] = argmax_row(V, [&](int64_t i) { return _mm256_loadu_ps(row + i); },
                        [&](int64_t i) { return row[i]; });
    }
  }
  return out;
}

// ---- KVzip's key scores: common.h's repeat_max_with, in 8-float vectors --------------------------
namespace {

// log sum_j exp(row[j]) over C floats: the row's maximum, then the sum of exp(x - max).
inline float row_logsumexp(const float* row, int64_t C) {
  __m256 mx = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= C; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(row + j));
  float top = hmax(mx);
  for (int64_t i = j; i < C; ++i) top = std::max(top, row[i]);
  const __m256 t = _mm256_set1_ps(top);
  __m256 sum = _mm256_setzero_ps();
  for (j = 0; j + 8 <= C; j += 8) sum = _mm256_add_ps(sum, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), t)));
  float total = hsum(sum);
  for (int64_t i = j; i < C; ++i) total += std::exp(row[i] - top);
  return top + std::log(total);
}

// best[j0, j1) = max(best, max_r s[r, j] - lse[r]) for j1 - j0 <= 64: eight vectors of columns
// down all M rows (each row's 256 bytes are four whole cache lines); a shorter last chunk
// column by column.
inline void col_max(const float* s, int64_t M, int64_t ld, const float* lse, int64_t j0, int64_t j1,
                    float* best) {
  if (j1 - j0 < 64) {
    for (int64_t j = j0; j < j1; ++j) {
      float b = best[j];
      for (int64_t r = 0; r < M; ++r) b = std::max(b, s[r * ld + j] - lse[r]);
      best[j] = b;
    }
    return;
  }
  __m256 acc[8];
  for (int u = 0; u < 8; ++u) acc[u] = _mm256_loadu_ps(best + j0 + 8 * u);
  for (int64_t r = 0; r < M; ++r) {
    const __m256 l = _mm256_set1_ps(lse[r]);
    const float* row = s + r * ld + j0;
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_max_ps(acc[u], _mm256_sub_ps(_mm256_loadu_ps(row + 8 * u), l));
  }
  for (int u = 0; u < 8; ++u) _mm256_storeu_ps(best + j0 + 8 * u, acc[u]);
}

}  // namespace

// best [region] (fp32, in place) from fp32 queries q [N, D], keys [C, D] and bias [C] (no bf16
// dot products here: a bf16 model's queries and keys come widened).
void repeat_max(torch::Tensor q, torch::Tensor keys, torch::Tensor bias, double scale,
                int64_t region, torch::Tensor best) {
  repeat_max_fp32(q, keys, bias, scale, region, best, row_logsumexp, col_max);
}

// ---- Packed small-M linear ---------------------------------------------------------------------
//
// pack_bf16's layout ([N/16][K/2][16] words, word (t, kp, c) = W[16t + c, 2kp .. 2kp + 1]): one
// 64-byte line holds a k-pair of 16 outputs. Each half line is 8 outputs' pairs: shifted left by
// 16 bits it is their even k in fp32, masked to its high halves their odd k. Every row's x[2kp]
// and x[2kp + 1] (fp32, widened once) are broadcast against both, into 8-output accumulators.
// No reductions, and each tile is one contiguous stream.
namespace {

// Lines ahead within a tile's stream, fetched into L2 (T1): 16 lines into L2 was 13% faster
// than 8 into L1 over SmolLM2's decode step (2-core EPYC, AVX2; 12 and 24 in between, 32 less).
constexpr int64_t kPackedPrefetch = 16;

template <int M, int R>
inline void packed_tiles(const uint32_t* p, int64_t K2, const float* x, int64_t ldx,
                         const uint16_t* bias, at::BFloat16* y, int64_t N, int64_t tile) {
  __m256 acc[M][R][2];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r][0] = acc[m][r][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  const uint32_t* base = p + tile * K2 * 16;  // R consecutive tiles, K2 * 16 words apart
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m256 xe[M], xo[M];
    for (int m = 0; m < M; ++m) {
      xe[m] = _mm256_broadcast_ss(x + m * ldx + 2 * kp);
      xo[m] = _mm256_broadcast_ss(x + m * ldx + 2 * kp + 1);
    }
    for (int r = 0; r < R; ++r) {
      const uint32_t* line = base + (r * K2 + kp) * 16;
      _mm_prefetch(reinterpret_cast<const char*>(line + kPackedPrefetch * 16), _MM_HINT_T1);
      for (int half = 0; half < 2; ++half) {
        const __m256i w = _mm256_loadu_si256((const __m256i*)(line + 8 * half));
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(w, high));
        for (int m = 0; m < M; ++m)
          acc[m][r][half] =
              _mm256_fmadd_ps(wo, xo[m], _mm256_fmadd_ps(we, xe[m], acc[m][r][half]));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int half = 0; half < 2; ++half) {
      const int64_t n0 = (tile + r) * 16 + 8 * half;
      if (n0 >= N) continue;
      const __m256 b = bias ? load8_any(bias + n0, N - n0) : _mm256_setzero_ps();
      for (int m = 0; m < M; ++m)
        store8_any(y + m * N + n0, _mm256_add_ps(acc[m][r][half], b), N - n0);
    }
}

// Rows per pass over a tile, and tiles per group, within the 16 vector registers: M * R * 2
// accumulators, 2 * M broadcasts, and the line's vectors.
constexpr int kPackedRows = 3;
template <int M>
constexpr int packed_group() { return M == 1 ? 4 : (M == 2 ? 2 : 1); }

// Calls f(std::integral_constant<int, M>) for 1 <= M <= kPackedRows.
template <typename F>
void with_packed_rows(int64_t M, F&& f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 3>{}); break;
  }
}

// Any M: the rows go in chunks of kPackedRows *within* each group of tiles, so a group's
// weights come from memory once, for the first chunk, and from L1/L2 for the others.
void packed_run(const uint32_t* p, int64_t K2, const float* x, int64_t ldx, int64_t M,
                const uint16_t* bias, at::BFloat16* y, int64_t N) {
  const int64_t tiles = (N + 15) / 16;
  if (M <= kPackedRows) {
    with_packed_rows(M, [&](auto m) {
      constexpr int rows = decltype(m)::value, R = packed_group<rows>();
      const int64_t groups = (tiles + R - 1) / R;
      at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
        for (int64_t g = begin; g < end; ++g) {
          const int64_t tile = g * R;
          if (tile + R <= tiles) {
            packed_tiles<rows, R>(p, K2, x, ldx, bias, y, N, tile);
          } else {
            for (int64_t t = tile; t < tiles; ++t)
              packed_tiles<rows, 1>(p, K2, x, ldx, bias, y, N, t);
          }
        }
      });
    });
    return;
  }
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile)
      for (int64_t m0 = 0; m0 < M; m0 += kPackedRows)
        with_packed_rows(std::min<int64_t>(kPackedRows, M - m0), [&](auto m) {
          constexpr int rows = decltype(m)::value;
          packed_tiles<rows, 1>(p, K2, x + m0 * ldx, ldx, bias, y + m0 * N, N, tile);
        });
  });
}

}  // namespace

// No AMX on this build: the bf16 and int8 products stay on AVX2.
bool set_amx(bool) { return false; }
bool amx_int8_enabled() { return false; }
int64_t amx_int8_count() { return 0; }

// y [M, N] = x [M, K] @ W^T (+ bias) with W given as pack_bf16(W); any M >= 1.
torch::Tensor linear_packed_bf16(torch::Tensor x, torch::Tensor packed, int64_t N,
                                 c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "contiguous bf16 [M, K] input");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kInt32 &&
                  packed.size(0) == (N + 15) / 16 && packed.size(1) * 2 == x.size(1),
              "packed weight does not match x or N");
  const int64_t M = x.size(0), K = x.size(1), K2 = packed.size(1), ld = padded8(K);
  TORCH_CHECK(M >= 1, "at least one row");
  const uint16_t* b = bias_ptr(bias, N);
  auto y = torch::empty({M, N}, x.options());
  const std::vector<float> xf =
      widen_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, ld);
  auto p = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  packed_run(p, K2, xf.data(), ld, M, b, y.data_ptr<at::BFloat16>(), N);
  return y;
}

// Q8_0 int8 weights (avx2_int8.cpp, linked into the same extension; pack_q8 in common.h).
torch::Tensor linear_q8(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t N,
                        c10::optional<torch::Tensor> bias);

#include "decode_stack.h"

// ---- prefill attention: many queries over key ranges of one layer's keys ------------------------
// Keys packed once per layer as [Hkv, K/8, D/2, 8] words (`pack_attention_kv`): word (b, d2, i)
// holds dims 2 d2 and 2 d2 + 1 of key 8b + i, so a query's dim pair broadcast against one
// vector, split into its even and odd dims as in the packed linear, scores 8 keys. Values stay
// rows of D bf16 [Hkv, K, D]: a probability broadcast against them adds one key's value.
std::vector<torch::Tensor> pack_attention_kv(const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k, v [Hkv, K, D]");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 &&
                  v.stride(1) == v.size(2), "rows of k and v contiguous");
  const int64_t Hkv = k.size(0), K = k.size(1), D = k.size(2);
  TORCH_CHECK(D % 32 == 0 && D <= 256, "head_dim a multiple of 32, at most 256");
  const int64_t NB = (K + 7) / 8, D2 = D / 2;
  auto kp = torch::zeros({Hkv, NB, D2, 8}, torch::TensorOptions().dtype(torch::kInt32));
  auto kptr = kp.data_ptr<int32_t>();
  auto ks = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const int64_t khs = k.stride(0);
  at::parallel_for(0, Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      const uint16_t* kh = ks + h * khs;
      int32_t* kd = kptr + h * NB * D2 * 8;
      for (int64_t j = 0; j < K; ++j) {  // key j: lane j % 8 of block j / 8
        const uint16_t* row = kh + j * D;
        int32_t* dst = kd + (j / 8) * D2 * 8 + (j % 8);
        for (int64_t d2 = 0; d2 < D2; ++d2) {
          int32_t pair;
          std::memcpy(&pair, row + 2 * d2, 4);
          dst[d2 * 8] = pair;
        }
      }
    }
  });
  return {kp, v.contiguous()};
}

namespace {

constexpr int kRowTile = 4;  // query rows per pass over the keys: each key vector serves them all
constexpr int kKeyChunk = 32;  // keys per online-softmax step (4 vectors)

// Up to kRowTile query rows of one head over the visible keys: the union of [a, b) ranges,
// each row also below its own limit. Online softmax in fp32, probabilities rounded to bf16 for
// the weighted values as the flash kernels (and the AVX512 build) do.
void attend_tile(int rows, const uint16_t* const q[kRowTile], const int32_t* kp,
                 const uint16_t* vh, int64_t D, const float* bias,
                 const std::vector<int64_t>& ranges, const int64_t limit[kRowTile], float scale,
                 at::BFloat16* const out[kRowTile]) {
  const int64_t D2 = D / 2;
  alignas(32) float qf[kRowTile][256];
  alignas(32) float o[kRowTile][256];
  float m[kRowTile], l[kRowTile];
  for (int r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < D; d += 8) {
      _mm256_store_ps(qf[r] + d, load8(q[r] + d));
      _mm256_store_ps(o[r] + d, _mm256_setzero_ps());
    }
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
  int64_t seen = 0;  // the tile's rows see no key past this one
  for (int r = 0; r < rows; ++r) seen = std::max(seen, limit[r]);
  alignas(32) float pr[kRowTile][kKeyChunk];
  for (size_t x = 0; x + 1 < ranges.size(); x += 2) {
    const int64_t a = ranges[x], b = std::min(ranges[x + 1], seen);
    for (int64_t j0 = a & ~int64_t(7); j0 < b; j0 += kKeyChunk) {
      const int nv = int(std::min<int64_t>(kKeyChunk, (b - j0 + 7) / 8 * 8) / 8);
      __m256 s[kRowTile][kKeyChunk / 8];
      for (int r = 0; r < kRowTile; ++r)
        for (int u = 0; u < kKeyChunk / 8; ++u) s[r][u] = _mm256_setzero_ps();
      for (int u = 0; u < nv; ++u) {
        const int32_t* kb = kp + ((j0 / 8) + u) * D2 * 8;
        for (int64_t d2 = 0; d2 < D2; ++d2) {
          const __m256i w = _mm256_loadu_si256((const __m256i*)(kb + d2 * 8));
          const __m256 ke = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
          const __m256 ko = _mm256_castsi256_ps(_mm256_and_si256(w, high));
          for (int r = 0; r < rows; ++r)
            s[r][u] = _mm256_fmadd_ps(ko, _mm256_broadcast_ss(qf[r] + 2 * d2 + 1),
                                      _mm256_fmadd_ps(ke, _mm256_broadcast_ss(qf[r] + 2 * d2), s[r][u]));
        }
      }
      for (int r = 0; r < rows; ++r) {
        const int64_t hi = std::min(b, limit[r]);
        __m256 top = minus_inf;
        __m256 valid[kKeyChunk / 8];
        for (int u = 0; u < kKeyChunk / 8; ++u) {
          const __m256 key = _mm256_add_ps(kLaneIndex, _mm256_set1_ps(float(j0 + 8 * u)));
          valid[u] = u < nv ? _mm256_and_ps(_mm256_cmp_ps(key, _mm256_set1_ps(float(a)), _CMP_GE_OQ),
                                            _mm256_cmp_ps(key, _mm256_set1_ps(float(hi)), _CMP_LT_OQ))
                            : _mm256_setzero_ps();
          __m256 sc = _mm256_mul_ps(s[r][u], _mm256_set1_ps(scale));
          if (bias && u < nv)
            sc = _mm256_add_ps(sc, _mm256_maskload_ps(bias + j0 + 8 * u, _mm256_castps_si256(valid[u])));
          // A -inf bias (a padding slot) hides its key exactly, as in the softmax.
          valid[u] = _mm256_and_ps(valid[u], _mm256_cmp_ps(sc, minus_inf, _CMP_NEQ_OQ));
          s[r][u] = sc;
          top = _mm256_max_ps(top, _mm256_blendv_ps(minus_inf, sc, valid[u]));
        }
        const float cm = hmax(top);
        if (cm > m[r]) {  // a new maximum: rescale what is summed so far
          const float c = m[r] == -INFINITY ? 0.f : std::exp(m[r] - cm);
          const __m256 cv = _mm256_set1_ps(c);
          for (int64_t d = 0; d < D; d += 8)
            _mm256_store_ps(o[r] + d, _mm256_mul_ps(_mm256_load_ps(o[r] + d), cv));
          l[r] *= c;
          m[r] = cm;
        }
        const __m256 mv = _mm256_set1_ps(m[r]);
        __m256 sum = _mm256_setzero_ps();
        for (int u = 0; u < kKeyChunk / 8; ++u) {
          const __m256 e = m[r] == -INFINITY
                               ? _mm256_setzero_ps()
                               : _mm256_and_ps(valid[u], exp8(_mm256_sub_ps(s[r][u], mv)));
          sum = _mm256_add_ps(sum, e);
          _mm256_store_ps(pr[r] + 8 * u, round_bf16(e));
        }
        l[r] += hsum(sum);
      }
      // Weighted values: each key's value row loaded once for the tile's rows.
      for (int u = 0; u < nv * 8; ++u) {
        const int64_t j = j0 + u;
        bool any = false;
        for (int r = 0; r < rows; ++r) any |= pr[r][u] != 0.f;
        if (!any) continue;
        const uint16_t* value = vh + j * D;
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 vv = load8(value + d);
          for (int r = 0; r < rows; ++r)
            _mm256_store_ps(o[r] + d, _mm256_fmadd_ps(_mm256_set1_ps(pr[r][u]), vv,
                                                      _mm256_load_ps(o[r] + d)));
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    const __m256 inv = _mm256_set1_ps(l[r] > 0.f ? 1.0f / l[r] : 0.f);
    for (int64_t d = 0; d < D; d += 8) store8(out[r] + d, _mm256_mul_ps(_mm256_load_ps(o[r] + d), inv));
  }
}

}  // namespace

// Attention of query rows q [H, R, D] bf16 (any head and row stride, dims contiguous) over
// the packed keys and values of one layer (`pack_attention_kv`, K keys): row i sees the keys
// in the [a, b) ranges (flat, disjoint, in order), below limits[i] where given (int64 [R]);
// bias [Hkv, K] fp32 added to the scores where given. GQA: head h reads KV head h / (H / Hkv).
// Returns [H, R, D] bf16: softmax in fp32, online over chunks of 32 keys, the probabilities
// rounded to bf16 for the weighted values as the flash kernels do.
torch::Tensor attend_packed_bf16(const torch::Tensor& q, const torch::Tensor& kp,
                                 const torch::Tensor& vp, int64_t K, std::vector<int64_t> ranges,
                                 const c10::optional<torch::Tensor>& limits, double scale,
                                 const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.scalar_type() == at::kBFloat16, "q [H, R, D] bf16");
  const int64_t H = q.size(0), R = q.size(1), D = q.size(2), Hkv = kp.size(0);
  TORCH_CHECK(D % 32 == 0 && D <= 256, "head_dim a multiple of 32, at most 256");
  TORCH_CHECK(kp.dim() == 4 && kp.size(2) == D / 2 && kp.size(1) == (K + 7) / 8, "packed keys");
  TORCH_CHECK(vp.dim() == 3 && vp.size(0) == Hkv && vp.size(1) == K && vp.size(2) == D &&
                  vp.is_contiguous() && vp.scalar_type() == at::kBFloat16, "values [Hkv, K, D]");
  TORCH_CHECK(H % Hkv == 0 && ranges.size() % 2 == 0, "H % Hkv == 0, ranges in pairs");
  for (size_t x = 0; x < ranges.size(); x += 2)
    TORCH_CHECK(0 <= ranges[x] && ranges[x] <= ranges[x + 1] && ranges[x + 1] <= K &&
                    (x == 0 || ranges[x - 1] <= ranges[x]), "ranges within [0, K), disjoint, in order");
  const int64_t* lp = nullptr;
  if (limits.has_value() && limits->defined()) {
    TORCH_CHECK(limits->scalar_type() == at::kLong && limits->is_contiguous() && limits->numel() == R,
                "limits int64 [R]");
    lp = limits->data_ptr<int64_t>();
  }
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->size(0) == Hkv &&
                    bias->size(1) == K, "bias [Hkv, K] fp32");
    bp = bias->data_ptr<float>();
  }
  auto out = torch::empty({H, R, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  auto qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto op = out.data_ptr<at::BFloat16>();
  const int32_t* kptr = kp.data_ptr<int32_t>();
  auto vptr = reinterpret_cast<const uint16_t*>(vp.data_ptr<at::BFloat16>());
  const int64_t NB = kp.size(1), group = H / Hkv, tiles = (R + kRowTile - 1) / kRowTile;
  const int64_t qhs = q.stride(0), qrs = q.stride(1);
  const float s = float(scale);
  at::parallel_for(0, H * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t ht = begin; ht < end; ++ht) {
      const int64_t h = ht / tiles, r0 = (ht % tiles) * kRowTile, g = h / group;
      const int rows = int(std::min<int64_t>(kRowTile, R - r0));
      const uint16_t* qs[kRowTile];
      at::BFloat16* outs[kRowTile];
      int64_t limit[kRowTile];
      for (int r = 0; r < kRowTile; ++r) {
        const int64_t row = std::min(r0 + r, R - 1);
        qs[r] = qp + h * qhs + row * qrs;
        outs[r] = op + (h * R + row) * D;
        limit[r] = lp ? lp[row] : K;
      }
      attend_tile(rows, qs, kptr + g * NB * (D / 2) * 8, vptr + g * K * D, D,
                  bp ? bp + g * K : nullptr, ranges, limit, s, outs);
    }
  });
  return out;
}

}  // namespace avx2

#define CDLM_ISA avx2
#include "bindings.h"
