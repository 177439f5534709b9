"""``budget``: the plan of least recompute time whose ``pytorch``-model peak fits a byte budget.

``linear`` finds the smallest peak and re-runs whatever it takes to get there; most users want the fastest
plan that fits their GPU. This module computes the whole **Pareto frontier** of a trace — every plan not
dominated in (predicted peak, recompute cost) — exactly, and a budget picks from it: the frontier point
with the largest peak ≤ budget is the least-cost plan that fits (points are sorted by peak, cost falling).

**Why one number per position is enough.** A plan's recompute cost is the forward time of every stage
before its last checkpoint (:mod:`remat.client.planning.recompute_time`), so it depends on that position c alone,
and the frontier is found among n candidates: for each c, the smallest peak of any plan whose last
checkpoint is c, kept if no smaller-or-equal c reaches a smaller-or-equal peak.

**Recurrence.** As in ``linear`` (whose docstring derives it), the peak of a plan for stages i+1..n counted
above the checkpoints kept before boundary i is, for a first segment (i, j],

    d_i + max(local(i, j), r_j)                  (an ordinary segment: x_i is kept)
    max(local_frameless(i, j), r_j)               (a frameless one: x_i is not kept)

with r_j the same quantity for the rest of the plan. So, with r_i[c] the smallest such peak over the plans
from i whose last checkpoint is c (r_i[i] = d_i + local(i, n): no checkpoint after i),

    r_i[c] = min over j in (i, c] of  d_i + max(local(i, j), r_j[c])   (or the frameless form),

a minimum of non-decreasing functions of r_j[c], exact; r_0[c] is the answer for c (d_0 = 0). Each pair
(i, j) updates the vector r_i[j..n-1] in one numpy operation, local(i, j) comes from running maxima, so the
work is O(n²) vector steps of O(n): n = 500 in about half a second (docs/benchmarks.md, "Budgets"). Peaks
are exact integers (int64, or Python integers past 2^59 as in ``linear``); costs integer nanoseconds.

Side values whose lifetime depends on the plan (trace ``side_values``): the recurrence's tables price them from
above (cost_models.SideLifetimes), so for each c it finds the least bound, and that plan is priced exactly
(``pytorch_peak``) before the frontier is drawn: every point carries the peak its measured step is compared with.

Deterministic: among equal peaks for one c the smallest j wins (strict <), and among frontier points of
equal (peak, cost) the smallest c, so a stored frontier does not depend on luck.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from remat.client.budget_spec import pick_for_budget
from remat.client.planning.cost_models import PytorchTables, pytorch_peak
from remat.client.planning.recompute_time import cost_before
from remat.client.trace import Trace

_INT64_LIMIT = 1 << 59
_INT64_INFINITY = 1 << 62  # above every value below _INT64_LIMIT; plus one of them, still below 2^63


def _entry_dtype(largest: int) -> object:
    """int64 while every value of the recurrence (at most ``largest``) is below 2^59; Python integers
    (object arrays: exact, but about 14x slower, measured at 200 stages) past it."""
    return np.int64 if largest < _INT64_LIMIT else object


@dataclass(frozen=True, slots=True)
class FrontierPoint:
    """One non-dominated plan: its checkpoints, ``pytorch``-model peak and recompute cost (stage_costs units)."""

    checkpoints: tuple[int, ...]
    peak_bytes: int
    recompute_cost: int


def _first_segment_locals(a: dict[str, np.ndarray], t: PytorchTables, i: int) -> tuple[np.ndarray, np.ndarray]:
    """For every first segment (i, j], j = i+1..n-1: its local peak and what it keeps (d_i, or 0 if frameless).

    The range maxima of ``PytorchTables.local`` and ``local_frameless`` as prefix maxima over j (numpy).
    """
    n = t.n
    acc = np.maximum.accumulate
    zeros = np.zeros(2, dtype=a["d"].dtype)
    max_back = acc(a["back_ck"][i + 1:n]) - t.U[i]
    max_fwd_mid_all = acc(a["fwd_mid"][i + 1:n])
    max_fwd_mid = np.concatenate((zeros[:1], acc(a["fwd_mid"][i + 2:n])))  # over i+2..j; none for j = i+1
    rec_inner = np.concatenate((zeros, acc(a["rec"][i + 2:n - 1])))[:n - i - 1]  # over i+2..j-1
    ends = slice(i + 1, n)
    recompute = np.maximum(np.maximum(a["rec_last"][ends], rec_inner), t.rec_first[i + 1])
    recompute[0] = t.rec_last_first[i + 1]  # a one-stage segment stops at its last saved tensor
    forward = np.maximum(max_fwd_mid, t.fwd_first[i + 1])
    local = np.maximum(np.maximum(max_back, recompute + a["delta"][ends] - t.U[i]), forward)
    base = np.full(n - i - 1, t.d[i], dtype=a["d"].dtype)
    frameless = min(t.frameless_end[i], n - 1) - i  # j = i+1 .. frameless_end[i] are frameless
    if frameless > 0:
        local[:frameless] = np.maximum(max_back[:frameless], max_fwd_mid_all[:frameless])
        base[:frameless] = 0
    return local, base


def _min_peaks_by_last_checkpoint(t: PytorchTables) -> tuple[list[int], np.ndarray]:
    """r_0[c] for c = 0..n-1 (the recurrence of the module docstring) and the first-segment ends chosen.

    Each boundary i is one numpy step over the block r[j, c] (j, c in i+1..n-1): r[j, c] is "infinite" for
    c < j, so the minimum over j needs no mask, and ``argmin`` takes the smallest j among equals. The
    infinity is not derived from a bound on the peaks: 2^62 on the int64 path, which ``_entry_dtype`` only
    takes while every value is below 2^59 (so 2^62 plus one d stays below 2^63), and a float infinity on
    Python integers.

    Returns:
        (peaks, parent): peaks[c] is the smallest peak of a plan whose last checkpoint is c; parent[i, c]
        is the end j of the first segment of the best plan from boundary i with last checkpoint c.
    """
    n = t.n
    names = ("back_ck", "fwd_mid", "rec", "rec_last", "delta", "d")
    values = [v for name in PytorchTables.__slots__ if name not in ("n", "frameless_end", "sides")
              for v in getattr(t, name)]
    # A peak sums kept d's and one local term of at most two entries: at most sum(d) + 2·max|entry|.
    dtype = _entry_dtype(sum(t.d) + 2 * max(map(abs, values)))
    infinity = _INT64_INFINITY if dtype is np.int64 else float("inf")
    arrays = {name: np.array(getattr(t, name), dtype=dtype) for name in names}
    r = np.full((n, n), infinity, dtype=dtype)  # r[i, c], c ≥ i
    parent = np.zeros((n, n), dtype=np.int32)  # read for c > i only; n² entries: n is far below 2^31
    for i in range(n - 1, -1, -1):
        r[i, i] = t.d[i] + t.local(i, n)
        parent[i, i] = n
        if i == n - 1:
            continue
        local, base = _first_segment_locals(arrays, t, i)
        block = np.maximum(r[i + 1:, i + 1:], local[:, None]) + base[:, None]
        best = np.argmin(block, axis=0)
        r[i, i + 1:] = block[best, np.arange(n - i - 1)]
        parent[i, i + 1:] = best + i + 1
    return [int(v) for v in r[0]], parent


def _rebuild(parent: np.ndarray, last: int) -> tuple[int, ...]:
    """The checkpoints of the best plan from boundary 0 whose last checkpoint is ``last``."""
    out: list[int] = []
    i = 0
    while i != last:
        i = int(parent[i, last])
        out.append(i)
    return tuple(out)


def pareto_frontier(trace: Trace) -> list[FrontierPoint]:
    """Every plan not dominated in (``pytorch`` peak, recompute cost), by peak ascending and cost descending.

    Costs are :func:`remat.client.planning.recompute_time.recompute_cost` units (nanoseconds, or stages re-run).
    A one-stage trace (a trace has at least one) gives the single point ((), its peak, 0) through the
    same recurrence.
    """
    t = PytorchTables(trace)
    peaks, parent = _min_peaks_by_last_checkpoint(t)
    plans = {c: _rebuild(parent, c) for c in range(t.n)}
    if t.sides.values:
        # Side values' lifetimes depend on the plan: the tables bound them from above (cost_models.SideLifetimes),
        # so each plan is priced exactly before the frontier is drawn, and its points carry the peaks a
        # measured step is compared with.
        peaks = [pytorch_peak(trace, plans[c], t) for c in range(t.n)]
    costs = cost_before(trace)
    front: list[tuple[int, int, int]] = []  # (peak, cost, last checkpoint), best first by cost then peak
    for c in sorted(range(t.n), key=lambda c: (costs[c], peaks[c], c)):
        if not front or peaks[c] < front[-1][0]:
            front.append((peaks[c], costs[c], c))
    return [FrontierPoint(plans[c], peak, cost) for peak, cost, c in reversed(front)]


def pick(frontier: list[FrontierPoint], budget_bytes: int) -> FrontierPoint:
    """The least-cost frontier point whose peak fits the budget.

    Raises:
        BudgetInfeasibleError: the budget is below the smallest peak on the frontier.
    """
    return pick_for_budget(frontier, budget_bytes, peak=lambda p: p.peak_bytes)


def plan(trace: Trace, *, cost_model: str = "pytorch", budget_bytes: int) -> tuple[int, ...]:
    """Checkpoints of least recompute cost whose ``pytorch`` peak is at most ``budget_bytes``.

    ``cost_model`` is accepted for the registry's uniform signature and ignored: budgets are bytes of the
    model a validation step measures.

    Raises:
        BudgetInfeasibleError: no plan fits; the error names the smallest feasible peak.
    """
    return pick(pareto_frontier(trace), budget_bytes).checkpoints
