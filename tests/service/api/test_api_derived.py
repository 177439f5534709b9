"""``GET /v1/plans/{hash}`` at a batch size never profiled: answered from a trace derived from the key's stored
profiles at two other batch sizes (service/derived_plans.py), marked derived until a measured step is stored.
The oracle is the plan of the synthetic ground-truth trace at that batch, planned here."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from remat.client.planning.plans import make_plan
from tests.client.test_derived_trace import profile
from tests.service.factories import AUTH

SPECS: list[dict[str, Any]] = [
    {"output_bytes": (0, 4096 * (i + 1)), "saved_bytes": (512, 2048),
     "levels": {"backward_peak_bytes": [(2**20, 0), (0, 8192 * (i + 1))]}} for i in range(6)]


def _upload(client: TestClient, batch: int, **meta: Any) -> dict[str, Any]:
    response = client.post("/v1/traces", content=profile(batch, SPECS, **meta).to_json(),
                           headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 201, response.text
    return response.json()["key"]


def _query(batch: int, **extra: Any) -> dict[str, Any]:
    return {"input_shape": f"{batch},3,8,8", "dtype": "float32", "grads": "kept", "device": "cpu", **extra}


def test_a_batch_never_profiled_is_planned_from_two_stored_profiles(client: TestClient) -> None:
    _upload(client, 2)
    _upload(client, 4)
    response = client.get("/v1/plans/h", params=_query(256))
    assert response.status_code == 200, response.text
    record = response.json()
    truth = make_plan(profile(256, SPECS), "linear", cost_model="pytorch")
    assert record["plan"]["predicted_peak_bytes"] == truth.predicted_peak_bytes
    assert record["plan"]["checkpoints"] == list(truth.checkpoints)
    assert record["derived"] is True and record["trace"]["derived_from"] == [2, 4]
    assert record["trace"]["batch_size"] == 256 and record["key"]["input_shape"] == [256, 3, 8, 8]
    # batch_size replaces input_shape's first dimension; the frontier and budget reads derive too.
    again = client.get("/v1/plans/h", params=_query(2, batch_size=256))
    assert again.status_code == 200 and again.json()["plan_id"] == record["plan_id"]
    frontier = client.get("/v1/plans/h/frontier", params=_query(2, batch_size=64))
    assert frontier.status_code == 200 and frontier.json()["key"]["input_shape"] == [64, 3, 8, 8]
    budget = client.get("/v1/plans/h", params=_query(128, algorithm="budget", budget=10**9))
    assert budget.status_code == 200 and budget.json()["derived"] is True


def test_a_measured_step_makes_a_derived_plan_an_ordinary_one(client: TestClient) -> None:
    _upload(client, 2)
    _upload(client, 4)
    record = client.get("/v1/plans/h", params=_query(16)).json()
    measured = client.post("/v1/measurements", headers=AUTH, json={
        "key": record["key"], "algorithm": "linear", "measured_peak_bytes": record["plan"]["predicted_peak_bytes"]})
    assert measured.status_code == 201, measured.text
    after = client.get("/v1/plans/h", params=_query(16)).json()
    assert after["derived"] is False and after["trace"]["derived_from"] == [2, 4]


def test_one_profile_or_profiles_that_differ_answer_nothing(client: TestClient) -> None:
    _upload(client, 2)
    assert client.get("/v1/plans/h", params=_query(16)).status_code == 404
    _upload(client, 4, dtype="bfloat16")  # another key: not a profile of this one
    assert client.get("/v1/plans/h", params=_query(16)).status_code == 404
    _upload(client, 8, model="renamed")  # same key, but the profiles disagree on more than the batch
    assert client.get("/v1/plans/h", params=_query(16)).status_code == 404
    assert client.get("/v1/plans/h", params={"batch_size": 4}).status_code == 422  # no input_shape to take it


def test_a_key_with_a_profile_of_its_own_is_never_derived(client: TestClient) -> None:
    """Whatever read misses for it (a plan the upload deferred, a frontier), no derived trace may be stored beside
    (and newer than) the real one."""
    from remat.client.plan_key import PlanKey
    from remat.service.derived_plans import store_derived

    _upload(client, 2)
    _upload(client, 4)
    own = PlanKey.from_dict(_upload(client, 16))
    state = client.app.state.remat  # type: ignore[attr-defined]
    assert store_derived(state.db, state.settings, own) is False
    record = client.get("/v1/plans/h", params=_query(16)).json()
    assert record["trace"]["derived_from"] == [] and record["derived"] is False


def _signature(batch: int) -> str:
    return f"pixel_values: float32[{batch}, 3, 8, 8]; labels: int64[{batch}]; return_dict=True"


def test_a_call_of_several_inputs_is_derived_with_its_signature_at_the_new_batch(client: TestClient) -> None:
    """A transformer's key names its batch in ``inputs`` as well as in ``input_shape``: the profiles at 2 and 4
    are found for a query at 32 (asked with the signature at 32, or at 2 with ``batch_size``), and a profile
    of another call (another constant) is not."""
    _upload(client, 2, inputs=_signature(2))
    _upload(client, 4, inputs=_signature(4))
    record = client.get("/v1/plans/h", params=_query(32, inputs=_signature(32)))
    assert record.status_code == 200, record.text
    assert record.json()["derived"] is True and record.json()["key"]["inputs"] == _signature(32)
    again = client.get("/v1/plans/h", params=_query(2, inputs=_signature(2), batch_size=32))
    assert again.status_code == 200 and again.json()["plan_id"] == record.json()["plan_id"]
    other = client.get("/v1/plans/h", params=_query(32, inputs=_signature(32).replace("True", "False")))
    assert other.status_code == 404, other.text


TOKEN_SPECS: list[dict[str, Any]] = [
    {"output_bytes": (0, 4096, 0), "saved_bytes": (512, 2048, 64 * (i + 1)),
     "levels": {"backward_peak_bytes": [(2**20, 0, 0), (0, 8192, 128 * (i + 1))]}} for i in range(4)]


def _token_query(batch: int, tokens: int, **extra: Any) -> dict[str, Any]:
    return {"input_shape": f"{batch},{tokens}", "inputs": f"input_ids: int64[{batch}, {tokens}]; labels: "
            f"int64[{batch}, {tokens}]", "dtype": "float32", "grads": "none", "device": "cpu", **extra}


def test_a_sequence_length_never_profiled_is_planned_from_three_stored_lengths(client: TestClient) -> None:
    """A token model's profiles at the same batch and 8, 16 and 24 tokens answer a read at 96 tokens (asked with
    its key, or at 8 with ``seq_len``): the trace's attention holds its scores, so the fit is quadratic; the
    oracle is the plan of the ground-truth trace at 96."""
    from tests.client.test_derived_trace import token_profile

    for seq_len in (8, 16):
        response = client.post("/v1/traces", content=token_profile(seq_len, TOKEN_SPECS).to_json(),
                               headers={**AUTH, "Content-Type": "application/json"})
        assert response.status_code == 201, response.text
    assert client.get("/v1/plans/t", params=_token_query(2, 96)).status_code == 404  # two lengths: too few
    client.post("/v1/traces", content=token_profile(24, TOKEN_SPECS).to_json(),
                headers={**AUTH, "Content-Type": "application/json"})
    response = client.get("/v1/plans/t", params=_token_query(2, 96))
    assert response.status_code == 200, response.text
    record = response.json()
    truth = make_plan(token_profile(96, TOKEN_SPECS), "linear", cost_model="pytorch")
    assert record["plan"]["predicted_peak_bytes"] == truth.predicted_peak_bytes
    assert record["plan"]["checkpoints"] == list(truth.checkpoints)
    assert record["derived"] is True
    assert record["trace"]["derived_from"] == [8, 16, 24] and record["trace"]["derived_along"] == "seq_len"
    again = client.get("/v1/plans/t", params=_token_query(2, 8, seq_len=96))
    assert again.status_code == 200 and again.json()["plan_id"] == record["plan_id"]
    frontier = client.get("/v1/plans/t/frontier", params=_token_query(2, 8, seq_len=200))
    assert frontier.status_code == 200 and frontier.json()["key"]["input_shape"] == [2, 200]
    assert client.get("/v1/plans/t", params=_token_query(4, 96)).status_code == 404  # another batch: no family


def test_seq_len_on_a_key_without_token_ids_is_refused_naming_it(client: TestClient) -> None:
    response = client.get("/v1/plans/h", params=_query(2, seq_len=64))
    assert response.status_code == 422
    assert response.json()["detail"].startswith("seq_len: needs a token model's key")
