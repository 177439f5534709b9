"""Plans for a batch size (or sequence length) never profiled, derived from stored profiles of the same key at
others.

A plan read (``GET /v1/plans/{hash}``) or a profiling job that misses its key does not send anyone to profile
when the store holds profiles of the same architecture, call and conventions at other batch sizes: the trace
at the asked batch is derived from them (remat.client.derived_trace, torch-free), planned with the planners an
upload runs inline, and stored like an upload, marked as derived (its trace records ``derived_from``). A
derived plan stays marked (``PlanRecord.derived``) until a measured step of it is stored, by a worker's
validation or a ``POST /v1/measurements``; then it is an ordinary plan.

Bounded as an upload is: the profiles were stored under the service's stage and vertex limits, the planners
are those ``split_algorithms`` runs inline, and the fit reads at most ``repository.MAX_SIZE_PROFILES``
traces of the key per family (batch sizes, sequence lengths).
"""

from __future__ import annotations

from remat.client.derived_trace import SizeFitError, derive_at
from remat.client.plan import BUDGET_ALGORITHM
from remat.client.plan_key import PlanKey
from remat.client.trace import Trace
from remat.service import repository
from remat.service.config import ServiceSettings
from remat.service.db import Database
from remat.service.plan_limits import split_algorithms

__all__ = ["derive_trace", "store_derived"]


def derive_trace(db: Database, key: PlanKey) -> Trace | None:
    """The trace at ``key``'s shape derived from stored profiles at other batch sizes (or, for a token model,
    other sequence lengths); None without enough of them."""
    if not key.input_shape:
        return None
    with db.read_session() as session:
        profiles = repository.size_profiles(session=session, key=key)
    try:
        return derive_at(profiles, key.input_shape, key.inputs)
    except SizeFitError:
        return None  # profiles that do not line up answer nothing; the read stays a 404


def store_derived(db: Database, settings: ServiceSettings, key: PlanKey) -> bool:
    """Derive ``key``'s trace, plan it inline and store both; False when nothing could be derived."""
    from remat.client.planning.plans import plans_to_store

    trace = derive_trace(db, key)
    if trace is None:
        return False
    inline, _deferred, _skipped = split_algorithms(trace.num_stages, settings)  # the rest stays unplanned
    plans = plans_to_store(trace, algorithms=[a for a in inline if a != BUDGET_ALGORITHM],
                           frontier=BUDGET_ALGORITHM in inline)
    with db.write_session() as session:
        stored = repository.store_trace(session=session, trace=trace)
        repository.store_plans(session=session, trace_id=stored.trace_id, plans=plans)
    return True
