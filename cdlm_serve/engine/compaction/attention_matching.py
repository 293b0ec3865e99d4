"""Attention Matching KV compaction (arXiv:2602.16284), per layer and KV head, in fp32.

For one KV head: original keys K [T, D] (post-RoPE), values V [T, D], an optional bias b [T]
(already-compacted slots carry one), and reference queries Q [n, D] (every query head of the
GQA group, pooled). The compacted block is keys C_k [t, D], biases beta [t], values C_v [t, D],
chosen so that for the reference queries it reproduces

- the attention mass  m_i = sum_j exp(s_ij - max_i)          (s = Q K^T * scale + b), and
- the attention output  y_i = softmax(s_i) V,

which together make the compacted block a drop-in for the original inside any larger softmax.

1. keys: a subset of the original keys — the t with the highest aggregated attention
   (HighestAttnKeys: the mean over the reference queries here, not the paper's RMS; see
   HIGHEST_AGGREGATE; or, where the head says so (`context_keys`), the attention the context's
   own queries paid each key at prefill, accumulated: `highest_context_attention`), or Orthogonal
   Matching Pursuit on the mass target (pick the keys whose exp-score columns best explain
   the residual mass, k at a time, refitting every r iterations; "fast" = 4 and 2), always
   with a final refit;
2. beta = log w, with w >= 0 the nonnegative least-squares fit of the exp-score columns of the
   chosen keys to the mass (rows stabilized by their max), w clamped away from 0;
3. C_v = least squares of the compacted softmax weights against the original outputs (ridge
   when ill-conditioned).

Token-selection baselines (StreamingLLM, H2O, SnapKV, Expected Attention, KVzip-style, random;
`engine.compaction.baselines`) share the interface: they pick keys and keep their values and
bias.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from cdlm_serve.engine.compaction import baselines
from cdlm_serve.engine.compaction.nnls import GrowingNNLS, nonnegative_weights
from cdlm_serve.models import kernels

Aggregate = Literal["rms", "mean", "max"]
# HighestAttnKeys' aggregate over the reference queries. The paper's is RMS; on SmolLM2-135M the
# mean keeps more of the facts in all 12 cells measured (bench.compaction's 2K contexts, medians
# of 5, Austen | the Python reference, 10x / 20x): am-highest-fast 0.32 -> 0.44 | 0.37 -> 0.45 /
# 0.13 -> 0.17 | 0.12 -> 0.30; with measured budgets 0.47 -> 0.53 | 0.50 -> 0.55 / 0.16 -> 0.28
# | 0.21 -> 0.34. RMS favours keys that a few queries attend to sharply, the mean those many use.
HIGHEST_AGGREGATE: Aggregate = "mean"
MIN_WEIGHT = 1e-6  # w is clamped here before the log: beta >= log(1e-6) ~ -13.8


@dataclass(slots=True)
class HeadInputs:
    keys: Tensor  # [T, D] post-RoPE
    values: Tensor  # [T, D]
    queries: Tensor  # [n, D] reference queries (the group's heads pooled), post-RoPE
    scale: float
    bias: Tensor | None = None  # [T] additive bias already on these slots
    # For the key scores from the context's own queries (`engine.compaction.baselines`, and
    # am-highest's `highest_context_attention`): the baselines get every query head of the
    # group [G, n, D] in position order (not subsampled), am-highest a subsample of them pooled
    # [1, n', D]; their positions [n] (or [n']); the region's key positions [T]; the
    # row's slots after the region [R, D] (their bias [R], positions [R]), which those queries
    # attended to as well; and Expected Attention's future-query statistics per head of the
    # group, mean [G, D] and covariance [G, D, D].
    head_queries: Tensor | None = None
    query_positions: Tensor | None = None
    key_positions: Tensor | None = None
    tail_keys: Tensor | None = None
    tail_bias: Tensor | None = None
    tail_positions: Tensor | None = None
    future: tuple[Tensor, Tensor] | None = None
    # am-highest ranks the keys by head_queries' attention, not the reference queries'
    # (`highest_context_attention`; `engine.compaction.row.KEY_QUERIES`).
    context_keys: bool = False
    # kvzip: every reference query of the group pooled [N, D], of which `queries` is the fits'
    # sample: a key's score is its largest attention from any of them (`repeat_max_scores`).
    every_query: Tensor | None = None
    # A method's own key scores [T] (`CompactionMethod.scores`), where they were computed
    # before the selection: budgets="global" compares them across every head to share slots.
    scores: Tensor | None = None
    _targets: tuple[Tensor, Tensor, Tensor] | None = None
    _summary: tuple[Tensor, Tensor, Tensor] | None = None


@dataclass(slots=True)
class HeadResult:
    index: Tensor  # [t] chosen slots of the original block
    keys: Tensor  # [t, D]
    bias: Tensor  # [t]
    values: Tensor  # [t, D]


# ---- targets ---------------------------------------------------------------------------------
SUMMARY_ROWS = 256  # queries per chunk of `summary`: a [rows, T] block of scores stays in cache


def targets(h: HeadInputs) -> tuple[Tensor, Tensor, Tensor]:
    """(E [n, T] = exp(s - rowmax), mass m [n], outputs Y [n, D]) of the original block, for
    the fp32 scores s = Q K^T * scale + b; computed once per head (the key selections that
    read E, beta, the values and the error all read them). E is made in the scores' own
    storage: at n = 2,048 queries and 4K keys each [n, T] temporary is 32 MB of fresh pages,
    and in place the whole is 2x faster. Where nothing reads E, `summary` is cheaper still."""
    if h._targets is None:
        q, k = h.queries.float(), h.keys.float()
        if h.bias is None:
            s = q @ k.T
            s.mul_(h.scale)
        else:
            s = torch.addmm(h.bias.float(), q, k.T, alpha=h.scale)
        rowmax = s.max(dim=1, keepdim=True).values  # [n, 1]
        e = s.sub_(rowmax).exp_()
        m = e.sum(dim=1)
        y = (e @ h.values.float()) / m[:, None]
        h._targets = e, m, y
        h._summary = rowmax, m, y
    return h._targets


def summary(h: HeadInputs) -> tuple[Tensor, Tensor, Tensor]:
    """(rowmax [n, 1], mass m [n], outputs Y [n, D]): what beta, the values and the error
    read of the targets, without E. Unless `targets` made them already, the scores go
    SUMMARY_ROWS queries at a time through one reused block, so no [n, T] matrix is made:
    1.7x faster than `targets` at 4K-8K keys (it writes 32-64 MB of fresh memory per head),
    with the same values (the same kernels on the same numbers, row by row)."""
    if h._summary is None:
        q, kt, v = h.queries.float(), h.keys.float().T, h.values.float()
        bias = None if h.bias is None else h.bias.float()
        n = q.shape[0]
        block = torch.empty(min(n, SUMMARY_ROWS), kt.shape[1])  # [rows, T], reused
        rowmax, m, y = torch.empty(n, 1), torch.empty(n), torch.empty(n, v.shape[1])
        for a in range(0, n, SUMMARY_ROWS):
            b = min(n, a + SUMMARY_ROWS)
            s = block[: b - a]
            if bias is None:
                torch.mm(q[a:b], kt, out=s)
                s.mul_(h.scale)
            else:
                torch.addmm(bias, q[a:b], kt, alpha=h.scale, out=s)
            torch.amax(s, dim=1, keepdim=True, out=rowmax[a:b])
            s.sub_(rowmax[a:b]).exp_()
            torch.sum(s, dim=1, out=m[a:b])
            torch.mm(s, v, out=y[a:b])
        h._summary = rowmax, m, y.div_(m[:, None])
    return h._summary


# ---- key selection ---------------------------------------------------------------------------
def highest_attention_scores(h: HeadInputs, aggregate: Aggregate = HIGHEST_AGGREGATE) -> Tensor:
    """[T] each key's attention from the reference queries, aggregated over them."""
    e, m, _ = targets(h)
    if aggregate == "rms":  # sqrt(mean_i (e_ij / m_i)^2), without the [n, T] softmax
        return _weighted_square_sums(e, m.pow(-2)).div_(e.shape[0]).sqrt_()
    if aggregate == "mean":  # mean_i e_ij / m_i, likewise
        return (e.T @ m.reciprocal()).div_(e.shape[0])
    return (e / m[:, None]).max(dim=0).values  # [n, T] the softmax, then its column maxima


