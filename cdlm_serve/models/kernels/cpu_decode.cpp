// Fused bf16 ops for decoding a few tokens at a time on AVX512-BF16 CPUs.
//
// Each op has a PyTorch reference in models/kernels/__init__.py (used as the fallback and in the
// tests); these exist because at decode sizes PyTorch's CPU dispatch and its bf16 matrix-vector
// path cost more than the arithmetic.
//
// linear_bf16: y[M, N] = x[M, K] @ W[N, K]^T (+ bias). Decoding a few tokens at a time is bound by how fast the weights stream from memory. PyTorch's
// bf16 matrix-vector path reaches about half of this machine's DRAM bandwidth; this kernel
// reads each weight cache line once, multiplies it with all M activation rows using AVX512-BF16
// dot products (fp32 accumulation), and prefetches the next block of rows into L2 so the memory
// system always has requests in flight.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <mutex>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "bf16_simd.h"

namespace avx512 {

constexpr const char* kIsa = "avx512";

#include "common.h"

namespace {

constexpr int64_t kPrefetchRows = 4;  // prefetch distance in weight rows (one block ahead)

template <int R, int M>
inline void block_dot(const uint16_t* w, int64_t K, const uint16_t* x, int64_t ldx,
                      float out[M][R]) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const int64_t pf = kPrefetchRows * K;
  for (int64_t k = 0; k < K; k += 32) {
    // The last chunk may be partial: masked loads read zeros past K.
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
    __m512bh xv[M];
    for (int m = 0; m < M; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + k);
    for (int r = 0; r < R; ++r) {
      const uint16_t* p = w + r * K + k;
      _mm_prefetch(reinterpret_cast<const char*>(p + pf), _MM_HINT_T1);
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
      for (int m = 0; m < M; ++m) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv, xv[m]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}

template <int R, int M>
void rows(const uint16_t* w, const uint16_t* x, const uint16_t* bias, at::BFloat16* y,
          int64_t N, int64_t K, int64_t begin, int64_t end) {
  float out[M][R];
  int64_t n = begin;
  for (; n + R <= end; n += R) {
    block_dot<R, M>(w + n * K, K, x, K, out);
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r)
        y[m * N + n + r] = at::BFloat16(out[m][r] + (bias ? bf16_to_float(bias[n + r]) : 0.f));
  }
  float one[M][1];
  for (; n < end; ++n) {
    block_dot<1, M>(w + n * K, K, x, K, one);
    for (int m = 0; m < M; ++m)
      y[m * N + n] = at::BFloat16(one[m][0] + (bias ? bf16_to_float(bias[n]) : 0.f));
  }
}

template <int M>
void run(const uint16_t* w, const uint16_t* x, const uint16_t* bias, at::BFloat16* y, int64_t N,
         int64_t K) {
  // Keep M * R accumulators within the 32 vector registers.
  constexpr int R = M <= 4 ? 4 : 2;
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    rows<R, M>(w, x, bias, y, N, K, begin, end);
  });
}

}  // namespace

// x: [M, K] bf16 contiguous, M >= 1 (8 rows per pass); weight: [N, K] bf16 contiguous; bias: [N]
// or empty.
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "shape mismatch");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "bf16 only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "contiguous inputs only");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(M >= 1, "at least one row");
  auto y = torch::empty({M, N}, x.options());
  auto w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto xv = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* b = bias_ptr(bias, N);
  auto out = y.data_ptr<at::BFloat16>();
  in_row_passes(M, [&](int64_t m0, auto m) {
    run<decltype(m)::value>(w, xv + m0 * K, b, out + m0 * N, N, K);
  });
  return y;
}

// One row of RMSNorm with HF's rounding order: normalize in fp32, round to bf16, then multiply
// by the bf16 weight and round again.
void norm_row(const uint16_t* x, const uint16_t* w, at::BFloat16* y, int64_t K, float eps) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 v = load_bf16_masked(x + k, tail_mask(K - k));
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / K + eps));
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 m = tail_mask(K - k);
    const __m512 normed = _mm512_mul_ps(load_bf16_masked(x + k, m), inv);
    const __m512 rounded = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(to_bf16(normed)), 16));
    store_bf16_masked(y + k, _mm512_mul_ps(rounded, load_bf16_masked(w + k, m)), m);
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
    for (int64_t i = m0 * K, end = m1 * K; i < end; i += 16) {
      const __mmask16 m = tail_mask(end - i);
      store_bf16_masked(hp + i, _mm512_add_ps(load_bf16_masked(xp + i, m),
                                              load_bf16_masked(rp + i, m)), m);
    }
    for (int64_t m = m0; m < m1; ++m) norm_row(hraw + m * K, wp, yp + m * K, K, float(eps));
  });
  return {y, h};
}

// exp(x) for 16 floats: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' degree-6
// polynomial (relative error ~1e-7, far below bf16's 4e-3), times 2^n. Inputs clamped to
// [-87, 88], where expf neither overflows nor goes subnormal.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

