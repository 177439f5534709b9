"""Every torchvision classifier, as a user asks for it: the pipeline at batch 2 and the model's default CPU
input (128 px, or its own where it only runs there), in train mode — planned, every plan measured and
gradient-checked, and the `linear` plan applied to the unmodified model, whose training step it must equal
bit for bit (loss, gradients, buffers).

Hours on 2 cores, so not in the default run: ``uv run pytest -m zoo`` (one model: ``-k resnet18``). The
figures of the same sweep are in docs/benchmarks.md (``benchmarks/zoo_registry.py``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator

import pytest
import torch
import torchvision

from remat.client.apply_plan import apply
from remat.client.graph import built_model
from remat.client.request import default_request
from remat.worker import pipeline
from remat.worker.measure import make_loss

pytestmark = pytest.mark.zoo

MODELS = torchvision.models.list_models(module=torchvision.models)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(1)
    y = model(x)
    loss = make_loss(y, seed=0)(y)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("name", MODELS)
def test_every_classifier_plans_and_trains_identically(name: str) -> None:
    request = default_request(name, batch_size=2, sample_shape=None, device="cpu", grads="none")
    result = pipeline.run(request, algorithms=["none", "linear"], timing_rounds=1)
    assert result.trace.num_stages > 1, f"{name} was not cut"
    for algorithm, m in result.measurements.items():
        assert m.grad_check_passed, f"{name} {algorithm}: gradients differ by {m.grad_max_abs_diff}"
        assert abs(m.prediction_error) <= 0.005, f"{name} {algorithm}: prediction off by {m.prediction_error:+.2%}"
    plan = next(p for p in result.plans if p.algorithm == "linear")

    built = built_model.build(request)  # a fresh model with the same seed and weights as the profiled one
    ref = copy.deepcopy(built.model)
    applied = apply(copy.deepcopy(built.model), dataclasses.replace(plan, extra={"key": result.key.to_dict()}))
    assert torch.equal(_step(applied, built.example), _step(ref, built.example))
    pairs = list(zip(applied.named_parameters(), ref.named_parameters(), strict=True))
    assert not [n for (n, p), (_, q) in pairs if (p.grad is None) != (q.grad is None)
                or (p.grad is not None and not torch.equal(p.grad, q.grad))]
    buffers = list(zip(applied.named_buffers(), ref.named_buffers(), strict=True))
    assert not [n for (n, b), (_, c) in buffers if not torch.equal(b, c)]
