"""Profilers: turn a model and an example batch into a ``remat-trace/1`` layer trace.

One entry point, :func:`profile`, for every device; the algorithm is in :mod:`.common` (NOTE [ profiling
protocol ]), the readings in one :class:`Backend` per device class: :mod:`.cpu` (exact live-storage meter) and
:mod:`.cuda` (caching allocator), registered in :data:`BACKENDS`. A new device is a backend module, its line
in :data:`BACKENDS` and its name in ``remat.client.devices.DEVICES``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from remat.client.trace import Trace
from remat.worker.profilers.common import Backend, StageChainLike, build_chain, preserved_state, profile_chain
from remat.worker.profilers.cpu import CpuBackend
from remat.worker.profilers.cuda import CudaBackend

__all__ = ["BACKENDS", "Backend", "StageChainLike", "backend_for", "build_chain", "preserved_state", "profile",
           "profile_chain"]

BACKENDS: dict[str, type[Backend]] = {backend.name: backend for backend in (CpuBackend, CudaBackend)}
"""Device class -> its backend; the same names as ``remat.client.devices.DEVICES``, in the same order."""


def backend_for(device: torch.device | str) -> Backend:
    """The profiling backend of a device (``cpu`` or ``cuda[:i]``).

    Raises:
        ValueError: a device class without a backend, or one this machine cannot run.
    """
    dev = torch.device(device)
    backend = BACKENDS.get(dev.type)
    if backend is None:
        raise ValueError(f"remat profiler: device {str(dev)!r} is not supported; use {' or '.join(BACKENDS)}")
    reason = backend.unavailable_reason()
    if reason is not None:
        raise ValueError(f"remat profiler: device {dev.type!r} asked for, but {reason}")
    return backend(dev)


def profile(model: nn.Module, example_input: torch.Tensor, *, device: torch.device | str = "cpu",
            grads: str = "none", train: bool = True, chain: StageChainLike | None = None,
            model_name: str | None = None, model_hash: str | None = None, timing_repeats: int = 1,
            precision: str | None = None) -> Trace:
    """Profile a model's stage chain on one device and return its trace.

    Args:
        model: the network, already on ``device``; it is left unchanged (buffers, gradients, mode, RNG).
        example_input: one input batch (its first dimension is the batch size).
        device: a device of :data:`BACKENDS`: ``cpu`` or ``cuda[:i]``.
        grads: ``none`` (gradients set to None between steps, so they are born in backward and counted)
            or ``kept`` (allocated before the step, so only their accumulation transients count).
        train: profile train mode (the default) or eval mode.
        chain: a stage chain of ``model`` built beforehand; by default
            ``remat.client.graph.stage_graph.build_stage_chain(model, example_input, train=train)``.
        model_name, model_hash: recorded in the trace metadata.
        timing_repeats: unmetered timing runs per stage, and the timed rounds of whole steps above 0 (0: no times).
        precision: ``float32``, ``bfloat16``… or ``autocast_bfloat16`` (remat.client.precision); default
            from the input's dtype and the caller's autocast state.

    Returns:
        A validated ``remat-trace/1`` trace whose fields are those the ``pytorch`` cost model reads.
    """
    backend = backend_for(device)
    first = next(iter(model.parameters()), None)
    if first is not None and first.device.type != backend.device.type:
        raise ValueError(f"remat profiler: the model's parameters are on {first.device}, not {backend.device}; "
                         "move the model first (model.to(device))")
    if chain is None:
        chain = build_chain(model, example_input.to(backend.device), train=train)
    kwargs: dict[str, Any] = {"grads": grads, "train": train, "model_name": model_name, "model_hash": model_hash,
                              "timing_repeats": timing_repeats, "precision": precision}
    return profile_chain(chain, model, example_input, backend=backend, **kwargs)
