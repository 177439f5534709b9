"""The plan table's bound lines: forced memory over every plan, and the certified bound over one-level graph
plans where a worker certified one (``REMAT_CERTIFY_S``)."""

from __future__ import annotations

import pytest

from remat.client.cli_common import print_model_table
from remat.client.measurement import Measurement
from remat.client.plan import CERTIFIED_BOUND_KEY, CERTIFIED_BY_KEY, LOWER_BOUND_AT_KEY, LOWER_BOUND_KEY, Plan
from remat.client.report import PlanRow

MIB = 2**20


def _report(extra: dict) -> object:
    acg = Plan(algorithm="acg", checkpoints=(), predicted_peak_bytes=100 * MIB, baseline_peak_bytes=400 * MIB,
               cost_model="pytorch", num_stages=4, dropped_vertices=(1, 2), num_vertices=5, extra=extra)
    none = Plan(algorithm="none", checkpoints=(), predicted_peak_bytes=400 * MIB, baseline_peak_bytes=400 * MIB,
                cost_model="pytorch", num_stages=4)

    class Report:
        request = type("R", (), {"name": "toy", "input_shape": (1, 3), "dtype": "float32", "device": "cpu",
                                 "grads": "kept"})()
        device_name, num_stages, from_store, frontier = "cpu", 4, True, ()
        rows = [PlanRow.from_measurement(p, Measurement(algorithm=p.algorithm,
                                                        measured_peak_bytes=p.predicted_peak_bytes))
                for p in (none, acg)]

        def row(self, name: str) -> PlanRow | None:
            return next((r for r in self.rows if r.plan.algorithm == name), None)

    return Report()


def test_a_certified_bound_is_printed_beside_forced_memory(capsys: pytest.CaptureFixture[str]) -> None:
    forced = {LOWER_BOUND_KEY: 40 * MIB, LOWER_BOUND_AT_KEY: "backward of AddmmBackward0 #3 (fc)"}
    print_model_table(_report({**forced, CERTIFIED_BOUND_KEY: 75 * MIB,
                               CERTIFIED_BY_KEY: "relaxed step, HiGHS MILP, solved"}))
    out = " ".join(capsys.readouterr().out.split())
    assert "No plan of this step can peak below 40.0 MiB" in out and "60% below acg's" in out
    assert "No one-level graph plan can peak below 75.0 MiB (relaxed step, HiGHS MILP, solved)" in out
    assert "none is more than 25% below acg's" in out
    print_model_table(_report(forced))
    assert "one-level" not in capsys.readouterr().out
