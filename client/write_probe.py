"""The probe run: one no-grad run of a model that records what it writes, then leaves no trace.

What the stage-chain builders learn from it: which fx nodes (or top-level children) carry a tensor, which
write in place into a value another node produced (``_WriteRecorder.hits``, for the in-place safety of
boundaries in ``boundaries``), and which buffers each writes (restored after a checkpointed recompute by
``stage_chain``). ``preserved_state`` restores buffers (BN running statistics) and RNG states on exit, for
the probe and for profilers that run stages in train mode.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["preserved_state"]


def _storages(value: Any) -> list[torch.UntypedStorage]:
    """The (non-empty) storages of every tensor in a (nested) value."""
    out = []
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            try:
                storage = leaf.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, subclasses)
                continue
            if storage.nbytes() > 0:
                out.append(storage)
    return out


def _has_tensor(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value))


def _written_arguments(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments an aten op writes in place: those annotated ``is_write`` in its schema, plus the
    running statistics of batch/instance norm ops in training, which ``aten.native_batch_norm`` updates
    without an annotation."""
    schema = func._schema
    named = {}
    written = []
    for i, arg in enumerate(schema.arguments):
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        named[arg.name] = value
        if arg.alias_info is not None and arg.alias_info.is_write:
            written.append(value)
    if "norm" in schema.name and "no_training" not in schema.name:
        if named.get("training", named.get("use_input_stats", True)):
            written += [named.get("running_mean"), named.get("running_var")]
    return written


class _WriteRecorder(TorchDispatchMode):
    """Record which aten ops write in place into which recorded values (schema ``alias_info.is_write``).

    ``register(owner, value)`` notes the storages of a value a node (or child) produced. Every in-place
    write made while ``current`` names a writer is matched, at the moment it happens, against those
    storages by object identity (storage Python objects are preserved, so one storage is one object while
    it lives; the weak reference guards against an ``id`` reused after the storage died) and against the
    model's buffers. Matching at write time is what lets the probe run free values as it goes.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a dispatch mode's __torch_dispatch__ in torch._dynamo.disable unless this says False;
        # the wrapper imports torch._dynamo (seconds) at the first op. The probe runs eagerly, never under
        # torch.compile, so it has nothing to disable: a plan-cache hit starts without that import.
        return False

    def __init__(self, buffer_slots: dict[int, tuple[torch.UntypedStorage, list[tuple[nn.Module, str]]]]):
        super().__init__()
        self.current: str | None = None
        self.producers: dict[int, tuple[weakref.ref[torch.UntypedStorage], list[str]]] = {}
        self.buffer_slots = buffer_slots
        self.hits: list[tuple[str, str]] = []
        """(writer, producer) pairs: ``writer`` wrote in place into a storage that ``producer`` returned."""
        self.buffer_writes: dict[str, list[tuple[nn.Module, str]]] = {}
        self.ops_outside: list[str] = []

    def register(self, owner: str, value: Any) -> None:
        for storage in _storages(value):
            entry = self.producers.get(id(storage))
            if entry is not None and entry[0]() is storage:
                entry[1].append(owner)
            else:
                self.producers[id(storage)] = (weakref.ref(storage), [owner])

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        writer = self.current
        if writer is None:
            self.ops_outside.append(str(func))
            return out
        for value in _written_arguments(func, args, kwargs):
            for storage in _storages(value):
                entry = self.producers.get(id(storage))
                if entry is not None and entry[0]() is storage:
                    self.hits += [(writer, producer) for producer in entry[1] if producer != writer]
                buf = self.buffer_slots.get(id(storage))
                if buf is not None and buf[0] is storage:
                    self.buffer_writes.setdefault(writer, []).extend(buf[1])
        return out


@contextlib.contextmanager
def preserved_state(model: nn.Module, *, cuda_devices: Sequence[int] = ()) -> Iterator[None]:
    """Run a block that trains or probes the model and leave the model as it was (feasibility P5).

    Restores every buffer slot (BatchNorm running statistics, ``num_batches_tracked``; also undoing a forward
    that rebinds a buffer), each parameter's ``.grad`` object, the train/eval flag of every submodule and the
    RNG states (CPU and ``cuda_devices``). The probe run here and the worker's profilers and measurements
    all use it, so profiling is invisible to the caller. Grad mode is left as it is.
    """
    saved = [
        (module, name, buf, buf.detach().clone())
        for module in model.modules()
        for name, buf in module._buffers.items()
        if buf is not None
    ]
    grads = [(p, p.grad) for p in model.parameters()]
    modes = [(m, m.training) for m in model.modules()]
    try:
        with torch.random.fork_rng(devices=list(cuda_devices)):
            yield
    finally:
        with torch.no_grad():
            for module, name, buf, copy_ in saved:
                module._buffers[name] = buf
                buf.copy_(copy_)
        for p, g in grads:
            p.grad = g
        for m, training in modes:
            m.training = training


@contextlib.contextmanager
def _untouched(model: nn.Module, example: torch.Tensor) -> Iterator[None]:
    """Run a probe that leaves no trace: no grad, RNG forked, every buffer slot restored."""
    with preserved_state(model, cuda_devices=_probe_devices(example)), torch.no_grad():
        yield


def _buffer_owners(
    *roots: nn.Module,
) -> dict[int, tuple[torch.UntypedStorage, list[tuple[nn.Module, str]]]]:
    """id(buffer storage) -> (storage, every (module, buffer name) slot holding a tensor on it)."""
    owners: dict[int, tuple[torch.UntypedStorage, list[tuple[nn.Module, str]]]] = {}
    seen: set[tuple[int, str]] = set()
    for root in roots:
        for module in root.modules():
            for name, buf in module._buffers.items():
                if buf is None or (id(module), name) in seen:
                    continue
                seen.add((id(module), name))
                for storage in _storages(buf):
                    owners.setdefault(id(storage), (storage, []))[1].append((module, name))
    return owners


def _running_stat_slots(modules: Sequence[nn.Module]) -> list[tuple[nn.Module, str]]:
    """Running-statistics slots of every norm layer at or below ``modules``.

    Needed on top of the recorded writes because ``aten.native_batch_norm`` updates running_mean/var
    without an ``is_write`` annotation in its schema.
    """
    slots = []
    for top in modules:
        for m in top.modules():
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.running_mean is not None:
                slots += [(m, "running_mean"), (m, "running_var")]
                if m.num_batches_tracked is not None:
                    slots.append((m, "num_batches_tracked"))
    return slots


class _RecordingInterpreter(torch.fx.Interpreter):
    """Runs the graph once, telling the recorder which node runs and what each node produced."""

    def __init__(self, gm: torch.fx.GraphModule, recorder: _WriteRecorder) -> None:
        super().__init__(gm)
        self.recorder = recorder
        self.has_tensor: dict[str, bool] = {}
        self.is_tensor: dict[str, bool] = {}
        """Whether the node's value is one tensor: only such a value can cross a stage boundary."""
        self.small_values: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        self.recorder.current = n.name
        value = super().run_node(n)
        self.recorder.current = "<between>"
        self.has_tensor[n.name] = _has_tensor(value)
        self.is_tensor[n.name] = isinstance(value, torch.Tensor)
        if self.has_tensor[n.name]:
            self.recorder.register(n.name, value)
        else:
            self.small_values[n.name] = value
        return value


def _probe_devices(example: torch.Tensor) -> list[int]:
    if example.device.type != "cuda":
        return []
    return [example.device.index if example.device.index is not None else torch.cuda.current_device()]
