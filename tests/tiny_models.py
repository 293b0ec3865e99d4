"""Tiny random checkpoints in the exact on-disk formats of real releases, for fast tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from cdlm_serve.train.tokenizer import BOS_ID, EOS_ID, MASK_ID, PAD_ID, byte_tokenizer

VOCAB = 300  # 256 byte tokens + specials (ids 256..259) + spare ids (a padded embedding)
__all__ = ["BOS_ID", "EOS_ID", "MASK_ID", "PAD_ID", "VOCAB", "byte_tokenizer"]


# Gemma 3's switches at tiny sizes: a window of 8 (the tests' sequences run far past it), a
# global layer between two sliding ones, a query scale and local RoPE base of its own.
GEMMA3_TINY = {
    "head_dim": 16,
    "num_hidden_layers": 3,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "sliding_window": 8,
    "query_pre_attn_scalar": 20,
    "rope_theta": 20000.0,
    "rope_local_base_freq": 500.0,
}


def perturb(model: torch.nn.Module, seed: int = 0, scale: float = 0.05) -> None:
    """Random init leaves norms at 1 and biases at 0; make every tensor matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def hf_tiny(kind: str, folder: Path, **overrides) -> torch.nn.Module:
    """Save a tiny transformers model (llama | qwen2 | qwen3 | gemma3) with random weights to
    `folder` and return it (eval mode, fp32)."""
    import transformers as tf

    classes = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
    }
    config_cls, model_cls = classes[kind]
    kwargs = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }
    if kind == "qwen3":
        kwargs["head_dim"] = 16
    if kind == "gemma3":
        kwargs |= GEMMA3_TINY
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs)).eval()
    perturb(model)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return model


def kernel_llama(folder: Path) -> torch.nn.Module:
    """`hf_tiny("llama")` with head_dim 64 (hidden 128, 2 heads, 1 KV head), so that every
    fused CPU kernel applies to it (they need head_dim a multiple of 32)."""
    return hf_tiny(
        "llama",
        folder,
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=192,
    )


def wide_llama(folder: Path) -> torch.nn.Module:
    """`kernel_llama` widened to hidden 1024 (16 heads of 64, 4 KV heads, 2 layers): long sums,
    so a change in a reduction's order flips bf16 roundings often enough to show in the
    logprobs (at hidden 128 too few do). A 2K context, for prompts of several hundred tokens."""
    return hf_tiny(
        "llama",
        folder,
        hidden_size=1024,
        num_attention_heads=16,
        num_key_value_heads=4,
        intermediate_size=2048,
        max_position_embeddings=2048,
    )


