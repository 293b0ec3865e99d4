"""Weight names: checkpoint formats <-> our native (fused) module names.

Three layers of names:
- checkpoint names: what a release's safetensors hold (HF Llama/Qwen/Dream names, or LLaDA's
  `model.transformer.blocks.N.*`);
- canonical names: the HF Llama/Qwen layout (`model.layers.N.self_attn.q_proj.weight`), which
  every format maps onto one to one;
- native names: our modules, with q/k/v and gate/up fused (`layers.N.attn.qkv_proj.weight`).

`to_native` goes checkpoint -> native for loading; `to_checkpoint` goes back, so models we
train can be saved in a real release's format and loaded by the same path as a download.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from cdlm_serve.models.config import ModelConfig

# LLaDA checkpoint suffix (under model.transformer.blocks.N.) -> canonical suffix.
_LLADA_BLOCK = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_proj": "mlp.gate_proj",  # LLaDA's ff_proj is the gate (silu applied to it)
    "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ff_norm": "post_attention_layernorm",
}
_LLADA_TOP = {
    "model.transformer.wte.weight": "model.embed_tokens.weight",
    "model.transformer.ln_f.weight": "model.norm.weight",
    "model.transformer.ff_out.weight": "lm_head.weight",
}
_LLADA_BLOCK_RE = re.compile(r"model\.transformer\.blocks\.(\d+)\.(\w+)\.(weight|bias)")
_CANON_BLOCK_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")

# Canonical per-layer suffix -> native suffix, for the tensors that are not fused.
_NATIVE_PLAIN = {
    "self_attn.o_proj": "attn.o_proj",
    "self_attn.q_norm": "attn.q_norm",
    "self_attn.k_norm": "attn.k_norm",
    "mlp.down_proj": "mlp.down_proj",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "mlp_norm",
}
# Gemma's four norms per block: its post_attention_layernorm comes after attention (before the
# residual add), where Llama's is the MLP's pre-norm.
_NATIVE_PLAIN_SANDWICH = {
    **{k: v for k, v in _NATIVE_PLAIN.items() if k != "post_attention_layernorm"},
    "post_attention_layernorm": "attn_post_norm",
    "pre_feedforward_layernorm": "mlp_norm",
    "post_feedforward_layernorm": "mlp_post_norm",
}
_FUSED = {
    "attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# Tensors some checkpoints carry that the model recomputes (rotary tables).
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def llada_to_canonical(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    return _rename(sd, _LLADA_TOP, _LLADA_BLOCK, _LLADA_BLOCK_RE, "model.layers", "LLaDA weight")


def canonical_to_llada(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    top = {v: k for k, v in _LLADA_TOP.items()}
    block = {v: k for k, v in _LLADA_BLOCK.items()}
    return _rename(sd, top, block, _CANON_BLOCK_RE, "model.transformer.blocks", "canonical name")


def _rename(
    sd: dict[str, Tensor],
    top: dict[str, str],
    block: dict[str, str],
    block_re: re.Pattern[str],
    prefix: str,
    what: str,
) -> dict[str, Tensor]:
    """Rename top-level weights by `top` and per-layer ones (`block_re`: layer, name, suffix)
    by `block`, under `prefix`.<layer>; KeyError for a name neither knows."""
    out: dict[str, Tensor] = {}
    for name, t in sd.items():
        if name in top:
            out[top[name]] = t
            continue
        m = block_re.fullmatch(name)
        if m is None or m.group(2) not in block:
            raise KeyError(f"unexpected {what} {name!r}")
        out[f"{prefix}.{m.group(1)}.{block[m.group(2)]}.{m.group(3)}"] = t
    return out


def to_canonical(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    sd = {k: v for k, v in sd.items() if not _IGNORED.fullmatch(k)}
    return llada_to_canonical(sd) if cfg.weight_format == "llada" else sd


def _plain_names(cfg: ModelConfig) -> dict[str, str]:
    return _NATIVE_PLAIN_SANDWICH if cfg.sandwich_norms else _NATIVE_PLAIN


def _shift_norms(sd: dict[str, Tensor], offset: float) -> dict[str, Tensor]:
    """Norm weights w of a family whose norms scale by (offset + w) (Gemma's 1 + w) become
    the plain scales our norms multiply by (and back, with -offset). In fp32: a bf16 1 + w
    would round w's small values away."""
    if offset == 0.0:
        return sd
    return {
        k: (v.float() + offset).to(v.dtype) if k.endswith("norm.weight") else v
        for k, v in sd.items()
    }


def canonical_to_native(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Rename and fuse; raises KeyError naming any tensor that is missing or left over."""
    src = _shift_norms(dict(sd), cfg.norm_offset)
    out: dict[str, Tensor] = {}

    def take(name: str) -> Tensor:
        try:
            return src.pop(name)
        except KeyError:
            raise KeyError(f"checkpoint lacks {name!r}") from None

    out["embed_tokens.weight"] = take("model.embed_tokens.weight")
    out["norm.weight"] = take("model.norm.weight")
    if cfg.tie_word_embeddings:
        src.pop("lm_head.weight", None)  # some tied checkpoints store a copy anyway
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        for canon, native in _plain_names(cfg).items():
            for kind in ("weight", "bias"):
                if pre + f"{canon}.{kind}" in src:
                    out[f"layers.{i}.{native}.{kind}"] = take(pre + f"{canon}.{kind}")
        for native, parts in _FUSED.items():
            out[f"layers.{i}.{native}.weight"] = torch.cat(
                [take(pre + f"{p}.weight") for p in parts], dim=0
            )
            if pre + f"{parts[0]}.bias" in src:
                out[f"layers.{i}.{native}.bias"] = torch.cat(
                    [take(pre + f"{p}.bias") for p in parts], dim=0
                )
    if src:
        raise KeyError(f"unexpected checkpoint tensors: {sorted(src)[:8]}")
    return out


def native_to_canonical(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {
        "model.embed_tokens.weight": sd["embed_tokens.weight"],
        "model.norm.weight": sd["norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    q_out = cfg.num_heads * cfg.head_dim
    kv_out = cfg.num_kv_heads * cfg.head_dim
    split_sizes = {
        "attn.qkv_proj": [q_out, kv_out, kv_out],
        "mlp.gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size],
    }
    for i in range(cfg.num_layers):
        pre = f"layers.{i}."
        for canon, native in _plain_names(cfg).items():
            for kind in ("weight", "bias"):
                if pre + f"{native}.{kind}" in sd:
                    out[f"model.layers.{i}.{canon}.{kind}"] = sd[pre + f"{native}.{kind}"]
        for native, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                if pre + f"{native}.{kind}" not in sd:
                    continue
                pieces = torch.split(sd[pre + f"{native}.{kind}"], split_sizes[native], dim=0)
                for part, piece in zip(parts, pieces, strict=True):
                    out[f"model.layers.{i}.{part}.{kind}"] = piece.contiguous()
    return _shift_norms(out, -cfg.norm_offset)


def to_native(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    return canonical_to_native(to_canonical(sd, cfg), cfg)


Q8 = tuple[Tensor, Tensor]  # Q8_0 codes int8 [N, K], scales fp32 [N, K / 32]


def native_q8(q8: dict[str, Q8], cfg: ModelConfig) -> dict[str, Q8]:
    """Q8_0 matrices under canonical weight names -> under our module names
    (`layers.N.attn.qkv_proj`, `lm_head`, or `embed_tokens` for a tied head), fused the way
    `canonical_to_native` fuses weights: rows concatenated, codes and scales alike. A fused
    module whose parts are not all Q8_0 is left out."""
    out: dict[str, Q8] = {}
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    if head in q8:
        out["embed_tokens" if cfg.tie_word_embeddings else "lm_head"] = q8[head]
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        for canon, native in _NATIVE_PLAIN.items():
            if pre + f"{canon}.weight" in q8:
                out[f"layers.{i}.{native}"] = q8[pre + f"{canon}.weight"]
        for native, parts in _FUSED.items():
            found = [q8.get(pre + f"{p}.weight") for p in parts]
            if all(f is not None for f in found):
                codes, scales = zip(*found, strict=True)
                out[f"layers.{i}.{native}"] = (torch.cat(codes), torch.cat(scales))
    return out


def to_checkpoint(sd: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    canon = native_to_canonical(sd, cfg)
    return canonical_to_llada(canon) if cfg.weight_format == "llada" else canon
