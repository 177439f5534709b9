"""Hostile servers (issue 31, suite (d)): the client against a loopback server that answers foreign JSON,
truncated JSON, NaN, a trickle, a 200 that never ends, a body past any cap or a redirect loop.

For each, ``PlanServiceClient`` raises its documented ``ServiceError`` (one line, naming the field when the JSON
is of the wrong shape) and ``remat.client.checkpoint()`` warns and falls back as docs/apply.md says — never an
``AttributeError``/``KeyError``/``TypeError``, and never waiting on the service past its deadline + 1 s. The
deadline is small (``TIMEOUT_S``) so that the suite stays fast; elapsed times are bounds, not targets.
The last tests hold the other side: the real service's answers pass the client's checks.
"""

from __future__ import annotations

import json
import re
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import remat.client
from remat.client import plan_lookup
from remat.client.apply_plan import applied_plan
from remat.client.errors import ServiceError
from remat.client.plan import Plan
from remat.client.plan_key import PlanKey
from remat.client.service_client import MAX_ANSWER_BYTES, PlanServiceClient
from tests.service.factories import TOKEN, closed_port_url
from tests.utils import hostile_server as hostile
from tests.utils.cli import run_cli
from tests.utils.user_model import user_model

TIMEOUT_S = 1.0
MARGIN_S = 1.0
"""The bound every test holds: the deadline plus this (issue 31: "never past its deadline + 1 s")."""
KEY = {"model_hash": "abc", "input_shape": [2, 3, 8, 8]}
JOB_ID = "0" * 8 + "-0000-0000-0000-" + "0" * 12


def _record(**changes: Any) -> dict[str, Any]:
    """A plan record as the service serves it (service/schemas.py ``PlanRecordOut``), ``changes`` applied as
    ``{"plan.num_stages": value}`` (a dotted path; ``...: DELETE`` removes the field)."""
    plan = Plan(algorithm="linear", cost_model="pytorch", checkpoints=(2,), predicted_peak_bytes=100,
                baseline_peak_bytes=200, num_stages=4, recompute_ms=1.0, step_ms=10.0)
    key = PlanKey(model_hash="abc", input_shape=(2, 3, 8, 8), torch_version="2.5")
    record: dict[str, Any] = {
        "plan_id": 1, "key": key.to_dict(), "plan": plan.to_dict(),
        "trace": {"trace_id": 1, "content_sha256": "0" * 64, "model": None, "device_name": "cpu",
                  "torch_version": "2.5.1", "batch_size": 2, "created_at": "2025-01-01T00:00:00Z"},
        "measurements": [{"algorithm": "linear", "measured_peak_bytes": 90, "step_ms": 11.0}],
        "created_at": "2025-01-01T00:00:00Z", "updated_at": "2025-01-01T00:00:00Z"}
    for path, value in changes.items():
        *parents, name = path.split(".")
        target = record
        for parent in parents:
            target = target[parent]
        if value is DELETE:
            del target[name]
        else:
            target[name] = value
    return record


DELETE = object()


def _json_with(record: dict[str, Any], old: str, new: str) -> bytes:
    """The record's JSON with one literal replaced (what json.dumps cannot write: NaN, a cut)."""
    text = json.dumps(record)
    assert old in text
    return text.replace(old, new, 1).encode()


