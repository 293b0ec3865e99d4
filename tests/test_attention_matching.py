"""Attention Matching on single heads with known answers (engine/compaction/attention_matching.py,
engine/compaction/nnls.py)."""

from __future__ import annotations

import math

import pytest
import torch

from cdlm_serve.engine.compaction import METHODS
from cdlm_serve.engine.compaction.attention_matching import (
    HIGHEST_AGGREGATE,
    HeadInputs,
    fit,
    highest_attention_scores,
    keep,
    mass_error,
    relative_output_error,
    sampled_output_error,
    summary,
    targets,
)
from cdlm_serve.engine.compaction.head import compact_head, select_keys
from cdlm_serve.engine.compaction.nnls import (
    _reduced,
    gram_nnls,
    nonnegative_weights,
    pivoting_nnls,
)
from tolerances import assert_reordered_close


def _head(
    total: int = 200, n: int = 300, dim: int = 32, seed: int = 0, bias: bool = False
) -> HeadInputs:
    """Queries that concentrate on a few "hot" keys plus noise, as real attention does (with
    `bias`, slots compacted before: an additive bias on every key)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(total, dim, generator=gen)
    hot = keys[torch.randint(0, 8, (n,), generator=gen)]
    queries = 0.7 * torch.randn(n, dim, generator=gen) + 1.5 * hot
    h = HeadInputs(keys, torch.randn(total, dim, generator=gen), queries, dim**-0.5)
    if bias:
        h.bias = torch.randn(total, generator=gen)
    # The prefill-time baselines read the queries as one head's, after every key.
    h.head_queries = queries[None]
    h.query_positions = torch.arange(total, total + n)
    h.key_positions = torch.arange(total)
    centred = queries - queries.mean(0)
    h.future = (queries.mean(0)[None], (centred.T @ centred / n)[None])
    return h


def test_highest_attention_scores_aggregate_the_softmax_over_queries():
    """Each aggregate, computed without the [n, T] softmax where it can be, is the softmax's
    mean / RMS / max over the queries; am-highest keeps the top keys by HIGHEST_AGGREGATE."""
    h = _head(bias=True)
    s = h.queries @ h.keys.T * h.scale + h.bias
    p = torch.softmax(s, dim=1)  # [n, T]
    expected = {"mean": p.mean(0), "rms": p.square().mean(0).sqrt(), "max": p.max(0).values}
    for aggregate, want in expected.items():
        got = highest_attention_scores(_head(bias=True), aggregate)
        # Each aggregate reduces over the 300 queries; the softmax over the 200 keys.
        assert_reordered_close(got, want, terms=300 + 200)
    top = expected[HIGHEST_AGGREGATE].topk(20).indices.sort().values
    assert torch.equal(select_keys(_head(bias=True), 20, "am-highest"), top)
    assert not torch.equal(
        expected["mean"].topk(20).indices.sort().values,
        expected["rms"].topk(20).indices.sort().values,
    )  # the choice matters


def test_am_highest_ranks_by_the_context_queries_causal_attention_when_told():
    """With `context_keys`, am-highest keeps the t keys the context's own queries attended to
    most, each query over the keys at or before its position (H2O's accumulated attention,
    without its recent window); else the reference queries' mean, a different set here."""
    h = _head(bias=True)
    gen = torch.Generator().manual_seed(5)
    n, total = 150, h.keys.shape[0]
    hot = h.keys[torch.randint(0, total, (2, n), generator=gen)]
    context = 0.7 * torch.randn(2, n, h.keys.shape[1], generator=gen) + 1.5 * hot  # [G, n, D]
    positions = torch.randint(0, total, (n,), generator=gen).sort().values
    h.head_queries, h.query_positions = context, positions
    s = context @ h.keys.T * h.scale + h.bias  # [G, n, T]
    s = s.masked_fill(torch.arange(total)[None, :] > positions[:, None], -math.inf)
    want = torch.softmax(s, dim=-1).sum(dim=(0, 1)).topk(20).indices.sort().values
    h.context_keys = True
    assert torch.equal(select_keys(h, 20, "am-highest"), want)
    assert torch.equal(select_keys(h, 20, "am-highest-fast"), want)
    h.context_keys = False
    assert not torch.equal(select_keys(h, 20, "am-highest"), want)
    bare = _head()
    bare.head_queries, bare.context_keys = None, True
    with pytest.raises(ValueError, match="context's own queries"):
        select_keys(bare, 20, "am-highest")


