"""Fetch plans from a remat service: one call at train time, and the CLI's ``plan MODEL --server URL``.

A training job computes its model's plan key here (the architecture hash needs torch and the model), asks
the service for the stored plan and gets a :class:`~remat.client.plan.Plan` whose ``extra["key"]`` says what
it was made for, so that ``apply`` refuses it for another architecture, input or torch version::

    model = fetch_and_apply(model, (32, 3, 224, 224), server="http://plans:8000", grads="none")
    model = fetch_and_apply(llm, batch, server="http://plans:8000")   # one call's inputs: a dict (keywords)

The key sent is the client's own (``remat.client.graph.built_model.key_for_model``); the torch version in the
returned plan's key is the one of the trace the service planned from, because the service keys plans without
it and records it as provenance (docs/service.md): ``apply`` then compares it with the installed torch.

Public API::

    fetch_plan(model, input_shape | inputs, *, server, algorithm="linear", dtype="float32", grads="none",
               mode="train", device=None, token=None) -> Plan
    fetch_and_apply(model, input_shape, *, server, **kw) -> nn.Module
    report_from_service(request, client, *, upload=False, refresh=False, progress=None) -> ModelReport
    PlanNotFoundError                       # a PlanError: the service has no plan for the key
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from remat.client.errors import PlanNotFoundError, ServiceError
from remat.client.plan import Plan
from remat.client.plan_key import UNKNOWN, PlanKey
from remat.client.report import ModelReport, PlanRow
from remat.client.request import ModelRequest, ProgressFn
from remat.client.service_client import PlanServiceClient, plan_from_record

__all__ = ["PlanNotFoundError", "fetch_and_apply", "fetch_plan", "report_from_service"]

HOW_TO_CREATE = ("create one with `remat-client trace MODEL --out trace.json` and POST it to /v1/traces "
                 "(with the write token), or POST a profiling job to /v1/jobs")


def describe_key(key: PlanKey) -> str:
    """One line naming a key, short enough for an error message (``PlanKey.describe``)."""
    return key.describe()


@contextmanager
def _service(server: str | PlanServiceClient, token: str | None) -> Iterator[PlanServiceClient]:
    """Use the caller's client as is (it keeps its connections), or open one for this call only."""
    if isinstance(server, PlanServiceClient):
        yield server
        return
    with PlanServiceClient(server, token=token) as client:
        yield client


def _call_of(model: nn.Module, inputs: Any) -> Any:
    """A ``ModelCall`` when ``inputs`` are one training call's inputs (a mapping: keywords; a tuple or list of
    tensors: positional arguments), None when they are a shape (integers)."""
    from remat.client.graph.model_call import ModelCall, cache_turned_off
    from remat.client.user_frame import user_stacklevel

    if isinstance(inputs, Mapping):
        args, kwargs = (), dict(inputs)
    elif isinstance(inputs, (tuple, list)) and inputs and any(isinstance(v, torch.Tensor) for v in inputs):
        args, kwargs = tuple(inputs), {}
    else:
        return None
    call = ModelCall.bind(model, args, kwargs)
    if (cache_note := cache_turned_off(model, args, kwargs)) is not None:
        warnings.warn(cache_note, RuntimeWarning, stacklevel=user_stacklevel())
    return call


def fetch_plan(model: nn.Module, input_shape: Sequence[int] | Mapping[str, Any], *, server: str | PlanServiceClient,
               algorithm: str = "linear", dtype: torch.dtype | str = "float32", grads: str = "none",
               mode: str = "train", device: torch.device | str | None = None, token: str | None = None) -> Plan:
    """The service's plan for ``model`` on inputs of ``input_shape``.

    Args:
        model: the model to be trained (its architecture is hashed; weights are never read or sent).
        input_shape: the full input shape, batch dimension included: plans are made for one batch size. For a
            model called with several inputs, one training call's inputs instead: a dict of keyword inputs
            (``{"input_ids": ids, "labels": ids}``) or a tuple of positional ones; the key's ``inputs`` is
            that call's signature (docs/apply.md).
        server: the service URL (``http://plans:8000``) or an open ``PlanServiceClient`` to reuse.
        algorithm: planner whose plan to fetch; ``linear`` is exact for the PyTorch-faithful cost model.
        dtype: input dtype (``torch.bfloat16`` or ``"bfloat16"``).
        grads: ``none`` if gradients are set to None between steps (``zero_grad()``'s default), ``kept``
            if they stay allocated; the plans differ.
        mode: ``train`` (checkpointing only matters there; ``apply`` refuses an ``eval`` plan).
        device: device class of the training run; None: the device of the model's parameters.
        token: bearer token, needed only where the service requires one for reads.

    Returns:
        The plan, with ``extra["key"]`` set so that ``apply`` can check it.

    Raises:
        PlanNotFoundError: the service has no plan for this key (the message says how to create one).
        ServiceError: the service is unreachable or answered an error.
        PlanError: the arguments do not make a valid key, or the served plan is malformed.
    """
    from remat.client.graph.built_model import key_for_model
    from remat.client.model_wrappers import trained_module

    model = trained_module(model, "fetch_plan")
    call = _call_of(model, input_shape)
    if call is None:
        key = key_for_model(model, input_shape, dtype=dtype, mode=mode, grads=grads, device=device)
    else:
        from remat.client.graph.fx_trace import trace_model

        graph = trace_model(model, train=True, call=call)
        key = key_for_model(model, tuple(call.main.shape), dtype=dtype, mode=mode, grads=grads,
                            device=device if device is not None else call.device, graph=graph,
                            inputs=call.signature)
    return _fetch_for_key(key, server=server, token=token, algorithm=algorithm)


