// The ISA-free parts of the CPU kernels, shared by the AVX512 build (cpu_decode.cpp,
// cpu_int8.cpp) and the AVX2 one (avx2_decode.cpp, avx2_int8.cpp): the weight layouts both
// read (pack_bf16, pack_q8), argument checks, row-count dispatch, the fp32 split linear.
// Included inside a kernel file's ISA namespace, after <torch/extension.h>, <ATen/Parallel.h>,
// <cstring>, <mutex> and <vector>; everything here is inline or a template, so both files of a
// build include it.
#pragma once

constexpr int64_t kQ8Block = 32;  // Q8_0: weights (and activations) per scale

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Calls f(std::integral_constant<int, M>) for a runtime row count 1 <= M <= 8, so the
// register-blocked kernels get M as a template argument.
template <typename F>
void with_rows(int64_t M, F&& f) {
  switch (M) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// Any row count M >= 1, 8 rows per pass (the registers hold 8 rows' accumulators, so the
// weights stream once per 8 rows): calls f(m0, std::integral_constant<int, rows>) per pass.
template <typename F>
void in_row_passes(int64_t M, F&& f) {
  for (int64_t m0 = 0; m0 < M; m0 += 8)
    with_rows(std::min<int64_t>(8, M - m0), [&](auto m) { f(m0, m); });
}

// The raw pointer of an optional bf16 [N] bias (nullptr without one), checked.
inline const uint16_t* bias_ptr(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N && bias->is_contiguous(),
              "bias must be a contiguous bf16 [N] tensor");
  return reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>());
}

// fp32 y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with N split across the threads. For a few dozen
// rows (a CDLM block step) MKL's GEMM runs on one core; one GEMM per thread on a slice of W uses
// them all (measured 1.6x at M = 32 on 2 cores, and never slower). Same arithmetic per output.
inline torch::Tensor linear_split(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shape mismatch");
  const int64_t M = x.size(0), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const int64_t parts = std::max<int64_t>(1, at::get_num_threads());
  const int64_t chunk = (N + parts - 1) / parts;
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    // Worker threads do not inherit the caller's thread-local modes: restore inference mode
    // (writing into an inference tensor outside it is an error) and turn grad mode off (the
    // caller only gets here when autograd has nothing to record; out= ops refuse otherwise).
    c10::InferenceMode inference_guard(inference);
    at::NoGradGuard no_grad;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = i * chunk, n1 = std::min(N, n0 + chunk);
      if (n0 >= n1) continue;
      auto out = y.narrow(1, n0, n1 - n0);
      at::mm_out(out, x, w.narrow(0, n0, n1 - n0).t());
      if (bias.has_value() && bias->defined()) out.add_(bias->narrow(0, n0, n1 - n0));
    }
  });
  return y;
}

// W [N, K] bf16 -> [ceil(N/16), K/2, 16] int32: word (t, kp, c) holds W[16t + c, 2kp] in its
// low half and W[16t + c, 2kp + 1] in its high half (zeros past N).
inline torch::Tensor pack_bf16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "contiguous bf16 [N, K] weight");
  const int64_t N = w.size(0), K = w.size(1), K2 = K / 2, tiles = (N + 15) / 16;
  TORCH_CHECK(K % 2 == 0, "K must be even");
  auto out = torch::zeros({tiles, K2, 16}, w.options().dtype(torch::kInt32));
  auto src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto dst = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t c = 0; c < 16 && t * 16 + c < N; ++c) {
        const uint16_t* row = src + (t * 16 + c) * K;
        for (int64_t kp = 0; kp < K2; ++kp)
          dst[(t * K2 + kp) * 16 + c] = uint32_t(row[2 * kp]) | (uint32_t(row[2 * kp + 1]) << 16);
      }
  });
  return out;
}

