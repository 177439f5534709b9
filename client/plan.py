"""The plan: which stage boundaries (or op-graph vertices) to keep, and what that is predicted (and measured) to cost.

This is the wire form shared by the CLI's ``--json`` output, the service and the worker; it lives in the
client package because training jobs read it without any of the heavy dependencies.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from remat.client.errors import PlanError

PLAN_SCHEMA_VERSION = 1
COST_MODELS = ("classic", "pytorch")
NESTED_KEY = "nested"
"""The plan field (in ``Plan.extra``) of a nested plan: its checkpointed segments re-run their stages one at a
time during their own backward (remat.client.planning.nested; ``StageChain.run(..., nested=True)``)."""
LOWER_BOUND_KEY = "lower_bound_bytes"
"""The plan field (kept in ``Plan.extra``, so stored and served as it is) of a peak no plan can go below."""
LOWER_BOUND_AT_KEY = "lower_bound_at"
"""Beside it: the event of the step where that memory is forced."""
CERTIFIED_BOUND_KEY = "certified_bound_bytes"
"""The plan field (in ``Plan.extra``) of a peak no one-level graph plan of the step can go below, certified by
the relaxed step's MILP (NOTE [relaxed step] in remat.client.planning.relaxed_step); only where a worker spent
time on it (``REMAT_CERTIFY_S``)."""
CERTIFIED_BY_KEY = "certified_by"
"""Beside it: how it was certified (the solver, its time, whether it finished)."""
BUDGET_ALGORITHM = "budget"
"""The algorithm of plans chosen for a byte budget: points of a trace's Pareto frontier of (peak, recompute
time), each stored under its own peak (``budget_bytes``). Not a registered planner: it needs a budget."""
PLANNED_BY_KEY = "planned_by"
"""The plan field (in ``Plan.extra``) of a budget point that is another planner's plan: a nested or graph plan
below every chain plan (NOTE [ budgets below the chains ] in remat.client.planning.plans) names its planner,
so that a table can say ``budget (acg)``."""


def validate_checkpoints(checkpoints: Iterable[int], num_stages: int) -> tuple[int, ...]:
    """Return checkpoints as a sorted tuple, checking each is a boundary 1..n-1 and appears once."""
    out = tuple(sorted(checkpoints))
    for c in out:
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= num_stages - 1:
            raise PlanError(f"checkpoints: boundary {c!r} is not in 1..{num_stages - 1} (n = {num_stages} stages)")
    if len(set(out)) != len(out):
        raise PlanError(f"checkpoints: a boundary is listed twice in {list(out)}")
    return out


def validate_dropped_vertices(dropped: Iterable[int], num_vertices: int) -> tuple[int, ...]:
    """Return dropped op-graph vertices as a sorted tuple, checking each is in 1..num_vertices-2 and appears once
    (the input and the output vertex are always kept)."""
    out = tuple(sorted(dropped))
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= num_vertices - 2:
            raise PlanError(f"dropped_vertices: vertex {v!r} is not in 1..{num_vertices - 2} "
                            f"({num_vertices} graph vertices)")
    if len(set(out)) != len(out):
        raise PlanError(f"dropped_vertices: a vertex is listed twice in {list(out)}")
    return out


@dataclass(kw_only=True, slots=True, frozen=True)
class Plan:
    """A checkpoint plan for one trace, as one algorithm chose it."""

    algorithm: str
    cost_model: str
    """The cost model the two peaks below were computed with (``classic`` or ``pytorch``)."""
    checkpoints: tuple[int, ...]
    """Stage boundaries 1..n-1 whose activations are kept; stages between them are recomputed."""
    predicted_peak_bytes: int
    baseline_peak_bytes: int
    """The same cost model's peak with no checkpoints: what the plan is compared against."""
    num_stages: int
    recompute_ms: float | None = None
    """Estimated extra forward time per step (sum of forward_ms of re-run stages), None without times."""
    step_ms: float | None = None
    """Estimated forward + backward time of one step without checkpointing, None without times."""
    budget_bytes: int | None = None
    """For a ``budget`` plan (a point of the Pareto frontier): the tightest budget it answers, its own
    predicted peak; a request for any budget ≥ this and below the next point's peak gets this plan."""
    dropped_vertices: tuple[int, ...] | None = None
    """A graph plan (``acg`` on a trace with an op graph): the op-graph vertices recomputed in backward, all
    others kept. ``checkpoints`` is then empty: the plan cuts inside the chain's stages, not between them.
    None for a chain plan."""
    num_vertices: int | None = None
    """A graph plan's op-graph vertex count (input and output included), None for a chain plan."""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.dropped_vertices is None) != (self.num_vertices is None):
            raise PlanError("plan: dropped_vertices and num_vertices go together (a graph plan has both)")
        if self.dropped_vertices is not None:
            if self.checkpoints:
                raise PlanError("plan: a graph plan (dropped_vertices) has no chain checkpoints")
            object.__setattr__(self, "dropped_vertices",
                               validate_dropped_vertices(self.dropped_vertices, int(self.num_vertices or 0)))
        # One JSON type per field, wherever the plan came from: a planner's sum of no re-run stages is the
        # int 0, a stored plan reads back 0.0; both print as 0.0.
        for name in ("recompute_ms", "step_ms"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, float):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise PlanError(f"plan: {name} must be a number, got {value!r}")
                object.__setattr__(self, name, float(value))

    @property
    def label(self) -> str:
        """What names this plan among a trace's plans: its algorithm, and its budget when it has one
        (``budget@123456``): a trace has one plan per registered planner but many frontier plans."""
        return f"{self.algorithm}@{self.budget_bytes}" if self.budget_bytes else self.algorithm

    @property
    def is_graph_plan(self) -> bool:
        """True for a plan over the op graph (``dropped_vertices``), False for a chain plan (``checkpoints``)."""
        return self.dropped_vertices is not None

    @property
    def runs_as(self) -> tuple[str, tuple[int, ...]]:
        """The training step this plan is, whatever its name: a graph plan's dropped vertices, a nested plan's
        or a chain plan's checkpoints. Two plans with the same ``runs_as`` are one step, measured once (NOTE
        [ one step, one measurement ] in remat.worker.pipeline); a chain plan and a graph plan never are, even
        where both keep everything."""
        if self.dropped_vertices is not None:
            return "graph", self.dropped_vertices
        return ("nested" if self.nested else "chain"), self.checkpoints

    @property
    def saving(self) -> float:
        """Fraction of the no-checkpoint peak that the plan saves (0.0 when the baseline is 0)."""
        if self.baseline_peak_bytes == 0:
            return 0.0
        return 1.0 - self.predicted_peak_bytes / self.baseline_peak_bytes

    @property
    def nested(self) -> bool:
        """True for a nested plan (``extra["nested"]``): what runs it is the chain with ``nested=True``, and
        its checkpoints name the outer segments."""
        return isinstance(self.extra, Mapping) and self.extra.get(NESTED_KEY) is True

    @property
    def planned_by(self) -> str:
        """The planner whose plan this is: ``extra["planned_by"]`` for a budget point taken from a registered
        planner, else ``algorithm``."""
        value = self.extra.get(PLANNED_BY_KEY) if isinstance(self.extra, Mapping) else None
        return value if isinstance(value, str) and value else self.algorithm

    @property
    def lower_bound_bytes(self) -> int | None:
        """A peak no plan of the same step can go below (``extra["lower_bound_bytes"]``: a graph plan's
        forced memory, NOTE [forced memory] in remat.client.planning.graph_predict), None when not computed."""
        value = self.extra.get(LOWER_BOUND_KEY) if isinstance(self.extra, Mapping) else None
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

    @property
    def optimality_gap(self) -> float | None:
        """How far above the lower bound the plan's predicted peak may be from the best plan's, as a fraction
        of the plan's peak (0.0: proven optimal); None without a bound."""
        bound = self.lower_bound_bytes
        if bound is None or self.predicted_peak_bytes <= 0:
            return None
        return max(0.0, 1.0 - bound / self.predicted_peak_bytes)

    @property
    def certified_bound_bytes(self) -> int | None:
        """A peak no one-level graph plan of the same step goes below (``extra["certified_bound_bytes"]``), None
        when not certified. Nested plans, which re-run twice, are bounded by ``lower_bound_bytes`` alone."""
        value = self.extra.get(CERTIFIED_BOUND_KEY) if isinstance(self.extra, Mapping) else None
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

    @property
    def certified_gap(self) -> float | None:
        """How far below this plan's predicted peak the best one-level graph plan may be, as a fraction of it
        (0.0: this plan is proven the best of them); None without a certified bound."""
        bound = self.certified_bound_bytes
        if bound is None or self.predicted_peak_bytes <= 0:
            return None
        return max(0.0, 1.0 - bound / self.predicted_peak_bytes)

    @property
    def recompute_overhead(self) -> float | None:
        """Recompute time as a fraction of the step time, when times are known."""
        if self.recompute_ms is None or not self.step_ms:
            return None
        return self.recompute_ms / self.step_ms

    @property
    def segments(self) -> list[tuple[int, int]]:
        """The plan's segments as (start boundary, end boundary) pairs: stages start+1..end."""
        bounds = (0, *self.checkpoints, self.num_stages)
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "algorithm": self.algorithm,
            "checkpoints": list(self.checkpoints),
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "cost_model": self.cost_model,
            "num_stages": self.num_stages,
            "recompute_ms": self.recompute_ms,
            "step_ms": self.step_ms,
            "budget_bytes": self.budget_bytes,
            "schema_version": PLAN_SCHEMA_VERSION,
        }
        if self.dropped_vertices is not None:
            out["dropped_vertices"] = list(self.dropped_vertices)
            out["num_vertices"] = self.num_vertices
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Plan:
        """Parse the JSON form (as printed by ``--json`` or served by the API)."""
        try:
            num_stages = int(obj["num_stages"])
            known = {"algorithm", "checkpoints", "predicted_peak_bytes", "baseline_peak_bytes", "cost_model",
                     "num_stages", "recompute_ms", "step_ms", "budget_bytes", "schema_version",
                     "dropped_vertices", "num_vertices"}
            dropped, num_vertices = obj.get("dropped_vertices"), obj.get("num_vertices")
            if dropped is not None:
                if isinstance(num_vertices, bool) or not isinstance(num_vertices, int):
                    raise PlanError(f"plan: num_vertices must be an integer, got {num_vertices!r}")
                if not isinstance(dropped, list | tuple):
                    raise PlanError(f"plan: dropped_vertices must be a list, got {type(dropped).__name__}")
                dropped = tuple(dropped)
            return cls(
                algorithm=str(obj["algorithm"]),
                cost_model=str(obj["cost_model"]),
                checkpoints=validate_checkpoints(obj["checkpoints"], num_stages),
                predicted_peak_bytes=int(obj["predicted_peak_bytes"]),
                baseline_peak_bytes=int(obj["baseline_peak_bytes"]),
                num_stages=num_stages,
                recompute_ms=obj.get("recompute_ms"),
                step_ms=obj.get("step_ms"),
                budget_bytes=obj.get("budget_bytes"),
                dropped_vertices=dropped,
                num_vertices=num_vertices if dropped is not None else None,
                extra={k: v for k, v in obj.items() if k not in known},
            )
        except KeyError as exc:
            raise PlanError(f"plan: field {exc.args[0]!r} is missing") from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, PlanError):
                raise
            raise PlanError(f"plan: malformed ({exc})") from None
