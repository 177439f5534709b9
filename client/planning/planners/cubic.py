"""``cubic``: the exact O(n³) minimiser of the classic cost model (Hong et al. 2025, first algorithm).

classic(C) = Σ_{c∈C} d_c + max_k S(c_{k-1}, c_k), with S(i, j) = d_{i+1} + … + d_{j-1} the interior of a
segment. The max term can only take one of the O(n²) values S(i, j); for each candidate bound T the cheapest
set of checkpoints whose segment interiors all fit under T is a shortest-path-like recurrence

    f_T[0] = 0;   f_T[j] = d_j·[j < n] + min { f_T[i] : i < j, S(i, j) ≤ T }

and the optimum is min_T (f_T[n] + T). Because the prefix sums are non-decreasing, the admissible i for j form
a window [lo_j, j-1] whose left end only moves right, so a monotone deque gives each f_T in O(n).
"""

from __future__ import annotations

from collections import deque
from itertools import accumulate

from remat.client.trace import Trace


def _solve_for_bound(d: list[int], prefix: list[int], bound: int) -> tuple[int, list[int]]:
    """f_T[n] and the back-pointers for one bound T (d and prefix are 1-indexed, d[0] = 0)."""
    n = len(d) - 1
    f = [0] * (n + 1)
    parent = [0] * (n + 1)
    window: deque[int] = deque([0])  # indices i with increasing f[i]
    lo = 0
    for j in range(1, n + 1):
        need = prefix[j - 1] - bound  # admissible i have prefix[i] >= need
        while prefix[lo] < need:
            lo += 1
        while window[0] < lo:
            window.popleft()
        best = window[0]
        f[j] = f[best] + (d[j] if j < n else 0)
        parent[j] = best
        while window and f[window[-1]] >= f[j]:
            window.pop()
        window.append(j)
    return f[n], parent


def _candidate_bounds(prefix: list[int]) -> list[int]:
    """Every value the max-interior term can take: S(i, j) for 0 ≤ i < j ≤ n, sorted, unique."""
    n = len(prefix) - 1
    values = {prefix[j - 1] - prefix[i] for j in range(1, n + 1) for i in range(j)}
    return sorted(values)


def _solve_table(d: list[int]) -> tuple[int, ...]:
    """The DP over bounds, without input checks. Returns the optimal checkpoints."""
    n = len(d) - 1
    prefix = list(accumulate(d))
    best_cost: int | None = None
    best_parent: list[int] = []
    for bound in _candidate_bounds(prefix):
        if best_cost is not None and bound >= best_cost:
            break  # f_T[n] ≥ 0, so no larger bound can do better
        cost, parent = _solve_for_bound(d, prefix, bound)
        if best_cost is None or cost + bound < best_cost:
            best_cost, best_parent = cost + bound, parent
    checkpoints = []
    j = best_parent[n]
    while j > 0:
        checkpoints.append(j)
        j = best_parent[j]
    return tuple(reversed(checkpoints))


def plan(trace: Trace, *, cost_model: str = "classic") -> tuple[int, ...]:
    """Checkpoints minimising the classic cost model.

    ``cost_model`` is accepted for the common planner signature and ignored: this planner is exact for the
    classic objective only, which is what Hong et al.'s first algorithm solves; the caller reports the plan
    under whichever model was asked.

    Example:
        >>> from remat.client.trace import make_trace
        >>> plan(make_trace([1, 1, 1, 1, 1]))
        (2, 4)

    Notes:
        O(n²) candidate bounds × O(n) per bound = O(n³) time, O(n²) memory for the candidate set. Bounds are
        tried in increasing order and the search stops once a bound alone reaches the best total, which
        usually prunes most of them.

    References:
        Hong et al., "GPU Memory Usage Optimization for Backward Propagation in Deep Network Training",
        JPDC 2025, arXiv 2502.12499 (the O(n³) algorithm; recurrence reconstructed, see docs/algorithms.md,
        "`cubic`").
    """
    if trace.num_stages <= 1:
        return ()
    return _solve_table([0, *trace.column("output_bytes")])