// gu [M, 2I] (gate then up) -> silu(gate) * up [M, I], in fp32, rounded once.
torch::Tensor silu_mul_bf16(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0, "contiguous [M, 2I]");
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  auto y = torch::empty({M, I}, gu.options());
  auto gp = reinterpret_cast<const uint16_t*>(gu.data_ptr<at::BFloat16>());
  auto yp = y.data_ptr<at::BFloat16>();
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* g = gp + m * 2 * I;
    const uint16_t* u = g + I;
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 mask = tail_mask(I - i);
      const __m512 gv = load_bf16_masked(g + i, mask), uv = load_bf16_masked(u + i, mask);
      const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
      store_bf16_masked(yp + m * I + i, _mm512_mul_ps(silu, uv), mask);
    }
  }
  return y;
}

// gu [M, 2I] (gate then up) -> gelu_tanh(gate) * up [M, I] (Gemma's GeGLU), in fp32, rounded
// once: gelu_tanh(g) = g / 2 (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), and
// 1 + tanh(z) = 2 - 2 / (exp(2z) + 1), exact at both ends (exp_ps clamps, never overflows).
torch::Tensor gelu_mul_bf16(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0, "contiguous [M, 2I]");
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  auto y = torch::empty({M, I}, gu.options());
  auto gp = reinterpret_cast<const uint16_t*>(gu.data_ptr<at::BFloat16>());
  auto yp = y.data_ptr<at::BFloat16>();
  const __m512 one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f);
  const __m512 c = _mm512_set1_ps(0.7978845608028654f), k = _mm512_set1_ps(0.044715f);
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* g = gp + m * 2 * I;
    const uint16_t* u = g + I;
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 mask = tail_mask(I - i);
      const __m512 gv = load_bf16_masked(g + i, mask), uv = load_bf16_masked(u + i, mask);
      const __m512 inner = _mm512_mul_ps(
          c, _mm512_fmadd_ps(_mm512_mul_ps(k, gv), _mm512_mul_ps(gv, gv), gv));  // z
      const __m512 e = exp_ps(_mm512_add_ps(inner, inner));                      // exp(2z)
      const __m512 plus = _mm512_sub_ps(two, _mm512_div_ps(two, _mm512_add_ps(e, one)));
      const __m512 gelu = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), gv), plus);
      store_bf16_masked(yp + m * I + i, _mm512_mul_ps(gelu, uv), mask);
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
      for (int64_t i = 0; i < half; i += 16) {
        const __m512 x1 = load_bf16(x + i), x2 = load_bf16(x + half + i);
        // out1 = x1 cos1 - x2 sin1; out2 = x2 cos2 + x1 sin2
        const __m512 o1 = _mm512_fnmadd_ps(x2, load_bf16(s + i), _mm512_mul_ps(x1, load_bf16(c + i)));
        const __m512 o2 = _mm512_fmadd_ps(x1, load_bf16(s + half + i),
                                          _mm512_mul_ps(x2, load_bf16(c + half + i)));
        _mm256_storeu_si256((__m256i*)(x + i), to_bf16(o1));
        _mm256_storeu_si256((__m256i*)(x + half + i), to_bf16(o2));
      }
    }
  }
}

// [s_0 .. s_15] where s_i is the sum of the 16 lanes of a[i]: pairs within 128-bit lanes, then
// pairs of pairs, then across the four 128-bit lanes; 15 adds and 30 shuffles for 16 sums.
inline __m512 sum16(const __m512 a[16]) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                                  _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                                  _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

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
  auto out = torch::empty({T, H * D}, q.options());
  auto qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  auto vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  auto op = out.data_ptr<at::BFloat16>();
  const int64_t group = H / Hkv, qstride = q.stride(0);
  const float fscale = float(scale);
  TORCH_CHECK(D <= 256, "head_dim <= 256");
  at::parallel_for(0, T * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p;
    std::vector<__mmask16> seen;  // per block of 16 keys: those attended to
    for (int64_t th = begin; th < end; ++th) {
      const int64_t t = th / H, h = th % H, g = h / group, b = rows[t], L = lens[t];
      const uint16_t* qh = qp + t * qstride + h * D;
      const uint16_t* kh = kp + (b * Hkv + g) * S * D;
      const uint16_t* vh = vp + (b * Hkv + g) * S * D;
      const float* bh_bias = bp ? bp + (b * Hkv + g) * S : nullptr;
      const int64_t blocks = (L + 15) / 16;
      p.resize(blocks * 16);
      seen.resize(blocks);
      // Scores 16 keys at a time: D/32 dot-product steps per key, then one transposing
      // reduction for all 16 (a horizontal sum per key would cost ~4x more). A key whose bias
      // is -inf is the padding of non-uniform budgets (engine/sessions/ragged.py: each head's segment
      // is as long as the longest head's): its probability is exactly 0, so neither it nor its
      // value is read, and a head pays for its own slots only.
      const __m512 hidden = _mm512_set1_ps(-INFINITY);
      __m512 mx = hidden;
      for (int64_t j0 = 0; j0 < L; j0 += 16) {
        const __mmask16 live = tail_mask(L - j0);
        const __m512 beta = bh_bias ? _mm512_maskz_loadu_ps(live, bh_bias + j0) : _mm512_setzero_ps();
        const __mmask16 keys = bh_bias ? _mm512_mask_cmp_ps_mask(live, beta, hidden, _CMP_NEQ_UQ) : live;
        seen[j0 / 16] = keys;
        if (!keys) continue;
        __m512 part[16];
        for (int i = 0; i < 16; ++i) {
          __m512 acc = _mm512_setzero_ps();
          if (keys >> i & 1)
            for (int64_t d = 0; d < D; d += 32)
              acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qh + d),
                                     (__m512bh)_mm512_loadu_si512(kh + (j0 + i) * D + d));
          part[i] = acc;
        }
        __m512 sc = _mm512_add_ps(_mm512_mul_ps(sum16(part), _mm512_set1_ps(fscale)), beta);
        sc = _mm512_mask_mov_ps(hidden, keys, sc);
        _mm512_storeu_ps(p.data() + j0, sc);
        mx = _mm512_max_ps(mx, sc);
      }
      const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
      __m512 total = _mm512_setzero_ps();
      for (int64_t j0 = 0; j0 < L; j0 += 16) {
        const __mmask16 keys = seen[j0 / 16];
        if (!keys) continue;
        const __m512 e = _mm512_maskz_mov_ps(keys, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(p.data() + j0), top)));
        _mm512_storeu_ps(p.data() + j0, e);
        total = _mm512_add_ps(total, e);
      }
      // Weighted values: each key's probability broadcast once for all D/16 output vectors.
      const int64_t C = D / 16;
      __m512 acc[16];
      for (int64_t c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
      for (int64_t j0 = 0; j0 < L; j0 += 16) {
        for (uint32_t keys = seen[j0 / 16]; keys; keys &= keys - 1) {
          const int64_t j = j0 + __builtin_ctz(keys);
          const __m512 pj = _mm512_set1_ps(p[j]);
          for (int64_t c = 0; c < C; ++c)
            acc[c] = _mm512_fmadd_ps(pj, load_bf16(vh + j * D + 16 * c), acc[c]);
        }
      }
      const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
      for (int64_t c = 0; c < C; ++c)
        _mm256_storeu_si256((__m256i*)(op + t * H * D + h * D + 16 * c),
                            to_bf16(_mm512_mul_ps(acc[c], inv)));
    }
  });
  return out;
}

