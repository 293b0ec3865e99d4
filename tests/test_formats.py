"""Checkpoint formats: Dream, LLaDA, sharded safetensors, GGUF, PEFT LoRA adapters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny_models
from cdlm_serve.models.config import ConfigError, ModelConfig
from cdlm_serve.models.loading import load_model
from cdlm_serve.models.weights import to_checkpoint

# The real releases' config.json files (values as published).
DREAM_7B = {
    "architectures": ["DreamModel"],
    "model_type": "Dream",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "mask_token_id": 151666,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "pad_token_id": 151643,
    "max_position_embeddings": 131072,
    "hidden_act": "silu",
}
LLADA_8B = {
    "architectures": ["LLaDAModelLM"],
    "model_type": "llada",
    "d_model": 4096,
    "n_heads": 32,
    "n_kv_heads": 32,
    "n_layers": 32,
    "mlp_hidden_size": 12288,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-05,
    "vocab_size": 126464,
    "embedding_size": 126464,
    "weight_tying": False,
    "include_bias": False,
    "activation_type": "silu",
    "block_type": "llama",
    "mask_token_id": 126336,
    "eos_token_id": 126081,
    "bos_token_id": 126080,
    "pad_token_id": 126081,
    "max_sequence_length": 4096,
}


def test_real_dream_config():
    cfg = ModelConfig.from_hf_dict(DREAM_7B)
    assert (cfg.family, cfg.num_kv_heads, cfg.head_dim) == ("dream", 4, 128)
    assert cfg.qkv_bias and not cfg.o_bias and not cfg.tie_word_embeddings
    assert cfg.is_diffusion and cfg.default_attention == "bidirectional" and cfg.logits_shift
    assert cfg.mask_token_id == 151666
    assert cfg.eos_token_ids == [151643, 151645]  # <|endoftext|>, then <|im_end|>


def test_real_llada_config():
    cfg = ModelConfig.from_hf_dict(LLADA_8B)
    assert (cfg.family, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == ("llada", 4096, 32, 32)
    assert cfg.intermediate_size == 12288 and cfg.vocab_size == 126464
    assert cfg.mask_token_id == 126336 and not cfg.logits_shift
    assert cfg.eos_token_ids == [126081, 126348]  # <|endoftext|>, then <|eot_id|>
    assert cfg.weight_format == "llada" and cfg.default_attention == "bidirectional"


def test_unsupported_configs_are_named():
    with pytest.raises(ConfigError, match="model_type"):
        ModelConfig.from_hf_dict({"model_type": "gpt2"})
    with pytest.raises(ConfigError, match="MoE"):
        ModelConfig.from_hf_dict({**LLADA_8B, "architectures": ["LLaDAMoEModelLM"]})


def _bidirectional_reference(kind: str, sd: dict, **cfg_kw):
    """transformers' own Qwen2 / Llama with every position visible: the DLM forward."""
    import transformers as tf

    config_cls, model_cls = {
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
    }[kind]
    model = model_cls(config_cls(**cfg_kw)).eval()
    model.load_state_dict(sd, strict=True)

    def run(ids: torch.Tensor) -> torch.Tensor:
        b, n = ids.shape
        return model(ids, attention_mask=torch.ones(b, 1, n, n, dtype=torch.bool)).logits

    return run


def _ids(n: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, tiny_models.VOCAB, (2, n), generator=torch.Generator().manual_seed(seed)
    )


