"""What a plan costs in time: the forward work its checkpointed segments run a second time.

One definition, shared by the reported ``recompute_ms`` of every plan and by the ``budget`` planner, which
minimises it: a planner that optimised one estimate while plans reported another could not be checked.

Every segment but the last runs under a non-reentrant checkpoint and is re-run in backward, so the cost of
a plan is the forward time of every stage before its last checkpoint: **only the last checkpoint's position
matters**. Two simplifications, both on the side of overhead: the last stage of a re-run segment is counted
whole although the recompute stops at its last saved tensor, and a frameless segment (views, permutes,
``cat``: nothing saved, so nothing to re-run, docs/cost-model.md) is counted although it is not re-run — such
stages take microseconds, and counting them keeps the cost a function of one position, which is what lets
the budget planner stay exact at O(n²).

Costs are integers (nanoseconds of profiled forward time) so that sums are exact whatever their order: the
planner and an exhaustive search must agree to the unit, not to a float tolerance. A trace without forward
times (hand-written) costs one unit per re-run stage, so a budget still picks the plan that re-runs the
fewest stages; its plans report no ``recompute_ms``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

from remat.client.trace import Trace

NS_PER_MS = 1_000_000


def stage_costs(trace: Trace) -> list[int]:
    """Per-stage re-run cost: forward time in integer nanoseconds, or 1 per stage without times."""
    if not trace.has_times:
        return [1] * trace.num_stages
    return [max(0, round((s.forward_ms or 0.0) * NS_PER_MS)) for s in trace.stages]


def cost_before(trace: Trace) -> list[int]:
    """cost_before[c]: the recompute cost of any plan whose last checkpoint is c (0: no checkpoint)."""
    return [0, *accumulate(stage_costs(trace))]


def recompute_cost(trace: Trace, checkpoints: Sequence[int]) -> int:
    """Summed :func:`stage_costs` of every stage a plan re-runs in backward: those before its last checkpoint."""
    last = max(checkpoints, default=0)
    return sum(stage_costs(trace)[:last])


def recompute_ms(trace: Trace, checkpoints: Sequence[int]) -> float | None:
    """Estimated extra forward time per step in milliseconds; None when the trace has no forward times."""
    if not trace.has_times:
        return None
    return recompute_cost(trace, checkpoints) / NS_PER_MS
