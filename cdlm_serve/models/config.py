"""One model configuration for every family we run, parsed from an HF `config.json`.

The families differ only in a handful of switches (biases, q/k norm, weight names, attention
pattern, logit shift), so they share one dataclass and one transformer implementation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Family = Literal["llama", "qwen2", "qwen3", "gemma3", "dream", "llada"]
Activation = Literal["silu", "gelu_tanh"]
WeightFormat = Literal["hf", "llada"]

# Families whose checkpoints are masked-diffusion LMs (served by the DLM engine).
DIFFUSION_FAMILIES: frozenset[str] = frozenset({"dream", "llada"})


class ConfigError(ValueError):
    """A config.json we cannot serve, with a message that says why."""


@dataclass(slots=True)
class ModelConfig:
    family: Family
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # HF-style rope scaling dict ({"rope_type": "llama3", "factor": ...}) or None.
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    # Diffusion LMs only.
    mask_token_id: int | None = None
    # Dream predicts token i from hidden state i-1 ("shifted" logits); LLaDA does not.
    logits_shift: bool = False
    # Decoding defaults a DLM checkpoint may carry (block size B, confidence threshold tau).
    dlm_block_size: int | None = None
    dlm_threshold: float | None = None
    weight_format: WeightFormat = "hf"
    # Gemma-style switches (all off for the other families).
    hidden_act: Activation = "silu"  # the MLP gate's activation: act(gate) * up
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size)
    # Norms after attention and after the MLP too ("sandwich"), not only before them.
    sandwich_norms: bool = False
    # The checkpoint's norm weights w mean a scale of (norm_offset + w): Gemma's 1 + w.
    norm_offset: float = 0.0
    # query_pre_attn_scalar ** -0.5 where a family sets it; else head_dim ** -0.5.
    attention_scale: float | None = None
    # Sliding-window attention: a layer whose layer_types entry is "sliding_attention" sees
    # the last `sliding_window` positions only (itself included), with its own RoPE base.
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    rope_local_theta: float | None = None

    @property
    def scale(self) -> float:
        """The attention's score scale: query_pre_attn_scalar's where set, else head_dim's."""
        return self.attention_scale or self.head_dim**-0.5

    def is_local(self, layer: int) -> bool:
        """Whether a layer attends within the sliding window (its cache bounded by it)."""
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @property
    def local_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_local(i)]

    @property
    def global_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if not self.is_local(i)]

    @property
    def is_diffusion(self) -> bool:
        return self.family in DIFFUSION_FAMILIES

    @property
    def default_attention(self) -> Literal["causal", "bidirectional"]:
        return "bidirectional" if self.is_diffusion else "causal"

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"no config.json in {folder}") from e
        return cls.from_hf_dict(raw)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = str(raw.get("model_type", "")).lower()
        archs = [str(a) for a in raw.get("architectures") or []]
        if model_type == "llada":
            if any("moe" in a.lower() for a in archs):
                raise ConfigError("LLaDA-MoE checkpoints are not supported (dense LLaDA only)")
            return _llada_config(raw)
        if model_type == "dream":
            return _hf_layout_config(raw, "dream")
        if model_type in ("llama", "qwen2", "qwen3"):
            return _hf_layout_config(raw, model_type)  # type: ignore[arg-type]
        if model_type == "gemma3_text":
            return _gemma3_config(raw)
        if model_type == "gemma3":
            raise ConfigError(
                "Gemma 3 multimodal checkpoints are not supported: serve a text-only Gemma 3 "
                "(model_type gemma3_text, e.g. gemma-3-270m or gemma-3-1b)"
            )
        raise ConfigError(
            f"unsupported model_type {model_type!r} (architectures {archs}); supported: "
            "llama, qwen2, qwen3, gemma3_text, Dream, llada"
        )


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]


# End-of-turn tokens the instruct releases emit before their end-of-text padding; an answer
# ends there too. Only added when the vocabulary is large enough to hold them.
DREAM_IM_END = 151645
LLADA_EOT = 126348


def _with_turn_end(eos: list[int], turn_end: int | None, raw: dict[str, Any]) -> list[int]:
    vocab = int(raw.get("embedding_size") or raw.get("vocab_size") or 0)
    if turn_end is not None and turn_end < vocab and turn_end not in eos:
        return [*eos, turn_end]
    return eos


