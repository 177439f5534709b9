"""What a user may write for a memory budget, and the bytes it means.

``--budget`` and ``budget=`` accept a byte count (``6442450944``), a size with a unit (``6GiB``, ``6GB``,
``512MiB``, ``512MB``, ``64KiB``; binary units are powers of 1024, decimal ones of 1000), a share of the
activation peak without checkpointing (``70%``), or ``fit`` on CUDA: what the device has left for
activations, its total memory less a safety margin and the static memory (weights, gradients, optimizer
state, the batch) measured before the step. All budgets count activation memory, the quantity every plan's
peak predicts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from remat.client.errors import PlanError

if TYPE_CHECKING:
    from remat.client.plan import Plan

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
FIT_MARGIN = 0.05
"""Share of the device's total memory ``fit`` leaves free: the caching allocator's rounding and
fragmentation (0–3% above the requested bytes on the H100, docs/cost-model.md) and the CUDA context."""
FIT_OFF_CUDA = "fit needs a CUDA device (use --device cuda), or give bytes or a percentage"
"""Why ``fit`` has no meaning on the CPU, where memory is no fixed pool a plan must fit."""
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*|%)\s*$")


class BudgetError(PlanError):
    """A budget that is malformed or cannot be resolved here; the message names ``budget``. A PlanError: a
    bad argument, like every other one of ``checkpoint()``."""


LINEAR_PEAK = "the linear plan's"
"""Whose a chain frontier's least peak is: ``linear`` finds the least peak of any chain plan."""


class BudgetInfeasibleError(BudgetError):
    """No plan's predicted peak fits the budget; carries the smallest feasible peak (a BudgetError: the
    input cannot be met, exit 2 on the CLI)."""

    def __init__(self, budget_bytes: int, min_peak_bytes: int, whose: str = LINEAR_PEAK) -> None:
        self.budget_bytes = budget_bytes
        self.min_peak_bytes = min_peak_bytes
        super().__init__(f"budget: {budget_bytes} bytes is below the smallest feasible peak, {min_peak_bytes} "
                         f"bytes ({min_peak_bytes / 2**20:.2f} MiB, {whose}); raise the budget or "
                         f"shrink the batch")


def whose_peak(plan: Plan) -> str:
    """Words for the plan holding a frontier's least peak: the ``linear`` plan's, unless a nested or graph plan
    reaches below every chain plan (NOTE [ budgets below the chains ] in remat.client.planning.plans)."""
    kind = plan.runs_as[0]
    return {"graph": "a graph plan's, recomputing inside stages", "nested": "a nested plan's"}.get(kind, LINEAR_PEAK)


@dataclass(frozen=True, slots=True)
class BudgetSpec:
    """A parsed budget: exactly one of bytes, a fraction of the no-checkpoint peak, or ``fit``."""

    text: str
    bytes: int | None = None
    fraction: float | None = None
    fit: bool = False

    def check_device(self, device: str) -> None:
        """Refuse ``fit`` off CUDA before anything is spent on the request: its room is a CUDA device's memory,
        and the commands that resolve it only after profiling (``plan --budget``, ``max-batch --memory``) used to
        profile and measure a model for minutes, then say so."""
        if self.fit and device != "cuda":
            raise BudgetError(f"budget: {FIT_OFF_CUDA}")

    def resolve(self, *, baseline_peak_bytes: int, fit_bytes: int | None = None) -> int:
        """The budget in bytes, given the plan's no-checkpoint peak and (for ``fit``) the device's room."""
        if self.bytes is not None:
            return self.bytes
        if self.fraction is not None:
            return max(1, int(baseline_peak_bytes * self.fraction))
        if fit_bytes is None:
            raise BudgetError(f"budget: {FIT_OFF_CUDA}")
        if fit_bytes <= 0:
            raise BudgetError("budget: fit leaves no room for activations on this device: the static memory "
                              "(weights, gradients, optimizer state, batch) already fills it")
        return fit_bytes


def parse_budget(text: str) -> BudgetSpec:
    """Parse ``6GiB``, ``6 GB``, ``123456``, ``70%`` or ``fit``; a bad one is a one-line BudgetError.

    Example:
        >>> parse_budget("1.5GiB").bytes
        1610612736
        >>> parse_budget("70%").fraction
        0.7
    """
    raw = text.strip()
    if raw.lower() == "fit":
        return BudgetSpec(text=raw, fit=True)
    match = _PATTERN.match(raw)
    if not match:
        raise BudgetError(f"budget: {text!r} is not a size; write bytes (6442450944), a size (6GiB, 6GB, 512MiB), "
                          f"a share of the no-checkpoint peak (70%) or fit")
    number, unit = float(match.group(1)), match.group(2).upper()
    if unit == "%":
        if not 0 < number <= 100:
            raise BudgetError(f"budget: {text!r} must be a percentage in (0, 100]")
        return BudgetSpec(text=raw, fraction=number / 100)
    if unit not in UNITS:
        raise BudgetError(f"budget: unit {match.group(2)!r} in {text!r} is unknown; use B, KB, MB, GB, TB, KiB, MiB, "
                          f"GiB or TiB")
    value = int(number * UNITS[unit])
    if value < 1:
        raise BudgetError(f"budget: {text!r} is less than one byte")
    return BudgetSpec(text=raw, bytes=value)


T = TypeVar("T")


def pick_for_budget(frontier: Sequence[T], budget_bytes: int, peak: Callable[[T], int],
                    plan: Callable[[T], Plan] | None = None) -> T:
    """The frontier point a budget gets: the one with the largest peak that fits, which on a frontier (peaks
    ascending, recompute falling) is the fastest plan that fits. ``peak`` reads a point's peak, so planner
    points, plans, report rows and stored records are picked by this one rule; ``plan`` reads its Plan, for
    the error to say whose the least peak is (the ``linear`` plan's without it: a chain frontier's).

    Raises:
        ValueError: the frontier is empty.
        BudgetInfeasibleError: the budget is below the smallest peak on the frontier.
    """
    if not frontier:
        raise ValueError("pick_for_budget: the frontier is empty")
    fitting = [p for p in frontier if peak(p) <= budget_bytes]
    if not fitting:
        whose = whose_peak(plan(frontier[0])) if plan is not None else LINEAR_PEAK
        raise BudgetInfeasibleError(budget_bytes, peak(frontier[0]), whose)
    return fitting[-1]


def pick_from_frontier(frontier: Sequence[Plan], budget: BudgetSpec) -> Plan:
    """The frontier plan answering ``budget`` (a share resolves against the no-checkpoint peak).

    Raises:
        BudgetInfeasibleError: no plan fits; it names the smallest peak.
    """
    ordered = sorted(frontier, key=lambda p: p.predicted_peak_bytes)
    budget_bytes = budget.resolve(baseline_peak_bytes=ordered[-1].baseline_peak_bytes)
    return pick_for_budget(ordered, budget_bytes, peak=lambda p: p.predicted_peak_bytes, plan=lambda p: p)


def fit_bytes(device_total_bytes: int, static_bytes: int, margin: float = FIT_MARGIN) -> int:
    """Activation room of ``fit``: total memory less the margin and the static memory."""
    return int(device_total_bytes * (1 - margin)) - static_bytes
