"""``linear``: the exact minimiser of the ``pytorch`` cost model (docs/cost-model.md §2), in O(n log² n).

The name is the registry's: Hong et al. claim a linear-time exact planner for their PyTorch-faithful model.
For *our* model (``client/planning/cost_models.py``) we have not found an exact linear algorithm; this module is exact
for every trace and runs in O(n log² n) worst-case time, with all but O(n) of the work inside numpy kernels.

**Recurrence.** With local(i, j) from :class:`PytorchTables`, the peak of the best plan for stages i+1..n,
counted above the checkpoints kept before boundary i, is w[i], where

    h[i] = min( local(i, n),  min_{i < j < n} max(local(i, j), w[j]) )       (segment (i, j] keeps x_i)
    f[i] = max(back[i+1] - U[i], w[i+1])                 if stage i+1 saves nothing and i+1 < n, else none
    w[i] = min(d[i] + h[i], f[i]),                                             optimum = w[0].

f[i] is the best suffix that starts with a frameless segment (its stages save nothing, so x_i is not kept
and nothing is recomputed, docs/cost-model.md): local_frameless(i, j) is a running maximum of back minus
U[i], and U is constant inside such a run, so the minimum over j folds into the one-step form above
(w[i+1] ≤ f[i+1] already offers continuing the run). h's minimum also meets frameless (i, j] priced as
ordinary segments; that price is never below the frameless one, so it cannot win wrongly. It is exact
because every later segment's peak is offset by the same kept checkpoints, so only the value of the rest
matters, not how it was reached.

**Divide and conquer over positions** (offline, "CDQ"): solve the right half, add every pair (i left, j right)
in one vectorised batch, then solve the left half, whose i then see every j. In a batch split at ``mid`` the
segment (i, j] is (i, mid) ∪ [mid, j], so both range maxima of local() split into an i-part and a j-part:
for j ≥ i + 2,

    max(local(i, j), w[j]) = max(p_i + aL_i, W_j, p_i + X_j, q_i + D_j),

with p_i = -U[i], aL_i = max back(i, mid), mL_i = max(rec_first[i+1], rec[i+2..mid-1]), q_i = p_i + mL_i, and
W_j = w[j], D_j = delta[j], X_j = max(max back[mid..j], delta[j] + rec_last[j], delta[j] + max rec[mid..j-1]).
As i decreases both p_i and q_i - p_i = mL_i only grow (u ≥ 0, and rec ≥ rec_first), so each j's largest
term moves one way, W → X → D (X possibly skipped), at times found by binary search. At each i the batch
minimum is then a suffix minimum (W), an interval-stabbing minimum (X, a sparse table) and a prefix minimum
(D). The pair (mid-1, j) is computed directly. Ranges of ≤ ``_LEAF`` positions run the recurrence in Python.

Notes:
    Time O(n log² n) worst case: log(n/32) levels, each O(n log n) in searchsorted and the sparse tables;
    O(32 n) in the leaves; O(n) to rebuild the plan. Memory O(n), plus an O(n log n) transient sparse
    table at the top level. Values are int64 while every table entry is below 2^59; beyond that the same
    code runs on Python integers (numpy object arrays): exact, about 2x slower (measured at n = 2·10^4).
    The log factors sit in numpy kernels, so measured time grows about tenfold per tenfold n up to 10^6
    stages (docs/benchmarks.md, "Planner scaling", has the figures and the command).

    Tie-break among optimal plans: the plan is rebuilt forwards with the slack left under the optimum,
    taking the farthest admissible next checkpoint (fewer checkpoints by a greedy rule, not a guarantee,
    though it matched exhaustive search's fewest-checkpoint optimum on 600 random traces of ≤ 12 stages);
    after 8n scanned positions it takes the nearest one, which keeps rebuilding O(n).

    ``cost_model`` is accepted for the registry's uniform signature and ignored: the planner is exact for
    the ``pytorch`` objective, and the caller evaluates the plan under whichever model it reports.

    Side values whose lifetime depends on the plan (trace ``side_values``): the tables price them from above
    (cost_models.SideLifetimes), so there the recurrence minimises that bound, and the plan is reported at its
    exact ``pytorch_peak``, which is never higher.

    Model facts checked here: local(a, b) is non-increasing in a for b < n, but **not** for b = n, because
    ``drop_input[a]`` releases the last segment's input (d = [100, 0, 100], e = [5, 1, 0]: local(1, 3) = 1,
    local(2, 3) = 100). Nothing below relies on monotonicity for the last segment.

References:
    Hong et al., "GPU Memory Usage Optimization for Backward Propagation in Deep Network Training",
    arXiv 2502.12499, 2025: a linear-time exact planner for a PyTorch-faithful model. Their full text was
    not available; the model and this algorithm are our reconstruction (docs/algorithms.md, "`linear`").
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import numpy as np

from remat.client.planning.cost_models import PytorchTables
from remat.client.trace import Trace

_LEAF = 32
_INT64_LIMIT = 1 << 59  # every sum the batches form stays below 2^62
_TABLE_NAMES = ("back", "back_ck", "rec", "rec_first", "rec_last", "rec_last_first", "delta", "U", "d", "drop_input",
                "fwd_first", "fwd_last_first", "fwd_mid", "fwd_tail", "cast_saved")


def plan(trace: Trace, *, cost_model: str = "pytorch") -> tuple[int, ...]:
    """Checkpoints minimising ``pytorch_peak`` (exact for every trace without plan-dependent side values; see the
    module Notes), sorted.

    Args:
        trace: the chain to plan.
        cost_model: ignored; this planner always minimises the ``pytorch`` model (see module Notes).

    Returns:
        The stage boundaries to keep, in 1..n-1; () when n ≤ 1 or when keeping nothing is optimal.
    """
    if trace.num_stages <= 1:
        return ()
    tables = PytorchTables(trace)
    return _rebuild_plan(tables, optimal_suffix_peaks(tables))


def optimal_suffix_peaks(tables: PytorchTables, leaf: int = _LEAF) -> list[int]:
    """w[0..n-1] of the recurrence in the module docstring; w[0] is the optimal peak.

    Args:
        tables: the model's arrays for one trace.
        leaf: ranges of at most this many positions run the recurrence directly (tests use 1..3).
    """
    solver = _Solver(tables)
    solver.solve(0, tables.n, max(leaf, 1))
    return solver.w[:tables.n]


class _Solver:
    """State of one divide-and-conquer run: the model's arrays as lists and numpy, w and the open minima
    (``best[i]``: h[i] over the ends j seen so far)."""

    def __init__(self, t: PytorchTables) -> None:
        n = t.n
        self.t = t
        self.w = [0] * (n + 1)  # min(d[j] + h[j], f[j]), as Python integers for the leaves
        lists = [getattr(t, name) for name in _TABLE_NAMES]
        self.arr = _as_arrays(lists)
        back, U, drop = self.arr["back"], self.arr["U"], self.arr["drop_input"]
        dtype = back.dtype
        self.big: Any = 1 << 62 if dtype.kind != "O" else 4 * max(max(map(abs, col)) for col in lists) + 1
        self.w_np = np.zeros(n + 1, dtype=dtype)
        suffix_back = np.maximum.accumulate(back[:0:-1])[::-1]  # max back[i+1..n] for i = 0..n-1
        self.best = np.maximum(suffix_back - U[:n] - drop[:n], _last_segment_forward(self.arr, n, self.big)).tolist()

    def solve(self, lo: int, hi: int, leaf: int) -> None:
        """Finish h[lo:hi], given that best[i] already covers every j ≥ hi."""
        if hi - lo <= leaf:
            self._leaf(lo, hi)
            return
        mid = (lo + hi) // 2
        self.solve(mid, hi, leaf)
        self._boundary_row(mid, hi)
        if mid - 2 >= lo:
            self._batch(lo, mid, hi)
        self.solve(lo, mid, leaf)

    def _leaf(self, lo: int, hi: int) -> None:
        """The recurrence directly for i = hi-1..lo, j in (i, hi), with running maxima; O((hi-lo)²)."""
        t, w, best = self.t, self.w, self.best
        back, rec, rec_first, rec_last, delta, U = t.back_ck, t.rec, t.rec_first, t.rec_last, t.delta, t.U
        fwd_mid = t.fwd_mid
        for i in range(hi - 1, lo - 1, -1):
            b, u = best[i], U[i]
            if i + 1 < hi:
                fmax = t.fwd_first[i + 1]
                b = min(b, max(max(back[i + 1], t.rec_last_first[i + 1] + delta[i + 1]) - u, fmax, w[i + 1]))
                bmax, rmax = back[i + 1], rec_first[i + 1]
                for j in range(i + 2, hi):  # comparisons, not max(): this loop is the leaves' hot path
                    x = back[j]
                    if x > bmax:
                        bmax = x
                        if x - u >= b:
                            break  # every later j costs at least bmax - u
                    x = fwd_mid[j]
                    if x > fmax:
                        fmax = x
                        if x >= b:
                            break  # likewise for the forward candidates
                    v = rec_last[j]
                    if rmax > v:
                        v = rmax
                    v += delta[j]
                    if bmax > v:
                        v = bmax
                    v -= u
                    if fmax > v:
                        v = fmax
                    if w[j] > v:
                        v = w[j]
                    if v < b:
                        b = v
                    x = rec[j]
                    if x > rmax:
                        rmax = x
            v = t.d[i] + b
            if i + 1 < t.n and t.frameless_end[i] > i:  # stage i+1 saves nothing: (i, j] may be frameless
                f = max(t.back_ck[i + 1] - t.U[i], t.fwd_mid[i + 1], w[i + 1])  # f[i]; w[i+1] ≤ f[i+1]
                v = min(v, f)
            w[i] = v
            self.w_np[i] = v

    def _boundary_row(self, mid: int, hi: int) -> None:
        """Pairs (mid-1, j), j in [mid, hi): the one start whose first stage lies right of the split."""
        a, t, i = self.arr, self.t, mid - 1
        v = max(max(t.back_ck[mid], t.rec_last_first[mid] + t.delta[mid]) - t.U[i], t.fwd_first[mid], self.w[mid])
        if hi > mid + 1:
            # max(rec_first[mid], rec[mid+1..j-1]) for j = mid+1..hi-1
            interior = np.maximum.accumulate(np.concatenate((a["rec_first"][mid:mid + 1], a["rec"][mid + 1:hi - 1])))
            first = np.maximum.accumulate(a["back_ck"][mid:hi])[1:]
            local = np.maximum(first, a["delta"][mid + 1:hi] + np.maximum(interior, a["rec_last"][mid + 1:hi]))
            forward = np.maximum.accumulate(np.concatenate((a["fwd_first"][mid:mid + 1], a["fwd_mid"][mid + 1:hi])))[1:]
            v = min(v, int(np.maximum(np.maximum(self.w_np[mid + 1:hi], local - a["U"][i]), forward).min()))
        self.best[i] = min(self.best[i], v)

    def _batch(self, lo: int, mid: int, hi: int) -> None:
        """Pairs (i, j), lo ≤ i ≤ mid-2 < mid ≤ j < hi, by the separable form (module docstring)."""
        a = self.arr
        delta = a["delta"][mid:hi]
        right_back = np.maximum.accumulate(a["back_ck"][mid:hi])
        right_rec = np.concatenate((np.zeros(1, dtype=delta.dtype), np.maximum.accumulate(a["rec"][mid:hi - 1])))
        X = np.maximum(np.maximum(right_back, delta + a["rec_last"][mid:hi]), delta + right_rec)
        # Time s = 0, 1, ... is i = mid-2, mid-3, ..., lo.
        starts = np.arange(mid - 2, lo - 1, -1)
        left_back = np.maximum.accumulate(a["back_ck"][mid - 1:lo:-1])
        left_rec = np.concatenate((np.zeros(1, dtype=delta.dtype), np.maximum.accumulate(a["rec"][mid - 1:lo + 1:-1])))
        m = np.maximum(a["rec_first"][starts + 1], left_rec)
        p = -a["U"][starts]
        # Forward candidates carry no -U[i]: the left part is an i-only term, the right part a j-only one.
        left_mid = np.maximum.accumulate(a["fwd_mid"][mid - 1:lo + 1:-1])
        left_fwd = np.maximum(a["fwd_first"][starts + 1],
                              np.concatenate((np.zeros(1, dtype=delta.dtype), left_mid)))
        right_w = np.maximum(self.w_np[mid:hi], np.maximum.accumulate(a["fwd_mid"][mid:hi]))
        inner = _separable_min(right_w, X, delta, p, m, self.big)
        result = np.maximum(np.maximum(p + left_back, left_fwd), inner)[::-1]
        self.best[lo:mid - 1] = np.minimum(np.array(self.best[lo:mid - 1], dtype=result.dtype), result).tolist()


def _last_segment_forward(a: dict[str, np.ndarray], n: int, big: Any) -> np.ndarray:
    """For i = 0..n-1, the forward candidates of the last segment (i, n] (``PytorchTables.local``)."""
    result = a["fwd_last_first"][1:n + 1].copy()
    if n >= 2:
        tail = np.maximum.accumulate(a["fwd_tail"][:1:-1])[::-1]  # max fwd_tail[k..n] for k = 2..n
        later = tail - a["U"][:n - 1] - a["drop_input"][:n - 1] + a["cast_saved"][:n - 1]
        result[:n - 1] = np.maximum(result[:n - 1], later)
    return result


def _as_arrays(lists: Sequence[list[int]]) -> dict[str, np.ndarray]:
    """The tables as int64 arrays when every value is below 2^59 in magnitude, else as object arrays."""
    try:
        arrays = [np.array(col, dtype=np.int64) for col in lists]
        if max(int(np.abs(x).max()) for x in arrays) < _INT64_LIMIT:
            return dict(zip(_TABLE_NAMES, arrays, strict=True))
    except OverflowError:
        pass
    return {name: np.array(col, dtype=object) for name, col in zip(_TABLE_NAMES, lists, strict=True)}


def _separable_min(W: np.ndarray, X: np.ndarray, D: np.ndarray, p: np.ndarray, m: np.ndarray,
                   big: Any) -> np.ndarray:
    """For every time s: min over j of max(W_j, p_s + X_j, p_s + m_s + D_j), p and m non-decreasing in s.

    Point j is W-dominated before time end_w[j], then X-dominated before end_x[j], then D-dominated.
    """
    T = len(p)
    q = p + m
    end_w = np.minimum(np.searchsorted(p, W - X, "right"), np.searchsorted(q, W - D, "right"))
    end_x = np.maximum(np.searchsorted(m, X - D, "right"), end_w)
    w_at = np.full(T + 1, big, dtype=W.dtype)
    np.minimum.at(w_at, end_w, W)
    best = np.minimum.accumulate(w_at[::-1])[::-1][1:]  # min W_j over end_w[j] > s
    d_at = np.full(T + 1, big, dtype=W.dtype)
    np.minimum.at(d_at, end_x, D)
    d_min = np.minimum.accumulate(d_at)[:T]  # min D_j over end_x[j] ≤ s
    best = np.minimum(best, np.where(d_min == big, big, q + d_min))
    x_open = end_w < end_x
    if x_open.any():
        x_min = _stabbing_min(end_w[x_open], end_x[x_open], X[x_open], T, big)
        best = np.minimum(best, np.where(x_min == big, big, p + x_min))
    return best


def _stabbing_min(start: np.ndarray, stop: np.ndarray, value: np.ndarray, T: int, big: Any) -> np.ndarray:
    """For s in 0..T-1: min of value[k] over the intervals start[k] ≤ s < stop[k] (all non-empty)."""
    length = stop - start
    level = np.zeros(len(length), dtype=np.int64)
    for k in range(1, int(length.max()).bit_length()):
        level[length >= (1 << k)] = k  # floor(log2(length)), without floating point
    K = int(level.max()) + 1
    table = np.full((K, T), big, dtype=value.dtype)  # table[k][s]: a minimum applied to [s, s + 2^k)
    np.minimum.at(table, (level, start), value)
    np.minimum.at(table, (level, stop - (1 << level)), value)
    for k in range(K - 1, 0, -1):
        half = 1 << (k - 1)
        np.minimum(table[k - 1], table[k], out=table[k - 1])
        np.minimum(table[k - 1][half:], table[k][:-half], out=table[k - 1][half:])
    return table[0]


def _rebuild_plan(t: PytorchTables, w: list[int]) -> tuple[int, ...]:
    """Walk forwards spending the slack under the optimum w[0]; see the tie-break in the module Notes.

    At boundary i the budget counts above the checkpoints kept before i. A segment that keeps x_i costs
    d[i] for the rest of the walk; a frameless one (docs/cost-model.md) keeps nothing and is taken only
    when no segment that keeps x_i fits.
    """
    n = t.n
    suffix_back = list(accumulate(reversed(t.back), max))[::-1]  # max back[s..n]
    suffix_tail = list(accumulate(reversed(t.fwd_tail), max))[::-1] + [None]  # max fwd_tail[s..n]

    def last_segment(i: int) -> int:  # local(i, n) from the suffix maxima, O(1)
        value = max(suffix_back[i + 1] - t.U[i] - t.drop_input[i], t.fwd_last_first[i + 1])
        if i + 2 <= n:
            value = max(value, suffix_tail[i + 2] - t.U[i] - t.drop_input[i] + t.cast_saved[i])
        return value

    checkpoints: list[int] = []
    i, budget, work = 0, w[0], 0
    while t.d[i] + last_segment(i) > budget:  # the last segment does not fit yet
        j, scanned = _next_checkpoint(t, w, i, budget - t.d[i], farthest=work < 8 * n)
        if j:
            budget -= t.d[i]
        else:
            j, scanned = _next_frameless(t, w, i, budget)
        work += scanned
        checkpoints.append(j)
        i = j
    return tuple(checkpoints)


def _next_checkpoint(t: PytorchTables, w: list[int], i: int, budget: int, *, farthest: bool) -> tuple[int, int]:
    """A j with local(i, j) ≤ budget and w[j] ≤ budget (0 when there is none), and the positions scanned."""
    back, delta, U = t.back_ck, t.delta, t.U
    u, j = U[i], i + 1
    fmax = t.fwd_first[j]
    chosen = j if max(max(back[j], t.rec_last_first[j] + delta[j]) - u, fmax, w[j]) <= budget else 0
    bmax, rmax = back[j], t.rec_first[j]
    for j in range(i + 2, t.n):
        if chosen and not farthest:
            break
        bmax = max(bmax, back[j])
        fmax = max(fmax, t.fwd_mid[j])
        if bmax - u > budget or fmax > budget:
            break
        if max(bmax, max(rmax, t.rec_last[j]) + delta[j]) - u <= budget and w[j] <= budget:
            chosen = j
        rmax = max(rmax, t.rec[j])
    return chosen, j - i


def _next_frameless(t: PytorchTables, w: list[int], i: int, budget: int) -> tuple[int, int]:
    """The nearest j with (i, j] frameless, local_frameless(i, j) ≤ budget and w[j] ≤ budget."""
    worst = 0
    for j in range(i + 1, min(t.frameless_end[i], t.n - 1) + 1):
        worst = max(worst, t.back_ck[j] - t.U[i], t.fwd_mid[j])
        if max(worst, w[j]) <= budget:
            return j, j - i
    raise RuntimeError(f"no admissible boundary after {i} within {budget}: the recurrence and the model disagree")


def quadratic_suffix_peaks(tables: PytorchTables) -> tuple[list[int], list[int]]:
    """Reference: w[0..n-1] and each i's best next boundary, by the plain O(n²) recurrence.

    w[i] is the least peak of stages i+1..n counted above the checkpoints kept before boundary i. A segment
    (i, j] either keeps x_i (d[i] is added to its own local and to everything after it) or, when it is
    frameless, keeps nothing: local(i, j) is built for j = i+1, i+2, ... with running maxima exactly as
    ``PytorchTables.local`` defines it (first stage rec_first, interior rec, last stage rec_last; a one-stage
    segment rec_last_first; the last segment drop_input), and a frameless segment's by ``local_frameless``.
    """
    t, n = tables, tables.n
    w, nxt = [0] * n, [n] * n
    for i in range(n - 1, -1, -1):
        u, bmax, cmax, rmax = t.U[i], 0, 0, 0  # cmax: back_ck, for segments that are checkpointed
        fmax = t.fwd_first[i + 1]  # forward candidates of a segment that keeps x_i
        lmax = 0  # forward candidates of a frameless segment: fwd_mid from its first stage on
        tmax = 0  # fwd_tail over the last segment's later stages
        best, best_j = None, n
        for j in range(i + 1, n + 1):
            bmax = max(bmax, t.back[j])
            cmax = max(cmax, t.back_ck[j])
            lmax = max(lmax, t.fwd_mid[j])
            if j >= i + 2:
                fmax = max(fmax, t.fwd_mid[j])
                tmax = max(tmax, t.fwd_tail[j])
            if j == n:
                last = max(bmax - u - t.drop_input[i], t.fwd_last_first[i + 1])
                if j >= i + 2:
                    last = max(last, tmax - u - t.drop_input[i] + t.cast_saved[i])
                cost = t.d[i] + last
            elif t.is_frameless(i, j):
                cost = max(cmax - u, lmax, w[j])
                rmax = t.rec_first[j] if j == i + 1 else max(rmax, t.rec[j])
            else:
                rec = t.rec_last_first[j] if j == i + 1 else max(rmax, t.rec_last[j])
                cost = t.d[i] + max(max(cmax, rec + t.delta[j]) - u, fmax, w[j])
                rmax = t.rec_first[j] if j == i + 1 else max(rmax, t.rec[j])
            if best is None or cost < best:
                best, best_j = cost, j
        w[i], nxt[i] = best, best_j
    return w, nxt


def _plan_quadratic(trace: Trace) -> tuple[int, ...]:
    """The optimal plan by the O(n²) reference recurrence (a second oracle for tests)."""
    if trace.num_stages <= 1:
        return ()
    _, nxt = quadratic_suffix_peaks(PytorchTables(trace))
    checkpoints, i = [], nxt[0]
    while i < trace.num_stages:
        checkpoints.append(i)
        i = nxt[i]
    return tuple(checkpoints)
