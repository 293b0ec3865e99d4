"""Our native transformer against transformers' own classes on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch

import tiny_models
from cdlm_serve.models.loading import load_model

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-mha": ("qwen3", {"num_key_value_heads": 4}),
    "gemma3": ("gemma3", {}),
    "gemma3-tied-mha": ("gemma3", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    kind, overrides = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = tiny_models.hf_tiny(kind, folder, **overrides)
    ours, _ = load_model(folder, dtype=torch.float32)
    return hf, ours


def test_full_forward_matches(pair):
    hf, ours = pair
    ids = torch.randint(0, tiny_models.VOCAB, (2, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours.logits(ours(ids))
    assert (ref - got).abs().max().item() <= 1e-4


def test_prefill_then_token_by_token_matches(pair):
    hf, ours = pair
    ids = torch.randint(0, tiny_models.VOCAB, (2, 100), generator=torch.Generator().manual_seed(2))
    cache = ours.new_cache(batch=2, capacity=16)  # small on purpose: the cache must grow
    with torch.no_grad():
        ref = hf(ids).logits
        steps = [ours.logits(ours(ids[:, :40], cache=cache))]
        for i in range(40, 100):
            steps.append(ours.logits(ours(ids[:, i : i + 1], cache=cache)))
    got = torch.cat(steps, dim=1)
    assert cache.lengths == [100, 100]
    assert (ref - got).abs().max().item() <= 1e-4


def test_padded_batch_matches_each_sequence_alone(pair):
    """Rows of different lengths, right-padded, prefilled together then decoded together."""
    _, ours = pair
    gen = torch.Generator().manual_seed(3)
    lens = [7, 13]
    seqs = [torch.randint(0, tiny_models.VOCAB, (n + 5,), generator=gen) for n in lens]
    alone = []
    with torch.no_grad():
        for s in seqs:
            cache = ours.new_cache(1, 32)
            out = [ours.logits(ours(s[None, : len(s) - 5], cache=cache))[:, -1]]
            for t in s[len(s) - 5 :]:
                out.append(ours.logits(ours(t.view(1, 1), cache=cache))[:, -1])
            alone.append(torch.cat(out[1:]))
        width = max(lens)
        batch = torch.full((2, width), tiny_models.PAD_ID)
        valid = torch.zeros(2, width, dtype=torch.bool)
        for b, (s, n) in enumerate(zip(seqs, lens, strict=True)):
            batch[b, :n] = s[:n]
            valid[b, :n] = True
        cache = ours.new_cache(2, 32)
        ours(batch, cache=cache, valid=valid)  # commits only the valid tokens of each row
        assert cache.lengths == lens
        together = []
        for i in range(5):
            step = torch.stack([s[n + i] for s, n in zip(seqs, lens, strict=True)]).view(2, 1)
            together.append(ours.logits(ours(step, cache=cache))[:, -1])
    for b in range(2):
        got = torch.stack([t[b] for t in together])
        assert (got - alone[b]).abs().max().item() <= 1e-4


def test_bf16_forward_close(pair):
    hf, ours = pair
    ids = torch.randint(0, tiny_models.VOCAB, (1, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours.to(torch.bfloat16).logits(ours(ids)).float()
    ours.to(torch.float32)
    # bf16 keeps ~3 significant digits; the point is that nothing is wired differently.
    assert (ref - got).abs().max().item() <= 0.05 * ref.abs().max().item()
