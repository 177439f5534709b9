"""HTTP client of the remat plan service: fetch stored plans, upload traces, ask for health.

Training jobs fetch plans at start-up, often from many nodes at once, so this module is deliberately small:
it needs httpx and nothing else of the heavy stack (no torch, sqlalchemy, celery or the web framework; a test
checks ``sys.modules`` in a fresh interpreter). Keys are taken as plain mappings or as anything with a
``to_dict()`` (the client's ``PlanKey``, whose module imports no torch either).

The service is not trusted to behave (issue 31): every request ends by its deadline, connecting, sending and
every read together (``timeout``; remat.client.http_bounds), an answer is read up to ``MAX_ANSWER_BYTES``,
redirects are not followed, and every JSON answer is parsed by ``remat.client.wire_json`` and checked against
the shape the client reads (remat.client.service_answers) before any field is used.

Every failure leaves as one ``ServiceError`` with a one-line message naming the URL and what happened (for a
malformed answer, the field), the way httpx maps socket errors to its own: callers catch one exception type
and can show its message as is.

Public API::

    with PlanServiceClient("http://plans:8000", token=None, timeout=10.0) as client:
        client.health() -> dict                                     # {status, database, cache}
        client.get_plan(key, algorithm="linear", budget=None) -> dict | None   # None: no such plan
        client.upload_trace(trace) -> dict                          # {key, trace_id, created, plans}
        client.submit_job(request, queue=None) -> dict              # a profiling job (JobOut)
        client.get_job(job_id) -> dict                              # its state, progress and result
        with client.within(): ...                                   # several requests, one deadline
    plan_from_record(record, key) -> Plan                           # a served record as a Plan carrying its key
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, fields
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx

from remat.client import http_bounds, service_answers, wire_json
from remat.client.errors import PlanError, ServiceError
from remat.client.plan import Plan
from remat.client.plan_key import UNKNOWN, PlanKey, normalize_torch_version

__all__ = ["MAX_ANSWER_BYTES", "PlanServiceClient", "ServiceResponseError", "key_query", "plan_from_record"]

MAX_ANSWER_BYTES = 64 * 2**20
"""The longest answer the client reads. Four times the largest request body the service accepts by default
(``REMAT_MAX_BODY_BYTES``, 16 MiB): every answer is built from what such bodies stored (a trace's plans and
frontier, a job's result, a batch's rows); a 200 that never ends stops here or at the deadline."""

_MAX_DETAIL_CHARS = 300
"""An error answer's ``detail`` (or body excerpt) is cut here: the message it ends up in is one line."""

_KEY_DEFAULTS = {f.name: f.default if f.default is not MISSING else UNKNOWN for f in fields(PlanKey)
                 if f.default is not MISSING or f.default_factory is not MISSING}
"""What a key mapping means when it leaves a field out: the defaults of the client's ``PlanKey``, except that a
default computed where the key is made (the installed torch's version) is ``unknown``, which asks the service
for the newest plan of any."""


class ServiceResponseError(ServiceError):
    """The service answered, with an error status; ``detail`` is its own one-line explanation.

    Attributes:
        status_code: the HTTP status.
        url: the request URL.
        detail: the service's ``detail`` message (or a short excerpt of a non-JSON body).
    """

    def __init__(self, message: str, *, status_code: int, url: str, detail: str) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.url = url
        self.detail = detail


def _one_line(text: str, limit: int | None = None) -> str:
    """One line of printable text (a server's words reach a terminal), cut to ``limit`` characters."""
    line = "".join(ch if ch.isprintable() else "?" for ch in " ".join(str(text).split()))
    return line if limit is None or len(line) <= limit else f"{line[:limit - 3]}..."


@dataclass(frozen=True, slots=True)
class _Answer:
    """One answer, read whole (within the deadline and the size cap) before anything looks at it."""

    status_code: int
    reason: str
    url: str
    headers: httpx.Headers
    content: bytes

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")


