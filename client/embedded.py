"""The CLI's embedded mode: profile, plan, measure and store a zoo model on this machine, no server.

``remat-client plan resnet152`` runs here. The first run builds the model (random weights), cuts it into
stages, profiles one trace, plans with every algorithm, measures a real training step per plan and stores
trace, plans and measurements in the local plan database (``remat.service.store.PlanStore``: SQLite under
the user's cache directory unless ``REMAT_DATABASE_URL`` says otherwise). Later runs with the same request
answer from the store **without importing torch**: the request is matched by zoo name, input shape, dtype,
device class, gradient convention and mode, and the stored trace must come from the installed torch's
major.minor version — the same facts the architecture hash stands for when the zoo builds the model.

The worker and service packages are imported inside functions only: ``import remat.client`` stays light.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from remat.client.errors import ModelError
from remat.client.plan import Plan

ProgressFn = Callable[[str, float], None]
"""Called with a description of the step starting and the fraction of the work done before it."""

DEFAULT_CPU_BATCH = 4
DEFAULT_CPU_RESOLUTION = 128
DEFAULT_CUDA_BATCH = 32


def installed_torch_version() -> str:
    """torch's major.minor from the package metadata (reading it does not import torch)."""
    from remat.client.plan_key import normalize_torch_version

    return normalize_torch_version(importlib.metadata.version("torch"))


@dataclass(kw_only=True, frozen=True)
class ModelRequest:
    """What the user asked for: a zoo model and the input signature and conventions to plan for."""

    spec: str
    batch_size: int
    sample_shape: tuple[int, ...]
    """Input shape of one sample (C, H, W for images)."""
    device: str = "cpu"
    grads: str = "none"
    dtype: str = "float32"
    mode: str = "train"

    @property
    def name(self) -> str:
        """Canonical zoo name, as stored: ``torchvision:resnet152``."""
        return "torchvision:" + self.spec.strip().lower().removeprefix("torchvision:")

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.batch_size, *self.sample_shape)


def default_request(spec: str, *, batch_size: int | None, sample_shape: Sequence[int] | None, device: str,
                    grads: str) -> ModelRequest:
    """Fill in defaults that keep a CPU run to a couple of minutes and a GPU run realistic.

    On CPU the images are 128 px (a 3-channel model's default resolution is scaled down, unless the model
    only runs at its own, like ViT) and the batch is 4; on CUDA the zoo's own input shape and a batch of 32.
    """
    if sample_shape is None:
        from remat.client.zoo import default_input_shape, fixed_resolution

        shape = tuple(default_input_shape(spec, check_known=False))
        if device == "cpu" and len(shape) == 3 and not fixed_resolution(spec):
            shape = (shape[0], DEFAULT_CPU_RESOLUTION, DEFAULT_CPU_RESOLUTION)
        sample_shape = shape
    if batch_size is None:
        batch_size = DEFAULT_CPU_BATCH if device == "cpu" else DEFAULT_CUDA_BATCH
    return ModelRequest(spec=spec, batch_size=batch_size, sample_shape=tuple(sample_shape), device=device,
                        grads=grads)


@dataclass(kw_only=True)
class PlanRow:
    """One algorithm's plan beside what a real training step measured with it."""

    plan: Plan
    measured_peak_bytes: int | None
    step_ms: float | None


@dataclass(kw_only=True)
class ModelReport:
    """Every algorithm's plan for one request, with measurements, and where the answer came from."""

    request: ModelRequest
    key: dict[str, Any]
    num_stages: int
    rows: list[PlanRow] = field(default_factory=list)
    from_store: bool = False
    device_name: str | None = None

    def row(self, algorithm: str) -> PlanRow | None:
        return next((r for r in self.rows if r.plan.algorithm == algorithm), None)

    def to_dict(self) -> dict[str, Any]:
        base = self.row("none")
        out: dict[str, Any] = {
            "model": self.request.name, "key": self.key, "num_stages": self.num_stages,
            "from_store": self.from_store, "device_name": self.device_name, "plans": [],
        }
        for r in self.rows:
            entry = r.plan.to_dict()
            entry["key"] = self.key  # so that apply() can refuse the plan for another model or input
            entry.update(measured_peak_bytes=r.measured_peak_bytes, step_ms=r.step_ms,
                         baseline_measured_peak_bytes=base.measured_peak_bytes if base else None,
                         baseline_step_ms=base.step_ms if base else None)
            out["plans"].append(entry)
        return out


