"""How far apart two computations of the same sums may be when only their order differs.

Chunked vs whole, a fused kernel vs PyTorch, AMX vs AVX512 vs AVX2 matmul blocking: each adds
the same terms in another order, so the results differ by rounding alone, and by how much
depends on the dtype and on how many terms each output sums, not on the machine that last ran
the test. Every such comparison in the suite states its reduction length here instead of a
hand-picked `atol=1e-7` (which held on one CPU's blocking and failed on another's).

The bound: a sum of n terms in floating point is off by at most n·eps·Σ|x_i| in the worst
case and by about sqrt(n)·eps·Σ|x_i| for rounding errors of random sign, which is what blocked
kernels give; two such sums differ by up to twice that. We allow SAFETY times the random-sign
figure, relative to `scale` (the size of Σ|x_i|: for a softmax-weighted average of values,
the largest |value|), so a real error (a missing chunk, a wrong maximum, a dropped bias: O(1)
relative) still fails by orders of magnitude.
"""

from __future__ import annotations

import math

import torch

SAFETY = 4.0


def tolerance(dtype: torch.dtype, terms: int) -> float:
    """The relative difference allowed between two `dtype` sums of `terms` terms that differ
    only in order, relative to the sum of the terms' magnitudes."""
    if terms < 1:
        raise ValueError("a sum has at least one term")
    return SAFETY * torch.finfo(dtype).eps * math.sqrt(terms)


def assert_reordered_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    terms: int,
    scale: float | torch.Tensor | None = None,
) -> None:
    """`actual` equals `expected` up to the reordering of sums of `terms` terms each: every
    element within `tolerance` times its `scale`, the size of the sum of its terms' magnitudes.
    `scale` defaults to |expected| element by element, which is that size exactly where the
    terms do not cancel (sums of positive terms); pass it where they may (a softmax-weighted
    average of values: the largest |value|)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if scale is None:
        scale = expected.abs()
    allowed = tolerance(expected.dtype, terms) * scale
    excess = (actual - expected).abs() - allowed
    worst = int(excess.argmax())
    got, want = actual.flatten()[worst].item(), expected.flatten()[worst].item()
    assert excess.max() <= 0, (
        f"element {worst}: {got!r} vs {want!r}, more than reordering {terms} terms allows "
        f"({float(torch.as_tensor(allowed).max()):.3g})"
    )