def test_dream_checkpoint_is_bidirectional_qwen2(tmp_path):
    sd = tiny_models.dream_tiny(tmp_path)
    ours, ckpt = load_model(tmp_path)
    assert ckpt.config.family == "dream" and ckpt.config.mask_token_id == tiny_models.MASK_ID
    ref = _bidirectional_reference(
        "qwen2",
        sd,
        **tiny_models.TINY_DIMS,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    ids = _ids()
    with torch.no_grad():
        expected = ref(ids)
        got = ours.logits(ours(ids))
        shifted = ours.token_logits(ours(ids))
    assert (expected - got).abs().max().item() <= 1e-4
    # Dream: the prediction for position i comes from hidden state i-1.
    assert torch.equal(shifted[:, 1:], got[:, :-1]) and torch.equal(shifted[:, 0], got[:, 0])


def test_llada_checkpoint_uses_its_own_names(tmp_path):
    canonical = tiny_models.llada_tiny(tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert "model.transformer.blocks.0.ff_proj.weight" in stored
    assert "model.transformer.ff_out.weight" in stored
    assert not any(k.startswith("model.layers") for k in stored)
    ours, ckpt = load_model(tmp_path)
    assert ckpt.config.family == "llada" and not ckpt.config.logits_shift
    dims = {
        **tiny_models.TINY_DIMS,
        "num_key_value_heads": tiny_models.TINY_DIMS["num_attention_heads"],
    }
    ref = _bidirectional_reference(
        "llama",
        canonical,
        **dims,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    ids = _ids()
    with torch.no_grad():
        expected = ref(ids)
        got = ours.logits(ours(ids))
        assert torch.equal(ours.token_logits(ours(ids)), got)  # no shift
    assert (expected - got).abs().max().item() <= 1e-4


@pytest.mark.parametrize("maker", [tiny_models.dream_tiny, tiny_models.llada_tiny])
def test_native_weights_round_trip_to_release_format(tmp_path, maker):
    maker(tmp_path)
    ours, ckpt = load_model(tmp_path)
    back = to_checkpoint(ours.state_dict(), ckpt.config)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert set(back) == set(stored)
    assert all(torch.equal(back[k], stored[k]) for k in stored)


def test_sharded_safetensors_with_index(tmp_path):
    single = tmp_path / "single"
    tiny_models.dream_tiny(single)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    sd = load_file(str(single / "model.safetensors"))
    names = sorted(sd)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(sharded / fname))
        weight_map.update({k: fname for k in keys})
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    (sharded / "config.json").write_text((single / "config.json").read_text())
    a, _ = load_model(single)
    b, _ = load_model(sharded)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(a.logits(a(ids)), b.logits(b(ids)))


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (written independently here)."""
    out_dim = w.shape[0]
    return (
        w.reshape(n_head, 2, out_dim // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _write_gguf(path: Path, hf_model, quantize_ffn: bool, quantize_all: bool = False) -> None:
    """hf_model as llama.cpp writes it: fp32, or Q8_0 for the MLP's matrices (`quantize_ffn`)
    or for every matrix, embedding and head included (`quantize_all`, a Q8_0 file)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    cfg = hf_model.config
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(tiny_models.BOS_ID)
    w.add_eos_token_id(tiny_models.EOS_ID)
    names = {
        "embed_tokens": "token_embd",
        "norm": "output_norm",
        "q_proj": "attn_q",
        "k_proj": "attn_k",
        "v_proj": "attn_v",
        "o_proj": "attn_output",
        "gate_proj": "ffn_gate",
        "up_proj": "ffn_up",
        "down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for name, t in hf_model.state_dict().items():
        arr = t.float().numpy()
        parts = name.split(".")
        if name == "lm_head.weight":
            gname = "output.weight"
        elif parts[1] == "layers":
            gname = f"blk.{parts[2]}.{names[parts[-2]]}.weight"
        else:
            gname = f"{names[parts[1]]}.weight"
        if gname.endswith("attn_q.weight"):
            arr = _llama_cpp_permute(arr, cfg.num_attention_heads)
        elif gname.endswith("attn_k.weight"):
            arr = _llama_cpp_permute(arr, cfg.num_key_value_heads)
        matrix = "norm" not in gname
        if matrix and (quantize_all or (quantize_ffn and ".ffn_" in gname)):
            q = quantize(arr, GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_f32_loads_exactly(tmp_path):
    hf = tiny_models.hf_tiny("llama", tmp_path / "hf")
    _write_gguf(tmp_path / "m.gguf", hf, quantize_ffn=False)
    ours, ckpt = load_model(tmp_path / "m.gguf")
    assert ckpt.config.family == "llama" and ckpt.config.num_kv_heads == 2
    ids = _ids()
    with torch.no_grad():
        assert (hf(ids).logits - ours.logits(ours(ids))).abs().max().item() <= 1e-4


def test_gguf_q8_0_dequantizes(tmp_path):
    hf = tiny_models.hf_tiny("llama", tmp_path / "hf", intermediate_size=128)
    _write_gguf(tmp_path / "m.gguf", hf, quantize_ffn=True)
    ours, _ = load_model(tmp_path / "m.gguf")
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids).logits
        err = (ref - ours.logits(ours(ids))).abs().max().item()
    # Q8_0 keeps ~2-3 digits per weight: close, but not bit-identical.
    assert 0 < err <= 0.02 * ref.abs().max().item()


def test_lora_adapter_is_merged_at_load(tmp_path):
    base = tmp_path / "base"
    hf = tiny_models.hf_tiny("llama", base)
    gen = torch.Generator().manual_seed(5)
    r, alpha = 4, 8.0
    targets = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    tensors, expected = {}, {k: v.clone() for k, v in hf.state_dict().items()}
    for module in targets:
        w = expected[f"{module}.weight"]
        a = torch.randn(r, w.shape[1], generator=gen) * 0.1
        b = torch.randn(w.shape[0], r, generator=gen) * 0.1
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
        expected[f"{module}.weight"] = w + (alpha / r) * b @ a
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": r,
                "lora_alpha": alpha,
                "base_model_name_or_path": "../base",
                "target_modules": ["q_proj", "down_proj"],
                "bias": "none",
            }
        )
    )
    hf.load_state_dict(expected)
    ours, ckpt = load_model(adapter)
    assert ckpt.tokenizer_folder == base.resolve()
    ids = _ids()
    with torch.no_grad():
        assert (hf(ids).logits - ours.logits(ours(ids))).abs().max().item() <= 1e-4


def test_missing_tensor_is_named(tmp_path):
    tiny_models.dream_tiny(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path)


