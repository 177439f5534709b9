"""`remat-client zoo`: model selection, one summary row per model from either path, resume from the store,
failures kept with their reason, Ctrl-C that leaves finished results stored."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from remat.client.errors import ModelError, UnknownModelError
from remat.client.plan import Plan
from remat.client.report import ModelReport, PlanRow
from remat.client.request import ModelRequest
from remat.client.zoo_batch import ZooRow, select_models
from remat.worker import local
from tests.utils.cli import run_cli

MIB = 1024 * 1024
SMALL = ["--batch-size", "2", "--input-shape", "3,32,32"]


@pytest.fixture
def store_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"sqlite:///{tmp_path / 'plans.sqlite'}"
    monkeypatch.setenv("REMAT_DATABASE_URL", url)
    return url


def test_filters_select_classifiers_in_registry_order() -> None:
    everything = select_models("torchvision")
    assert len(everything) >= 78 and "resnet50" in everything and "fasterrcnn_resnet50_fpn" not in everything
    assert select_models("torchvision", "resnet*") == ["resnet101", "resnet152", "resnet18", "resnet34", "resnet50"]
    assert select_models("torchvision", "vgg11, googlenet") == ["googlenet", "vgg11"]
    with pytest.raises(UnknownModelError, match="filter: 'resnet9\\*' matches none of the"):
        select_models("torchvision", "resnet9*")
    with pytest.raises(UnknownModelError, match="zoo: unknown zoo 'timm'"):
        select_models("timm")


def _report(name: str, *, from_store: bool = False, linear_ms: float = 25.0, spread_ms: float = 0.0,
            others: dict[str, int] | None = None) -> ModelReport:
    """``none`` at 80 MiB and ``linear`` at 32 MiB measured; ``others``: more planners' measured peaks."""
    request = ModelRequest(spec=name, batch_size=2, sample_shape=(3, 32, 32))

    def row(algorithm: str, predicted: int, measured: int, ms: float) -> PlanRow:
        plan = Plan(algorithm=algorithm, cost_model="pytorch", checkpoints=(2,) if algorithm == "linear" else (),
                    predicted_peak_bytes=predicted, baseline_peak_bytes=80 * MIB, num_stages=9)
        return PlanRow(plan=plan, measured_peak_bytes=measured, step_ms=ms, step_spread_ms=spread_ms,
                       grad_check_passed=True)

    rows = [row("none", 80 * MIB, 80 * MIB, 20.0), row("linear", 30 * MIB, 32 * MIB, linear_ms)]
    rows += [row(algorithm, peak, peak, 30.0) for algorithm, peak in (others or {}).items()]
    return ModelReport(request=request, key={}, num_stages=9, from_store=from_store, rows=rows)


def test_a_report_becomes_one_row_and_survives_json() -> None:
    row = ZooRow.from_report(_report("resnet18"))
    assert row.status == "planned" and row.model == "torchvision:resnet18" and row.input_shape == (2, 3, 32, 32)
    assert row.saving == pytest.approx(0.6) and row.overhead == pytest.approx(0.25)
    assert row.prediction_error == pytest.approx(-2 / 32) and row.grad_check_passed is True
    assert ZooRow.from_dict(json.loads(json.dumps(row.to_dict()))) == row
    assert ZooRow.from_report(_report("resnet18", from_store=True)).status == "stored"
    failed = ZooRow.failed("torchvision:x", "line one\nline two")
    assert failed.reason == "line one line two" and failed.saving is None


