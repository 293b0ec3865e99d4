"""A KV segment as named tensors: slots of a batch-1 cache, every layer, as the tensors a
segment file (or the shared tier's copy) holds (`segment_tensors`), and consecutive segments'
tensors back into a cache (`cache_from_parts`). Ragged layers (non-uniform budgets' masked
padding) hold only their visible slots; int8 codes (`engine.compaction.kv_quant`) are kept as codes.
A model's sliding-window layers (`models.window_cache`) are not slots: the segment that ends
at the cache's last slot also holds their ring, as its positions in order (`wk.<l>`, `wv.<l>`,
the window in `window`); an earlier segment's copy is stale and ignored."""

from __future__ import annotations

import torch

from cdlm_serve.engine.compaction import QuantizedSegment
from cdlm_serve.engine.sessions import ragged
from cdlm_serve.models.kv_cache import KVCache
from cdlm_serve.models.window_cache import WindowCache

MAX_WINDOW = 1 << 20  # slots: larger than any model's sliding window (Gemma 3's: 512-4,096)


def segment_tensors(
    cache: KVCache, start: int, end: int, codes: QuantizedSegment | None = None
) -> dict[str, torch.Tensor]:
    """Slots [start, end) of row 0 of `cache`, every layer, as the named tensors a segment
    file holds: `k.<layer>`, `v.<layer>`, or the int8 codes of `codes` where given (then they
    are exactly slots [0, codes.slots): `kq`, `vq`, `vs`, `ks`), and `b.<layer>`, the biases. A
    layer whose slots include masked ones (a -inf bias: the padding of non-uniform budgets) is
    ragged: only the visible slots, every head's after the other's, and which they are
    (`m.<layer>`, [Hkv, n] bool), so padding takes no room. On the codes' device (the CPU)
    where given, else the cache's; some may be views of the cache."""
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(cache.num_layers):
        keys, values, bias = cache.read(0, layer)  # [Hkv, n, D], [Hkv, n]
        device = keys.device if codes is None else codes.keys[layer].device
        part = {}
        if codes is not None:
            part["kq"], part["vq"] = codes.keys[layer], codes.values[layer]
            part["vs"] = codes.value_scales[layer]
            tensors[f"ks.{layer}"] = codes.key_scales[layer].contiguous()  # per channel
        else:
            part["k"], part["v"] = keys[:, start:end], values[:, start:end]
        if bias is not None:
            part["b"] = bias[:, start:end].to(device)
            visible = ragged.visible_slots(part["b"])  # [Hkv, n] or None
            if visible is not None:
                part = ragged.squeeze(part, visible)  # [sum, ...]
                tensors[f"m.{layer}"] = visible
        tensors |= {f"{name}.{layer}": t.contiguous() for name, t in part.items()}
    if cache.window is not None and end == cache.lengths[0]:
        ring_keys, ring_values = cache.window.ordered(0, cache.logical[0])  # [Hkv, n, D] each
        for layer, (k, v) in enumerate(zip(ring_keys, ring_values, strict=True)):
            tensors[f"wk.{layer}"], tensors[f"wv.{layer}"] = k.contiguous(), v.contiguous()
        tensors["window"] = torch.tensor([cache.window.window])
    return tensors


def cache_from_parts(
    parts: list[dict[str, torch.Tensor]],
    length: int,
    logical: int,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[KVCache, QuantizedSegment | None]:
    """A batch-1 cache of `length` slots from consecutive segments' tensors (`segment_tensors`,
    none of them changed here), and the int8 codes the first one holds (None if it holds plain
    tensors); ragged layers padded back (masked slots: zero keys and values, a -inf bias)."""
    parts = [_unragged(dict(part)) for part in parts]
    layers = sum(1 for name in parts[0] if name.startswith(("k.", "kq.")))
    codes = None
    if "kq.0" in parts[0]:
        codes = QuantizedSegment(
            keys=[parts[0][f"kq.{i}"] for i in range(layers)],
            key_scales=[parts[0][f"ks.{i}"] for i in range(layers)],
            values=[parts[0][f"vq.{i}"] for i in range(layers)],
            value_scales=[parts[0][f"vs.{i}"] for i in range(layers)],
        )
        for i in range(layers):  # the dense cache holds the codes' values
            parts[0][f"k.{i}"], parts[0][f"v.{i}"] = codes.layer(i, dtype, device)
    # Exactly its slots: a request copies the session into the engine's batch cache, and what
    # writes past them (a compaction's reference pass) grows the buffers itself.
    capacity = max(1, length)
    has_bias = any("b.0" in p for p in parts)

    def join(prefix: str, layer: int, dt: torch.dtype) -> torch.Tensor:
        pieces = []
        for part in parts:
            if f"{prefix}.{layer}" in part:
                pieces.append(part[f"{prefix}.{layer}"].to(device=device, dtype=dt))
            else:  # a segment written before the first compaction: no bias there
                keys = part[f"k.{layer}"]
                pieces.append(torch.zeros(keys.shape[:2], device=device, dtype=dt))
        whole = torch.cat(pieces, dim=1)  # [Hkv, n, ...]
        out = torch.zeros(1, whole.shape[0], capacity, *whole.shape[2:], device=device, dtype=dt)
        out[0, :, :length] = whole
        return out

    keys = [join("k", i, dtype) for i in range(layers)]
    values = [join("v", i, dtype) for i in range(layers)]
    biases = [join("b", i, torch.float32) for i in range(layers)] if has_bias else None
    window = _window(parts, logical, device, dtype)
    return KVCache(keys, values, [length], [logical], biases, window), codes


def _window(
    parts: list[dict[str, torch.Tensor]], logical: int, device: torch.device, dtype: torch.dtype
) -> WindowCache | None:
    """The sliding-window layers' ring the last segment holds (None for a model without)."""
    last = next((p for p in reversed(parts) if "window" in p), None)
    if last is None:
        return None
    count = sum(1 for name in last if name.startswith("wk."))

    def load(name: str) -> list[torch.Tensor]:
        return [last[f"{name}.{i}"].to(device=device, dtype=dtype) for i in range(count)]

    window = int(last["window"][0])
    # A size read from a file: bounded before it becomes an allocation.
    if not 0 < window <= MAX_WINDOW or last["wk.0"].shape[1] > window:
        raise ValueError(f"a segment's window ring of {window} slots is not a window")
    return WindowCache.from_ordered(load("wk"), load("wv"), window, logical)


def _unragged(part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A segment file's tensors with its ragged layers padded back to [Hkv, n, ...]."""
    for name in [k for k in part if k.startswith("m.")]:
        layer = name[2:]
        visible = part.pop(name)  # [Hkv, n] bool
        for kind in ("k", "v", "kq", "vq", "vs", "b"):
            flat = part.get(f"{kind}.{layer}")
            if flat is None:
                continue
            fill = float("-inf") if kind == "b" else 0.0
            part[f"{kind}.{layer}"] = ragged.unsqueeze(flat, visible, fill)
    return part
