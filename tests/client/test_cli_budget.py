"""``--budget``: sizes as users write them, the fastest plan that fits, measured, and one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remat.client.budget_spec import BudgetError, fit_bytes, parse_budget
from remat.client.planning.cost_models import pytorch_peak
from remat.client.planning.planners.budget import pareto_frontier
from remat.client.planning.recompute_time import recompute_cost
from remat.client.trace import load_trace
from tests.utils.cli import run_cli

SMALL = ["resnet18", "--batch-size", "2", "--input-shape", "3,32,32", "--grads", "kept"]
TOY = Path(__file__).resolve().parents[2] / "examples" / "toy-trace.json"


@pytest.mark.parametrize(("text", "expected"), [
    ("6442450944", 6 * 2**30), ("6GiB", 6 * 2**30), ("6 GB", 6 * 10**9), ("512MiB", 512 * 2**20),
    ("512mb", 512 * 10**6), ("1.5GiB", 3 * 2**29), ("64KiB", 65536), ("7B", 7), ("2TiB", 2 * 2**40),
])
def test_sizes_in_every_unit(text: str, expected: int) -> None:
    assert parse_budget(text).bytes == expected


def test_a_percentage_is_of_the_no_checkpoint_peak_and_fit_needs_cuda() -> None:
    assert parse_budget("70%").resolve(baseline_peak_bytes=1000) == 700
    assert parse_budget("100%").resolve(baseline_peak_bytes=1000) == 1000
    with pytest.raises(BudgetError, match="fit needs a CUDA device"):
        parse_budget("fit").resolve(baseline_peak_bytes=1000)
    assert parse_budget("FIT").resolve(baseline_peak_bytes=1, fit_bytes=5000) == 5000
    assert fit_bytes(100 * 2**30, 10 * 2**30) == int(95 * 2**30) - 10 * 2**30
    with pytest.raises(BudgetError, match="no room for activations"):
        parse_budget("fit").resolve(baseline_peak_bytes=1, fit_bytes=-5)


@pytest.mark.parametrize(("text", "message"), [
    ("abc", "is not a size"), ("", "is not a size"), ("-5GiB", "is not a size"), ("0%", "percentage in"),
    ("150%", "percentage in"), ("3XB", "unit 'XB'"), ("0.2", "less than one byte"), ("5 % %", "is not a size"),
])
def test_malformed_budgets_are_named(text: str, message: str) -> None:
    with pytest.raises(BudgetError, match=message):
        parse_budget(text)


def test_plan_trace_with_a_budget_is_the_cheapest_frontier_point_that_fits(capsys) -> None:
    trace = load_trace(TOY)
    frontier = pareto_frontier(trace)
    target = frontier[len(frontier) // 2]
    code, out, err = run_cli(capsys, "plan", "--trace", str(TOY), "--budget", str(target.peak_bytes + 1), "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["algorithm"] == "budget" and plan["budget_bytes"] == plan["predicted_peak_bytes"] == target.peak_bytes
    assert pytorch_peak(trace, plan["checkpoints"]) <= target.peak_bytes + 1
    assert recompute_cost(trace, plan["checkpoints"]) == target.recompute_cost


@pytest.mark.parametrize(("budget", "message"), [
    ("1", "--budget: 1 bytes is below the smallest feasible peak"),
    ("9QB", "--budget: unit 'QB'"),
    ("fit", "--budget: fit needs a CUDA device"),
])
def test_refusals_are_one_line_and_exit_2(capsys, budget: str, message: str) -> None:
    code, out, err = run_cli(capsys, "plan", "--trace", str(TOY), "--budget", budget)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("where", [[], ["--server", "http://127.0.0.1:9"]])
def test_fit_on_the_cpu_is_refused_before_the_model_is_profiled(capsys, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               where: list[str]) -> None:
    """``fit`` is a CUDA device's room: the refusal comes first, not after minutes of profiling, and with
    ``--server`` before the service is asked (nothing listens there: a request would exit 1, not 2)."""
    from tests.service.factories import TOKEN

    monkeypatch.setenv("REMAT_DATABASE_URL", f"sqlite:///{tmp_path / 'plans.sqlite'}")
    monkeypatch.setenv("REMAT_API_TOKEN", TOKEN)
    code, out, err = run_cli(capsys, "plan", "resnet18", "--batch-size", "2", "--input-shape", "3,16,16",
                             "--budget", "fit", *where)
    assert code == 2 and out == "", err
    assert err.startswith("remat-client: error: --budget: fit needs a CUDA device") and err.count("\n") == 1
    code, _, err = run_cli(capsys, "show", "resnet18", "--batch-size", "2", "--input-shape", "3,16,16")
    assert code == 1, "a profile was stored: the model was profiled before the refusal"


def test_budget_with_algorithm_is_refused(capsys) -> None:
    code, _, err = run_cli(capsys, "plan", "--trace", str(TOY), "--budget", "50%", "--algorithm", "cubic")
    assert code == 2 and "drop --algorithm" in err


def test_plan_model_with_a_budget_is_measured_within_it_and_stored(capsys, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REMAT_DATABASE_URL", f"sqlite:///{tmp_path / 'plans.sqlite'}")
    code, out, err = run_cli(capsys, "plan", *SMALL, "--json")
    assert code == 0, err
    full = {p["algorithm"]: p["predicted_peak_bytes"] for p in json.loads(out)["plans"]}
    budget_bytes = (full["none"] + full["linear"]) // 2  # between the two: the budget plan is neither
    code, out, err = run_cli(capsys, "plan", *SMALL, "--budget", str(budget_bytes), "--json")
    assert code == 0, err
    report = json.loads(out)
    rows = {p["algorithm"]: p for p in report["plans"]}
    assert list(rows) == ["none", "linear", "budget"]
    chosen = rows["budget"]
    assert chosen["budget_bytes"] == chosen["predicted_peak_bytes"] <= budget_bytes  # stored under its own peak
    frontier = json.loads(run_cli(capsys, "plan", *SMALL, "--json")[1])["frontier"]
    fitting = [p for p in frontier if p["predicted_peak_bytes"] <= budget_bytes]
    assert chosen["checkpoints"] == fitting[-1]["checkpoints"]
    # A graph plan below the chains has no recompute estimate: it counts as the slowest (NOTE [ budgets below
    # the chains ]), and ResNet-18's searched graph plan is one here.
    assert chosen["recompute_ms"] == min(p["recompute_ms"] for p in fitting if p["recompute_ms"] is not None)
    # Judged by a real step: the measured peak fits too (CPU predictions are exact to 0.5%).
    assert chosen["measured_peak_bytes"] == pytest.approx(chosen["predicted_peak_bytes"], rel=0.005)
    assert chosen["measured_peak_bytes"] <= rows["none"]["measured_peak_bytes"]
    assert chosen["recompute_ms"] <= rows["linear"]["recompute_ms"]

    code, out, err = run_cli(capsys, "plan", *SMALL, "--budget", str(budget_bytes), "--json")  # from the store
    assert code == 0, err
    again = {p["algorithm"]: p for p in json.loads(out)["plans"]}
    assert again["budget"]["checkpoints"] == chosen["checkpoints"]
    assert again["budget"]["measured_peak_bytes"] == chosen["measured_peak_bytes"]
    # The budget row does not spoil the stored full report: plain `plan` still answers from the store.
    code, out, _ = run_cli(capsys, "plan", *SMALL, "--json")
    assert code == 0 and json.loads(out)["from_store"] is True


def test_a_budget_below_every_chain_plan_gets_the_graph_plan_measured(capsys, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """No chain plan of DARTS-like cells fits half of none's peak; acg's graph plan does, and answers it (NOTE
    [ budgets below the chains ] in remat.client.planning.plans). Before, exit 2: "below the smallest feasible
    peak ... the linear plan's"."""
    monkeypatch.setenv("REMAT_DATABASE_URL", f"sqlite:///{tmp_path / 'plans.sqlite'}")
    nas = ["tests.utils.nas_cell:nas_net", "--model-kwargs", '{"cells": 2}', "--batch-size", "2",
           "--input-shape", "3,16,16", "--grads", "kept"]
    code, out, err = run_cli(capsys, "plan", *nas, "--budget", "50%", "--json")
    assert code == 0, err
    rows = {p["algorithm"]: p for p in json.loads(out)["plans"]}
    chosen, none = rows["budget"], rows["none"]
    assert chosen["dropped_vertices"] and chosen["checkpoints"] == [] and chosen["planned_by"] == "acg"
    assert chosen["measured_peak_bytes"] <= none["measured_peak_bytes"] // 2
    assert chosen["measured_peak_bytes"] == pytest.approx(chosen["predicted_peak_bytes"], rel=0.005)
    assert rows["linear"]["predicted_peak_bytes"] > none["predicted_peak_bytes"] // 2  # no chain plan fits
    code, out, err = run_cli(capsys, "plan", *nas, "--budget", "50%")  # from the store: the table says whose
    assert code == 0 and "│ budget (acg) │ graph: recomputes" in out, out
    code, _, err = run_cli(capsys, "plan", *nas, "--budget", str(chosen["predicted_peak_bytes"] - 1))
    assert code == 2
    assert err.strip().endswith(f"smallest feasible peak, {chosen['predicted_peak_bytes']} bytes "
                                f"({chosen['predicted_peak_bytes'] / 2**20:.2f} MiB, a graph plan's, recomputing "
                                f"inside stages); raise the budget or shrink the batch")


