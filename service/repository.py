"""Reads and writes of the plan database, shared by the HTTP API, the embedded store and the worker.

Every function is keyword-only, takes the caller's :class:`~sqlalchemy.orm.Session` and runs inside the
transaction the caller opened (``Database.write_session()`` / ``read_session()``): the caller decides what
one unit of work is, and nothing here commits. Lookups return ``None`` on a miss; nothing here knows HTTP.

NOTE [idempotent writes]: writers race (two workers profiling the same model, a client retrying a POST).
Every insert that can collide is an ``INSERT ... ON CONFLICT`` on a unique key, so the second writer either
finds the first's row (architectures, traces: DO NOTHING then select) or replaces its content (plans: DO
UPDATE, latest profile wins). Neither raises, on SQLite or PostgreSQL. Rows of one statement are sorted by
key so that two PostgreSQL transactions upserting the same plans lock them in the same order and cannot
deadlock. Only bound parameters reach the SQL.

NOTE [latest profile wins]: a key's plans come from its newest trace, the one with the greatest id among the
traces of that key (ids grow with every trace stored; a re-upload of an older content is not a new trace).
Plans are written late: a ``plan`` job runs ``cubic`` or the frontier minutes after its upload, and a
re-profile may have stored a newer trace in between. So ``store_plans`` writes a trace's plans only while it
is the newest of its key, and drops them otherwise (``StoredPlans.superseded_by``): a late job can never put
a superseded trace's ``cubic`` beside the current ``linear``. Frontier points are keyed by their budget, so a
new curve does not replace the old one's rows: writing a trace's frontier deletes the key's points from older
traces (and their measurements with them), and the key keeps one curve. The check and the upsert run under a lock on
the key's architecture row (``FOR NO KEY UPDATE``, which inserts referencing the row do not wait on), so on
PostgreSQL a concurrent writer either committed its trace before our check (and we see it) or waits for our
commit (and then overwrites); SQLite's write transactions are serial anyway. Readers pick the newest trace by
the same rule (``newest_complete``, ``find_frontier``), never by a writer's clock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy import Select, delete, func, or_, select, text
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, defer

from remat.client.budget_spec import BudgetInfeasibleError, pick_for_budget
from remat.client.derived_trace import (
    DERIVED_FROM,
    derived_along,
    derived_sizes,
    inputs_at_batch,
    inputs_at_length,
    token_length,
)
from remat.client.errors import InvalidKeyError
from remat.client.measurement import STORED_FIELDS, Measurement
from remat.client.plan import BUDGET_ALGORITHM, Plan
from remat.client.plan_key import KEY_FIELDS, UNKNOWN, PlanKey, content_sha256, normalize_torch_version
from remat.client.report import BASELINE_ALGORITHM
from remat.client.report import PlanRow as ReportRow
from remat.client.trace import STAGE_FIELDS, Stage, Trace, parse_trace
from remat.service.keys import check_storable, trace_key
from remat.service.models import (
    NO_BUDGET,
    Architecture,
    MeasurementRow,
    PlanRow,
    TraceRow,
    TraceStageRow,
    utcnow,
)
from remat.service.records import (
    KeySummary,
    PlanRecord,
    StoredPlans,
    StoredTrace,
    TraceInfo,
)

_STAGE_CHUNK = 5000
MAX_MEASUREMENTS_PER_PLAN = 20
_PLAN_KEY_COLUMNS = [c.name for c in next(c for c in PlanRow.__table__.constraints if c.name == "uq_plans_key").columns]
"""The columns a plan is unique on (models.py ``uq_plans_key``): what an upsert conflicts on."""
_COLUMN_OF = {"device": "device_class"}
"""The key fields whose column is named otherwise; ``model_hash`` is the architecture's ``hash``."""
_ROW_KEY_COLUMNS = tuple(_COLUMN_OF.get(name, name) for name in KEY_FIELDS if name != "model_hash")


def _key_columns(key: PlanKey) -> dict[str, Any]:
    """The columns of ``plans`` and ``traces`` that hold ``key``, less ``model_hash`` (``architecture_id``).

    One key-to-row mapping for every write and lookup: the shape is stored as text (``32,3,224,224``).
    """
    values = {**key.to_dict(), "input_shape": key.input_shape_text}
    return {_COLUMN_OF.get(name, name): value for name, value in values.items() if name != "model_hash"}


