// The whole decode step in one call (`DecodeStack`), for both builds: it calls the ops of the
// kernel file that includes it (cpu_decode.cpp: AVX512, avx2_decode.cpp: AVX2) by name.
// Included inside that file's ISA namespace, after the ops (and common.h) are defined.
#pragma once

// ---- The whole decode step in one call ---------------------------------------------------
//
// Runs every layer for a set of new tokens against their rows' KV caches: one token per row
// (a decode step), a run of tokens in one row (a prompt), or both in one call. Calls the
// kernels above directly: the same arithmetic as the Python path with the fused ops, minus
// ~1,000 Python-level calls per step, and each weight matrix streams from memory once for
// every token of the step.
namespace {

struct LayerWeights {
  torch::Tensor attn_norm, qkv_w, qkv_b, q_norm, k_norm, o_w, o_b, mlp_norm, gate_up_w,
      gate_up_b, down_w, down_b;
  torch::Tensor qkv_p, o_p, gate_up_p, down_p;  // pack_bf16 of the matrices (when packed)
  // pack_q8 of the matrices (int8 weights: packed codes, fp16 scales), used instead when set.
  torch::Tensor qkv_q, qkv_qs, o_q, o_qs, gate_up_q, gate_up_qs, down_q, down_qs;
  // Gemma's sandwich: the attention's and the MLP's outputs normed before their residual adds
  // (undefined where a model has none).
  torch::Tensor post_attn_norm, post_mlp_norm;
  bool local = false;  // a sliding-window layer: its K/V live in the window ring
};

// The sliding-window layers' side of a step (`DecodeStack::forward_windowed`): per window
// layer its ring [B, Hkv, R, D]; token t's ring slot; a bias [B, Hkv, R] fp32 that hides each
// row's slots outside its token's window (-inf); their own RoPE [T, D].
struct Window {
  std::vector<torch::Tensor> keys, values;
  std::vector<int64_t> slots;
  torch::Tensor bias, cos, sin;
};

// pack_q8 of optional (codes, scales) into (packed, scales): both undefined without codes.
void maybe_pack_q8(const c10::optional<torch::Tensor>& codes,
                   const c10::optional<torch::Tensor>& scales, torch::Tensor& packed,
                   torch::Tensor& packed_scales) {
  if (!codes.has_value() || !codes->defined()) return;
  TORCH_CHECK(scales.has_value() && scales->defined(), "int8 codes without their scales");
  if (codes->scalar_type() == torch::kUInt8 && codes->dim() == 5) {  // packed already
    packed = *codes;
    packed_scales = *scales;
    return;
  }
  auto p = pack_q8(*codes, *scales);
  packed = p[0];
  packed_scales = p[1];
}

torch::Tensor opt(const c10::optional<torch::Tensor>& t) {
  return t.has_value() ? *t : torch::Tensor();
}

c10::optional<torch::Tensor> maybe(const torch::Tensor& t) {
  return t.defined() ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// The packed copy where the packing applies (K even), else none: `lin` then uses the row kernel.
torch::Tensor maybe_pack(const torch::Tensor& w) {
  return w.size(1) % 2 == 0 ? pack_bf16(w) : torch::Tensor();
}

}  // namespace

class DecodeStack {
 public:
  DecodeStack(std::vector<std::vector<c10::optional<torch::Tensor>>> layers,
              torch::Tensor final_norm, int64_t heads, int64_t kv_heads, int64_t head_dim,
              double eps, double scale, bool packed, torch::Tensor head,
              c10::optional<torch::Tensor> head_codes, c10::optional<torch::Tensor> head_scales)
      : DecodeStack(layers, final_norm, heads, kv_heads, head_dim, eps, scale, packed, head,
                    head_codes, head_scales, {}, false) {}

