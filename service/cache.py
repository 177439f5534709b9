"""Redis read-through cache of plan reads, keyed by the plan key; optional and never a point of failure.

Values are the JSON bytes of the API's plan response (never pickle: a shared Redis must not be a code
execution channel). Every Redis error is swallowed here, logged once per outage, and turns into a cache
miss; after a failure the cache is skipped for ``redis_retry_after_s`` so that a dead Redis costs one
timeout per interval, not one per request.

NOTE [cache coherence]: writers delete the affected keys *after* their transaction commits. A reader that
loaded the old row just before the commit can still put it back after the delete; the TTL
(``cache_ttl_s``) bounds how long such a stale entry lives. Plans change rarely (a new profile of the same
key), so a bounded window is preferred to versioned keys that would need a Redis round trip per read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import replace

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from remat.client.plan_key import UNKNOWN, PlanKey
from remat.service.config import ServiceSettings

log = logging.getLogger(__name__)

KEY_VERSION = "4"
"""Bumped when the cached JSON or the names change, so that a rolling upgrade never serves the old shape
(3: names list the key's fields in ``PlanKey`` order, the shape as a list; 4: the key has ``inputs``, and a
text field longer than :data:`NAME_TEXT_CHARS` is named by its digest)."""
NAME_TEXT_CHARS = 64
"""Longest text field a name holds as is; a longer one (a call's signature: up to 2000 characters) appears as
``sha256:<hex>``, 71 characters, which no text kept as is can equal: names stay short and unambiguous."""


def _name_part(value: object) -> object:
    if isinstance(value, str) and len(value) > NAME_TEXT_CHARS:
        return "sha256:" + hashlib.sha256(value.encode("utf-8")).hexdigest()
    return value


class PlanCache:
    """Get/set/delete of cached plan responses; a disabled or unreachable Redis behaves as always-miss."""

    def __init__(self, settings: ServiceSettings) -> None:
        self.prefix = f"{settings.cache_prefix}plan:{KEY_VERSION}:"
        self.ttl_s = settings.cache_ttl_s
        self.retry_after_s = settings.redis_retry_after_s
        self._client: redis.Redis | None = None
        if settings.redis_url:
            self._client = redis.Redis.from_url(
                settings.redis_url, socket_timeout=settings.redis_timeout_s,
                socket_connect_timeout=settings.redis_timeout_s, retry=Retry(NoBackoff(), 0),
                health_check_interval=0)
        self._lock = threading.Lock()
        self._skip_until = 0.0
        self.last_error: str | None = None

    @property
    def enabled(self) -> bool:
        return self._client is not None

    def key_name(self, key: PlanKey, algorithm: str, budget_bytes: int | None) -> str:
        """The Redis key of one plan read: every field of the plan key (``PlanKey.to_dict()``, in field order;
        a text longer than ``NAME_TEXT_CHARS`` by its digest), then the algorithm and the budget (0: none)."""
        parts = [*map(_name_part, key.to_dict().values()), algorithm, budget_bytes or 0]
        return self.prefix + json.dumps(parts, separators=(",", ":"))

    def delete_plans(self, key: PlanKey, algorithms_budgets: Iterable[tuple[str, int | None]]) -> None:
        """Invalidate the reads of the given (algorithm, budget) plans of ``key``, after a commit: those asked
        for its torch version and those asked for any (``unknown``), which may now be answered by this plan."""
        keys = {key, replace(key, torch_version=UNKNOWN)}
        self.delete(self.key_name(k, algorithm, budget) for k in keys for algorithm, budget in algorithms_budgets)

    def _available(self) -> redis.Redis | None:
        if self._client is None or time.monotonic() < self._skip_until:
            return None
        return self._client

    def _failed(self, exc: redis.RedisError) -> None:
        with self._lock:
            if self.last_error is None:
                log.warning("remat cache: Redis unavailable, reading from the database (%s)", exc)
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._skip_until = time.monotonic() + self.retry_after_s

    def _succeeded(self) -> None:
        if self.last_error is not None:
            with self._lock:
                log.info("remat cache: Redis reachable again")
                self.last_error = None

    def get(self, name: str) -> bytes | None:
        client = self._available()
        if client is None:
            return None
        try:
            value = client.get(name)
        except redis.RedisError as exc:
            self._failed(exc)
            return None
        self._succeeded()
        return value if isinstance(value, bytes) else None

    def set(self, name: str, value: bytes) -> None:
        client = self._available()
        if client is None:
            return
        try:
            client.set(name, value, ex=self.ttl_s)
        except redis.RedisError as exc:
            self._failed(exc)

    def delete(self, names: Iterable[str]) -> None:
        """Invalidate entries after a write. A failure here leaves them to expire (NOTE [cache coherence])."""
        names = list(names)
        client = self._client  # try even while skipping reads: a missed invalidation is worse than a timeout
        if client is None or not names:
            return
        try:
            client.delete(*names)
        except redis.RedisError as exc:
            self._failed(exc)

    def ping(self) -> str | None:
        """None when Redis answers (or no cache is configured), else the error; always asks Redis."""
        if self._client is None:
            return None
        try:
            self._client.ping()
        except redis.RedisError as exc:
            self._failed(exc)
            return self.last_error
        self._succeeded()
        return None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