def _row_key(model_hash: str, row: PlanRow | TraceRow, **overrides: Any) -> PlanKey:
    """The key stored in a ``plans`` or ``traces`` row (``_key_columns`` backwards); ``overrides`` replace fields
    the row holds in another form (a trace's full torch version)."""
    values = {name: getattr(row, _COLUMN_OF.get(name, name)) for name in KEY_FIELDS if name != "model_hash"}
    return PlanKey(model_hash=model_hash, **{**values, **overrides})


def _insert(session: Session, table: Any) -> Any:
    """The dialect's INSERT, which has ``on_conflict_do_*`` (both SQLite and PostgreSQL spell it alike)."""
    dialect = session.get_bind().dialect.name
    module = {"postgresql": postgresql, "sqlite": sqlite}.get(dialect)
    if module is None:
        raise NotImplementedError(f"database dialect {dialect!r} is not supported; use SQLite or PostgreSQL")
    return module.insert(table)


def ping(*, session: Session) -> None:
    """Run a trivial query; raises the driver's error when the database is unreachable."""
    session.execute(text("SELECT 1"))


# --- traces -----------------------------------------------------------------------------------------------

def _architecture_id(session: Session, *, model_hash: str, name: str | None, trace: Trace) -> int:
    names_digest = hashlib.sha256("\n".join(s.name for s in trace.stages).encode("utf-8")).hexdigest()
    summary = {"num_stages": trace.num_stages, "stage_names_sha256": names_digest}
    stmt = _insert(session, Architecture.__table__).values(
        hash=model_hash, name=name, graph_summary=summary, created_at=utcnow())
    session.execute(stmt.on_conflict_do_nothing(index_elements=["hash"]))
    return session.execute(select(Architecture.id).where(Architecture.hash == model_hash)).scalar_one()


def _stage_rows(trace_id: int, trace: Trace) -> Iterable[dict[str, Any]]:
    for position, s in enumerate(trace.stages):
        yield {"trace_id": trace_id, "position": position, **{name: getattr(s, name) for name in STAGE_FIELDS},
               "extra": dict(s.extra) or None}


def store_trace(*, session: Session, trace: Trace) -> StoredTrace:
    """Store a trace and its stages once per distinct content; storing it again is a no-op.

    Raises:
        TraceRejectedError: the trace exceeds the database's limits or its key metadata is malformed.
    """
    check_storable(trace)
    digest = content_sha256(trace)
    key = trace_key(trace, content_hash=digest)
    meta = trace.metadata
    arch_id = _architecture_id(session, model_hash=key.model_hash, name=meta.get("model"), trace=trace)
    # The trace records its torch version in full (or not at all); its plans key on the major.minor.
    columns = {**_key_columns(key), "torch_version": meta.get("torch_version")}
    stmt = _insert(session, TraceRow.__table__).values(
        architecture_id=arch_id, content_sha256=digest, **columns, device_name=meta.get("device_name"),
        input_bytes=trace.input_bytes, num_stages=trace.num_stages, metadata=dict(meta),
        graph=trace.graph.to_dict() if trace.graph is not None else None, created_at=utcnow())
    stmt = stmt.on_conflict_do_nothing(index_elements=["content_sha256"]).returning(TraceRow.__table__.c.id)
    trace_id = session.execute(stmt).scalar_one_or_none()
    if trace_id is None:
        existing = select(TraceRow.id).where(TraceRow.content_sha256 == digest)
        return StoredTrace(trace_id=session.execute(existing).scalar_one(), key=key, content_sha256=digest,
                           created=False)
    rows = list(_stage_rows(trace_id, trace))
    for start in range(0, len(rows), _STAGE_CHUNK):
        session.execute(TraceStageRow.__table__.insert(), rows[start:start + _STAGE_CHUNK])
    return StoredTrace(trace_id=trace_id, key=key, content_sha256=digest, created=True)