def test_am_h2o_keeps_h2os_keys_and_their_values_with_a_fitted_beta():
    """am-h2o: H2O's keys (heavy hitters of the context's attention and the recent half), the
    mass matched by AM's beta on the reference queries, the values the keys' own (not fitted).
    Its beta matches the mass better than H2O's (none), and the full fit's values differ."""
    h = _head(seed=3, bias=True)
    r = compact_head(h, 40, "am-h2o")
    want = compact_head(h, 40, "h2o")
    assert torch.equal(r.index, want.index)
    assert torch.equal(r.keys, h.keys[r.index]) and torch.equal(r.values, h.values[r.index])
    full = fit(h, r.index)
    assert torch.equal(r.bias, full.bias)  # the same beta as the fit that fits values too
    assert not torch.allclose(full.values, r.values, atol=1e-3)
    assert mass_error(h, r) < 0.5 * mass_error(h, want)
    bare = _head()
    bare.head_queries = None
    with pytest.raises(ValueError, match="context's own queries"):
        select_keys(bare, 20, "am-h2o")


@pytest.mark.parametrize("bias", [False, True])
def test_the_summary_is_the_targets_without_their_exp_score_matrix(bias):
    """`summary` (row maxima, mass, outputs) over queries in chunks, across several chunks
    and a short last one, equals the definitions and what `targets` gives with E; a head
    summarized alone never makes E (which only the key selections that read it need)."""
    h = _head(total=300, n=2 * 256 + 37, bias=bias)
    rowmax, m, y = summary(h)
    assert h._targets is None
    s = h.queries @ h.keys.T * h.scale + (h.bias if bias else 0)  # [n, T]
    torch.testing.assert_close(rowmax, s.max(dim=1, keepdim=True).values)
    # Every mass and output sums over the 300 keys (after a 32-long dot product), in chunks
    # here and whole below: equal up to the order of those sums, on any CPU's kernels.
    terms = 300 + 32
    assert_reordered_close(m, torch.exp(s - rowmax).sum(dim=1), terms)
    values = float(h.values.abs().max())  # an output is a convex combination of the values
    assert_reordered_close(y, torch.softmax(s, dim=1) @ h.values, terms, scale=values)
    other = _head(total=300, n=2 * 256 + 37, bias=bias)
    e, m_full, y_full = targets(other)
    assert summary(other)[1] is m_full  # made with E: taken from there
    assert_reordered_close(m_full, m, terms)
    assert_reordered_close(y_full, y, terms, scale=values)
    assert_reordered_close(e.sum(dim=1), m, terms)


def test_keeping_every_key_reproduces_output_and_mass():
    h = _head()
    r = fit(h, torch.arange(200))
    assert relative_output_error(h, r) <= 1e-4
    assert mass_error(h, r) <= 1e-4
    # beta = log 1; keys that get almost no attention determine their weight only loosely.
    assert r.bias.abs().max() <= 1e-3


