"""Baseline planners every comparison includes (the table at the top of docs/algorithms.md).

They are not optimal; they are what people use today, so remat's plans are always shown beside them.
"""

from __future__ import annotations

import math

from remat.client.planning.cost_models import peak
from remat.client.trace import Trace


def plan_none(trace: Trace, *, cost_model: str = "pytorch") -> tuple[int, ...]:
    """No checkpointing: every activation is kept."""
    return ()


def uniform_boundaries(num_stages: int, segments: int) -> tuple[int, ...]:
    """Boundaries of ``torch.utils.checkpoint.checkpoint_sequential(functions, segments)``.

    PyTorch gives every segment ``len(functions) // segments`` stages and puts the remainder in the last
    one (which it runs without checkpointing), so the boundaries are multiples of that size.
    """
    if num_stages <= 1 or segments <= 1:
        return ()
    segments = min(segments, num_stages)
    size = num_stages // segments
    return tuple(size * k for k in range(1, segments))


def plan_uniform(trace: Trace, *, cost_model: str = "pytorch", segments: int | None = None) -> tuple[int, ...]:
    """``checkpoint_sequential`` with ⌈√n⌉ segments unless ``segments`` is given."""
    n = trace.num_stages
    return uniform_boundaries(n, segments if segments is not None else math.ceil(math.sqrt(n)))


def plan_chen_sqrt(trace: Trace, *, cost_model: str = "pytorch") -> tuple[int, ...]:
    """Chen et al. 2016: a checkpoint every ⌊√n⌋ stages."""
    n = trace.num_stages
    step = max(1, math.isqrt(n))
    return tuple(range(step, n, step))


def greedy_boundaries(output_bytes: list[int], budget: int) -> tuple[int, ...]:
    """Chen et al.'s greedy pass: walk forward summing d, checkpoint where the running sum passes budget."""
    checkpoints: list[int] = []
    running = 0
    for i, d in enumerate(output_bytes[:-1], start=1):
        running += d
        if running > budget:
            checkpoints.append(i)
            running = 0
    return tuple(checkpoints)


SWEEP_STEPS = 64


def sweep_budgets(output_bytes: list[int]) -> list[int]:
    """The budgets ``chen-greedy`` tries, ascending: Chen et al.'s own √(Σd · max d) and 64 spread
    geometrically from the largest single activation to the sum of all of them (both ends included)."""
    d = output_bytes
    lo, hi = max(max(d), 1), max(sum(d), 1)
    geometric = {round(lo * (hi / lo) ** (k / (SWEEP_STEPS - 1))) for k in range(SWEEP_STEPS)}
    return sorted(geometric | {math.isqrt(sum(d) * max(d))})


def plan_chen_greedy(trace: Trace, *, cost_model: str = "pytorch") -> tuple[int, ...]:
    """Chen et al.'s greedy planner, with the budget swept and the best plan under ``cost_model`` kept.

    The sweep tries :func:`sweep_budgets`; ties go to the plan with fewer checkpoints, then to the smaller
    budget's plan.

    Notes:
        O(n · k) for k = 65 budgets, each plan evaluated in O(n).
    """
    d = trace.column("output_bytes")
    best: tuple[int, tuple[int, ...]] | None = None
    for budget in sweep_budgets(d):
        candidate = greedy_boundaries(d, budget)
        score = (peak(trace, candidate, cost_model), len(candidate))
        if best is None or score < (best[0], len(best[1])):
            best = (score[0], candidate)
    assert best is not None
    return best[1]