def test_the_least_peak_is_any_planners_and_linears_on_a_tie(capsys: pytest.CaptureFixture[str]) -> None:
    """A model whose graph plan keeps far less than every chain plan (CrossViT: 14.8 against 81.2 MiB) shows it
    in its row, not only linear's saving; where nothing beats linear, linear is the least."""
    from remat.client import zoo_command

    below = ZooRow.from_report(_report("resnet18", others={"nested": 40 * MIB, "acg": 16 * MIB}))
    assert (below.least_algorithm, below.least_peak_bytes) == ("acg", 16 * MIB)
    assert below.least_saving == pytest.approx(0.8) and below.saving == pytest.approx(0.6)
    assert ZooRow.from_dict(json.loads(json.dumps(below.to_dict()))) == below
    tie = ZooRow.from_report(_report("resnet34", others={"cubic": 32 * MIB, "uniform": 50 * MIB}))
    assert (tie.least_algorithm, tie.least_peak_bytes) == ("linear", 32 * MIB)
    assert zoo_command._line(below).endswith("), least with acg: 16.0 MiB (80.0% saved)")
    assert "least" not in zoo_command._line(tie)
    assert "acg" not in zoo_command._line(tie)
    zoo_command._print_table([below, tie], "zoo")
    table = capsys.readouterr().out
    assert "acg 16.0 MiB (80.0%)" in table and "linear 32.0 MiB (60.0%)" in table