FIELD = r"; is this a remat service\?"
HOSTILE = [
    # Valid JSON of the wrong shape: the message names the field.
    pytest.param(hostile.answer([]), r"answer: expected an object, got an array" + FIELD, id="array"),
    pytest.param(hostile.answer({"plan": 3}), r"plan: expected an object, got 3" + FIELD, id="plan-is-3"),
    pytest.param(hostile.answer({"detail": "hello"}), r"plan: missing", id="foreign-object"),
    pytest.param(hostile.answer(_record(**{"plan.num_stages": DELETE})), r"plan\.num_stages: missing" + FIELD,
                 id="plan-field-missing"),
    pytest.param(hostile.answer(_record(**{"plan.num_stages": "many"})),
                 r"plan\.num_stages: expected an integer, got 'many'", id="plan-field-wrong-type"),
    pytest.param(hostile.answer(_record(**{"plan.checkpoints": [9]})), r"plan: checkpoints: boundary 9 is not in",
                 id="plan-checkpoint-out-of-range"),
    pytest.param(hostile.answer(_record(key=DELETE)), r"key: missing", id="key-missing"),
    pytest.param(hostile.answer(_record(**{"key.input_shape": "wide"})), r"key: input_shape", id="key-malformed"),
    pytest.param(hostile.answer(_record(trace=[])), r"trace: expected an object, got an array", id="trace-array"),
    pytest.param(hostile.answer(_record(**{"trace.torch_version": 2.5})),
                 r"trace\.torch_version: expected a string or null, got 2\.5", id="trace-field-wrong-type"),
    pytest.param(hostile.answer(_record(measurements="none")), r"measurements: expected an array",
                 id="measurements-string"),
    pytest.param(hostile.answer(_record(measurements=[{"measured_peak_bytes": "90"}])),
                 r"measurements\[0\]\.measured_peak_bytes: expected an integer or null", id="measurement-wrong-type"),
    # Not JSON remat accepts.
    pytest.param(hostile.answer(_json_with(_record(), '"predicted_peak_bytes": 100', '"predicted_peak_bytes": NaN')),
                 r"plan\.predicted_peak_bytes: NaN is not a number remat accepts", id="nan"),
    pytest.param(hostile.answer(json.dumps(_record())[:60]), r"answer: not valid JSON", id="truncated-json"),
    pytest.param(hostile.answer(b"<html>plans</html>", content_type="text/html"), r"answer: not valid JSON",
                 id="html"),
    pytest.param(hostile.truncated(json.dumps(_record()).encode()), r"request failed \(RemoteProtocolError",
                 id="truncated-body"),
    # Time and size.
    pytest.param(hostile.trickle(json.dumps(_record()).encode(), 0.5), r"no whole answer within 1 s",
                 id="trickle-body"),
    pytest.param(hostile.trickle_headers(0.5), r"no whole answer within 1 s", id="trickle-headers"),
    pytest.param(hostile.endless(0.05), r"no whole answer within 1 s", id="endless-200"),
    pytest.param(hostile.endless(0, 65536, limit=MAX_ANSWER_BYTES + 2**20),
                 rf"an answer longer than the {MAX_ANSWER_BYTES} bytes the client reads|no whole answer within 1 s",
                 id="endless-200-fast"),
    pytest.param(hostile.huge(2**40, MAX_ANSWER_BYTES + 2**20),
                 rf"an answer of {2**40} bytes, more than the {MAX_ANSWER_BYTES} the client reads", id="huge-body"),
    pytest.param(hostile.redirect_loop(), r"answered a redirect \(HTTP 307 to /v1/plans/\w+\?", id="redirect-loop"),
]


def _one_line(message: str) -> None:
    assert "\n" not in message and len(message) < 600, message


@pytest.mark.parametrize(("behaviour", "message"), HOSTILE)
def test_the_client_raises_its_one_error_within_the_deadline(behaviour: hostile.Behaviour, message: str) -> None:
    with hostile.hostile_server(behaviour) as url, PlanServiceClient(url, timeout=TIMEOUT_S) as client:
        started = time.monotonic()
        with pytest.raises(ServiceError) as info:
            client.get_plan(KEY)
        elapsed = time.monotonic() - started
    assert elapsed < TIMEOUT_S + MARGIN_S, f"held the client {elapsed:.1f} s"
    assert info.value.args[0].startswith(f"remat service {url}/v1/plans/abc")
    assert re.search(message, str(info.value)), str(info.value)
    _one_line(str(info.value))


@pytest.mark.parametrize("method", ["health", "upload_trace", "submit_job", "get_job", "submit_zoo", "get_zoo"])
@pytest.mark.parametrize(("behaviour", "message"), [
    pytest.param(hostile.answer({"id": 3, "state": ["running"], "status": 1, "created": "yes", "total": "all"}),
                 r": expected ", id="foreign-object"),
    pytest.param(hostile.trickle_headers(0.2), r"no whole answer within 0\.5 s", id="trickle-headers"),
])
def test_every_call_checks_its_answer_and_keeps_the_deadline(method: str, behaviour: hostile.Behaviour,
                                                             message: str) -> None:
    arguments: dict[str, tuple[Any, ...]] = {
        "health": (), "upload_trace": ({"format": "remat-trace/1"},), "get_job": (JOB_ID,),
        "submit_job": ({"model": "torchvision:resnet18", "batch_size": 1, "input_shape": [3, 8, 8]},),
        "submit_zoo": ({"zoo": "torchvision"},), "get_zoo": (JOB_ID,)}
    timeout = TIMEOUT_S / 2  # a shorter deadline than the others' (and a faster trickle): every call goes the one way
    with hostile.hostile_server(behaviour) as url, PlanServiceClient(url, token="t", timeout=timeout) as client:
        started = time.monotonic()
        with pytest.raises(ServiceError, match=message) as info:
            getattr(client, method)(*arguments[method])
        assert time.monotonic() - started < timeout + MARGIN_S
    _one_line(str(info.value))


