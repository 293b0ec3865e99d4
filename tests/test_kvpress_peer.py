"""bench/kvpress_peer.py's bridge: what a kvpress press keeps of a context, moved into our
model's cache, answers as transformers answers on kvpress's own cache (a uniform press, and
head-wise ones whose evictions kvpress applies by masking keys, we by -inf biases), at the
physical size the bench asks for. kvpress is installed by the README's test command (the
`kvpress` extra, then kvpress 0.5.5 without its dependencies), so a missing kvpress fails here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cdlm_serve.bench import kvpress_peer
from cdlm_serve.bench.facts import answer_nll
from cdlm_serve.models.loading import load_model

T = 200  # context tokens: past SnapKV's 64-query window
RATIO = 2
KEPT = round(T / RATIO)


def _ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=gen).tolist()


@pytest.fixture(scope="module")
def models(tiny_llama_dir):
    hf = kvpress_peer.load_hf(tiny_llama_dir, torch.float32)
    ours, _ = load_model(tiny_llama_dir)
    return hf, ours


@torch.no_grad()
def _hf_nll(hf, cache, prompt: list[int], answer: list[int]) -> float:
    """transformers' mean NLL of `answer` after `prompt` on kvpress's cache, the question at
    positions T.. as the bench's (kvpress's masks, where a press left them, still in place)."""
    x = torch.tensor([prompt + answer])
    positions = torch.arange(T, T + x.shape[1])[None]
    logits = hf(input_ids=x, past_key_values=cache, position_ids=positions).logits[0]
    return float(F.cross_entropy(logits[len(prompt) - 1 : -1], torch.tensor(answer)))


@pytest.mark.parametrize("press", ["snapkv", "adakv_expected_attention", "kvzip"])
def test_our_model_on_the_bridged_cache_answers_as_transformers_on_kvpress_cache(models, press):
    hf, ours = models
    context, prompt, answer = _ids(T, 0), _ids(6, 1), _ids(5, 2)
    full = ours.new_cache(1, T + 16)
    with torch.no_grad():
        ours(torch.tensor([context]), cache=full)

    cache = kvpress_peer.run_press(hf, press, context, KEPT)
    keys, values, masks = kvpress_peer.kept_slots(hf, cache)
    seg_k, seg_v, seg_b, slots = kvpress_peer.to_segment(keys, values, masks)
    bridged = full.extract_row(0)
    bridged.replace_prefix(0, T, seg_k, seg_v, seg_b)
    theirs = _hf_nll(hf, cache, prompt, answer)
    kvpress_peer.clear_masks(hf)

    heads = ours.config.num_kv_heads * full.num_layers
    if press == "kvzip":  # one global budget over layers and heads: int() of its share
        assert abs(slots - KEPT * heads) <= 1
    else:
        assert slots == KEPT * heads
    if press == "snapkv":  # uniform: every head keeps the same count, nothing padded
        assert all(int(m.sum()) == m.numel() == KEPT * m.shape[0] for m in masks)
    else:  # head-wise: the heads' counts differ, the bridge pads them
        assert any(len(set(m.sum(dim=1).tolist())) > 1 for m in masks)
    # our cache holds the segment (the longest head's count), the questions still at T
    assert bridged.lengths[0] == seg_k[0].shape[1] and bridged.logical[0] == T
    mine = answer_nll(ours, bridged, prompt, answer)
    assert mine == pytest.approx(theirs, abs=1e-4)
    # and the press mattered: the full context answers otherwise
    assert abs(answer_nll(ours, full, prompt, answer) - mine) > 1e-3


def test_compression_ratio_keeps_exactly_the_slots_asked_for():
    for total in range(150, 2200, 7):
        for ratio in (2, 4, 10, 20):
            kept = round(total / ratio)
            r = kvpress_peer.compression_ratio(total, kept)
            assert 0 <= r < 1 and int(total * (1 - r)) == kept


def test_peer_rows_are_named_apart_from_ours_and_their_sources():
    assert kvpress_peer.is_peer("kvpress:snapkv")
    assert not kvpress_peer.is_peer("kvzip:repeat-banded")
    assert kvpress_peer.press_name("kvpress:kvzip") == "kvzip"
    with pytest.raises(SystemExit):
        kvpress_peer.press_name("kvpress:snapkv+attn")
