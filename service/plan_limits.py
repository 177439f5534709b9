"""Which planners a trace gets inside a request, which as a ``plan`` job, and which not at all: one rule for an
upload (``POST /v1/traces``) and for a trace the service derives at a new batch size (``derived_plans``)."""

from __future__ import annotations

from remat.service.config import ServiceSettings

__all__ = ["split_algorithms"]


def split_algorithms(num_stages: int, settings: ServiceSettings) -> tuple[list[str], list[str], dict[str, str]]:
    """Which planners run inside the upload, which as a ``plan`` job, and which not at all (with why).

    Every planner but ``cubic`` and ``nested`` is at most O(n log n) (docs/service.md, "Limits", times them at
    ``max_stages``); ``cubic`` is O(n³): inline up to ``inline_cubic_stages``, as a job up to
    ``max_cubic_stages``, beyond that skipped. ``nested`` is O(n²): inline up to FRONTIER_INLINE_STAGES, as a
    job up to FRONTIER_MAX_STAGES, like the frontier.
    The Pareto frontier (``budget``, O(n²) vector steps) likewise: inline up to FRONTIER_INLINE_STAGES, as a
    job up to FRONTIER_MAX_STAGES.
    """
    from remat.client.plan import BUDGET_ALGORITHM
    from remat.client.planning.planners import PLANNERS  # torch-free
    from remat.client.planning.plans import FRONTIER_INLINE_STAGES, FRONTIER_MAX_STAGES

    quadratic = [a for a, spec in PLANNERS.items() if spec.nested]  # O(n²) pure Python, like the frontier's size
    inline = [a for a in PLANNERS if (a != "cubic" or num_stages <= settings.inline_cubic_stages)
              and (a not in quadratic or num_stages <= FRONTIER_INLINE_STAGES)]
    deferred, skipped = [], {}
    if "cubic" in PLANNERS and "cubic" not in inline:
        if num_stages <= settings.max_cubic_stages:
            deferred.append("cubic")
        else:
            skipped["cubic"] = (f"O(n^3): not run above {settings.max_cubic_stages} stages "
                                f"(REMAT_MAX_CUBIC_STAGES); linear is exact under the pytorch cost model")
    for name in quadratic:
        if name in inline:
            continue
        if num_stages <= FRONTIER_MAX_STAGES:
            deferred.append(name)
        else:
            skipped[name] = (f"O(n^2): not run above {FRONTIER_MAX_STAGES} stages; linear's one-level plan is "
                             f"stored")
    if num_stages <= FRONTIER_INLINE_STAGES:
        inline.append(BUDGET_ALGORITHM)
    elif num_stages <= FRONTIER_MAX_STAGES:
        deferred.append(BUDGET_ALGORITHM)
    else:
        skipped[BUDGET_ALGORITHM] = (f"the Pareto frontier is O(n^2): not computed above {FRONTIER_MAX_STAGES} "
                                     f"stages; linear's minimum-peak plan is stored")
    return inline, deferred, skipped