def load_trace(*, session: Session, trace_id: int) -> Trace | None:
    """Rebuild a stored trace (the worker plans from it again when planners change)."""
    row = session.get(TraceRow, trace_id)
    if row is None:
        return None
    stages = []
    for s in row.stages:
        stage: dict[str, Any] = {**(s.extra or {})}
        for name in STAGE_FIELDS:
            value = getattr(s, name)
            if value is not None:  # times are None when not profiled
                stage[name] = value
        stages.append(stage)
    return parse_trace({**row.trace_metadata, "format": "remat-trace/1", "input_bytes": row.input_bytes,
                        "stages": stages, **({"graph": row.graph} if row.graph is not None else {})})


MAX_SIZE_PROFILES = 4
"""Profiles of a key at other sizes that :func:`size_profiles` returns per family (the newest per batch size;
the newest per sequence length)."""
_SIZE_CANDIDATES = 64
"""Traces of the architecture read to find them: the newest first, a bounded read however many are stored."""


def size_profiles(*, session: Session, key: PlanKey, include_own: bool = False) -> list[Trace]:
    """Measured profiles of ``key`` at other sizes: the traces a trace at ``key``'s shape can be derived from
    (remat.client.derived_trace.derive_at). Two families: those at other batch sizes with the key's sample
    shape, and, for a token model (derived_trace.token_length), those at the key's batch with other sequence
    lengths; the newest per size, at most MAX_SIZE_PROFILES per family. With ``include_own``, the key's own
    profile too.

    Same architecture, call, precision, mode, gradient convention, device class and torch major.minor (any, for
    a key whose torch version is ``unknown``); no trace that was itself derived. None at all when the key has a
    trace of its own (unless ``include_own``): then nothing is to be derived, and a derived trace stored beside
    it would supersede it.
    """
    arch = session.execute(select(Architecture.id).where(Architecture.hash == key.model_hash)).scalar_one_or_none()
    if arch is None or not key.input_shape:
        return []
    columns = {c: v for c, v in _key_columns(key).items() if c not in ("input_shape", "torch_version", "inputs")}
    own_batch, sample = key.input_shape[0], list(key.input_shape[1:])
    seq_len = token_length(key.input_shape, key.inputs)
    rows = session.execute(
        select(TraceRow.id, TraceRow.input_shape, TraceRow.inputs, TraceRow.torch_version, TraceRow.trace_metadata)
        .where(TraceRow.architecture_id == arch, *(getattr(TraceRow, c) == v for c, v in columns.items()))
        .order_by(TraceRow.id.desc()).limit(_SIZE_CANDIDATES)).all()
    by_batch: dict[int, int] = {}
    by_length: dict[int, int] = {}
    for trace_id, shape_text, inputs, version, metadata in rows:
        shape = [int(d) for d in shape_text.split(",")] if shape_text else []
        if not shape:
            continue
        # a call of several inputs names its sizes in its signature too: the same call at another size
        same_call_in_batch = (shape[1:] == sample
                              and inputs_at_batch(inputs or "", shape[0], own_batch) == key.inputs)
        same_call_in_length = (seq_len is not None and len(shape) == 2 and shape[0] == own_batch
                               and shape[1] not in (seq_len, own_batch)
                               and inputs_at_length(inputs or "", shape[1], seq_len) == key.inputs)
        if not same_call_in_batch and not same_call_in_length:
            continue
        if shape == list(key.input_shape) and not include_own:
            return []  # the key has a trace of its own: a profile (or one derived before) beats a new derivation
        if key.torch_version not in (UNKNOWN, _major_minor(version)) or (metadata or {}).get(DERIVED_FROM):
            continue
        if same_call_in_batch and len(by_batch) < MAX_SIZE_PROFILES:
            by_batch.setdefault(shape[0], trace_id)
        elif same_call_in_length and len(by_length) < MAX_SIZE_PROFILES:
            by_length.setdefault(shape[1], trace_id)
    chosen = dict.fromkeys([*by_batch.values(), *by_length.values()])
    return [t for t in (load_trace(session=session, trace_id=i) for i in chosen) if t is not None]


# --- plans ------------------------------------------------------------------------------------------------

