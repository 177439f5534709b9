"""Budget points below the chain plans, for frontiers stored before they were computed.

Since 9753cb3 a key's stored frontier also holds, below the least peak of its chain plans, the nested and graph
plans that peak lower: ``budget`` rows whose ``budget_bytes`` is their own peak, naming their planner
(``planned_by``) and measured as its plan (NOTE [ budgets below the chains ] in remat.client.planning.plans).
A frontier stored before has none, so a budget below its chain plans was refused although a stored plan fits
it, until the model was profiled again. This revision adds them to every frontier that has none, by a frozen
copy of the rule (``with_points_below_chains``), each with copies of its source plan's measurements of its
current step, and names the planner of those stored without ``planned_by`` (between 9753cb3 and the field).

Downgrade keeps them: the schema is unchanged, and the code before this revision stores and serves such rows.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07
"""

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BUDGET = "budget"
NO_BUDGET = 0
STORED_COST_MODEL = "pytorch"
KEY = ("architecture_id", "input_shape", "inputs", "dtype", "mode", "grads", "device_class", "torch_version")


def _is_chain(row: Any) -> bool:
    """A plan that runs as a chain: no dropped vertices, not nested (frozen copy of ``Plan.runs_as``)."""
    return not row.is_graph and not _is_nested(row)


def _cost(row: Any) -> float:
    return row.recompute_ms if row.recompute_ms is not None else float("inf")


def points_below_chains(rows: Sequence[Any]) -> list[Any]:
    """The plan rows of one key that become budget points (frozen copy of ``with_points_below_chains`` over the
    newest frontier's trace): none where that frontier already has a point that is not a chain plan."""
    points = [r for r in rows if r.algorithm == BUDGET and r.budget_bytes != NO_BUDGET]
    if not points:
        return []
    newest = max(r.trace_id for r in points)  # NOTE [latest profile wins]: the frontier is one trace's
    frontier = [r for r in points if r.trace_id == newest]
    if not all(_is_chain(r) for r in frontier):
        return []
    least = min(r.predicted_peak_bytes for r in frontier)
    candidates = sorted((r for r in rows if r.trace_id == newest and r.budget_bytes == NO_BUDGET
                         and r.algorithm != BUDGET and not _is_chain(r) and r.cost_model == STORED_COST_MODEL
                         and r.predicted_peak_bytes < least),
                        key=lambda r: (r.predicted_peak_bytes, _cost(r)))
    below: list[Any] = []
    for row in candidates:  # tightest first: one joins if it is faster than every tighter one
        if all(_cost(row) < _cost(b) for b in below):
            below.append(row)
    return below


def _is_nested(row: Any) -> bool:
    return isinstance(row.extra, dict) and row.extra.get("nested") is True


def planners_of_points(rows: Sequence[Any]) -> list[tuple[int, str]]:
    """(point id, planner) for the points below the chains of one key that were stored without ``planned_by``
    (between 9753cb3 and the field): each is its trace's plan of the same peak and kind, graph or nested."""
    named = []
    for point in rows:
        if (point.algorithm != BUDGET or point.budget_bytes == NO_BUDGET or _is_chain(point)
                or (isinstance(point.extra, dict) and "planned_by" in point.extra)):
            continue
        sources = [r for r in rows if r.trace_id == point.trace_id and r.algorithm != BUDGET
                   and r.budget_bytes == NO_BUDGET and r.predicted_peak_bytes == point.predicted_peak_bytes
                   and (r.is_graph, _is_nested(r)) == (point.is_graph, _is_nested(point))]
        if len(sources) == 1:  # two plans of one peak and kind: which it was is not known, so it stays unnamed
            named.append((point.id, sources[0].algorithm))
    return named


def _copied(row: Any, **changes: Any) -> dict[str, Any]:
    """A row's values for an insert, less its id; a NULL stays SQL NULL (a reflected JSON column would write
    ``None`` as JSON ``null``, which ``IS NULL`` does not find)."""
    values = {k: (sa.null() if v is None else v) for k, v in row._mapping.items() if k != "id"}
    values.update(changes)
    return values


def _groups(rows: Iterable[Any]) -> Iterator[list[Any]]:
    """Consecutive rows of one plan key, from rows ordered by it."""
    group: list[Any] = []
    for row in rows:
        if group and tuple(getattr(row, k) for k in KEY) != tuple(getattr(group[0], k) for k in KEY):
            yield group
            group = []
        group.append(row)
    if group:
        yield group


def upgrade() -> None:
    conn = op.get_bind()
    meta = sa.MetaData()
    plans = sa.Table("plans", meta, autoload_with=conn)
    measurements = sa.Table("measurements", meta, autoload_with=conn)
    # What the rule reads, streamed in the order of the plan key's unique index, one key at a time: a cluster's
    # store is never held in memory at once (a graph plan's vertex list is read only for the points it makes).
    columns = [plans.c[name] for name in (*KEY, "id", "trace_id", "algorithm", "budget_bytes", "cost_model",
                                          "extra", "predicted_peak_bytes", "recompute_ms")]
    light = (sa.select(*columns, plans.c.dropped_vertices.is_not(None).label("is_graph"))
             .order_by(*(plans.c[k] for k in KEY), plans.c.id))
    streamed = conn.execute(light.execution_options(stream_results=True, yield_per=1000))
    sources: list[int] = []
    unnamed: list[tuple[int, str]] = []
    for rows in _groups(streamed):
        sources += [row.id for row in points_below_chains(rows)]
        unnamed += planners_of_points(rows)
    for point_id, planner in unnamed:
        extra = conn.execute(sa.select(plans.c.extra).where(plans.c.id == point_id)).scalar_one()
        conn.execute(plans.update().where(plans.c.id == point_id)
                     .values(extra={**(extra or {}), "planned_by": planner}))
    for source_id in sources:  # written after the read: no insert while its cursor is open
        source = conn.execute(sa.select(plans).where(plans.c.id == source_id)).one()
        point = _copied(source, algorithm=BUDGET, budget_bytes=source.predicted_peak_bytes,
                        extra={**(source.extra or {}), "planned_by": source.algorithm})
        point_id = conn.execute(plans.insert().values(**point).returning(plans.c.id)).scalar_one()
        for m in conn.execute(sa.select(measurements).where(measurements.c.plan_id == source_id)).all():
            ran = (list(m.checkpoints), list(m.dropped_vertices) if m.dropped_vertices is not None else None)
            if ran != (list(source.checkpoints), source.dropped_vertices):
                continue  # a measurement of checkpoints the plan no longer keeps
            conn.execute(measurements.insert().values(**_copied(m, plan_id=point_id)))


def downgrade() -> None:
    pass  # see the module docstring: the rows are valid, and served, below this revision
