"""The plan key's precision: one spelling for client, service and workers, read back from a training call."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat.client.errors import PlanError
from remat.client.precision import PRECISIONS, autocast_dtype, normalize_precision, precision_of_call


@pytest.mark.parametrize(("given", "canonical"), [
    ("float32", "float32"), (torch.float32, "float32"), ("torch.bfloat16", "bfloat16"), ("fp16", "float16"),
    ("bf16", "bfloat16"), ("autocast_bf16", "autocast_bfloat16"), ("autocast_float16", "autocast_float16"),
    ("double", "float64"),
])
def test_spellings_normalise(given: object, canonical: str) -> None:
    assert normalize_precision(given) == canonical
    assert canonical in PRECISIONS


@pytest.mark.parametrize("bad", ["int64", "autocast_float32", "float8", "", None, "autocast_", "FP16", "Float32"])
def test_unknown_precisions_are_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(PlanError, match=r"^dtype: must be one of float32, .*, got"):
        normalize_precision(bad)


def test_autocast_dtype() -> None:
    assert autocast_dtype("autocast_bfloat16") == "bfloat16"
    assert autocast_dtype("bfloat16") is None


def test_precision_of_a_call() -> None:
    model = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    assert precision_of_call(model, x) == "float32"
    assert precision_of_call(model.to(torch.bfloat16), x.to(torch.bfloat16)) == "bfloat16"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert precision_of_call(model, x) == "autocast_bfloat16"
    # Integer inputs (token ids): the model's floating dtype is the step's precision.
    embedding = nn.Embedding(10, 4).to(torch.float64)
    assert precision_of_call(embedding, torch.zeros(2, 3, dtype=torch.long)) == "float64"