# Queries per block of `repeat_max_scores`' torch path (the CPU kernel's blocks are as many,
# `kScoreRows` in models/kernels/common.h): a [rows, T] block of scores stays in the caches
# (2 MB at 4K keys). 2,048 rows (64 MB blocks at 8K) took 2.2x as long for the same maxima
# (one KV head, 24.6K queries x 8K keys, fp32, 2 cores: 0.73 s against 0.31-0.33 s at
# 128-512 rows), which at 8K tokens was 68 of auto's 85 s of compaction (bf16 model).
REPEAT_MAX_ROWS = 128


def repeat_max_scores(h: HeadInputs) -> Tensor:
    """[T] KVzip's score: each region key's largest attention from any repeat query, every
    one of them (h.every_query; else the sample h.queries), each query's softmax over the
    region and the exact tail after it (h.tail_keys, where given), as it attends at decode.
    A repeated token's query reads the original it copies most where the model cannot
    predict it, so the score is high on what only the cache knows (a fact's code word) and
    low on what the model would write anyway. The maximum needs every query: the one that
    copies a token is one of thousands, and the fits' sample (2,048 of ~25K at 8K tokens)
    holds each query a twelfth of the time (bench.online_compaction: 0.72 of the facts with
    every query, median of 3 contexts, docs/compaction.md).

    The maxima are kept as logs: each score costs one exp. On a CPU a fused kernel does it
    all (`kernels.repeat_max`), a bf16 model's scores by AVX512-BF16 dot products where the
    CPU has them (exact products, fp32 sums). One KV head at 8K tokens, 2 cores: 0.45 s by
    torch's softmax, 0.21 s by the kernel in fp32, 0.10 s in bf16."""
    queries = h.queries if h.every_query is None else h.every_query  # [N, D]
    keys, bias = baselines.row_keys(h)  # [T + R, D], [T + R]
    region, n = h.keys.shape[0], queries.shape[0]
    best = torch.full((region,), -math.inf, device=keys.device)  # log of the maxima so far
    if not kernels.repeat_max(queries, keys, bias, h.scale, region, best):
        for a in range(0, n, REPEAT_MAX_ROWS):
            s = torch.addmm(bias, queries[a : a + REPEAT_MAX_ROWS].float(), keys.T, alpha=h.scale)
            torch.maximum(best, torch.log_softmax(s, dim=1)[:, :region].amax(dim=0), out=best)
    return best.exp_()


