"""Dependencies of the routes: the service's shared state and the bearer-token checks.

Writes need ``REMAT_API_TOKEN``; a server without one refuses every write (403) rather than accepting
anonymous ones. Reads are open unless ``REMAT_READ_TOKEN_REQUIRED`` is set, in which case the read token
or the write token is accepted. Tokens are compared with :func:`hmac.compare_digest` so that response
timing says nothing about how much of a guess was right.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr

from remat.service.cache import PlanCache
from remat.service.celery_client import JobQueue
from remat.service.config import ServiceSettings
from remat.service.db import Database
from remat.service.schemas import ErrorOut


@dataclass(slots=True)
class ServiceState:
    """What every request shares: created once by ``create_app`` and kept on ``app.state.remat``."""

    settings: ServiceSettings
    db: Database
    cache: PlanCache
    queue: JobQueue

    def close(self) -> None:
        self.cache.close()
        self.queue.close()
        self.db.dispose()


# The dependencies below are ``async`` although they never await: FastAPI runs a sync dependency in the
# thread pool, and two thread hops per request are most of the cost of a cached plan read.

async def get_state(request: Request) -> ServiceState:
    return request.app.state.remat  # type: ignore[no-any-return]


StateDep = Annotated[ServiceState, Depends(get_state)]

bearer_credentials = HTTPBearer(auto_error=False,
                                description="`Authorization: Bearer <token>`; see docs/service.md")
"""The bearer credentials of a request (None when absent): a dependency, and callable on a request before
its body is read (``service_route``)."""
CredentialsDep = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_credentials)]


def _matches(credentials: HTTPAuthorizationCredentials, *tokens: SecretStr | None) -> bool:
    return _token_matches(credentials.credentials, *tokens)


def _token_matches(token: str, *tokens: SecretStr | None) -> bool:
    given = token.encode("utf-8")
    # Compare against every configured token (no early exit) so timing does not tell which one matched.
    results = [hmac.compare_digest(given, t.get_secret_value().encode("utf-8"))
               for t in tokens if t is not None and t.get_secret_value()]
    return any(results)


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail=detail, headers={"WWW-Authenticate": "Bearer"})


async def require_writer(state: StateDep, credentials: CredentialsDep) -> None:
    """Let the request through only with the write token."""
    settings = state.settings
    if not settings.writes_enabled:
        raise HTTPException(status.HTTP_403_FORBIDDEN,
                            detail="authorization: writes are disabled because the server has no "
                                   "REMAT_API_TOKEN configured")
    if credentials is None:
        raise _unauthorized("authorization: missing bearer token (send Authorization: Bearer <REMAT_API_TOKEN>)")
    if not _matches(credentials, settings.api_token):
        raise _unauthorized("authorization: the bearer token is not valid for writes")


async def require_reader(state: StateDep, credentials: CredentialsDep) -> None:
    """Let reads through, unless the server requires a token for them."""
    settings = state.settings
    if not settings.read_token_required:
        return
    if credentials is None:
        raise _unauthorized("authorization: this server requires a bearer token for reads")
    if not _matches(credentials, settings.read_token, settings.api_token):
        raise _unauthorized("authorization: the bearer token is not valid for reads")


PAGE_CHALLENGE = {"WWW-Authenticate": 'Basic realm="remat plan service", charset="UTF-8"'}
"""What a web page answers a browser without the read token: the browser asks for a user name and password
once and sends them with every later request to the server, pictures and stylesheet included."""


def _page_token(authorization: str | None) -> str | None:
    """The token in ``Authorization``: a bearer token, or the password of HTTP Basic (any user name)."""
    scheme, _, value = (authorization or "").strip().partition(" ")
    if scheme.lower() == "bearer":
        return value.strip() or None
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2] or None
    return None


async def require_page_reader(request: Request, state: StateDep) -> None:
    """The read rule of the JSON routes, for the web pages: open unless ``REMAT_READ_TOKEN_REQUIRED``, then the
    read or the write token. A browser cannot send a bearer token when it follows a link, so the token is also
    taken as the password of HTTP Basic authentication, which the 401 asks the browser for."""
    settings = state.settings
    if not settings.read_token_required:
        return
    token = _page_token(request.headers.get("authorization"))
    if token is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, headers=PAGE_CHALLENGE,
                            detail="authorization: this server requires the read token: sign in with any user "
                                   "name and the token as the password")
    if not _token_matches(token, settings.read_token, settings.api_token):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, headers=PAGE_CHALLENGE,
                            detail="authorization: the token is not valid for reads")


OPTIONAL_AUTH: dict[str, object] = {"security": [{}]}
"""``openapi_extra`` of read routes: FastAPI lists the bearer scheme because ``require_reader`` can check
it; the added empty requirement tells clients (and schemathesis) that reads work without it by default."""


def _error(description: str) -> dict[str, object]:
    return {"model": ErrorOut, "description": description}


AUTH_RESPONSES: dict[int | str, dict[str, object]] = {
    400: _error("The body cannot be decoded, or Content-Length is malformed."),
    401: _error("Missing or invalid bearer token."),
    403: _error("Writes are disabled: the server has no API token configured."),
}
READ_RESPONSES: dict[int | str, dict[str, object]] = {
    401: _error("A bearer token is required for reads on this server and is missing or invalid."),
    422: _error("A parameter is malformed; the message names it."),
    503: _error("The database is unreachable."),
}
WRITE_RESPONSES: dict[int | str, dict[str, object]] = {
    **AUTH_RESPONSES,
    413: _error("The request body is larger than REMAT_MAX_BODY_BYTES."),
    422: _error("The body is malformed; the message names the field."),
    503: _error("The database is unreachable."),
}