  // `local[i]`: layer i attends within a sliding window (empty: none does); `gelu`: the MLP's
  // gate is GELU (tanh approximation) instead of SiLU (Gemma 3).
  DecodeStack(std::vector<std::vector<c10::optional<torch::Tensor>>> layers,
              torch::Tensor final_norm, int64_t heads, int64_t kv_heads, int64_t head_dim,
              double eps, double scale, bool packed, torch::Tensor head,
              c10::optional<torch::Tensor> head_codes, c10::optional<torch::Tensor> head_scales,
              std::vector<bool> local, bool gelu)
      : final_norm_(final_norm), head_(head), H_(heads), Hkv_(kv_heads), D_(head_dim), eps_(eps),
        scale_(scale), gelu_(gelu) {
    TORCH_CHECK(local.empty() || local.size() == layers.size(), "a local flag per layer");
    maybe_pack_q8(head_codes, head_scales, head_q_, head_qs_);
    if (packed && !head_q_.defined()) head_p_ = maybe_pack(head);
    for (size_t i = 0; i < layers.size(); ++i) {
      const auto& l = layers[i];
      // 12 tensors, then optionally int8 (codes, scales) of qkv, o, gate_up and down, then
      // optionally the two sandwich norms.
      const size_t extra = l.size() - 12;
      TORCH_CHECK(l.size() >= 12 && (extra == 0 || extra == 2 || extra == 8 || extra == 10),
                  "12, 14, 20 or 22 tensors per layer");
      LayerWeights w{*l[0], *l[1], opt(l[2]), opt(l[3]), opt(l[4]), *l[5], opt(l[6]), *l[7],
                     *l[8], opt(l[9]), *l[10], opt(l[11])};
      if (extra >= 8) {
        maybe_pack_q8(l[12], l[13], w.qkv_q, w.qkv_qs);
        maybe_pack_q8(l[14], l[15], w.o_q, w.o_qs);
        maybe_pack_q8(l[16], l[17], w.gate_up_q, w.gate_up_qs);
        maybe_pack_q8(l[18], l[19], w.down_q, w.down_qs);
      }
      if (extra % 8 == 2) {
        w.post_attn_norm = *l[l.size() - 2];
        w.post_mlp_norm = *l[l.size() - 1];
      }
      w.local = !local.empty() && local[i];
      if (packed && !w.qkv_q.defined()) {
        w.qkv_p = maybe_pack(w.qkv_w);
        w.o_p = maybe_pack(w.o_w);
        w.gate_up_p = maybe_pack(w.gate_up_w);
        w.down_p = maybe_pack(w.down_w);
      }
      global_ += !w.local;
      layers_.push_back(w);
    }
  }

  // x [T, hidden] embedded new tokens; keys/values per global layer [B, Hkv, S, D]. Token t
  // belongs to cache row rows[t], goes to slot slots[t] and attends to that row's slots
  // [0, attend[t]). attend = slots + 1 is causal: one token per row is a decode step, a run of
  // consecutive slots in one row a prompt, and both can share one call; a block of tokens
  // that all attend to the block's end is a diffusion block (bidirectional within itself).
  // cos/sin [T, D]. Writes the new K/V, returns the final hidden states [T, hidden]. The
  // caller commits the slots (or not: a diffusion block rewrites its scratch slots).
  torch::Tensor forward(torch::Tensor x, std::vector<torch::Tensor> keys,
                        std::vector<torch::Tensor> values,
                        c10::optional<std::vector<torch::Tensor>> biases,
                        std::vector<int64_t> rows, std::vector<int64_t> slots,
                        std::vector<int64_t> attend, torch::Tensor cos, torch::Tensor sin) {
    return run(x, keys, values, biases, rows, slots, attend, cos, sin, nullptr);
  }

