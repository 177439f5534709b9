"""Stage times a plan's cost can be estimated from: timed in the context a recompute runs in, and robust to
a busy machine.

NOTE [ timing a plan ] What a checkpointed plan adds to a training step is not the forward time of the stages
it re-runs, timed one stage at a time. Measured on CPU (ResNet-152, batch 1, 64², one thread, medians of 15
interleaved steps): one checkpointed segment over stages 1–50 added 84 ms to a 215 ms step whose forward of
those stages took 59 ms. Its recompute, timed between the enter and exit of the checkpoint's recompute
context, took 63 ms; the checkpoint's hooks on every saved tensor added 7 ms to the forward and 14 ms to the
backward outside the recompute. Hand-written ``torch.utils.checkpoint`` over the same stages cost the same.
And each segment has a fixed cost whatever it re-runs (frame, RNG state, buffer snapshot, early stop): 50
one-stage segments over the same stages cost 0.5–0.9 ms more per segment than one segment of 50 stages.

So the profiler measures what the estimate is made of in real training steps, in interleaved rounds:

- each stage's forward inside a whole forward pass with grad (``forward_ms``), the least over the rounds;
- five steps per round: no checkpoint, one segment over stages 1..n-1 (``(n-1,)``), no checkpoint, one segment
  per stage (``(1, …, n-1)``), no checkpoint. Both checkpointed plans re-run the same stages, so their overheads
  over no checkpoint give the fixed cost of a segment, ``checkpoint_ms = (all - one) / (n - 2)``, and what
  re-running stages 1..n-1 costs, ``one - checkpoint_ms``, shared among them in proportion to their forward
  times (``recompute_ms``).

Each checkpointed step is read against the ``none`` steps run just before and just after it: its overhead is
the median over the rounds of the step less the mean of the two. This project's 2-core VM changes speed within
seconds, and in both directions (and the run-queue clock below can read a step short), so the difference of the
two steps' leasts over the rounds, which the profiler read until 2026-12-07, took each figure from another
moment and kept the drift between them. The steps on either side of a plan's step share its seconds; the median
leaves out a round where one of the three was hit alone. Measured on that VM (``benchmarks/busy_clock.py
profiles``, four profiles alone and four beside a spinning process, each read both ways from its own rounds;
ResNet-50 and DenseNet-121 at batch 4, 128², ViT-B/16 at 1, 64² with gradients kept), ``linear``'s estimate
spread across the profiles with standard deviations summing to 35 ms bracketed against 46 ms as leasts alone,
and 27 against 65 ms beside the neighbour (ViT-B/16 there: 65-83 ms against 58-162). It costs two more steps per
round: the profiles took about 40% longer. Reading the rounds' ratios to their ``none`` step (in pairs) had
been tried on 2026-12-02 and spread like the leasts across profiles. The step time (``step_ms``) is still a least,
what the step takes when nothing interferes: the least over the rounds of each round's median ``none`` step
(``baseline_step``: the least of all three a round would pick the one the clock read shortest), with its spread
(median minus least) beside it. ``benchmarks/step_overhead.py`` measures the overheads the estimates are held
to the same way.

On CPU the clock leaves out the time the process's threads waited for a core (NOTE [ time beside a neighbour ],
:mod:`remat.worker.profilers.run_queue`): a neighbour that keeps a core busy takes from every round, so no
least of rounds escapes it, but its share is booked. A wait is booked whole when it ends, so a stage of a few
ms can be charged with a slice of its neighbour stage's wait, and the least of such times would pick the most
over-corrected round. So a stage's ``forward_ms`` is its share of the fastest whole pass (the least over the
rounds of the pass's corrected time, its stages' waits and wall times summed: the misbooked slices cancel),
shared by each stage's lower quartile over the rounds (which, like the least, ignores noisy rounds as long as a
quarter are clean). In a side trial beside a neighbour (ResNet-152 at batch 1, 64² and 4, 128², ResNet-50 at
4, 128²; 9-15 rounds), against the idle profile's shares, over every run of two or more stages: the lower
quartiles' shares off by 3-4% on average, the least of the plain wall times' by 4-9%, the least of the
corrected times' by 12-24%. ``waited_share`` in the summary is the part of the timed rounds' wall time spent
waiting: near 0 on an idle machine.

A step also pays for what glibc's malloc gives back to the system and faults in again, a different amount per
plan and per run; remat's CLI and workers keep freed memory, and ``host_malloc`` in the summary says whether
the profile was timed so (NOTE [ page faults on CPU ], :mod:`remat.client.host_memory`).
"""

from __future__ import annotations

import functools
import operator
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, TypeVar

from remat.client.host_memory import host_malloc
from remat.worker.profilers.run_queue import Timed

