"""A model made concrete for planning: the model on its device, an example batch, its stage chain and plan key.

"Held model → chain + key" has one home, here: the profiling pipeline (``remat.worker.pipeline``) builds a
zoo request with :func:`build`, and ``remat.client.checkpoint`` builds the model a training script holds
with :func:`build_from_model`, both through the same chain builder and the same key. Everything here needs
torch, and nothing here needs the worker or the service.

Public API::

    build(request) -> BuiltModel                             # a zoo / callable request: build the model, then
    build_from_model(request, model, example, *, graph=None, probe=None, facts=None, key=None) -> BuiltModel
    model_key(request, model, graph=None) -> PlanKey
    key_for_model(model, input_shape, *, dtype=, mode=, grads=, device=, graph=None) -> PlanKey
    fit_bytes_for(request) -> int | None                     # --budget fit: the CUDA device's room
    guard_memory(request, exc)                               # out of memory -> OutOfMemoryProfiling
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from remat.client.errors import ModelError, RematError
from remat.client.plan_key import PlanKey
from remat.client.precision import autocast_dtype
from remat.client.request import ModelRequest, check_fixed_size

if TYPE_CHECKING:
    import torch
    from torch import nn

    from remat.client.planning.graph_predict import GraphProfile

__all__ = ["BuiltModel", "OutOfMemoryProfiling", "build", "build_from_model", "fit_bytes_for", "guard_memory",
           "key_for_model", "model_key"]


class OutOfMemoryProfiling(RematError):
    """The device ran out of memory: the message names the model, batch and device, and what to try."""


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
    graph_profile: GraphProfile | None = None
    """One instrumented step on the op graph (``remat.worker.graph_profile``), from which graph plans' peaks
    are predicted: CPU without autocast only, where the predictor is validated (docs/cost-model.md)."""


def _out_of_memory(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


def guard_memory(request: ModelRequest, exc: BaseException) -> None:
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


def build(request: ModelRequest, *, probe_batch: int | None = None) -> BuiltModel:
    """The model (random weights), an example batch and its stage chain on the requested device, and its key.

    ``probe_batch``: cut the chain on that many samples of a one-tensor example instead of the whole batch,
    for a chain that only runs plans (a measured step): the stage structure does not depend on the batch, and
    the probe keeps every value of its forward alive, which at the largest batch that fits with
    checkpointing is more than the device holds. A chain to profile needs the full probe (the default).

    Raises:
        ModelError: unknown model, no CUDA device, or a model that cannot run on or be cut at this input.
    """
    import torch

    from remat.client.devices import unavailable_reason
    from remat.client.model_spec import build_model

    unavailable = unavailable_reason(request.device)
    if unavailable is not None:
        raise ModelError(f"--device {request.device}: {unavailable} on this machine")
    if request.source in ("torchvision", "timm"):
        check_fixed_size(request.spec, request.sample_shape, request.model_kwargs)
    torch.manual_seed(0)
    # An autocast precision trains float32 weights on float32 inputs; a plain one runs everything in it.
    dtype = getattr(torch, "float32" if autocast_dtype(request.dtype) else request.dtype)
    try:
        model = build_model(request.spec, request.model_kwargs).to(device=request.device, dtype=dtype)
        if request.source == "hf":
            example: Any = _hf_call(request, model)
        else:
            example = torch.randn(request.input_shape, device=request.device, dtype=dtype)
    except RuntimeError as exc:
        guard_memory(request, exc)
        raise ModelError(f"{request.name} cannot be built on {request.device}: "
                         f"{(str(exc).splitlines() or [''])[0]}") from None
    if probe_batch is not None and isinstance(example, torch.Tensor) and example.shape[0] > probe_batch:
        return build_from_model(request, model, example, probe=example[:probe_batch])
    return build_from_model(request, model, example)


def _hf_call(request: ModelRequest, model: Any) -> Any:
    """The training call of an ``hf:`` model: keyword inputs (remat.client.hf_models.hf_example_call)."""
    from remat.client.graph.model_call import ModelCall
    from remat.client.hf_models import hf_example_call

    args, kwargs = hf_example_call(model, request.spec, batch_size=request.batch_size, seq_len=request.seq_len,
                                   device=request.device)
    return ModelCall.bind(model, args, kwargs)


def key_for_model(model: nn.Module, input_shape: Sequence[int], *, dtype: torch.dtype | str = "float32",
                  mode: str = "train", grads: str = "none", device: torch.device | str | None = None,
                  graph: Any = None, inputs: str = "") -> PlanKey:
    """The key of ``model`` for one input signature (computes the architecture hash).

    ``device`` defaults to the device class of the model's parameters; ``graph`` is passed on to
    ``architecture_hash`` (a train-mode trace from ``trace_model``, or None to trace here; a call of several
    inputs must give its exported trace); ``inputs``: the call's signature (``ModelCall.signature``).
    """
    from remat.client.graph.hashing import architecture_hash

    if device is None:
        tensor = next(model.parameters(), None)
        device = tensor.device if tensor is not None else "cpu"
    return PlanKey(model_hash=architecture_hash(model, graph=graph), input_shape=tuple(input_shape), inputs=inputs,
                   dtype=dtype, mode=mode, grads=grads, device=str(device))


def model_key(request: ModelRequest, model: Any, graph: Any = None, *, inputs: str = "") -> PlanKey:
    """The plan key of ``model`` for ``request``; ``graph``: the model's trace when the caller holds it
    (the chain's ``graph_module``), else the hash traces the model itself; ``inputs``: the training call's
    signature when it is not one tensor."""
    return key_for_model(model, request.input_shape, dtype=request.dtype, mode=request.mode,
                         grads=request.grads, device=request.device, graph=graph, inputs=inputs)


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
        guard_memory(request, exc)
        text = str(exc).splitlines()[0]
        raise ModelError(f"{request.name} cannot run on input {list(request.input_shape)}: "
                         f"{text}{_input_hint(request, text)}") from None
    if key is None or graph is None or chain.graph_module is not graph:
        key = model_key(request, model, chain.graph_module, inputs=getattr(example, "signature", ""))
    probe_batch = 0 if not chain.probed else int(probe.shape[0]) if probe is not None else None
    return BuiltModel(request=request, model=model, example=example, chain=chain, key=key, probe_batch=probe_batch)


def fit_bytes_for(request: ModelRequest) -> int | None:
    """``--budget fit``: the CUDA device's room for activations once the model, its gradients and the batch
    are on it (None on CPU, where ``fit`` has no meaning)."""
    if request.device != "cuda":
        return None
    import torch

    from remat.client.budget_spec import fit_bytes

    built = build(request)
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated()
    if request.grads == "kept":
        static += sum(p.numel() * p.element_size() for p in built.model.parameters() if p.requires_grad)
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    del built
    return fit_bytes(total, static)
