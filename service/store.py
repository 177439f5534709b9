"""``PlanStore``: the plan database in-process, without the HTTP service.

This is the CLI's embedded mode (``remat-client plan resnet152`` with no server configured) and what a
worker with database access writes through. It opens a SQLite file under the user's cache directory by
default, migrates it on first use, and wraps each call in one transaction of the shared repository, so it
stores exactly what the HTTP API stores.

Example::

    from remat.service.store import PlanStore
    from remat.client.planning.plans import STORED_COST_MODEL, plan_all

    with PlanStore() as store:                      # REMAT_DATABASE_URL or the user cache SQLite file
        key = store.save_trace_and_plans(trace, plan_all(trace, cost_model=STORED_COST_MODEL))
        plans = store.find_plans(key)               # list[Plan] | None

Importing this module pulls in SQLAlchemy and Pydantic only (Alembic when a migration runs, redis with
``use_cache``): no web framework, no Celery, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from remat.client.plan import Plan
from remat.client.plan_key import PlanKey
from remat.client.trace import Trace
from remat.service import jobs, migrate, repository
from remat.service.config import ServiceSettings
from remat.service.db import Database
from remat.service.errors import SchemaOutdatedError
from remat.service.records import JobRecord, Measurement, PlanRecord, StoredTrace

if TYPE_CHECKING:
    from remat.service.cache import PlanCache

DEFAULT_ALGORITHM = "linear"


class PlanStore:
    """Save and find plans, traces, measurements and jobs; one transaction per call.

    Args:
        url: SQLAlchemy database URL. None: ``settings.database_url`` (``REMAT_DATABASE_URL``, else
            ``<user cache dir>/remat/remat.sqlite``).
        settings: Settings to use instead of reading the environment.
        auto_migrate: Upgrade the schema to head when it is behind. None (default): on SQLite only; a
            shared PostgreSQL database is migrated by its operator (``remat-service migrate``).
        use_cache: Invalidate the service's Redis plan cache after writes (for writers that share a
            database with a running service, such as workers). Off for the embedded SQLite use.
    """

    def __init__(self, url: str | None = None, *, settings: ServiceSettings | None = None,
                 auto_migrate: bool | None = None, use_cache: bool = False) -> None:
        self._settings = settings or ServiceSettings()
        self.url = url or self._settings.database_url
        self._auto_migrate = auto_migrate
        self._use_cache = use_cache
        self._db: Database | None = None
        self._cache: PlanCache | None = None

    # --- lifecycle ----------------------------------------------------------------------------------------

    def open(self) -> PlanStore:
        """Connect and bring the schema to head (see ``auto_migrate``); idempotent.

        Raises:
            SchemaOutdatedError: the schema is not at head and migrating was not allowed.
        """
        if self._db is not None:
            return self
        db = Database(self.url)
        try:
            if self._auto_migrate if self._auto_migrate is not None else db.is_sqlite:
                migrate.ensure_current(db)
            else:
                current, head = migrate.current_revision(db), migrate.HEAD_REVISION
                if current != head:
                    raise SchemaOutdatedError(
                        f"database schema is at revision {current or 'none'}, this remat needs {head}: "
                        f"run `remat-service migrate` with REMAT_DATABASE_URL pointing at it")
        except BaseException:
            db.dispose()
            raise
        self._db = db
        if self._use_cache:
            from remat.service.cache import PlanCache  # redis only for writers that share a service's cache

            self._cache = PlanCache(self._settings)
        return self

    def close(self) -> None:
        if self._db is not None:
            self._db.dispose()
            self._db = None
        if self._cache is not None:
            self._cache.close()
            self._cache = None

    def __enter__(self) -> PlanStore:
        return self.open()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def is_open(self) -> bool:
        return self._db is not None

    @property
    def db(self) -> Database:
        """The open database (opening it on first use)."""
        if self._db is None:
            self.open()
        assert self._db is not None
        return self._db

    def invalidate(self, key: PlanKey, plans: Sequence[Plan]) -> None:
        """Drop the cached reads of these plans (after the commit that changed them)."""
        if self._cache is not None:
            self._cache.delete_plans(key, [(p.algorithm, p.budget_bytes) for p in plans])

    # --- traces and plans ---------------------------------------------------------------------------------

    def save_trace(self, trace: Trace) -> StoredTrace:
        """Store a trace once per content (no plans)."""
        with self.db.write_session() as session:
            return repository.store_trace(session=session, trace=trace)

    def save_trace_and_plans(self, trace: Trace, plans: Sequence[Plan]) -> PlanKey:
        """Store a trace and the plans computed from it in one transaction; returns their key.

        The plans are left out when a newer trace of the key is stored (NOTE [latest profile wins] in
        repository.py): that can only be an older content stored again.

        Raises:
            TraceRejectedError: the trace exceeds the database's limits or has malformed key metadata.
        """
        with self.db.write_session() as session:
            stored = repository.store_trace(session=session, trace=trace)
            repository.store_plans(session=session, trace_id=stored.trace_id, plans=plans)
        self.invalidate(stored.key, plans)
        return stored.key

    def save_profile(self, trace: Trace, plans: Sequence[Plan], measurements: Mapping[str, Measurement]) -> PlanKey:
        """A profiling run's trace, plans and measurements in one transaction; returns their key."""
        with self.db.write_session() as session:
            stored = repository.store_profile(session=session, trace=trace, plans=plans, measurements=measurements)
        self.invalidate(stored.key, plans)
        return stored.key

    def find_plans(self, key: PlanKey) -> list[Plan] | None:
        """Every stored plan for ``key`` (one per algorithm and budget), or None when there is none."""
        records = self.find_plan_records(key)
        return [r.plan for r in records] or None

    def find_plan_records(self, key: PlanKey) -> list[PlanRecord]:
        """Like :meth:`find_plans` with provenance and measurements; empty when there is none."""
        with self.db.read_session() as session:
            return repository.find_plans(session=session, key=key)

    def complete_plans(self, key: PlanKey) -> list[PlanRecord] | None:
        """``key``'s complete stored answer (``repository.newest_complete``: the rule the local mode and the
        workers share), or None when the key must be profiled."""
        with self.db.read_session() as session:
            return repository.complete_plans(session=session, key=key)

    def find_plans_by_name(self, name: str, like: PlanKey) -> list[PlanRecord]:
        """Plans stored under model ``name`` with ``like``'s key but for the hash (repository.find_plans_by_name)."""
        with self.db.read_session() as session:
            return repository.find_plans_by_name(session=session, name=name, like=like)

    def find_plans_by_hash_prefix(self, prefix: str) -> list[PlanRecord]:
        """Plans of every architecture whose hash starts with ``prefix``, newest first."""
        with self.db.read_session() as session:
            return repository.find_plans_by_hash_prefix(session=session, prefix=prefix)

    def find_frontier(self, key: PlanKey) -> list[PlanRecord]:
        """``key``'s stored Pareto frontier, tightest first (``repository.find_frontier``)."""
        with self.db.read_session() as session:
            return repository.find_frontier(session=session, key=key)

    def get_plan(self, key: PlanKey, *, algorithm: str = DEFAULT_ALGORITHM,
                 budget_bytes: int | None = None) -> PlanRecord | None:
        """One plan with its measurements, or None."""
        with self.db.read_session() as session:
            return repository.get_plan(session=session, key=key, algorithm=algorithm, budget_bytes=budget_bytes)

    def size_profiles(self, key: PlanKey, *, include_own: bool = False) -> list[Trace]:
        """Profiles of ``key`` at other batch sizes or sequence lengths, to derive a trace at its shape from
        (``repository``)."""
        with self.db.read_session() as session:
            return repository.size_profiles(session=session, key=key, include_own=include_own)

    def load_trace(self, trace_id: int) -> Trace | None:
        with self.db.read_session() as session:
            return repository.load_trace(session=session, trace_id=trace_id)

    # --- measurements -------------------------------------------------------------------------------------

    def save_measurement(self, key: PlanKey, measurement: Measurement, *, algorithm: str = DEFAULT_ALGORITHM,
                         budget_bytes: int | None = None) -> Measurement | None:
        """Attach a validation run to a stored plan; None when the plan is not stored."""
        with self.db.write_session() as session:
            stored = repository.store_measurement(session=session, key=key, algorithm=algorithm,
                                                  budget_bytes=budget_bytes, measurement=measurement)
        if stored is not None and self._cache is not None:
            self._cache.delete_plans(key, [(algorithm, budget_bytes)])
        return stored

    # --- jobs ---------------------------------------------------------------------------------------------

    def create_job(self, request: Mapping[str, Any]) -> JobRecord:
        with self.db.write_session() as session:
            return jobs.create_job(session=session, request=request)[0]

    def get_job(self, job_id: str) -> JobRecord | None:
        with self.db.read_session() as session:
            return jobs.get_job(session=session, job_id=job_id)

    def update_job(self, job_id: str, **changes: Any) -> JobRecord | None:
        """Advance a job (``state``, ``progress``, ``message``, ``error``, ``result``, ``only_from``)."""
        with self.db.write_session() as session:
            return jobs.update_job(session=session, job_id=job_id, **changes)