__all__ = ["MAX_ROUNDS", "MIN_ROUNDS", "ROUNDS_BUDGET_S", "ROUNDS_LIMIT_S", "StageTimes", "baseline_step",
           "bracketed_differences", "bracketed_order", "bracketed_overhead", "calibrate", "time_stages"]

T = TypeVar("T")

MIN_ROUNDS = 3
"""Rounds run unless they pass :data:`ROUNDS_LIMIT_S`: three are what a busy 2-core machine needs at least, for
the least of the steps and for a median that leaves out a round hit alone."""
MAX_ROUNDS = 7
"""Rounds run while they fit :data:`ROUNDS_BUDGET_S`."""
ROUNDS_BUDGET_S = 30.0
"""Seconds of timing after which no further round starts past :data:`MIN_ROUNDS`."""
ROUNDS_LIMIT_S = 120.0
"""Seconds of timing after which no round starts but the first: a profile whose step takes tens of seconds (a
large batch on CPU) adds minutes, not a quarter of an hour, to its job (worker task time limits)."""


@dataclass(frozen=True, slots=True)
class StageTimes:
    """What :func:`time_stages` measured."""

    forward_ms: list[float]
    """Per stage: its forward inside a whole forward pass with grad, its share of the fastest pass."""
    recompute_ms: list[float] | None
    """Per stage: what re-running it under a checkpoint adds to a step (None with fewer than two stages)."""
    checkpoint_ms: float | None
    """Fixed cost of one checkpointed segment (None with fewer than three stages: not separable)."""
    summary: dict[str, Any] = field(default_factory=dict)
    """The trace's ``timing`` metadata: rounds, the measured steps and their spread."""


def time_stages(stages: Sequence[Callable[[Any], Any]], x0: Any, step: Callable[[Sequence[int]], None],
                timer: Callable[[Callable[[], Any]], Timed], forward_context: Callable[[], Any], *,
                min_rounds: int = MIN_ROUNDS, max_rounds: int = MAX_ROUNDS,
                budget_s: float = ROUNDS_BUDGET_S) -> StageTimes:
    """Time every stage in context and calibrate the recompute cost (NOTE [ timing a plan ]).

    Args:
        stages: stage callables 1..n (x_{i-1} -> x_i).
        x0: stage 1's input.
        step: one whole training step with the given checkpoints (forward, loss, backward; gradients reset).
        timer: runs a callable and times it, synchronised with the device (a backend's ``timed``).
        forward_context: a context manager factory for the forward pass (grad enabled, autocast).
        min_rounds, max_rounds, budget_s: rounds run; see the module's constants.
    """
    n = len(stages)
    plans: dict[str, tuple[int, ...]] = {"none": ()}
    if n >= 2:
        plans["one"] = (n - 1,)
    if n >= 3:
        plans["all"] = tuple(range(1, n))
    # Each checkpointed step between two ``none`` steps of its round: none, one, none, all, none.
    order = bracketed_order("none", [name for name in plans if name != "none"])
    for checkpoints in plans.values():  # first calls (allocations, lazy initialisation) are not timed
        step(checkpoints)
    per_stage: list[list[Timed]] = [[] for _ in range(n)]
    steps: list[list[Timed]] = [[] for _ in order]
    started = perf_counter()
    rounds = 0
    def another_round() -> bool:
        elapsed = perf_counter() - started
        if rounds == 0:
            return True
        if rounds >= max_rounds or elapsed >= ROUNDS_LIMIT_S:
            return False
        return rounds < min_rounds or elapsed < budget_s

    while another_round():
        with forward_context():
            x = x0
            for i, stage in enumerate(stages):
                holder: dict[str, Any] = {}

                def run(stage: Callable[[Any], Any] = stage, x: Any = x, holder: dict[str, Any] = holder) -> None:
                    holder["y"] = stage(x)

                per_stage[i].append(timer(run))
                x = holder.pop("y")
            del x  # the pass's graph: no backward runs
        for timed, name in zip(steps, order, strict=True):
            timed.append(timer(lambda cps=plans[name]: step(cps)))
        rounds += 1
    forward_ms = _stage_shares(per_stage)
    step_ms = [[t.ms for t in timed] for timed in steps]
    base_ms, base_spread = baseline_step([timed for name, timed in zip(order, step_ms, strict=True) if name == "none"])
    everything = [t for timed in (*per_stage, *steps) for t in timed]
    wall = sum(t.wall_ms for t in everything)
    summary: dict[str, Any] = {
        "rounds": rounds,
        "statistic": "step: least over interleaved rounds of each round's median none step; overheads: median over "
                     "the rounds of the step less the mean of the none steps either side",
        "step_ms": base_ms,
        "step_spread_ms": base_spread,
        "forward_ms": sum(forward_ms),
        "waited_share": sum(t.waited_ms for t in everything) / wall if wall > 0 else 0.0,
        # Threads runnable beside the profile's, their wall-weighted mean; None where the clock could not count them.
        "neighbours": functools.reduce(operator.add, everything).neighbours if everything else None,
        "host_malloc": host_malloc(),  # NOTE [ page faults on CPU ]: whether freed memory was faulted in again
    }
    if n < 2:
        return StageTimes(forward_ms, None, None, summary)
    overheads = {name: bracketed_overhead(step_ms[k], step_ms[k - 1], step_ms[k + 1])
                 for k, name in enumerate(order) if name != "none"}
    one = overheads["one"]
    summary["one_segment_overhead_ms"] = one
    all_segments = overheads.get("all")
    if all_segments is not None:
        summary["one_per_stage_overhead_ms"] = all_segments
    recompute_ms, checkpoint_ms, ratio = calibrate(forward_ms, one, all_segments)
    summary["recompute_to_forward"] = ratio
    return StageTimes(forward_ms, recompute_ms, checkpoint_ms if n >= 3 else None, summary)