def _fetch_for_key(key: PlanKey, *, server: str | PlanServiceClient, token: str | None, algorithm: str) -> Plan:
    """The served ``algorithm`` plan for ``key`` (``fetch_plan``'s lookup, for a key already computed); its
    one or two requests share one deadline, the client's timeout."""
    with _service(server, token) as client, client.within():
        record = client.get_plan(key, algorithm=algorithm)
        if record is None:
            other = client.get_plan(replace(key, torch_version=UNKNOWN), algorithm=algorithm)
            elsewhere = ""
            if other is not None:
                elsewhere = (f" (it has one made with torch {(other.get('key') or {}).get('torch_version')}, "
                             f"which apply would refuse under torch {key.torch_version})")
            raise PlanNotFoundError(f"the remat service at {client.base_url} has no {algorithm} plan for "
                                    f"{describe_key(key)}{elsewhere}; {HOW_TO_CREATE}")
    return plan_from_record(record, key)


def fetch_and_apply(model: nn.Module, input_shape: Sequence[int] | Mapping[str, Any], *,
                    server: str | PlanServiceClient,
                    strict: bool = True, algorithm: str = "linear", dtype: torch.dtype | str = "float32",
                    grads: str = "none", mode: str = "train", device: torch.device | str | None = None,
                    token: str | None = None) -> nn.Module:
    """The service's plan for ``model``, applied: the one call of a training script that uses a plan service.

    It takes the train-time path of ``remat.client.checkpoint`` (``build_held_model``): the model is traced
    once, for its key and its stage chain both, the chain cut from the key's cached probe facts when there are
    some; only the lookup differs (the service alone, and a missing plan is an error).

    Args:
        model, input_shape, server, algorithm, dtype, grads, mode, device, token: as for ``fetch_plan``.
        strict: refuse the plan when the model or torch version does not match its key. ``strict=False`` (and
            a mode other than ``train``) takes ``apply(model, fetch_plan(...), strict=strict)`` instead.

    Returns:
        ``model`` itself, its forward now running the plan's checkpointed segments in training.

    Raises:
        PlanNotFoundError, ServiceError, PlanError: as ``fetch_plan``; PlanMismatchError: as ``apply``.
    """
    from remat.client.apply_plan import apply, apply_with_chain, example_for
    from remat.client.local_plans import LocalPlanCache
    from remat.client.model_wrappers import trained_module
    from remat.client.plan_lookup import build_held_model

    wrapper, model = model, trained_module(model, "fetch_and_apply")
    if not strict or mode != "train":
        apply(model, fetch_plan(model, input_shape, server=server, algorithm=algorithm, dtype=dtype, grads=grads,
                                mode=mode, device=device, token=token), strict=strict)
        return wrapper
    call = _call_of(model, input_shape)
    shape = tuple(call.main.shape) if call is not None else tuple(input_shape)  # type: ignore[arg-type]
    wanted = PlanKey(model_hash=UNKNOWN, input_shape=shape, dtype=dtype, mode=mode, grads=grads,
                     device=str(device) if device is not None else "cpu")  # normalises and checks the arguments
    if call is not None:
        example: Any = call if device is None else call.to(device)
    else:
        example = example_for(wanted, model) if device is None else example_for(wanted, model).to(device)
    cache = LocalPlanCache()
    built = build_held_model(model, example, grads=wanted.grads, dtype=wanted.dtype, cache=cache)
    plan = _fetch_for_key(built.key, server=server, token=token, algorithm=algorithm)
    apply_with_chain(model, plan, key=built.key, chain=built.chain, cache_dir=cache.directory)
    return wrapper


# --- the CLI's server mode --------------------------------------------------------------------------------

def _fetch_all(client: PlanServiceClient, key: PlanKey, algorithms: Sequence[str]) -> list[dict[str, Any]]:
    """The stored record of every algorithm the service has a minimum-peak plan of, in ``algorithms`` order."""
    records = (client.get_plan(key, algorithm=name) for name in algorithms)
    return [r for r in records if r is not None]