def store_plans(*, session: Session, trace_id: int, plans: Sequence[Plan]) -> StoredPlans | None:
    """Upsert the plans computed from a stored trace under that trace's key; None if the trace is unknown.

    A plan already stored for the same key, algorithm and budget is replaced (see NOTE [idempotent writes]),
    unless a newer trace of the key is stored: then nothing is written (NOTE [latest profile wins]).
    """
    trace = session.get(TraceRow, trace_id)
    if trace is None:
        return None
    model_hash = session.execute(select(Architecture.hash).where(Architecture.id == trace.architecture_id))
    key = _row_key(model_hash.scalar_one(), trace, torch_version=_major_minor(trace.torch_version))
    newest = _newest_trace_id(session, architecture_id=trace.architecture_id, key=key)
    if newest != trace_id:
        return StoredPlans(key=key, superseded_by=newest)
    by_key = {(p.algorithm, p.budget_bytes or NO_BUDGET): p for p in plans}  # one row per key per statement
    if not by_key:
        return StoredPlans(key=key)
    now = utcnow()
    values = [{"architecture_id": trace.architecture_id, "trace_id": trace_id, **_key_columns(key),
               "algorithm": algorithm, "budget_bytes": budget,
               "cost_model": p.cost_model, "checkpoints": list(p.checkpoints), "num_stages": p.num_stages,
               "dropped_vertices": list(p.dropped_vertices) if p.dropped_vertices is not None else None,
               "num_vertices": p.num_vertices,
               "predicted_peak_bytes": p.predicted_peak_bytes, "baseline_peak_bytes": p.baseline_peak_bytes,
               "recompute_ms": p.recompute_ms, "step_ms": p.step_ms, "extra": dict(p.extra) or None,
               "created_at": now, "updated_at": now}
              for (algorithm, budget), p in sorted(by_key.items())]
    # One statement for any number of plans, its parameters a list: SQLAlchemy caches its compiled form and
    # sends the rows as one multi-row INSERT ("insertmanyvalues"), where .values(rows) compiled anew per count.
    stmt = _insert(session, PlanRow.__table__)
    replaced = ("trace_id", "cost_model", "checkpoints", "num_stages", "dropped_vertices", "num_vertices",
                "predicted_peak_bytes",
                "baseline_peak_bytes", "recompute_ms", "step_ms", "extra", "updated_at")
    stmt = stmt.on_conflict_do_update(index_elements=_PLAN_KEY_COLUMNS,
                                      set_={c: stmt.excluded[c] for c in replaced})
    session.execute(stmt, values)
    if any(budget != NO_BUDGET for _, budget in by_key):  # a new frontier: the older curves' points go
        session.execute(delete(PlanRow).where(
            PlanRow.architecture_id == trace.architecture_id, PlanRow.trace_id != trace_id,
            PlanRow.algorithm == BUDGET_ALGORITHM, PlanRow.budget_bytes != NO_BUDGET,
            *(getattr(PlanRow, column) == value for column, value in _key_columns(key).items())))
    return StoredPlans(key=key)


def _newest_trace_id(session: Session, *, architecture_id: int, key: PlanKey) -> int:
    """The newest stored trace of ``key``, read under the key's lock (NOTE [latest profile wins]).

    The lock is held to the end of the caller's transaction. Traces key on the full torch version and plans
    on its major.minor, so the versions are compared here rather than in SQL; a key has few traces.
    """
    session.execute(select(Architecture.id).where(Architecture.id == architecture_id)
                    .with_for_update(key_share=True))
    signature = {column: value for column, value in _key_columns(key).items() if column != "torch_version"}
    traces = session.execute(select(TraceRow.id, TraceRow.torch_version).where(
        TraceRow.architecture_id == architecture_id, *(getattr(TraceRow, c) == v for c, v in signature.items()))
        .order_by(TraceRow.id.desc()))
    return next(trace_id for trace_id, version in traces if _major_minor(version) == key.torch_version)


def has_plans(*, session: Session, trace_id: int, algorithms: Sequence[str]) -> bool:
    """Whether every one of ``algorithms`` has a stored plan computed from this very trace."""
    found = session.execute(select(func.count(func.distinct(PlanRow.algorithm))).where(
        PlanRow.trace_id == trace_id, PlanRow.algorithm.in_(list(algorithms)))).scalar_one()
    return found == len(set(algorithms))


def _major_minor(version: str | None) -> str:
    """A trace's torch version as plans key it; ``unknown`` when the trace did not record a readable one."""
    try:
        return normalize_torch_version(version if version is not None else UNKNOWN)
    except InvalidKeyError:
        return UNKNOWN


