"""Checkpoint planners: one module per algorithm, one signature, one registry.

Every planner is a pure function ``(trace, *, cost_model) -> checkpoints`` (a sorted tuple of stage
boundaries 1..n-1). A planner with a ``graph_fn`` (``acg``) also plans on the trace's op graph when the
trace has one (``remat.client.planning.plans.make_plan`` decides which, and asks no planner by name).
``cost_model`` names the objective a planner that searches should minimise; exact planners minimise their
own objective whatever is asked (``cubic`` and ``acg``: classic, ``linear``: pytorch), and the caller
evaluates the result under the requested model. Planners import neither torch nor any service code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from remat.client.planning import nested
from remat.client.planning.planners import acg, baselines, cubic, linear
from remat.client.planning.planners.acg import GraphPlanned
from remat.client.trace import Trace

PlannerFn = Callable[..., tuple[int, ...]]
GraphPlannerFn = Callable[[Trace], GraphPlanned]


@dataclass(frozen=True, slots=True)
class PlannerSpec:
    """A registered planner and the cost model its plans are reported under by default."""

    name: str
    fn: PlannerFn
    native_cost_model: str
    summary: str
    graph_fn: GraphPlannerFn | None = None
    """Plans on ``trace.graph`` (a graph plan, ``Plan.dropped_vertices``) when the trace has one."""
    nested: bool = False
    """Its plans run nested (``Plan.nested``): priced by ``nested_peak``, run with ``nested=True``."""

    @property
    def plans_graphs(self) -> bool:
        return self.graph_fn is not None


PLANNERS: dict[str, PlannerSpec] = {
    spec.name: spec
    for spec in (
        PlannerSpec("none", baselines.plan_none, "pytorch", "no checkpointing"),
        PlannerSpec("uniform", baselines.plan_uniform, "pytorch",
                    "checkpoint_sequential with ceil(sqrt(n)) equal segments"),
        PlannerSpec("chen-sqrt", baselines.plan_chen_sqrt, "pytorch",
                    "Chen et al.: a checkpoint every floor(sqrt(n)) stages"),
        PlannerSpec("chen-greedy", baselines.plan_chen_greedy, "pytorch",
                    "Chen et al.: greedy running-sum budget, swept"),
        PlannerSpec("cubic", cubic.plan, "classic", "exact minimiser of the classic model, O(n^3)"),
        PlannerSpec("linear", linear.plan, "pytorch", "exact minimiser of the pytorch model, O(n log^2 n)"),
        PlannerSpec("nested", nested.plan, "pytorch", "linear's model with one more level: a checkpointed "
                    "segment re-runs its stages one at a time in its own backward, exact, O(n^2)", nested=True),
        PlannerSpec("acg", acg.plan, "classic", "Feng & Huang: the classic model on the op graph (cuts inside "
                    "blocks), on the chain when the trace has no graph", graph_fn=acg.plan_trace_graph_dropped),
    )
}
DEFAULT_PLANNER = "linear"


def get_planner(name: str) -> PlannerSpec:
    """Look a planner up by name; the error lists the valid names."""
    try:
        return PLANNERS[name]
    except KeyError:
        raise ValueError(f"algorithm {name!r} is unknown; choose one of {', '.join(PLANNERS)} or all") from None

