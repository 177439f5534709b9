"""Oracles that judge the exact planners: exhaustive search over every plan.

docs/algorithms.md ("How they are checked") says which planner each judges, and under which objective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import combinations

from remat.client.trace import Trace

CostFn = Callable[[Trace, Sequence[int]], int]

#: Beyond this many stages 2^(n-1) plans is too many to enumerate in a test.
MAX_EXHAUSTIVE_STAGES = 16


def exhaustive_min(trace: Trace, cost_fn: CostFn) -> tuple[int, tuple[int, ...]]:
    """The minimum of ``cost_fn`` over all 2^(n-1) plans, and the first plan that attains it.

    Plans are enumerated by increasing number of checkpoints, then lexicographically, so among optimal
    plans the one returned has the fewest checkpoints. ``cost_fn(trace, checkpoints)`` is any cost model
    (``classic_peak``, ``pytorch_peak`` or a closure over precomputed tables).

    Raises:
        ValueError: when the trace has more than :data:`MAX_EXHAUSTIVE_STAGES` stages.
    """
    n = trace.num_stages
    if n > MAX_EXHAUSTIVE_STAGES:
        raise ValueError(f"exhaustive search over 2^{n - 1} plans is too slow; n ≤ {MAX_EXHAUSTIVE_STAGES}")
    boundaries = range(1, n)
    best: tuple[int, tuple[int, ...]] | None = None
    for size in range(n):
        for plan in combinations(boundaries, size):
            cost = cost_fn(trace, plan)
            if best is None or cost < best[0]:
                best = (cost, plan)
    assert best is not None  # size 0 always yields the empty plan
    return best


def exhaustive_frontier(trace: Trace, peak_fn: CostFn, time_fn: CostFn) -> list[tuple[int, int]]:
    """Every (peak, time) pair not dominated by another plan's, by peak ascending, from all 2^(n-1) plans.

    A plan dominates another when neither figure is larger and one is smaller; equal pairs count once.
    """
    n = trace.num_stages
    if n > MAX_EXHAUSTIVE_STAGES:
        raise ValueError(f"exhaustive search over 2^{n - 1} plans is too slow; n ≤ {MAX_EXHAUSTIVE_STAGES}")
    pairs = {(peak_fn(trace, plan), time_fn(trace, plan))
             for size in range(max(n, 1)) for plan in combinations(range(1, n), size)}
    front: list[tuple[int, int]] = []
    for peak, time in sorted(pairs):
        if not front or time < front[-1][1]:
            front.append((peak, time))
    return front
