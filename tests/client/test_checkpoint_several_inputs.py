"""``remat.client.checkpoint(model, **inputs)`` on a transformer: one call, any signature.

The oracle is the unmodified model: a copy trained with the same optimizer on the same batches gives
bit-equal losses at every step (dropout on) and equal parameters at the end.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import remat.client
from remat.client.apply_plan import applied_plan
from remat.client.errors import PlanMismatchError
from remat.worker import local
from tests.utils.tiny_transformers import batch, tiny


def _train(model: torch.nn.Module, batches: list[dict]) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(7)
    losses = []
    for kwargs in batches:
        optimizer.zero_grad()
        loss = model(**kwargs).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def test_a_transformer_trains_exactly_with_its_plan(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference = tiny("gpt2")
    model = copy.deepcopy(reference)
    first = batch(seed=1)
    assert remat.client.checkpoint(model, cache_dir=cache_dir, **first) is model
    plan = applied_plan(model)
    assert plan is not None and plan.checkpoints
    assert plan.extra["key"]["inputs"] == \
        "input_ids: int64[2, 32]; attention_mask: int64[2, 32]; labels: int64[2, 32]"
    batches = [batch(seed=s) for s in (1, 2, 3)]
    assert all(torch.equal(a, b) for a, b in zip(_train(reference, batches), _train(model, batches), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters(), strict=True))

    # The same call spelled positionally finds the stored plan: no profiling.
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("profiled although the plan is cached")

    monkeypatch.setattr(local, "plan_held_model", refuse)
    again = copy.deepcopy(reference)
    remat.client.checkpoint(again, first["input_ids"], cache_dir=cache_dir,
                            attention_mask=first["attention_mask"], labels=first["labels"])
    assert applied_plan(again).checkpoints == plan.checkpoints

    # Another call signature at train time is refused, naming the inputs that differ.
    short = batch(seed=4, seq=16)
    with pytest.raises(PlanMismatchError, match=r"inputs: input_ids: int64\[2, 32\] vs int64\[2, 16\]"):
        again(**short)