def calibrate(forward_ms: Sequence[float], one_ms: float,
              all_segments_ms: float | None) -> tuple[list[float], float, float]:
    """Each stage's ``recompute_ms``, the fixed ``checkpoint_ms`` of a segment and the recompute-to-forward ratio,
    from the overheads of one segment over stages 1..n-1 and of one segment per stage (None: fewer than three
    stages, no segment cost separable) (NOTE [ timing a plan ])."""
    n = len(forward_ms)
    checkpoint_ms = max(0.0, (all_segments_ms - one_ms) / (n - 2)) if all_segments_ms is not None else 0.0
    rerun = one_ms - checkpoint_ms
    rerun_forward = sum(forward_ms[: n - 1])
    # Where the overhead was lost in the noise, the forward time is the best estimate there is. The ratio used
    # is recorded either way: one type in every profile, which a trace derived from several requires.
    ratio = rerun / rerun_forward if rerun > 0 and rerun_forward > 0 else 1.0
    return [f * ratio for f in forward_ms], checkpoint_ms, ratio


def bracketed_overhead(plan_ms: Sequence[float], before_ms: Sequence[float], after_ms: Sequence[float]) -> float:
    """What a checkpointed step adds to ``none``'s, read against the ``none`` steps run just before and just after
    it in each round: the median over the rounds of the step less the mean of the two (NOTE [ timing a plan ]).
    The one reading of an overhead: the profile's calibration, validation's measured steps
    (``measure.time_plans_spread``) and ``benchmarks/step_overhead.py`` (which also records what a profile reads
    through this name)."""
    return statistics.median(bracketed_differences(plan_ms, before_ms, after_ms))


def bracketed_differences(plan_ms: Sequence[float], before_ms: Sequence[float],
                          after_ms: Sequence[float]) -> list[float]:
    """Per round, the checkpointed step less the mean of the ``none`` steps just before and after it."""
    return [p - (b + a) / 2 for p, b, a in zip(plan_ms, before_ms, after_ms, strict=True)]


def bracketed_order(baseline: T, others: Sequence[T]) -> list[T]:
    """A round's order: ``baseline`` first, last and between every two of ``others``."""
    order = [baseline]
    for other in others:
        order += [other, baseline]
    return order


def baseline_step(rounds_at: Sequence[Sequence[float]]) -> tuple[float, float]:
    """The no-checkpoint step's time and spread from the rounds it ran several times in (``rounds_at[j][r]``: its
    j-th step of round r): the least over the rounds of each round's median, and how far the median of those sits
    above it. The least of every step would pick the one the run-queue clock read shortest: on a loaded
    machine a step of a few ms can read 0 when a wait booked from its neighbour call outweighs it, and three
    such steps a round give it three chances (seen in CI on a small ResNet's profile)."""
    per_round = [statistics.median(steps) for steps in zip(*rounds_at, strict=True)]
    least = min(per_round)
    return least, statistics.median(per_round) - least


def _lower_quartile(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=4, method="inclusive")[0]


def _stage_shares(per_stage: Sequence[Sequence[Timed]]) -> list[float]:
    """Each stage's forward time: its lower quartile's share of the fastest whole pass (the module's docstring).
    Where every quartile is zero (a clock too coarse for the stages), the least of each stage's wall times."""
    rounds = len(per_stage[0]) if per_stage else 0
    passes = [functools.reduce(operator.add, (stage[r] for stage in per_stage)) for r in range(rounds)]
    shares = [_lower_quartile([t.ms for t in stage]) for stage in per_stage]
    total = sum(shares)
    fastest = min((p.ms for p in passes), default=0.0)
    if total <= 0 or fastest <= 0:
        return [min(t.wall_ms for t in stage) for stage in per_stage]
    return [fastest * share / total for share in shares]
