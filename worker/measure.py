"""Measure a real training step with a checkpoint plan applied: the judge of every cost model.

NOTE [ measured peak ] — what ``measured_peak_bytes`` means, and why it can be set beside a prediction:
the ``pytorch`` cost model predicts *activation* bytes, i.e. memory above what exists before a training step
starts: parameters, buffers, the input batch, the labels and (``grads="kept"``) the allocated gradients are
that baseline (feasibility.md §0). So a step is measured as

    measured_peak_bytes = activation_measured_bytes
                        = (highest allocation during forward + loss + backward) - (allocation just before it)

after a warm-up step of the same plan (first-call allocations, gradient creation) and, for
``grads="none"``, with every gradient set to None first, so that gradients born in backward count as they
do in the prediction. On CPU both readings come from :class:`~remat.worker.memory_meter.MemoryMeter`
(exact live storage bytes); on CUDA from ``memory_allocated``/``max_memory_allocated``, with the reserved
peak reported beside it. ``absolute_peak_bytes`` adds the baseline back (what a device must hold).

The loss is cross-entropy against fixed random labels for (N, C, ...) outputs (mean squared error against a
fixed random target otherwise), so the gradient reaching the last stage is a real dense buffer, as in
training. Its own few tensors (N x C log-probabilities) are inside the measured peak; they are tiny next to
activations. No optimizer step is taken: an optimizer's state is not activation memory and the model must
come back unchanged (buffers, gradients, mode and RNG are restored).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat.client.trace import GRAD_CONVENTIONS, Trace
from remat.worker.profilers import backend_for, build_chain
from remat.worker.profilers.common import Backend, StageChainLike, preserved_state, set_grad_convention

__all__ = ["make_loss", "measure_plan", "measure_step", "time_plans"]

LossFn = Callable[[torch.Tensor], torch.Tensor]


def make_loss(output: torch.Tensor, *, seed: int = 0) -> LossFn:
    """A loss over outputs shaped like ``output`` whose gradient is a real buffer (NOTE [ measured peak ]).

    Labels/targets are drawn once from a fixed seed, before measuring, so they belong to the baseline.
    """
    gen = torch.Generator().manual_seed(seed)
    if output.is_floating_point() and output.dim() >= 2 and output.shape[1] > 1:
        shape = (output.shape[0], *output.shape[2:])
        labels = torch.randint(0, output.shape[1], shape, generator=gen).to(output.device)
        return lambda out: F.cross_entropy(out, labels)
    target = torch.randn(output.shape, generator=gen, dtype=output.dtype).to(output.device)
    return lambda out: F.mse_loss(out, target)


def _step(chain: StageChainLike, x: torch.Tensor, loss_fn: LossFn, checkpoints: Sequence[int]) -> None:
    # One expression: no Python name keeps the network output alive during backward.
    loss_fn(chain.run(x, checkpoints)).backward()


def _baseline_bytes(model: nn.Module, tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages of parameters, buffers, gradients and the given tensors."""
    seen: dict[int, int] = {}
    items = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None),
             *tensors]
    for t in items:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _measure_one(chain: StageChainLike, model: nn.Module, x: torch.Tensor, loss_fn: LossFn,
                 checkpoints: Sequence[int], *, backend: Backend, grads: str, timing_repeats: int) -> dict[str, Any]:
    set_grad_convention(model, grads)
    _step(chain, x, loss_fn, checkpoints)  # warm-up
    set_grad_convention(model, grads)
    gc.collect()
    backend.synchronize()
    meter = backend.make_meter()
    gc.disable()
    try:
        with meter:
            base = meter.mark_baseline()
            _step(chain, x, loss_fn, checkpoints)
            backend.synchronize()
            peak = meter.peak_bytes
    finally:
        gc.enable()
    out: dict[str, Any] = {"activation_bytes": peak - base}
    if backend.device.type == "cuda":
        out["absolute_peak_bytes"] = peak
        out["reserved_peak_bytes"] = torch.cuda.max_memory_reserved(backend.device)
    else:
        out["absolute_peak_bytes"] = peak - base + _baseline_bytes(model, [x])
    times = []
    for _ in range(max(timing_repeats, 1)):
        set_grad_convention(model, grads)
        times.append(backend.time_ms(lambda: _step(chain, x, loss_fn, checkpoints)))
    out["step_ms"] = min(times)
    return out


