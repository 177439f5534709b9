"""The one door from the client to the heavy side: planning on this machine, and the local plan store.

The client is the light side: ``import remat.client`` loads neither torch nor a database, and no module of
this package imports ``remat.worker`` or ``remat.service``. Yet two of its faces need the heavy side:
``remat-client plan MODEL`` without a server (profile, plan and measure here, keep the answer in the local
plan store) and ``remat.client.checkpoint`` on a miss (profile the model the script holds). They reach it
through this port, :class:`LocalPlanner`, written in the client's own vocabulary (requests, keys, plans,
traces, measurements, reports). The worker implements it (``remat.worker.local``, the local twin of the
Celery tasks) and the distribution binds the two with an entry point, as torch binds out-of-tree device
backends::

    [project.entry-points."remat.local_planner"]
    local = "remat.worker.local"

So the dependency points one way (worker → client), and an environment with the client alone says what is
missing instead of failing on an import deep inside a command.

Public API::

    local_planner() -> LocalPlanner          # raises LocalPlannerMissing when no heavy side is installed
    local_planner_or_none() -> LocalPlanner | None
    LocalPlanner                             # the port (a Protocol)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol

from remat.client.errors import RematError

if TYPE_CHECKING:
    from remat.client.budget_spec import BudgetSpec
    from remat.client.graph.built_model import BuiltModel
    from remat.client.measurement import Measurement
    from remat.client.plan import Plan
    from remat.client.plan_key import PlanKey
    from remat.client.report import MaxBatchReport, ModelReport, ProfileResult
    from remat.client.request import ModelRequest, ProgressFn
    from remat.client.trace import Trace
    from remat.client.zoo_batch import ZooRow

__all__ = ["ENTRY_POINT_GROUP", "LocalPlanner", "LocalPlannerMissing", "local_planner", "local_planner_or_none"]

ENTRY_POINT_GROUP = "remat.local_planner"


class LocalPlannerMissing(RematError):
    """No heavy side is installed: this environment can fetch and apply plans, not make them."""


class LocalPlanner(Protocol):
    """What the client asks of the heavy side: the pipeline run here, and the local plan store.

    Store reads answer None (or empty) when this machine has no store (an image with torch alone); they
    never create one. Every method that profiles raises ``remat.client.errors.ModelError`` for a model that
    cannot be built, run or cut at its input, with what to change.
    """

    # --- remat-client plan / trace / measure / zoo / show: a request, planned here and kept in the store ---
    def cached_report(self, request: ModelRequest) -> ModelReport | None:
        """The stored complete answer for a zoo request, found by name without importing torch; else None."""
        ...

    def profile_and_plan(self, request: ModelRequest, progress: ProgressFn | None = None, *,
                         refresh: bool = False) -> ModelReport:
        """Build, look the key up, else profile, plan with every planner, measure, and store in one transaction."""
        ...

    def budget_report(self, request: ModelRequest, budget: BudgetSpec, progress: ProgressFn | None = None, *,
                      refresh: bool = False) -> ModelReport:
        """``plan MODEL --budget X``: none, linear and the fastest frontier plan that fits, measured."""
        ...

    def profile_trace(self, request: ModelRequest, progress: ProgressFn | None = None) -> Trace:
        """Only the profiling step: the model's ``remat-trace/1`` trace."""
        ...

    def profile(self, built: BuiltModel) -> Trace:
        """The trace of a model the caller built (``plan MODEL --server`` uploads it)."""
        ...

    def measure_algorithm(self, request: ModelRequest, algorithm: str,
                          progress: ProgressFn | None = None) -> Measurement:
        """One plan measured beside no checkpointing."""
        ...

    def max_batch(self, request: ModelRequest, memory: BudgetSpec, *, overhead: float | None = None,
                  profile_batches: Sequence[int] = (2, 4), progress: ProgressFn | None = None) -> MaxBatchReport:
        """``remat-client max-batch``: the largest batch whose best plan fits ``memory``, from profiles at
        ``profile_batches``, verified by one measured step at that batch."""
        ...

    def plan_zoo(self, requests: Iterable[ModelRequest], *, refresh: bool = False,
                 on_start: Callable[[ModelRequest], None] | None = None,
                 on_row: Callable[[ZooRow], None] | None = None,
                 progress: ProgressFn | None = None) -> list[ZooRow]:
        """Every request planned here in turn, each stored as it finishes; one failure is a failed row."""
        ...

    def stored_reports(self, *, request: ModelRequest | None = None,
                       model_hash: str | None = None) -> list[ModelReport]:
        """What the store holds for a request's key, or for every key whose hash starts with ``model_hash``."""
        ...

    # --- remat.client.checkpoint: the model a training script holds --------------------------------------
    def stored_plan(self, key: PlanKey, algorithm: str) -> Plan | None:
        """The store's ``algorithm`` plan for ``key``, carrying its key; None without one or without a store."""
        ...

    def stored_frontier(self, key: PlanKey) -> Sequence[Plan]:
        """The store's Pareto frontier for ``key`` (plans carrying their key), tightest first."""
        ...

    def plan_held_model(self, built: BuiltModel, algorithm: str, progress: ProgressFn | None = None, *,
                        budget: BudgetSpec | None = None) -> tuple[ProfileResult, Plan | None]:
        """Profile and plan a held model, measure ``none`` and the chosen plan, keep it all in the store.

        Returns the profile and the plan to apply (``algorithm``'s, or the frontier plan ``budget`` picks;
        None for an unknown algorithm). Raises ``BudgetInfeasibleError`` after storing when nothing fits.
        """
        ...


def _load() -> Any | None:
    found = entry_points(group=ENTRY_POINT_GROUP)
    if not found:
        return None
    (first, *_) = sorted(found, key=lambda ep: ep.name)
    return first.load()


@functools.cache
def local_planner_or_none() -> LocalPlanner | None:
    """The installed heavy side, or None when this environment has the client alone."""
    return _load()


def local_planner() -> LocalPlanner:
    """The installed heavy side.

    Raises:
        LocalPlannerMissing: no package provides the ``remat.local_planner`` entry point here.
    """
    planner = local_planner_or_none()
    if planner is None:
        raise LocalPlannerMissing(
            "remat: planning on this machine needs remat's worker side, which this environment does not install "
            "(no 'remat.local_planner' entry point); install the whole remat distribution, or use a plan service "
            "(--server / REMAT_SERVER)")
    return planner
