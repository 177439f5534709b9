"""remat-client on zoo models: profile-plan-measure-store, answers from the store, trace and measure."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from remat.client.planning.planners import PLANNERS
from remat.client.trace import load_trace
from tests.utils.cli import run_cli, run_cli_with_store

SMALL = ["resnet18", "--batch-size", "2", "--input-shape", "3,32,32"]


@pytest.fixture
def store_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"sqlite:///{tmp_path / 'plans.sqlite'}"
    monkeypatch.setenv("REMAT_DATABASE_URL", url)
    return url


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """A store that ``plan SMALL`` filled (a profile, every plan measured: the module's one such run), and the
    report that run printed."""
    url = f"sqlite:///{tmp_path_factory.mktemp('planned') / 'plans.sqlite'}"
    code, out = run_cli_with_store(url, "plan", *SMALL, "--json")
    assert code == 0
    return url, json.loads(out)


@pytest.fixture
def planned_store(planned: tuple[str, dict], monkeypatch: pytest.MonkeyPatch) -> str:
    """The planned store, as this test's ``REMAT_DATABASE_URL``."""
    monkeypatch.setenv("REMAT_DATABASE_URL", planned[0])
    return planned[0]


def test_plan_model_profiles_measures_stores_then_answers_from_store(capsys, planned: tuple[str, dict],
                                                                   planned_store: str) -> None:
    first = planned[1]
    assert first["from_store"] is False
    assert [p["algorithm"] for p in first["plans"]] == list(PLANNERS)
    assert first["key"]["input_shape"] == [2, 3, 32, 32] and first["key"]["grads"] == "none"
    for plan in first["plans"]:
        assert plan["measured_peak_bytes"] > 0
        assert plan["cost_model"] == "pytorch"  # acg's graph plan too: the graph predictor's peak
        # Judged by the measurement: CPU predictions are exact to well under 0.5% (docs/benchmarks.md).
        assert plan["predicted_peak_bytes"] == pytest.approx(plan["measured_peak_bytes"], rel=0.005)
    assert any("dropped_vertices" in plan for plan in first["plans"]), "the trace carried no op graph"
    acg = next(p for p in first["plans"] if p["algorithm"] == "acg")
    assert 0 < acg["lower_bound_bytes"] <= min(p["measured_peak_bytes"] for p in first["plans"])

    # A second run, in a fresh interpreter, answers from the store without importing torch.
    probe = (
        "import json, sys\n"
        "from remat.client.cli import main\n"
        "try:\n"
        f"    main(['plan', *{SMALL!r}, '--json'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "print('TORCH', 'torch' in sys.modules, file=sys.stderr)\n"
    )
    env = {"REMAT_DATABASE_URL": planned_store, "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    second = json.loads(result.stdout)
    assert second["from_store"] is True

    def types(obj: object) -> object:  # a JSON value's shape: same keys, same type at every leaf
        if isinstance(obj, dict):
            return {k: types(v) for k, v in obj.items() if k != "from_store"}
        if isinstance(obj, list):
            return [types(v) for v in obj]
        return type(obj).__name__

    assert types(second) == types(first), "a stored answer prints every number with the type of a fresh one"
    assert "TORCH False" in result.stderr
    assert [p["checkpoints"] for p in second["plans"]] == [p["checkpoints"] for p in first["plans"]]
    assert [p["measured_peak_bytes"] for p in second["plans"]] == [p["measured_peak_bytes"] for p in first["plans"]]
    code, out, _ = run_cli(capsys, "plan", *SMALL)  # the table says the bound, from the store
    assert code == 0 and "No plan of this step can peak below" in out


def test_a_reported_plan_applies_to_the_model_and_refuses_another_input(capsys, planned_store: str) -> None:
    import torch
    import torchvision

    from remat.client.apply_plan import apply
    from remat.client.errors import PlanMismatchError
    from remat.client.plan import Plan

    code, out, _ = run_cli(capsys, "plan", *SMALL, "--json")
    assert code == 0
    entry = next(p for p in json.loads(out)["plans"] if p["algorithm"] == "uniform")
    plan = Plan.from_dict(entry)
    assert plan.checkpoints == (3, 6, 9)  # ceil(sqrt(14)) = 4 segments of 3 stages
    model = apply(torchvision.models.resnet18(weights=None), plan)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    other = apply(torchvision.models.resnet18(weights=None), plan)
    with pytest.raises(PlanMismatchError):
        other(torch.randn(4, 3, 32, 32))
    # Every printed plan names the torch release its trace was made with, and apply holds it to it.
    from remat.client.plan_key import current_torch_version

    assert entry["key"]["torch_version"] == current_torch_version()
    older = Plan.from_dict({**entry, "key": {**entry["key"], "torch_version": "1.13"}})
    with pytest.raises(PlanMismatchError, match=f"torch_version: plan 1.13 vs installed {current_torch_version()}"):
        apply(torchvision.models.resnet18(weights=None), older)


def test_other_gradient_convention_is_another_key(capsys, tmp_path: Path, planned: tuple[str, dict],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside the stored answer for the default convention, ``--grads kept`` is not answered from it."""
    copy = tmp_path / "plans.sqlite"
    shutil.copyfile(planned[0].removeprefix("sqlite:///"), copy)
    monkeypatch.setenv("REMAT_DATABASE_URL", f"sqlite:///{copy}")
    code, out, _ = run_cli(capsys, "plan", *SMALL, "--grads", "kept", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["from_store"] is False and report["key"]["grads"] == "kept"
    assert report["key"]["model_hash"] == planned[1]["key"]["model_hash"]
    code, out, _ = run_cli(capsys, "plan", *SMALL, "--json")
    stored = json.loads(out)
    assert code == 0 and stored["from_store"] is True and stored["key"]["grads"] == "none"


def test_human_table(capsys, planned_store: str) -> None:
    code, out, _ = run_cli(capsys, "plan", *SMALL)
    assert code == 0
    for word in ("measured peak", "predicted peak", "linear", "saving vs none", "torchvision:resnet18"):
        assert word in out


def test_trace_command_writes_a_valid_trace(capsys, tmp_path: Path) -> None:
    out_path = tmp_path / "t.json"
    code, _, err = run_cli(capsys, "trace", *SMALL, "--out", str(out_path))
    assert code == 0, err
    trace = load_trace(out_path)
    assert trace.metadata["model"] == "torchvision:resnet18"
    assert trace.metadata["input_shape"] == [2, 3, 32, 32]
    assert len(trace.metadata["model_hash"]) == 64
    assert trace.num_stages == 14


def test_autocast_precision_reaches_the_trace_and_the_measured_step(capsys) -> None:
    code, out, err = run_cli(capsys, "measure", *SMALL, "--dtype", "autocast_bfloat16", "--grads", "kept",
                             "--algorithm", "linear", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["dtype"] == "autocast_bfloat16"
    # The cast cache is in the prediction: without it bf16 autocast is far off (docs/cost-model.md).
    assert result["predicted_peak_bytes"] == pytest.approx(result["measured_peak_bytes"], rel=0.005)


def test_measure_command_prints_spreads(capsys) -> None:
    code, out, err = run_cli(capsys, "measure", *SMALL, "--algorithm", "linear")
    assert code == 0, err
    assert "step_spread_ms" in out and "baseline_step_spread_ms" in out


def test_measure_command_json(capsys) -> None:
    code, out, err = run_cli(capsys, "measure", *SMALL, "--algorithm", "linear", "--json")
    assert code == 0, err
    result = json.loads(out)
    for field in ("algorithm", "predicted_peak_bytes", "measured_peak_bytes", "baseline_measured_peak_bytes",
                  "activation_measured_bytes", "baseline_activation_measured_bytes", "step_ms",
                  "baseline_step_ms", "step_spread_ms", "baseline_step_spread_ms", "grads"):
        assert field in result
    assert result["algorithm"] == "linear" and result["grads"] == "none"
    # Timed in interleaved rounds, each with a spread: a median's distance above the least (of the baseline's steps,
    # of the plan's differences from the baseline steps beside it).
    assert result["step_spread_ms"] >= 0 and result["baseline_step_spread_ms"] >= 0
    assert result["measured_peak_bytes"] <= result["baseline_measured_peak_bytes"]


@pytest.mark.parametrize(("args", "message"), [
    (["plan", "resnet9000"], "resnet9000"),
    (["plan", "resnet18", "--input-shape", "3,x,32"], "--input-shape: '3,x,32' is not comma-separated integers"),
    (["plan", "resnet18", "--input-shape", "3,0,32"], "--input-shape: every dimension must be ≥ 1"),
    (["plan", "resnet18", "--batch-size", "0"], "--batch-size"),
    (["plan", "resnet18", "--algorithm", "cubic"], "--algorithm and --cost-model apply to --trace"),
    (["plan", "resnet18", "--trace", "t.json"], "not both"),
    (["measure", "resnet18", "--algorithm", "all"], "measure takes one planner name"),
    (["trace", "resnet18", "--grads", "sometimes"], "'sometimes' is not one of"),
    (["trace", "resnet18", "--dtype", "int8"], "'int8' is not one of"),
    # Files written after the work are checked before it: a bad one used to cost the profile (or the zoo run),
    # then exit 1 with the OSError.
    (["trace", *SMALL, "--out", "no/such/dir/t.json"], "'--out': 'no/such/dir/t.json': no directory 'no/such/dir'"),
    (["trace", *SMALL, "--out", "."], "'--out': '.' is a directory"),
    (["show", *SMALL, "--plot", "no/such/dir/p.png"], "'--plot': 'no/such/dir/p.png': no directory"),
    (["show", *SMALL, "--plot", "memory.txt"], "'--plot': 'memory.txt' must end in .png, .svg, .pdf"),
    (["zoo", "torchvision", "--filter", "resnet18", "--csv", "no/such/dir/z.csv"], "'--csv': 'no/such/dir/z.csv'"),
])
def test_bad_model_input_exits_2_with_one_line(capsys, store_url: str, args: list[str], message: str) -> None:
    code, out, err = run_cli(capsys, *args)
    assert code == 2, err
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_default_request_needs_no_torch() -> None:
    """The store lookup path fills in defaults without importing torch (regression: the zoo imported it)."""
    probe = (
        "import sys\n"
        "from remat.client.request import default_request\n"
        "r = default_request('resnet152', batch_size=None, sample_shape=None, device='cpu', grads='none')\n"
        "assert r.input_shape == (4, 3, 128, 128), r.input_shape\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert "TORCH False" in result.stdout


@pytest.mark.parametrize(("spec", "shape"), [("resnet152", (4, 3, 128, 128)), ("vit_b_16", (4, 3, 224, 224)),
                                             ("torchvision:maxvit_t", (4, 3, 224, 224))])
def test_cpu_defaults_scale_images_down_only_where_the_model_allows(spec: str, shape: tuple[int, ...]) -> None:
    from remat.client.request import default_request

    assert default_request(spec, batch_size=None, sample_shape=None, device="cpu", grads="none").input_shape == shape