def _plan_query(key: PlanKey, *, name: str | None = None) -> Select[Any]:
    """Plans of ``key``; a key whose torch_version is ``unknown`` matches every version, newest first. With
    ``name``, the architectures stored under that model name stand for the key's hash."""
    columns = _key_columns(key)
    if key.torch_version == UNKNOWN:
        del columns["torch_version"]
    architecture = Architecture.hash == key.model_hash if name is None else Architecture.name == name
    stmt = (select(PlanRow, TraceRow, Architecture)
            .join(Architecture, PlanRow.architecture_id == Architecture.id)
            .join(TraceRow, PlanRow.trace_id == TraceRow.id)
            .where(architecture, *(getattr(PlanRow, column) == value for column, value in columns.items())))
    return stmt.order_by(PlanRow.updated_at.desc(), PlanRow.id.desc())


def _measurements(session: Session, plans: Sequence[PlanRow], *, extra: bool = True,
                  limit: int = MAX_MEASUREMENTS_PER_PLAN) -> dict[int, tuple[Measurement, ...]]:
    """The latest measurements (at most ``limit``) of each plan whose checkpoints (or dropped vertices) are the
    plan's current ones. ``extra=False`` leaves the measurements' ``extra`` unread (empty): it holds their
    timelines, most of a measurement's bytes, which a summary of many plans does not show."""
    if not plans:
        return {}
    current = {p.id: (list(p.checkpoints), p.dropped_vertices) for p in plans}
    stmt = (select(MeasurementRow).where(MeasurementRow.plan_id.in_(current))
            .order_by(MeasurementRow.created_at.desc(), MeasurementRow.id.desc()))
    if not extra:
        stmt = stmt.options(defer(MeasurementRow.extra, raiseload=True))
    by_id = {p.id: p for p in plans}
    out: dict[int, list[Measurement]] = {pid: [] for pid in current}
    for m in session.execute(stmt).scalars():
        kept = out[m.plan_id]
        ran = (list(m.checkpoints), list(m.dropped_vertices) if m.dropped_vertices is not None else None)
        if ran == current[m.plan_id] and len(kept) < limit:
            kept.append(_measurement(m, by_id[m.plan_id], extra=extra))
    return {pid: tuple(ms) for pid, ms in out.items()}


def _measurement(m: MeasurementRow, plan: PlanRow, *, extra: bool = True) -> Measurement:
    values = {name: getattr(m, name) for name in STORED_FIELDS if extra or name != "extra"}
    values["checkpoints"] = tuple(m.checkpoints)
    values["dropped_vertices"] = tuple(m.dropped_vertices) if m.dropped_vertices is not None else None
    values["extra"] = (m.extra or {}) if extra else {}
    return Measurement(**values, id=m.id, created_at=m.created_at, algorithm=plan.algorithm, grads=plan.grads,
                       dtype=plan.dtype, device=plan.device_class)


def _plan(plan: PlanRow) -> Plan:
    """The ``Plan`` a ``plans`` row stores."""
    return Plan(algorithm=plan.algorithm, cost_model=plan.cost_model, checkpoints=tuple(plan.checkpoints),
                predicted_peak_bytes=plan.predicted_peak_bytes, baseline_peak_bytes=plan.baseline_peak_bytes,
                num_stages=plan.num_stages, recompute_ms=plan.recompute_ms, step_ms=plan.step_ms,
                budget_bytes=plan.budget_bytes or None,
                dropped_vertices=tuple(plan.dropped_vertices) if plan.dropped_vertices is not None else None,
                num_vertices=plan.num_vertices, extra=plan.extra or {})


def _records(session: Session, rows: Sequence[Any]) -> list[PlanRecord]:
    measured = _measurements(session, [r[0] for r in rows])
    out = []
    for plan, trace, arch in rows:
        out.append(PlanRecord(
            plan_id=plan.id, key=_row_key(arch.hash, plan), measurements=measured[plan.id], created_at=plan.created_at,
            updated_at=plan.updated_at, plan=_plan(plan),
            trace=TraceInfo(trace_id=trace.id, content_sha256=trace.content_sha256, model=arch.name,
                            device_name=trace.device_name, torch_version=trace.torch_version,
                            batch_size=(trace.trace_metadata or {}).get("batch_size"),
                            derived_from=derived_sizes(trace.trace_metadata),
                            derived_along=derived_along(trace.trace_metadata),
                            created_at=trace.created_at)))
    return out