def test_a_checkpointed_step_faster_than_none_within_the_spread_reads_within_noise(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A table may not show a checkpointed plan faster than none by less than the steps' spread (issue 29)."""
    from remat.client import zoo_command

    noisy = ZooRow.from_report(_report("resnet18", linear_ms=18.0, spread_ms=3.0))
    clear = ZooRow.from_report(_report("resnet34", linear_ms=25.0, spread_ms=3.0))
    assert noisy.overhead_within_noise and noisy.overhead == pytest.approx(-0.1)
    assert not clear.overhead_within_noise
    assert ZooRow.from_dict(json.loads(json.dumps(noisy.to_dict()))) == noisy
    assert "step within noise" in zoo_command._line(noisy) and "step +25%" in zoo_command._line(clear)
    zoo_command._print_table([noisy, clear], "zoo")
    table = capsys.readouterr().out
    assert "within noise" in table and "-10%" not in table and "+25%" in table


def test_embedded_run_keeps_going_past_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    stored = {"torchvision:resnet18"}
    monkeypatch.setattr(local, "cached_report",
                        lambda req: _report(req.spec, from_store=True) if req.name in stored else None)

    def profile(req: ModelRequest, progress: object = None, *, refresh: bool = False) -> ModelReport:
        if req.name == "torchvision:vgg11":
            raise ModelError("vgg11 cannot be cut: a reason")
        if req.name == "torchvision:alexnet":
            raise ValueError("a bug\nwith a traceback")
        return _report(req.spec)

    monkeypatch.setattr(local, "profile_and_plan", profile)
    seen: list[str] = []
    requests = [ModelRequest(spec=n, batch_size=2, sample_shape=(3, 32, 32))
                for n in ("resnet18", "vgg11", "alexnet", "resnet34")]
    rows = local.plan_zoo(requests, on_row=lambda r: seen.append(r.model))
    assert [r.status for r in rows] == ["stored", "failed", "failed", "planned"]
    assert rows[1].reason == "vgg11 cannot be cut: a reason"
    assert rows[2].reason == "internal error (ValueError: a bug)"
    assert seen == [r.model for r in rows]
    assert [r.status for r in local.plan_zoo(requests[:1], refresh=True)] == ["planned"]  # refresh ignores the store


def test_zoo_cli_plans_stores_resumes_and_refreshes(capsys, store_url: str, tmp_path: Path) -> None:
    out_csv = tmp_path / "zoo.csv"
    code, out, err = run_cli(capsys, "zoo", "torchvision", "--filter", "squeezenet1_1", *SMALL, "--grads", "kept",
                             "--json", "--csv", str(out_csv))
    assert code == 0, err
    result = json.loads(out)
    (row,) = result["rows"]
    assert result["total"] == 1 and row["model"] == "torchvision:squeezenet1_1" and row["status"] == "planned"
    assert row["input_shape"] == [2, 3, 32, 32] and row["num_stages"] > 10 and row["grad_check_passed"] is True
    assert 0 < row["linear_peak_bytes"] < row["none_peak_bytes"]  # grads kept: activations dominate
    assert 0 < row["least_peak_bytes"] <= row["linear_peak_bytes"] and row["least_algorithm"]
    assert abs(row["prediction_error"]) < 0.005
    assert "✓ squeezenet1_1: " in err
    with out_csv.open() as f:
        (written,) = list(csv.DictReader(f))
    assert written["model"] == "torchvision:squeezenet1_1" and written["input_shape"] == "2x3x32x32"
    assert int(written["none_peak_bytes"]) == row["none_peak_bytes"]

    code, out, err = run_cli(capsys, "zoo", "torchvision", "--filter", "squeezenet1_1", *SMALL, "--grads", "kept",
                             "--json")
    again = json.loads(out)["rows"][0]
    assert code == 0 and again["status"] == "stored" and again["none_peak_bytes"] == row["none_peak_bytes"]
    code, out, _ = run_cli(capsys, "zoo", "torchvision", "--filter", "squeezenet1_1", *SMALL, "--grads", "kept")
    assert code == 0 and "squeezenet1_1" in out and "stored" in out  # the human table


def test_zoo_cli_failures_exit_1_and_ctrl_c_says_how_to_resume(capsys, store_url: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "cached_report", lambda req: None)

    def fails(req: ModelRequest, progress: object = None, **_: object) -> ModelReport:
        if req.name == "torchvision:resnet18":
            return _report(req.spec)
        raise ModelError(f"{req.name.removeprefix('torchvision:')} refused: why")

    monkeypatch.setattr(local, "profile_and_plan", fails)
    code, out, err = run_cli(capsys, "zoo", "torchvision", "--filter", "resnet18,resnet34", *SMALL)
    assert code == 1
    assert "resnet34 refused: why" in out and "1 of 2 models failed: resnet34" in err

    def interrupted(req: ModelRequest, progress: object = None, **_: object) -> ModelReport:
        if req.name == "torchvision:resnet18":
            return _report(req.spec)
        raise KeyboardInterrupt

    monkeypatch.setattr(local, "profile_and_plan", interrupted)
    code, out, err = run_cli(capsys, "zoo", "torchvision", "--filter", "resnet18,resnet34", *SMALL)
    assert code == 130
    assert "interrupted after 1 of 2 models" in err and "run the same command again" in err
    assert "resnet18" in out  # the finished model's row is shown


@pytest.mark.parametrize("args, message", [
    (["zoo", "timm"], "Invalid value for '{torchvision|hf}'"),
    (["zoo", "torchvision", "--filter", "nothing*"], "filter: 'nothing*' matches none"),
    (["zoo", "torchvision", "--filter", "resnet18", "--input-shape", "3,x"], "--input-shape: '3,x' is not"),
    (["zoo", "torchvision", "--filter", "resnet18", "--server", "http://127.0.0.1:9"], "set REMAT_API_TOKEN"),
])
def test_zoo_cli_bad_input_is_one_line_exit_2(capsys, store_url: str, monkeypatch: pytest.MonkeyPatch,
                                              args: list[str], message: str) -> None:
    monkeypatch.delenv("REMAT_API_TOKEN", raising=False)
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("args, token, message", [
    (["--queue", "cuda"], "t", "--server URL (or REMAT_SERVER) is needed"),
    (["--server", "ftp://127.0.0.1"], "t", "server URL 'ftp://127.0.0.1': expected http://HOST"),
    (["--server", "http://127.0.0.1:9"], None, "set REMAT_API_TOKEN"),
])
def test_zoo_jobs_that_cannot_be_sent_are_refused_before_the_zoo_is_read(
        capsys, store_url: str, monkeypatch: pytest.MonkeyPatch, args: list[str], token: str | None,
        message: str) -> None:
    """Reading the zoo's names imports torchvision (seconds): a missing server or token is named before it."""
    import remat.client.zoo_batch as zoo_batch

    def must_not_run(*_: object) -> list[str]:
        raise AssertionError("the zoo was read before the service's settings were checked")

    monkeypatch.setattr(zoo_batch, "select_zoo_models", must_not_run)
    if token is None:
        monkeypatch.delenv("REMAT_API_TOKEN", raising=False)
    else:
        monkeypatch.setenv("REMAT_API_TOKEN", token)
    code, out, err = run_cli(capsys, "zoo", "torchvision", *args)
    assert code == 2 and message in err and err.count("\n") == 1 and out == "", err