def key_query(key: Any, *, algorithm: str = "linear", budget: int | None = None) -> tuple[str, dict[str, str]]:
    """The path and query parameters of ``GET /v1/plans/{model_hash}`` for ``key``.

    Args:
        key: a mapping with ``model_hash`` and ``input_shape`` (missing ``inputs``, ``dtype``, ``device``,
            ``mode`` and ``grads`` take ``PlanKey``'s defaults; a missing ``torch_version`` asks for the newest
            plan of any torch), or an object with ``to_dict()`` returning one. The values are sent as text in
            the query (httpx percent-encodes them: a call signature's ``;``, ``+`` or ``&`` arrive as written).
        algorithm: planner name.
        budget: memory budget in bytes; None asks for the minimum-peak plan.

    Raises:
        ServiceError: the key lacks ``model_hash`` or ``input_shape``; nothing was sent.
    """
    fields = key.to_dict() if hasattr(key, "to_dict") else key
    if not isinstance(fields, Mapping):
        raise ServiceError(f"plan key: expected a mapping or a PlanKey, got {type(key).__name__}")
    missing = [name for name in ("model_hash", "input_shape") if fields.get(name) is None]
    if missing:
        raise ServiceError(f"plan key: field {missing[0]!r} is missing")
    shape = fields["input_shape"]
    try:
        shape_text = shape if isinstance(shape, str) else ",".join(str(int(d)) for d in shape)
    except (TypeError, ValueError):
        raise ServiceError(f"plan key: input_shape must be a list of integers, got {shape!r}") from None
    params = {"input_shape": shape_text, "algorithm": algorithm}
    for name, default in _KEY_DEFAULTS.items():
        value = fields.get(name)
        params[name] = str(default if value is None else value)
    if budget is not None:
        params["budget"] = str(int(budget))
    # Quoted so that a hand-written hash cannot change the path; real hashes are hex digits and pass as is.
    return f"/v1/plans/{quote(str(fields['model_hash']), safe=':+.-_')}", params


DEFAULT_TIMEOUT_S = 10.0