  // `forward` for a model with sliding-window layers (Gemma 3), one token per row (the window
  // bias is a row's): the window layers write token t's K/V at ring slot ring_slots[t] of
  // their ring (ring_keys/ring_values, one per window layer), attend over the whole ring
  // under ring_bias [B, Hkv, R] (-inf: outside the token's window) and rotate with
  // ring_cos/ring_sin [T, D].
  torch::Tensor forward_windowed(torch::Tensor x, std::vector<torch::Tensor> keys,
                                 std::vector<torch::Tensor> values,
                                 c10::optional<std::vector<torch::Tensor>> biases,
                                 std::vector<int64_t> rows, std::vector<int64_t> slots,
                                 std::vector<int64_t> attend, torch::Tensor cos,
                                 torch::Tensor sin, std::vector<torch::Tensor> ring_keys,
                                 std::vector<torch::Tensor> ring_values,
                                 std::vector<int64_t> ring_slots, torch::Tensor ring_bias,
                                 torch::Tensor ring_cos, torch::Tensor ring_sin) {
    const Window window{ring_keys, ring_values, ring_slots, ring_bias, ring_cos, ring_sin};
    return run(x, keys, values, biases, rows, slots, attend, cos, sin, &window);
  }

  // Logits [B, vocab] of final hidden states [B, hidden] through the output head.
  torch::Tensor logits(torch::Tensor h) {
    return lin(h.contiguous(), head_, head_p_, {}, head_q_, head_qs_);
  }

  // Whether the matrices run on int8 weights (every layer's, as built).
  bool int8() const { return !layers_.empty() && layers_[0].qkv_q.defined(); }

 private:
  torch::Tensor run(torch::Tensor x, const std::vector<torch::Tensor>& keys,
                    const std::vector<torch::Tensor>& values,
                    const c10::optional<std::vector<torch::Tensor>>& biases,
                    const std::vector<int64_t>& rows, const std::vector<int64_t>& slots,
                    const std::vector<int64_t>& attend, const torch::Tensor& cos,
                    const torch::Tensor& sin, const Window* window) {
    const int64_t T = x.size(0), W = (H_ + 2 * Hkv_) * D_;
    TORCH_CHECK((int64_t)keys.size() == global_ && (int64_t)values.size() == global_,
                "one cache per global layer");
    TORCH_CHECK((int64_t)rows.size() == T && (int64_t)slots.size() == T &&
                    (int64_t)attend.size() == T, "a row, a slot and a length per token");
    const int64_t local = (int64_t)layers_.size() - global_;
    TORCH_CHECK(local == 0 || (window != nullptr && (int64_t)window->keys.size() == local &&
                               (int64_t)window->values.size() == local &&
                               (int64_t)window->slots.size() == T),
                "a window ring per sliding-window layer and a ring slot per token");
    std::vector<int64_t> ring_lens;
    if (local) ring_lens.assign(T, window->keys[0].size(2));  // the whole ring, under the bias
    torch::Tensor residual, h;
    size_t g = 0, w = 0;  // the next global and window layer's cache
    for (size_t i = 0; i < layers_.size(); ++i) {
      const LayerWeights& L = layers_[i];
      if (i == 0) {
        residual = x;
        h = rms_norm_bf16(x, L.attn_norm, eps_);
      } else {
        auto hr = add_rms_norm_bf16(x, residual, L.attn_norm, eps_);
        h = hr[0];
        residual = hr[1];
      }
      torch::Tensor qkv = lin(h, L.qkv_w, L.qkv_p, L.qkv_b, L.qkv_q, L.qkv_qs);  // [T, W]
      if (L.q_norm.defined()) qk_norm(qkv, L.q_norm, L.k_norm);
      auto q = qkv.as_strided({T, H_, D_}, {W, D_, 1});
      torch::Tensor attn;
      if (L.local) {
        rope_inplace_bf16(qkv, window->cos, window->sin, H_ + Hkv_, D_);
        const torch::Tensor &k = window->keys[w], &v = window->values[w];
        write_cache(qkv, k, v, rows, window->slots);  // every new K/V before any attends
        attn = attend_rows(q, k, v, rows, ring_lens, scale_, window->bias);
        ++w;
      } else {
        rope_inplace_bf16(qkv, cos, sin, H_ + Hkv_, D_);
        write_cache(qkv, keys[g], values[g], rows, slots);
        c10::optional<torch::Tensor> bias =
            biases.has_value() ? c10::optional<torch::Tensor>((*biases)[g]) : c10::nullopt;
        attn = attend_rows(q, keys[g], values[g], rows, attend, scale_, bias);
        ++g;
      }
      torch::Tensor o = lin(attn, L.o_w, L.o_p, L.o_b, L.o_q, L.o_qs);
      if (L.post_attn_norm.defined()) o = rms_norm_bf16(o, L.post_attn_norm, eps_);
      auto hr = add_rms_norm_bf16(o, residual, L.mlp_norm, eps_);
      residual = hr[1];
      torch::Tensor gu = lin(hr[0], L.gate_up_w, L.gate_up_p, L.gate_up_b, L.gate_up_q,
                             L.gate_up_qs);
      torch::Tensor act = gelu_ ? gelu_mul_bf16(gu) : silu_mul_bf16(gu);
      x = lin(act, L.down_w, L.down_p, L.down_b, L.down_q, L.down_qs);
      if (L.post_mlp_norm.defined()) x = rms_norm_bf16(x, L.post_mlp_norm, eps_);
    }
    return add_rms_norm_bf16(x, residual, final_norm_, eps_)[0];
  }

