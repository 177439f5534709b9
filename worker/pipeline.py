"""The profiling pipeline, in one place: request → model → stage chain and plan key → trace → every planner's
plan → a measured, gradient-checked training step per plan.

Three callers and no other copy of any step: the CLI's embedded mode (``remat-client plan MODEL``, which
stores the result in the local plan store), the service client's upload path (``plan MODEL --server``,
which profiles here and uploads the trace) and the Celery task (``remat.worker.tasks.profile_model``, which
stores the result and finishes the job in one transaction). Storing is the caller's: this module knows
nothing of databases.

Public API::

    build(request) -> BuiltModel                           # model, example batch, stage chain, plan key
    build_from_model(request, model, example, graph=None, probe=None) -> BuiltModel   # a model the caller holds
    profile(built) -> Trace
    plans_for(built, trace) -> tuple[Plan, ...]            # every planner; graph plans searched under the predictor
    graph_planned(built, trace, plan) -> Plan              # one graph plan so searched (as it is otherwise)
    validate(built, trace, plans, progress=None) -> dict[str, Measurement]
    run(request, progress=None) -> ProfileResult           # all of the above, with every planner
    measure_algorithm(request, algorithm, progress=None) -> Measurement
    ProgressFn = Callable[[str, float], None]               # (what starts now, fraction done before it)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from remat.client.errors import ModelError, RematError
from remat.client.measurement import Measurement
from remat.client.plan import Plan
from remat.client.plan_key import PlanKey
from remat.client.precision import autocast_dtype
from remat.client.request import ModelRequest, ProgressFn
from remat.client.trace import Trace

__all__ = ["BuiltModel", "OutOfMemoryProfiling", "ProfileResult", "ProgressFn", "build", "build_from_model",
           "graph_planned", "measure_algorithm", "plans_for", "profile", "run", "validate"]

TIMING_ROUNDS = 2


class OutOfMemoryProfiling(RematError):
    """The device ran out of memory: the message names the model, batch and device, and what to try."""


def _silent(message: str, fraction: float) -> None:
    return None


@dataclass(eq=False)
class BuiltModel:
    """A request made concrete: the model on its device, an example batch, its stage chain and plan key."""

    request: ModelRequest
    model: Any
    example: Any
    chain: Any
    key: PlanKey
    probe_batch: int | None = None
    """Batch size the chain's probe ran on when it was not the example's (``build_from_model``'s ``probe``);
    0 when no probe ran (the chain was cut from cached probe facts). Such a chain serves ``run`` only."""
    op_graph: Any = None
    """The model's op graph (``remat.client.graph.op_graph.OpGraph``), built by :func:`profile` in train mode; None
    before, in eval mode, or when the model has none (``acg`` then plans the chain)."""
    graph_profile: dict[str, Any] | None = None
    """One instrumented step on the op graph (``remat.worker.graph_profile``), from which graph plans' peaks
    are predicted: CPU without autocast only, where the predictor is validated (docs/cost-model.md)."""


@dataclass(frozen=True)
class ProfileResult:
    """Everything one profiling run produced, ready to be stored in one transaction."""

    request: ModelRequest
    key: PlanKey
    trace: Trace
    plans: tuple[Plan, ...]
    measurements: Mapping[str, Measurement] = field(default_factory=dict)
    """One measurement per algorithm (empty when not validated)."""

    @property
    def device_name(self) -> str | None:
        return self.trace.metadata.get("device_name")


def _out_of_memory(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


def _guard_memory(request: ModelRequest, exc: BaseException) -> None:
    """Turn an out-of-memory error into one a person can act on (re-raised by the caller otherwise)."""
    if _out_of_memory(exc):
        raise OutOfMemoryProfiling(
            f"out of memory profiling {request.name} at batch {request.batch_size} on {request.device}: "
            f"use a smaller batch or input, or a device with more memory") from None


def _input_hint(request: ModelRequest, message: str) -> str:
    """What to change when a model refuses the requested input, appended to the error's one line."""
    from remat.client.zoo import default_input_shape, fixed_resolution

    if "Expected more than 1 value per channel when training" in message and request.batch_size == 1:
        return (" — at batch 1 a BatchNorm layer sees one value per channel in train mode: use --batch-size 2 "
                "or more")
    if request.source == "torchvision" and fixed_resolution(request.spec):
        native = tuple(default_input_shape(request.spec, check_known=False))
        if tuple(request.sample_shape) != native:
            shape = ",".join(str(d) for d in native)
            return f" — {request.name} trains only at its own input size: use --input-shape {shape}"
    return ""


def build(request: ModelRequest) -> BuiltModel:
    """The model (random weights), an example batch and its stage chain on the requested device, and its key.

    Raises:
        ModelError: unknown model, no CUDA device, or a model that cannot run on or be cut at this input.
    """
    import torch

    from remat.client.model_spec import build_model
    from remat.worker.profilers import BACKENDS

    unavailable = BACKENDS[request.device].unavailable_reason()
    if unavailable is not None:
        raise ModelError(f"--device {request.device}: {unavailable} on this machine")
    torch.manual_seed(0)
    # An autocast precision trains float32 weights on float32 inputs; a plain one runs everything in it.
    dtype = getattr(torch, "float32" if autocast_dtype(request.dtype) else request.dtype)
    try:
        model = build_model(request.spec, request.model_kwargs).to(device=request.device, dtype=dtype)
        x = torch.randn(request.input_shape, device=request.device, dtype=dtype)
    except RuntimeError as exc:
        _guard_memory(request, exc)
        raise ModelError(f"{request.name} cannot be built on {request.device}: "
                         f"{(str(exc).splitlines() or [''])[0]}") from None
    return build_from_model(request, model, x)


def model_key(request: ModelRequest, model: Any, graph: Any = None) -> PlanKey:
    """The plan key of ``model`` for ``request``; ``graph``: the model's fx trace when the caller holds it
    (the chain's ``graph_module``), else the hash traces the model itself."""
    return PlanKey.for_model(model, request.input_shape, dtype=request.dtype, mode=request.mode,
                             grads=request.grads, device=request.device, graph=graph)


def build_from_model(request: ModelRequest, model: Any, example: Any, *, graph: Any = None,
                     probe: Any = None, facts: Any = None, key: PlanKey | None = None) -> BuiltModel:
    """``build`` for a model the caller already holds (``remat.client.checkpoint``): its stage chain, cut
    from ``graph`` when the caller traced it already, and its key.

    ``probe``: the input the chain builder's probe forward runs on instead of ``example`` (a slice of the
    batch: the stage structure does not depend on the batch size, the probe's cost does). A chain built so
    serves ``run`` only; profiling needs one probed with the full example. ``facts``: cached probe facts
    for this key (``build_stage_chain``), which spare the probe altogether; ``key``: ``model_key(request,
    model, graph)`` when the caller computed it already (used when the chain was cut from ``graph``).

    Raises:
        ModelError: a model that cannot run on or be cut at this input (one line, with what to change).
    """
    from remat.client.graph.stage_graph import build_stage_chain

    try:
        chain = build_stage_chain(model, example if probe is None else probe, train=request.mode == "train",
                                  graph=graph, facts=facts)
    except ModelError as exc:
        hint = _input_hint(request, str(exc))
        if not hint:
            raise
        raise ModelError(f"{exc}{hint}") from None
    except RuntimeError as exc:  # e.g. an input shape the model cannot take
        _guard_memory(request, exc)
        text = str(exc).splitlines()[0]
        raise ModelError(f"{request.name} cannot run on input {list(request.input_shape)}: "
                         f"{text}{_input_hint(request, text)}") from None
    if key is None or graph is None or chain.graph_module is not graph:
        key = model_key(request, model, chain.graph_module)
    probe_batch = 0 if not chain.probed else int(probe.shape[0]) if probe is not None else None
    return BuiltModel(request=request, model=model, example=example, chain=chain, key=key, probe_batch=probe_batch)


def profile(built: BuiltModel, *, timing_repeats: int = 1) -> Trace:
    """The built model's ``remat-trace/1`` trace, keyed by its architecture hash, with its op graph (train
    mode, when the model has one: ``acg`` plans on it)."""
    from remat.worker.profilers import profile as profile_chain

    request = built.request
    try:
        trace = profile_chain(built.model, built.example, device=request.device, grads=request.grads,
                              train=request.mode == "train", chain=built.chain, model_name=request.name,
                              model_hash=built.key.model_hash, precision=request.dtype,
                              timing_repeats=timing_repeats)
        if request.mode == "train":
            built.op_graph = _op_graph(built)
        if built.op_graph is not None and request.device == "cpu" and not autocast_dtype(request.dtype):
            from remat.worker.graph_profile import profile_graph

            built.graph_profile = profile_graph(built.model, built.example, built.op_graph, grads=request.grads)
    except RuntimeError as exc:
        _guard_memory(request, exc)
        raise
    if built.op_graph is None:
        return trace
    return replace(trace, graph=built.op_graph.to_trace_graph())


def _op_graph(built: BuiltModel) -> Any:
    """The op graph from the chain's own trace, its sizes probed in the request's precision; None when the
    model has none (one source, one sink, a tensor input: the chain's rules)."""
    from remat.client.graph.op_graph import build_op_graph
    from remat.client.precision import autocast_context

    try:
        with autocast_context(built.request.dtype, built.example.device.type):
            return build_op_graph(built.model, built.example, graph=built.chain.graph_module)
    except ModelError:
        return None


SEARCH_EVALUATIONS = 2000
"""Plans the graph search predicts for ``acg`` (remat.client.planning.graph_predict.search_plan): 2–25 ms each on
torchvision models (about 15 s for DenseNet-121 on the 2-core CI machine, beside a profile and validation
that take minutes); a count, not a clock, so the plan does not depend on the machine's load."""


def graph_planned(built: BuiltModel, trace: Trace, plan: Plan) -> Plan:
    """A graph plan under the ``pytorch`` model when the profile has a graph profile: the dropped set of least
    predicted peak among acg's plans, every chain plan of the trace (the chain planners' and the frontier's,
    as dropped sets on the op graph) and a local search from the best (``search_plan``), with the graph
    predictor's peaks. The plan is a function of the trace and the graph profile alone, so ``plan`` and
    ``measure`` agree. Any other plan, or a graph plan without a graph profile (CUDA, autocast), as it is."""
    if plan.dropped_vertices is None or built.graph_profile is None:
        return plan
    import functools

    from remat.client.planning.graph_predict import predict_graph_peak, search_plan
    from remat.client.planning.planners import PLANNERS
    from remat.client.planning.plans import plans_to_store
    from remat.worker.graph_profile import executor_units

    graph, _ = _cut(built, plan)
    chain = built.chain
    chain_planners = [name for name, spec in PLANNERS.items() if not spec.plans_graphs]
    seeds = [(f"chain plan {p.label}", graph.dropped_for_chain_plan(chain.stage_nodes, chain.boundaries, p.checkpoints))
             for p in plans_to_store(trace, algorithms=chain_planners) if p.checkpoints]
    found = search_plan(built.graph_profile, graph.weights, graph.edges, functools.partial(executor_units, graph),
                        vertex_nodes=graph.vertex_nodes, seeds=seeds, max_evaluations=SEARCH_EVALUATIONS)
    return replace(plan, cost_model="pytorch", dropped_vertices=tuple(found.dropped),
                   predicted_peak_bytes=found.prediction.peak,
                   baseline_peak_bytes=predict_graph_peak(built.graph_profile, executor_units(graph, ())).peak)


def plans_for(built: BuiltModel, trace: Trace, *, algorithms: Sequence[str] | None = None,
              frontier: bool | None = None) -> tuple[Plan, ...]:
    """Every planner's plan for a profiled model (``planning.plans_to_store``), graph plans searched under the
    predictor where the profile allows (:func:`graph_planned`): what ``run`` and the one-call path store."""
    from remat.client.planning.plans import plans_to_store

    return tuple(graph_planned(built, trace, p)
                 for p in plans_to_store(trace, algorithms=algorithms, frontier=frontier))


def _as_graph_measurement(m: Measurement, plan: Plan) -> Measurement:
    """A graph plan's step as measured on the op graph: its vertices (measure_step recorded them as
    checkpoints) and the plan's own prediction, when it has one under the measured model."""
    return replace(m, checkpoints=(), dropped_vertices=plan.dropped_vertices,
                   predicted_peak_bytes=plan.predicted_peak_bytes if plan.cost_model == "pytorch" else None)


def _cut(built: BuiltModel, plan: Plan) -> tuple[Any, tuple[int, ...]]:
    """What runs a plan: the op graph and its dropped vertices for a graph plan, else the chain and the
    plan's checkpoints."""
    if plan.dropped_vertices is not None:
        if built.op_graph is None or built.op_graph.num_vertices != plan.num_vertices:
            raise ModelError(f"{plan.algorithm}: a graph plan of {plan.num_vertices} vertices, and this model's op "
                             f"graph has {getattr(built.op_graph, 'num_vertices', 'no')} vertices")
        return built.op_graph, plan.dropped_vertices
    return built.chain, plan.checkpoints


def validate(built: BuiltModel, trace: Trace, plans: Sequence[Plan], *, progress: ProgressFn | None = None,
             start: float = 0.0, end: float = 1.0, timing_rounds: int = TIMING_ROUNDS,
             check_gradients: bool = True) -> dict[str, Measurement]:
    """A real training step per plan: measured peak beside the prediction, step time, gradient check.

    Step times come from interleaved rounds (every plan once per round, fastest kept): timing the plans one
    after another put a busy minute of the machine on whichever plan ran then (overheads of +3000% seen).
    Each measurement's baseline fields are those of the ``none`` plan when it is among ``plans``. Keyed by
    :attr:`Plan.label <remat.client.plan.Plan.label>` (the algorithm, and the budget of a frontier plan).
    """
    from remat.worker.measure import gradient_check, measure_step, time_plans

    say = progress or _silent
    request = built.request
    common: dict[str, Any] = {"grads": request.grads, "device": request.device, "chain": built.chain,
                              "train": request.mode == "train", "precision": request.dtype}
    steps = len(plans) + 2
    out: dict[str, Measurement] = {}
    cuts = [_cut(built, plan) for plan in plans]
    runners, cut_points = [c[0] for c in cuts], [c[1] for c in cuts]
    try:
        for k, plan in enumerate(plans):
            say(f"measuring {plan.algorithm}", start + (end - start) * k / steps)
            # A graph plan's prediction is its own (``predicted``; None under the classic model).
            graph = plan.dropped_vertices is not None
            out[plan.label] = measure_step(built.model, built.example, cut_points[k],
                                           trace=None if graph else trace, algorithm=plan.algorithm,
                                           baseline=False, timing_repeats=0, **{**common, "chain": runners[k]})
            if graph:
                out[plan.label] = _as_graph_measurement(out[plan.label], plan)
        checks: list[tuple[bool, float]] | None = None
        if check_gradients:
            say("checking gradients", start + (end - start) * len(plans) / steps)
            checks = gradient_check(built.model, built.example, cut_points, runners=runners, **common)
        say("timing every plan", start + (end - start) * (len(plans) + 1) / steps)
        times = time_plans(built.model, built.example, cut_points, rounds=timing_rounds, runners=runners,
                           **common)
    except RuntimeError as exc:
        _guard_memory(request, exc)
        raise
    names = [p.label for p in plans]
    base_k = names.index("none") if "none" in names else None
    for k, plan in enumerate(plans):
        passed, diff = checks[k] if checks is not None else (None, None)
        out[plan.label] = replace(
            out[plan.label], step_ms=times[k], grad_check_passed=passed, grad_max_abs_diff=diff,
            baseline_measured_peak_bytes=out["none"].measured_peak_bytes if base_k is not None else None,
            baseline_step_ms=times[base_k] if base_k is not None else None)
    return out


def run(request: ModelRequest, *, progress: ProgressFn | None = None, timing_rounds: int = TIMING_ROUNDS,
        check_gradients: bool = True, algorithms: Sequence[str] | None = None,
        on_key: Callable[[PlanKey], None] | None = None) -> ProfileResult:
    """Build, profile, plan with every algorithm (or ``algorithms``) and validate each plan.

    ``on_key`` is called with the plan key as soon as the model is built (seconds, before the minutes of
    profiling): the worker records it on the job and stops here, by raising, when the key already has plans.
    """
    from remat.client.planning.plans import FRONTIER_MAX_STAGES, frontier_to_validate

    say = progress or _silent
    say(f"building {request.name}", 0.0)
    built = build(request)
    if on_key is not None:
        on_key(built.key)
    say(f"profiling {built.chain.num_stages} stages", 0.05)
    trace = profile(built)
    say("planning", 0.4)
    plans = plans_for(built, trace, algorithms=list(algorithms) if algorithms else None,
                      frontier=trace.num_stages <= FRONTIER_MAX_STAGES)
    measured = [p for p in plans if not p.budget_bytes] + frontier_to_validate(plans)
    measurements = validate(built, trace, measured, progress=say, start=0.42, end=0.98, timing_rounds=timing_rounds,
                            check_gradients=check_gradients)
    measurements.update(_shared_measurements(plans, measurements))
    say("done", 1.0)
    return ProfileResult(request=request, key=built.key, trace=trace, plans=plans, measurements=measurements)


def _shared_measurements(plans: Sequence[Plan], measurements: Mapping[str, Measurement]) -> dict[str, Measurement]:
    """Frontier plans whose checkpoints a measured chain plan has get that measurement too: the same step."""
    by_checkpoints = {p.checkpoints: measurements[p.label] for p in plans
                      if p.label in measurements and not p.is_graph_plan}
    return {p.label: replace(by_checkpoints[p.checkpoints], algorithm=p.algorithm) for p in plans
            if p.label not in measurements and p.checkpoints in by_checkpoints}


def fit_bytes_for(request: ModelRequest) -> int | None:
    """``--budget fit``: the CUDA device's room for activations once the model, its gradients and the batch
    are on it (None on CPU, where ``fit`` has no meaning)."""
    from remat.worker.profilers import BACKENDS, backend_for

    if not BACKENDS[request.device].fixed_memory:
        return None
    from remat.client.budget_spec import fit_bytes

    built = build(request)
    backend = backend_for(request.device)
    backend.synchronize()
    static = backend.allocated_bytes()
    if request.grads == "kept":
        static += sum(p.numel() * p.element_size() for p in built.model.parameters() if p.requires_grad)
    total = backend.capacity_bytes()
    del built
    return fit_bytes(total, static)


def measure_algorithm(request: ModelRequest, algorithm: str, *, progress: ProgressFn | None = None) -> Measurement:
    """Profile, plan with one algorithm, and measure the plan beside no checkpointing (``remat-client measure``).

    The plan is predicted under the ``pytorch`` cost model, the one whose prediction speaks of the measured
    quantity.
    """
    from remat.client.planning.plans import STORED_COST_MODEL, make_plan
    from remat.worker.measure import measure_step

    say = progress or _silent
    say(f"building {request.name}", 0.0)
    built = build(request)
    say(f"profiling {built.chain.num_stages} stages", 0.2)
    trace = profile(built)
    plan = graph_planned(built, trace, make_plan(trace, algorithm, cost_model=STORED_COST_MODEL))
    runner, cut_points = _cut(built, plan)
    say(f"measuring {algorithm} and none", 0.5)
    try:
        result = measure_step(built.model, built.example, cut_points, grads=request.grads,
                              device=request.device, chain=runner, train=request.mode == "train",
                              trace=None if plan.is_graph_plan else trace, algorithm=algorithm,
                              timing_repeats=TIMING_ROUNDS, precision=request.dtype)
        if plan.is_graph_plan:
            result = _as_graph_measurement(result, plan)
    except RuntimeError as exc:
        _guard_memory(request, exc)
        raise
    say("done", 1.0)
    return result