def _random_llama_layout(cfg: dict, qkv_bias: bool, seed: int) -> dict[str, torch.Tensor]:
    """Canonical (HF Llama-named) random weights for a config dict with HF keys."""
    gen = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads

    def rnd(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    sd = {
        "model.embed_tokens.weight": rnd(cfg["vocab_size"], h, scale=0.5),
        "model.norm.weight": 1 + rnd(h),
        "lm_head.weight": rnd(cfg["vocab_size"], h),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = rnd(heads * d, h)
        sd[p + "self_attn.k_proj.weight"] = rnd(kv * d, h)
        sd[p + "self_attn.v_proj.weight"] = rnd(kv * d, h)
        sd[p + "self_attn.o_proj.weight"] = rnd(h, heads * d)
        if qkv_bias:
            sd[p + "self_attn.q_proj.bias"] = rnd(heads * d)
            sd[p + "self_attn.k_proj.bias"] = rnd(kv * d)
            sd[p + "self_attn.v_proj.bias"] = rnd(kv * d)
        sd[p + "mlp.gate_proj.weight"] = rnd(inter, h)
        sd[p + "mlp.up_proj.weight"] = rnd(inter, h)
        sd[p + "mlp.down_proj.weight"] = rnd(h, inter)
        sd[p + "input_layernorm.weight"] = 1 + rnd(h)
        sd[p + "post_attention_layernorm.weight"] = 1 + rnd(h)
    return sd


TINY_DIMS = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


# Scales that make a random tiny model decisive, as a trained one is: the top probability of a
# position spreads over ~0.1-0.99 (instead of ~0.02 over 300 tokens), and sharper attention makes
# the prediction depend on the position and the prompt (instead of copying one token).
PEAKED_SCALES = {"lm_head.weight": 6.0, "self_attn.": 3.0}


def _peaked(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical weights with `PEAKED_SCALES` applied (every attention projection and bias)."""
    out = {}
    for name, t in sd.items():
        scale = next((s for key, s in PEAKED_SCALES.items() if key in name), 1.0)
        out[name] = t * scale if scale != 1.0 else t
    return out


def dream_tiny(folder: Path, seed: int = 1) -> dict[str, torch.Tensor]:
    """A tiny checkpoint in Dream's release format; returns its (canonical) weights."""
    return _dream(folder, seed, peaked=False)


def dream_peaked(folder: Path, seed: int = 3) -> dict[str, torch.Tensor]:
    """`dream_tiny` with `PEAKED_SCALES`: confident, varied predictions (for tests whose
    decisions must not hinge on near-ties, e.g. against the reference decoders)."""
    return _dream(folder, seed, peaked=True)


def _dream(folder: Path, seed: int, peaked: bool) -> dict[str, torch.Tensor]:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["DreamModel"],
        "model_type": "Dream",
        "auto_map": {"AutoModel": "modeling_dream.DreamModel"},
        **TINY_DIMS,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "mask_token_id": MASK_ID,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
        "torch_dtype": "float32",
    }
    sd = _random_llama_layout(cfg, qkv_bias=True, seed=seed)
    if peaked:
        sd = _peaked(sd)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    byte_tokenizer().save_pretrained(folder)
    return sd


def llada_tiny(folder: Path, seed: int = 2) -> dict[str, torch.Tensor]:
    """A tiny checkpoint in LLaDA's release format (its own weight names); returns the
    weights under canonical names."""
    return _llada(folder, seed, peaked=False)


def llada_peaked(folder: Path, seed: int = 4) -> dict[str, torch.Tensor]:
    """`llada_tiny` with `PEAKED_SCALES` (see `dream_peaked`)."""
    return _llada(folder, seed, peaked=True)


def _llada(folder: Path, seed: int, peaked: bool) -> dict[str, torch.Tensor]:
    from cdlm_serve.models.weights import canonical_to_llada

    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "auto_map": {"AutoModel": "modeling_llada.LLaDAModelLM"},
        "d_model": TINY_DIMS["hidden_size"],
        "n_heads": TINY_DIMS["num_attention_heads"],
        "n_kv_heads": TINY_DIMS["num_attention_heads"],  # LLaDA-8B has no GQA
        "n_layers": TINY_DIMS["num_hidden_layers"],
        "mlp_hidden_size": TINY_DIMS["intermediate_size"],
        "mlp_ratio": 4,
        "vocab_size": VOCAB,
        "embedding_size": VOCAB,
        "weight_tying": False,
        "include_bias": False,
        "include_qkv_bias": False,
        "activation_type": "silu",
        "block_type": "llama",
        "layer_norm_type": "rms",
        "rms_norm_eps": 1e-5,
        "rope": True,
        "rope_theta": 500000.0,
        "max_sequence_length": 512,
        "mask_token_id": MASK_ID,
        "eos_token_id": EOS_ID,
        "bos_token_id": BOS_ID,
        "pad_token_id": PAD_ID,
    }
    hf_view = {
        **TINY_DIMS,
        "num_key_value_heads": TINY_DIMS["num_attention_heads"],
    }
    canonical = _random_llama_layout(hf_view, qkv_bias=False, seed=seed)
    if peaked:
        canonical = _peaked(canonical)
    save_file(
        canonical_to_llada(canonical), str(folder / "model.safetensors"), metadata={"format": "pt"}
    )
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    byte_tokenizer().save_pretrained(folder)
    return canonical
