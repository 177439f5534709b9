"""remat-client on models that are not torchvision names: ``package.module:callable`` with --model-kwargs,
``timm:NAME``, and the one-line exit-2 errors of every way a spec can be wrong."""

from __future__ import annotations

import json
import os
import platform
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from remat.client.errors import ModelError
from remat.client.model_spec import canonical_spec, source_of
from tests.utils.cli import run_cli

BUILDERS = textwrap.dedent("""
    import torch.nn as nn

    def mlp(depth=3, width=32):
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(width, 10))

    def broken():
        raise RuntimeError("no GPU here")

    def not_a_module():
        return 42

    class Factory:
        @staticmethod
        def small():
            return mlp(depth=2)
""")


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's project directory holding ``usernets.py``, as the current directory; an empty local store."""
    (tmp_path / "usernets.py").write_text(BUILDERS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("REMAT_DATABASE_URL", f"sqlite:///{tmp_path / 'plans.sqlite'}")
    yield tmp_path
    sys.modules.pop("usernets", None)


@pytest.mark.parametrize(("spec", "canonical", "source"), [
    ("resnet18", "torchvision:resnet18", "torchvision"),
    ("torchvision:ResNet18", "torchvision:resnet18", "torchvision"),
    ("timm:convnext_tiny.fb_in1k", "timm:convnext_tiny.fb_in1k", "timm"),
    ("pkg.models:build", "pkg.models:build", "python"),
    ("usernets:Factory.small", "usernets:Factory.small", "python"),
    ("custom:UserNet", "custom:UserNet", "custom"),
])
def test_specs_have_one_spelling(spec: str, canonical: str, source: str) -> None:
    assert canonical_spec(spec) == canonical
    assert source_of(spec) == source


@pytest.mark.parametrize("spec", ["", "a b", "pkg.mod", "pkg:", ":build", "timm:", "pkg:1x", "x" * 201,
                                  "torchvision:a b", "os.path:join;rm"])
def test_malformed_specs_name_the_accepted_forms(spec: str) -> None:
    with pytest.raises(ModelError, match="is not a torchvision name .* or package.module:callable"):
        canonical_spec(spec)


def test_a_callable_with_kwargs_plans_and_its_kwargs_are_part_of_what_is_stored(capsys, project: Path) -> None:
    code, out, err = run_cli(capsys, "plan", "usernets:mlp", "--input-shape", "32", "--batch-size", "4", "--json")
    assert code == 0, err
    first = json.loads(out)
    assert first["model"] == "usernets:mlp" and first["from_store"] is False
    assert first["key"]["input_shape"] == [4, 32]

    code, out, err = run_cli(capsys, "plan", "usernets:mlp", "--input-shape", "32", "--batch-size", "4",
                             "--model-kwargs", '{"depth": 5}', "--json")
    assert code == 0, err
    deeper = json.loads(out)
    assert deeper["from_store"] is False, "other builder arguments are another architecture"
    assert deeper["key"]["model_hash"] != first["key"]["model_hash"]
    assert deeper["num_stages"] > first["num_stages"]

    code, out, err = run_cli(capsys, "plan", "usernets:mlp", "--input-shape", "32", "--batch-size", "4", "--json")
    assert code == 0, err
    again = json.loads(out)
    assert again["from_store"] is True and again["key"] == first["key"]


def test_a_nested_attribute_callable_traces(capsys, project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.client import host_memory

    monkeypatch.setattr(host_memory, "_state", None)  # as in a new process: an earlier command's call set it
    code, out, err = run_cli(capsys, "trace", "usernets:Factory.small", "--input-shape", "32", "--batch-size", "2")
    assert code == 0, err
    trace = json.loads(out)
    assert trace["model"] == "usernets:Factory.small"
    # The CLI times steps with freed memory kept (NOTE [ page faults on CPU ]), and the trace says so.
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    users = any(name in os.environ for name in host_memory.ENVIRONMENT)
    expected = "set by environment" if users else "kept" if glibc else "not glibc"
    assert trace["timing"]["host_malloc"] == expected


@pytest.mark.parametrize(("args", "message"), [
    (["usernets:mlp"], "--input-shape is needed for usernets:mlp"),
    (["usernets:nope", "--input-shape", "32"], "usernets has no attribute nope"),
    (["nosuchpkg.nets:mlp", "--input-shape", "32"], "cannot import nosuchpkg.nets"),
    (["usernets:broken", "--input-shape", "32"], "calling it with {} failed: RuntimeError: no GPU here"),
    (["usernets:not_a_module", "--input-shape", "32"], "returned int, not a torch.nn.Module"),
    (["usernets:mlp", "--input-shape", "32", "--model-kwargs", '{"deep": 1}'],
     "unexpected keyword argument 'deep'"),
    (["usernets:mlp", "--input-shape", "32", "--model-kwargs", "{depth: 1}"], "--model-kwargs: not valid JSON"),
    (["usernets:mlp", "--input-shape", "32", "--model-kwargs", '{"depth": NaN}'],
     "--model-kwargs: depth: NaN is not a number remat accepts"),
    (["usernets:mlp", "--input-shape", "32", "--model-kwargs", "[" * 100_000], "--model-kwargs: nested more than"),
    (["usernets:mlp", "--input-shape", "32", "--model-kwargs", "[1]"], "--model-kwargs: must be a JSON object"),
    (["resnet18", "--input-shape", "3,16,16", "--model-kwargs", '{"nope": 1}'],
     "model torchvision:resnet18: building it with --model-kwargs {\"nope\": 1} failed: TypeError: "),
    (["resnet18", "--input-shape", "3,16,16", "--model-kwargs", '{"num_classes": -3}'],
     "building it with --model-kwargs {\"num_classes\": -3} failed: RuntimeError: "),
    (["timm:resnet18", "--input-shape", "3,16,16", "--model-kwargs", '{"nope": 1}'],
     "model timm:resnet18: building it with --model-kwargs {\"nope\": 1} failed: TypeError: "),
    (["pkg.mod", "--input-shape", "32"], "is not a torchvision name"),
    (["custom:UserNet", "--input-shape", "32"], "remat.client.checkpoint(model, example_input) plans it there"),
])
def test_a_bad_spec_is_one_line_and_exit_2(capsys, project: Path, args: list[str], message: str) -> None:
    code, out, err = run_cli(capsys, "trace", *args)
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_submit_refuses_what_a_worker_would_have_to_import(capsys, project: Path) -> None:
    for args in (["usernets:mlp", "--input-shape", "32"],
                 ["resnet18", "--model-kwargs", '{"num_classes": 10}']):
        code, _, err = run_cli(capsys, "submit", *args, "--server", "http://127.0.0.1:9")
        assert code == 2 and "workers build torchvision models with their default arguments only" in err, err


def test_a_timm_model_traces_without_weights(capsys, project: Path) -> None:
    code, out, err = run_cli(capsys, "trace", "timm:resnet18", "--batch-size", "2", "--input-shape", "3,32,32")
    assert code == 0, err
    trace = json.loads(out)
    assert trace["model"] == "timm:resnet18" and len(trace["stages"]) > 5
    code, _, err = run_cli(capsys, "trace", "timm:no_such_net", "--batch-size", "1", "--input-shape", "3,32,32")
    assert code == 2 and "timm:no_such_net" in err, err
    code, _, err = run_cli(capsys, "trace", "timm:resnet18", "--model-kwargs", '{"pretrained": true}')
    assert code == 2 and "without pretrained weights" in err, err


def test_show_prints_what_is_stored_by_model_or_by_hash(capsys, project: Path) -> None:
    small = ["usernets:mlp", "--input-shape", "32", "--batch-size", "4"]
    code, _, err = run_cli(capsys, "show", *small)
    assert code == 1 and "has nothing for usernets:mlp at input [4, 32]" in err and "remat-client plan" in err
    code, out, err = run_cli(capsys, "plan", *small, "--json")
    assert code == 0, err
    planned = json.loads(out)

    code, out, err = run_cli(capsys, "show", *small, "--json")
    assert code == 0, err
    [shown] = json.loads(out)
    assert shown["key"] == planned["key"] and shown["from_store"] is True
    assert [(p["algorithm"], p["checkpoints"], p["measured_peak_bytes"]) for p in shown["plans"]] == \
        [(p["algorithm"], p["checkpoints"], p["measured_peak_bytes"]) for p in planned["plans"]]

    prefix = planned["key"]["model_hash"][:10]
    code, out, err = run_cli(capsys, "show", prefix, "--json")
    assert code == 0, err
    assert [r["key"] for r in json.loads(out)] == [planned["key"]]
    code, out, err = run_cli(capsys, "show", prefix)
    assert code == 0 and "usernets:mlp" in out and "linear" in out, err
    code, _, err = run_cli(capsys, "show", prefix, "--batch-size", "3")
    assert code == 2 and "apply to MODEL" in err
    code, _, err = run_cli(capsys, "show", "0123456789abcdef")
    assert code == 1 and "nothing for model_hash 0123456789abcdef" in err and "remat-client plan" not in err
    # A name that is no model is bad input naming close matches, not a hint to plan it.
    code, _, err = run_cli(capsys, "show", "resnt18", "--batch-size", "2")
    assert code == 2 and "unknown model 'resnt18'; close matches: resnet18" in err and err.count("\n") == 1, err


def test_every_command_has_help_with_an_example(capsys) -> None:
    from remat.client.cli import cli

    for name in cli.commands:
        code, out, err = run_cli(capsys, name, "--help")
        assert code == 0 and ("Example:" in out or "Examples:" in out) and "remat-client " + name in out, name


def test_show_plot_draws_the_stored_timelines(capsys, project: Path) -> None:
    small = ["usernets:mlp", "--input-shape", "32", "--batch-size", "4"]
    code, _, err = run_cli(capsys, "plan", *small)
    assert code == 0, err
    png = project / "memory.png"
    code, _, err = run_cli(capsys, "show", *small, "--plot", str(png))
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    from PIL import Image

    assert Image.open(png).size == (1560, 576)  # 13 x 4.8 inches at 120 dpi: two readable panels


SMALL_MLP = ["usernets:mlp", "--input-shape", "32", "--batch-size", "4"]


def _plan_then_change_stored_rows(capsys, monkeypatch, change: Callable[[Any], None]) -> None:
    """Plan the small MLP, then let ``show`` read its stored reports with ``change`` applied to every row."""
    from remat.client.report import ModelReport
    from remat.worker import local

    assert run_cli(capsys, "plan", *SMALL_MLP)[0] == 0
    original = local.stored_reports

    def changed(**kw: object) -> list[ModelReport]:
        reports = original(**kw)
        for report in reports:
            for row in report.rows:
                change(row)
        return reports

    monkeypatch.setattr(local, "stored_reports", changed)


def test_a_cuda_timeline_is_drawn_as_allocator_events_in_requested_bytes(capsys, project: Path,
                                                                         monkeypatch) -> None:
    import matplotlib.pyplot as plt

    def as_if_measured_on_cuda(row: Any) -> None:
        if row.timeline is not None:  # what a CUDA measurement stores (remat.worker.measure)
            row.timeline = {**row.timeline, "sample": "allocator event"}

    _plan_then_change_stored_rows(capsys, monkeypatch, as_if_measured_on_cuda)
    figures: list = []
    monkeypatch.setattr(plt, "close", figures.append)
    code, _, err = run_cli(capsys, "show", *SMALL_MLP, "--plot", str(project / "cuda.png"))
    assert code == 0, err
    memory = figures[0].axes[0]
    assert "allocator events" in memory.get_xlabel() and "requested" in memory.get_ylabel()


def test_plans_measured_at_one_point_share_one_label_and_no_label_is_hidden(capsys, project: Path,
                                                                           monkeypatch) -> None:
    import matplotlib.pyplot as plt

    # linear and nested one step measured once, as validation stores it; the others a few pixels apart
    figures_of = {"none": (8.0, 1000.0), "linear": (3.0, 1230.0), "nested": (3.0, 1230.0),
                  "uniform": (3.0, 1250.0), "chen-sqrt": (3.02, 1255.0), "cubic": (3.05, 1240.0),
                  "chen-greedy": (3.01, 1262.0), "acg": (2.98, 1245.0)}

    def close_plans(row: Any) -> None:
        mib, step_ms = figures_of.get(row.plan.algorithm, (row.measured_peak_bytes / 2**20, row.step_ms))
        row.measured_peak_bytes, row.step_ms = int(mib * 2**20), step_ms

    _plan_then_change_stored_rows(capsys, monkeypatch, close_plans)
    figures: list = []
    monkeypatch.setattr(plt, "close", figures.append)
    code, _, err = run_cli(capsys, "show", *SMALL_MLP, "--plot", str(project / "trade.png"))
    assert code == 0, err
    figure = figures[0]
    trade = figure.axes[1]
    labels = [t for t in trade.texts if t.get_text()]
    assert [t.get_text() for t in labels if "linear" in t.get_text() or "nested" in t.get_text()] \
        == ["linear, nested"]
    assert len(labels) >= 6, [t.get_text() for t in labels]
    figure.canvas.draw()  # at the figure's own dpi again: savefig drew it at 120
    renderer = figure.canvas.get_renderer()
    inside = trade.bbox  # the panel: a name outside it is cut off or lands on the other panel
    legend = trade.get_legend()
    from matplotlib.text import Text

    # The names as drawn, in pixels (the text alone: an annotation's own extent includes its line to the point).
    boxes = {label.get_text(): Text.get_window_extent(label, renderer) for label in labels}
    for name, box in boxes.items():
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, name
        assert legend is None or not box.overlaps(legend.get_window_extent(renderer)), name
        for other, other_box in boxes.items():
            assert name == other or not box.overlaps(other_box), (name, other)


def test_show_plot_without_a_timeline_says_how_to_get_one(capsys, project: Path, monkeypatch) -> None:
    def without_timeline(row: Any) -> None:
        row.timeline = None  # as stored before timelines were recorded

    _plan_then_change_stored_rows(capsys, monkeypatch, without_timeline)
    code, _, err = run_cli(capsys, "show", *SMALL_MLP, "--plot", str(project / "x.png"))
    assert code == 1 and "no memory timeline stored" in err and "--refresh" in err, err


def test_every_command_takes_json(capsys) -> None:
    from remat.client.cli import cli

    def commands(group: object, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
        out = []
        for name, command in group.commands.items():  # type: ignore[attr-defined]
            out += commands(command, (*prefix, name)) if hasattr(command, "commands") else [(*prefix, name)]
        return out

    for path in commands(cli):
        code, out, err = run_cli(capsys, *path, "--help")
        assert code == 0 and "--json" in out, " ".join(path)


def test_trace_json_with_an_output_file_prints_a_summary(capsys, project: Path) -> None:
    out_file = project / "t.json"
    code, out, err = run_cli(capsys, "trace", "usernets:mlp", "--input-shape", "32", "--batch-size", "2",
                             "--out", str(out_file), "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["out"] == str(out_file) and summary["model"] == "usernets:mlp"
    assert summary["num_stages"] == len(json.loads(out_file.read_text())["stages"])