def test_plan_model_with_a_budget_from_the_service(capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Profiled here and uploaded once; the service picks the budget's plan from the frontier it stored."""
    from tests.service.factories import TOKEN
    from tests.utils.live_service import live_service

    monkeypatch.setenv("REMAT_DATABASE_URL", f"sqlite:///{tmp_path / 'local.sqlite'}")
    with live_service(tmp_path) as url:
        monkeypatch.setenv("REMAT_API_TOKEN", TOKEN)
        code, out, err = run_cli(capsys, "plan", *SMALL, "--server", url, "--budget", "95%", "--json")
        assert code == 0, err
        rows = {p["algorithm"]: p for p in json.loads(out)["plans"]}
        assert list(rows) == ["none", "linear", "budget"]
        budget_bytes = int(rows["none"]["predicted_peak_bytes"] * 0.95)
        assert rows["budget"]["predicted_peak_bytes"] <= budget_bytes
        assert rows["budget"]["recompute_ms"] <= rows["linear"]["recompute_ms"]
        monkeypatch.delenv("REMAT_API_TOKEN")
        code, _, err = run_cli(capsys, "plan", *SMALL, "--server", url, "--budget", "1")  # served, not planned
        assert code == 2 and "--budget: 1 bytes is below the smallest feasible peak" in err