def _open_store() -> Any:
    from remat.service.store import PlanStore

    return PlanStore().open()


def cached_report(request: ModelRequest) -> ModelReport | None:
    """The stored answer for ``request``, when every algorithm has a measured plan; never imports torch."""
    from remat.client.plan_key import normalize_torch_version
    from remat.service import repository
    from remat.worker.planners import PLANNERS

    store = _open_store()
    try:
        with store.db.read_session() as session:
            records, _ = repository.list_plans(session=session, model=request.name, device=request.device,
                                               dtype=request.dtype, limit=10_000)
    finally:
        store.close()
    torch_version = installed_torch_version()
    matching = [r for r in records
                if r.key.input_shape == request.input_shape and r.key.grads == request.grads
                and r.key.mode == request.mode and r.trace.torch_version is not None
                and normalize_torch_version(r.trace.torch_version) == torch_version]
    if not matching:
        return None
    newest_trace = max(matching, key=lambda r: r.updated_at).trace.trace_id
    by_algorithm = {r.plan.algorithm: r for r in matching if r.trace.trace_id == newest_trace}
    if set(by_algorithm) != set(PLANNERS) or not all(r.measurements for r in by_algorithm.values()):
        return None
    first = next(iter(by_algorithm.values()))
    report = ModelReport(request=request, key=first.key.to_dict(), num_stages=first.plan.num_stages,
                         from_store=True, device_name=first.trace.device_name)
    for name in PLANNERS:
        record = by_algorithm[name]
        m = record.measurements[0]  # the repository returns the newest first
        report.rows.append(PlanRow(plan=record.plan, measured_peak_bytes=m.measured_peak_bytes, step_ms=m.step_ms))
    return report


def _build(request: ModelRequest) -> tuple[Any, Any, Any]:
    """The model, an example batch and its stage chain, on the requested device."""
    import torch

    from remat.client.stage_graph import build_stage_chain
    from remat.client.zoo import resolve_model

    if request.device == "cuda" and not torch.cuda.is_available():
        raise ModelError("--device cuda: torch sees no CUDA device on this machine")
    torch.manual_seed(0)
    model = resolve_model(request.spec).to(request.device)
    dtype = getattr(torch, request.dtype)
    x = torch.randn(request.input_shape, device=request.device, dtype=dtype)
    try:
        chain = build_stage_chain(model, x, train=request.mode == "train")
    except RuntimeError as exc:  # e.g. an input shape the model cannot take
        raise ModelError(f"{request.name} cannot run on input {list(request.input_shape)}: "
                         f"{str(exc).splitlines()[0]}") from None
    return model, x, chain