def get_plan(*, session: Session, key: PlanKey, algorithm: str, budget_bytes: int | None = None) -> PlanRecord | None:
    """The plan stored for ``key``, ``algorithm`` and ``budget_bytes`` (None: no budget), or None."""
    stmt = _plan_query(key).where(PlanRow.algorithm == algorithm,
                                  PlanRow.budget_bytes == (budget_bytes or NO_BUDGET)).limit(1)
    rows = session.execute(stmt).all()
    return _records(session, rows)[0] if rows else None


def find_frontier(*, session: Session, key: PlanKey) -> list[PlanRecord]:
    """The stored Pareto frontier of ``key`` (its ``budget`` plans, one per peak), tightest peak first.

    Only the newest trace's points: a frontier is one trace's curve, never a mix of two profiles.
    """
    rows = session.execute(_plan_query(key).where(PlanRow.algorithm == BUDGET_ALGORITHM,
                                                  PlanRow.budget_bytes != NO_BUDGET)).all()
    if not rows:
        return []
    newest_trace = max(r[1].id for r in rows)  # NOTE [latest profile wins]
    points = sorted((r for r in rows if r[1].id == newest_trace), key=lambda r: r[0].budget_bytes)
    return _records(session, points)


def pick_budget_plan(*, session: Session, key: PlanKey, budget_bytes: int) -> tuple[PlanRecord | None, int | None]:
    """The stored frontier plan answering ``budget_bytes`` (the largest peak that fits) and the frontier's
    smallest peak; (None, None) without a stored frontier, (None, smallest) when nothing fits."""
    frontier = find_frontier(session=session, key=key)
    if not frontier:
        return None, None
    smallest = frontier[0].plan.predicted_peak_bytes
    try:
        return pick_for_budget(frontier, budget_bytes, peak=lambda r: r.plan.predicted_peak_bytes), smallest
    except BudgetInfeasibleError:
        return None, smallest


def find_plans(*, session: Session, key: PlanKey) -> list[PlanRecord]:
    """Every plan stored for ``key`` (all algorithms and budgets), by algorithm then budget."""
    rows = session.execute(_plan_query(key).order_by(None).order_by(
        PlanRow.algorithm, PlanRow.budget_bytes, PlanRow.updated_at.desc(), PlanRow.id.desc())).all()
    seen: set[tuple[str, int]] = set()
    newest = []  # with an unknown torch version, the newest plan of each algorithm and budget
    for row in rows:
        if (row[0].algorithm, row[0].budget_bytes) not in seen:
            seen.add((row[0].algorithm, row[0].budget_bytes))
            newest.append(row)
    return _records(session, newest)


def list_plans(*, session: Session, model_hash: str | None = None, model: str | None = None,
               algorithm: str | None = None, device: str | None = None, dtype: str | None = None,
               limit: int = 50, offset: int = 0, include_frontier: bool = False) -> tuple[list[PlanRecord], int]:
    """A page of plans matching the filters, newest first, and how many match in all.

    Frontier points (``budget`` plans, one per peak) are listed only when asked for by ``algorithm`` or
    ``include_frontier``: a search for a model's plans would otherwise be mostly curve points.
    """
    stmt = (select(PlanRow, TraceRow, Architecture)
            .join(Architecture, PlanRow.architecture_id == Architecture.id)
            .join(TraceRow, PlanRow.trace_id == TraceRow.id))
    for column, value in ((Architecture.hash, model_hash), (Architecture.name, model),
                          (PlanRow.algorithm, algorithm), (PlanRow.device_class, device), (PlanRow.dtype, dtype)):
        if value is not None:
            stmt = stmt.where(column == value)
    if algorithm is None and not include_frontier:
        stmt = stmt.where(PlanRow.algorithm != BUDGET_ALGORITHM)
    total = session.execute(select(func.count()).select_from(stmt.subquery())).scalar_one()
    page = stmt.order_by(PlanRow.updated_at.desc(), PlanRow.id.desc()).limit(limit).offset(offset)
    return _records(session, session.execute(page).all()), total


