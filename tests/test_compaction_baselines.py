"""The token-selection baselines, as their papers define them (engine/compaction/baselines.py)."""

from __future__ import annotations

import pytest
import torch

from cdlm_serve.engine.compaction import baselines
from cdlm_serve.engine.compaction.attention_matching import HeadInputs
from cdlm_serve.engine.compaction.head import compact_head
from cdlm_serve.models.rope import apply_rotary


def _context_head(total: int = 64, dim: int = 16, seed: int = 0) -> HeadInputs:
    """A context of `total` tokens whose queries are its own positions 0..total-1 (causal),
    with no keys after the region."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(total, dim, generator=gen)
    queries = 0.1 * torch.randn(total, dim, generator=gen)
    h = HeadInputs(keys, torch.randn(total, dim, generator=gen), queries, dim**-0.5)
    h.head_queries = queries[None]
    h.query_positions = torch.arange(total)
    h.key_positions = torch.arange(total)
    return h


def _aim(h: HeadInputs, query: int, key: int, strength: float = 30.0) -> None:
    """Make query `query` attend almost only to key `key`."""
    h.head_queries[0, query] = strength * h.keys[key] / h.keys[key].norm()


def test_h2o_accumulates_causal_attention_and_keeps_a_recent_half():
    h = _context_head()
    for q in range(20, 40):
        _aim(h, q, 5)  # key 5: a heavy hitter for 20 queries
    # Key 50 is aimed at by queries before it exists: causally they cannot see it.
    for q in range(10, 20):
        _aim(h, q, 50)
    chosen = baselines.h2o(h, 8).tolist()
    assert 5 in chosen
    assert chosen[-4:] == [60, 61, 62, 63]  # half the budget: the most recent slots
    assert 50 not in chosen
    # Without the causal mask the early queries would have made key 50 a heavy hitter.
    h.query_positions = torch.full((64,), 1000)
    assert 50 in baselines.h2o(h, 8).tolist()


def test_snapkv_votes_with_the_last_window_and_pools_neighbours():
    h = _context_head(total=128)
    for q in range(0, 90):
        _aim(h, q, 7)  # early queries only: outside the observation window
    _aim(h, 120, 40)  # the window's vote
    chosen = baselines.snapkv(h, 40, window=32, kernel=7).tolist()
    assert set(range(96, 128)) <= set(chosen)  # the window's own keys are kept
    assert 40 in chosen and 7 not in chosen
    # Max-pooling: the neighbours of the voted key share its vote.
    assert {38, 39, 41, 42} <= set(chosen)


def test_expected_attention_scores_are_the_gaussian_expectation():
    """For q ~ N(mu, S), E[exp(q.k * scale)] = exp(mu.k * scale + k^T S k * scale^2 / 2): the
    closed form the scores use, against a Monte Carlo estimate."""
    gen = torch.Generator().manual_seed(0)
    dim, scale = 8, 8**-0.5
    keys = torch.randn(5, dim, generator=gen)
    mu = torch.randn(dim, generator=gen)
    a = 0.5 * torch.randn(dim, dim, generator=gen)
    cov = a @ a.T
    q = mu + torch.randn(400_000, dim, generator=gen, dtype=torch.float64).float() @ a.T
    sampled = torch.exp(q.double() @ keys.double().T * scale).mean(0)
    closed = torch.exp(
        mu @ keys.T * scale + torch.einsum("kd,de,ke->k", keys, cov, keys) * scale**2 / 2
    )
    torch.testing.assert_close(sampled.float(), closed, rtol=0.03, atol=0)


def test_future_statistics_undo_rope_and_apply_the_average_future_rotation():
    """Queries that are one vector q0 rotated to their positions have mean q0 and no spread
    before RoPE; the statistics carried to the future are q0 rotated by the mean rotation."""
    from cdlm_serve.models.rope import RotaryTable, inverse_frequencies

    dim, n = 16, 50
    table = RotaryTable(
        inverse_frequencies(dim, 10000.0, None), 700, torch.device("cpu"), torch.float32
    )
    q0 = torch.randn(dim, generator=torch.Generator().manual_seed(1))
    cos, sin = table.cos[:n], table.sin[:n]
    queries = apply_rotary(q0.expand(1, n, 1, dim), cos[None, :, None], sin[None, :, None])[0, :, 0]
    fcos, fsin = table.cos[100:612], table.sin[100:612]
    mean, cov = baselines.future_query_statistics(queries[None], cos, sin, fcos, fsin)
    assert cov.abs().max() < 1e-4
    future = apply_rotary(q0.expand(1, 512, 1, dim), fcos[None, :, None], fsin[None, :, None])
    torch.testing.assert_close(mean[0], future[0, :, 0].mean(0), rtol=1e-4, atol=1e-4)


def test_expected_attention_keeps_sinks_and_weighs_by_value_norm():
    h = _context_head()
    mean = 5 * h.keys[30] / h.keys[30].norm()
    h.future = (mean[None], torch.zeros(1, 16, 16))
    chosen = baselines.expected_attention(h, 6).tolist()
    assert chosen[:4] == [0, 1, 2, 3] and 30 in chosen
    h.values[30] = 0  # nothing to read there: no longer worth keeping
    assert 30 not in baselines.expected_attention(h, 6).tolist()


@pytest.mark.parametrize("method", ["snapkv", "h2o", "expected_attention"])
def test_context_scored_baselines_need_the_contexts_queries(method):
    h = _context_head()
    h.head_queries = None
    with pytest.raises(ValueError, match="context"):
        compact_head(h, 8, method)


def test_accumulated_attention_is_the_causal_softmax_summed_in_any_query_order(monkeypatch):
    """H2O's score, computed in chunks of position-sorted queries over the keys up to each
    chunk's last position only, equals the dense causal softmax summed over the queries,
    whatever order the queries come in, with keys after the region (the tail) in the softmax."""
    gen = torch.Generator().manual_seed(3)
    h = _context_head(total=48, seed=3)
    h.head_queries = torch.randn(2, 60, 16, generator=gen)  # two heads, 60 queries
    h.query_positions = torch.randint(0, 56, (60,), generator=gen)  # unsorted, repeats
    h.tail_keys = torch.randn(8, 16, generator=gen)
    h.tail_bias = torch.randn(8, generator=gen)
    h.tail_positions = torch.arange(48, 56)
    h.bias = torch.randn(48, generator=gen)
    keys = torch.cat([h.keys, h.tail_keys])
    bias = torch.cat([h.bias, h.tail_bias])
    s = h.head_queries @ keys.T * h.scale + bias  # [2, 60, 56]
    s = s.masked_fill(torch.arange(56)[None, :] > h.query_positions[:, None], float("-inf"))
    want = torch.softmax(s, dim=-1).sum(dim=(0, 1))[:48]
    monkeypatch.setattr(baselines, "QUERY_CHUNK", 7)
    torch.testing.assert_close(baselines.accumulated_attention(h), want, atol=1e-5, rtol=1e-5)
