"""The client side of the shared plan cache, against the real service on a real socket.

One uvicorn server runs in a thread for the whole module (a temporary SQLite file, a write token, no Redis),
so every request goes through httpx, TCP and the ASGI stack as in a cluster. The model is ResNet-18 at
2×3×32×32: profiled once here, uploaded, then fetched and applied.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torchvision

from remat.client.apply_plan import applied_chain, apply
from remat.client.errors import PlanError, PlanNotFoundError, ServiceError
from remat.client.fetch import fetch_and_apply, fetch_plan
from remat.client.plan import Plan
from remat.client.plan_key import KEY_FIELDS, PlanKey
from remat.client.planning.planners import PLANNERS
from remat.client.request import default_request
from remat.client.service_client import PlanServiceClient, ServiceResponseError, key_query
from remat.worker import local
from tests.service.factories import TOKEN, closed_port_url
from tests.utils.cli import run_cli
from tests.utils.live_service import live_service

BATCH, SAMPLE = 2, (3, 32, 32)
SHAPE = (BATCH, *SAMPLE)
SMALL = ["resnet18", "--batch-size", str(BATCH), "--input-shape", ",".join(map(str, SAMPLE))]
ODD_SIGNATURE = 'input_ids: int64[2, 8]; mask: bool[2, 8]; scale=0.5; tag="a+b&c=d#e%f/g?h\\"'
"""A call signature with every character a query could misread."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The service on 127.0.0.1 at a port the kernel chose; stopped after the module."""
    with live_service(tmp_path_factory.mktemp("service")) as url:
        yield url


@pytest.fixture(scope="module")
def uploaded(server: str) -> dict[str, Any]:
    """ResNet-18's trace, profiled as ``remat-client trace`` does, uploaded with the write token."""
    request = default_request("resnet18", batch_size=BATCH, sample_shape=SAMPLE, device="cpu",
                                       grads="none")
    trace = local.profile_trace(request)
    with PlanServiceClient(server, token=TOKEN) as client:
        stored = client.upload_trace(trace)
    assert stored["created"] is True
    return stored


@pytest.fixture(autouse=True)
def _no_ambient_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("REMAT_API_TOKEN", "REMAT_SERVER"):
        monkeypatch.delenv(name, raising=False)




def _stored_plan(stored: dict[str, Any], algorithm: str) -> dict[str, Any]:
    return next(p for p in stored["plans"] if p["algorithm"] == algorithm)


# --- the HTTP client --------------------------------------------------------------------------------------

def test_fetch_plan_returns_the_stored_plan_with_its_key(server: str, uploaded: dict[str, Any]) -> None:
    model = torchvision.models.resnet18(weights=None)
    plan = fetch_plan(model, SHAPE, server=server)
    stored = _stored_plan(uploaded, "linear")
    assert plan.algorithm == "linear"
    assert list(plan.checkpoints) == stored["checkpoints"]
    assert plan.predicted_peak_bytes == stored["predicted_peak_bytes"]
    key = plan.extra["key"]
    assert key["model_hash"] == uploaded["key"]["model_hash"] and key["input_shape"] == list(SHAPE)
    assert key["torch_version"] == ".".join(torch.__version__.split(".")[:2])

    with PlanServiceClient(server) as client:  # reads need no token; an open client can be passed in
        uniform = fetch_plan(model, SHAPE, server=client, algorithm="uniform")
        assert list(uniform.checkpoints) == _stored_plan(uploaded, "uniform")["checkpoints"]
        health = client.health()  # this server has no broker: plans are served, jobs would wait
        assert health["status"] == "degraded" and health["database"]["ok"] and not health["broker"]["ok"]


