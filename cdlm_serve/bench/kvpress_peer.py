"""kvpress (NVIDIA's library of KV-cache "presses" for transformers models) as a peer in
`bench/compaction.py`: the same context prefilled by transformers, compressed by a press as
kvpress ships it, and its kept keys and values handed to our model's cache, so that the bench's
questions and scoring run on it unchanged (`python -m cdlm_serve.bench.compaction --peer
kvpress`; rows named `kvpress:<press>`).

Install (kvpress 0.5.5 pins transformers<5.3, we pin 5.23.0, so it goes in without its
dependencies; the `kvpress` extra holds the three it imports that we lack):

    pip install -e '.[kvpress]' && pip install --no-deps kvpress==0.5.5

How a press runs here, and where that differs from kvpress's own pipeline:
- `with press(hf): hf.model(input_ids=..., past_key_values=cache, cache_position=...)`, the
  pipeline's own prefill. transformers 5.4+ no longer passes `cache_position` down to the
  attention modules, where kvpress's hook reads it, so it is passed by hand (sdpa ignores it).
- The pipeline wraps the context in the chat template; the bench's contexts are raw text (the
  same ids our methods see). KVzip reads the template's prefix length (24 tokens for SmolLM2)
  and skips that many context tokens when it scores, so on a raw context tokens 4..23 would never
  be scored and always evicted: `RawKVzipPress` sets the prefix to 0.
- The physical size is ours: round(T / ratio) slots per KV head (on average, for the head-wise
  presses), the whole context compressed. kvpress's `compression_ratio` is the fraction removed;
  `compression_ratio` nudges it so its int() rounding keeps exactly that many.
- Head-wise presses (AdaKV, KVzip) do not shrink the cache: they leave `masked_key_indices` on
  the attention modules, which we read (and clear: they would mask the next run's keys) and turn
  into a ragged segment, each head's kept slots first, padded with -inf-bias slots.
- The questions continue at position T, as in kvpress (no key re-rotation).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from cdlm_serve.models.kv_cache import KVCache

PREFIX = "kvpress:"
INSTALL = "pip install -e '.[kvpress]' && pip install --no-deps kvpress==0.5.5"
VERSION = "0.5.5"
# The presses `--peer kvpress` runs by default: the list and the per-head variant.
DEFAULT_PRESSES = (
    "snapkv",
    "streaming_llm",
    "expected_attention",
    "adakv_expected_attention",
    "tova",
    "keydiff",
    "kvzip",
)


def _kvpress() -> Any:
    """The kvpress module, imported only when a peer row is asked for: importing it wraps
    transformers' attention functions for the whole process."""
    try:
        import kvpress
    except ImportError as e:
        raise SystemExit(f"kvpress is not installed ({e}); install it with:\n    {INSTALL}") from e
    if kvpress_version() != VERSION:
        raise SystemExit(f"kvpress {kvpress_version()} found, the peer is written for {VERSION}")
    return kvpress


def kvpress_version() -> str:
    from importlib.metadata import version

    return version("kvpress")


def _raw_kvzip(kp: Any, ratio: float, layerwise: bool = False) -> Any:
    """KVzip on a raw context (no chat-template prefix to skip, see the module doc)."""

    class RawKVzipPress(kp.KVzipPress):  # type: ignore[misc]
        def prepare(self, model: Any, tokenizer: Any, prev_postfix_size: int = 8) -> Any:
            # _perform_kvzip_compression calls prepare() before it sets start_idx from it
            self.prefix_length = 0
            return super().prepare(model, tokenizer, prev_postfix_size)

    return RawKVzipPress(compression_ratio=ratio, layerwise=layerwise)


# name -> the press at a compression ratio (kvpress's: the fraction removed), as shipped.
PRESSES: dict[str, Callable[[Any, float], Any]] = {
    "snapkv": lambda kp, r: kp.SnapKVPress(r),  # window 64, avg-pool 5
    "pyramidkv": lambda kp, r: kp.PyramidKVPress(r),
    "streaming_llm": lambda kp, r: kp.StreamingLLMPress(r),  # 4 sinks + the most recent
    "expected_attention": lambda kp, r: kp.ExpectedAttentionPress(r),
    "tova": lambda kp, r: kp.TOVAPress(r),
    "keydiff": lambda kp, r: kp.KeyDiffPress(r),
    "knorm": lambda kp, r: kp.KnormPress(r),
    "adakv_expected_attention": lambda kp, r: kp.AdaKVPress(kp.ExpectedAttentionPress(r)),
    "adakv_snapkv": lambda kp, r: kp.AdaKVPress(kp.SnapKVPress(r)),
    "kvzip": lambda kp, r: _raw_kvzip(kp, r),  # budgets global over layers and heads
    "kvzip_layerwise": lambda kp, r: _raw_kvzip(kp, r, layerwise=True),
}


def is_peer(method: str) -> bool:
    """A `kvpress:<press>` row. No method of ours is named "kvpress", so the prefix never
    reads as one of ours with a query source (`kvzip:repeat-banded`)."""
    return method.startswith(PREFIX)


def press_name(method: str) -> str:
    name = method.removeprefix(PREFIX)
    if name not in PRESSES:
        raise SystemExit(f"unknown kvpress press {name!r}: one of {', '.join(PRESSES)}")
    return name


