"""Settings of the plan service and of the embedded plan store: the one place that reads the environment.

Every field can be set by an environment variable named ``REMAT_<FIELD>`` (``REMAT_DATABASE_URL``,
``REMAT_API_TOKEN``...). Code elsewhere receives a :class:`ServiceSettings` instance instead of reading
``os.environ``, so tests build settings explicitly and never leak configuration between each other.
"""

from __future__ import annotations

from pathlib import Path

from platformdirs import user_cache_dir
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_SQLITE_NAME = "remat.sqlite"


def redact_url(url: str) -> str:
    """``scheme://user:***@host/...``: URLs go into logs and job errors, their passwords must not."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}"


def default_database_url() -> str:
    """The embedded default: one SQLite file in the user's cache directory, shared by CLI runs."""
    return f"sqlite:///{Path(user_cache_dir('remat')) / DEFAULT_SQLITE_NAME}"


class ServiceSettings(BaseSettings):
    """Configuration of the database, cache, broker, HTTP server and access control."""

    model_config = SettingsConfigDict(env_prefix="REMAT_", extra="ignore", frozen=True)

    database_url: str = Field(default_factory=default_database_url)
    """SQLAlchemy URL. Default: a SQLite file under the user cache dir; PostgreSQL as
    ``postgresql+psycopg://user@host:5432/db``."""
    redis_url: str | None = "redis://127.0.0.1:6379/0"
    """Redis for the plan read cache; empty to run without a cache."""
    broker_url: str = "redis://127.0.0.1:6379/0"
    """Celery broker that profiling jobs are sent to."""
    queue_prefix: str = ""
    """Prefix of every broker queue name (``cpu`` becomes ``<prefix>cpu``), so that one Redis can serve several
    deployments; the API and the workers of one deployment must agree on it."""
    api_token: SecretStr | None = None
    """Bearer token that writes require. Unset means every write is refused: never open by default."""
    read_token: SecretStr | None = None
    """Token for reads when ``read_token_required``; the write token is accepted for reads too."""
    read_token_required: bool = False
    """Require a bearer token for reads as well (private clusters)."""
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    """Request bodies above this are refused with 413; a 10^5-stage trace is about 6 MB."""
    cache_ttl_s: int = Field(default=300, ge=1)
    """Upper bound on how long a cached plan can outlive a write (see NOTE [cache coherence] in cache.py)."""
    cache_prefix: str = "remat:"
    """Prefix of every Redis key the cache writes, so one Redis can serve several deployments."""
    redis_timeout_s: float = Field(default=0.2, gt=0)
    """Socket connect/read timeout for the cache: a slow Redis must not slow plan reads down."""
    redis_retry_after_s: float = Field(default=5.0, ge=0)
    """After a Redis failure, skip the cache for this long instead of paying the timeout per request."""
    broker_timeout_s: float = Field(default=2.0, gt=0)
    """Connect timeout when enqueueing a job; past it the job is recorded as not enqueued."""
    # --- limits on what one request or job may cost (docs/service.md, "Limits") ---------------------------
    max_stages: int = Field(default=20_000, ge=2, le=1_000_000)
    """Traces with more stages are refused (422 naming the limit): a real network has at most a few thousand."""
    max_graph_vertices: int = Field(default=20_000, ge=2, le=1_000_000)
    """Traces whose op graph (``graph``) has more vertices are refused (422 naming the limit): torchvision's
    classifiers have a few hundred to a few thousand; ``acg`` plans in linear time on chain-like graphs
    (docs/service.md, "Limits", has its time at this limit)."""
    inline_cubic_stages: int = Field(default=256, ge=1)
    """``cubic`` (O(n³)) runs inside an upload up to this many stages (under a second), beyond it as a job."""
    max_cubic_stages: int = Field(default=2000, ge=1)
    """Beyond this many stages ``cubic`` is not run at all (about a minute at 2000; ``linear`` is exact for
    the model that is measured, and answers in well under a second)."""
    # --- workers ---------------------------------------------------------------------------------------------
    worker_queues: str = "cpu"
    """Comma-separated queues ``remat-worker`` consumes: ``cpu``, ``cuda`` (or ``cuda-<model>``), ``plan``."""
    worker_concurrency: int = Field(default=1, ge=1, le=64)
    """Jobs a worker runs at once; keep 1 per GPU."""
    job_lease_s: float = Field(default=30.0, ge=1.0)
    """A running job's lease (NOTE [job lease] in models.py): renewed every third of it by a heartbeat; when it
    lapses the job is queued again. A killed worker's job restarts within about this plus ``reap_interval_s``."""
    job_max_attempts: int = Field(default=3, ge=1, le=100)
    """Leases a job may take: one that kills its worker this many times fails with that reason."""
    reap_interval_s: float = Field(default=10.0, ge=0.1)
    """How often each worker looks for jobs whose lease lapsed, or that the broker lost."""
    pending_resend_after_s: float = Field(default=10.0, ge=0.1)
    """A job the API could not hand to the broker (it was down) is sent again by a worker's reaper after this."""
    requeue_after_s: float = Field(default=900.0, ge=1.0)
    """A job queued this long without a worker taking it is sent again (a broker restart loses messages)."""
    certify_s: float = Field(default=0.0, ge=0.0, le=600.0)
    """Seconds a worker's MILP spends certifying each graph plan's bound over every one-level graph plan
    (remat.client.planning.relaxed_step); 0, the default, keeps to the forced-memory bound. The slow path
    for zoo models: the bound is stored with the plan and served from the cache."""
    task_time_limit_s: int = Field(default=3600, ge=10)
    """Hard limit of one profiling job; the soft limit (a clean failure) is 30 s earlier."""
    plan_time_limit_s: int = Field(default=600, ge=10)
    """Hard limit of one planning job (``cubic`` on a large trace)."""
    visibility_timeout_s: int = Field(default=7200, ge=60)
    """Redis re-delivers an unacknowledged task after this long: well above every time limit, so a running
    task is never delivered twice; jobs of killed workers come back through the lease, not through this."""
    auto_migrate: bool = True
    """Run ``alembic upgrade head`` when the service starts (the embedded store always does on SQLite)."""

    @field_validator("redis_url", mode="before")
    @classmethod
    def _empty_redis_is_none(cls, value: object) -> object:
        if isinstance(value, str) and value.strip().lower() in ("", "none", "off"):
            return None
        return value

    @field_validator("database_url")
    @classmethod
    def _psycopg_driver(cls, value: str) -> str:
        # A bare postgresql:// URL would pick psycopg2, which is not installed; psycopg 3 is.
        for prefix in ("postgresql://", "postgres://"):
            if value.startswith(prefix):
                return "postgresql+psycopg://" + value[len(prefix):]
        return value

    @property
    def broker_url_redacted(self) -> str:
        """The broker URL with any password masked, for messages that end up in the jobs table."""
        return redact_url(self.broker_url)

    @property
    def queues(self) -> list[str]:
        """``worker_queues`` as a list, without the prefix."""
        return [q.strip() for q in self.worker_queues.split(",") if q.strip()]

    def queue_name(self, queue: str) -> str:
        """The broker's name of one of our queues."""
        return self.queue_prefix + queue

    @property
    def writes_enabled(self) -> bool:
        return self.api_token is not None and bool(self.api_token.get_secret_value())
