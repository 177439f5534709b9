"""PlanKey normalisation and the bounds on what is stored."""

from __future__ import annotations

import pytest

from remat.client.errors import TraceFormatError
from remat.client.plan_key import MAX_INPUTS_CHARS, PlanKey, parse_input_shape
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


SIGNATURE = "input_ids: int64[2, 256]; attention_mask: int64[2, 256]; labels: int64[2, 256]; use_cache=False"


def test_from_trace_reads_the_call_signature_and_absent_is_one_tensor() -> None:
    assert PlanKey.from_trace(make_trace()).inputs == ""
    assert PlanKey.from_trace(make_trace(inputs=None)).inputs == ""
    key = PlanKey.from_trace(make_trace(inputs=SIGNATURE))
    assert key.inputs == SIGNATURE
    assert key != PlanKey.from_trace(make_trace())
    assert PlanKey.from_dict(key.to_dict()) == key
    with pytest.raises(TraceRejectedError, match="^inputs: "):
        trace_key(make_trace(inputs="x: int64[2]\n"))
    with pytest.raises(TraceFormatError, match="^inputs: must be of type str"):
        make_trace(inputs=["x"])


# --- the API's key fields are PlanKey's ---------------------------------------------------------------------

def test_every_key_field_has_api_bounds_and_the_schemas_list_them_in_order() -> None:
    from remat.client.plan_key import KEY_FIELDS
    from remat.service.keys import KEY_BOUNDS
    from remat.service.schemas import TRACE_SCHEMA, PlanKeyIn, PlanKeyOut

    assert set(KEY_BOUNDS) == set(KEY_FIELDS)
    assert tuple(PlanKeyIn.model_fields) == tuple(PlanKeyOut.model_fields) == KEY_FIELDS
    assert set(KEY_FIELDS) <= set(TRACE_SCHEMA["properties"])


def test_the_plan_routes_read_every_key_field_from_path_and_query() -> None:
    from remat.client.plan_key import KEY_FIELDS
    from remat.service.api.app import create_app
    from remat.service.config import ServiceSettings

    doc = create_app(ServiceSettings(database_url="sqlite://", redis_url=None)).openapi()
    for path in ("/v1/plans/{model_hash}", "/v1/plans/{model_hash}/frontier", "/v1/plans/{model_hash}/timeline"):
        names = [p["name"] for p in doc["paths"][path]["get"]["parameters"]]
        assert [n for n in names if n in KEY_FIELDS] == list(KEY_FIELDS), path


def test_a_key_body_round_trips_through_the_one_plan_key() -> None:
    from remat.service.schemas import PlanKeyIn

    body = PlanKeyIn(model_hash="h", input_shape=[8, 3], dtype="torch.float32", device="CUDA:1")
    assert body.to_key() == PlanKey(model_hash="h", input_shape=(8, 3), dtype="float32", device="cuda",
                                    torch_version="unknown")
    assert PlanKeyIn.model_validate(body.to_key().to_dict()).to_key() == body.to_key()


def test_a_key_body_bounds_the_call_signature_as_the_plan_key_does() -> None:
    from pydantic import ValidationError

    from remat.service.schemas import TRACE_SCHEMA, PlanKeyIn

    base = {"model_hash": "h", "input_shape": [2, 256], "dtype": "float32", "device": "cpu"}
    assert PlanKeyIn(**base).to_key().inputs == ""  # PlanKey's own default: a single-tensor call
    assert PlanKeyIn(**base, inputs=SIGNATURE).to_key().inputs == SIGNATURE
    assert PlanKeyIn(**base, inputs="x" * MAX_INPUTS_CHARS).to_key().inputs == "x" * MAX_INPUTS_CHARS
    for bad in ("x" * (MAX_INPUTS_CHARS + 1), "a: int64[2]\n", "a\tb", "\u00e9", "a\x00"):
        with pytest.raises(ValidationError, match="inputs"):
            PlanKeyIn(**base, inputs=bad)
        with pytest.raises(InvalidKeyError, match="^inputs: "):
            PlanKey(**base, inputs=bad)
    schema = TRACE_SCHEMA["properties"]["inputs"]["anyOf"][0]
    assert (schema["type"], schema["maxLength"]) == ("string", MAX_INPUTS_CHARS)