def measure_step(model: nn.Module, example_input: torch.Tensor, checkpoints: Sequence[int], *,
                 grads: str = "none", device: torch.device | str = "cpu", chain: StageChainLike | None = None,
                 train: bool = True, trace: Trace | None = None, algorithm: str | None = None,
                 baseline: bool = True, timing_repeats: int = 1, loss_fn: LossFn | None = None) -> dict[str, Any]:
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
        timing_repeats: unmetered timed steps per configuration (the fastest is reported).
        loss_fn: the loss applied to the network output; default :func:`make_loss`.

    Returns:
        The ``measure`` command's JSON fields (design.md): ``algorithm``, ``predicted_peak_bytes``,
        ``measured_peak_bytes``, ``baseline_measured_peak_bytes``, ``activation_measured_bytes``,
        ``baseline_activation_measured_bytes``, ``step_ms``, ``baseline_step_ms``, ``grads``, plus
        ``checkpoints``, ``device``, ``absolute_peak_bytes``, ``baseline_predicted_peak_bytes`` and
        ``prediction_error`` (predicted / measured - 1) where they apply.
    """
    if grads not in GRAD_CONVENTIONS:
        raise ValueError(f"grads must be one of {', '.join(GRAD_CONVENTIONS)}, got {grads!r}")
    backend = backend_for(device)
    x = example_input.to(backend.device)
    if chain is None:
        chain = build_chain(model, x, train=train)
    checkpoints = tuple(sorted(checkpoints))
    with preserved_state(model, devices=[backend.device]):
        model.train(train)
        if loss_fn is None:
            with torch.no_grad():
                loss_fn = make_loss(chain.run(x))
        plan = _measure_one(chain, model, x, loss_fn, checkpoints, backend=backend, grads=grads,
                            timing_repeats=timing_repeats)
        base = (_measure_one(chain, model, x, loss_fn, (), backend=backend, grads=grads,
                             timing_repeats=timing_repeats) if baseline else None)
    result: dict[str, Any] = {
        "algorithm": algorithm,
        "checkpoints": list(checkpoints),
        "predicted_peak_bytes": None,
        "measured_peak_bytes": plan["activation_bytes"],
        "baseline_measured_peak_bytes": base["activation_bytes"] if base else None,
        "activation_measured_bytes": plan["activation_bytes"],
        "baseline_activation_measured_bytes": base["activation_bytes"] if base else None,
        "step_ms": plan["step_ms"],
        "baseline_step_ms": base["step_ms"] if base else None,
        "grads": grads,
        "device": backend.device.type,
        "device_name": backend.device_name,
        "absolute_peak_bytes": plan["absolute_peak_bytes"],
    }
    if "reserved_peak_bytes" in plan:
        result["reserved_peak_bytes"] = plan["reserved_peak_bytes"]
        if base:
            result["baseline_reserved_peak_bytes"] = base["reserved_peak_bytes"]
    if trace is not None:
        from remat.worker.cost_models import pytorch_peak

        predicted = pytorch_peak(trace, checkpoints)
        result["predicted_peak_bytes"] = predicted
        result["baseline_predicted_peak_bytes"] = pytorch_peak(trace, ())
        if plan["activation_bytes"]:
            result["prediction_error"] = predicted / plan["activation_bytes"] - 1.0
    return result


def time_plans(model: nn.Module, example_input: torch.Tensor, plans: Sequence[Sequence[int]], *,
               grads: str = "none", device: torch.device | str = "cpu", chain: StageChainLike | None = None,
               train: bool = True, rounds: int = 3, loss_fn: LossFn | None = None) -> list[float]:
    """Step time of several plans, interleaved: ``rounds`` rounds each run every plan once; fastest kept.

    Why interleaved: on a shared or throttling machine a slow minute would otherwise land on whichever plan
    was being timed, and time overheads (plan / no checkpointing) would be noise. Each round runs the
    plans in the given order after one warm-up step each.

    Returns:
        Milliseconds per plan, in the order given.
    """
    backend = backend_for(device)
    x = example_input.to(backend.device)
    if chain is None:
        chain = build_chain(model, x, train=train)
    best = [float("inf")] * len(plans)
    with preserved_state(model, devices=[backend.device]):
        model.train(train)
        if loss_fn is None:
            with torch.no_grad():
                loss_fn = make_loss(chain.run(x))
        for checkpoints in plans:
            set_grad_convention(model, grads)
            _step(chain, x, loss_fn, tuple(checkpoints))
        for _ in range(max(rounds, 1)):
            for i, checkpoints in enumerate(plans):
                set_grad_convention(model, grads)
                ms = backend.time_ms(lambda cps=tuple(checkpoints): _step(chain, x, loss_fn, cps))
                best[i] = min(best[i], ms)
    return best


def measure_plan(model: nn.Module, example_input: torch.Tensor, algorithm: str, *, grads: str = "none",
                 device: torch.device | str = "cpu", chain: StageChainLike | None = None, train: bool = True,
                 trace: Trace | None = None, model_name: str | None = None,
                 timing_repeats: int = 1) -> dict[str, Any]:
    """Profile (unless a trace is given), plan with ``algorithm``, and measure: the ``measure`` command.

    The plan is chosen and predicted under the ``pytorch`` cost model, whatever the planner optimises, so
    that ``predicted_peak_bytes`` and ``measured_peak_bytes`` speak of the same quantity.
    """
    from remat.worker.planning import make_plan
    from remat.worker.profilers import profile

    backend = backend_for(device)
    x = example_input.to(backend.device)
    if chain is None:
        chain = build_chain(model, x, train=train)
    if trace is None:
        trace = profile(model, x, device=device, grads=grads, train=train, chain=chain, model_name=model_name,
                        timing_repeats=timing_repeats)
    plan = make_plan(trace, algorithm, cost_model="pytorch")
    return measure_step(model, x, plan.checkpoints, grads=grads, device=device, chain=chain, train=train,
                        trace=trace, algorithm=algorithm, timing_repeats=timing_repeats)
