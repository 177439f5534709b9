"""Invariant (a) of issue 31, read after write: no body sent to a write route gets a 5xx, a refused write
changes nothing, and after any write every read route still answers 2xx or 404 for every stored key.

Bodies are drawn by hypothesis from valid templates of each write route, then mutated where it hurts: a field
replaced, a field added or dropped, with values that ``json.loads`` takes and a database or a later
``json.dumps`` does not (``NaN``, ``Infinity``, ``1e400``, 30- and 5,000-digit integers, lone surrogates, NUL,
nesting 30 to 2,000 deep), ordinary values of the wrong type, unicode text, and bytes that are not JSON. The
bodies go out as raw text, the way a careless or hostile client would write them. It runs on SQLite and
PostgreSQL, against the app in process (ASGI), with a broker nobody listens on (accepted jobs stay pending).

``EXAMPLES`` per write route and backend in the default run; ``uv run pytest -m soak`` runs ten times as many.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from remat.client.planning.planners import PLANNERS
from remat.service.api.app import create_app
from remat.service.config import ServiceSettings
from remat.service.db import Database
from remat.service.models import Base
from tests.service.factories import AUTH, trace_dict

EXAMPLES = int(__import__("os").environ.get("REMAT_TEST_EXAMPLES", 2000))
SOAK_EXAMPLES = 20_000
JSON_AUTH = {**AUTH, "Content-Type": "application/json"}
SWEEP_EVERY = 500
"""Examples between two sweeps of every read route over every stored key (and one at the end); between them,
each accepted write reads back what it touched and the newest page of each list."""


@dataclass(frozen=True)
class Raw:
    """JSON text written as is: what ``json.dumps`` would not write, or would write differently."""

    text: str


HOSTILE = st.sampled_from([
    Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), Raw("-1e999"), Raw("9" * 30), Raw("-" + "9" * 25),
    Raw("1" * 5000), Raw("9223372036854775808"), Raw('"\\ud800"'), Raw('"a\\udfffb"'), Raw('"\\u0000"'),
    Raw("1e-400"), Raw("-0.0"), Raw("[" * 30 + "]" * 30), Raw("[" * 40 + "]" * 40),
    Raw('{"a":' * 35 + "1" + "}" * 35),
    Raw("[" * 2000 + "]" * 2000), Raw('"' + "x" * 5000 + '"'),
])
ORDINARY = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
            | st.text(max_size=20) | st.lists(st.integers(-3, 2**31), max_size=5)
            | st.dictionaries(st.text(max_size=5), st.integers(), max_size=3))
VALUES = HOSTILE | ORDINARY


def render(value: Any) -> str:
    """JSON text of a value whose leaves may be ``Raw``."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{render(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(render(v) for v in value) + "]"
    return json.dumps(value)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a template: containers and leaves (the root excluded)."""
    out: list[tuple[Any, ...]] = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        out.append((*prefix, k))
        out.extend(_paths(v, (*prefix, k)))
    return out


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = _replace(copy[path[0]], path[1:], new)
    return copy


def _drop(value: Any, path: tuple[Any, ...]) -> Any:
    if len(path) == 1:
        copy = dict(value) if isinstance(value, dict) else list(value)
        del copy[path[0]]
        return copy
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = _drop(copy[path[0]], path[1:])
    return copy


@st.composite
def mutated(draw: st.DrawFn, template: Any, free: tuple[Any, ...] | None = None,
            kept: tuple[str, ...] = ()) -> str:
    """A body: the template as is, with a value put where the route stores anything (``free``: a trace's
    unknown fields, a measurement's ``extra``), or with one to three places replaced, dropped or added."""
    choice = draw(st.integers(0, 9))
    if free is not None and choice in (8, 9):
        name = draw(st.sampled_from(["x", "note", "calibration", "\u00e9\u4e2d", "a\nb"]) | st.text(max_size=8))
        return render(_replace(template, free, {**_at(template, free), name: draw(VALUES)}))
    if choice == 0:
        return draw(st.sampled_from(["", "{", "[]", "null", "{}", '"text"', "\ufeff{}", "{\"a\":1}{}"])
                    | st.text(max_size=50))
    body = template
    for _ in range(draw(st.integers(0 if choice == 1 else 1, 3))):
        paths = [p for p in _paths(body) if p[0] not in kept]
        what = draw(st.integers(0, 5))
        if what <= 2 and paths:
            body = _replace(body, draw(st.sampled_from(paths)), draw(VALUES))
        elif what == 3 and paths:
            body = _drop(body, draw(st.sampled_from(paths)))
        else:  # a field added, at the top or inside an object
            objects = [()] + [p for p in paths if isinstance(_at(body, p), dict)]
            where = draw(st.sampled_from(objects))
            name = draw(st.sampled_from(["extra", "note", "x", "calibration", "\u00e9\u4e2d", "stages"])
                        | st.text(max_size=8))
            body = _replace(body, where, {**_at(body, where), name: draw(VALUES)})
    return render(body)


def _at(value: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        value = value[p]
    return value


class AsgiClient:
    """The app called in this thread's event loop (httpx's ASGI transport): a request costs about a millisecond
    less than through TestClient's thread portal, which is most of a refused write's cost here."""

    def __init__(self, app: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://remat.test")

    def get(self, path: str, params: dict[str, Any] | None = None) -> httpx.Response:
        return self._loop.run_until_complete(self._http.get(path, params=params))

    def post(self, path: str, *, content: bytes, headers: dict[str, str]) -> httpx.Response:
        return self._loop.run_until_complete(self._http.post(path, content=content, headers=headers))

    def close(self) -> None:
        self._loop.run_until_complete(self._http.aclose())
        self._loop.close()


@dataclass
class Store:
    """What the writes left behind, for the reads to visit."""

    keys: list[dict[str, Any]] = field(default_factory=list)
    batches: set[str] = field(default_factory=set)


def _fingerprint(db: Database) -> tuple[int, ...]:
    """Rows per table, in one query: a refused write must leave every count as it was."""
    counts = [select(func.count()).select_from(t).scalar_subquery() for t in Base.metadata.sorted_tables]
    with db.read_session() as session:
        return tuple(session.execute(select(*counts)).one())


def _key_query(key: dict[str, Any]) -> dict[str, str]:
    return {k: ",".join(map(str, v)) if isinstance(v, list) else str(v) for k, v in key.items()
            if k != "model_hash" and v not in (None, "")}


def _read_ok(client: AsgiClient, path: str, params: dict[str, Any] | None = None) -> Any:
    response = client.get(path, params=params)
    assert response.status_code in (200, 404), (path, params, response.status_code, response.text[:300])
    return response.json()


def _read_key(client: AsgiClient, key: dict[str, Any], *, every_algorithm: bool = True) -> None:
    query = _key_query(key)
    if not every_algorithm:  # right after a write: the default plan and the frontier (the sweeps read the rest)
        _read_ok(client, f"/v1/plans/{key['model_hash']}", query)
        _read_ok(client, f"/v1/plans/{key['model_hash']}/frontier", query)
        return
    base = f"/v1/plans/{key['model_hash']}"
    for algorithm in (*PLANNERS, "budget"):
        params = {**query, "algorithm": algorithm, **({"budget": 10**9} if algorithm == "budget" else {})}
        _read_ok(client, base, params)
    _read_ok(client, f"{base}/frontier", query)
    _read_ok(client, f"{base}/timeline", query)


def _pages(client: AsgiClient, path: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    while True:
        page = _read_ok(client, path, {"limit": 200, "offset": len(rows)})
        rows.extend(page["data"])
        if not page["data"] or len(rows) >= page["count"]:
            return rows


def sweep(client: AsgiClient, store: Store) -> None:
    """Every read route over every stored plan key, job and zoo batch."""
    assert client.get("/healthz").status_code == 200
    for record in _pages(client, "/v1/plans"):
        if record["key"] not in store.keys:
            store.keys.append(record["key"])
    for key in store.keys:
        _read_key(client, key)
        _read_ok(client, "/v1/plans", {"model_hash": key["model_hash"]})
    for job in _pages(client, "/v1/jobs"):
        _read_ok(client, f"/v1/jobs/{job['id']}")
    for batch in store.batches:
        _read_ok(client, f"/v1/zoo/{batch}")


def _templates(stored_key: dict[str, Any]) -> dict[str, Callable[[st.DrawFn], Any]]:
    """A valid body per write route, drawn a little differently each time."""
    return {
        "/v1/traces": lambda draw: trace_dict(num_stages=draw(st.integers(1, 6)),
                                              model_hash=draw(st.sampled_from(["arch-1", "arch-2"])),
                                              scale=draw(st.integers(1, 3))),
        "/v1/measurements": lambda draw: {
            "key": stored_key, "algorithm": draw(st.sampled_from(["linear", "none", "cubic"])),
            "measured_peak_bytes": draw(st.integers(0, 2**40)), "step_ms": 1.5, "grad_check_passed": True,
            "grad_max_abs_diff": 0.0, "device_name": "cpu",
            "extra": {"timeline": {"bytes": [1, 2, 3]}, "note": "ok"}},
        "/v1/jobs": lambda draw: {"model": draw(st.sampled_from(["resnet18", "hf:gpt2", "nope"])), "batch_size": 1,
                                  "input_shape": [3, 8, 8], "device": "cpu"},
        "/v1/zoo": lambda draw: {"zoo": "torchvision", "filter": draw(st.sampled_from(["resnet18", "alexnet,vgg11"])),
                                 "batch_size": 1, "device": "cpu"},
    }


def run_property(client: AsgiClient, db: Database, route: str, examples: int) -> None:
    seeded = client.post("/v1/traces", content=json.dumps(trace_dict()).encode(), headers=JSON_AUTH)
    assert seeded.status_code == 201
    store = Store(keys=[seeded.json()["key"]])
    template = _templates(store.keys[0])[route]

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one_write(data: st.DataObject) -> None:
        body = data.draw(mutated(template(data.draw), FREE.get(route), KEPT.get(route, ())), label="body")
        nonlocal rows
        before, rows = rows, None  # re-counted below, or at the next example should this one fail before that
        if before is None:
            before = _fingerprint(db)
        response = client.post(route, content=body.encode("utf-8", "surrogatepass"), headers=JSON_AUTH)
        assert response.status_code < 500, (body[:500], response.status_code, response.text[:300])
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        nonlocal count
        count += 1
        if count % SWEEP_EVERY == 0:
            sweep(client, store)
        detail = response.json().get("detail") if response.status_code >= 400 else None
        if detail is not None:
            assert isinstance(detail, str) and "\n" not in detail, detail
            after = _fingerprint(db)
            assert after == before, f"a refused write ({response.status_code}: {detail}) changed rows"
        else:  # what the write touched, and the first (newest) page of each list, which now holds it
            answer = response.json()
            key = answer.get("key") if route in ("/v1/traces", "/v1/measurements") else None
            if key is not None:
                _read_key(client, key, every_algorithm=False)
                store.keys.append(key) if key not in store.keys else None
            if route == "/v1/zoo":
                store.batches.add(answer["id"])
                _read_ok(client, f"/v1/zoo/{answer['id']}")
            if route == "/v1/jobs":
                _read_ok(client, f"/v1/jobs/{answer['id']}")
            _read_ok(client, "/v1/plans", {"limit": 10})
            _read_ok(client, "/v1/jobs", {"limit": 10})
            after = _fingerprint(db)
        rows = after

    statuses: dict[int, int] = {}
    count = 0
    rows: tuple[int, ...] | None = None
    """The row counts the last example left: the next one's counts before its write, since nothing else writes
    between two examples (reads and sweeps write nothing), so each example counts rows once, not twice."""
    one_write()
    sweep(client, store)
    print(route, sorted(statuses.items()))


WRITE_ROUTES = ["/v1/traces", "/v1/measurements", "/v1/jobs", "/v1/zoo"]
FREE: dict[str, tuple[Any, ...]] = {"/v1/traces": (), "/v1/measurements": ("extra",)}
"""Where each route keeps fields it does not know (a trace's top level) or anything (a measurement's extra)."""
KEPT: dict[str, tuple[str, ...]] = {"/v1/zoo": ("filter",)}
"""Fields the mutations leave alone: a zoo batch without its filter is the whole zoo, 80 jobs (300 ms), which
the run can afford a few times (the empty and the non-object bodies still send it), not hundreds."""


class SentQueue:
    """A broker that takes every job at once: these tests are about the database and the reads, and a dead
    broker costs each accepted job a connection timeout (tests/service/test_jobs.py covers that path)."""

    def enqueue(self, kind: str, job_id: str, queue: str) -> str | None:
        return None

    def ping(self) -> str | None:
        return None

    def close(self) -> None:
        pass


@pytest.fixture
def asgi_client(make_settings: Callable[..., ServiceSettings]) -> Iterator[AsgiClient]:
    app = create_app(make_settings())
    app.state.remat.queue.close()
    app.state.remat.queue = SentQueue()
    client = AsgiClient(app)
    yield client
    client.close()


@pytest.mark.parametrize("route", WRITE_ROUTES)
def test_no_write_gets_a_5xx_or_breaks_a_read(asgi_client: AsgiClient, db: Database, route: str) -> None:
    run_property(asgi_client, db, route, EXAMPLES)


@pytest.mark.soak
@pytest.mark.parametrize("route", WRITE_ROUTES)
def test_no_write_gets_a_5xx_or_breaks_a_read_soak(asgi_client: AsgiClient, db: Database, route: str) -> None:
    run_property(asgi_client, db, route, SOAK_EXAMPLES)
