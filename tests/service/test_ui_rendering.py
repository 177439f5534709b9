"""The web pages' pieces without a server: how figures read, the SVG builder, and the lines that fetch a plan."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from remat.client.plan_key import PlanKey
from remat.service.ui.fetch_lines import fetch_lines
from remat.service.ui.formatting import ms, percent, size
from remat.service.ui.svg import Figure, empty_figure, nice_ticks

SVG = "{http://www.w3.org/2000/svg}"


def test_figures_read_like_the_cli_and_never_minus_zero() -> None:
    assert size(None) == "–" and size(1536) == "1.5 KiB" and size(3 * 1024**3) == "3.0 GiB"
    assert percent(-0.00001, signed=True) == "+0.0%" and percent(-0.0004) == "0.0%"
    assert percent(-0.0123, signed=True) == "-1.2%" and percent(0.5) == "50.0%" and percent(None) == "–"
    assert ms(12.34) == "12.3 ms" and ms(1234.5) == "1234 ms"


@pytest.mark.parametrize("low, high", [(0, 1), (0, 37.2), (-12, 340), (0.001, 0.0042), (5, 5)])
def test_ticks_are_round_and_cover_the_range(low: float, high: float) -> None:
    ticks = nice_ticks(low, high)
    assert ticks[0] >= low - 1e-12 and ticks[-1] <= high + 1e-12
    assert 1 <= len(ticks) <= 11
    steps = {round(b - a, 12) for a, b in zip(ticks, ticks[1:], strict=False)}
    assert len(steps) <= 1


def test_a_figure_is_valid_svg_and_escapes_its_text() -> None:
    figure = Figure(title='<script>alert("x")</script> & co', x_label="x <", y_label="y >", x_range=(0, 1),
                    y_range=(0, 10), description="d & e")
    figure.step([0, 0.5, 1], [1, 5, 5], colour="#c0392b", label="a <b>")
    figure.hline(4, colour="#1f6fb4", label="predicted")
    figure.vline(0.4, colour="#1f6fb4")
    figure.points([0.2], [3], colour="#8a8a8a", names=['name "quoted" <x>'], label="plans")
    document = figure.svg()
    root = ET.fromstring(document)
    assert root.tag == f"{SVG}svg" and "<script" not in document
    assert root.find(f"{SVG}title").text == '<script>alert("x")</script> & co'
    assert root.find(f"{SVG}path") is not None and len(root.findall(f".//{SVG}circle")) == 2
    assert "style=" not in document and "<style" not in document  # shows under default-src 'none'
    assert ET.fromstring(empty_figure("T <", "why & how")).find(f"{SVG}desc").text == "why & how"


def test_the_cli_line_only_for_a_name_the_cli_builds() -> None:
    key = PlanKey(model_hash="ab" * 32, input_shape=(4, 3, 128, 128), torch_version="2.9")
    lines = fetch_lines(key, model="torchvision:resnet50", server="http://plans:8000", algorithm="linear",
                        read_token=False)
    assert lines.cli == ("remat-client plan torchvision:resnet50 --batch-size 4 --input-shape 3,128,128 --dtype float32"
                         " --device cpu --grads none --algorithm linear --server http://plans:8000")
    assert "fetch_and_apply(model, (4, 3, 128, 128), server='http://plans:8000'" in lines.python
    assert "os.environ" not in lines.python and "Authorization" not in lines.http
    for label in ("ResNet", "tiny-net", "custom:MyNet", "hf:/abs/config.json", None):
        other = fetch_lines(key, model=label, server="http://plans:8000", algorithm="linear", read_token=True)
        assert other.cli is None and other.cli_note
        assert 'token=os.environ["REMAT_READ_TOKEN"]' in other.python and "$REMAT_READ_TOKEN" in other.http
    evaluation = fetch_lines(PlanKey(model_hash="ab" * 32, input_shape=(4, 3), mode="eval", torch_version="2.9"),
                             model="torchvision:resnet50", server="http://p", algorithm="linear", read_token=False)
    assert evaluation.cli is None and "fetch_and_apply" not in evaluation.python and "fetch_plan" in evaluation.python


def test_a_zoo_batch_row_within_noise_says_so_instead_of_a_percentage() -> None:
    """As the CLI's zoo table: a linear step faster than none by less than the steps' spread is no speed-up."""
    from datetime import UTC, datetime
    from types import SimpleNamespace

    from remat.client.zoo_batch import ZooRow
    from remat.service.ui.pages import render

    def entry(model: str, overhead: float, within: bool) -> dict[str, object]:
        row = ZooRow(model=model, status="planned", num_stages=9, none_peak_bytes=80 << 20,
                     linear_peak_bytes=30 << 20, saving=0.625, overhead=overhead, overhead_within_noise=within,
                     prediction_error=0.01, grad_check_passed=True, least_algorithm="acg",
                     least_peak_bytes=20 << 20, least_saving=0.75)
        return {"model": model, "job_id": "0" * 36, "state": "succeeded", "progress": 1.0, "row": row,
                "message": None}

    batch = SimpleNamespace(id="1" * 36, zoo="torchvision", filter=None, created_at=datetime(2026, 12, 1, tzinfo=UTC))
    summary = {"progress": 1.0, "done": True, "finished": 2, "total": 2, "counts": {"succeeded": 2},
               "models": [entry("torchvision:resnet18", -0.04, True), entry("torchvision:resnet34", 0.25, False)]}
    html = render("zoo_batch.html", nav="zoo", batch=batch, summary=summary)
    assert "within noise" in html and "-4.0%" not in html and "+25.0%" in html
    assert "Least peak" in html and "acg 20.0 MiB (75.0%)" in html  # the least peak, whose plan and its saving
