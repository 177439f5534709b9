"""POST /v1/zoo makes one ordinary profiling job per selected model in one transaction; GET /v1/zoo/{id}
reads their progress and, per finished model, the same ZooRow the CLI prints."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from remat.client.plan import Plan
from remat.service import jobs
from remat.service.api.deps import ServiceState
from tests.service.factories import AUTH

ZOO = {"filter": "resnet1*", "device": "cpu", "batch_size": 2, "grads": "kept"}
MIB = 1024 * 1024


def _state(client: TestClient) -> ServiceState:
    return client.app.state.remat  # type: ignore[attr-defined,no-any-return]


def test_a_batch_is_one_job_per_model_with_each_models_default_input(client: TestClient) -> None:
    assert client.post("/v1/zoo", json=ZOO).status_code == 401  # writes need the token
    response = client.post("/v1/zoo", json=ZOO, headers=AUTH)
    assert response.status_code == 202, response.text
    batch = response.json()
    assert [m["model"] for m in batch["models"]] == ["torchvision:resnet101", "torchvision:resnet152",
                                                     "torchvision:resnet18"]  # the registry's order
    assert batch["total"] == 3 and batch["finished"] == 0 and not batch["done"] and batch["progress"] == 0.0
    assert batch["counts"]["pending"] == 3  # the test client's broker is down: the reaper sends them later
    for entry in batch["models"]:
        job = client.get(f"/v1/jobs/{entry['job_id']}").json()
        assert job["request"] == {"model": entry["model"], "batch_size": 2, "input_shape": [3, 128, 128],
                                  "dtype": "float32", "device": "cpu", "mode": "train", "grads": "kept"}
        assert job["queue"] == "cpu" and entry["row"] is None
    assert client.get(f"/v1/zoo/{batch['id']}").json() == batch
    # Fixed-resolution models keep their own input; a second batch of the same requests follows the first.
    vit = client.post("/v1/zoo", json={**ZOO, "filter": "vit_b_16,resnet18"}, headers=AUTH).json()
    requests = {m["model"]: client.get(f"/v1/jobs/{m['job_id']}").json() for m in vit["models"]}
    assert requests["torchvision:vit_b_16"]["request"]["input_shape"] == [3, 224, 224]
    first_resnet18 = batch["models"][2]["job_id"]
    assert requests["torchvision:resnet18"]["leader_id"] == first_resnet18


@pytest.mark.parametrize("change, detail", [
    ({"filter": "nothing*"}, "filter: 'nothing*' matches none of the"),
    ({"filter": "resnet; rm"}, "filter: String should match pattern"),
    ({"zoo": "timm"}, "zoo: Input should be 'torchvision'"),
    ({"queue": "cuda"}, "queue: 'cuda' is not a queue of device 'cpu'"),
    ({"batch_size": 0}, "batch_size: Input should be greater than or equal to 1"),
    ({"input_shape": [65536, 65536, 65536]}, "input_shape: batch 2 x [65536, 65536, 65536] is"),
    ({"models": ["resnet18"]}, "models: Extra inputs are not permitted"),
])
def test_bad_zoo_requests_are_422_naming_the_field_and_record_nothing(client: TestClient, change: dict,
                                                                     detail: str) -> None:
    response = client.post("/v1/zoo", json={**ZOO, **change}, headers=AUTH)
    assert response.status_code == 422
    assert response.json()["detail"].startswith(detail), response.json()
    assert client.get("/v1/jobs").json()["count"] == 0


def _plan(algorithm: str, predicted: int) -> dict:
    return Plan(algorithm=algorithm, cost_model="pytorch", checkpoints=(3,) if algorithm == "linear" else (),
                predicted_peak_bytes=predicted, baseline_peak_bytes=100 * MIB, num_stages=14).to_dict()


def test_finished_jobs_become_rows_and_failures_keep_their_reason(client: TestClient) -> None:
    batch = client.post("/v1/zoo", json={**ZOO, "filter": "resnet18,resnet34"}, headers=AUTH).json()
    first, second = (m["job_id"] for m in batch["models"])
    db = _state(client).db
    result = {"key": {"model_hash": "ab" * 32}, "trace_id": 1, "reused": False, "device_name": "test cpu",
              "plans": [{"plan": _plan("none", 100 * MIB),
                         "measurement": {"algorithm": "none", "measured_peak_bytes": 100 * MIB, "step_ms": 10.0,
                                         "grad_check_passed": True}},
                        {"plan": _plan("linear", 41 * MIB),
                         "measurement": {"algorithm": "linear", "measured_peak_bytes": 40 * MIB, "step_ms": 12.5,
                                         "grad_check_passed": True}}]}
    with db.write_session() as session:
        for job_id in (first, second):
            claim = jobs.claim_job(session=session, job_id=job_id, owner="w", lease_s=30, max_attempts=3)
            assert claim.outcome == "run"
        jobs.finish_job(session=session, job_id=first, owner="w", state="succeeded", result=result)
    half = client.get(f"/v1/zoo/{batch['id']}").json()
    assert half["finished"] == 1 and not half["done"] and half["counts"]["running"] == 1
    row = half["models"][0]["row"]
    assert row["status"] == "planned" and row["num_stages"] == 14
    assert row["none_peak_bytes"] == 100 * MIB and row["linear_peak_bytes"] == 40 * MIB
    assert row["saving"] == pytest.approx(0.6) and row["overhead"] == pytest.approx(0.25)
    assert row["prediction_error"] == pytest.approx(0.025) and row["grad_check_passed"] is True
    with db.write_session() as session:
        jobs.finish_job(session=session, job_id=second, owner="w", state="failed", error="out of memory profiling")
    done = client.get(f"/v1/zoo/{batch['id']}").json()
    assert done["done"] and done["progress"] == 1.0 and done["counts"] == {
        "pending": 0, "queued": 0, "running": 0, "succeeded": 1, "failed": 1}
    failed = done["models"][1]["row"]
    assert failed["status"] == "failed" and failed["reason"] == "out of memory profiling"
    assert failed["model"] == "torchvision:resnet34" and failed["input_shape"] == [2, 3, 128, 128]


def test_unknown_and_malformed_batch_ids(client: TestClient) -> None:
    missing = client.get("/v1/zoo/00000000-0000-4000-8000-000000000000")
    assert missing.status_code == 404 and missing.json()["detail"].startswith("batch_id: no zoo batch")
    assert client.get("/v1/zoo/not-a-uuid").status_code == 422


def test_an_hf_zoo_batch_gives_each_model_its_configuration_and_the_token_models_the_sequence_length(
        client: TestClient) -> None:
    pytest.importorskip("transformers")
    response = client.post("/v1/zoo", json={**ZOO, "zoo": "hf", "filter": "gpt2,vit", "seq_len": 32}, headers=AUTH)
    assert response.status_code == 202, response.text
    batch = response.json()
    assert [m["model"] for m in batch["models"]] == ["hf:gpt2", "hf:vit"]
    requests = [client.get(f"/v1/jobs/{m['job_id']}").json()["request"] for m in batch["models"]]
    assert requests[0]["input_shape"] == [32] and requests[0]["seq_len"] == 32
    assert requests[0]["model_kwargs"]["n_layer"] == 6
    assert requests[1]["input_shape"] == [3, 64, 64] and "seq_len" not in requests[1]


@pytest.mark.parametrize("change, detail", [
    ({"zoo": "hf", "filter": "gpt3"}, "filter: 'gpt3' matches none of the 7 hf models"),
    ({"zoo": "hf", "filter": "vit", "seq_len": 32}, "seq_len: none of the selected models takes token sequences"),
    ({"filter": "resnet18", "seq_len": 32}, "seq_len: none of the selected models takes token sequences"),
    ({"zoo": "hf", "filter": "gpt2", "input_shape": [3, 32, 32]}, "input_shape: every selected model takes token"),
])
def test_bad_hf_zoo_requests_are_422_and_record_nothing(client: TestClient, change: dict, detail: str) -> None:
    response = client.post("/v1/zoo", json={**ZOO, **change}, headers=AUTH)
    assert response.status_code == 422
    assert response.json()["detail"].startswith(detail), response.json()
    assert client.get("/v1/jobs").json()["count"] == 0