def _report(request: ModelRequest, key: PlanKey, records: Sequence[Mapping[str, Any]], *,
            from_store: bool) -> ModelReport:
    """A ``ModelReport`` from served records: measured figures are those of each plan's newest measurement."""
    plans = [plan_from_record(r, key) for r in records]
    first_trace = records[0].get("trace") or {}
    derived = first_trace.get("derived_from") or ()
    report = ModelReport(request=request, key=dict(plans[0].extra["key"]), num_stages=plans[0].num_stages,
                         from_store=from_store, device_name=first_trace.get("device_name"),
                         derived_from=tuple(int(b) for b in derived if isinstance(b, int) and not isinstance(b, bool)),
                         derived_along=first_trace.get("derived_along") if derived else None)
    for record, plan in zip(records, plans, strict=True):
        measured = (record.get("measurements") or [{}])[0]  # the service lists them newest first
        report.rows.append(PlanRow(plan=plan, measured_peak_bytes=measured.get("measured_peak_bytes"),
                                   step_ms=measured.get("step_ms")))
    return report


def report_from_service(request: ModelRequest, client: PlanServiceClient, *, upload: bool = False,
                        refresh: bool = False, progress: ProgressFn | None = None) -> ModelReport:
    """Every algorithm's plan for a zoo request, from the service (``remat-client plan MODEL --server URL``).

    The model is built here only to compute its key. When the service has no plan for it (or ``refresh``),
    and ``upload`` is allowed (a write token is configured), the model is profiled here and its trace
    uploaded: the service plans it with every algorithm and stores the plans for everyone after us.

    Raises:
        PlanNotFoundError: nothing stored and ``upload`` is False.
        ServiceError: unreachable service, refused token, or an error answer.
    """
    from remat.client.graph.built_model import build
    from remat.client.local_planner import local_planner
    from remat.client.planning.planners import PLANNERS

    say = progress or (lambda message, fraction: None)
    say(f"building {request.name}", 0.0)
    built = build(request)
    key = built.key
    say("fetching plans", 0.3)
    records = [] if refresh else _fetch_all(client, key, list(PLANNERS))
    if records:
        return _report(request, key, records, from_store=True)
    if not upload:
        raise PlanNotFoundError(f"the remat service at {client.base_url} has no plans for {request.name} "
                                f"({describe_key(key)}); set REMAT_API_TOKEN to profile it here and upload "
                                f"the trace, or POST a profiling job to /v1/jobs")
    say(f"profiling {built.chain.num_stages} stages", 0.4)
    trace = local_planner().profile(built)
    say("uploading the trace", 0.9)
    client.upload_trace(trace)
    records = _fetch_all(client, key, list(PLANNERS))
    if not records:
        raise ServiceError(f"remat service {client.base_url}: stored the trace but serves no plan for "
                           f"{describe_key(key)}")
    say("done", 1.0)
    return _report(request, key, records, from_store=False)


def budget_report_from_service(request: ModelRequest, client: PlanServiceClient, budget: Any, *,
                               upload: bool = False, progress: ProgressFn | None = None) -> ModelReport:
    """``plan MODEL --budget X --server URL``: none and linear, and the service's frontier plan for X.

    The percentage form resolves against the served ``none`` plan's predicted peak; ``fit`` against this
    machine's CUDA device. The service picks from its stored frontier, so nothing is planned here.

    Raises:
        BudgetError: ``fit`` without a CUDA device, or the service refused the budget as infeasible.
        PlanNotFoundError, ServiceError: as :func:`report_from_service`.
    """
    full = report_from_service(request, client, upload=upload, progress=progress)
    none_row, linear_row = full.row("none"), full.row("linear")
    key = PlanKey.from_dict(full.key)
    if none_row is None or linear_row is None:
        raise ServiceError(f"remat service {client.base_url}: no none or linear plan for {describe_key(key)}")
    from remat.client.graph.built_model import fit_bytes_for

    fit = fit_bytes_for(request) if budget.fit else None  # None where the device's memory is not a fixed pool
    budget_bytes = budget.resolve(baseline_peak_bytes=none_row.plan.predicted_peak_bytes, fit_bytes=fit)
    record = client.get_budget_plan(key, budget_bytes)
    if record is None:
        raise ServiceError(f"remat service {client.base_url}: no frontier stored for {request.name}; it is "
                           f"computed when the trace is stored (upload again with --refresh)")
    (row,) = _report(request, key, [record], from_store=True).rows
    out = ModelReport(request=request, key=full.key, num_stages=full.num_stages, from_store=full.from_store,
                      device_name=full.device_name)
    out.rows.extend([none_row, linear_row, row])
    return out
