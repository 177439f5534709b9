"""Nested re-runs: a checkpointed segment that re-runs its stages one at a time during its own backward.

Every registered planner re-runs a dropped stage once, in its segment's re-run. On ResNet-152 at batch 16,
224², that stops at an 83.3% cut on a plateau of near-equal peaks, each a whole segment's saved tensors
beside one block's backward (docs/benchmarks.md, "Where ResNet-152's 83.3% stops"). One more level lowers
it: ``StageChain.run(..., nested=True)`` runs every stage of a checkpointed segment but its last under its own
non-reentrant checkpoint, so the segment's re-run keeps only its stage outputs and each stage is re-run once
more, alone, in its own backward.

This module prices such a plan from the ``pytorch`` model's tables (:func:`nested_peak`), finds the outer
segments of least peak (:func:`nested_plan`, exact for that price) and estimates its time
(:func:`nested_recompute_ms`). It is the registered planner ``nested`` (:func:`plan`): its plans carry
``Plan.nested``, and every path that runs a plan (``apply``, the measured step, the gradient check, the timing
rounds) runs them with ``StageChain.run(..., nested=True)``. benchmarks/nested_checkpoints.py measures it
(ResNet-152, ResNet-50: predicted to 0.02%) and docs/benchmarks.md has the figures.
"""

from __future__ import annotations

from collections.abc import Sequence

from remat.client.planning.cost_models import PytorchTables, segments_peak
from remat.client.planning.recompute_time import NS_PER_MS, recompute_cost, stage_costs
from remat.client.trace import Trace


def nested_peak(trace: Trace, checkpoints: Sequence[int], tables: PytorchTables | None = None) -> int:
    """Peak activation bytes of ``checkpoints`` run nested.

    A checkpointed segment (a, b] of two or more stages, once its backward starts: the outer re-run runs stages
    a+1..b-1 keeping nothing but their outputs (the inner checkpoints' inputs) and stage b up to its last saved
    tensor, beside the gradient of x_b (``delta[b]``); then stage b's backward, and for s = b-1 down to a+1 a
    one-stage re-run and backward (a one-stage segment's candidates), beside the outputs a+1..s-1 that the inner
    checkpoints before s still hold. Its first forward, one-stage and frameless segments and the last segment
    are as in :func:`remat.client.planning.cost_models.pytorch_peak` (side values as the tables price them).
    """
    t = tables if tables is not None else PytorchTables(trace)
    return segments_peak(trace, checkpoints, t,
                         lambda a, b: t.local(a, b) if b == t.n or b == a + 1 else _nested_local(t, a, b))


def _stage_alone(t: PytorchTables, s: int) -> int:
    """Stage s re-run alone from its input and run backward (a one-stage segment's recompute and backward),
    above the input."""
    return max(t.back_ck[s], t.rec_last_first[s] + t.delta[s]) - t.U[s - 1]


def _nested_local(t: PytorchTables, a: int, b: int) -> int:
    candidates = [t.fwd_first[a + 1], *(t.fwd_mid[s] for s in range(a + 2, b + 1))]  # the first forward
    held = 0  # outputs a+1..s-1: the inputs of the inner checkpoints not yet run backward
    for s in range(a + 1, b):
        candidates.append(held + t.fwd_first[s] + t.delta[b])  # the outer re-run, stage s keeping nothing
        candidates.append(held + _stage_alone(t, s))
        held += t.d[s]
    candidates.append(held + _stage_alone(t, b))  # the outer re-run's end (stage b saves) and b's backward
    return max(candidates)


def nested_plan(trace: Trace) -> tuple[int, ...]:
    """The checkpoints whose nested run has the least :func:`nested_peak`.

    The recurrence of ``linear``'s O(n²) reference (``quadratic_suffix_peaks``): w[i], the least peak of stages
    i+1..n above the checkpoints kept before boundary i, is the least over the first segment (i, j] of its
    price and w[j], both above what it keeps. A nested segment's price grows with j through running maxima
    (its first forward, its stages re-run alone, its outer re-run by ``delta[j]``), so each pair costs O(1):
    O(n²) in all. Checked against every plan's :func:`nested_peak` by exhaustive search
    (tests/client/planning/test_nested.py).
    """
    t = PytorchTables(trace)
    n = t.n
    w, nxt = [0] * (n + 1), [n] * (n + 1)
    for i in range(n - 1, -1, -1):
        best, best_j = t.d[i] + t.local(i, n), n
        forward = t.fwd_first[i + 1]
        alone = rerun = held = 0  # running maxima over stages i+1..j-1, and their outputs' bytes
        for j in range(i + 1, n):
            if j >= i + 2:
                forward = max(forward, t.fwd_mid[j])
            last = held + _stage_alone(t, j)
            if t.is_frameless(i, j):
                cost = max(t.local_frameless(i, j), w[j])
            else:
                cost = t.d[i] + max(forward, alone, last, rerun + t.delta[j], w[j])
            if cost < best:
                best, best_j = cost, j
            rerun = max(rerun, held + t.fwd_first[j])
            alone = max(alone, last)
            held += t.d[j]
        w[i], nxt[i] = best, best_j
    plan, i = [], nxt[0]
    while i < n:
        plan.append(i)
        i = nxt[i]
    return tuple(plan)


def plan(trace: Trace, *, cost_model: str = "pytorch") -> tuple[int, ...]:
    """The registered planner's checkpoints (:func:`nested_or_one_level`), whatever ``cost_model`` asks."""
    return nested_or_one_level(trace)[0]


def nested_or_one_level(trace: Trace) -> tuple[tuple[int, ...], bool, int]:
    """(checkpoints, whether they run nested, their peak): :func:`nested_plan` when its nested price is below
    ``linear``'s exact one-level peak, else ``linear``'s plan run one level. Why both: nesting every multi-stage segment
    is not always lower (an inner checkpoint keeps its stage's output through the segment's backward; measured
    on DenseNet-121 at batch 32, 224², 661.5 against 659.2 MiB), and a planner that promises the least peak
    with up to one more level of re-runs must not return more than one level gives. Ties go to one level
    (less recompute)."""
    from remat.client.planning.cost_models import pytorch_peak
    from remat.client.planning.planners import linear

    tables = PytorchTables(trace)
    outer = nested_plan(trace)
    one_level = linear.plan(trace, cost_model="pytorch")
    nested, single = nested_peak(trace, outer, tables), pytorch_peak(trace, one_level, tables)
    return (outer, True, nested) if nested < single else (one_level, False, single)


def nested_recompute_ms(trace: Trace, checkpoints: Sequence[int]) -> float | None:
    """Estimated time a nested plan adds to a step: what the same checkpoints cost run one level
    (``recompute_time``: every stage before the last checkpoint re-run once, one ``checkpoint_ms`` per segment),
    plus, in every checkpointed segment (a, b] of two or more stages, stages a+1..b-1 re-run a second time
    alone, each under its own checkpoint. None when the trace has no forward times."""
    if not trace.has_times:
        return None
    costs = stage_costs(trace)
    bounds = (0, *sorted(checkpoints))
    inner = [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a + 1]
    again = sum(sum(costs[a:b - 1]) for a, b in inner)  # stages a+1..b-1 (0-indexed a..b-2)
    extra_checkpoints = sum(b - a - 1 for a, b in inner)
    return ((recompute_cost(trace, checkpoints) + again) / NS_PER_MS
            + trace.checkpoint_ms * (len(checkpoints) + extra_checkpoints))
