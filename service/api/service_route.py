"""The route class of every router: the write token is checked before a body is read, and JSON bodies are read
by ``remat.client.wire_json``.

FastAPI reads and parses a request's body before it solves the route's dependencies, so ``require_writer``
alone let an anonymous client make the server buffer and ``json.loads`` a 15 MB body on the event loop before
being told 401 (issue 31: ``/healthz`` waited a second behind such requests). Here the same check runs first,
from the headers alone; the dependency stays on the routes, where it documents the scheme in OpenAPI.

``json.loads`` also accepts ``NaN``, ``1e400``, 5,000-digit integers and stack-deep nesting, which either
poisoned every later read of a row or surfaced as a misleading 400; :class:`WireRequest` parses with the one
reading the client uses too, off the event loop, and refuses with a 422 naming the place.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from remat.client import wire_json
from remat.service.api.deps import bearer_credentials, get_state, require_writer


class WireRequest(Request):
    """A request whose ``json()`` is ``wire_json.loads``, run in the thread pool (a large upload's parse must
    not stall every other request on the event loop)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = await run_in_threadpool(wire_json.loads, body)
            except wire_json.WireJSONError as exc:
                raise HTTPException(422, detail=str(exc)) from None
        return self._json


class ServiceRoute(APIRoute):
    """Auth from the headers, then the body (module docstring)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        writes = any(d.dependency is require_writer for d in self.dependencies)

        async def guarded(request: Request) -> Response:
            if writes:
                await require_writer(await get_state(request), await bearer_credentials(request))
            return await handler(WireRequest(request.scope, request.receive))

        return guarded
