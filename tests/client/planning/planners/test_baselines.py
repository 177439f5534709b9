"""Baselines produce exactly the segments they claim."""

from __future__ import annotations

import math

import pytest
import torch.nn as nn
from torch.utils.checkpoint import checkpoint_sequential

from remat.client.planning.cost_models import peak
from remat.client.planning.planners.baselines import (
    greedy_boundaries,
    plan_chen_greedy,
    plan_chen_sqrt,
    plan_none,
    plan_uniform,
    uniform_boundaries,
)
from remat.client.trace import make_trace


def test_none_keeps_nothing() -> None:
    assert plan_none(make_trace([1, 2, 3])) == ()


@pytest.mark.parametrize("n", [1, 2, 3, 9, 10, 16, 17, 50])
def test_uniform_uses_ceil_sqrt_segments(n: int) -> None:
    segments = math.ceil(math.sqrt(n))
    checkpoints = plan_uniform(make_trace([1] * n))
    assert len(checkpoints) == (min(segments, n) - 1 if n > 1 else 0)
    sizes = [b - a for a, b in zip((0, *checkpoints), (*checkpoints, n), strict=True)]
    assert len(set(sizes[:-1])) <= 1  # equal segments; the remainder goes to the last one
    assert all(sizes[-1] >= s for s in sizes[:-1])


@pytest.mark.parametrize(("n", "segments"), [(10, 3), (7, 7), (22, 5), (5, 2)])
def test_uniform_matches_checkpoint_sequential(n: int, segments: int) -> None:
    """The boundaries are where torch's checkpoint_sequential really starts each checkpoint call."""
    import torch
    import torch.utils.checkpoint as ckpt

    ends: list[int] = []
    original = ckpt.checkpoint

    def recording_checkpoint(fn, *args, **kwargs):
        out = original(fn, *args, **kwargs)
        ends.append(len(seen))  # layers run so far = the boundary where this checkpointed chunk ends
        return out

    layers = [nn.Identity() for _ in range(n)]
    seen: list[int] = []
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda m, a, o, i=i: seen.append(i))
    ckpt.checkpoint = recording_checkpoint
    try:
        checkpoint_sequential(nn.Sequential(*layers), segments, torch.ones(1, requires_grad=True),
                              use_reentrant=False)
    finally:
        ckpt.checkpoint = original
    assert len(seen) == n
    assert uniform_boundaries(n, segments) == tuple(ends)


def test_chen_sqrt_every_floor_sqrt_stages() -> None:
    assert plan_chen_sqrt(make_trace([1] * 10)) == (3, 6, 9)
    assert plan_chen_sqrt(make_trace([1] * 16)) == (4, 8, 12)
    assert plan_chen_sqrt(make_trace([1])) == ()


def test_greedy_pass_checkpoints_when_running_sum_passes_budget() -> None:
    assert greedy_boundaries([3, 3, 3, 3, 3], 5) == (2, 4)
    assert greedy_boundaries([10, 1, 1, 1], 5) == (1,)
    assert greedy_boundaries([1, 1, 1], 100) == ()


@pytest.mark.parametrize("cost_model", ["classic", "pytorch"])
def test_chen_greedy_is_a_greedy_plan_no_worse_than_chens_budget(cost_model: str) -> None:
    trace = make_trace([5, 1, 9, 2, 2, 8, 1, 1, 7, 3], [4, 4, 1, 9, 3, 3, 2, 8, 1, 1])
    chosen = plan_chen_greedy(trace, cost_model=cost_model)
    d = trace.column("output_bytes")
    assert chosen in {greedy_boundaries(d, b) for b in range(1, sum(d) + 1)}
    chen_budget = math.isqrt(sum(d) * max(d))
    assert peak(trace, chosen, cost_model) <= peak(trace, greedy_boundaries(d, chen_budget), cost_model)


@pytest.mark.parametrize("sizes", [[1, 2, 3], [5] * 40, [1, 10**9, 7, 3], [2**40] * 3 + [1] * 20, [1000] * 1000,
                                   [1] * 100])
def test_the_greedy_sweep_spans_the_largest_activation_to_the_sum(sizes: list[int]) -> None:
    """Found by mutation testing: nothing pinned which budgets chen-greedy tries."""
    from remat.client.planning.planners.baselines import sweep_budgets

    budgets = sweep_budgets(sizes)
    lo, hi = max(sizes), sum(sizes)
    assert budgets == sorted(set(budgets))
    assert budgets[0] == lo and budgets[-1] == hi and math.isqrt(lo * hi) in budgets
    assert all(lo <= b <= hi for b in budgets)
    if hi > 64 * lo and lo * ((hi / lo) ** (1 / 63) - 1) >= 1:  # steps at least 1 apart: no rounding collisions
        assert len(budgets) >= 64
        ratios = [b / a for a, b in zip(budgets[:-1], budgets[1:], strict=True) if b != math.isqrt(lo * hi) != a]
        step = (hi / lo) ** (1 / 63)
        assert all(r <= step * 1.01 for r in ratios)


def test_uniform_boundaries_of_no_stages_are_empty() -> None:
    assert uniform_boundaries(0, 4) == () and uniform_boundaries(1, 4) == () and uniform_boundaries(5, 1) == ()


def test_greedy_ties_go_to_the_smallest_budget() -> None:
    """Budgets 1 and 2 give (2,) and (3,), both one checkpoint and peak 3: the first tried wins, so the plan
    does not depend on set order (found by mutation testing: `<=` for `<` survived)."""
    from remat.client.trace import TRACE_FORMAT, parse_trace

    stages = [{"name": f"s{i}", "output_bytes": 1, "saved_bytes": 0, "saves_input": True} for i in range(4)]
    trace = parse_trace({"format": TRACE_FORMAT, "input_bytes": 0, "stages": stages})
    assert peak(trace, (2,), "pytorch") == peak(trace, (3,), "pytorch") < peak(trace, (), "pytorch")
    assert plan_chen_greedy(trace) == (2,)


def test_greedy_checkpoints_where_the_running_sum_passes_the_budget_and_restarts_from_zero() -> None:
    # running sums 1, 2, 3 > 2 → checkpoint at 3, restart; 1, 2, 3 > 2 → checkpoint at 6; the last stage never
    assert greedy_boundaries([1] * 8, 2) == (3, 6)
    assert greedy_boundaries([5, 1, 1], 4) == (1,)
    assert greedy_boundaries([4, 4], 4) == ()  # equal to the budget is not past it


def test_uniform_with_no_or_one_segment_keeps_nothing() -> None:
    assert uniform_boundaries(5, 0) == () and uniform_boundaries(5, 1) == ()


@pytest.mark.parametrize(("n", "expected"), [(1, ()), (2, (1,)), (3, (1, 2)), (4, (2,)), (9, (3, 6)), (10, (3, 6, 9))])
def test_chen_sqrt_checkpoints_every_floor_sqrt_n_stages(n: int, expected: tuple[int, ...]) -> None:
    assert plan_chen_sqrt(make_trace([1] * n)) == expected