def compression_ratio(total: int, kept: int) -> float:
    """kvpress's compression_ratio under which it keeps exactly `kept` of `total` slots per
    head: it keeps int(total * (1 - ratio)), and 1 - kept / total is off by one in float about
    a third of the time."""
    r = 1 - kept / total
    while int(total * (1 - r)) < kept:
        r = math.nextafter(r, 0.0)
    while int(total * (1 - r)) > kept:
        r = math.nextafter(r, 1.0)
    return r


def load_hf(folder: Path, dtype: torch.dtype) -> Any:
    """The transformers model kvpress hooks, with sdpa (the head-wise presses refuse eager)."""
    _kvpress()
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation="sdpa"
    )
    return model.eval()


@dataclass(slots=True)
class PeerReport:
    """What the bench reads of a compaction report, for a kvpress row."""

    head_slots: int  # kept slots, all layers and heads together (without padding)
    seconds: dict[str, float] = field(default_factory=dict)
    output_error: float = float("nan")  # no reference queries on this side
    codes: None = None  # never quantized (resident_bytes / stored_bytes read it)


@torch.no_grad()
def run_press(hf: Any, name: str, ids: list[int], kept: int) -> Any:
    """Press `name` run on the context `ids`, keeping `kept` slots per KV head (on average):
    transformers' cache as the press left it (a DynamicCache; a head-wise press leaves it
    whole and its evictions on the attention modules, `kept_slots` reads them)."""
    from transformers import DynamicCache

    kp = _kvpress()
    total = len(ids)
    press = PRESSES[name](kp, compression_ratio(total, kept))
    cache = DynamicCache()
    x = torch.tensor([ids], device=hf.device)
    with press(hf):
        # input_ids by keyword: KVzip wraps model.model.forward and reads it from kwargs
        hf.model(
            input_ids=x,
            past_key_values=cache,
            cache_position=torch.arange(total, device=hf.device),
        )
    return cache


def kept_slots(hf: Any, cache: Any) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Per layer, the keys and values a press left [Hkv, n, D] (n = T for head-wise presses)
    and which of them it kept [Hkv, n] (bool: False where `masked_key_indices` evicts)."""
    keys, values, masks = [], [], []
    for i, layer in enumerate(hf.model.layers):
        k, v = cache.layers[i].keys[0], cache.layers[i].values[0]  # [Hkv, n, D]
        mask = torch.ones(k.shape[:2], dtype=torch.bool, device=k.device)  # [Hkv, n]
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:  # (batch, head, slot) indices of the evicted
            mask[masked[1], masked[2]] = False
        keys.append(k)
        values.append(v)
        masks.append(mask)
    return keys, values, masks


def clear_masks(hf: Any) -> None:
    """Drop a head-wise press's evictions from the modules: they would mask the keys of the
    next forward pass whose query and key lengths differ (the next question, another run's)."""
    for layer in hf.model.layers:
        layer.self_attn.masked_key_indices = None


def to_segment(
    keys: list[Tensor], values: list[Tensor], masks: list[Tensor]
) -> tuple[list[Tensor], list[Tensor], list[Tensor], int]:
    """Per layer the kept slots of each head first, every layer padded to the longest head's
    count t with zero K/V and a -inf bias: keys/values [Hkv, t, D], biases [Hkv, t]; and the
    kept slots in all."""
    t = max(int(m.sum(dim=1).max()) for m in masks)
    out_k, out_v, out_b, slots = [], [], [], 0
    for k, v, m in zip(keys, values, masks, strict=True):
        heads, _, d = k.shape
        sk, sv = k.new_zeros(heads, t, d), v.new_zeros(heads, t, d)
        bias = torch.full((heads, t), float("-inf"), device=k.device)
        for h in range(heads):
            idx = m[h].nonzero().flatten()
            sk[h, : len(idx)], sv[h, : len(idx)], bias[h, : len(idx)] = k[h, idx], v[h, idx], 0.0
            slots += len(idx)
        out_k.append(sk)
        out_v.append(sv)
        out_b.append(bias)
    return out_k, out_v, out_b, slots


def compact(
    hf: Any, full: KVCache, ids: list[int], kept: int, method: str, prefill_s: float
) -> tuple[KVCache, PeerReport]:
    """Row 0 of `full` (our prefilled context) with its whole context replaced by what
    kvpress's press `method` keeps of it, `kept` slots per KV head on average; its logical
    length stays T, so the questions continue at T. The seconds: "with_prefill", the press's
    wall time, which includes transformers' prefill that the press rides on; "total", that
    less `prefill_s` (`prefill_seconds`, one plain prefill: noisy on a busy machine)."""
    name = press_name(method)
    started = time.perf_counter()
    cache = run_press(hf, name, ids, kept)
    seconds = time.perf_counter() - started
    keys, values, masks = kept_slots(hf, cache)
    clear_masks(hf)
    seg_k, seg_v, seg_b, slots = to_segment(keys, values, masks)
    out = full.extract_row(0)
    out.replace_prefix(0, len(ids), seg_k, seg_v, seg_b)
    spent = {"total": max(0.0, seconds - prefill_s), "with_prefill": seconds, "prefill": prefill_s}
    return out, PeerReport(head_slots=slots, seconds=spent)


@torch.no_grad()
def prefill_seconds(hf: Any, ids: list[int]) -> float:
    """A plain transformers prefill of `ids`: the part of a press's time that is not its own."""
    from transformers import DynamicCache

    started = time.perf_counter()
    hf.model(input_ids=torch.tensor([ids], device=hf.device), past_key_values=DynamicCache())
    return time.perf_counter() - started
