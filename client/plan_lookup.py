"""Your own model in one call: ``model = remat.client.checkpoint(model, *example_args, **example_kwargs)``.

Any ``nn.Module``, called as it trains, in a training script::

    import remat.client

    model = MyNet().cuda()
    model = remat.client.checkpoint(model, next(iter(loader))[0].cuda())   # before building the optimizer
    optimizer = torch.optim.AdamW(model.parameters())

    llm = remat.client.checkpoint(llm, input_ids=ids, attention_mask=mask, labels=ids)   # a transformer

The example is one training call: one tensor, or every argument the model's ``forward`` takes (tensors,
token ids, masks, ``None`` and constants such as ``use_cache=False``, which the plan bakes in). Keywords
named like this function's options (``grads``, ``algorithm``, ``budget``, ``server``, ``token``, ``on_miss``,
``cache_dir``, ``timeout_s``) are the options; every other keyword is the model's.

The model is traced once; its plan key (architecture hash, input shape, precision, gradient convention,
device class, torch version) is computed from that trace, and so is the stage chain the plan is applied to.
The plan is looked up, in order, in:

1. the plan cache on disk (remat.client.local_plans): one file read, no database, no network;
2. the local plan store (what ``remat-client plan`` stored on this machine), when there is one;
3. the service (``server=`` or ``REMAT_SERVER``), within ``timeout_s`` for the whole lookup; unreachable,
   slow or answering nonsense is a warning, not an error: a training job never hangs on, or dies of, a plan
   service;
4. on a miss, by ``on_miss``: ``"profile"`` (default) profiles and plans here — a few training steps — stores
   the result locally and, with a write token (``token=`` or ``REMAT_API_TOKEN``), uploads the trace so the
   cluster has it next time; ``"none"`` trains without checkpointing and warns; ``"raise"`` raises.

Every plan found in 2–4 is written to the disk cache. A plan whose key differs from this model's (another
architecture, input, precision or torch version) is refused with what differs.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from typing import TYPE_CHECKING, Any

from remat.client.errors import PlanError, PlanNotFoundError, RematError, ServiceError, StalePlanError
from remat.client.local_planner import local_planner, local_planner_or_none
from remat.client.local_plans import LocalPlanCache

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch
    from torch import nn

    from remat.client.budget_spec import BudgetSpec
    from remat.client.graph.built_model import BuiltModel
    from remat.client.graph.model_call import ModelCall
    from remat.client.plan import Plan
    from remat.client.plan_key import PlanKey
    from remat.client.request import ModelRequest

__all__ = ["ON_MISS", "build_held_model", "checkpoint"]

logger = logging.getLogger("remat")

ON_MISS = ("profile", "none", "raise")


def checkpoint(model: nn.Module, *example_args: Any, grads: str = "none", algorithm: str = "linear",
               budget: str | int | None = None, server: str | None = None, token: str | None = None,
               on_miss: str = "profile", cache_dir: str | os.PathLike[str] | None = None,
               timeout_s: float | None = None, **example_kwargs: Any) -> nn.Module:
    """Find or make ``model``'s plan for training calls like ``model(*example_args, **example_kwargs)`` and
    apply it; returns ``model``.

    Args:
        model: any module, on the device it trains on. Only its instance ``forward`` changes
            (remat.client.apply): parameters, ``state_dict()`` keys and optimizers are untouched. A
            DistributedDataParallel wrapper is returned with its module planned; FSDP shards the model after
            this call, as one unit (NOTE [ plans under data parallelism ] in remat.client.model_wrappers).
        example_args, example_kwargs: one training call's inputs (module docstring), or tensors of their
            shapes, dtypes and devices: plans are made for one call signature. Call inside ``torch.autocast``
            if training runs there (the precision is keyed). When the model computes its own loss (``labels=``
            given, ``output.loss``), plans are made for backpropagating that loss. A call that leaves
            ``use_cache`` out of a model whose configuration turns the cache on trains with ``use_cache=False``
            (a warning; NOTE [ training without the cache ] in remat.client.graph.model_call); one tensor
            passed twice (``labels=input_ids``) is fine. Peaks are predicted for a step that lets go of the
            output before ``backward()``; a loop that keeps it (or a loss that saves it) is told at its first
            training step, with the bytes (docs/apply.md, Limits).
        grads: ``"none"`` if gradients are set to None between steps (``zero_grad()``'s default) or
            ``"kept"`` if they stay allocated; the best plans differ.
        algorithm: which planner's plan (``linear``: least peak memory under the PyTorch-faithful model).
        budget: instead of ``algorithm``, the fastest plan whose activation peak fits: bytes (an int, or
            ``"6GiB"``, ``"6GB"``, ``"512MiB"``), ``"70%"`` of the no-checkpoint peak, or ``"fit"`` on CUDA (the
            device's memory less 5% and what is allocated when this is called: build the optimizer after, and
            leave room for its state). A budget no plan fits raises BudgetInfeasibleError naming the smallest
            feasible peak: the job would not fit.
        server: a remat service URL; default ``REMAT_SERVER``; None and unset: no service.
        token: the service's write token, to upload a trace profiled here; default ``REMAT_API_TOKEN``.
        on_miss: ``"profile"``, ``"none"`` or ``"raise"`` (module docstring).
        cache_dir: the plan cache directory; default ``REMAT_PLAN_CACHE_DIR`` or the user cache directory.
        timeout_s: seconds the service lookup may take in all (its one request, or a budget's two), and the
            upload of a trace profiled here; default ``REMAT_TIMEOUT_S``, else 10.

    Settings not passed come from the ``REMAT_*`` environment, then the config file (remat.client.config).

    Raises:
        PlanMismatchError: a cached or served plan was made for another key (the message says what differs).
        PlanNotFoundError: no plan anywhere and ``on_miss="raise"``.
        ModelError: the model cannot be traced and cut into stages for this call, or is sharded already (one
            line saying why).
        PlanError: bad arguments (one line naming the argument or input).
    """
    from torch import nn

    from remat.client.graph.model_call import ModelCall, cache_turned_off
    from remat.client.model_wrappers import trained_module

    if not isinstance(model, nn.Module):
        raise PlanError(f"checkpoint: model must be a torch.nn.Module, got {type(model).__name__}")
    wrapper, model = model, trained_module(model, "checkpoint")
    call = ModelCall.bind(model, example_args, example_kwargs)
    if (cache_note := cache_turned_off(model, example_args, example_kwargs)) is not None:
        warnings.warn(cache_note, RuntimeWarning, stacklevel=2)
    _checkpoint(model, call, grads=grads, algorithm=algorithm,
                budget=budget, server=server, token=token, on_miss=on_miss, cache_dir=cache_dir, timeout_s=timeout_s)
    return wrapper


def _checkpoint(model: nn.Module, call: ModelCall, *, grads: str, algorithm: str, budget: str | int | None,
                server: str | None, token: str | None, on_miss: str, cache_dir: str | os.PathLike[str] | None,
                timeout_s: float | None) -> nn.Module:
    """:func:`checkpoint` on the module the plan is for (a DistributedDataParallel wrapper's module)."""
    from remat.client.apply_plan import apply_with_chain
    from remat.client.graph.built_model import build_from_model
    from remat.client.precision import precision_of_call

    if call.main.dim() < 2:
        what = "example_input" if call.single_tensor is not None else "the first tensor input"
        raise PlanError(f"checkpoint: {what} must have a batch dimension and at least one more, got shape "
                        f"{list(call.main.shape)}")
    example_input = call.main
    described = call.signature or str(list(example_input.shape))
    if on_miss not in ON_MISS:
        raise PlanError(f"checkpoint: on_miss must be one of {', '.join(ON_MISS)}, got {on_miss!r}")
    spec = _budget_spec(budget, algorithm, example_input) if budget is not None else None
    from remat.client.config import apply_to_environment

    apply_to_environment()
    server = server if server is not None else (os.environ.get("REMAT_SERVER") or None)
    token = token if token is not None else (os.environ.get("REMAT_API_TOKEN") or None)

    cache = LocalPlanCache(cache_dir)
    built = build_held_model(model, call, grads=grads, dtype=precision_of_call(model, call), cache=cache)
    example = built.example
    if built.chain.num_stages < 2:  # every plan of one stage keeps every activation: say so, never silently
        warnings.warn(f"remat: {type(model).__name__} at input {described} has no point between its inputs and "
                      f"its loss that the whole step passes through, so no checkpoint can be placed: it trains "
                      f"as without remat", RuntimeWarning, stacklevel=3)

    if spec is not None:
        plan = _find_for_budget(built.key, spec, cache, server, token, timeout_s)
        algorithm = f"budget {spec.text}"  # for the messages below
    else:
        plan = _find(built.key, algorithm, cache, server, token, timeout_s)
    if plan is not None:
        try:
            return apply_with_chain(model, plan, key=built.key, chain=built.chain, cache_dir=cache.directory)
        except StalePlanError as exc:
            warnings.warn(f"remat: the {algorithm} plan found for {type(model).__name__} at input {described} was "
                          f"made on another cut of the model (an older remat made it; {exc}): planning again",
                          RuntimeWarning, stacklevel=3)
    if on_miss == "raise":
        raise PlanNotFoundError(f"no {algorithm} plan for {type(model).__name__} at input "
                                f"{described} in the plan cache, the local store"
                                f"{' or the service' if server else ''}")
    if on_miss == "none":
        warnings.warn(f"remat: no {algorithm} plan for {type(model).__name__} at input "
                      f"{described}; training without checkpointing", RuntimeWarning,
                      stacklevel=3)
        return model
    if built.probe_batch is not None:  # profiling needs a chain probed with the whole batch
        built = build_from_model(built.request, model, example, graph=built.chain.graph_module)
    plan = _profile_here(built, algorithm, cache, server, token, timeout_s, budget=spec)
    return apply_with_chain(model, plan, key=built.key, chain=built.chain, cache_dir=cache.directory)


PROBE_BATCH = 2
"""Samples the chain builder's probe forward runs on a cache hit: the stage structure does not depend on the
batch size, the probe's cost does (a forward of the whole batch was most of a hit's time: docs/benchmarks.md).
Two, not one: a BatchNorm in train mode refuses one value per channel."""


def build_held_model(model: nn.Module, example: torch.Tensor | ModelCall, *, grads: str, dtype: str,
                     cache: LocalPlanCache) -> BuiltModel:
    """The train-time path's one build, shared by :func:`checkpoint` and ``fetch_and_apply``: the model a
    script holds, traced once (train mode); its plan key from that trace, and its stage chain cut from the same
    trace (from the key's cached probe facts when there are some: no run of the model at all).

    Args:
        example: a batch, or a tensor of its shape, dtype and device; or one training call's inputs
            (``ModelCall``: several tensors, keywords, constants).
        dtype: the step's precision as keyed (``precision_of_call``, or what the caller says it trains in).
    """
    from remat.client.apply_plan import remove
    from remat.client.graph.model_call import ModelCall
    from remat.client.graph.stage_graph import ModelError, trace_model
    from remat.client.request import ModelRequest

    remove(model)  # a plan applied before is undone: the key and chain come from the model's own forward
    call = example if isinstance(example, ModelCall) else ModelCall.bind(model, (example,), {})
    main = call.main
    request = ModelRequest(spec=f"custom:{type(model).__name__}", batch_size=int(main.shape[0]),
                           sample_shape=tuple(int(d) for d in main.shape[1:]), device=main.device.type,
                           grads=grads, dtype=dtype)
    try:
        graph = trace_model(model, train=True, call=call, cache_dir=cache.directory)
    except ModelError:
        if call.single_tensor is None:
            raise  # a call of several inputs has no fallback: export's reason is the model's
        graph = None  # build_stage_chain falls back to the top-level children and says why if it cannot
    detached = call.detach()
    held = detached.single_tensor if detached.single_tensor is not None else detached
    return _build_for_apply(request, model, held, graph, cache)


def _build_for_apply(request: ModelRequest, model: nn.Module, example: torch.Tensor | ModelCall, graph: Any,
                     cache: LocalPlanCache) -> BuiltModel:
    """The model's chain and key: cut from the probe facts cached for the key when there are some (no run of
    the model at all), else probing a slice of the batch (one tensor), or the whole batch when the slice fails
    (a model that needs a batch divisible by something, say) or the call has several inputs (which of them
    have a batch dimension is the model's business). Facts a probe here found are cached for next time."""
    import torch

    from remat.client.graph.built_model import build_from_model, model_key
    from remat.client.graph.write_probe import ProbeFacts

    key = facts = None
    inputs = getattr(example, "signature", "")
    if graph is not None:
        key = model_key(request, model, graph, inputs=inputs)
        facts = ProbeFacts.from_dict(cache.get_probe_facts(key))
    built = None
    if isinstance(example, torch.Tensor) and example.shape[0] > PROBE_BATCH:
        try:
            built = build_from_model(request, model, example, graph=graph, probe=example[:PROBE_BATCH],
                                     facts=facts, key=key)
        except (RematError, RuntimeError):
            pass
    if built is None:
        built = build_from_model(request, model, example, graph=graph, facts=facts, key=key)
    found = built.chain.probe_facts
    if built.chain.probed and found is not None:  # facts exist for fx chains only, cut from the traced graph
        try:
            cache.put_probe_facts(built.key, found.to_dict())
        except OSError as exc:  # a read-only or full cache directory costs the next start a probe, no more
            logger.info("remat: probe facts not cached (%s)", exc)
    return built


def _find(key: PlanKey, algorithm: str, cache: LocalPlanCache, server: str | None, token: str | None,
          timeout_s: float | None) -> Plan | None:
    """Steps 1–3 of the lookup; what steps 2 and 3 find is written to the disk cache."""
    cached = cache.get(key, algorithm)
    if cached is not None:
        logger.info("remat: %s plan from the plan cache (%s), first from %s", algorithm, cached.path, cached.source)
        return cached.plan
    try:
        planner = local_planner_or_none()
        stored = planner.stored_plan(key, algorithm) if planner is not None else None
    except Exception as exc:  # noqa: BLE001 - a broken local database must not stop a training job
        warnings.warn(f"remat: the local plan store is unreadable ({type(exc).__name__}: {exc}); skipping it",
                      RuntimeWarning, stacklevel=4)
        stored = None
    if stored is not None:
        cache.put(key, stored, source="the local plan store")
        logger.info("remat: %s plan from the local plan store", algorithm)
        return stored
    if server:
        served = _from_service(key, algorithm, server, token, timeout_s)
        if served is not None:
            cache.put(key, served, source=f"service {server}")
            logger.info("remat: %s plan from the service at %s", algorithm, server)
            return served
    return None


def _budget_spec(budget: str | int, algorithm: str, example: torch.Tensor) -> BudgetSpec:
    """``budget=`` as a BudgetSpec in bytes or a share; ``fit`` measured on the example's CUDA device now."""
    from remat.client.budget_spec import BudgetSpec, fit_bytes, parse_budget

    if algorithm != "linear":
        raise PlanError("checkpoint: give algorithm or budget, not both (a budget picks its own plan)")
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise PlanError(f"checkpoint: budget must be bytes (an int), a size such as '6GiB', a share such as "
                        f"'70%', or 'fit'; got {type(budget).__name__}")
    if isinstance(budget, int):
        if budget < 1:
            raise PlanError(f"checkpoint: budget must be at least 1 byte, got {budget}")
        return BudgetSpec(text=str(budget), bytes=budget)
    spec = parse_budget(budget)
    if not spec.fit:
        return spec
    if example.device.type != "cuda":
        raise PlanError("checkpoint: budget='fit' needs the example on a CUDA device; give bytes or a share")
    import torch

    torch.cuda.synchronize(example.device)
    total = torch.cuda.get_device_properties(example.device).total_memory
    room = fit_bytes(total, torch.cuda.memory_allocated(example.device))
    return BudgetSpec(text=f"fit ({room} bytes)", bytes=spec.resolve(baseline_peak_bytes=0, fit_bytes=room))


def _find_for_budget(key: PlanKey, spec: BudgetSpec, cache: LocalPlanCache, server: str | None,
                     token: str | None, timeout_s: float | None) -> Plan | None:
    """Steps 1–3 for a budget: the disk cache (by the budget as written), the local store's frontier, the
    service's frontier. A budget that fits nothing there raises: profiling again would not change it."""
    from remat.client.budget_spec import pick_from_frontier
    from remat.client.plan import BUDGET_ALGORITHM

    cached = cache.get(key, BUDGET_ALGORITHM, variant=spec.text)
    if cached is not None:
        return cached.plan
    try:
        planner = local_planner_or_none()
        frontier = list(planner.stored_frontier(key)) if planner is not None else []
    except Exception as exc:  # noqa: BLE001 - a broken local database must not stop a training job
        warnings.warn(f"remat: the local plan store is unreadable ({type(exc).__name__}: {exc}); skipping it",
                      RuntimeWarning, stacklevel=4)
        frontier = []
    plan = pick_from_frontier(frontier, spec) if frontier else None
    source = "the local plan store"
    if plan is None and server:
        plan, source = _budget_from_service(key, spec, server, token, timeout_s), f"service {server}"
    if plan is not None:
        cache.put(key, plan, source=source, variant=spec.text)
    return plan


def _budget_from_service(key: PlanKey, spec: BudgetSpec, server: str, token: str | None,
                         timeout_s: float | None) -> Plan | None:
    """The service's frontier plan for ``spec``; both requests share one deadline (``timeout_s``); a service
    that fails or answers nonsense is a warning (None)."""
    from remat.client.service_client import PlanServiceClient, plan_from_record

    try:
        with PlanServiceClient(server, token=token, timeout=timeout_s) as client, client.within():
            none = client.get_plan(key, algorithm="none")
            if none is None:
                return None
            budget_bytes = spec.resolve(baseline_peak_bytes=none["plan"]["predicted_peak_bytes"])
            record = client.get_budget_plan(key, budget_bytes)
            return plan_from_record(record, key) if record is not None else None
    except ServiceError as exc:
        _warn_service(exc)
        return None


def _from_service(key: PlanKey, algorithm: str, server: str, token: str | None,
                  timeout_s: float | None) -> Plan | None:
    """The service's ``algorithm`` plan for ``key``, within ``timeout_s``; a service that fails or answers
    nonsense is a warning (None): a training job never dies of its plan service."""
    from remat.client.service_client import PlanServiceClient, plan_from_record

    try:
        with PlanServiceClient(server, token=token, timeout=timeout_s) as client, client.within():
            record = client.get_plan(key, algorithm=algorithm)
            return plan_from_record(record, key) if record is not None else None
    except ServiceError as exc:
        _warn_service(exc)
        return None


def _warn_service(exc: ServiceError) -> None:
    # stacklevel 6: this, _from_service (or _budget_from_service), _find (or _find_for_budget), _checkpoint,
    # checkpoint, its caller
    warnings.warn(f"remat: the plan service is not answering ({exc}); going on without it", RuntimeWarning,
                  stacklevel=6)


BELOW_THE_CHAINS_SHARE = 0.75
"""A nested or graph plan predicted at this share of ``linear``'s peak or less is worth a word to a user who got
``linear``: it saves a further quarter of the memory or more, for more recompute."""


def _say_if_below_the_chains(plans: Sequence[Plan], chosen: Plan, name: str) -> None:
    """Announce, once at profiling, a plan far below the ``linear`` plan just applied (NOTE [ budgets below the
    chains ] in remat.client.planning.plans): timm's CrossViT keeps 81.6 MiB under every chain plan and 14.8
    MiB under acg's graph plan, and a user of the default would never learn it. A warning, like the profiling
    announcement, so a script that configures no logging still prints it."""
    if chosen.algorithm != "linear" or chosen.budget_bytes:
        return
    below = [p for p in plans if p.budget_bytes and p.runs_as[0] != "chain"]
    if not below:
        return
    tightest = min(below, key=lambda p: p.predicted_peak_bytes)
    if tightest.predicted_peak_bytes > BELOW_THE_CHAINS_SHARE * chosen.predicted_peak_bytes:
        return
    source = tightest.planned_by
    kind = "graph plan, recomputing inside stages," if tightest.is_graph_plan else "plan, re-running segments nested,"
    logger.warning("remat: %s: the linear plan keeps %.1f MiB of activations, and no plan that cuts between stages "
                   "keeps less; %s's %s is predicted at %.1f MiB: pass algorithm=%r, or a budget, to use it",
                   name, chosen.predicted_peak_bytes / 2**20, source, kind, tightest.predicted_peak_bytes / 2**20,
                   source)


def _profile_here(built: Any, algorithm: str, cache: LocalPlanCache, server: str | None, token: str | None,
                  timeout_s: float | None, *, budget: BudgetSpec | None = None) -> Plan:
    """Step 4, ``on_miss="profile"``: plan here, keep it, share the trace when allowed."""
    from remat.client.service_client import PlanServiceClient

    # A miss runs training steps for seconds to minutes inside the user's job: announced at WARNING, which a
    # script that configures no logging still prints (logging's last-resort handler), never silently.
    stages = built.chain.num_stages
    logger.warning("remat: no stored plan for %s; profiling %d stage%s here (a few training steps, once: the plan "
                   "is kept in %s)", built.request.name, stages, "" if stages == 1 else "s", cache.directory)
    started = time.monotonic()

    def say(text: str, fraction: float) -> None:
        logger.info("remat: %s (%.0f%%, %.0f s)", text, 100 * fraction, time.monotonic() - started)

    result, plan = local_planner().plan_held_model(built, algorithm, budget=budget, progress=say)
    logger.info("remat: planned %s in %.1f s", built.request.name, time.monotonic() - started)
    if plan is None:
        raise PlanError(f"checkpoint: algorithm {algorithm!r} is unknown; choose one of "
                        f"{', '.join(p.algorithm for p in result.plans if not p.budget_bytes)}")
    measured = result.measurements.get(plan.label)
    if measured is not None and measured.grad_check_passed is False:
        raise RematError(f"remat: the {algorithm} plan for {built.request.name} changed the gradients "
                         f"(max difference {measured.grad_max_abs_diff}); not applying it — please report this")
    _say_if_below_the_chains(result.plans, plan, built.request.name)
    plan = type(plan).from_dict({**plan.to_dict(), "key": built.key.to_dict()})
    cache.put(built.key, plan, source="profiled here", variant=budget.text if budget is not None else "")
    if server and token:
        try:
            with PlanServiceClient(server, token=token, timeout=timeout_s) as client:
                client.upload_trace(result.trace)
            logger.info("remat: uploaded the trace to %s", server)
        except ServiceError as exc:
            warnings.warn(f"remat: the trace was not uploaded ({exc}); the plan is kept here", RuntimeWarning,
                          stacklevel=5)
    return plan
