"""Budgets below every chain plan: what the frontier's tightest point is now, measured (CPU).

Before NOTE [ budgets below the chains ] (remat.client.planning.plans), a budget could only be answered by a
chain plan: anything below ``linear``'s peak was refused, even where ``nested`` or ``acg``'s graph plan peaks far
lower. For each model this script runs what ``remat-client plan MODEL`` runs (profile, every planner, the
frontier, a measured step per plan: ``remat.worker.pipeline.run``), then reports ``linear``'s peak (the least of
any chain plan), the frontier's tightest point below it (which plan it is), both measured, and whether a budget
halfway between is now answered, and by which plan.

    uv run python benchmarks/budgets_below_chains.py                # the models below, about 15 minutes on 2 cores
    uv run python benchmarks/budgets_below_chains.py --only crossvit
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

MODELS: dict[str, dict[str, Any]] = {
    "crossvit": {"spec": "timm:crossvit_tiny_240", "batch_size": 2, "sample_shape": (3, 240, 240)},
    "nas_cells": {"spec": "tests.utils.nas_cell:nas_net", "batch_size": 2, "sample_shape": (3, 16, 16)},
    "resnet18": {"spec": "resnet18", "batch_size": 2, "sample_shape": (3, 32, 32)},
    "resnet50": {"spec": "resnet50", "batch_size": 4, "sample_shape": (3, 64, 64)},
    "densenet121": {"spec": "densenet121", "batch_size": 2, "sample_shape": (3, 64, 64)},
    "vit_b_16": {"spec": "vit_b_16", "batch_size": 1, "sample_shape": (3, 64, 64),
                 "model_kwargs": {"image_size": 64}},
}


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def measure(name: str) -> dict[str, Any]:
    """One model through the pipeline, its frontier read as a user's budget would read it."""
    from remat.client.budget_spec import BudgetInfeasibleError, BudgetSpec, pick_from_frontier
    from remat.client.request import ModelRequest
    from remat.worker.pipeline import run

    config = MODELS[name]
    request = ModelRequest(spec=config["spec"], batch_size=config["batch_size"], sample_shape=config["sample_shape"],
                           grads="kept", model_kwargs=config.get("model_kwargs") or {})
    start = time.perf_counter()
    result = run(request, timing_rounds=1, check_gradients=True)
    seconds = time.perf_counter() - start
    m = result.measurements
    points = sorted((p for p in result.plans if p.budget_bytes), key=lambda p: p.predicted_peak_bytes)
    chains = [p for p in points if p.runs_as[0] == "chain"]
    below = [p for p in points if p.runs_as[0] != "chain"]
    none = next(p for p in result.plans if p.algorithm == "none")
    row: dict[str, Any] = {
        "model": name, "input": [config["batch_size"], *config["sample_shape"]], "seconds": round(seconds, 1),
        "none_measured": m["none"].measured_peak_bytes, "chain_least_predicted": chains[0].predicted_peak_bytes,
        "linear_measured": m["linear"].measured_peak_bytes,  # the chains' least peak is linear's (planners/budget.py)
        "below": [], "budget": None, "answered_by": None,
    }
    for p in below:
        measured = m.get(p.label)
        row["below"].append({"plan": p.planned_by, "predicted": p.predicted_peak_bytes,
                             "measured": measured.measured_peak_bytes if measured else None,
                             "grad_check_passed": measured.grad_check_passed if measured else None})
    if below:
        budget = (below[0].predicted_peak_bytes + chains[0].predicted_peak_bytes) // 2
        row["budget"] = budget
        try:
            chosen = pick_from_frontier(points, BudgetSpec(text=str(budget), bytes=budget))
            row["answered_by"] = chosen.planned_by  # below every chain plan: a point of a registered planner
        except BudgetInfeasibleError as exc:
            row["answered_by"] = f"refused: {exc}"
    row["none_predicted"] = none.predicted_peak_bytes
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated names among: " + ", ".join(MODELS))
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(MODELS)
    rows = []
    print("| model | input | none, measured | `linear` (the least chain plan), measured | below the chains: plan, "
          "predicted (measured) | a budget halfway between | s |")
    print("|---|---|---:|---:|---|---|---:|")
    for name in names:
        row = measure(name)
        rows.append(row)
        below = "; ".join(f"`{b['plan']}` {_mib(b['predicted'])} ({_mib(b['measured'])})" for b in row["below"]) \
            or "none: the chains reach the least"
        budget = f"{_mib(row['budget'])} MiB: `{row['answered_by']}`" if row["budget"] else "-"
        print(f"| {name} | {'×'.join(map(str, row['input']))} | {_mib(row['none_measured'])} MiB | "
              f"{_mib(row['linear_measured'])} MiB | {below} | {budget} | {row['seconds']:.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