// First index of the largest of n values, 16 lanes at a time: each lane keeps its first
// maximum (strict >), then the smallest index among the lanes that hold the overall maximum.
template <typename Load>
int64_t argmax_row(int64_t n, Load load, const std::function<float(int64_t)>& at) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_i = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                                     10, 11, 12, 13, 14, 15);
  const __m512i sixteen = _mm512_set1_epi32(16);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load(i);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
    idx = _mm512_add_epi32(idx, sixteen);
  }
  alignas(64) float bv[16];
  alignas(64) int32_t bi[16];
  _mm512_store_ps(bv, best);
  _mm512_store_si512(bi, best_i);
  float top = -INFINITY;
  int64_t arg = 0;
  for (int l = 0; l < 16 && l < n; ++l)
    if (bv[l] > top || (bv[l] == top && bi[l] < arg)) top = bv[l], arg = bi[l];
  for (; i < n; ++i)  // the tail comes after every vector index: strict > keeps the first
    if (at(i) > top) top = at(i), arg = i;
  return arg;
}

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
      o[m] = argmax_row(V, [&](int64_t i) { return load_bf16(row + i); },
                        [&](int64_t i) { return bf16_to_float(row[i]); });
    } else {
      const float* row = x.data_ptr<float>() + m * V;
      o[m] = argmax_row(V, [&](int64_t i) { return _mm512_loadu_ps(row + i); },
                        [&](int64_t i) { return row[i]; });
    }
  }
  return out;
}

// ---- KVzip's key scores: common.h's repeat_max_with, in 16-float vectors -----------------------
namespace {

// log sum_j exp(row[j]) over C floats: the row's maximum, then the sum of exp(x - max).
inline float row_logsumexp(const float* row, int64_t C) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= C; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + j));
  const __mmask16 tail = __mmask16((1u << (C - j)) - 1);
  if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, row + j));
  const float top = _mm512_reduce_max_ps(mx);
  const __m512 t = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j + 16 <= C; j += 16) sum = _mm512_add_ps(sum, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(row + j), t)));
  if (tail) sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + j), t))));
  return top + std::log(_mm512_reduce_add_ps(sum));
}

// best[j0, j1) = max(best, max_r s[r, j] - lse[r]) for j1 - j0 <= 64: four vectors of columns
// down all M rows (each row's 256 bytes are four whole cache lines).
inline void col_max(const float* s, int64_t M, int64_t ld, const float* lse, int64_t j0, int64_t j1,
                    float* best) {
  __mmask16 m[4];
  __m512 acc[4];
  for (int u = 0; u < 4; ++u) {
    const int64_t left = j1 - j0 - 16 * u;
    m[u] = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
    acc[u] = _mm512_maskz_loadu_ps(m[u], best + j0 + 16 * u);
  }
  for (int64_t r = 0; r < M; ++r) {
    const __m512 l = _mm512_set1_ps(lse[r]);
    const float* row = s + r * ld + j0;
    for (int u = 0; u < 4; ++u)
      acc[u] = _mm512_max_ps(acc[u], _mm512_sub_ps(_mm512_maskz_loadu_ps(m[u], row + 16 * u), l));
  }
  for (int u = 0; u < 4; ++u) _mm512_mask_storeu_ps(best + j0 + 16 * u, m[u], acc[u]);
}

}  // namespace