// codes int8 [N, K] (K a multiple of 32), scales fp32 [N, K / 32] -> {packed u8 [tiles, K/32,
// 8, 16, 4] (code + 128, zero rows past N), scales fp16 [tiles, K/32, 16]}.
inline std::vector<torch::Tensor> pack_q8(torch::Tensor codes, torch::Tensor scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kInt8 && codes.is_contiguous(),
              "contiguous int8 [N, K] codes");
  const int64_t N = codes.size(0), K = codes.size(1), nb = K / kQ8Block, tiles = (N + 15) / 16;
  TORCH_CHECK(K % kQ8Block == 0, "K must be a multiple of 32");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == nb &&
                  scales.scalar_type() == torch::kFloat32,
              "fp32 [N, K / 32] scales");
  auto packed = torch::full({tiles, nb, 8, 16, 4}, 128, codes.options().dtype(torch::kUInt8));
  auto half = torch::zeros({tiles, nb, 16}, codes.options().dtype(torch::kFloat16));
  auto s = scales.contiguous();
  const int8_t* src = codes.data_ptr<int8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  at::Half* hp = half.data_ptr<at::Half>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t c = 0; c < 16 && t * 16 + c < N; ++c) {
        const int64_t n = t * 16 + c;
        for (int64_t b = 0; b < nb; ++b) {
          hp[(t * nb + b) * 16 + c] = at::Half(sp[n * nb + b]);
          for (int64_t k = 0; k < kQ8Block; ++k)
            dst[((((t * nb + b) * 8 + k / 4) * 16 + c) * 4) + k % 4] =
                uint8_t(int(src[n * K + b * kQ8Block + k]) + 128);
        }
      }
  });
  return {packed, half};
}

// ---- What each build defines, and the ops made of them the same way in both ---------------------
// One row of RMSNorm with HF's rounding order (normalize in fp32, round to bf16, multiply by
// the bf16 weight, round again).
void norm_row(const uint16_t* x, const uint16_t* w, at::BFloat16* y, int64_t K, float eps);

// Queries against cached keys: query t reads cache row rows[t], slots [0, lens[t]) (the
// build's comment has the layout).
torch::Tensor attend_rows(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const std::vector<int64_t>& rows, const std::vector<int64_t>& lens,
                          double scale, const c10::optional<torch::Tensor>& bias);

// Rows [0, M) of a row-wise op as ranges over the threads, f(m0, m1) each: a prefill's
// thousands of rows in parallel, a decode step's few (fewer than kRowGrain) on the calling
// thread. The ops are memory-bound: torch's unfused fp32 RMSNorm over 8K rows of 576 took
// ~15 ms, most of it faulting in its fresh fp32 temporaries; these take ~1 ms.
constexpr int64_t kRowGrain = 64;
template <typename F>
void over_rows(int64_t M, F&& f) {
  at::parallel_for(0, M, kRowGrain, [&](int64_t m0, int64_t m1) { f(m0, m1); });
}

// add_rms_norm_bf16's arguments, checked once for both builds: contiguous bf16 x and
// residual [M, K] of one shape, weight [K].
inline void check_add_rms_norm(const torch::Tensor& x, const torch::Tensor& r,
                               const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && r.is_contiguous() && w.is_contiguous(),
              "contiguous [M, K]");
  TORCH_CHECK(x.sizes() == r.sizes(), "x and residual differ in shape");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && r.scalar_type() == at::kBFloat16 &&
                  w.scalar_type() == at::kBFloat16 && w.numel() == x.size(1),
              "bf16 x, residual [M, K] and weight [K]");
}

// y = RMSNorm(x) * w for x [M, K] bf16.
inline torch::Tensor rms_norm_bf16(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous(), "contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
                  w.numel() == x.size(1), "bf16 x [M, K] and weight [K]");
  auto y = torch::empty_like(x);
  const int64_t K = x.size(1);
  auto xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto yp = y.data_ptr<at::BFloat16>();
  over_rows(x.size(0), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) norm_row(xp + m * K, wp, yp + m * K, K, float(eps));
  });
  return y;
}

// One query per row: row b attends to its slots [0, lens[b]).
inline torch::Tensor decode_attention_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                           std::vector<int64_t> lens, double scale,
                                           c10::optional<torch::Tensor> bias) {
  std::vector<int64_t> rows(q.size(0));
  for (size_t b = 0; b < rows.size(); ++b) rows[b] = int64_t(b);
  return attend_rows(q, k, v, rows, lens, scale, bias);
}

// ---- KVzip's key scores (engine.compaction.attention_matching.repeat_max_scores) ------------
//
// For N repeat queries and a row of C slots, of which the first `region` are the keys being
// scored: s = q k^T * scale + bias, lse_r = log sum_j exp(s[r, j]) (each query's softmax
// normalizer over the whole row), and best[j] = max(best[j], max_r s[r, j] - lse_r) for
// j < region: the log of each key's largest softmax weight, kept in the log domain so that each
// score costs one exp (the row pass) and a subtract and a max (the column pass), both on a block
// of kScoreRows queries that stays in the caches. For one KV head at 8K tokens (24.6K queries x
// 8,256 slots, 2 cores, AVX512) torch's softmax and column maximum took 0.25 s beside the
// GEMM's 0.2 s; these passes 0.03 s.
//
// Each thread takes whole blocks with its own buffer and maxima, merged at the end: one
// parallel region per call. One region per block (for the GEMM, then each pass) was as fast on
// an idle machine and 15x slower beside another busy process (a thread waiting at every
// barrier for one the OS had descheduled: 17K blocks per compaction at 8K tokens).
constexpr int64_t kScoreRows = 128;

