"""PlanKey normalisation and the bounds on what is stored."""

from __future__ import annotations

import pytest

from remat.client.plan_key import PlanKey, parse_input_shape
from remat.service.errors import InvalidKeyError, TraceRejectedError
from remat.service.keys import trace_key
from tests.service.factories import make_trace


def test_normalisation() -> None:
    key = PlanKey(model_hash="h", input_shape="32, 3,224,224", dtype="torch.bfloat16", device="CUDA:3")
    assert (key.input_shape, key.dtype, key.device, key.mode, key.grads) == ((32, 3, 224, 224), "bfloat16",
                                                                            "cuda", "train", "none")
    assert key.input_shape_text == "32,3,224,224"
    assert PlanKey.from_dict(key.to_dict()) == key


@pytest.mark.parametrize("text, shape", [("", ()), ("7", (7,)), ("1,2,3", (1, 2, 3))])
def test_parse_input_shape(text: str, shape: tuple[int, ...]) -> None:
    assert parse_input_shape(text) == shape


@pytest.mark.parametrize("kwargs, message", [
    ({"model_hash": ""}, "model_hash: "),
    ({"model_hash": "a/b"}, "model_hash: "),
    ({"input_shape": "1,,2"}, "input_shape: must be comma-separated"),
    ({"input_shape": [True, 2]}, "input_shape: every dimension"),
    ({"input_shape": [2**40, 2]}, "input_shape: every dimension"),
    ({"dtype": "Float32"}, "dtype: "),
    ({"dtype": "autocast_float64"}, "dtype: "),
    ({"torch_version": "two"}, "torch_version: "),
    ({"device": "cuda:x"}, "device: "),
    ({"mode": "infer"}, "mode: must be one of train, eval"),
    ({"grads": "zero"}, "grads: must be one of none, kept"),
])
def test_bad_components_name_the_field(kwargs: dict, message: str) -> None:
    base = {"model_hash": "h", "input_shape": (1,), "dtype": "float32", "device": "cpu"}
    with pytest.raises(InvalidKeyError, match=f"^{message}"):
        PlanKey(**{**base, **kwargs})


def test_from_trace_defaults_and_errors() -> None:
    key = PlanKey.from_trace(make_trace(dtype=None, device=None, model_hash=None, input_shape=(), torch_version=None))
    assert (key.dtype, key.device, key.input_shape) == ("unknown", "unknown", ())
    assert key.model_hash.startswith("trace:")
    assert key.torch_version == "unknown"
    with pytest.raises(TraceRejectedError, match="^dtype: "):
        trace_key(make_trace(dtype=""))