// The scores too, for bf16 queries and keys (a bf16 model's: its cache and its repeat pass are
// bf16): s = q k^T * scale + bias by AVX512-BF16 dot products, whose products of two bf16 are
// exact in fp32 and summed in fp32, so s is what fp32 FMAs make of the same numbers (the order
// of the sum aside), in half the instructions (32 products each). The keys are packed once
// (pack_bf16's layout), as the packed linear reads its weights: per 8 queries and 3 tiles of
// 16 keys, 24 accumulators; each block of kScoreRows queries is scored into one fp32 buffer
// that stays in the caches, then reduced as common.h's repeat_max_with does.
namespace {

template <int M, int R>
inline void score_tiles(const uint32_t* p, int64_t K2, const uint32_t* x, const float* bias,
                        float scale, float* s, int64_t C, int64_t tile) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const uint32_t* base = p + tile * K2 * 16;
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512bh kv[R];
    for (int r = 0; r < R; ++r) kv[r] = (__m512bh)_mm512_loadu_si512(base + (r * K2 + kp) * 16);
    for (int m = 0; m < M; ++m) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(int(x[m * K2 + kp]));
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], kv[r], qb);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r) {
    const int64_t n0 = (tile + r) * 16;
    const __mmask16 mask = tail_mask(C - n0);
    const __m512 b = _mm512_maskz_loadu_ps(mask, bias + n0);
    for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(s + m * C + n0, mask, _mm512_fmadd_ps(acc[m][r], sc, b));
  }
}

}  // namespace

// best [region] (fp32, in place) from queries q [N, D] and keys [C, D], both bf16 (the dot
// products above) or both fp32 (GEMMs), and bias [C] fp32.
void repeat_max(torch::Tensor q, torch::Tensor keys, torch::Tensor bias, double scale,
                int64_t region, torch::Tensor best) {
  if (q.scalar_type() != at::kBFloat16) {
    repeat_max_fp32(q, keys, bias, scale, region, best, row_logsumexp, col_max);
    return;
  }
  check_repeat_max(q, keys, bias);
  const int64_t C = keys.size(0);
  const auto packed = pack_bf16(keys);  // [tiles, D / 2, 16]; checks keys
  const int64_t tiles = packed.size(0), K2 = packed.size(1);
  const auto p = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  const auto x = reinterpret_cast<const uint32_t*>(q.data_ptr<at::BFloat16>());
  const float* b = bias.data_ptr<float>();
  const float sc = float(scale);
  constexpr int R = 3;  // 8 rows x 3 tiles of accumulators, as packed_run_chunked
  repeat_max_with(q.size(0), C, region, best, [&](int64_t a, int64_t rows, float* s) {
    for (int64_t tile = 0; tile < tiles; tile += R)
      for (int64_t m0 = 0; m0 < rows; m0 += 8)
        with_rows(std::min<int64_t>(8, rows - m0), [&](auto m) {
          constexpr int M = decltype(m)::value;
          const uint32_t* xm = x + (a + m0) * K2;
          float* sm = s + m0 * C;
          if (tile + R <= tiles) {
            score_tiles<M, R>(p, K2, xm, b, sc, sm, C, tile);
          } else {
            for (int64_t t = tile; t < tiles; ++t) score_tiles<M, 1>(p, K2, xm, b, sc, sm, C, t);
          }
        });
  }, row_logsumexp, col_max);
}

// ---- Packed small-M linear ---------------------------------------------------------------
//
// linear_bf16 above reads W's rows in their natural [N, K] layout, so every output needs a
// horizontal reduction of its accumulator at the end, and each weight load feeds M dot
// products against M activation loads. Packing W once as [N/16][K/2][16][2] (pairs of
// consecutive k for 16 outputs in one 64-byte line) turns the step into: load one weight line,
// broadcast each row's (x[k], x[k+1]) pair, one dpbf16 per row into 16 outputs at once. No
// reductions, no activation vector loads, and each 16-output tile is one contiguous stream.
// Used by DecodeStack (which packs its layers once); the rounding is the same (fp32 sums,
// bias added in fp32, rounded once), only the summation order differs.
namespace {

// Cache lines ahead within a tile's stream. 4 was 4-10% faster on SmolLM2's 121 matrices
// alone (Zen 4) but no faster in the decode step (bench.kernel_ab, 1.00 / 0.97 at batch 1 / 8).
constexpr int64_t kPackedPrefetch = 8;

template <int M, int R>
inline void packed_block(const uint32_t* p, int64_t K2, const uint32_t* x, const uint16_t* bias,
                         at::BFloat16* y, int64_t N, int64_t tile) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const uint32_t* base = p + tile * K2 * 16;  // R consecutive tiles, K2 * 16 words apart
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) {
      const uint32_t* line = base + (r * K2 + kp) * 16;
      _mm_prefetch(reinterpret_cast<const char*>(line + kPackedPrefetch * 16), _MM_HINT_T0);
      wv[r] = (__m512bh)_mm512_loadu_si512(line);
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(int(x[m * K2 + kp]));
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xb);
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t n0 = (tile + r) * 16;
    const __mmask16 mask = tail_mask(N - n0);
    const __m512 b = bias ? load_bf16_masked(bias + n0, mask) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m)
      store_bf16_masked(y + m * N + n0, _mm512_add_ps(acc[m][r], b), mask);
  }
}