// One block's rows: s [M, C] (row stride C) -> lse [M], then the running maxima.
template <typename RowLse, typename ColMax>
inline void reduce_block(const float* s, int64_t M, int64_t C, int64_t region, float* lse,
                         float* best, RowLse row_lse, ColMax col_max) {
  for (int64_t r = 0; r < M; ++r) lse[r] = row_lse(s + r * C, C);
  constexpr int64_t kCols = 64;
  for (int64_t j0 = 0; j0 < region; j0 += kCols)
    col_max(s, M, C, lse, j0, std::min(region, j0 + kCols), best);
}

// `score(a, rows, s)` writes the scores of queries [a, a + rows) into s [rows, C] on the calling
// thread; best [region] fp32 is updated in place.
template <typename Score, typename RowLse, typename ColMax>
inline void repeat_max_with(int64_t N, int64_t C, int64_t region, torch::Tensor& best,
                            Score score, RowLse row_lse, ColMax col_max) {
  TORCH_CHECK(0 < region && region <= C, "0 < region <= C");
  TORCH_CHECK(best.dim() == 1 && best.scalar_type() == at::kFloat && best.is_contiguous() &&
                  best.size(0) == region && best.device().is_cpu(),
              "best must be a contiguous fp32 [region] CPU tensor");
  float* out = best.data_ptr<float>();
  const int64_t blocks = (N + kScoreRows - 1) / kScoreRows;
  const bool inference = c10::InferenceMode::is_enabled();
  std::mutex merge;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode inference_guard(inference);  // as linear_split: modes are per thread
    at::NoGradGuard no_grad;
    std::vector<float> s(std::min(N, kScoreRows) * C), lse(kScoreRows), mine(region, -INFINITY);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t a = b * kScoreRows, rows = std::min(kScoreRows, N - a);
      score(a, rows, s.data());
      reduce_block(s.data(), rows, C, region, lse.data(), mine.data(), row_lse, col_max);
    }
    std::lock_guard<std::mutex> lock(merge);
    for (int64_t j = 0; j < region; ++j) out[j] = std::max(out[j], mine[j]);
  });
}

// repeat_max's scores' arguments: contiguous q [N, D] and keys [C, D] of one dtype, bias fp32
// [C] (best and region are repeat_max_with's to check).
inline void check_repeat_max(const torch::Tensor& q, const torch::Tensor& keys,
                             const torch::Tensor& bias) {
  TORCH_CHECK(q.dim() == 2 && keys.dim() == 2 && q.size(1) == keys.size(1) &&
                  q.scalar_type() == keys.scalar_type() && q.is_contiguous() &&
                  keys.is_contiguous(),
              "q [N, D] and keys [C, D]: contiguous, one dtype");
  TORCH_CHECK(bias.dim() == 1 && bias.scalar_type() == at::kFloat && bias.is_contiguous() &&
                  bias.size(0) == keys.size(0),
              "bias must be a contiguous fp32 [C] tensor");
}

// Scores in fp32 by one-threaded GEMMs (MKL inside a parallel region runs on its thread).
template <typename RowLse, typename ColMax>
inline void repeat_max_fp32(const torch::Tensor& q, const torch::Tensor& keys,
                            const torch::Tensor& bias, double scale, int64_t region,
                            torch::Tensor& best, RowLse row_lse, ColMax col_max) {
  check_repeat_max(q, keys, bias);
  TORCH_CHECK(q.scalar_type() == at::kFloat, "fp32 q and keys");
  const int64_t C = keys.size(0);
  const auto kt = keys.t();
  repeat_max_with(q.size(0), C, region, best, [&](int64_t a, int64_t rows, float* s) {
    auto out = torch::from_blob(s, {rows, C}, q.options());
    at::addmm_out(out, bias, q.narrow(0, a, rows), kt, 1.0, scale);
  }, row_lse, col_max);
}
