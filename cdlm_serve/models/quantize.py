"""int8 weights in Q8_0, llama.cpp's block format: each run of 32 weights of one output row
shares one scale d = fp16(max|w| / 127), and each weight is stored as round(w / d) in int8.

`quantize_model` gives a model's decoder matrices and output head Q8_0 weights: the PyTorch
weights become the dequantized values (so every path, GPU and long prefills included, computes
with the same numbers) and the codes are kept beside them for the fused CPU step, which
multiplies them directly (`kernels/cpu_int8.cpp`, AVX512-VNNI) with activations quantized the
same way on the fly: one byte per weight streams from memory instead of two.

`q8_linear_reference` is what that kernel computes, in PyTorch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cdlm_serve.models import kernels

BLOCK = 32


def quantize_q8_0(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [N, K] (K a multiple of 32) -> (codes int8 [N, K], scales fp32 [N, K / 32]), the
    scales rounded to fp16 as Q8_0 stores them (codes are computed with the rounded scale)."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"Q8_0 needs rows of a multiple of {BLOCK} weights, not {k}")
    blocks = w.float().reshape(n, k // BLOCK, BLOCK)
    scales = (blocks.abs().amax(-1) / 127).half().float()  # [N, K/32]
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    codes = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return codes.reshape(n, k), scales


def dequantize_q8_0(codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """(codes [N, K], scales [N, K / 32]) -> weights [N, K] in `dtype`."""
    n, k = codes.shape
    blocks = codes.float().reshape(n, k // BLOCK, BLOCK) * scales[..., None]
    return blocks.reshape(n, k).to(dtype)


def _quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (codes [M, K/32, 32] fp32 holding integers, scales [M, K/32]) the way the
    kernel does it: code = round(x * (127 / max|x|)) per block, scale = max|x| / 127 (fp32)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(blocks * inv[..., None]), amax / 127


def q8_linear_reference(
    x: Tensor, codes: Tensor, scales: Tensor, bias: Tensor | None = None
) -> Tensor:
    """What `linear_q8` computes: x [M, K] quantized per row and 32-block, exact integer dot
    products per block with the weight codes [N, K], each scaled by both scales [.., K/32],
    summed in fp32 -> [M, N] in x's dtype (+ bias)."""
    n, k = codes.shape
    xq, xs = _quantize_activations(x)  # [M, B, 32], [M, B]
    w = codes.float().reshape(n, k // BLOCK, BLOCK)  # [N, B, 32]
    dots = torch.einsum("mbk,nbk->mnb", xq.double(), w.double()).float()  # exact integers
    y = (dots * xs[:, None, :] * scales[None, :, :]).sum(-1)  # [M, N]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantized_modules(model: Any) -> dict[str, Any]:
    """The modules `quantize_model` gives Q8_0 weights, by their names in the model: every
    decoder matrix (qkv, o, gate_up, down) and the output head (the embedding when tied)."""
    out = {}
    for i, block in enumerate(model.layers):
        out[f"layers.{i}.attn.qkv_proj"] = block.attn.qkv_proj
        out[f"layers.{i}.attn.o_proj"] = block.attn.o_proj
        out[f"layers.{i}.mlp.gate_up_proj"] = block.mlp.gate_up_proj
        out[f"layers.{i}.mlp.down_proj"] = block.mlp.down_proj
    if model.lm_head is not None:
        out["lm_head"] = model.lm_head
    else:
        out["embed_tokens"] = model.embed_tokens
    return out


def serving_quantization(
    asked: str | None, stored: dict[str, tuple[Tensor, Tensor]], model: Any
) -> str | None:
    """What a model is served as: what was asked (`--quantize`), else int8 where the file
    stored every matrix `quantize_model` quantizes as Q8_0 (`stored`: `models.weights.
    native_q8` of a GGUF's), as llama.cpp serves such a file; else as loaded."""
    if asked is None and stored and stored.keys() >= quantized_modules(model).keys():
        return "int8"
    return asked


def quantize_model(model: Any, stored: dict[str, tuple[Tensor, Tensor]] | None = None) -> int:
    """Q8_0 for every decoder matrix and the output head of `model`
    (models.transformer.Transformer), in place; returns the number of matrices. Each module's
    weight becomes its dequantized value, and its codes and scales are kept as `module.q8`
    for the fused CPU step, packed by `kernels.pack_q8` where the kernels run. `stored` gives
    some modules' codes and scales as a file holds them (a Q8_0 GGUF: `models.weights.
    native_q8`), taken as they are instead of quantizing the loaded weights again. Call it
    after `kernels.enable_cpu_kernels()`, so they are kept packed (else the fused step packs a
    copy). A tied head shares the embedding table, which then holds the dequantized values
    too (as in a Q8_0 GGUF)."""
    stored = stored or {}
    modules = quantized_modules(model)
    for name, module in modules.items():
        _quantize_linear(module, stored.get(name))
    return len(modules)


def _quantize_linear(module: Any, stored: tuple[Tensor, Tensor] | None = None) -> None:
    weight = module.weight
    with torch.no_grad():
        if stored is not None:
            codes, scales = stored
            if codes.shape != weight.shape:
                shapes = f"{tuple(codes.shape)} for {tuple(weight.shape)}"
                raise ValueError(f"stored Q8_0 codes {shapes}")
        else:
            codes, scales = quantize_q8_0(weight.data.cpu())
        weight.data = dequantize_q8_0(codes, scales, weight.dtype).to(weight.device)
    # Kept in the kernel's layout where the kernels run (the fused step takes it as it is:
    # one int8 copy in memory), else as they are.
    module.q8 = kernels.pack_q8(codes, scales) or (codes, scales)