template <int M>
void packed_run(const uint32_t* p, int64_t K2, const uint32_t* x, const uint16_t* bias,
                at::BFloat16* y, int64_t N) {
  // M * R accumulators + R weight lines + 1 broadcast within the 32 vector registers.
  constexpr int R = M <= 2 ? 8 : (M <= 4 ? 4 : 3);
  const int64_t tiles = (N + 15) / 16, groups = (tiles + R - 1) / R;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t tile = g * R;
      if (tile + R <= tiles) {
        packed_block<M, R>(p, K2, x, bias, y, N, tile);
      } else {
        for (int64_t t = tile; t < tiles; ++t) packed_block<M, 1>(p, K2, x, bias, y, N, t);
      }
    }
  });
}

// More than 8 rows: the rows go in chunks of 8 (what the registers hold) *within* each group of
// tiles, so a group's weights (R tiles x K/2 x 64 bytes, 55-150 KB here) come from memory once,
// for the first chunk, and from L2 for the others. Passes of 8 rows over the whole matrix
// instead stream every weight once per chunk: at 16 rows that doubled the bytes and left the
// step bound by memory when it could be bound by the dot products.
void packed_run_chunked(const uint32_t* p, int64_t K2, const uint32_t* x, int64_t M,
                        const uint16_t* bias, at::BFloat16* y, int64_t N) {
  constexpr int R = 3;  // the 8-row chunk's choice in packed_run; every chunk uses it
  const int64_t tiles = (N + 15) / 16, groups = (tiles + R - 1) / R;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t tile = g * R;
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        with_rows(std::min<int64_t>(8, M - m0), [&](auto m) {
          constexpr int rows = decltype(m)::value;
          const uint32_t* xm = x + m0 * K2;
          at::BFloat16* ym = y + m0 * N;
          if (tile + R <= tiles) {
            packed_block<rows, R>(p, K2, xm, bias, ym, N, tile);
          } else {
            for (int64_t t = tile; t < tiles; ++t) packed_block<rows, 1>(p, K2, xm, bias, ym, N, t);
          }
        });
      }
    }
  });
}

}  // namespace

// ---- The same packed linear on AMX tiles -------------------------------------------------
//
// pack_bf16's layout is exactly AMX's VNNI B-tile layout: 16 consecutive k-pairs of one
// 16-output tile are 16 contiguous 64-byte lines, i.e. one 1 KB tile loaded with stride 64. One
// TDPBF16PS multiplies it with up to 16 activation rows (an A tile of 32 k) into 16 x 16 fp32
// sums, so the rows cost no extra instructions per weight byte: AVX512's dpbf16 needs one per
// row. Used where the CPU has AMX-BF16 and the kernel grants the tile state (Linux 5.16+) and
// K is a multiple of 32; any M, 16 rows per A tile. Built only when the compiler knows AMX
// (-mamx-*).
namespace {

bool amx_enabled = false;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr bool kAmxBuilt = true;

constexpr int64_t kAmxPrefetch = 32;  // k-pairs ahead: two 1 KB chunks per tile stream

// tmm0: A = x[:, 32 k] (M rows); tmm1..R: B = R weight tiles' 16 k-pairs; tmm4..4+R: C sums.
template <int R>
void amx_group(const uint32_t* p, int64_t K2, const uint16_t* x, int64_t K, int64_t M,
               const uint16_t* bias, at::BFloat16* y, int64_t N, int64_t tile) {
  _tile_zero(4);
  if (R > 1) _tile_zero(5);
  if (R > 2) _tile_zero(6);
  const uint32_t* base = p + tile * K2 * 16;
  for (int64_t kp = 0; kp < K2; kp += 16) {
    for (int r = 0; r < R; ++r)  // the tiles' next chunk but one (1 KB each) into L1
      for (int l = 0; l < 16; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(base + (r * K2 + kp + kAmxPrefetch + l) * 16),
                     _MM_HINT_T0);
    _tile_loadd(0, x + 2 * kp, K * 2);
    _tile_loadd(1, base + kp * 16, 64);
    if (R > 1) _tile_loadd(2, base + (K2 + kp) * 16, 64);
    if (R > 2) _tile_loadd(3, base + (2 * K2 + kp) * 16, 64);
    _tile_dpbf16ps(4, 0, 1);
    if (R > 1) _tile_dpbf16ps(5, 0, 2);
    if (R > 2) _tile_dpbf16ps(6, 0, 3);
  }
  alignas(64) float c[R][16][16];  // [tile][row][output]
  _tile_stored(4, c[0], 64);
  if (R > 1) _tile_stored(5, c[1], 64);
  if (R > 2) _tile_stored(6, c[2], 64);
  for (int r = 0; r < R; ++r) store_tile_bf16(c[r], M, bias, y, N, (tile + r) * 16);
}

// Any M: rows in chunks of 16 (one A tile each); a group's weight tiles (3 x K/2 x 64 bytes,
// <= 150 KB for K <= 1,600) stay in L2 across the chunks, so DRAM streams them once. x is
// padded to whole chunks so every chunk has one tile shape; padded rows are never stored.
void amx_run(const uint32_t* p, int64_t K2, const uint16_t* x, int64_t M, const uint16_t* bias,
             at::BFloat16* y, int64_t N) {
  constexpr int R = 3;  // 1 A + 3 B + 3 C of the 8 tile registers
  const int64_t K = 2 * K2, chunks = (M + 15) / 16, rows = M <= 16 ? M : 16;
  std::vector<uint16_t> padded;
  if (M > 16 && M % 16 != 0) {
    padded.assign(chunks * 16 * K, 0);
    std::memcpy(padded.data(), x, M * K * sizeof(uint16_t));
    x = padded.data();
  }
  const int64_t tiles = (N + 15) / 16, groups = (tiles + R - 1) / R;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    amx::TileConfig cfg;  // tile shapes are per thread state
    cfg.rows[0] = uint8_t(rows);
    cfg.colsb[0] = 64;
    for (int t = 1; t <= 3; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    for (int t = 4; t <= 6; ++t) cfg.rows[t] = uint8_t(rows), cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t tile = g * R;
      for (int64_t c = 0; c < chunks; ++c) {
        const uint16_t* xc = x + c * 16 * K;
        const int64_t valid = std::min<int64_t>(16, M - c * 16);
        at::BFloat16* yc = y + c * 16 * N;
        if (tile + R <= tiles) {
          amx_group<R>(p, K2, xc, K, valid, bias, yc, N, tile);
        } else {
          for (int64_t t = tile; t < tiles; ++t) amx_group<1>(p, K2, xc, K, valid, bias, yc, N, t);
        }
      }
    }
    _tile_release();
  });
}
#else
constexpr bool kAmxBuilt = false;
void amx_run(const uint32_t*, int64_t, const uint16_t*, int64_t, const uint16_t*, at::BFloat16*,
             int64_t) {}
