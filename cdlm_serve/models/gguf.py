"""Read a GGUF file (llama.cpp's format) into an HF config dict and HF-named fp32 weights.

Weights are dequantized with the `gguf` package. llama.cpp's converter permutes the q/k rows of
Llama-architecture models into its interleaved RoPE layout; we undo that so the weights match
the "rotate half" layout of the HF release. For Gemma 3 it stores every norm weight as 1 + w
(Gemma's norms scale by 1 + w); we take the 1 back off, so the weights are the HF release's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

SUPPORTED_ARCHS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# What llama.cpp hard-codes for Gemma 3 rather than storing (its llama-model.cpp): every 6th
# layer is global, the sliding-window layers rotate with base 10K.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10_000.0

_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3's four norms per block: llama.cpp's ffn_norm is its pre-feedforward norm.
_GEMMA3_BLOCK = {
    **_BLOCK,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFError(ValueError):
    pass


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(reader: GGUFReader) -> dict[str, Any]:
    """An HF-style config.json dict from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"GGUF architecture {arch!r} not supported ({sorted(SUPPORTED_ARCHS)})")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise GGUFError("GGUF with rope_freqs (Llama-3.1 rope scaling) is not supported yet")

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = key("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens", []))
    cfg: dict[str, Any] = {
        "architectures": [SUPPORTED_ARCHS[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 4096)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    if arch == "gemma3":
        cfg |= _gemma3_fields(cfg, int(key("attention.sliding_window", 4096)))
    return cfg


def _gemma3_fields(cfg: dict[str, Any], window: int) -> dict[str, Any]:
    """What an HF Gemma3TextConfig holds beyond the Llama-shaped fields."""
    layers = cfg["num_hidden_layers"]
    head_dim = cfg["head_dim"]
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    return {
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        # llama.cpp: 27B scales queries by (hidden / heads) ** -0.5, the others by head_dim's.
        "query_pre_attn_scalar": hidden // heads if (hidden, heads) == (5376, 32) else head_dim,
        "sliding_window": window,
        "layer_types": [
            "full_attention" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
            for i in range(layers)
        ],
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
    }


def _f32(value: float) -> float:
    """GGUF stores these as float32: print 1e-05, not 9.999999747378752e-06."""
    return float(f"{float(value):.7g}")


def _hf_name(name: str, gemma: bool = False) -> str:
    if name in _TOP:
        return _TOP[name]
    block = _GEMMA3_BLOCK if gemma else _BLOCK
    m = _BLOCK_RE.fullmatch(name)
    if m is None or m.group(2) not in block:
        raise GGUFError(f"unexpected GGUF tensor {name!r}")
    return f"model.layers.{m.group(1)}.{block[m.group(2)]}.{m.group(3)}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> two halves per head)."""
    rows = w.shape[0]
    # llama.cpp viewed each head's rows as [2, half] and stored them as [half, 2].
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rows_in_hf_order(arr: np.ndarray, name: str, cfg: dict[str, Any]) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation where it applies (rows are outputs: weights,
    codes and per-block scales alike)."""
    if cfg["model_type"] != "llama":
        return arr
    if name.endswith("self_attn.q_proj.weight"):
        return _unpermute(arr, cfg["num_attention_heads"])
    if name.endswith("self_attn.k_proj.weight"):
        return _unpermute(arr, cfg["num_key_value_heads"])
    return arr


def iter_weights(reader: GGUFReader, cfg: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, fp32 tensor [out, in]) for every tensor, dequantized."""
    gemma = cfg["model_type"] == "gemma3_text"
    for t in reader.tensors:
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            arr = np.asarray(t.data, dtype=np.float32)
        else:
            arr = dequantize(t.data, t.tensor_type)
        # GGUF lists dims fastest-first; numpy/torch want [out, in].
        arr = arr.reshape([int(d) for d in reversed(t.shape)])
        name = _hf_name(t.name, gemma)
        if gemma and name.endswith("norm.weight"):
            arr = arr - 1.0  # llama.cpp stored 1 + w
        arr = _rows_in_hf_order(arr, name, cfg)
        yield name, torch.tensor(arr)  # a copy: the reader's arrays are read-only memmaps


Q8_0_BLOCK_BYTES = 34  # an fp16 scale, then 32 int8 codes


def quantized_types(reader: GGUFReader) -> dict[str, int]:
    """How many tensors of each quantized type (Q8_0, Q4_K, ...) the file holds."""
    counts: dict[str, int] = {}
    for t in reader.tensors:
        if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


def iter_q8_0(
    reader: GGUFReader, cfg: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """Yield (HF name, codes int8 [out, in], scales fp32 [out, in / 32]) for every Q8_0 matrix,
    exactly as stored: what `iter_weights` dequantizes is codes x scales, and int8 serving
    takes these rather than quantizing those values again (which a bf16 copy rounds)."""
    gemma = cfg["model_type"] == "gemma3_text"
    for t in reader.tensors:
        if t.tensor_type != GGMLQuantizationType.Q8_0 or len(t.shape) != 2:
            continue
        cols, rows = (int(d) for d in t.shape)
        blocks = np.asarray(t.data, dtype=np.uint8).reshape(rows, cols // 32, Q8_0_BLOCK_BYTES)
        scales = blocks[..., :2].copy().view(np.float16).reshape(rows, cols // 32)
        codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
        name = _hf_name(t.name, gemma)
        codes = _rows_in_hf_order(codes, name, cfg)
        scales = _rows_in_hf_order(scales, name, cfg)
        yield (
            name,
            torch.from_numpy(np.ascontiguousarray(codes)),
            torch.tensor(scales.astype(np.float32)),
        )


def open_gguf(path: str | Path) -> GGUFReader:
    try:
        return GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise GGUFError(f"cannot read GGUF {path}: {e}") from e
