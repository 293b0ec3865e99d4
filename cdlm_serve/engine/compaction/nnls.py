"""Nonnegative least squares for Attention Matching's beta: an active-set NNLS on the Gram
matrix for the final fit (SciPy's NNLS where it does not converge) and on a growing Gram matrix
for OMP's many refits."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor


def nonnegative_weights(a: Tensor, m: Tensor) -> Tensor:
    """argmin_{w >= 0} ||a w - m||  (a [n, t], m [n]), in float64.

    An active-set NNLS on the Gram matrix (`scaled_gram_nnls`). It reaches the optimum that
    SciPy's NNLS finds on the t x t reduced problem, in a fraction of its time: on 15 heads of
    an 8K-token compaction (t = 755) the objectives were SciPy's to 1.5e-13 relative, in 35 ms
    per head after the Gram matrix against SciPy's 100-300 ms. Where it does not converge
    (its iteration cap, which only cycling on ties could reach), SciPy's NNLS on the reduced
    problem ||R w - c|| (`_reduced`)."""
    a64, m64 = a.double(), m.double()
    gram, rhs = a64.T @ a64, a64.T @ m64  # [t, t], [t]
    w = scaled_gram_nnls(gram, rhs)
    if w is None:
        # Imported here: scipy.optimize costs ~1.5 s at every server start, for a fallback
        # that few compactions reach.
        from scipy.optimize import nnls

        r, c = _reduced(a64, m64, gram, rhs)
        w_np, _ = nnls(r.numpy(), c.numpy(), maxiter=50 * a.shape[1] + 100)
        w = torch.from_numpy(np.asarray(w_np))
    return w.float()


def scaled_gram_nnls(gram: Tensor, rhs: Tensor) -> Tensor | None:
    """argmin_{w >= 0} ||A w - m|| from G = A^T A [t, t] and A^T m [t] (float64), or None where
    the active set did not reach the optimality conditions.

    The columns are first scaled to unit norm (w = D u, D = diag(G)^-1/2, which keeps w >= 0):
    a head's exp-score columns span up to 1e13 in squared norm at 8K keys, and unscaled, the
    ridge and tolerances of `gram_nnls` (relative to the mean diagonal) swamped the small
    columns: objectives up to 1e-3 worse than SciPy's on 3 of 15 such heads, equal on all 15
    once scaled. Kim & Park's block principal pivoting (`pivoting_nnls`), started from the
    unconstrained least squares' positive set, gets there in 10 solves per head at 8K keys
    (Lawson-Hanson's `gram_nnls` from the same start: 45), 35 vs 92 ms per head."""
    d = gram.diagonal().clamp_min(1e-300).rsqrt()  # [t]
    g = gram * d[:, None] * d[None, :]  # [t, t] unit diagonal (zero columns: 0)
    b = rhs * d
    start = None
    chol, info = torch.linalg.cholesky_ex(g)
    if int(info) == 0:
        start = torch.cholesky_solve(b[:, None], chol)[:, 0]
    u, converged = pivoting_nnls(g, b, start)
    return u * d if converged else None


def _reduced(a: Tensor, m: Tensor, gram: Tensor, rhs: Tensor) -> tuple[Tensor, Tensor]:
    """(R [t, t], c [t]) with ||a w - m||^2 = ||R w - c||^2 + const (float64), for
    gram = a^T a and rhs = a^T m: R from the Cholesky factor of the Gram matrix (R^T R = a^T a),
    or from a QR of a where that is too ill-conditioned for Cholesky in float64. With n <= 2t
    rows, (a, m) as they are: a reduction would not pay for itself."""
    if a.shape[0] <= 2 * a.shape[1]:
        return a, m
    chol, info = torch.linalg.cholesky_ex(gram)  # gram = L L^T, R = L^T
    diag = chol.diagonal()
    if int(info) == 0 and float(diag.min()) > 1e-7 * float(diag.max()):
        c = torch.linalg.solve_triangular(chol, rhs[:, None], upper=False)[:, 0]
        return chol.T, c
    q, r = torch.linalg.qr(a)
    return r, q.T @ m


class GrowingNNLS:
    """NNLS of the mass on a growing set of exp-score columns, for OMP's refits.

    Refitting from scratch (QR of the n x s column block, then SciPy's NNLS) at every refit made
    OMP cost ~2 s per head at t = 400. Here the columns' Gram matrix G = A^T A and A^T m grow by
    the new keys' rows only, and so does its Cholesky factor (one triangular solve per added
    block). A refit first takes the unconstrained least-squares weights from that factor (two
    triangular solves): where they are all positive they are the NNLS solution too (the
    constraints are inactive; with t in the hundreds, rare: 2% of the refits of 6 heads at 4K
    keys); otherwise, or once the factor has broken down on nearly collinear columns, it is an
    active-set NNLS on G started from the previous refit's answer: block principal pivoting
    (`pivoting_nnls`), and Lawson-Hanson's (`gram_nnls`) in case that does not converge.
    Measured (one head, T = 4,000 keys, 2,048 queries, t = 400): am-omp-fast 0.70 -> 0.39 s per
    head, am-omp 1.92 -> 1.07 s (OMP's picks can differ where the two fits differ in the last
    digits: the chosen keys' final mass error was equal at the median over 12 random heads)."""

    def __init__(self, e: Tensor, m: Tensor, t: int):
        self.e, self.m = e, m.double()  # [n, T], [n]
        self.cols = torch.empty(e.shape[0], t, dtype=torch.float64)  # [n, t] chosen columns
        self.gram = torch.empty(t, t, dtype=torch.float64)
        self.rhs = torch.empty(t, dtype=torch.float64)
        self.chol: Tensor | None = torch.zeros(t, t, dtype=torch.float64)  # lower, of gram
        self.chosen: list[int] = []
        self.w = torch.zeros(0, dtype=torch.float64)

    def add(self, keys: list[int]) -> None:
        s0, s1 = len(self.chosen), len(self.chosen) + len(keys)
        self.cols[:, s0:s1] = self.e[:, keys].double()
        new = self.cols[:, s0:s1]  # [n, k]
        block = new.T @ self.cols[:, :s1]  # [k, s1]
        self.gram[s0:s1, :s1] = block
        self.gram[:s1, s0:s1] = block.T
        self.rhs[s0:s1] = new.T @ self.m
        self.chosen += keys
        self._grow_factor(s0, s1)

    def _grow_factor(self, s0: int, s1: int) -> None:
        """Extend the Cholesky factor by the rows of columns [s0, s1): [L11 0; X^T L22] with
        L11 X = G12 and L22 L22^T = G22 - X^T X; dropped (None) if that is not positive
        definite enough to trust."""
        if self.chol is None:
            return
        g12, g22 = self.gram[:s0, s0:s1], self.gram[s0:s1, s0:s1]
        x = torch.linalg.solve_triangular(self.chol[:s0, :s0], g12, upper=False)  # [s0, k]
        l22, info = torch.linalg.cholesky_ex(g22 - x.T @ x)
        diag = l22.diagonal()
        scale = float(self.gram.diagonal()[:s1].max())
        if int(info) != 0 or float(diag.min()) ** 2 <= 1e-12 * scale:
            self.chol = None  # nearly collinear columns: the active-set path from here on
            return
        self.chol[s0:s1, :s0] = x.T
        self.chol[s0:s1, s0:s1] = l22

    def residual(self) -> Tensor:
        """Refit, then m - A w, [n] fp32."""
        s = len(self.chosen)
        self.w = self._refit(s)
        return (self.m - self.cols[:, :s] @ self.w).float()

    def _refit(self, s: int) -> Tensor:
        if self.chol is not None:
            w = torch.cholesky_solve(self.rhs[:s, None], self.chol[:s, :s])[:, 0]
            if bool((w > 0).all()):
                return w
        start = torch.cat([self.w, torch.zeros(s - len(self.w), dtype=torch.float64)])
        w, converged = pivoting_nnls(self.gram[:s, :s], self.rhs[:s], start, solved=True)
        if converged:
            return w
        return gram_nnls(self.gram[:s, :s], self.rhs[:s], start, solved=True)


def pivoting_nnls(
    gram: Tensor, rhs: Tensor, start: Tensor | None = None, solved: bool = False
) -> tuple[Tensor, bool]:
    """(argmin_{w >= 0} ||A w - m||, converged) given G = A^T A [s, s] and A^T m [s] (float64):
    Kim & Park's block principal pivoting (SIAM J. Sci. Comput. 33(6), 2011). Each step solves
    the least squares on a passive set, then swaps in one go every index that breaks the
    optimality conditions (a passive weight < 0, or a zero weight whose gradient says grow);
    after three steps that do not shrink that set, one index at a time (the largest), which
    makes it finite. One solve per step, where Lawson-Hanson's single entries and step-backs
    take several: an OMP refit 3.8 solves and 2.6x less time (4K keys, 87 refits, objectives
    equal to 1e-15). `start`: its positive entries are the first passive set; `solved`: it is
    already the least-squares fit there (a previous refit's answer, padded with zeros), so the
    first solve is skipped. Not converged within the cap: the caller falls back."""
    s = gram.shape[0]
    ridge, tol, passive, w = _initial(gram, rhs, start, solved)
    fewest, chances = s + 1, 3
    for step in range(5 * s + 10):
        if step > 0 or not solved:
            w = _solve_on(gram, rhs, passive, ridge)
        grad = rhs - gram @ w  # [s] minus the gradient of 1/2 w^T G w - b^T w
        wrong = (passive & (w < 0)) | (~passive & (grad > tol))
        count = int(wrong.sum())
        if count == 0:
            return w, True
        if count < fewest:
            fewest, chances = count, 3
        elif chances > 0:
            chances -= 1
        else:  # the backup rule: only the last wrong index changes sides
            wrong = torch.zeros_like(wrong).index_fill_(0, wrong.nonzero()[-1], True)
        passive ^= wrong
    return w.clamp_min(0.0), False


def gram_nnls(
    gram: Tensor, rhs: Tensor, start: Tensor | None = None, solved: bool = False
) -> Tensor:
    """argmin_{w >= 0} ||A w - m|| given only G = A^T A [s, s] and A^T m [s] (float64):
    Lawson-Hanson's active-set method on the normal equations (Bro & de Jong's "fast NNLS"),
    with the passive set taken from `start`'s positive entries. A small ridge keeps the solves
    defined when chosen columns are nearly collinear (exp-score columns often are).
    `solved`: `start` is already the least-squares fit on its positive entries (a previous
    refit's answer, padded with zeros for new columns), so it is taken as it is."""
    s = gram.shape[0]
    ridge, tol, passive, w = _initial(gram, rhs, start, solved)
    while passive.any() and not solved:  # the largest subset whose least-squares fit is > 0
        z = _solve_on(gram, rhs, passive, ridge)
        if not (passive & (z <= 0)).any():
            w = z
            break
        passive &= z > 0
    for _ in range(3 * s + 10):
        grad = rhs - gram @ w  # [s] minus the gradient of 1/2 w^T G w - b^T w
        grad[passive] = -math.inf
        j = int(grad.argmax())
        if grad[j] <= tol:
            break
        # Every coordinate whose gradient says it should grow enters at once (block pivoting:
        # after a warm start a refit's few new keys all enter, one pass instead of one each);
        # where the step back drops the steepest one again, Lawson-Hanson's single entry, which
        # always makes progress.
        trial, block = _enter(gram, rhs, passive, grad > tol, w, ridge)
        if trial[j]:
            passive, w = trial, block
            continue
        passive[j] = True
        w = _feasible(gram, rhs, passive, w, ridge)
    # (Past the cap, which degenerate ties could reach, w is still feasible and no worse than
    # any earlier iterate: good enough to pick OMP's next keys.)
    return w


def _initial(
    gram: Tensor, rhs: Tensor, start: Tensor | None, solved: bool
) -> tuple[float, float, Tensor, Tensor]:
    """What both active-set methods start from: (ridge, tolerance on the gradient, passive set
    [s] bool, weights [s]): a small ridge keeps the solves defined where chosen columns are
    nearly collinear (exp-score columns often are); the passive set is `start`'s positive
    entries, and the weights are `start` there where it is `solved`, else 0."""
    ridge = 1e-10 * float(gram.diagonal().mean().clamp_min(1e-300))
    tol = 1e-10 * float(rhs.abs().max().clamp_min(1e-300))
    s = gram.shape[0]
    passive = start > 0 if start is not None else torch.zeros(s, dtype=torch.bool)
    w = torch.zeros(s, dtype=torch.float64)
    if solved and start is not None:
        w = torch.where(passive, start, w)
    return ridge, tol, passive, w


def _solve_on(gram: Tensor, rhs: Tensor, passive: Tensor, ridge: float) -> Tensor:
    """The least-squares weights restricted to `passive` (zeros elsewhere)."""
    idx = passive.nonzero()[:, 0]
    sub = gram.index_select(0, idx).index_select(1, idx)  # a copy: the ridge goes on it
    sub.diagonal().add_(ridge)
    z = torch.zeros(gram.shape[0], dtype=torch.float64)
    chol, info = torch.linalg.cholesky_ex(sub)  # symmetric positive definite: half an LU
    if int(info) == 0:
        z[idx] = torch.cholesky_solve(rhs[idx, None], chol)[:, 0]
    else:
        z[idx] = torch.linalg.solve(sub, rhs[idx])
    return z


def _enter(
    gram: Tensor, rhs: Tensor, passive: Tensor, entering: Tensor, w: Tensor, ridge: float
) -> tuple[Tensor, Tensor]:
    """(passive set, feasible w) after `entering` joins `passive`: the entrants whose
    least-squares weight comes out <= 0 leave again first (they are still 0 in w, so stepping
    back for them would not move at all), then Lawson-Hanson's inner loop."""
    trial = passive | entering
    while True:
        z = _solve_on(gram, rhs, trial, ridge)
        out = entering & trial & (z <= 0)
        if not out.any():
            break
        trial &= ~out
    if not (trial & (z <= 0)).any():
        return trial, z
    return trial, _feasible(gram, rhs, trial, w, ridge, z)


def _feasible(
    gram: Tensor, rhs: Tensor, passive: Tensor, w: Tensor, ridge: float, z: Tensor | None = None
) -> Tensor:
    """Lawson-Hanson's inner loop: the least-squares solution on the passive set, stepping back
    toward the feasible w (and shrinking the set) while any passive weight would go <= 0.
    `z`: that solution where the caller has it already."""
    while True:
        if z is None:
            z = _solve_on(gram, rhs, passive, ridge)
        bad = passive & (z <= 0)
        if not bad.any():
            return z
        alpha = (w[bad] / (w[bad] - z[bad])).min()
        w = w + alpha * (z - w)
        passive &= w > 1e-15 * float(w.abs().max().clamp_min(1e-300))
        w[~passive] = 0.0
        z = None