def profile_and_plan(request: ModelRequest, progress: ProgressFn | None = None) -> ModelReport:
    """Profile, plan with every algorithm, measure each plan, store everything; returns the report."""
    from remat.service.records import Measurement
    from remat.worker.measure import measure_step, time_plans
    from remat.worker.planners import PLANNERS
    from remat.worker.planning import STORED_COST_MODEL, plan_all

    say = progress or (lambda message, fraction: None)
    total = 3 + len(PLANNERS)  # build, profile, one measurement per plan, timing; storing is quick
    say(f"building {request.name}", 0.0)
    model, x, chain = _build(request)
    say(f"profiling {chain.num_stages} stages", 1 / total)
    trace = _profile(request, model, x, chain)
    plans = plan_all(trace, cost_model=STORED_COST_MODEL)
    report = ModelReport(request=request, key={}, num_stages=trace.num_stages,
                         device_name=trace.metadata.get("device_name"))
    measurements = {}
    for k, plan in enumerate(plans):
        say(f"measuring {plan.algorithm}", (2 + k) / total)
        result = measure_step(model, x, plan.checkpoints, grads=request.grads, device=request.device, chain=chain,
                              train=request.mode == "train", trace=trace, algorithm=plan.algorithm, baseline=False)
        measurements[plan.algorithm] = result
    # Step times from interleaved rounds (every plan once per round, fastest kept): timing the plans one
    # after another put a busy minute of the machine on whichever plan ran then (overheads of +3000% seen).
    say("timing every plan", (2 + len(plans)) / total)
    step_times = time_plans(model, x, [p.checkpoints for p in plans], grads=request.grads, device=request.device,
                            chain=chain, train=request.mode == "train", rounds=2)
    for plan, ms in zip(plans, step_times, strict=True):
        measurements[plan.algorithm]["step_ms"] = ms
        report.rows.append(PlanRow(plan=plan, measured_peak_bytes=measurements[plan.algorithm]["measured_peak_bytes"],
                                   step_ms=ms))
    say("storing", 0.99)
    store = _open_store()
    try:
        stored_key = store.save_trace_and_plans(trace, plans)
        report.key = stored_key.to_dict()
        base = measurements["none"]
        for plan in plans:
            m = measurements[plan.algorithm]
            store.save_measurement(stored_key, Measurement(
                checkpoints=tuple(plan.checkpoints), measured_peak_bytes=m["measured_peak_bytes"],
                measured_reserved_bytes=m.get("reserved_peak_bytes"),
                baseline_measured_peak_bytes=base["measured_peak_bytes"],
                activation_measured_bytes=m["activation_measured_bytes"],
                baseline_activation_measured_bytes=base["activation_measured_bytes"],
                step_ms=m["step_ms"], baseline_step_ms=base["step_ms"], device_name=m.get("device_name"),
                torch_version=trace.metadata.get("torch_version")), algorithm=plan.algorithm)
    finally:
        store.close()
    say("done", 1.0)
    return report


def _profile(request: ModelRequest, model: Any, x: Any, chain: Any) -> Any:
    """The trace of an already built model, keyed by its architecture hash."""
    from remat.client.plan_key import PlanKey
    from remat.worker.profilers import profile

    key = PlanKey.for_model(model, request.input_shape, dtype=request.dtype, mode=request.mode,
                            grads=request.grads, device=request.device, graph=chain.graph_module)
    return profile(model, x, device=request.device, grads=request.grads, train=request.mode == "train",
                   chain=chain, model_name=request.name, model_hash=key.model_hash)


def profile_trace(request: ModelRequest, progress: ProgressFn | None = None) -> Any:
    """Only the profiling step: the model's ``remat-trace/1`` trace (``remat-client trace``)."""
    say = progress or (lambda message, fraction: None)
    say(f"building {request.name}", 0.0)
    model, x, chain = _build(request)
    say(f"profiling {chain.num_stages} stages", 0.3)
    return _profile(request, model, x, chain)


def measure_algorithm(request: ModelRequest, algorithm: str, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Profile, plan with one algorithm, and measure the plan beside no checkpointing (``remat-client measure``).

    The plan is predicted under the ``pytorch`` cost model, the one whose prediction speaks of the measured
    quantity.
    """
    from remat.worker.measure import measure_step
    from remat.worker.planning import STORED_COST_MODEL, make_plan

    say = progress or (lambda message, fraction: None)
    say(f"building {request.name}", 0.0)
    model, x, chain = _build(request)
    say(f"profiling {chain.num_stages} stages", 0.2)
    trace = _profile(request, model, x, chain)
    plan = make_plan(trace, algorithm, cost_model=STORED_COST_MODEL)
    say(f"measuring {algorithm} and none", 0.5)
    result = measure_step(model, x, plan.checkpoints, grads=request.grads, device=request.device, chain=chain,
                          train=request.mode == "train", trace=trace, algorithm=algorithm, timing_repeats=2)
    say("done", 1.0)
    return result
