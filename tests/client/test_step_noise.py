"""Step times within noise: a plan is never shown faster (or slower) than ``none`` by less than the spread its
timed rounds measured (remat.client.measurement, remat.client.report, the CLI table)."""

from __future__ import annotations

import pytest

from remat.client.cli_common import print_model_table
from remat.client.measurement import Measurement
from remat.client.plan import Plan
from remat.client.report import PlanRow, Trade


def _plan(algorithm: str, checkpoints: tuple[int, ...] = ()) -> Plan:
    return Plan(algorithm=algorithm, checkpoints=checkpoints, predicted_peak_bytes=100, baseline_peak_bytes=200,
                cost_model="pytorch", num_stages=4)


def _row(algorithm: str, step: float, spread: float | None) -> PlanRow:
    m = Measurement(algorithm=algorithm, measured_peak_bytes=100, step_ms=step, step_spread_ms=spread)
    return PlanRow.from_measurement(_plan(algorithm, (2,) if algorithm != "none" else ()), m)


@pytest.mark.parametrize(("step", "spread", "within"), [
    (95.0, 6.0, True),    # 5 ms faster, spread 6: not told apart
    (95.0, 4.0, False),   # faster beyond the spread: shown as it was measured
    (112.0, 13.0, True),
    (112.0, None, False),  # timed once: no spread, the percentage
])
def test_a_difference_within_the_spread_is_within_noise(step: float, spread: float | None, within: bool) -> None:
    base = _row("none", 100.0, 1.0)
    trade = Trade.of(base, _row("linear", step, spread))
    assert trade.within_noise is within
    assert trade.overhead == pytest.approx(step / 100.0 - 1)
    assert Trade.of(base, base).within_noise is False
    m = Measurement(step_ms=step, baseline_step_ms=100.0, step_spread_ms=spread, baseline_step_spread_ms=1.0)
    assert m.within_noise is within


def test_the_table_says_within_noise_instead_of_a_faster_plan(capsys: pytest.CaptureFixture[str]) -> None:
    class Report:
        request = type("R", (), {"name": "toy", "input_shape": (1, 3), "dtype": "float32", "device": "cpu",
                                 "grads": "none"})()
        device_name, num_stages, from_store, frontier = "cpu", 4, True, ()
        rows = [_row("none", 100.0, 8.0), _row("linear", 96.0, 2.0), _row("checkmate", 130.0, 2.0)]

        def row(self, name: str) -> PlanRow | None:
            return next((r for r in self.rows if r.plan.algorithm == name), None)

    print_model_table(Report())
    out = capsys.readouterr().out
    linear = next(line for line in out.splitlines() if "linear" in line)
    assert "within noise" in linear and "-4%" not in linear
    assert "+30%" in next(line for line in out.splitlines() if "checkmate" in line)


def test_a_plan_that_is_nones_step_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """A chain plan keeping every boundary is ``none``'s step, measured as one with it (NOTE [ one step, one
    measurement ]): the table names it, neither an overhead nor noise. Only where the times are that one
    measurement: the same checkpoints measured apart (an older store) keep the comparison."""
    same = PlanRow.from_measurement(_plan("linear"), Measurement(algorithm="linear", measured_peak_bytes=100,
                                                                 step_ms=100.0, step_spread_ms=8.0))
    apart = PlanRow.from_measurement(_plan("chen-greedy"), Measurement(algorithm="chen-greedy",
                                                                       measured_peak_bytes=100, step_ms=131.0,
                                                                       step_spread_ms=1.0))

    class Report:
        request = type("R", (), {"name": "toy", "input_shape": (1, 3), "dtype": "float32", "device": "cpu",
                                 "grads": "none"})()
        device_name, num_stages, from_store, frontier = "cpu", 4, True, ()
        rows = [_row("none", 100.0, 8.0), same, apart]

        def row(self, name: str) -> PlanRow | None:
            return next((r for r in self.rows if r.plan.algorithm == name), None)

    print_model_table(Report())
    lines = capsys.readouterr().out.splitlines()
    assert "100 ms (none's step)" in next(line for line in lines if "linear" in line)
    assert "131 ms (+31%)" in next(line for line in lines if "chen-greedy" in line)


def _frontier_report(peaks: list[int]) -> object:
    def point(peak: int) -> PlanRow:
        plan = Plan(algorithm="budget", checkpoints=(2,), predicted_peak_bytes=peak, baseline_peak_bytes=200,
                    cost_model="pytorch", num_stages=4, budget_bytes=peak)
        return PlanRow.from_measurement(plan, Measurement(algorithm="budget", measured_peak_bytes=peak))

    class Report:
        request = type("R", (), {"name": "toy", "input_shape": (1, 3), "dtype": "float32", "device": "cpu",
                                 "grads": "none"})()
        device_name, num_stages, from_store = "cpu", 4, True
        rows = [_row("none", 100.0, 1.0)]
        frontier = [point(p) for p in peaks]

        def row(self, name: str) -> PlanRow | None:
            return next((r for r in self.rows if r.plan.algorithm == name), None)

    return Report()


def test_the_frontier_line_counts_its_plans(capsys: pytest.CaptureFixture[str]) -> None:
    print_model_table(_frontier_report([3 << 20]))
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("Time-memory frontier"))
    assert line == ("Time-memory frontier: one plan, 3.0 MiB (measured); no plan trades step time for memory here.")
    print_model_table(_frontier_report([1 << 20, 2 << 20, 3 << 20]))
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("Time-memory frontier"))
    assert line.startswith("Time-memory frontier: 3 plans from 1.0 MiB to 3.0 MiB (3 measured)")