  static torch::Tensor lin(const torch::Tensor& x, const torch::Tensor& w,
                           const torch::Tensor& packed, const torch::Tensor& b,
                           const torch::Tensor& q8 = {}, const torch::Tensor& q8_scales = {}) {
    if (q8.defined()) return linear_q8(x, q8, q8_scales, w.size(0), maybe(b));
    return packed.defined() ? linear_packed_bf16(x, packed, w.size(0), maybe(b))
                            : linear_bf16(x, w, maybe(b));
  }

  // Qwen3: RMSNorm over each q and k head before RoPE (HF rounding order), in place.
  void qk_norm(torch::Tensor& qkv, const torch::Tensor& qw, const torch::Tensor& kw) {
    const int64_t B = qkv.size(0), W = qkv.size(1);
    auto p = qkv.data_ptr<at::BFloat16>();
    auto qwp = reinterpret_cast<const uint16_t*>(qw.data_ptr<at::BFloat16>());
    auto kwp = reinterpret_cast<const uint16_t*>(kw.data_ptr<at::BFloat16>());
    std::vector<at::BFloat16> tmp(D_);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H_ + Hkv_; ++h) {
        at::BFloat16* head = p + b * W + h * D_;
        norm_row(reinterpret_cast<const uint16_t*>(head), h < H_ ? qwp : kwp, tmp.data(), D_,
                 float(eps_));
        std::memcpy(head, tmp.data(), D_ * sizeof(at::BFloat16));
      }
  }

  // k/v of each token (heads H.. and H+Hkv.. of qkv) into slot slots[t] of cache row rows[t].
  void write_cache(const torch::Tensor& qkv, const torch::Tensor& k, const torch::Tensor& v,
                   const std::vector<int64_t>& rows, const std::vector<int64_t>& slots) {
    const int64_t T = qkv.size(0), W = qkv.size(1), B = k.size(0), S = k.size(2);
    TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "contiguous cache buffers");
    auto src = qkv.data_ptr<at::BFloat16>();
    auto kp = k.data_ptr<at::BFloat16>();
    auto vp = v.data_ptr<at::BFloat16>();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(rows[t] >= 0 && rows[t] < B && slots[t] >= 0 && slots[t] < S,
                  "row or slot outside the cache");
      for (int64_t g = 0; g < Hkv_; ++g) {
        const int64_t dst = ((rows[t] * Hkv_ + g) * S + slots[t]) * D_;
        std::memcpy(kp + dst, src + t * W + (H_ + g) * D_, D_ * sizeof(at::BFloat16));
        std::memcpy(vp + dst, src + t * W + (H_ + Hkv_ + g) * D_, D_ * sizeof(at::BFloat16));
      }
    }
  }

  std::vector<LayerWeights> layers_;
  torch::Tensor final_norm_, head_, head_p_, head_q_, head_qs_;
  int64_t H_, Hkv_, D_;
  double eps_, scale_;
  bool gelu_ = false;
  int64_t global_ = 0;  // layers attending over the whole cache (the rest: a window)
};
