"""The largest batch whose best plan fits a memory limit, planned on traces derived at each batch size.

The question users ask of activation checkpointing is not "how much does this plan save" but "what is the
largest batch I can train here, and at what time cost". With a trace at any batch size
(remat.client.derived_trace), the answer is a search over the batch: at each candidate, the plan of least
predicted peak — or, with an overhead allowance, the least-peak plan whose estimated recompute stays within it
— either fits the limit or not. The plans searched are those a derived trace prices exactly: ``linear`` and the
frontier's chain plans (one level of re-runs), and ``nested``, whose checkpointed segments re-run their stages
once more, one at a time (remat.client.planning.nested: ResNet-152 at batch 16, 224², 355 against ``linear``'s
453 MiB). The least predicted peak only grows with the batch (every stored byte count is non-decreasing in it, a
plan's peak is a maximum of sums of them, and the least of such peaks grows too), so an exponential search from
the profiled batches, then a bisection, finds the boundary in O(log B) plannings.

Graph plans (``acg``) are searched too where the caller can price them (``graph_plan_at``: a graph profile
derived at the batch, remat.client.planning.graph_fit, and the predictor's search on it, which runs the op
graph's executor and so is the heavy side's). Each costs a search of up to 2,000 replayed plans (seconds), not
microseconds, so the chain plans' boundary comes first and the graph plans search only above it: a graph plan
is searched from every chain plan as a start and is never predicted above them, so below that boundary it
cannot change the answer. Without a recompute estimate of its own, a graph plan is no candidate under an
``overhead``.

What "fits" means is the caller's: a byte limit on the activation peak (``--memory SIZE``, like every budget:
remat.client.budget_spec), or a room that shrinks as the batch's own input grows (``fit`` on CUDA).

Torch-free: a planning question. The measured step that verifies the answer is the heavy side's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from remat.client.derived_trace import SizeFit
from remat.client.errors import PlanError
from remat.client.plan import Plan
from remat.client.planning.plans import STORED_COST_MODEL, frontier_plans, make_plan
from remat.client.trace import Trace

__all__ = ["MAX_BATCH", "BatchAnswer", "GraphPlanAt", "MaxBatchError", "best_plan", "largest_batch"]

MAX_BATCH = 2**20
"""The search's upper end: a million samples, past any device's memory for any model remat plans."""


GraphPlanAt = Callable[[int, Trace], Plan]
"""``(batch, trace at that batch) -> the graph plan searched there``, with its predicted peak."""


class MaxBatchError(PlanError):
    """No batch fits (not even 1), or the limits make no sense; the message says which, with the figures."""


@dataclass(frozen=True)
class BatchAnswer:
    """The largest batch that fits, with its plan, and the next batch's plan that does not."""

    batch_size: int
    plan: Plan
    trace: Trace
    next_plan: Plan | None
    """The best plan at ``batch_size + 1``, predicted over the limit (None when the search hit MAX_BATCH)."""
    limit_bytes: int
    """The limit at ``batch_size`` (the room left for activations there)."""
    next_limit_bytes: int | None
    plannings: int
    """How many batch sizes the search planned."""


def best_plan(trace: Trace, overhead: float | None, *, nested: bool = True) -> Plan:
    """The plan of least predicted peak, or with ``overhead`` the least-peak plan whose estimated recompute is
    at most that share of the step (the least-peak plan when the trace has no times).

    Candidates: ``linear`` (the least peak of one level of re-runs), the frontier's chain plans under
    ``overhead``, and, unless ``nested`` is False, the ``nested`` planner's plan where it runs nested (where
    nesting lowers nothing it is ``linear``'s plan). Ties go to the chain plan: it re-runs less.
    """
    least = make_plan(trace, "linear", cost_model=STORED_COST_MODEL)
    nested_plans = [p for p in ([make_plan(trace, "nested")] if nested else []) if p.nested]
    if overhead is None or not trace.has_times:
        return min([least, *nested_plans], key=lambda p: p.predicted_peak_bytes)
    within = [p for p in [*frontier_plans(trace), *nested_plans]
              if p.recompute_overhead is not None and p.recompute_overhead <= overhead]
    return min(within, key=lambda p: p.predicted_peak_bytes) if within else make_plan(
        trace, "none", cost_model=STORED_COST_MODEL)


def largest_batch(fit: SizeFit, limit_at: Callable[[int], int], *, overhead: float | None = None,
                  max_batch: int = MAX_BATCH, nested: bool = True, graph_plan_at: GraphPlanAt | None = None
                  ) -> BatchAnswer:
    """The largest batch size whose :func:`best_plan` (with ``nested`` plans or without), or with
    ``graph_plan_at`` and no ``overhead`` its graph plan, is predicted within ``limit_at(batch)`` bytes.

    Raises:
        MaxBatchError: not even batch 1 fits (naming its peak and the limit).
    """
    chain_plans: dict[int, Plan] = {}
    graph_plans: dict[int, Plan] = {}

    def chain_plan(batch: int) -> Plan:
        if batch not in chain_plans:
            chain_plans[batch] = best_plan(fit.trace_at(batch), overhead, nested=nested)
        return chain_plans[batch]

    def graph_plan(batch: int) -> Plan:
        assert graph_plan_at is not None
        if batch not in graph_plans:
            graph_plans[batch] = graph_plan_at(batch, fit.trace_at(batch))
        return graph_plans[batch]

    def fits(plan: Plan, batch: int) -> bool:
        return plan.predicted_peak_bytes <= limit_at(batch)

    def plan_at(batch: int) -> Plan:
        """The least-peak plan at ``batch`` among those searched there (ties to the chain plan)."""
        searched = [chain_plan(batch), *([graph_plans[batch]] if batch in graph_plans else [])]
        return min(searched, key=lambda p: p.predicted_peak_bytes)

    low = _largest(lambda b: fits(chain_plan(b), b), 0, max(fit.sizes), max_batch)
    if graph_plan_at is not None and overhead is None and low < max_batch and fits(graph_plan(low + 1), low + 1):
        low = _largest(lambda b: fits(graph_plan(b), b), low + 1, 2 * (low + 1), max_batch)
    if low == 0:
        one = plan_at(1)
        raise MaxBatchError(f"memory: not even batch 1 fits: its best plan ({one.algorithm}) needs "
                            f"{one.predicted_peak_bytes} bytes of activations, {limit_at(1)} are available")
    over = low + 1 if low < max_batch else None
    if graph_plan_at is not None and overhead is None:  # the answer's and the next batch's least-peak plans
        for batch in (low, over):
            if batch is not None:
                graph_plan(batch)
    return BatchAnswer(batch_size=low, plan=plan_at(low), trace=fit.trace_at(low),
                       next_plan=plan_at(over) if over is not None else None, limit_bytes=limit_at(low),
                       next_limit_bytes=limit_at(over) if over is not None else None,
                       plannings=len(chain_plans) + len(graph_plans))


def _largest(fits: Callable[[int], bool], low: int, first: int, max_batch: int) -> int:
    """The largest batch ≤ ``max_batch`` that ``fits``, given that ``low`` fits (0: none known; 1 is tried),
    ``fits`` true up to some batch and false above it: doubling from ``first``, then bisecting."""
    if low == 0:
        if not fits(1):
            return 0
        low = 1
    high = max(first, low + 1)
    while high <= max_batch and fits(high):
        low, high = high, high * 2
    high = min(high, max_batch + 1)  # the first batch known not to fit, or one past the search's end
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low