def _weighted_square_sums(e: Tensor, w: Tensor, rows: int = 256) -> Tensor:
    """[T] sum_i w_i e_ij^2 for e [n, T], w [n]: `rows` rows at a time, so that the squares
    are a few MB of reused memory rather than another [n, T] temporary."""
    out = torch.zeros(e.shape[1], dtype=e.dtype)
    for a in range(0, e.shape[0], rows):
        out.addmv_(e[a : a + rows].square().T, w[a : a + rows])
    return out


def highest_attention(h: HeadInputs, t: int, aggregate: Aggregate = HIGHEST_AGGREGATE) -> Tensor:
    """The t keys the reference queries attend to most (aggregated over queries)."""
    return highest_attention_scores(h, aggregate).topk(t).indices.sort().values


def highest_context_attention(h: HeadInputs, t: int) -> Tensor:
    """The t keys the context's own queries (h.head_queries, at h.query_positions) attended to
    most at prefill, their causal attention summed over them: H2O's heavy hitters, all t of
    them by score (no recent window). The repeat queries that beta and the values are fitted
    on mostly read the token each one copies, so their attention picks the copy targets
    rather than the keys that later questions read (`engine.compaction.row.KEY_QUERIES` has
    the measurement). The plain sum ranks best of what was tried (am-highest-fast, facts
    kept, Austen 2K, 5 contexts, 10x / 20x): sum 0.56 / 0.43; divided by the number of
    queries that see each key (its mean) 0.50 / 0.26, by its square root 0.56 / 0.31; a
    quarter of the budget to the most recent slots, as H2O's half, 0.55 / 0.36."""
    return baselines.accumulated_attention(h).topk(t).indices.sort().values


