"""A training loop that keeps the model's output alive through ``backward()`` is told what that costs, once
(NOTE [ an output alive through backward ] in remat.client.held_output).

The oracle is the CPU meter (remat.worker.memory_meter), not the watch: the same applied model trained by a
loop that lets go of its output and by one that holds it measures the bytes the warning names apart — or
the same, where the model saves that output for backward itself and nothing is reported.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat.client
from remat.client import held_output
from remat.client.apply_plan import applied_plan
from remat.worker.memory_meter import MemoryMeter
from tests.utils.tiny_transformers import batch, tiny


def _peak_and_warnings(step: Callable[[], object]) -> tuple[int, list[str]]:
    """The step's peak above its start, on the CPU meter, and remat's warnings about its output during it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meter = MemoryMeter()
        with meter:
            meter.mark_baseline()
            step()
    told = [w for w in caught if "remat: the model's output" in str(w.message)]
    assert all(w.filename == __file__ for w in told)  # the user's line: the step's backward() here
    return meter.peak_above_baseline, [str(w.message) for w in told]


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def test_a_loop_holding_a_language_models_output_is_told_the_logits_bytes_it_adds(cache_dir: Path) -> None:
    reference = tiny("gpt2", layers=4)
    example = batch(seed=1)
    remat.client.checkpoint(reference, cache_dir=cache_dir, **example)
    plan = applied_plan(reference)
    assert plan is not None and plan.checkpoints
    logits_bytes = 2 * 32 * 512 * 4

    dropping, holding = copy.deepcopy(reference), copy.deepcopy(reference)  # each watches its own first step

    def dropped_step() -> None:
        dropping.zero_grad(set_to_none=True)
        dropping(**example).loss.backward()

    def held_step() -> None:
        holding.zero_grad(set_to_none=True)
        outputs = holding(**example)
        outputs.loss.backward()

    # A copy cuts its chain at its first training call: that step is told, the second one is measured.
    assert _peak_and_warnings(dropped_step)[1] == []
    _, told = _peak_and_warnings(held_step)
    assert len(told) == 1
    assert f"model's output['logits'] (float32[2, 32, 512], {_kib(logits_bytes)}) is still alive" in told[0]
    assert re.search(r"this step can reach .*iB\. Keep only the loss before backward\(\)", told[0])

    dropped, quiet = _peak_and_warnings(dropped_step)
    held, again = _peak_and_warnings(held_step)
    assert quiet == again == []  # once: the loop does not change between steps
    assert abs(dropped - plan.predicted_peak_bytes) <= 0.005 * dropped  # the step the plan is predicted for
    assert held - dropped == logits_bytes  # what holding really costs here: the logits, at backward's peak


class _Blocks(nn.Module):
    """Residual MLP blocks, a classifier head and its loss; ``returns`` picks the output: nanoGPT's
    ``(logits, loss)``, or ``{"loss", "hidden"}`` (a hidden state the head saves as its input)."""

    def __init__(self, returns: str, width: int = 256, depth: int = 6, classes: int = 1024) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.returns = returns
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
                                    for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> object:
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(x)
        loss = F.cross_entropy(logits, targets)
        return (logits, loss) if self.returns == "tuple" else {"loss": loss, "hidden": x}