# CDLM's students (minseo25/CDLM-Dream, minseo25/CDLM-LLaDA) are LoRA fine-tunes of attention
# and MLP on Dream-7B / LLaDA-8B. Whether the hub holds PEFT adapters or merged weights could not
# be checked from here (no hub access; D2F, whose training code CDLM builds on, publishes
# adapters), so both layouts must load, and to the same model.
CDLM_TARGETS = {
    "dream": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "llada": ["q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"],
}


@pytest.mark.parametrize("family", ["dream", "llada"])
def test_cdlm_student_loads_as_adapter_or_merged(tmp_path, family):
    base = tmp_path / "base"
    {"dream": tiny_models.dream_tiny, "llada": tiny_models.llada_tiny}[family](base)
    weights = load_file(str(base / "model.safetensors"))  # the release's own names
    gen = torch.Generator().manual_seed(7)
    r, alpha = 8, 16.0
    lora, merged = {}, dict(weights)
    for name, w in weights.items():
        module = name.removesuffix(".weight")
        if w.dim() != 2 or module.rsplit(".", 1)[-1] not in CDLM_TARGETS[family]:
            continue
        a = torch.randn(r, w.shape[1], generator=gen) * 0.1
        b = torch.randn(w.shape[0], r, generator=gen) * 0.1
        lora[f"base_model.model.{module}.lora_A.weight"] = a
        lora[f"base_model.model.{module}.lora_B.weight"] = b
        merged[name] = w + (alpha / r) * b @ a
    # PEFT matches target names as suffixes: LLaDA's LM head is `model.transformer.ff_out`,
    # so an "ff_out" target wraps the head too.
    wrapped = 7 * tiny_models.TINY_DIMS["num_hidden_layers"] + (family == "llada")
    assert len(lora) == 2 * wrapped
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file(lora, str(adapter / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "bias": "none"}
    config |= {"base_model_name_or_path": "../base", "target_modules": CDLM_TARGETS[family]}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    full = tmp_path / "merged"
    shutil.copytree(base, full)
    save_file(merged, str(full / "model.safetensors"), metadata={"format": "pt"})
    ids = _ids()
    logits = []
    for folder in (adapter, full, base):
        model, _ = load_model(folder)
        with torch.no_grad():
            logits.append(model.logits(model(ids)))
    assert (logits[0] - logits[1]).abs().max().item() <= 1e-4
    assert (logits[0] - logits[2]).abs().max().item() > 1e-2  # the adapter changed the model


def test_a_q8_0_ggufs_codes_are_kept_as_stored_and_served_as_int8(tmp_path):
    """A Q8_0 file's codes and scales come through as stored (q/k rows put back in HF order
    like the weights), and serving takes them as they are: int8 without being asked, the
    fused step multiplying the file's codes, not codes of its weights quantized again after
    the bf16 copy rounded them."""
    from gguf import GGUFReader

    from cdlm_serve.models import gguf as gguf_file
    from cdlm_serve.models import kernels
    from cdlm_serve.models.quantize import (
        dequantize_q8_0,
        quantize_model,
        quantize_q8_0,
        quantized_modules,
        serving_quantization,
    )
    from cdlm_serve.models.weights import native_q8

    hf = tiny_models.hf_tiny("llama", tmp_path / "hf", intermediate_size=128)
    _write_gguf(tmp_path / "m.gguf", hf, quantize_ffn=False, quantize_all=True)
    assert gguf_file.quantized_types(GGUFReader(str(tmp_path / "m.gguf"))) == {"Q8_0": 16}
    model, ckpt = load_model(tmp_path / "m.gguf", dtype=torch.bfloat16)
    weights = {
        k: t
        for k, t in gguf_file.iter_weights(GGUFReader(str(tmp_path / "m.gguf")), ckpt.raw_config)
    }
    assert sorted(ckpt.q8) == sorted(k for k, t in weights.items() if t.dim() == 2)
    for name, (codes, scales) in ckpt.q8.items():  # exactly what the loaded weights are
        assert torch.equal(dequantize_q8_0(codes, scales, torch.float32), weights[name]), name

    stored = native_q8(ckpt.q8, ckpt.config)
    assert stored.keys() == quantized_modules(model).keys()
    for name, module in quantized_modules(model).items():  # fused as the weights were
        assert torch.equal(dequantize_q8_0(*stored[name], torch.bfloat16), module.weight), name
    assert serving_quantization(None, stored, model) == "int8"
    assert serving_quantization(None, {}, model) is None
    requantized = {n: quantize_q8_0(m.weight.data) for n, m in quantized_modules(model).items()}
    assert any(not torch.equal(requantized[n][0], stored[n][0]) for n in stored)
    kernels.enable_cpu_kernels()
    quantize_model(model, stored)
    for name, module in quantized_modules(model).items():
        codes, scales = stored[name]
        expect = kernels.pack_q8(codes, scales) or (codes, scales)
        assert all(torch.equal(a, b) for a, b in zip(module.q8, expect, strict=True)), name
        assert torch.equal(module.weight, dequantize_q8_0(codes, scales, torch.bfloat16))