def find_plans_by_name(*, session: Session, name: str, like: PlanKey) -> list[PlanRecord]:
    """Every plan stored under model ``name`` whose key equals ``like`` in all but the architecture hash, newest
    first: a zoo name without builder arguments stands for one architecture, so the CLI answers a repeated
    ``plan resnet50`` from the store without building the model (and so without torch)."""
    return _records(session, session.execute(_plan_query(like, name=name)).all())


def find_plans_by_hash_prefix(*, session: Session, prefix: str, limit: int = 1000) -> list[PlanRecord]:
    """Plans of every architecture whose hash starts with ``prefix`` (``remat-client show HASH``), newest first."""
    stmt = (select(PlanRow, TraceRow, Architecture)
            .join(Architecture, PlanRow.architecture_id == Architecture.id)
            .join(TraceRow, PlanRow.trace_id == TraceRow.id)
            .where(Architecture.hash.startswith(prefix, autoescape=True))
            .order_by(PlanRow.updated_at.desc(), PlanRow.id.desc()).limit(limit))
    return _records(session, session.execute(stmt).all())


def key_summaries(*, session: Session, search: str | None = None, limit: int = 50,
                  offset: int = 0) -> tuple[list[KeySummary], int]:
    """A page of stored plan keys, newest planned first, and how many match in all (the web pages'
    architectures table).

    A key is its ``none`` plan: every stored trace is planned with every registered planner, ``none``
    included, and ``uq_plans_key`` makes that plan one row per key. ``search`` matches a substring of the
    model name (case-insensitive) or a prefix of the architecture hash. Three bounded reads: the page (walked
    in ``ix_plans_listing`` order), the other minimum-peak plans of the page's architectures, and their
    measurements without timelines.
    """
    stmt = (select(PlanRow, Architecture.hash, Architecture.name, TraceRow.created_at)
            .join(Architecture, PlanRow.architecture_id == Architecture.id)
            .join(TraceRow, PlanRow.trace_id == TraceRow.id)
            .where(PlanRow.algorithm == BASELINE_ALGORITHM, PlanRow.budget_bytes == NO_BUDGET))
    if search:
        stmt = stmt.where(or_(Architecture.name.icontains(search, autoescape=True),
                              Architecture.hash.startswith(search, autoescape=True)))
    total = session.execute(select(func.count()).select_from(stmt.with_only_columns(PlanRow.id).subquery())
                            ).scalar_one()
    page = session.execute(stmt.order_by(PlanRow.updated_at.desc(), PlanRow.id.desc())
                           .limit(limit).offset(offset)).all()
    if not page:
        return [], total
    # The page's other plans, matched to its keys by their key columns (a PlanKey is built per page row only).
    by_key: dict[tuple[Any, ...], list[PlanRow]] = {_key_signature(plan): [] for plan, *_ in page}
    for p in session.execute(select(PlanRow).where(PlanRow.architecture_id.in_({r[0].architecture_id for r in page}),
                                                   PlanRow.budget_bytes == NO_BUDGET)).scalars():
        by_key.get(_key_signature(p), []).append(p)
    newest = _measurements(session, [p for plans in by_key.values() for p in plans], extra=False, limit=1)
    return [KeySummary(key=_row_key(model_hash, plan), model=name, num_stages=plan.num_stages, profiled_at=profiled_at,
                       rows=tuple(ReportRow.from_measurement(_plan(p), newest[p.id][0] if newest[p.id] else None)
                                  for p in sorted(by_key[_key_signature(plan)], key=lambda p: p.algorithm)))
            for plan, model_hash, name, profiled_at in page], total


def _key_signature(row: PlanRow) -> tuple[Any, ...]:
    """The key columns of a ``plans`` row, its architecture's id for the hash: equal exactly when the keys are."""
    return (row.architecture_id, *(getattr(row, column) for column in _ROW_KEY_COLUMNS))