@dataclass(slots=True)
class OmpBudget:
    """Wall time OMP's key selection may take over one whole compaction (all layers and heads).
    Past `fast_after` (time.monotonic()) OMP continues as its fast variant (4 keys per
    iteration, refit every 2); past `stop_after` it takes the keys still missing by highest
    attention at once. `fast_from` / `stop_from` record the layer where each began."""

    fast_after: float
    stop_after: float
    layer: int = 0  # the layer being fitted (set by the caller)
    fast_from: int | None = None
    stop_from: int | None = None

    @classmethod
    def starting_now(cls, seconds: float) -> OmpBudget:
        """`seconds` of exact OMP, then as much again of its fast variant."""
        now = time.monotonic()
        return cls(now + seconds, now + 2 * seconds)

    def pace(self, per_iter: int, refit_every: int) -> tuple[int, int, bool]:
        """(keys per iteration, refit period, stop now) for OMP's next iteration."""
        now = time.monotonic()
        if now > self.stop_after:
            if self.stop_from is None:
                self.stop_from = self.layer
            return per_iter, refit_every, True
        if now > self.fast_after:
            if self.fast_from is None:
                self.fast_from = self.layer
            return max(per_iter, 4), max(refit_every, 2), False
        return per_iter, refit_every, False

    def describe(self) -> str | None:
        parts = []
        if self.fast_from is not None:
            parts.append(f"am-omp-fast from layer {self.fast_from}")
        if self.stop_from is not None:
            parts.append(f"highest-attention keys from layer {self.stop_from}")
        if not parts:
            return None
        return "OMP time budget used up: " + ", then ".join(parts)


def omp(
    h: HeadInputs,
    t: int,
    per_iter: int = 1,
    refit_every: int = 1,
    budget: OmpBudget | None = None,
) -> Tensor:
    """Orthogonal Matching Pursuit on the mass target: repeatedly add the keys whose exp-score
    columns correlate best with the mass not yet explained, refitting the nonnegative weights
    every `refit_every` iterations. With a budget, the pace quickens once it is spent."""
    e, m, _ = targets(h)  # E [n, T], m [n]
    norms = e.norm(dim=0).clamp_min(1e-12)  # [T]
    fit = GrowingNNLS(e, m, t)
    available = torch.ones(e.shape[1], dtype=torch.bool)
    residual = m.clone()
    corr: Tensor | None = None
    iteration = 0
    while len(fit.chosen) < t:
        stop = False
        if budget is not None:
            per_iter, refit_every, stop = budget.pace(per_iter, refit_every)
        if stop:  # out of time: the missing keys by attention (beta and values fit as usual)
            attention = highest_attention_scores(h)  # [T], as am-highest ranks them
            attention[~available] = -math.inf
            fit.add(attention.topk(t - len(fit.chosen)).indices.tolist())
            break
        if corr is None:  # a pass over E, once per refit (they change only when the fit does)
            corr = (e.T @ residual) / norms  # [T]
            corr[~available] = -math.inf
        take = corr.topk(min(per_iter, t - len(fit.chosen))).indices.tolist()
        fit.add(take)
        available[take] = False
        corr[take] = -math.inf
        iteration += 1
        if iteration % refit_every == 0 or len(fit.chosen) == t:
            residual = fit.residual()
            corr = None
        # Between refits the old fit stands (zero weight on the new keys): the residual, and so
        # the correlations, are unchanged, and the next keys are the next best of the same.
    return torch.tensor(sorted(fit.chosen))


# ---- beta and values -------------------------------------------------------------------------
def fit_values(x: Tensor, y: Tensor, ridge: float = 1e-6) -> Tensor:
    """argmin_C ||x C - y||^2 (x [n, t], y [n, D]): the normal equations by Cholesky, with a
    small ridge when x^T x is (numerically) singular."""
    gram = x.double().T @ x.double()
    rhs = x.double().T @ y.double()
    chol, info = torch.linalg.cholesky_ex(gram)
    if int(info) == 0 and chol.diagonal().min() > 1e-7 * chol.diagonal().max():
        return torch.cholesky_solve(rhs, chol).float()
    eye = torch.eye(gram.shape[0], dtype=gram.dtype)
    solved: Tensor = torch.linalg.solve(gram + ridge * gram.diagonal().mean() * eye, rhs)
    return solved.float()


