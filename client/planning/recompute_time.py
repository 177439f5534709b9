"""What a plan costs in time: the work its checkpointed segments add to a training step.

Two terms, both measured by the profiler in real steps (NOTE [ timing a plan ] in
``remat.worker.profilers.step_timing``):

- **stages re-run**: every segment but the last runs under a non-reentrant checkpoint and is re-run in
  backward, so a plan re-runs every stage before its last checkpoint; each costs its ``recompute_ms`` (the
  recompute and the checkpoint's hooks on its saved tensors), or its ``forward_ms`` where that was not
  measured. **Only the last checkpoint's position matters** for this term.
- **segments**: each checkpoint adds a fixed ``checkpoint_ms`` (the checkpoint's frame, RNG state and buffer
  snapshot, the early stop of its recompute): 0.3–0.9 ms per segment measured on CPU, as much as re-running a
  small stage, so a plan of 50 one-stage segments costs visibly more than one segment of the same 50 stages.

The ``budget`` planner minimises the first term exactly (it is what lets it stay exact at O(n²));
``recompute_ms``, what every plan reports, is both. Among plans of one last position the planner takes the
least peak, whatever its number of segments: the frontier is exact in the stage term, and its reported times
are the whole estimate. Two simplifications, both on the side of overhead: the last stage of a re-run segment
is counted whole although the recompute stops at its last saved tensor, and a frameless segment (views,
permutes, ``cat``: nothing saved, so nothing to re-run, docs/cost-model.md) is counted although it is not re-run.

Costs are integers (nanoseconds) so that sums are exact whatever their order: the planner and an exhaustive
search must agree to the unit, not to a float tolerance. A trace without forward times (hand-written) costs one
unit per re-run stage, so a budget still picks the plan that re-runs the fewest stages; its plans report no
``recompute_ms``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

from remat.client.trace import Trace

NS_PER_MS = 1_000_000


def stage_costs(trace: Trace) -> list[int]:
    """Per-stage re-run cost in integer nanoseconds: the measured ``recompute_ms``, else ``forward_ms``; 1 per
    stage without times."""
    if not trace.has_times:
        return [1] * trace.num_stages
    return [max(0, round((s.recompute_ms if s.recompute_ms is not None else s.forward_ms or 0.0) * NS_PER_MS))
            for s in trace.stages]


def cost_before(trace: Trace) -> list[int]:
    """cost_before[c]: the recompute cost of any plan whose last checkpoint is c (0: no checkpoint)."""
    return [0, *accumulate(stage_costs(trace))]


def recompute_cost(trace: Trace, checkpoints: Sequence[int]) -> int:
    """Summed :func:`stage_costs` of every stage a plan re-runs in backward: those before its last checkpoint."""
    last = max(checkpoints, default=0)
    return sum(stage_costs(trace)[:last])


def recompute_ms(trace: Trace, checkpoints: Sequence[int]) -> float | None:
    """Estimated time the plan adds to a training step in milliseconds: the stages it re-runs and one
    ``checkpoint_ms`` per checkpointed segment; None when the trace has no forward times."""
    if not trace.has_times:
        return None
    return recompute_cost(trace, checkpoints) / NS_PER_MS + trace.checkpoint_ms * len(checkpoints)