def default_timeout(default: float = DEFAULT_TIMEOUT_S) -> float:
    """``REMAT_TIMEOUT_S`` when set (a positive number), else ``default`` (10 seconds unless a caller knows its
    request takes longer)."""
    text = os.environ.get("REMAT_TIMEOUT_S", "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise ServiceError(f"REMAT_TIMEOUT_S: must be seconds between 0 and 3600, got {text!r}")
    return value


def _is_http_url(text: str) -> bool:
    """Whether ``text`` is an http(s) URL with a host: what a remat service can be reached at."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        _ = parts.port  # read to be checked: a port that is no number or out of range raises
    except ValueError:  # that, or an unbalanced [IPv6] bracket
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def checked_server_url(base_url: object) -> str:
    """``base_url`` stripped, or a ServiceError naming it: ftp://x, http:// and plain words are input, named
    before any request (and, by a command that checks it first, before any work)."""
    text = str(base_url).strip()
    if not _is_http_url(text):
        raise ServiceError(f"server URL {text!r}: expected http://HOST[:PORT] or https://HOST[:PORT]")
    return text


class PlanServiceClient:
    """A synchronous client of one remat service; reuses its connections until closed.

    Args:
        base_url: the service's root, e.g. ``http://plans.internal:8000``.
        token: bearer token, sent with every request: the write token (``REMAT_API_TOKEN``) is needed to
            upload and also reads; a read token is needed only where the server requires one for reads.
        timeout: seconds a request may take in all, connecting, sending and reading the whole answer (a
            training job should fail fast, not hang; a server that trickles its answer does not stretch it).
            None: ``REMAT_TIMEOUT_S`` (or the config file's ``timeout_s``), else 10.
        transport: an httpx transport (tests, proxies); None uses httpx's default.
    """

    def __init__(self, base_url: str, *, token: str | None = None, timeout: float | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        timeout = default_timeout() if timeout is None else timeout
        self.base_url = checked_server_url(base_url).rstrip("/")
        self.timeout = timeout
        # identity: the size cap counts the bytes that arrive, and no compressed answer inflates past it.
        headers = {"Accept": "application/json", "Accept-Encoding": "identity", "User-Agent": "remat-client"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._has_token = bool(token)
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport,
                                  follow_redirects=False)
        http_bounds.install(self._http)

    # --- lifecycle ----------------------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> PlanServiceClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PlanServiceClient({self.base_url!r})"

    @contextmanager
    def within(self, seconds: float | None = None) -> Iterator[None]:
        """Every request inside shares one deadline, ``seconds`` (default: this client's ``timeout``) from now:
        a lookup of several requests (``checkpoint()``'s) then takes the timeout in all, not per request."""
        with http_bounds.deadline_scope(self.timeout if seconds is None else seconds):
            yield

    # --- API ----------------------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        """``GET /healthz``: ``{status, database, cache}``.

        A 503 is returned, not raised: it is the documented answer of a service whose database is down
        (``status`` says ``unavailable``), and a health probe wants to show it.
        """
        response = self._send("GET", "/healthz")
        if response.status_code == 503:
            body = self._json(response)
            if isinstance(body, dict) and isinstance(body.get("status"), str):
                return body
        return self._checked(response, service_answers.health)

    def get_plan(self, key: Any, *, algorithm: str = "linear", budget: int | None = None) -> dict[str, Any] | None:
        """The stored plan record for ``key``, or None when the service has none.

        Args:
            key: a ``PlanKey`` (client or service) or a mapping with its fields; see ``key_query``.
            algorithm: planner name (``linear``, the default, is exact for the PyTorch-faithful cost model).
            budget: memory budget in bytes; None asks for the minimum-peak plan.

        Returns:
            ``{plan_id, key, plan, trace, measurements, created_at, updated_at}`` as served; ``plan`` is
            ``Plan.to_dict()``'s form and ``measurements`` are newest first.

        Raises:
            ServiceError: the service is unreachable, refused the request or answered an error, or answered
                a key's call signature (``inputs``) with the plan of another (a service that predates them).
        """
        path, params = key_query(key, algorithm=algorithm, budget=budget)
        response = self._send("GET", path, params=params)
        if response.status_code == 404 and self._is_remat_404(response):
            return None
        record = self._checked(response, service_answers.plan_record)
        served = record["key"]
        if params["inputs"] and served.get("inputs", "") != params["inputs"]:
            # A service older than the key's inputs field ignores the query parameter and answers the plan
            # of the single-tensor call of that shape, which would be applied to a different graph.
            raise ServiceError(f"remat service {self.base_url}{path}: answered with the plan of another call "
                               f"signature (inputs {str(served.get('inputs', ''))[:60]!r}); a service that does "
                               "not key plans on a call's inputs cannot serve models called with several inputs")
        return record

    def get_budget_plan(self, key: Any, budget_bytes: int) -> dict[str, Any] | None:
        """The service's frontier plan for a budget (the fastest whose predicted peak fits), or None when it
        stores no frontier for ``key``.

        Raises:
            BudgetInfeasibleError: the budget is below the smallest feasible peak (the service's 422).
            ServiceError: as :meth:`get_plan`.
        """
        from remat.client.budget_spec import BudgetError
        from remat.client.plan import BUDGET_ALGORITHM

        try:
            return self.get_plan(key, algorithm=BUDGET_ALGORITHM, budget=budget_bytes)
        except ServiceResponseError as exc:
            if exc.status_code == 422 and exc.detail.startswith("budget:"):
                raise BudgetError(exc.detail) from None
            raise

    def upload_trace(self, trace: Any) -> dict[str, Any]:
        """``POST /v1/traces``: store a trace; the service plans it with every algorithm and stores the plans.

        Args:
            trace: a ``Trace`` (anything with ``to_dict()``), its dict form, or its JSON text.

        Returns:
            ``{key, trace_id, content_sha256, created, plans}``; ``created`` is False when the same trace
            content was stored before (the upload is idempotent).

        Raises:
            ServiceError: no or a refused token, a trace the service rejects (the message is its own),
                or any transport failure.
        """
        if hasattr(trace, "to_dict"):
            trace = trace.to_dict()
        content = trace.encode("utf-8") if isinstance(trace, str) else (
            trace if isinstance(trace, bytes) else json.dumps(trace).encode("utf-8"))
        response = self._send("POST", "/v1/traces", content=content,
                              headers={"Content-Type": "application/json"})
        return self._checked(response, service_answers.trace_stored)

    def submit_job(self, request: Any, *, queue: str | None = None) -> dict[str, Any]:
        """``POST /v1/jobs``: have the service's workers profile, plan and validate a zoo model.

        Args:
            request: a ``ModelRequest`` (anything with ``to_dict()``) or its dict form.
            queue: the workers' queue (default: the request's device, ``cpu`` or ``cuda``).

        Returns:
            The job (``id``, ``state``...); an identical request already running is followed, not rerun.
        """
        body = dict(request.to_dict() if hasattr(request, "to_dict") else request)
        if queue is not None:
            body["queue"] = queue
        return self._checked(self._send("POST", "/v1/jobs", json=body), service_answers.job)

    def submit_zoo(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/zoo``: a profiling job per zoo model the filter selects; returns the batch (``id``...)."""
        return self._checked(self._send("POST", "/v1/zoo", json=body), service_answers.zoo_batch)

    def get_zoo(self, batch_id: str) -> dict[str, Any]:
        """``GET /v1/zoo/{id}``: the batch's progress and a row per finished model."""
        return self._checked(self._send("GET", f"/v1/zoo/{quote(batch_id, safe='')}"), service_answers.zoo_batch)

    def get_job(self, job_id: str) -> dict[str, Any]:
        """``GET /v1/jobs/{id}``: state, progress, plan key and, when finished, the plans or the reason."""
        return self._checked(self._send("GET", f"/v1/jobs/{quote(job_id, safe='')}"), service_answers.job)

    # --- plumbing -----------------------------------------------------------------------------------------

    def _send(self, method: str, path: str, **kwargs: Any) -> _Answer:
        """One request, its answer read whole by the deadline (``within``, else ``timeout`` from now) and up to
        ``MAX_ANSWER_BYTES``; every transport failure becomes a one-line ``ServiceError`` naming the URL."""
        url = f"{self.base_url}{path}"
        with http_bounds.deadline_scope(self.timeout):
            try:
                request = self._http.build_request(method, path, **kwargs)
                response = self._http.send(request, stream=True)
                try:
                    content = http_bounds.read_capped(response, MAX_ANSWER_BYTES)
                finally:
                    response.close()
                return _Answer(status_code=response.status_code, reason=response.reason_phrase,
                               url=str(response.request.url), headers=response.headers, content=content)
            except httpx.TimeoutException as exc:
                what = f"no whole answer within {self.timeout:g} s ({type(exc).__name__})"
            except httpx.ConnectError as exc:
                what = f"cannot connect ({_one_line(str(exc)) or type(exc).__name__})"
            except httpx.TransportError as exc:
                what = f"request failed ({type(exc).__name__}: {_one_line(str(exc), _MAX_DETAIL_CHARS)})"
            except httpx.InvalidURL as exc:
                what = f"invalid URL ({_one_line(str(exc))})"
            except http_bounds.AnswerTooLargeError as exc:
                what = str(exc)
            except httpx.HTTPError as exc:  # a malformed answer httpx refused (headers, chunk framing...)
                what = f"request failed ({type(exc).__name__}: {_one_line(str(exc), _MAX_DETAIL_CHARS)})"
        raise ServiceError(f"remat service {url}: {what}") from None

    @staticmethod
    def _json(response: _Answer) -> Any:
        """The answer's JSON as ``wire_json`` reads it (finite numbers, 64-bit integers, bounded nesting), or
        None when it is not such JSON."""
        try:
            return wire_json.loads(response.content, where="answer")
        except wire_json.WireJSONError:
            return None

    @staticmethod
    def _is_remat_404(response: _Answer) -> bool:
        """A 404 that means "no plan for this key", not a wrong base URL or another server.

        The service's 404 names the key (``model_hash: no linear plan ...``); a path that does not exist
        gets FastAPI's bare ``Not Found``, and that must not pass for "nothing stored".
        """
        body = PlanServiceClient._json(response)
        detail = body.get("detail") if isinstance(body, dict) else None
        return isinstance(detail, str) and detail.startswith("model_hash:")

    def _checked(self, response: _Answer, shape: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        """The JSON body of a success, checked to be of ``shape`` (remat.client.service_answers); otherwise a
        ``ServiceError`` that says what went wrong."""
        url = response.url
        code = response.status_code
        if response.is_success:
            try:
                body = wire_json.loads(response.content, where="answer")
                return shape(body)
            except (wire_json.WireJSONError, service_answers.MalformedAnswerError) as exc:
                raise ServiceError(f"remat service {url}: answered HTTP {code} with {_one_line(str(exc), 200)}; "
                                   "is this a remat service?") from None
        body = self._json(response)
        detail = body.get("detail") if isinstance(body, dict) else None
        detail = _one_line(detail if isinstance(detail, str) else (response.text[:_MAX_DETAIL_CHARS] or
                                                                   response.reason), _MAX_DETAIL_CHARS)
        if code == 401:
            problem = ("the bearer token was refused (check REMAT_API_TOKEN)" if self._has_token
                       else "a bearer token is needed and none was given (set REMAT_API_TOKEN)")
            message = f"remat service {url}: {problem}: {detail}"
        elif code == 403:
            message = f"remat service {url}: the token was refused (HTTP 403): {detail}"
        elif 300 <= code < 400:
            where = _one_line(response.headers.get("location", "nowhere"), 120)
            message = (f"remat service {url}: answered a redirect (HTTP {code} to {where}); the client follows "
                       "none: give the service's own URL")
        elif code >= 500:
            message = f"remat service {url}: server error HTTP {code}: {detail}"
        else:
            message = f"remat service {url}: HTTP {code}: {detail}"
        raise ServiceResponseError(message, status_code=code, url=url, detail=detail)


def plan_from_record(record: Mapping[str, Any], key: PlanKey) -> Plan:
    """The served plan, carrying the key it is valid for in ``extra["key"]``.

    The key is ``key`` (computed from the model here) with the torch version the service keyed the plan
    under (that of the trace it planned from): the stage graph, hence the plan, can change between torch
    releases, and ``apply`` checks this field against the installed torch.

    Raises:
        ServiceError: ``record`` is not a plan record (remat.client.service_answers.plan_record), the field
            named; :meth:`PlanServiceClient.get_plan` has checked its records already.
    """
    try:
        service_answers.plan_record(record)
    except service_answers.MalformedAnswerError as exc:
        raise ServiceError(f"remat service: a malformed plan record ({_one_line(str(exc), 200)}); is this a remat "
                           "service?") from None
    served = record["key"].get("torch_version")
    traced_with = served or (record.get("trace") or {}).get("torch_version")
    key_dict = key.to_dict()
    if traced_with:
        try:
            key_dict["torch_version"] = normalize_torch_version(traced_with)
        except PlanError:
            pass  # an unreadable version string is provenance, not a key; keep this torch's
    return Plan.from_dict({**record["plan"], "key": key_dict})