def _rope(raw: dict[str, Any], default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """Read rope theta and scaling from either the v4 (`rope_theta` + `rope_scaling`) or the
    v5 (`rope_parameters`) layout of transformers' configs."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    theta = raw.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", params.get("type", "default")) != "default":
            scaling = params
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        elif kind not in ("llama3", "linear"):
            raise ConfigError(f"unsupported rope scaling type {kind!r} (supported: llama3, linear)")
    else:
        scaling = None
    return float(theta if theta is not None else default_theta), scaling


def _hf_layout_config(raw: dict[str, Any], family: Family) -> ModelConfig:
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    theta, scaling = _rope(raw, 10000.0)
    is_qwen2_layout = family in ("qwen2", "dream")
    mask_id = raw.get("mask_token_id")
    return ModelConfig(
        family=family,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 (and Dream, which copies its layout) always has q/k/v biases, never an o bias.
        qkv_bias=True if is_qwen2_layout else bool(raw.get("attention_bias", False)),
        o_bias=False if is_qwen2_layout else bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_with_turn_end(
            _eos_list(raw.get("eos_token_id")), DREAM_IM_END if family == "dream" else None, raw
        ),
        pad_token_id=raw.get("pad_token_id"),
        mask_token_id=int(mask_id) if mask_id is not None else None,
        logits_shift=family == "dream",
        dlm_block_size=raw.get("cdlm_block_size"),
        dlm_threshold=raw.get("cdlm_threshold"),
    )


def _llada_config(raw: dict[str, Any]) -> ModelConfig:
    d_model = int(raw["d_model"])
    heads = int(raw["n_heads"])
    if raw.get("block_type", "llama") != "llama":
        raise ConfigError(f"unsupported LLaDA block_type {raw.get('block_type')!r}")
    if raw.get("activation_type", "silu") not in ("silu", "swiglu"):
        raise ConfigError(f"unsupported LLaDA activation {raw.get('activation_type')!r}")
    theta, _ = _rope(raw, 10000.0)
    include_bias = bool(raw.get("include_bias", False))
    mask_id = raw.get("mask_token_id", 126336)
    eos = _with_turn_end(_eos_list(raw.get("eos_token_id", 126081)), LLADA_EOT, raw)
    return ModelConfig(
        family="llada",
        # The embedding table may be padded past the tokenizer's vocab; logits cover it all.
        vocab_size=int(raw.get("embedding_size") or raw["vocab_size"]),
        hidden_size=d_model,
        intermediate_size=int(raw["mlp_hidden_size"]),
        num_layers=int(raw["n_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("n_kv_heads") or heads),
        head_dim=d_model // heads,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        max_position_embeddings=int(raw.get("max_sequence_length", 4096)),
        tie_word_embeddings=bool(raw.get("weight_tying", False)),
        qkv_bias=include_bias or bool(raw.get("include_qkv_bias", False)),
        o_bias=include_bias,
        mlp_bias=include_bias,
        bos_token_id=raw.get("bos_token_id", 126080),
        eos_token_ids=eos,
        pad_token_id=raw.get("pad_token_id", 126081),
        mask_token_id=int(mask_id),
        logits_shift=False,
        dlm_block_size=raw.get("cdlm_block_size"),
        dlm_threshold=raw.get("cdlm_threshold"),
        weight_format="llada",
    )


# Gemma's end of turn: its instruct releases end an answer there, before <eos>.
GEMMA_END_OF_TURN = 106
GEMMA_SLIDING_PATTERN = 6  # every 6th layer is global in configs that list no layer_types


def _gemma3_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(global theta, global scaling, local theta) from the v5 layout (`rope_parameters` per
    layer type) or the v4 one (`rope_theta`, `rope_scaling`, `rope_local_base_freq`)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        theta, scaling = _rope({"rope_parameters": full}, 1_000_000.0)
        local_theta, local_scaling = _rope({"rope_parameters": local}, 10_000.0)
    else:
        theta, scaling = _rope(raw, 1_000_000.0)
        local_theta = float(raw.get("rope_local_base_freq", 10_000.0))
        local_scaling = None
    if local_scaling is not None:
        raise ConfigError("rope scaling on Gemma 3's sliding-window layers is not supported")
    return theta, scaling, local_theta


def _gemma3_config(raw: dict[str, Any]) -> ModelConfig:
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(cap) is not None:
            raise ConfigError(f"Gemma logit soft-capping ({cap}) is not supported")
    if raw.get("use_bidirectional_attention"):
        raise ConfigError("Gemma 3 with bidirectional attention is not supported")
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types") or [
        "full_attention" if (i + 1) % GEMMA_SLIDING_PATTERN == 0 else "sliding_attention"
        for i in range(layers)
    ]
    if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
        raise ConfigError(f"Gemma 3 layer_types must list {layers} full/sliding_attention")
    act = str(raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"unsupported Gemma activation {act!r} (gelu_pytorch_tanh only)")
    theta, scaling, local_theta = _gemma3_rope(raw)
    window = raw.get("sliding_window")
    if "sliding_attention" in types and (window is None or int(window) < 1):
        raise ConfigError("Gemma 3 sliding-window layers need sliding_window >= 1")
    return ModelConfig(
        family="gemma3",
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or 256),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        qkv_bias=bool(raw.get("attention_bias", False)),
        o_bias=bool(raw.get("attention_bias", False)),
        qk_norm=True,
        bos_token_id=raw.get("bos_token_id", 2),
        eos_token_ids=_with_turn_end(_eos_list(raw.get("eos_token_id", 1)), GEMMA_END_OF_TURN, raw),
        pad_token_id=raw.get("pad_token_id", 0),
        hidden_act="gelu_tanh",
        embed_scale=True,
        sandwich_norms=True,
        norm_offset=1.0,
        attention_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
        sliding_window=int(window) if window is not None else None,
        layer_types=list(types),
        rope_local_theta=local_theta,
    )