class _Clock:
    """Adds wall time per stage into a dict (no-op without one)."""

    def __init__(self, timings: dict[str, float] | None):
        self.timings = timings
        self.last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        if self.timings is not None:
            self.timings[stage] = self.timings.get(stage, 0.0) + now - self.last
        self.last = now


def fit(
    h: HeadInputs, index: Tensor, timings: dict[str, float] | None = None, values: bool = True
) -> HeadResult:
    """Given chosen keys, fit beta (mass) then C_v (outputs); `values` False keeps the chosen
    keys' own values (am-h2o: fitted values do not carry over to later questions there)."""
    clock = _Clock(timings)
    rowmax, m, y = summary(h)
    s = h.queries.float() @ h.keys[index].float().T * h.scale  # [n, t], without old bias
    a = torch.exp(s - rowmax)  # same stabilization as the target
    w = nonnegative_weights(a, m).clamp_min(MIN_WEIGHT)
    beta = torch.log(w)
    clock.lap("beta")
    if not values:
        return HeadResult(index, h.keys[index].float(), beta, h.values[index].float())
    x = a * w  # [n, t] unnormalized weights of the compacted block
    x = x / x.sum(dim=1, keepdim=True)
    fitted = fit_values(x, y)
    clock.lap("values")
    return HeadResult(index, h.keys[index].float(), beta, fitted)


def keep(h: HeadInputs, index: Tensor) -> HeadResult:
    """Token selection: the chosen keys with their own values and bias."""
    bias = h.bias[index].float() if h.bias is not None else torch.zeros(len(index))
    return HeadResult(index, h.keys[index].float(), bias, h.values[index].float())


def relative_output_error(h: HeadInputs, r: HeadResult) -> float:
    """||y_compacted - y|| / ||y|| over the reference queries."""
    _, _, y = summary(h)
    return _output_error(h.queries, y, h.scale, r)


# The reference queries a compaction's reported output error is measured on. The error needs
# the original attention's outputs, which the fits make for every query anyway; a method with
# no fits (kvzip, the token-selection baselines) would make them only for the report: at 8K
# tokens that was ~3.5 s of `auto`'s ~27 s (2,046 queries over 8K keys, 90 heads).
ERROR_QUERIES = 256


def sampled_output_error(h: HeadInputs, r: HeadResult, count: int = ERROR_QUERIES) -> float:
    """relative_output_error over `count` of the reference queries evenly spaced (all of them
    where there are no more): the same queries whether or not the targets were made, so that
    methods compare; the original outputs are read from the targets where a fit made them,
    else made for those queries alone."""
    n = h.queries.shape[0]
    if n <= count:
        return relative_output_error(h, r)
    rows = torch.linspace(0, n - 1, count, device=h.queries.device).round().long()  # [count]
    queries = h.queries[rows]
    if h._summary is not None:
        y = h._summary[2][rows]
    else:
        _, _, y = summary(replace(h, queries=queries, _targets=None, _summary=None))
    return _output_error(queries, y, h.scale, r)


def _output_error(queries: Tensor, y: Tensor, scale: float, r: HeadResult) -> float:
    """queries [n, D] and their original outputs y [n, D] -> the relative error of r's."""
    s = queries.float() @ r.keys.T * scale + r.bias
    y_hat = torch.softmax(s, dim=1) @ r.values
    return float((y_hat - y).norm() / y.norm().clamp_min(1e-12))


def mass_error(h: HeadInputs, r: HeadResult) -> float:
    """Relative error of the attention mass sum_j exp(s_j) over the reference queries."""
    rowmax, m, _ = summary(h)
    s_hat = h.queries.float() @ r.keys.T * h.scale + r.bias
    m_hat = torch.exp(s_hat - rowmax).sum(dim=1)
    return float((m_hat - m).norm() / m.norm())
