"""Measure a real training step with a checkpoint plan applied: the judge of every cost model.

NOTE [ measured peak ] — what ``measured_peak_bytes`` means, and why it can be set beside a prediction:
the ``pytorch`` cost model predicts *activation* bytes, i.e. memory above what exists before a training step
starts: parameters, buffers, the input batch, the labels and (``grads="kept"``) the allocated gradients are
that baseline (docs/cost-model.md, "What is counted"). So a step is measured as

    measured_peak_bytes = activation_measured_bytes
                        = (highest allocation during forward + loss + backward) - (allocation just before it)

after a warm-up step of the same plan (first-call allocations, gradient creation) and, for
``grads="none"``, with every gradient set to None first, so that gradients born in backward count as they
do in the prediction. On CPU both readings come from :class:`~remat.worker.memory_meter.MemoryMeter`
(exact live storage bytes); on CUDA from ``memory_allocated``/``max_memory_allocated``, with the reserved
peak reported beside it. ``absolute_peak_bytes`` adds the baseline back (what a device must hold).

The loss is cross-entropy against fixed random labels for (N, C, ...) outputs (mean squared error against a
fixed random target otherwise; main plus weighted auxiliary losses for a model with auxiliary outputs), so
the gradient reaching the last stage is a real dense buffer, as in training. Its own few tensors (N x C
log-probabilities) are inside the measured peak; they are tiny next to activations. No optimizer step is
taken: an optimizer's state is not activation memory and the model must come back unchanged (buffers,
gradients, mode and RNG are restored).
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.client.errors import ModelError
from remat.client.measurement import Measurement
from remat.client.model_output import AUX_LOSS_WEIGHT, output_tensors, own_loss
from remat.client.precision import autocast_context, normalize_precision, precision_of_call
from remat.client.trace import GRAD_CONVENTIONS, Trace
from remat.worker.profilers import backend_for, build_chain
from remat.worker.profilers.common import Backend, StageChainLike, preserved_state, set_grad_convention
from remat.worker.profilers.step_timing import baseline_step, bracketed_differences, bracketed_order

__all__ = ["GRADIENT_RTOL", "gradient_check", "make_loss", "measure_plan", "measure_step", "step_loss", "time_plans",
           "time_plans_rounds", "time_plans_spread"]

LossFn = Callable[[Any], torch.Tensor]


def _tensor_loss(output: torch.Tensor, gen: torch.Generator) -> Callable[[torch.Tensor], torch.Tensor]:
    if output.is_floating_point() and output.dim() >= 2 and output.shape[1] > 1:
        shape = (output.shape[0], *output.shape[2:])
        labels = torch.randint(0, output.shape[1], shape, generator=gen).to(output.device)
        return lambda out: F.cross_entropy(out, labels)
    target = torch.randn(output.shape, generator=gen, dtype=output.dtype).to(output.device)
    return lambda out: F.mse_loss(out, target)


def make_loss(output: Any, *, seed: int = 0) -> LossFn:
    """A loss over outputs shaped like ``output`` whose gradient is a real buffer (NOTE [ measured peak ]).

    Labels/targets are drawn once from a fixed seed, before measuring, so they belong to the baseline. A
    model with auxiliary outputs (a tuple, main output first: GoogLeNet, Inception v3 in train mode) gets
    the main loss plus ``AUX_LOSS_WEIGHT`` times each auxiliary loss (remat.client.model_output).
    """
    gen = torch.Generator().manual_seed(seed)
    parts = [_tensor_loss(t, gen) for t in output_tensors(output)]
    if isinstance(output, torch.Tensor):
        return parts[0]

    def loss(out: Any) -> torch.Tensor:
        outs = output_tensors(out)
        total = parts[0](outs[0])
        for fn, t in zip(parts[1:], outs[1:], strict=True):
            total = total + AUX_LOSS_WEIGHT * fn(t)
        return total

    return loss


def _run(runner: Any, x: Any, checkpoints: Sequence[int]) -> Any:
    """The model's output with the plan: a call of several inputs through the chain's ``run_call`` (which
    folds an exported model's output back into its ``ModelOutput``), one tensor through ``run``."""
    if isinstance(x, torch.Tensor):
        return runner.run(x, checkpoints)
    return runner.run_call(x, checkpoints)


def _step(chain: StageChainLike, x: Any, loss_fn: LossFn, checkpoints: Sequence[int],
          precision: str, on_backward: Callable[[], None] | None = None) -> None:
    # Forward and loss under autocast for an autocast precision, backward outside it (the AMP recipe); one
    # expression, so that no Python name keeps the network output alive during backward.
    with autocast_context(precision, x.device.type):
        loss = loss_fn(_run(chain, x, checkpoints))
    if on_backward is not None:
        on_backward()
    loss.backward()


TIMELINE_POINTS = 400
"""Samples kept of a step's memory timeline: enough for a plot, small enough to store with every measurement."""


def _compact_timeline(samples: Sequence[int], backward_at: int, sample: str) -> dict[str, Any]:
    """At most ``TIMELINE_POINTS`` buckets of consecutive samples, each its highest level (the peak survives).

    The keys keep the names they had when every timeline was per aten op (``ops``, ``op_index``): stored
    measurements and the service's schema read them; ``sample`` (the meter's ``timeline_sample``) says what one
    step of the index is.
    """
    n = len(samples)
    buckets = max(1, min(TIMELINE_POINTS, n))
    edges = [round(k * n / buckets) for k in range(buckets + 1)]
    spans = [(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]
    return {"ops": n, "backward_op": backward_at, "op_index": [a for a, _ in spans],
            "bytes": [max(samples[a:b]) for a, b in spans], "sample": sample}


def _baseline_bytes(model: nn.Module, tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages of parameters, buffers, gradients and the given tensors."""
    seen: dict[int, int] = {}
    items = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None),
             *tensors]
    for t in items:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _precision(model: nn.Module, x: torch.Tensor, precision: str | None) -> str:
    return normalize_precision(precision) if precision is not None else precision_of_call(model, x)


def _default_loss(chain: StageChainLike, x: Any, precision: str) -> LossFn:
    """The model's own loss when it computes one (``labels=`` given), else :func:`make_loss` for the network
    output as the step will produce it (its dtype under autocast)."""
    with torch.no_grad(), autocast_context(precision, x.device.type):
        output = _run(chain, x, ())
    return step_loss(output)


def step_loss(output: Any) -> LossFn:
    """The loss of a training step whose network output looks like ``output``: the model's own when it
    computes one (``output.loss``), else :func:`make_loss`'s seeded sum over every floating output."""
    if own_loss(output) is not None:
        return _own_loss
    return make_loss(output)


def _own_loss(output: Any) -> torch.Tensor:
    loss = own_loss(output)
    if loss is None:
        raise ModelError("the model stopped returning its own loss between two steps")
    return loss


def _measure_one(chain: StageChainLike, model: nn.Module, x: torch.Tensor, loss_fn: LossFn,
                 checkpoints: Sequence[int], *, backend: Backend, grads: str, timing_repeats: int,
                 precision: str) -> dict[str, Any]:
    set_grad_convention(model, grads)
    _step(chain, x, loss_fn, checkpoints, precision)  # warm-up
    set_grad_convention(model, grads)
    gc.collect()
    backend.synchronize()
    # Cached blocks of earlier work would otherwise count in the reserved peak of this step.
    backend.empty_cache()
    reserved_before = backend.reserved_bytes()
    meter = backend.make_meter()
    marks: list[int] = []
    gc.disable()
    try:
        with meter:
            base = meter.mark_baseline()
            requested_base = backend.requested_bytes("current")
            meter.start_timeline()
            _step(chain, x, loss_fn, checkpoints, precision, lambda: marks.append(meter.timeline_position()))
            backend.synchronize()
            peak = meter.peak_bytes
            requested_peak = backend.requested_bytes("peak")
            samples, positions = meter.stop_timeline(*marks)
    finally:
        gc.enable()
    out: dict[str, Any] = {"activation_bytes": peak - base}
    if samples and positions:  # none when CUDA's history ring buffer wrapped (entries lost)
        out["timeline"] = _compact_timeline(samples, positions[0], meter.timeline_sample)
    inputs = [x] if isinstance(x, torch.Tensor) else x.leaves()
    out["absolute_peak_bytes"] = peak if backend.meter_counts_resident else peak - base + _baseline_bytes(model, inputs)
    if reserved_before is not None:
        out["reserved_peak_bytes"] = backend.peak_reserved_bytes()
        out["reserved_before_bytes"] = reserved_before
    if requested_base is not None and requested_peak is not None:
        # What the step asked the allocator for, before block rounding and unsplit blocks: the gap to the
        # allocated peak is the allocator's own overhead, not the cost model's.
        out["requested_activation_bytes"] = requested_peak - requested_base
    times = []
    for _ in range(timing_repeats):
        set_grad_convention(model, grads)
        times.append(backend.time_ms(lambda: _step(chain, x, loss_fn, checkpoints, precision)))
    out["step_ms"] = min(times) if times else None
    return out


def measure_step(model: nn.Module, example_input: torch.Tensor, checkpoints: Sequence[int], *,
                 grads: str = "none", device: torch.device | str = "cpu", chain: StageChainLike | None = None,
                 train: bool = True, trace: Trace | None = None, algorithm: str | None = None,
                 baseline: bool = True, timing_repeats: int = 1, loss_fn: LossFn | None = None,
                 precision: str | None = None) -> Measurement:
    """One measured training step with the plan applied, and (by default) the same without checkpoints.

    Args:
        model: the network, on ``device``; it comes back unchanged.
        example_input: one input batch.
        checkpoints: stage boundaries 1..n-1 of the chain to keep; every segment but the last is run
            under non-reentrant checkpointing by ``chain.run``.
        grads: ``none`` or ``kept`` (see NOTE [ measured peak ]).
        device: ``cpu`` or ``cuda[:i]``.
        chain: the model's stage chain (built with ``build_stage_chain`` when omitted).
        train: measure in train mode.
        trace: when given, the ``pytorch`` cost model's prediction for the plan (and for no checkpoints) is
            added, so one dict holds predicted and measured.
        algorithm: the planner name to report.
        baseline: also measure the no-checkpoint step (``baseline_*`` fields).
        timing_repeats: timed steps per configuration (the fastest is reported); with a baseline and more than
            one, the plan and the baseline are timed in interleaved rounds and their spreads reported. 0: none,
            ``step_ms`` None (a caller that times its plans in rounds of its own: ``pipeline.validate``, where
            the one timed step it used to get was thrown away, 8% of ``plan hf:gpt2``'s first run).
        loss_fn: the loss applied to the network output; default :func:`make_loss`.
        precision: the step's precision (``remat.client.precision``); default from the input's dtype and the
            caller's autocast state.

    Returns:
        The :class:`~remat.client.measurement.Measurement` (its ``to_dict()`` is the ``measure`` command's
        JSON); predictions are filled in when ``trace`` is given.
    """
    if grads not in GRAD_CONVENTIONS:
        raise ValueError(f"grads must be one of {', '.join(GRAD_CONVENTIONS)}, got {grads!r}")
    backend = backend_for(device)
    x = example_input.to(backend.device)
    precision = _precision(model, x, precision)
    if chain is None:
        chain = build_chain(model, x, train=train)
    checkpoints = tuple(sorted(checkpoints))
    with preserved_state(model, devices=backend.rng_devices):
        model.train(train)
        if loss_fn is None:
            loss_fn = _default_loss(chain, x, precision)
        interleaved = baseline and timing_repeats > 1
        repeats = 0 if interleaved else timing_repeats  # interleaved: timed below, in rounds
        plan = _measure_one(chain, model, x, loss_fn, checkpoints, backend=backend, grads=grads,
                            timing_repeats=repeats, precision=precision)
        base = (_measure_one(chain, model, x, loss_fn, (), backend=backend, grads=grads,
                             timing_repeats=repeats, precision=precision) if baseline else None)
    spreads: tuple[float | None, float | None] = (None, None)
    if base is not None and interleaved:  # the two steps' times from the same interleaved rounds
        (plan["step_ms"], spread), (base["step_ms"], base_spread) = time_plans_spread(
            model, x, [checkpoints, ()], grads=grads, device=device, chain=chain, train=train,
            rounds=timing_repeats, loss_fn=loss_fn, precision=precision, baseline=1)
        spreads = (spread, base_spread)
    extra: dict[str, Any] = {}
    if "timeline" in plan:
        extra["timeline"] = plan["timeline"]
        if base and "timeline" in base:
            extra["baseline_timeline"] = base["timeline"]
    if "reserved_before_bytes" in plan:
        extra["reserved_before_bytes"] = plan["reserved_before_bytes"]
        if base:
            extra["baseline_reserved_peak_bytes"] = base["reserved_peak_bytes"]
    predicted = baseline_predicted = None
    if trace is not None:
        from remat.client.planning.cost_models import pytorch_peak

        predicted = pytorch_peak(trace, checkpoints)
        baseline_predicted = pytorch_peak(trace, ())
    return Measurement(
        algorithm=algorithm, checkpoints=checkpoints, predicted_peak_bytes=predicted,
        measured_peak_bytes=plan["activation_bytes"], baseline_predicted_peak_bytes=baseline_predicted,
        baseline_measured_peak_bytes=base["activation_bytes"] if base else None,
        absolute_peak_bytes=plan["absolute_peak_bytes"], measured_reserved_bytes=plan.get("reserved_peak_bytes"),
        requested_peak_bytes=plan.get("requested_activation_bytes"), step_ms=plan["step_ms"],
        baseline_step_ms=base["step_ms"] if base else None, step_spread_ms=spreads[0],
        baseline_step_spread_ms=spreads[1], device_name=backend.device_name,
        torch_version=torch.__version__, grads=grads, dtype=precision, device=backend.device.type, extra=extra)


GRADIENT_RTOL = 1e-4
"""Relative tolerance of the gradient check: CPU steps are bit-identical; CUDA's default cuDNN kernels
accumulate with atomics, so two identical steps differ in the last bits (docs/apply.md)."""


def gradient_check(model: nn.Module, example_input: torch.Tensor, plans: Sequence[Sequence[int]], *,
                   grads: str = "none", device: torch.device | str = "cpu", chain: StageChainLike | None = None,
                   train: bool = True, loss_fn: LossFn | None = None, precision: str | None = None,
                   runners: Sequence[StageChainLike] | None = None) -> list[tuple[bool, float]]:
    """For each plan, (passed, largest absolute gradient difference) against the unmodified step.

    Every step starts from the same RNG state (dropout draws the same masks) and the same gradient
    convention; the reference is the model's own chain without checkpoints. A plan passes when every
    parameter gradient is within ``GRADIENT_RTOL`` of the reference's largest magnitude (exact on CPU).
    ``runners``: what runs each plan when not ``chain`` (an op graph for a graph plan, whose ``plans`` entry
    is then its dropped vertices).
    """
    backend = backend_for(device)
    x = example_input.to(backend.device)
    precision = _precision(model, x, precision)
    if chain is None:
        chain = build_chain(model, x, train=train)
    params = [p for p in model.parameters() if p.requires_grad]
    results: list[tuple[bool, float]] = []
    with preserved_state(model, devices=backend.rng_devices):
        model.train(train)
        if loss_fn is None:
            loss_fn = _default_loss(chain, x, precision)
        rng = torch.random.get_rng_state()
        device_rng = backend.device_rng_state()

        def gradients(checkpoints: Sequence[int], runner: StageChainLike) -> list[torch.Tensor | None]:
            torch.random.set_rng_state(rng)
            backend.set_device_rng_state(device_rng)
            for p in params:
                p.grad = None
            _step(runner, x, loss_fn, tuple(checkpoints), precision)
            return [None if p.grad is None else p.grad.detach().clone() for p in params]

        reference = gradients((), chain)
        scale = max((float(g.abs().max()) for g in reference if g is not None and g.numel()), default=0.0)
        for k, checkpoints in enumerate(plans):
            diff = 0.0
            passed = True
            runner = runners[k] if runners is not None else chain
            for g, ref in zip(gradients(checkpoints, runner), reference, strict=True):
                if (g is None) != (ref is None):
                    passed = False
                    continue
                if g is not None and ref is not None and g.numel():
                    diff = max(diff, float((g.float() - ref.float()).abs().max()))
            results.append((passed and diff <= GRADIENT_RTOL * scale, diff))
    return results


def time_plans(model: nn.Module, example_input: torch.Tensor, plans: Sequence[Sequence[int]], *,
               grads: str = "none", device: torch.device | str = "cpu", chain: StageChainLike | None = None,
               train: bool = True, rounds: int = 3, loss_fn: LossFn | None = None,
               precision: str | None = None, runners: Sequence[StageChainLike] | None = None) -> list[float]:
    """Step time of several plans, the least of interleaved rounds: :func:`time_plans_spread`'s times."""
    return [t for t, _ in time_plans_spread(model, example_input, plans, grads=grads, device=device, chain=chain,
                                            train=train, rounds=rounds, loss_fn=loss_fn, precision=precision,
                                            runners=runners)]


ROUNDS_BUDGET_S = 60.0
"""Seconds of timed rounds after which no further round starts once two have run: validating a frontier at a
large batch on CPU, where a step takes seconds, stays within minutes."""


def time_plans_spread(model: nn.Module, example_input: torch.Tensor, plans: Sequence[Sequence[int]], *,
                      grads: str = "none", device: torch.device | str = "cpu", chain: StageChainLike | None = None,
                      train: bool = True, rounds: int = 3, loss_fn: LossFn | None = None,
                      precision: str | None = None, runners: Sequence[StageChainLike] | None = None,
                      budget_s: float = ROUNDS_BUDGET_S, baseline: int | None = None) -> list[tuple[float, float]]:
    """(step time, spread) of several plans, interleaved: up to ``rounds`` rounds each run every plan once.
    ``runners`` as for :func:`gradient_check`.

    Why interleaved: on a shared or throttling machine a slow minute would otherwise land on whichever plan
    was being timed, and time overheads (plan / no checkpointing) would be noise. Why the least: noise (another
    process on the core, the host) only adds time, so the least of the rounds is the step's own time, and the
    median of the rounds above it says how noisy they were (the spread; 0 for one round). Measured on a
    2-core VM, ResNet-152 at batch 1, 64², five copies of the same plan in 9 rounds: least 126–131 ms, medians
    136–166 ms. Each round runs the plans in the given order after one warm-up step of each distinct one; no round
    starts past ``budget_s`` once two have run.

    ``baseline``: the index of the plan every other one is read against (the no-checkpoint step). Each round
    then runs the baseline between every two plans and at both ends, and a plan's time is the baseline's time
    plus the median over the rounds of its step less the mean of the baseline's steps just before and after it
    (``step_timing.bracketed_overhead``, NOTE [ timing a plan ]); its spread is how far that median sits above
    the least of those differences. Read so because the machine's speed also moves within a round, in both
    directions: two leasts taken in different rounds keep that drift (ResNet-152 at batch 4, 128² on this
    project's VM on 2026-12-07, 21 rounds: ``linear``'s overhead read as leasts 15 ms, bracketed 106 ms, the
    same segments checkpointed by hand 95 ms). The baseline's own time is the least over the rounds of each
    round's median baseline step (``step_timing.baseline_step``).

    Returns:
        (milliseconds, spread in milliseconds) per plan, in the order given.
    """
    import statistics

    if baseline is None or len(plans) < 2:
        times = time_plans_rounds(model, example_input, plans, grads=grads, device=device, chain=chain, train=train,
                                  rounds=rounds, loss_fn=loss_fn, precision=precision, runners=runners,
                                  budget_s=budget_s)
        return [(min(t), statistics.median(t) - min(t)) for t in times]
    order = bracketed_order(baseline, [k for k in range(len(plans)) if k != baseline])
    times = time_plans_rounds(model, example_input, [plans[k] for k in order], grads=grads, device=device,
                              chain=chain, train=train, rounds=rounds, loss_fn=loss_fn, precision=precision,
                              runners=[runners[k] for k in order] if runners is not None else None,
                              budget_s=budget_s)
    base_least, base_spread = baseline_step([t for k, t in zip(order, times, strict=True) if k == baseline])
    out = [(base_least, base_spread)] * len(plans)
    for i, k in enumerate(order):
        if k != baseline:
            differences = bracketed_differences(times[i], times[i - 1], times[i + 1])
            overhead = statistics.median(differences)  # bracketed_overhead, with the differences kept for the spread
            out[k] = (base_least + overhead, overhead - min(differences))
    return out


def time_plans_rounds(model: nn.Module, example_input: torch.Tensor, plans: Sequence[Sequence[int]], *,
                      grads: str = "none", device: torch.device | str = "cpu", chain: StageChainLike | None = None,
                      train: bool = True, rounds: int = 3, loss_fn: LossFn | None = None,
                      precision: str | None = None, runners: Sequence[StageChainLike] | None = None,
                      budget_s: float = ROUNDS_BUDGET_S) -> list[list[float]]:
    """Every round's step time of every plan, as :func:`time_plans_spread` times them: ``out[plan][round]``, in
    ms, the same rounds for every plan."""
    import time

    backend = backend_for(device)
    x = example_input.to(backend.device)
    precision = _precision(model, x, precision)
    if chain is None:
        chain = build_chain(model, x, train=train)
    times: list[list[float]] = [[] for _ in plans]
    with preserved_state(model, devices=backend.rng_devices):
        model.train(train)
        if loss_fn is None:
            loss_fn = _default_loss(chain, x, precision)
        run_by = list(runners) if runners is not None else [chain] * len(plans)
        warmed: set[tuple[int, tuple[int, ...]]] = set()
        for checkpoints, runner in zip(plans, run_by, strict=True):
            if (id(runner), tuple(checkpoints)) in warmed:  # a step given twice (a baseline between plans)
                continue
            warmed.add((id(runner), tuple(checkpoints)))
            set_grad_convention(model, grads)
            _step(runner, x, loss_fn, tuple(checkpoints), precision)
        started = time.perf_counter()
        done = 0
        while done < max(rounds, 1) and (done < 2 or time.perf_counter() - started < budget_s):
            for i, checkpoints in enumerate(plans):
                set_grad_convention(model, grads)
                ms = backend.time_ms(lambda cps=tuple(checkpoints), r=run_by[i]: _step(r, x, loss_fn, cps, precision))
                times[i].append(ms)
            done += 1
    return times


def measure_plan(model: nn.Module, example_input: torch.Tensor, algorithm: str, *, grads: str = "none",
                 device: torch.device | str = "cpu", chain: StageChainLike | None = None, train: bool = True,
                 trace: Trace | None = None, model_name: str | None = None,
                 timing_repeats: int = 1, precision: str | None = None) -> dict[str, Any]:
    """Profile (unless a trace is given), plan with ``algorithm``, and measure: the ``measure`` command.

    The plan is chosen and predicted under the ``pytorch`` cost model, whatever the planner optimises, so
    that ``predicted_peak_bytes`` and ``measured_peak_bytes`` speak of the same quantity.
    """
    from remat.client.planning.plans import make_plan
    from remat.worker.profilers import profile

    backend = backend_for(device)
    x = example_input.to(backend.device)
    if chain is None:
        chain = build_chain(model, x, train=train)
    if trace is None:
        trace = profile(model, x, device=device, grads=grads, train=train, chain=chain, model_name=model_name,
                        timing_repeats=timing_repeats, precision=precision)
    plan = make_plan(trace, algorithm, cost_model="pytorch")
    if not plan.nested:
        return measure_step(model, x, plan.checkpoints, grads=grads, device=device, chain=chain, train=train,
                            trace=trace, algorithm=algorithm, timing_repeats=timing_repeats, precision=precision)
    from remat.client.graph.stage_chain import NestedRun

    measured = measure_step(model, x, plan.checkpoints, grads=grads, device=device, chain=NestedRun(chain),
                            train=train, trace=trace, algorithm=algorithm, timing_repeats=timing_repeats,
                            precision=precision)
    return dataclasses.replace(measured, predicted_peak_bytes=plan.predicted_peak_bytes)