@pytest.mark.parametrize("method", ["am-highest", "am-omp-fast"])
def test_output_error_falls_as_the_budget_grows(method):
    h = _head()
    errors = [relative_output_error(h, compact_head(h, t, method)) for t in (10, 25, 50, 100)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.5 * errors[0]


def test_the_reported_error_is_measured_on_the_same_evenly_spaced_queries():
    """A compaction reports its output error on ERROR_QUERIES of the reference queries, evenly
    spaced: the same ones whether a fit made the original outputs for all of them (read
    there) or nothing did (made for those alone), and the error of exactly those queries."""
    h = _head(n=1000, bias=True)
    r = keep(h, torch.arange(0, 200, 9))
    cold = sampled_output_error(h, r, count=64)
    assert h._summary is None and h._targets is None  # made for the 64 queries alone
    rows = torch.linspace(0, 999, 64).round().long()
    alone = HeadInputs(h.keys, h.values, h.queries[rows], h.scale, bias=h.bias)
    assert cold == pytest.approx(relative_output_error(alone, r), rel=1e-5)
    targets(h)  # as a fit makes them: every query's
    assert sampled_output_error(h, r, count=64) == pytest.approx(cold, rel=1e-5)
    # An estimate of the error over all of them, and not the same number.
    whole = relative_output_error(h, r)
    assert whole != cold and cold == pytest.approx(whole, rel=0.25)
    assert sampled_output_error(h, r, count=1000) == whole  # no more than there are: all


def test_beta_is_what_matches_the_mass():
    h = _head()
    r = fit(h, compact_head(h, 20, "am-highest").index)
    without = keep(h, r.index)  # the same keys, no bias, original values
    assert mass_error(h, r) < 0.5 * mass_error(h, without)
    assert relative_output_error(h, r) < relative_output_error(h, without)


@pytest.mark.parametrize("warm", [False, True])
def test_gram_nnls_matches_scipy(warm):
    """OMP's refits solve NNLS from the Gram matrix, warm-started: same optimum as SciPy's."""
    from scipy.optimize import nnls

    gen = torch.Generator().manual_seed(1)
    for cols in (3, 30, 90):
        # Exp-score-like columns: positive and strongly correlated, so some weights hit 0.
        a = torch.rand(200, cols, generator=gen, dtype=torch.float64) ** 2
        a = a @ (
            torch.eye(cols, dtype=torch.float64)
            + 0.3 * torch.rand(cols, cols, generator=gen, dtype=torch.float64)
        )
        m = a @ torch.randn(cols, generator=gen, dtype=torch.float64)  # some w < 0
        ref, _ = nnls(a.numpy(), m.numpy(), maxiter=100 * cols)
        start = None
        if warm:  # a stale positive set, as the previous refit leaves it
            start = torch.from_numpy(ref).clone()
            start[: cols // 2] = 0
            start[cols // 2 :] += 0.1
        w = gram_nnls(a.T @ a, a.T @ m, start)
        assert (w >= 0).all()
        best = float(torch.linalg.norm(a @ torch.from_numpy(ref) - m))
        assert float(torch.linalg.norm(a @ w - m)) <= best * (1 + 1e-9)
        assert (ref == 0).sum() > 0  # the constraint was active: not a plain least squares


def _nnls_problem(gen: torch.Generator, rows: int, cols: int, spread: float = 0.0):
    """Exp-score-like columns (positive, strongly correlated) and a target that some weights
    would have to go negative to fit; `spread`: the columns' scales span 10^spread."""
    a = torch.rand(rows, cols, generator=gen, dtype=torch.float64) ** 2
    a = a @ (
        torch.eye(cols, dtype=torch.float64)
        + 0.3 * torch.rand(cols, cols, generator=gen, dtype=torch.float64)
    )
    a = a * 10 ** (-spread * torch.rand(cols, generator=gen, dtype=torch.float64))
    m = a @ (torch.randn(cols, generator=gen, dtype=torch.float64) + 0.5)
    m += 0.1 * torch.rand(rows, generator=gen, dtype=torch.float64)  # off the columns' span
    return a, m


def _scipy_nnls(a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    from scipy.optimize import nnls

    ref, _ = nnls(a.numpy(), m.numpy(), maxiter=200 * a.shape[1])
    return torch.from_numpy(ref)


@pytest.mark.parametrize("start", ["empty", "stale", "solved"])
def test_pivoting_nnls_reaches_scipys_optimum(start):
    """Block principal pivoting from no passive set, from a stale one, and from a previous
    refit's answer (the last columns new): SciPy's optimum, and it says it converged."""
    gen = torch.Generator().manual_seed(3)
    for cols in (3, 30, 120):
        a, m = _nnls_problem(gen, 300, cols)
        ref = _scipy_nnls(a, m)
        begin, solved = None, False
        if start == "stale":
            begin = ref.clone()
            begin[: cols // 2] = 0
            begin[cols // 2 :] += 0.1
        elif start == "solved":
            old = _scipy_nnls(a[:, : cols - cols // 4], m)
            begin, solved = torch.cat([old, torch.zeros(cols // 4, dtype=torch.float64)]), True
        w, converged = pivoting_nnls(a.T @ a, a.T @ m, begin, solved)
        assert converged and (w >= 0).all()
        best = float(torch.linalg.norm(a @ ref - m))
        assert float(torch.linalg.norm(a @ w - m)) <= best * (1 + 1e-9)
        # past 3 columns the constraint is active: not a plain least squares
        assert cols == 3 or (ref == 0).sum() > 0


def test_beta_weights_equal_scipys_on_columns_of_very_different_scales(monkeypatch):
    """The final fit's NNLS scales the columns first: with squared norms 1e12 apart (as a
    head's exp-score columns are at 8K keys) its optimum is still SciPy's, where the unscaled
    Gram NNLS falls short; and where the active set does not converge, the answer is SciPy's."""
    gen = torch.Generator().manual_seed(4)
    a, m = _nnls_problem(gen, 400, 80, spread=6.0)
    ref = _scipy_nnls(a, m)
    best = float(torch.linalg.norm(a @ ref - m))
    w = nonnegative_weights(a.float(), m.float()).double()
    # fp32 in and out (as fit passes them): as close as rounding the weights allows
    a32, m32 = a.float().double(), m.float().double()
    best32 = float(torch.linalg.norm(a32 @ _scipy_nnls(a32, m32).float().double() - m32))
    assert float(torch.linalg.norm(a32 @ w - m32)) <= best32 * (1 + 1e-6)
    unscaled = gram_nnls(a.T @ a, a.T @ m)
    assert float(torch.linalg.norm(a @ unscaled - m)) > best * (1 + 1e-6)

    from cdlm_serve.engine.compaction import nnls

    monkeypatch.setattr(nnls, "pivoting_nnls", lambda *args, **kw: (args[1] * 0, False))
    fallback = nonnegative_weights(a.float(), m.float()).double()
    reduced = _reduced(a32, m32, a32.T @ a32, a32.T @ m32)  # what SciPy is handed then
    assert torch.equal(fallback.float(), _scipy_nnls(*reduced).float())


def test_gram_nnls_grows_from_a_previous_refit():
    """A refit after new columns starts from the last answer as it is (`solved`): the same
    optimum as SciPy's on all the columns."""
    from scipy.optimize import nnls

    gen = torch.Generator().manual_seed(2)
    a = torch.rand(300, 60, generator=gen, dtype=torch.float64) ** 2
    a = a @ (torch.eye(60, dtype=torch.float64) + 0.3 * torch.rand(60, 60, generator=gen).double())
    m = a @ (torch.randn(60, generator=gen, dtype=torch.float64) + 0.5)  # some w < 0
    old, _ = nnls(a[:, :52].numpy(), m.numpy(), maxiter=6000)
    start = torch.cat([torch.from_numpy(old), torch.zeros(8, dtype=torch.float64)])
    w = gram_nnls(a.T @ a, a.T @ m, start, solved=True)
    ref, _ = nnls(a.numpy(), m.numpy(), maxiter=6000)
    assert (w >= 0).all() and (ref == 0).sum() > 0
    best = float(torch.linalg.norm(a @ torch.from_numpy(ref) - m))
    assert float(torch.linalg.norm(a @ w - m)) <= best * (1 + 1e-9)
    assert float(torch.linalg.norm(a @ start - m)) > best * 1.01  # the new columns mattered


def test_omp_beats_highest_attention_on_mass():
    h = _head(seed=3)
    omp_err = mass_error(h, compact_head(h, 20, "am-omp"))
    top_err = mass_error(h, compact_head(h, 20, "am-highest"))
    assert omp_err < top_err


def test_recompaction_accounts_for_existing_bias():
    """A block that already carries biases (a compacted segment) compacts again exactly."""
    h = _head()
    h.bias = torch.randn(200, generator=torch.Generator().manual_seed(9))
    r = fit(h, torch.arange(200))
    assert relative_output_error(h, r) <= 1e-4 and mass_error(h, r) <= 1e-4


@pytest.mark.parametrize("method", METHODS)
def test_every_method_returns_t_distinct_slots(method):
    h = _head()
    r = compact_head(h, 40, method)
    assert len(r.index) == 40 == len(set(r.index.tolist()))
    assert r.keys.shape == (40, 32) and r.values.shape == (40, 32) and r.bias.shape == (40,)


def test_attention_matching_beats_token_selection():
    h = _head(seed=5)
    am = relative_output_error(h, compact_head(h, 20, "am-highest"))
    for baseline in ("h2o", "streaming", "random", "snapkv"):
        assert am < 0.5 * relative_output_error(h, compact_head(h, 20, baseline)), baseline


def test_bad_sizes_and_methods_are_refused():
    h = _head()
    with pytest.raises(ValueError):
        compact_head(h, 0, "am-highest")
    with pytest.raises(ValueError):
        compact_head(h, 201, "am-highest")
    with pytest.raises(ValueError, match="unknown"):
        compact_head(h, 10, "magic")


# ---- a whole model's cache ----------------------------------------------------------------
