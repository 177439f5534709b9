"""POST /v1/jobs records then enqueues; a dead broker is a recorded failure, never a 500."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable

import pytest
import redis
from fastapi.testclient import TestClient

from remat.service.celery_client import PROFILE_TASK
from tests.service.factories import AUTH, REDIS_URL

JOB = {"model": "torchvision:resnet152", "batch_size": 32, "input_shape": [3, 224, 224], "dtype": "float32",
       "device": "cuda"}


def test_job_with_the_broker_down_waits_for_it(client: TestClient) -> None:
    response = client.post("/v1/jobs", json=JOB, headers=AUTH)
    assert response.status_code == 202
    job = response.json()
    assert job["state"] == "pending" and job["finished_at"] is None and job["error"] is None
    assert job["message"].startswith("waiting for the broker (broker redis://127.0.0.1:")
    assert "unreachable" in job["message"]
    assert job["request"] == {**JOB, "mode": "train", "grads": "none"}
    assert job["kind"] == "profile" and job["queue"] == "cuda" and job["leader_id"] is None
    fetched = client.get(f"/v1/jobs/{job['id']}")
    assert fetched.status_code == 200 and fetched.json() == job


def test_spellings_of_one_request_are_one_job(client: TestClient) -> None:
    first = client.post("/v1/jobs", json={**JOB, "model": "resnet152"}, headers=AUTH).json()
    second = client.post("/v1/jobs", json=JOB, headers=AUTH).json()
    assert first["request"] == second["request"] and first["request"]["model"] == "torchvision:resnet152"
    assert second["leader_id"] == first["id"] and second["state"] == "queued"
    other = client.post("/v1/jobs", json={**JOB, "dtype": "autocast_bfloat16"}, headers=AUTH).json()
    assert other["leader_id"] is None and other["request"]["dtype"] == "autocast_bfloat16"


def test_job_is_enqueued_by_name_with_its_id_only(make_client: Callable[..., TestClient], redis_prefix: str) -> None:
    queue = f"{redis_prefix}cuda"
    client = make_client(broker_url=REDIS_URL, queue_prefix=redis_prefix)
    response = client.post("/v1/jobs", json=JOB, headers=AUTH)
    assert response.status_code == 202 and response.json()["state"] == "queued"
    job_id = response.json()["id"]
    broker = redis.Redis.from_url(REDIS_URL)
    try:
        (raw,) = broker.lrange(queue, 0, -1)
        message = json.loads(raw)
        assert message["headers"]["task"] == PROFILE_TASK and message["headers"]["id"] == job_id
        args, kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        assert (args, kwargs) == ([job_id], {})
    finally:
        broker.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
        broker.close()
    listed = client.get("/v1/jobs", params={"state": "queued"}).json()
    assert listed["count"] == 1 and listed["data"][0]["id"] == job_id


@pytest.mark.parametrize("change, detail", [
    ({"batch_size": 0}, "batch_size: Input should be greater than or equal to 1"),
    ({"input_shape": []}, "input_shape: List should have at least 1 item"),
    ({"input_shape": [3, -1]}, "input_shape[1]: Input should be greater than or equal to 1"),
    ({"input_shape": [65536, 65536, 65536]}, "input_shape: batch_size x input_shape is"),
    ({"dtype": "int8"}, "dtype: String should match pattern"),
    ({"model": "resnet1888"}, "model: unknown model 'resnet1888'; close matches: resnet18"),
    ({"queue": "cpu"}, "queue: 'cpu' is not a queue of device 'cuda'"),
    ({"queue": "gpu"}, "queue: String should match pattern"),
    ({"device": "tpu"}, "device: Input should be"),
    ({"model": "rm -rf /; resnet"}, "model: String should match pattern"),
    ({"model": "os:system"}, "model: unknown model source 'os'"),  # workers never import what a request names
    ({"model": "timm:resnet18"}, "model: unknown model source 'timm'"),
    ({"model_kwargs": {"num_classes": 3}}, "model_kwargs: a service's workers build torchvision models with their "
                                           "default arguments"),
    ({"seq_len": 64}, "seq_len: torchvision:resnet152 takes images"),
    ({"model": "vit_b_16", "input_shape": [3, 64, 64]},  # the worker's refusal named --input-shape, minutes later
     "input_shape: torchvision:vit_b_16 is built for [3, 224, 224] images only (a service builds torchvision models "
     "with their default arguments), got [3, 64, 64]"),
    ({"model": "maxvit_t", "input_shape": [3, 128, 128]}, "input_shape: torchvision:maxvit_t is built for "
                                                          "[3, 224, 224] images only"),
    ({"seq_len": 0}, "seq_len: Input should be greater than or equal to 1"),
    ({"priority": 1}, "priority: Extra inputs are not permitted"),
])
def test_bad_job_requests_are_422_naming_the_field(client: TestClient, change: dict, detail: str) -> None:
    response = client.post("/v1/jobs", json={**JOB, **change}, headers=AUTH)
    assert response.status_code == 422
    assert response.json()["detail"].startswith(detail)


def test_unknown_and_malformed_job_ids(client: TestClient) -> None:
    missing = client.get("/v1/jobs/00000000-0000-4000-8000-000000000000")
    assert missing.status_code == 404 and missing.json()["detail"].startswith("job_id: no job")
    assert client.get("/v1/jobs/not-a-uuid").status_code == 422
    malformed = client.post("/v1/jobs", content=b'{"model": ', headers={**AUTH, "Content-Type": "application/json"})
    assert malformed.status_code == 422 and malformed.json()["detail"].startswith("body: not valid JSON")


HF_JOB = {"model": "hf:gpt2", "batch_size": 2, "input_shape": [64], "device": "cpu",
          "model_kwargs": {"n_layer": 2, "n_embd": 64, "n_head": 2}}


def test_an_hf_job_is_recorded_with_its_sequence_length_and_configuration(client: TestClient) -> None:
    pytest.importorskip("transformers")
    response = client.post("/v1/jobs", json={**HF_JOB, "model": "hf:GPT2"}, headers=AUTH)
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["request"] == {"model": "hf:gpt2", "batch_size": 2, "input_shape": [64], "seq_len": 64,
                              "dtype": "float32", "device": "cpu", "mode": "train", "grads": "none",
                              "model_kwargs": {"n_layer": 2, "n_embd": 64, "n_head": 2}}
    same = client.post("/v1/jobs", json={**HF_JOB, "seq_len": 64}, headers=AUTH).json()
    assert same["leader_id"] == job["id"]  # [64] alone and with seq_len 64 are one request
    vit = client.post("/v1/jobs", json={"model": "hf:vit", "batch_size": 2, "input_shape": [3, 32, 32],
                                        "device": "cpu", "model_kwargs": {"image_size": 32, "num_labels": 3}},
                      headers=AUTH)
    assert vit.status_code == 202, vit.text
    assert "seq_len" not in vit.json()["request"]
    clip = client.post("/v1/jobs", json={"model": "hf:clip", "batch_size": 2, "input_shape": [16], "device": "cpu",
                                         "model_kwargs": {"text_config": {"num_hidden_layers": 1},
                                                          "vision_config": {"image_size": 32}}},
                       headers=AUTH)
    assert clip.status_code == 202, clip.text  # two towers: [seq_len], the images sized by vision_config
    assert clip.json()["request"]["seq_len"] == 16
    assert clip.json()["request"]["model_kwargs"]["vision_config"] == {"image_size": 32}


@pytest.mark.parametrize("change, detail", [
    ({"model": "hf:gtp2"}, "model: unknown hf: architecture 'gtp2'; did you mean gpt2? (known: gpt2, llama"),
    ({"model": "hf:some/config.json"}, "model: 'hf:some/config.json' names a file; a service's workers build "
                                       "hf:NAME models only"),
    ({"model": "hf:/etc/config.json"}, "model: 'hf:/etc/config.json' names a file"),
    ({"model": "hf:config.json"}, "model: 'hf:config.json' names a file"),
    ({"model_kwargs": {"n_layers": 2}}, "model_kwargs: hf:gpt2's configuration has no field 'n_layers' (did you "
                                        "mean n_layer"),
    ({"model_kwargs": {"n_layer": {"a": 1}}}, "model_kwargs: n_layer: an object sets the fields of a "
                                            "sub-configuration, and n_layer is not one of hf:gpt2's"),
    ({"model_kwargs": {"auto_map": "x.y"}}, "model_kwargs: auto_map cannot be set"),
    ({"model": "hf:llama", "model_kwargs": {"hidden_size": 65, "num_attention_heads": 4}},
     "model_kwargs: model hf:llama: the configuration is refused: StrictDataclassClassValidationError"),
    ({"input_shape": [3, 64]}, "input_shape: hf:gpt2 takes token ids: input_shape is [seq_len]"),
    ({"seq_len": 32}, "seq_len: 32 but input_shape is [64]"),
    ({"model": "hf:vit", "model_kwargs": None, "input_shape": [3, 64, 64]},
     "input_shape: hf:vit trains at its configuration's image size [3, 224, 224]"),
    ({"model": "hf:vit", "model_kwargs": None, "input_shape": [3, 224, 224], "seq_len": 8},
     "seq_len: hf:vit takes images"),
    ({"model": "hf:clip", "model_kwargs": None, "input_shape": [3, 224, 224]},
     "input_shape: hf:clip takes token ids: input_shape is [seq_len]"),
    ({"model": "hf:clip", "model_kwargs": {"vision_config": {"image_size": 0}}, "input_shape": [16]},
     "model_kwargs: vision_config.image_size must be a positive integer"),
    ({"model": "hf:clip", "model_kwargs": {"text_config": {"n_layer": 1}}, "input_shape": [16]},
     "model_kwargs: hf:clip's text_config has no field 'n_layer'"),
    ({"model": "hf:clip", "model_kwargs": None, "input_shape": [100]},
     "seq_len: hf:clip takes captions of at most 77 tokens"),
])
def test_bad_hf_jobs_are_422_naming_the_field(client: TestClient, change: dict, detail: str) -> None:
    pytest.importorskip("transformers")
    response = client.post("/v1/jobs", json={**HF_JOB, **change}, headers=AUTH)
    assert response.status_code == 422, response.text
    assert response.json()["detail"].startswith(detail), response.json()
    assert client.get("/v1/jobs").json()["count"] == 0