#endif

}  // namespace

// cpu_int8.cpp's AMX-INT8 path of linear_q8: turned on or off with the bf16 one.
bool set_amx_int8(bool enabled);
bool amx_int8_enabled();
int64_t amx_int8_count();

// Turn the AMX paths of linear_packed_bf16 and linear_q8 on or off; returns whether the bf16
// one is now on (each stays off where the build, the CPU or the OS cannot run it).
bool set_amx(bool enabled) {
  amx_enabled = enabled && kAmxBuilt && amx::cpu_has(amx::kBf16) && amx::request_tile_state();
  set_amx_int8(enabled);
  return amx_enabled;
}

// y [M, N] = x [M, K] @ W^T (+ bias) with W given as pack_bf16(W); any M >= 1.
torch::Tensor linear_packed_bf16(torch::Tensor x, torch::Tensor packed, int64_t N,
                                 c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "contiguous bf16 [M, K] input");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kInt32 &&
                  packed.size(0) == (N + 15) / 16 && packed.size(1) * 2 == x.size(1),
              "packed weight does not match x or N");
  const int64_t M = x.size(0), K2 = packed.size(1);
  TORCH_CHECK(M >= 1, "at least one row");
  const uint16_t* b = bias_ptr(bias, N);
  auto y = torch::empty({M, N}, x.options());
  auto p = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  auto xv = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  auto out = y.data_ptr<at::BFloat16>();
  if (amx_enabled && K2 % 16 == 0) {
    amx_run(p, K2, reinterpret_cast<const uint16_t*>(xv), M, b, out, N);
    return y;
  }
  if (M > 8) {
    packed_run_chunked(p, K2, xv, M, b, out, N);
    return y;
  }
  in_row_passes(M, [&](int64_t m0, auto m) {
    packed_run<decltype(m)::value>(p, K2, xv + m0 * K2, b, out + m0 * N, N);
  });
  return y;
}

// Q8_0 int8 weights (cpu_int8.cpp, linked into the same extension; pack_q8 in common.h).
torch::Tensor linear_q8(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t N,
                        c10::optional<torch::Tensor> bias);

#include "decode_stack.h"

// ---- prefill attention: many queries over key ranges of one layer's keys -------------------
// Keys and values packed once per layer for the bf16 dot-product instruction
// (`pack_attention_kv`): K as [Hkv, K/16, D/2, 16] pairs of dims (lane i: key 16b + i), so a
// query's dim pair broadcast against one vector scores 16 keys; V as [Hkv, K/2, D/16, 16]
// pairs of keys (lane i: dim 16c + i of keys 2p and 2p + 1), so a pair of probabilities
// broadcast against one vector adds two keys' values to 16 output dims.
std::vector<torch::Tensor> pack_attention_kv(const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k, v [Hkv, K, D]");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 &&
                  v.stride(1) == v.size(2), "rows of k and v contiguous");
  const int64_t Hkv = k.size(0), K = k.size(1), D = k.size(2);
  TORCH_CHECK(D % 32 == 0 && D <= 256, "head_dim a multiple of 32, at most 256");
  // V padded to whole blocks of 16 keys: a chunk reads its last block's pairs whole.
  const int64_t NB = (K + 15) / 16, NP = NB * 8, D2 = D / 2, C = D / 16;
  auto opts = torch::TensorOptions().dtype(torch::kInt32);
  auto kp = torch::zeros({Hkv, NB, D2, 16}, opts), vp = torch::zeros({Hkv, NP, C, 16}, opts);
  auto kptr = kp.data_ptr<int32_t>();
  auto vptr = vp.data_ptr<int32_t>();
  auto ks = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  auto vs = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  const int64_t khs = k.stride(0), vhs = v.stride(0);
  at::parallel_for(0, Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      const uint16_t* kh = ks + h * khs;
      int32_t* kd = kptr + h * NB * D2 * 16;
      for (int64_t j = 0; j < K; ++j) {  // key j: lane j % 16 of block j / 16
        const uint16_t* row = kh + j * D;
        int32_t* dst = kd + (j / 16) * D2 * 16 + (j % 16);
        for (int64_t d2 = 0; d2 < D2; ++d2) {
          int32_t pair;
          std::memcpy(&pair, row + 2 * d2, 4);
          dst[d2 * 16] = pair;
        }
      }
      const uint16_t* vh = vs + h * vhs;
      uint16_t* vd = reinterpret_cast<uint16_t*>(vptr + h * NP * C * 16);
      for (int64_t j = 0; j < K; ++j) {  // key j: the (j % 2)-th half of pair j / 2's lanes
        const uint16_t* row = vh + j * D;
        uint16_t* dst = vd + (j / 2) * C * 32 + (j % 2);
        for (int64_t d = 0; d < D; ++d) dst[2 * d] = row[d];
      }
    }
  });
  return {kp, vp};
}