def trace_stages(*, session: Session, trace_id: int, limit: int, offset: int = 0) -> list[Stage]:
    """The stages ``offset`` to ``offset + limit`` of a stored trace, in order (a trace may have 20,000)."""
    rows = session.execute(select(TraceStageRow).where(TraceStageRow.trace_id == trace_id)
                           .order_by(TraceStageRow.position).limit(limit).offset(offset)).scalars()
    return [Stage(**{name: getattr(s, name) for name in STAGE_FIELDS}, extra=s.extra or {}) for s in rows]


def key_version(*, session: Session, key: PlanKey) -> tuple[Any, ...]:
    """A value that changes whenever ``key``'s plans or their measurements do (a plan replaced, added or
    deleted, a measurement stored): what a picture drawn from them is cached under. One aggregate read over
    the key's rows (``uq_plans_key``), none of their content."""
    stmt = (_plan_query(key).order_by(None)
            .outerjoin(MeasurementRow, MeasurementRow.plan_id == PlanRow.id)
            .with_only_columns(func.count(PlanRow.id), func.max(PlanRow.id), func.max(PlanRow.updated_at),
                               func.count(MeasurementRow.id), func.max(MeasurementRow.id),
                               maintain_column_froms=False))
    return tuple(session.execute(stmt).one())


def newest_complete(records: Sequence[PlanRecord]) -> list[PlanRecord] | None:
    """The one rule for "this key is already planned": the newest trace's plans, when every registered planner
    has a minimum-peak plan from that trace and each is measured; else None (the key must be profiled).

    Plans from two profiles are never mixed into one answer; the newest trace's frontier plans come along.
    """
    from remat.client.planning.planners import PLANNERS

    if not records:
        return None
    newest_trace = max(r.trace.trace_id for r in records)  # NOTE [latest profile wins]
    current = [r for r in records if r.trace.trace_id == newest_trace]
    measured = {r.plan.algorithm for r in current if not r.plan.budget_bytes and r.measurements}
    return current if measured >= set(PLANNERS) else None


def complete_plans(*, session: Session, key: PlanKey) -> list[PlanRecord] | None:
    """``key``'s stored answer under :func:`newest_complete`, or None when the key must be profiled."""
    return newest_complete(find_plans(session=session, key=key))


# --- measurements -----------------------------------------------------------------------------------------

def store_measurement(*, session: Session, key: PlanKey, algorithm: str, measurement: Measurement,
                      budget_bytes: int | None = None) -> Measurement | None:
    """Attach a validation run to a stored plan; None when no such plan is stored."""
    plan = session.execute(_plan_query(key).where(PlanRow.algorithm == algorithm,
                                                  PlanRow.budget_bytes == (budget_bytes or NO_BUDGET)).limit(1)
                           ).first()
    if plan is None:
        return None
    values = {name: getattr(measurement, name) for name in STORED_FIELDS}
    values["checkpoints"] = list(measurement.checkpoints if measurement.checkpoints is not None
                                 else plan[0].checkpoints)
    dropped = measurement.dropped_vertices if measurement.dropped_vertices is not None else plan[0].dropped_vertices
    values["dropped_vertices"] = list(dropped) if dropped is not None else None
    values["extra"] = dict(measurement.extra) or None
    row = MeasurementRow(plan_id=plan[0].id, created_at=utcnow(), **values)
    session.add(row)
    session.flush()
    return _measurement(row, plan[0])


def store_profile(*, session: Session, trace: Trace, plans: Sequence[Plan],
                  measurements: Mapping[str, Measurement]) -> StoredTrace:
    """A profiling run's trace, its plans and their measurements, in the caller's transaction.

    The one write of a finished profile (the CLI's embedded store and the workers both use it): either all of
    it is stored or, if the transaction rolls back, none of it. When a newer trace of the key is stored (this
    one's content was stored before it), the plans and measurements are left out and ``superseded_by`` says
    why (NOTE [latest profile wins]).
    """
    stored = store_trace(session=session, trace=trace)
    written = store_plans(session=session, trace_id=stored.trace_id, plans=plans)
    if written is not None and written.superseded_by is not None:  # a newer profile's plans stay; so do theirs
        return replace(stored, superseded_by=written.superseded_by)
    for plan in plans:
        measurement = measurements.get(plan.label)
        if measurement is not None:
            store_measurement(session=session, key=stored.key, algorithm=plan.algorithm, measurement=measurement,
                              budget_bytes=plan.budget_bytes)
    return stored
