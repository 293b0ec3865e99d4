"""bench/compaction.py's --layer-loss cache: one layer's compacted segment beside the other
layers' exact slots, padded with masked slots so every layer keeps its own length."""

from __future__ import annotations

import torch

import tiny_models
from bench.compaction import mixed_cache
from engine.kv_compaction import compact_row
from models.loading import load_model


@torch.no_grad()
def _logits(model, cache, ids: list[int]) -> torch.Tensor:
    work = cache.extract_row(0)
    work.ensure_capacity(work.lengths[0] + len(ids))
    return model.logits(model(torch.tensor([ids]), cache=work, commit=False)[0]).float()


def test_a_layer_loss_cache_is_exact_where_it_keeps_layers_and_compacted_where_it_swaps(
    tiny_llama_dir,
):
    model, _ = load_model(tiny_llama_dir)
    context = [(7 * i) % 200 + 3 for i in range(120)]
    keep_recent, target = 8, 20
    region = len(context) - keep_recent
    full = model.new_cache(1, len(context) + 16)
    with torch.no_grad():
        model(torch.tensor([context]), cache=full)
    compacted = full.extract_row(0)
    tok = tiny_models.byte_tokenizer()
    compact_row(model, tok, compacted, 0, context, target, "am-highest-fast", None, keep_recent)
    probe = [5, 17, 42, 99]
    layers = set(range(full.num_layers))

    # No layer swapped: the full cache; every layer swapped: the compacted one (the masked
    # padding takes no attention).
    assert torch.allclose(
        _logits(model, mixed_cache(full, compacted, set(), region), probe),
        _logits(model, full, probe),
        atol=1e-5,
    )
    swapped_all = _logits(model, mixed_cache(full, compacted, layers, region), probe)
    assert torch.allclose(swapped_all, _logits(model, compacted, probe), atol=1e-5)

    # One layer swapped: that layer holds the compacted segment, the others the exact slots.
    one = mixed_cache(full, compacted, {1}, region)
    assert one.lengths == full.lengths
    assert torch.equal(one.keys[0][0, :, : full.lengths[0]], full.keys[0][0, :, : full.lengths[0]])
    assert torch.equal(one.keys[1][0, :, :target], compacted.keys[1][0, :, :target])
    assert torch.isinf(one.biases[1][0, :, target:region]).all()
    assert torch.equal(
        one.keys[1][0, :, region : full.lengths[0]], full.keys[1][0, :, region : full.lengths[0]]
    )
    mixed = _logits(model, one, probe)
    assert not torch.allclose(mixed, _logits(model, full, probe), atol=1e-4)
    assert not torch.allclose(mixed, swapped_all, atol=1e-4)