namespace {

constexpr int kChunk = 64;  // keys per online-softmax step (4 vectors)

// RT query rows of one head over the visible keys: the union of [a, b) ranges, each row
// also below its own limit (causal rows, re-read tokens). Online softmax in fp32.
template <int RT, int C>
void attend_tile(const uint16_t* const q[RT], const int32_t* kp, const int32_t* vp, int64_t D2,
                 const float* bias, const std::vector<int64_t>& ranges, const int64_t limit[RT],
                 float scale, uint16_t* const out[RT]) {
  __m512 o[RT][C], lsum[RT];
  float m[RT];
  int32_t qpair[RT][128];
  for (int r = 0; r < RT; ++r) {
    for (int c = 0; c < C; ++c) o[r][c] = _mm512_setzero_ps();
    lsum[r] = _mm512_setzero_ps();
    m[r] = -INFINITY;
    std::memcpy(qpair[r], q[r], D2 * 4);
  }
  alignas(64) uint16_t pb[RT][kChunk];
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t seen = 0;  // the tile's rows see no key past this one
  for (int r = 0; r < RT; ++r) seen = std::max(seen, limit[r]);
  for (size_t x = 0; x + 1 < ranges.size(); x += 2) {
    const int64_t a = ranges[x], b = std::min(ranges[x + 1], seen);
    for (int64_t j0 = a & ~int64_t(15); j0 < b; j0 += kChunk) {
      const int nv = int(std::min<int64_t>(kChunk, ((b - j0 + 15) / 16) * 16) / 16);
      __m512 s[RT][4];
      for (int r = 0; r < RT; ++r)
        for (int u = 0; u < 4; ++u) s[r][u] = _mm512_setzero_ps();
      const int32_t* kb = kp + (j0 / 16) * D2 * 16;
      for (int64_t d2 = 0; d2 < D2; ++d2) {
        __m512bh kv[4];
        for (int u = 0; u < nv; ++u) kv[u] = (__m512bh)_mm512_loadu_si512(kb + (u * D2 + d2) * 16);
        for (int r = 0; r < RT; ++r) {
          const __m512bh qb = (__m512bh)_mm512_set1_epi32(qpair[r][d2]);
          for (int u = 0; u < nv; ++u) s[r][u] = _mm512_dpbf16_ps(s[r][u], qb, kv[u]);
        }
      }
      __mmask16 valid[RT][4];
      for (int r = 0; r < RT; ++r) {
        const int64_t hi = std::min(b, limit[r]);
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int u = 0; u < 4; ++u) {
          const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(int32_t(j0 + 16 * u)));
          valid[r][u] = u < nv ? _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(int32_t(a))) &
                                     _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32(int32_t(hi)))
                               : __mmask16(0);
          __m512 sc = _mm512_mul_ps(s[r][u], _mm512_set1_ps(scale));
          if (bias) sc = _mm512_add_ps(sc, _mm512_maskz_loadu_ps(valid[r][u], bias + j0 + 16 * u));
          // A -inf bias (a padding slot) hides its key exactly, as in the softmax.
          valid[r][u] &= _mm512_cmp_ps_mask(sc, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
          s[r][u] = sc;
          top = _mm512_mask_max_ps(top, valid[r][u], top, sc);
        }
        const float cm = _mm512_reduce_max_ps(top);
        if (cm > m[r]) {  // a new maximum: rescale what is summed so far
          const float c = m[r] == -INFINITY ? 0.f : std::exp(m[r] - cm);
          const __m512 cv = _mm512_set1_ps(c);
          for (int cc = 0; cc < C; ++cc) o[r][cc] = _mm512_mul_ps(o[r][cc], cv);
          lsum[r] = _mm512_mul_ps(lsum[r], cv);
          m[r] = cm;
        }
        const __m512 mv = _mm512_set1_ps(m[r]);
        __m512 p[4];
        for (int u = 0; u < 4; ++u) {
          p[u] = m[r] == -INFINITY ? _mm512_setzero_ps()
                                   : _mm512_maskz_mov_ps(valid[r][u], exp_ps(_mm512_sub_ps(s[r][u], mv)));
          lsum[r] = _mm512_add_ps(lsum[r], p[u]);
        }
        _mm512_store_si512(pb[r], (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
        _mm512_store_si512(pb[r] + 32, (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
      }
      const int npairs = nv * 8;
      const int32_t* vb = vp + (j0 / 2) * C * 16;
      for (int pp = 0; pp < npairs; ++pp) {
        __m512bh pr[RT];
        for (int r = 0; r < RT; ++r) {
          int32_t two;
          std::memcpy(&two, pb[r] + 2 * pp, 4);
          pr[r] = (__m512bh)_mm512_set1_epi32(two);
        }
        for (int c = 0; c < C; ++c) {
          const __m512bh vv = (__m512bh)_mm512_loadu_si512(vb + (pp * C + c) * 16);
          for (int r = 0; r < RT; ++r) o[r][c] = _mm512_dpbf16_ps(o[r][c], pr[r], vv);
        }
      }
    }
  }
  for (int r = 0; r < RT; ++r) {
    const float total = _mm512_reduce_add_ps(lsum[r]);
    const __m512 inv = _mm512_set1_ps(total > 0.f ? 1.0f / total : 0.f);
    for (int c = 0; c < C; ++c)
      _mm256_storeu_si256((__m256i*)(out[r] + 16 * c), to_bf16(_mm512_mul_ps(o[r][c], inv)));
  }
}

template <int C>
void attend_packed(const uint16_t* qp, int64_t qhs, int64_t qrs, const int32_t* kp,
                   const int32_t* vp, int64_t NB, int64_t NP, const float* bias, int64_t K,
                   const std::vector<int64_t>& ranges, const int64_t* limits, float scale,
                   uint16_t* op, int64_t H, int64_t Hkv, int64_t R) {
  constexpr int RT = C <= 4 ? 4 : 2;  // rows per tile: each key vector loaded serves RT rows
  const int64_t D = C * 16, D2 = D / 2, group = H / Hkv, tiles = (R + RT - 1) / RT;
  at::parallel_for(0, H * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t ht = begin; ht < end; ++ht) {
      const int64_t h = ht / tiles, r0 = (ht % tiles) * RT, g = h / group;
      const int32_t* kh = kp + g * NB * D2 * 16;
      const int32_t* vh = vp + g * NP * C * 16;
      const float* bh = bias ? bias + g * K : nullptr;
      const uint16_t* q[RT];
      uint16_t* out[RT];
      int64_t limit[RT];
      alignas(64) uint16_t spare[256];  // the output of a tile's missing last row
      for (int r = 0; r < RT; ++r) {
        const int64_t row = std::min(r0 + r, R - 1);
        q[r] = qp + h * qhs + row * qrs;
        out[r] = r0 + r < R ? op + (h * R + row) * D : spare;
        limit[r] = limits ? limits[row] : K;
      }
      attend_tile<RT, C>(q, kh, vh, D2, bh, ranges, limit, scale, out);
    }
  });
}

}  // namespace