class _Logits(_Blocks):
    """The same blocks returning their logits: the loop computes the loss."""

    def __init__(self, classes: int = 1024) -> None:
        super().__init__("logits", classes=classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(128, 256, generator=gen), torch.randint(0, 1024, (128,), generator=gen)


def test_a_tuple_of_logits_and_loss_held_by_the_loop_names_the_logits(cache_dir: Path) -> None:
    x, y = _inputs()
    model = remat.client.checkpoint(_Blocks("tuple"), x, y, cache_dir=cache_dir)

    def held_step() -> None:
        logits, loss = model(x, y)
        loss.backward()

    model(x, y)  # a training forward without backward (a shape check): the next step is still watched
    _, told = _peak_and_warnings(held_step)
    assert len(told) == 1
    assert f"model's output[0] (float32[128, 1024], {_kib(128 * 1024 * 4)}) is still alive" in told[0]


def test_an_output_the_model_saves_is_reported_held_since_it_outlives_its_savers_backward(cache_dir: Path) -> None:
    """The head keeps ``hidden`` as its input, so it is alive when backward starts in either loop; the loop
    that lets go of it frees it at the head's backward, the one that holds it at the end."""
    x, y = _inputs()
    reference = remat.client.checkpoint(_Blocks("dict"), x, y, cache_dir=cache_dir)
    dropping, holding = copy.deepcopy(reference), copy.deepcopy(reference)

    def dropped_step() -> None:
        dropping.zero_grad(set_to_none=True)
        dropping(x, y)["loss"].backward()

    def held_step() -> None:
        holding.zero_grad(set_to_none=True)
        outputs = holding(x, y)
        outputs["loss"].backward()

    assert _peak_and_warnings(dropped_step)[1] == []
    told = _peak_and_warnings(held_step)[1]
    hidden_bytes = 128 * 256 * 4
    assert len(told) == 1
    assert f"model's output['hidden'] (float32[128, 256], {_kib(hidden_bytes)}) is still alive" in told[0]
    dropped, _ = _peak_and_warnings(dropped_step)
    held, _ = _peak_and_warnings(held_step)
    assert held - dropped == hidden_bytes


def test_a_view_of_the_output_kept_by_the_loop_is_reported_and_a_small_output_is_not(cache_dir: Path) -> None:
    x, y = _inputs()
    reference = remat.client.checkpoint(_Logits(), x, cache_dir=cache_dir)
    viewing, classifying = copy.deepcopy(reference), copy.deepcopy(reference)

    def viewing_step() -> None:
        logits = viewing(x)
        loss = F.cross_entropy(logits, y)
        first_rows = logits.detach()[:4]  # kept for a log line: its storage is all of the logits  # noqa: F841
        del logits
        loss.backward()

    _, told = _peak_and_warnings(viewing_step)
    assert len(told) == 1 and f"model's output (float32[128, 1024], {_kib(128 * 1024 * 4)}) is still alive" in told[0]
    _, told = _peak_and_warnings(lambda: F.cross_entropy(classifying(x), y).backward())
    assert told == []  # log_softmax keeps its own output, not the logits

    small = remat.client.checkpoint(_Logits(classes=8), x, cache_dir=cache_dir)

    def held_small() -> None:
        logits = small(x)
        F.cross_entropy(logits, y % 8).backward()

    _, told = _peak_and_warnings(held_small)
    assert told == []  # 4 KiB of logits: within the prediction's tolerance


def test_a_loss_that_saves_the_output_is_reported_with_the_bytes_it_adds(cache_dir: Path) -> None:
    """``mse_loss`` keeps the logits for its backward, so they are alive as backward starts, the step's peak
    here; ``cross_entropy`` keeps its ``log_softmax`` instead, which the plan's step has too."""
    reference = tiny("gpt2", layers=4)
    example = batch(seed=1)
    labels = example.pop("labels")
    remat.client.checkpoint(reference, cache_dir=cache_dir, **example)
    predicted = applied_plan(reference).predicted_peak_bytes
    logits_bytes = 2 * 32 * 512 * 4
    regressing, classifying = copy.deepcopy(reference), copy.deepcopy(reference)
    target = torch.zeros(2, 32, 512)

    def regression_step() -> None:
        regressing.zero_grad(set_to_none=True)
        F.mse_loss(regressing(**example).logits, target).backward()

    def classification_step() -> None:
        classifying.zero_grad(set_to_none=True)
        F.cross_entropy(classifying(**example).logits.flatten(0, 1), labels.flatten()).backward()

    _, told = _peak_and_warnings(regression_step)
    assert len(told) == 1
    assert f"model's output['logits'] (float32[2, 32, 512], {_kib(logits_bytes)}) is saved by the loss" in told[0]
    assert "Keep only the loss" not in told[0]  # nothing the loop could let go of
    assert _peak_and_warnings(classification_step)[1] == []
    regressed, again = _peak_and_warnings(regression_step)
    classified, _ = _peak_and_warnings(classification_step)
    assert again == []
    assert abs(classified - predicted) <= 0.005 * predicted
    assert regressed - predicted == logits_bytes  # the bound the warning gives, reached


@pytest.mark.cuda
def test_on_cuda_the_watch_reports_from_the_engines_device_threads(cache_dir: Path) -> None:
    """A CUDA backward runs hooks and frees storages on the autograd engine's device threads, where the graph
    task is that thread's: the held loop and the saving loss are told all the same, the dropping loop not."""
    x, y = (t.cuda() for t in _inputs())
    reference = remat.client.checkpoint(_Logits().cuda(), x, cache_dir=cache_dir)
    holding, regressing, dropping = (copy.deepcopy(reference) for _ in range(3))
    target = torch.zeros(128, 1024, device="cuda")

    def held_step() -> None:
        logits = holding(x)
        F.cross_entropy(logits, y).backward()

    def dropped_step() -> None:
        F.cross_entropy(dropping(x), y).backward()

    def told(step: Callable[[], object]) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
            torch.cuda.synchronize()
        return [str(w.message) for w in caught if "remat: the model's output" in str(w.message)]

    assert "still alive when backward() ends" in " ".join(told(held_step))
    assert "is saved by the loss" in " ".join(told(lambda: F.mse_loss(regressing(x), target).backward()))
    assert told(dropped_step) == []


def test_an_encoders_output_the_model_keeps_through_backward_is_not_taken_for_the_loops(
        cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """T5's encoder output is read by every decoder segment, so its checkpoint frames keep it (the tensor
    itself) until their backward: alive when backward reaches the model in any loop, and let go by its end
    unless the loop holds it. Every byte counts here (thresholds at zero), so a false report would show."""
    monkeypatch.setattr(held_output, "MIN_SHARE", 0.0)
    monkeypatch.setattr(held_output, "MIN_BYTES", 0)
    reference = tiny("t5", layers=3)
    example = batch(seed=1)
    remat.client.checkpoint(reference, cache_dir=cache_dir, **example)
    assert applied_plan(reference).checkpoints
    dropping, holding = copy.deepcopy(reference), copy.deepcopy(reference)
    assert _peak_and_warnings(lambda: dropping(**example).loss.backward())[1] == []

    def held_step() -> None:
        outputs = holding(**example)
        outputs.loss.backward()

    told = _peak_and_warnings(held_step)[1]
    assert len(told) == 1
    assert "model's output['logits'] (float32[2, 32, 512]), output['encoder_last_hidden_state'] " \
           "(float32[2, 32, 64]), 144.0 KiB in all, are still alive when backward() ends" in told[0]