def test_fetch_and_apply_trains_like_the_plain_model(server: str, uploaded: dict[str, Any]) -> None:
    torch.manual_seed(0)
    plain = torchvision.models.resnet18(weights=None)
    planned = torchvision.models.resnet18(weights=None)
    planned.load_state_dict(plain.state_dict())
    assert fetch_and_apply(planned, SHAPE, server=server) is planned
    x = torch.randn(SHAPE)
    for model in (plain, planned):
        model(x).square().mean().backward()
    for (name, p), q in zip(plain.named_parameters(), planned.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def _count_traces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every torch.fx trace of a model from here on appends to the list returned."""
    from remat.client.graph import fx_trace

    traces: list[int] = []
    original = fx_trace._Tracer.trace

    def counting(self: fx_trace._Tracer, *args: object, **kwargs: object) -> object:
        traces.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(fx_trace._Tracer, "trace", counting)
    return traces


def test_fetch_and_apply_traces_the_model_once_for_key_and_chain(server: str, uploaded: dict[str, Any],
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    from remat.client.graph import write_probe

    monkeypatch.setenv("REMAT_PLAN_CACHE_DIR", str(tmp_path))  # where the probe facts of the key are kept
    traces = _count_traces(monkeypatch)
    fetch_and_apply(torchvision.models.resnet18(weights=None), SHAPE, server=server)
    assert len(traces) == 1, f"traced {len(traces)} times for the key and the chain"
    probes: list[int] = []
    monkeypatch.setattr(write_probe.RecordingInterpreter, "run", lambda *a, **k: probes.append(1))
    again = torchvision.models.resnet18(weights=None)
    fetch_and_apply(again, SHAPE, server=server)
    assert len(traces) == 2 and probes == [], "a second model cuts its chain from the key's cached probe facts"
    assert applied_chain(again) is not None


def test_apply_cuts_the_chain_from_the_trace_it_hashed(server: str, uploaded: dict[str, Any],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    model = torchvision.models.resnet18(weights=None)
    plan = fetch_plan(model, SHAPE, server=server)
    traces = _count_traces(monkeypatch)
    apply(model, plan)
    assert len(traces) == 1, f"apply traced {len(traces)} times for its hash check and the chain"


def test_a_missing_key_is_a_plan_error_that_says_how_to_create_one(server: str, uploaded: dict[str, Any]) -> None:
    with pytest.raises(PlanNotFoundError) as info:
        fetch_plan(torchvision.models.resnet18(weights=None), (1, *SAMPLE), server=server)
    message = str(info.value)
    assert isinstance(info.value, PlanError)
    assert "no linear plan" in message and "input_shape [1, 3, 32, 32]" in message and server in message
    assert "remat-client trace" in message and "/v1/traces" in message and "/v1/jobs" in message
    assert "\n" not in message
    with PlanServiceClient(server) as client:  # the client itself says "nothing" with None
        assert client.get_plan({**uploaded["key"], "input_shape": [1, 3, 32, 32]}) is None


@pytest.mark.parametrize("token, problem", [(None, "none was given"), ("wrong-token", "token was refused")])
def test_upload_without_the_write_token_names_the_token_problem(server: str, token: str | None,
                                                                problem: str) -> None:
    trace = {"format": "remat-trace/1", "input_bytes": 8, "stages": [{"name": "a", "output_bytes": 8,
                                                                       "saved_bytes": 0}]}
    with PlanServiceClient(server, token=token) as client, pytest.raises(ServiceResponseError) as info:
        client.upload_trace(trace)
    assert info.value.status_code == 401 and problem in str(info.value) and "REMAT_API_TOKEN" in str(info.value)


def test_service_error_details_are_carried(server: str) -> None:
    with PlanServiceClient(server, token=TOKEN) as client:
        with pytest.raises(ServiceResponseError) as info:
            client.upload_trace({"format": "remat-trace/1", "input_bytes": 8, "stages": []})
        assert info.value.status_code == 422 and "stages" in info.value.detail
        with pytest.raises(ServiceError, match="HTTP 422: input_shape"):
            client.get_plan({"model_hash": "abc", "input_shape": "x"})


def test_an_unreachable_server_is_one_line_naming_the_url() -> None:
    url = closed_port_url("http").removesuffix("/0")
    with PlanServiceClient(url, timeout=2) as client, pytest.raises(ServiceError) as info:
        client.get_plan({"model_hash": "abc", "input_shape": [1]})
    message = str(info.value)
    assert message.startswith(f"remat service {url}/v1/plans/abc: cannot connect") and "\n" not in message


def test_a_wrong_base_url_is_not_mistaken_for_a_missing_plan(server: str) -> None:
    with PlanServiceClient(server + "/nothing-here") as client, pytest.raises(ServiceResponseError) as info:
        client.get_plan({"model_hash": "abc", "input_shape": [1]})
    assert info.value.status_code == 404


def test_a_lookup_sends_every_key_field_and_a_short_mapping_means_the_key_defaults() -> None:
    path, params = key_query({"model_hash": "abc", "input_shape": [2, 3]})
    assert path == "/v1/plans/abc" and set(params) == {*KEY_FIELDS, "algorithm"} - {"model_hash"}
    key = PlanKey(model_hash="abc", input_shape=(2, 3), torch_version="unknown")
    assert {name: params[name] for name in KEY_FIELDS if name not in ("model_hash", "input_shape")} == \
        {name: str(value) for name, value in key.to_dict().items() if name not in ("model_hash", "input_shape")}
    assert key_query(key) == (path, params)
    _, with_inputs = key_query({"model_hash": "abc", "input_shape": [2, 3], "inputs": ODD_SIGNATURE})
    assert with_inputs == {**params, "inputs": ODD_SIGNATURE}


def test_a_call_signature_travels_whole_and_picks_its_own_plan(server: str) -> None:
    """A key's inputs go into the query percent-encoded (';', '+', '&', '#', '%', quotes and spaces included):
    the service reads them as written and answers the plan of that call, not the single-tensor one."""
    stages = [{"name": f"s{i}", "output_bytes": 1000 * i, "saved_bytes": 100 * i} for i in range(1, 5)]
    base = {"format": "remat-trace/1", "input_bytes": 64, "model_hash": "sig-arch", "input_shape": [2, 8],
            "dtype": "float32", "device": "cpu", "torch_version": "2.5"}
    with PlanServiceClient(server, token=TOKEN) as client:
        one = client.upload_trace({**base, "stages": stages})
        several = client.upload_trace({**base, "inputs": ODD_SIGNATURE,
                                       "stages": [{**s, "saved_bytes": 7 * s["saved_bytes"]} for s in stages]})
        assert several["key"]["inputs"] == ODD_SIGNATURE
        key = PlanKey.from_dict(several["key"])
        record = client.get_plan(key)
        assert record is not None and record["key"] == several["key"]
        assert record["trace"]["trace_id"] == several["trace_id"]
        by_mapping = client.get_plan({**several["key"], "torch_version": None})
        assert by_mapping is not None and by_mapping["trace"]["trace_id"] == several["trace_id"]
        plain = client.get_plan({**one["key"]})
        assert plain is not None and plain["key"]["inputs"] == "" and plain["trace"]["trace_id"] == one["trace_id"]
        assert client.get_plan({**several["key"], "inputs": ODD_SIGNATURE[:-1]}) is None


def test_a_service_that_ignores_the_call_signature_is_not_taken_at_its_word() -> None:
    """A service older than the inputs field answers every call with the single-tensor plan of its shape."""
    served_key = {"model_hash": "abc", "input_shape": [2, 8], "dtype": "float32", "mode": "train",
                  "grads": "none", "device": "cpu", "torch_version": "2.5"}  # no inputs: an older service
    seen: list[httpx.URL] = []
    plan = Plan(algorithm="linear", cost_model="pytorch", checkpoints=(1,), predicted_peak_bytes=1,
                baseline_peak_bytes=2, num_stages=3)

    def old_service(request: httpx.Request) -> httpx.Response:
        seen.append(request.url)
        return httpx.Response(200, json={"key": served_key, "plan": plan.to_dict()})

    with PlanServiceClient("http://plans.test", transport=httpx.MockTransport(old_service)) as client:
        assert client.get_plan({"model_hash": "abc", "input_shape": [2, 8]})["key"] == served_key
        with pytest.raises(ServiceError, match="another call signature"):
            client.get_plan({"model_hash": "abc", "input_shape": [2, 8], "inputs": ODD_SIGNATURE})
    assert seen[0].params["inputs"] == "" and seen[1].params["inputs"] == ODD_SIGNATURE
    assert "#" not in str(seen[1]) and "&c=" not in str(seen[1])  # nothing of the signature escapes its value


def test_the_client_module_imports_no_heavy_packages() -> None:
    probe = ("import sys\n"
             "import remat.client, remat.client.service_client\n"
             "print(sorted(m for m in ('torch', 'sqlalchemy', 'celery', 'fastapi') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# --- remat-client plan MODEL --server URL -----------------------------------------------------------------

def test_cli_shows_the_service_plans_with_their_measurements(capsys, server: str, uploaded: dict[str, Any]) -> None:
    measured = {"key": uploaded["key"], "algorithm": "linear", "measured_peak_bytes": 123_456, "step_ms": 42.0}
    response = httpx.post(f"{server}/v1/measurements", json=measured, headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 201, response.text

    code, out, err = run_cli(capsys, "plan", *SMALL, "--server", server, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["from_store"] is True and report["server"] == server
    assert report["key"]["model_hash"] == uploaded["key"]["model_hash"]
    assert [p["algorithm"] for p in report["plans"]] == list(PLANNERS)
    by_name = {p["algorithm"]: p for p in report["plans"]}
    assert by_name["linear"]["checkpoints"] == _stored_plan(uploaded, "linear")["checkpoints"]
    assert by_name["linear"]["measured_peak_bytes"] == 123_456 and by_name["linear"]["step_ms"] == 42.0
    assert by_name["uniform"]["measured_peak_bytes"] is None and by_name["uniform"]["step_ms"] is None
    assert all(p["key"] == report["key"] for p in report["plans"])  # each plan applies on its own


def test_cli_without_a_plan_or_token_exits_1_with_one_line(capsys, server: str, uploaded: dict[str, Any],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REMAT_SERVER", server)  # the environment variable works as --server
    code, out, err = run_cli(capsys, "plan", "resnet18", "--batch-size", "4", "--input-shape", "3,32,32", "--json")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "has no plans for torchvision:resnet18" in err and "REMAT_API_TOKEN" in err


def test_cli_with_a_token_profiles_uploads_and_shows_unmeasured_plans(capsys, server: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REMAT_API_TOKEN", TOKEN)
    code, out, err = run_cli(capsys, "plan", "resnet18", "--batch-size", "3", "--input-shape", "3,32,32",
                             "--server", server)
    assert code == 0, err
    assert "planned by the service" in " ".join(out.split())  # the table's title wraps with its width
    linear_row = next(line for line in out.splitlines() if " linear " in line)
    assert linear_row.count(" - ") >= 2  # measured peak and saving: nothing measured yet
    # The service now has them for everyone: without the token, the same request answers from it.
    monkeypatch.delenv("REMAT_API_TOKEN")
    code, out, err = run_cli(capsys, "plan", "resnet18", "--batch-size", "3", "--input-shape", "3,32,32",
                             "--server", server, "--json")
    assert code == 0, err
    assert json.loads(out)["from_store"] is True


def test_cli_unreachable_server_exits_1_with_one_line(capsys) -> None:
    url = closed_port_url("http").removesuffix("/0")
    code, out, err = run_cli(capsys, "plan", *SMALL, "--server", url)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and f"{url}/healthz: cannot connect" in err


@pytest.mark.parametrize("args, message", [
    (["--server", "localhost:8000"], "server URL"),
    (["--server", "ftp://127.0.0.1:8000"], "server URL 'ftp://127.0.0.1:8000': expected http://HOST"),
    (["--server", "http://"], "server URL 'http://': expected"),
    (["--server", "http://127.0.0.1:99999"], "server URL 'http://127.0.0.1:99999': expected"),
    (["--server", "http://[::1:8000"], "server URL"),
    (["--server", "http://127.0.0.1:1", "--refresh"], "REMAT_API_TOKEN"),
])
def test_cli_bad_server_arguments_exit_2(capsys, args: list[str], message: str) -> None:
    code, _, err = run_cli(capsys, "plan", *SMALL, *args)
    assert code == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("command", [["status", "0b6d2c5e-1111-2222-3333-444455556666"], ["submit", "resnet18"],
                                     ["zoo", "torchvision", "--filter", "resnet18"]])
def test_every_command_names_a_server_url_it_cannot_use_as_input(capsys, monkeypatch: pytest.MonkeyPatch,
                                                                 command: list[str]) -> None:
    """Not an http(s) URL with a host: exit 2 before any request, not exit 1 as a failed request."""
    monkeypatch.setenv("REMAT_API_TOKEN", TOKEN)
    code, _, err = run_cli(capsys, *command, "--server", "ftp://127.0.0.1:8000")
    assert code == 2 and "server URL 'ftp://127.0.0.1:8000': expected http://HOST" in err, err


def test_cli_server_with_a_trace_file_exits_2(capsys, tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"format": "remat-trace/1", "input_bytes": 8,
                                 "stages": [{"name": "a", "output_bytes": 8, "saved_bytes": 0}]}))
    code, _, err = run_cli(capsys, "plan", "--trace", str(trace), "--server", "http://127.0.0.1:1")
    assert code == 2 and "--server applies to MODEL" in err


def test_fetch_and_apply_takes_one_call_of_several_inputs(server: str) -> None:
    """A transformer's trace made as a worker makes it (an hf: request), fetched for the model a script holds
    with one training call's keyword inputs, and trained bit-equal to the plain model (dropout on)."""
    pytest.importorskip("transformers")
    from remat.client.hf_models import build_hf_model
    from remat.client.request import ModelRequest

    tiny = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 500}
    request = ModelRequest(spec="hf:gpt2", batch_size=2, sample_shape=(32,), seq_len=32, model_kwargs=tiny)
    with PlanServiceClient(server, token=TOKEN) as client:
        client.upload_trace(local.profile_trace(request))
    plain = build_hf_model("hf:gpt2", tiny)
    planned = build_hf_model("hf:gpt2", tiny)
    planned.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 500, (2, 32))
    batch = {"input_ids": ids, "labels": ids.clone()}
    assert fetch_and_apply(planned, batch, server=server) is planned
    from remat.client.apply_plan import applied_plan

    assert applied_plan(planned).extra["key"]["inputs"] == "input_ids: int64[2, 32]; labels: int64[2, 32]"
    for model in (plain, planned):
        torch.manual_seed(3)
        model(**batch).loss.backward()
    for (name, p), q in zip(plain.named_parameters(), planned.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