// Attention of query rows q [H, R, D] bf16 (any head and row stride, dims contiguous) over
// the packed keys and values of one layer (`pack_attention_kv`, K keys): row i sees the keys
// in the [a, b) ranges (flat, disjoint, in order), below limits[i] where given (int64 [R]);
// bias [Hkv, K] fp32 added to the scores where given. GQA: head h reads KV head h / (H / Hkv).
// Returns [H, R, D] bf16: softmax in fp32, online over chunks of 64 keys, the probabilities
// rounded to bf16 for the weighted values as the flash kernels do.
torch::Tensor attend_packed_bf16(const torch::Tensor& q, const torch::Tensor& kp,
                                 const torch::Tensor& vp, int64_t K, std::vector<int64_t> ranges,
                                 const c10::optional<torch::Tensor>& limits, double scale,
                                 const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.scalar_type() == at::kBFloat16, "q [H, R, D] bf16");
  const int64_t H = q.size(0), R = q.size(1), D = q.size(2), Hkv = kp.size(0);
  TORCH_CHECK(kp.dim() == 4 && kp.size(2) == D / 2 && kp.size(1) == (K + 15) / 16, "packed keys");
  TORCH_CHECK(vp.dim() == 4 && vp.size(0) == Hkv && vp.size(1) == kp.size(1) * 8 && vp.size(2) == D / 16,
              "packed values");
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
  auto op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int32_t* kptr = kp.data_ptr<int32_t>();
  const int32_t* vptr = vp.data_ptr<int32_t>();
  const int64_t NB = kp.size(1), NP = vp.size(1);
  const float s = float(scale);
  switch (D / 16) {
    case 2: attend_packed<2>(qp, q.stride(0), q.stride(1), kptr, vptr, NB, NP, bp, K, ranges, lp, s, op, H, Hkv, R); break;
    case 4: attend_packed<4>(qp, q.stride(0), q.stride(1), kptr, vptr, NB, NP, bp, K, ranges, lp, s, op, H, Hkv, R); break;
    case 8: attend_packed<8>(qp, q.stride(0), q.stride(1), kptr, vptr, NB, NP, bp, K, ranges, lp, s, op, H, Hkv, R); break;
    default: TORCH_CHECK(false, "head_dim 32, 64 or 128");
  }
  return out;
}

}  // namespace avx512

#define CDLM_ISA avx512
#include "bindings.h"