# --- remat.client.checkpoint() --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One local store for the module (made once; checkpoint() only reads it here)."""
    return tmp_path_factory.mktemp("hostile-store")


@pytest.fixture
def cache_dir(store_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty plan cache of the test's own (a plan one test let in must not answer the next), the module's
    local store, no ambient service."""
    monkeypatch.setenv("REMAT_DATABASE_URL", f"sqlite:///{store_dir / 'local.sqlite'}")
    for name in ("REMAT_SERVER", "REMAT_API_TOKEN", "REMAT_TIMEOUT_S"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "plans"


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Seconds each service lookup of checkpoint() took (a single plan, or a budget's two requests)."""
    took: list[float] = []

    def timed(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.monotonic()
            try:
                return original(*args, **kwargs)
            finally:
                took.append(time.monotonic() - started)
        return run

    monkeypatch.setattr(plan_lookup, "_from_service", timed(plan_lookup._from_service))
    monkeypatch.setattr(plan_lookup, "_budget_from_service", timed(plan_lookup._budget_from_service))
    return took


def _example() -> tuple[torch.nn.Module, torch.Tensor]:
    return user_model(depth=2, channels=4), torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def _warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize(("behaviour", "message"), HOSTILE)
def test_checkpoint_warns_and_trains_without_a_plan(behaviour: hostile.Behaviour, message: str, cache_dir: Path,
                                                    lookups: list[float]) -> None:
    model, x = _example()
    with hostile.hostile_server(behaviour) as url, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert remat.client.checkpoint(model, x, server=url, timeout_s=TIMEOUT_S, on_miss="none",
                                       cache_dir=cache_dir) is model
    assert applied_plan(model) is None
    said = _warnings(caught)
    assert any("plan service is not answering" in w and re.search(message, w) for w in said), said
    assert any("training without checkpointing" in w for w in said), said
    assert len(lookups) == 1 and lookups[0] < TIMEOUT_S + MARGIN_S, f"the lookup took {lookups} s"


@pytest.mark.parametrize("behaviour", [
    pytest.param(hostile.answer(_record(**{"plan.predicted_peak_bytes": "100"})), id="foreign"),
    pytest.param(hostile.endless(0.05), id="endless-200"),
])
def test_a_budget_lookup_warns_and_trains_without_a_plan(behaviour: hostile.Behaviour, cache_dir: Path,
                                                         lookups: list[float]) -> None:
    model, x = _example()
    with hostile.hostile_server(behaviour) as url, pytest.warns(RuntimeWarning) as caught:
        remat.client.checkpoint(model, x, server=url, timeout_s=TIMEOUT_S, budget="70%", on_miss="none",
                                cache_dir=cache_dir)
    assert applied_plan(model) is None
    assert any("plan service is not answering" in w for w in _warnings(caught.list))
    assert len(lookups) == 1 and lookups[0] < TIMEOUT_S + MARGIN_S


def _by_algorithm(fast: bytes, slow: hostile.Behaviour, seconds: float) -> hostile.Behaviour:
    """The ``none`` plan, sent whole over ``seconds``; every other request gets ``slow``."""

    def behave(conn: hostile.Connection) -> None:
        if b"algorithm=none" not in conn.head:
            slow(conn)
            return
        head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(fast)}\r\n\r\n".encode()
        conn.send(head)
        pieces = 10
        for i in range(pieces):
            if not (conn.pause(seconds / pieces) and conn.send(fast[i * len(fast) // pieces:(i + 1) * len(fast) //
                                                                pieces])):
                return

    return behave


def test_a_budget_lookups_two_requests_share_one_deadline(cache_dir: Path, lookups: list[float]) -> None:
    """The ``none`` plan comes slowly but within the deadline, the budget plan never: each request alone keeps
    the deadline, and the two together must too."""
    timeout = 2.0
    model, x = _example()
    none = _record(**{"plan.algorithm": "none", "plan.checkpoints": []})
    with hostile.hostile_server(_by_algorithm(json.dumps(none).encode(), hostile.trickle_headers(0.2),
                                              0.6 * timeout)) as url, pytest.warns(RuntimeWarning) as caught:
        remat.client.checkpoint(model, x, server=url, timeout_s=timeout, budget="70%", on_miss="none",
                                cache_dir=cache_dir)
    assert any("plan service is not answering" in w for w in _warnings(caught.list))
    assert len(lookups) == 1 and lookups[0] < timeout + MARGIN_S, f"the lookup took {lookups[0]:.1f} s"


def test_on_miss_profile_plans_here_and_keeps_the_plan_when_the_upload_fails(
        cache_dir: Path, lookups: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.client.report import ProfileResult
    from remat.client.trace import make_trace
    from remat.worker import local

    def profile_here(built: Any, algorithm: str, progress: Any = None, *, budget: Any = None) -> Any:
        """A stand-in for profiling (tests/client/test_checkpoint_call.py profiles for real): its plan
        checkpoints nothing, its trace is one the service would take."""
        n = built.chain.num_stages
        plan = Plan(algorithm=algorithm, cost_model="pytorch", checkpoints=(), predicted_peak_bytes=n,
                    baseline_peak_bytes=n, num_stages=n)
        trace = make_trace([1] * n, **built.key.to_dict())
        return ProfileResult(request=built.request, key=built.key, trace=trace, plans=(plan,)), plan

    monkeypatch.setattr(local, "plan_held_model", profile_here)
    model, x = _example()
    behaviour = hostile.answer({"plan": {"algorithm": "linear"}, "key": {}, "created": True})  # foreign everywhere
    with hostile.hostile_server(behaviour) as url, pytest.warns(RuntimeWarning) as caught:
        remat.client.checkpoint(model, x, server=url, token=TOKEN, timeout_s=TIMEOUT_S, cache_dir=cache_dir)
    plan = applied_plan(model)
    assert plan is not None and plan.algorithm == "linear", "profiled here"
    said = _warnings(caught.list)
    assert any("plan service is not answering" in w and "plan.cost_model: missing" in w for w in said), said
    assert any("the trace was not uploaded" in w and "key: " in w for w in said), said
    assert len(lookups) == 1 and lookups[0] < TIMEOUT_S + MARGIN_S


# --- the CLI ----------------------------------------------------------------------------------------------------

SERVICE_COMMANDS = [
    pytest.param(["submit", "resnet18", "--device", "cpu"], id="submit"),
    pytest.param(["status", JOB_ID], id="status"),
    pytest.param(["plan", "resnet18", "--batch-size", "1", "--input-shape", "3,8,8"], id="plan"),
    pytest.param(["zoo", "torchvision", "--filter", "resnet18", "--device", "cpu"], id="zoo"),
]


@pytest.mark.parametrize("args", SERVICE_COMMANDS)
def test_every_command_that_talks_to_the_service_keeps_the_timeout_setting(
        args: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REMAT_TIMEOUT_S", str(TIMEOUT_S))
    monkeypatch.setenv("REMAT_API_TOKEN", TOKEN)
    # The command's own cost (imports, building the request), against a port that refuses at once.
    started = time.monotonic()
    code, _, _ = run_cli(capsys, *args, "--server", closed_port_url("http"))
    own = time.monotonic() - started
    assert code == 1
    with hostile.hostile_server(hostile.trickle_headers(0.5)) as url:
        started = time.monotonic()
        code, out, err = run_cli(capsys, *args, "--server", url)
        elapsed = time.monotonic() - started
    assert code == 1 and "no whole answer within 1 s" in err, err
    assert err.count("\n") == 1
    assert elapsed < own + TIMEOUT_S + MARGIN_S, f"{elapsed:.1f} s (the command alone: {own:.1f} s)"


# --- the other side: the real service's answers pass ------------------------------------------------------------

@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    from tests.utils.live_service import live_service

    directory = tmp_path_factory.mktemp("service")
    with live_service(directory) as url:
        yield url, directory / "plans.sqlite"


def test_the_real_services_answers_pass_the_clients_checks(service: tuple[str, Path]) -> None:
    from remat.service import jobs
    from remat.service.db import Database
    from tests.service.factories import trace_dict

    url, database = service
    with PlanServiceClient(url, token=TOKEN) as client:
        assert client.health()["status"] in ("ok", "degraded")
        stored = client.upload_trace(trace_dict(model_hash="hostile-contract"))
        assert stored["created"] is True and stored["plans"]
        record = client.get_plan(stored["key"])
        assert record is not None and record["plan"]["algorithm"] == "linear"
        job = client.submit_job({"model": "torchvision:resnet18", "batch_size": 1, "input_shape": [3, 32, 32],
                                 "device": "cpu"})
        batch = client.submit_zoo({"zoo": "torchvision", "filter": "resnet34", "device": "cpu", "batch_size": 1})
        plans = [{"plan": plan, "measurement": {"algorithm": plan["algorithm"], "measured_peak_bytes": 10,
                                                "step_ms": 1.0, "grad_check_passed": True}}
                 for plan in stored["plans"]]
        result = {"key": stored["key"], "trace_id": stored["trace_id"], "reused": False, "device_name": "cpu",
                  "plans": plans, "frontier": [{"plan": plan} for plan in stored["frontier"]]}
        db = Database(f"sqlite:///{database}")
        try:
            with db.write_session() as session:
                for job_id in (job["id"], batch["models"][0]["job_id"]):
                    assert jobs.claim_job(session=session, job_id=job_id, owner="w", lease_s=30,
                                          max_attempts=3).outcome == "run"
                    jobs.finish_job(session=session, job_id=job_id, owner="w", state="succeeded", result=result)
        finally:
            db.dispose()
        finished = client.get_job(job["id"])
        assert finished["state"] == "succeeded" and finished["result"]["plans"]
        row = client.get_zoo(batch["id"])["models"][0]["row"]
        assert row is not None and row["status"] == "planned"


# --- any JSON at all: a checked answer or the one error ---------------------------------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**63 + 1, 2**63 - 1) | st.floats(allow_nan=False,
                    allow_infinity=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)


def _mutated(draw: st.DrawFn, value: Any) -> Any:
    """``value`` with one place (any depth) replaced by arbitrary JSON, or a field removed."""
    if isinstance(value, dict) and value and draw(st.booleans()):
        name = draw(st.sampled_from(sorted(value)))
        if draw(st.integers(0, 3)) == 0:
            return {k: v for k, v in value.items() if k != name}
        return {**value, name: _mutated(draw, value[name])}
    if isinstance(value, list) and value and draw(st.booleans()):
        i = draw(st.integers(0, len(value) - 1))
        return [*value[:i], _mutated(draw, value[i]), *value[i + 1:]]
    return draw(JSON)


@st.composite
def _answers(draw: st.DrawFn) -> tuple[str, Any]:
    from remat.client import service_answers

    shape = draw(st.sampled_from(["plan_record", "trace_stored", "job", "zoo_batch", "health"]))
    valid = {"plan_record": _record(), "health": {"status": "ok"},
             "trace_stored": {"key": _record()["key"], "trace_id": 1, "created": True, "plans": [_record()["plan"]]},
             "job": {"id": JOB_ID, "kind": "profile", "state": "succeeded", "progress": 1.0, "message": None,
                     "request": {"model": "torchvision:resnet18", "batch_size": 2, "input_shape": [3, 8, 8]},
                     "result": {"key": _record()["key"], "plans": [{"plan": _record()["plan"],
                                                                   "measurement": {"step_ms": 1.0}}]}},
             "zoo_batch": {"id": JOB_ID, "total": 1, "done": False, "progress": 0.0,
                           "models": [{"model": "torchvision:resnet18", "job_id": JOB_ID, "state": "succeeded",
                                       "row": {"model": "torchvision:resnet18", "status": "planned"}}]}}[shape]
    getattr(service_answers, shape)(valid)  # the unmutated answer passes
    return shape, _mutated(draw, valid)


@settings(max_examples=300, deadline=None)
@given(_answers())
def test_any_json_is_a_checked_answer_or_a_malformed_answer_error(answer: tuple[str, Any]) -> None:
    """Whatever the JSON (a valid answer with any one place changed), a shape check returns it or raises its
    one error; what it returns, the client's readers take without an exception."""
    from remat.client import service_answers
    from remat.client.report import ModelReport
    from remat.client.service_client import plan_from_record
    from remat.client.zoo_batch import ZooRow

    shape, body = answer
    try:
        checked = getattr(service_answers, shape)(body)
    except service_answers.MalformedAnswerError as exc:
        _one_line(str(exc))
        return
    if shape == "plan_record":
        plan_from_record(checked, PlanKey.from_dict(KEY))
        for m in checked.get("measurements") or []:
            assert m.get("measured_peak_bytes") is None or isinstance(m["measured_peak_bytes"], int)
    elif shape == "job" and checked["state"] == "succeeded" and checked.get("kind", "profile") == "profile" \
            and checked.get("result"):
        ModelReport.from_job(checked)
    elif shape == "zoo_batch":
        for entry in checked["models"]:
            if entry["row"] is not None:
                ZooRow.from_dict(entry["row"])
