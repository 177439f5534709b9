"""The probe run: one no-grad run of a model that records what it writes, then leaves no trace.

What the stage-chain builders learn from it: which fx nodes (or top-level children) carry a tensor, which
write in place into a value another node produced (``WriteRecorder.hits``, for the in-place safety of
boundaries in ``boundaries``), and which buffers each writes (restored after a checkpointed recompute by
``stage_chain``). ``preserved_state`` restores buffers (BN running statistics) and RNG states on exit, for
the probe and for profilers that run stages in train mode.

``ProbeFacts`` is what a probe of a traced graph learned, by node and module name, as plain JSON: the plan
cache keeps it beside the plans of the same key (the architecture hash covers the graph and every module's
configuration, so the facts are the key's), and a cache hit cuts the chain from it without running the model
(remat.client.plan_lookup; the probe forward was most of a hit's time).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["PROBE_FACTS_FORMAT", "ProbeFacts", "preserved_state"]

PROBE_FACTS_FORMAT = "remat-probe-facts/1"


def storages(value: Any) -> list[torch.UntypedStorage]:
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


class WriteRecorder(TorchDispatchMode):
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
        for storage in storages(value):
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
            for storage in storages(value):
                entry = self.producers.get(id(storage))
                if entry is not None and entry[0]() is storage:
                    self.hits += [(writer, producer) for producer in entry[1] if producer != writer]
                buf = self.buffer_slots.get(id(storage))
                if buf is not None and buf[0] is storage:
                    self.buffer_writes.setdefault(writer, []).extend(buf[1])
        return out


@dataclass(frozen=True)
class ProbeFacts:
    """What one probe run of a traced graph recorded, by fx node name: enough to cut the graph into the same
    chain again without running it.

    ``buffer_writes`` names each written buffer slot by its module's qualified name in the model (``""``: the
    model itself), or ``graph:`` and its name in the traced GraphModule for modules only the trace has (the
    GraphModule root, which holds the buffers a ``get_attr`` reads), and the buffer's name. Built from a
    probe by :meth:`recorded`; read back by :meth:`from_dict` and checked against a model and its trace by
    :meth:`fits` before use.
    """

    has_tensor: Mapping[str, bool]
    is_tensor: Mapping[str, bool]
    hits: tuple[tuple[str, str], ...]
    buffer_writes: Mapping[str, tuple[tuple[str, str], ...]]

    @classmethod
    def recorded(cls, model: nn.Module, gm: torch.fx.GraphModule, has_tensor: Mapping[str, bool],
                 is_tensor: Mapping[str, bool], recorder: WriteRecorder) -> ProbeFacts | None:
        """The facts of a finished probe; None when a written buffer's module is neither the model's nor the
        trace's (then the facts cannot be named, and the chain is probed every time)."""
        names = {id(m): f"{GRAPH_PREFIX}{name}" for name, m in gm.named_modules(remove_duplicate=False)}
        names.update({id(m): name for name, m in model.named_modules(remove_duplicate=False)})
        writes: dict[str, tuple[tuple[str, str], ...]] = {}
        for node, slots in recorder.buffer_writes.items():
            if any(id(module) not in names for module, _ in slots):
                return None
            writes[node] = tuple((names[id(module)], buf) for module, buf in slots)
        return cls(has_tensor=dict(has_tensor), is_tensor=dict(is_tensor), hits=tuple(recorder.hits),
                   buffer_writes=writes)

    def to_dict(self) -> dict[str, Any]:
        return {"format": PROBE_FACTS_FORMAT, "has_tensor": dict(self.has_tensor), "is_tensor": dict(self.is_tensor),
                "hits": [list(h) for h in self.hits],
                "buffer_writes": {node: [list(s) for s in slots] for node, slots in self.buffer_writes.items()}}

    @classmethod
    def from_dict(cls, data: Any) -> ProbeFacts | None:
        """The facts in ``data``, or None when it is not a well-formed ``remat-probe-facts/1`` dict."""

        def flags(value: Any) -> dict[str, bool] | None:
            if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, bool)
                                                      for k, v in value.items()):
                return None
            return value

        def pairs(value: Any) -> tuple[tuple[str, str], ...] | None:
            if not isinstance(value, list) or not all(
                    isinstance(p, list) and len(p) == 2 and all(isinstance(s, str) for s in p) for p in value):
                return None
            return tuple((a, b) for a, b in value)

        if not isinstance(data, dict) or data.get("format") != PROBE_FACTS_FORMAT:
            return None
        has_tensor, is_tensor = flags(data.get("has_tensor")), flags(data.get("is_tensor"))
        hits, writes_in = pairs(data.get("hits")), data.get("buffer_writes")
        if has_tensor is None or is_tensor is None or hits is None or not isinstance(writes_in, dict):
            return None
        writes: dict[str, tuple[tuple[str, str], ...]] = {}
        for node, slots in writes_in.items():
            named = pairs(slots)
            if not isinstance(node, str) or named is None:
                return None
            writes[node] = named
        return cls(has_tensor=has_tensor, is_tensor=is_tensor, hits=hits, buffer_writes=writes)

    def fits(self, model: nn.Module, gm: torch.fx.GraphModule) -> bool:
        """Whether these facts name exactly ``gm``'s nodes and only buffers ``model`` has."""
        nodes = {n.name for n in gm.graph.nodes}
        if set(self.has_tensor) != nodes or set(self.is_tensor) != nodes:
            return False
        if any(a not in nodes or b not in nodes for a, b in self.hits) or not set(self.buffer_writes) <= nodes:
            return False
        return all(_named_owner(model, gm, module, buf) is not None
                   for slots in self.buffer_writes.values() for module, buf in slots)

    def buffer_slots(self, model: nn.Module, gm: torch.fx.GraphModule) -> dict[str, list[tuple[nn.Module, str]]]:
        """``buffer_writes`` with the module objects of ``model`` and ``gm`` (call after :meth:`fits`)."""
        return {node: [(_named_owner(model, gm, module, buf), buf) for module, buf in slots]  # type: ignore[misc]
                for node, slots in self.buffer_writes.items()}


GRAPH_PREFIX = "graph:"


def _named_owner(model: nn.Module, gm: torch.fx.GraphModule, module: str, buf: str) -> nn.Module | None:
    """The module ``module`` names (in ``model``, or in ``gm`` after ``graph:``) if it has buffer ``buf``."""
    root, path = (gm, module.removeprefix(GRAPH_PREFIX)) if module.startswith(GRAPH_PREFIX) else (model, module)
    try:
        owner = root.get_submodule(path)
    except AttributeError:
        return None
    return owner if buf in owner._buffers else None


_NO_RNG_DEVICE_TYPES = ("cpu", "meta")
"""Device types with no generator of their own to fork: the CPU's is always forked, meta tensors draw nothing."""


@contextlib.contextmanager
def _forked_rng(devices: Sequence[torch.device]) -> Iterator[None]:
    """``torch.random.fork_rng`` over the CPU and each device in ``devices``, whatever its type.

    ``fork_rng`` forks one device type per call, so one call per type present; with none, one call forks
    the CPU's generator alone. A device without an index is the current one of its type.
    """
    indices: dict[str, list[int]] = {}
    for device in map(torch.device, devices):
        if device.type in _NO_RNG_DEVICE_TYPES:
            continue
        index = device.index if device.index is not None else torch.get_device_module(device.type).current_device()
        indices.setdefault(device.type, []).append(index)
    with contextlib.ExitStack() as stack:
        if not indices:
            stack.enter_context(torch.random.fork_rng(devices=[]))
        for device_type, forked in indices.items():
            stack.enter_context(torch.random.fork_rng(devices=forked, device_type=device_type))
        yield


@contextlib.contextmanager
def preserved_state(model: nn.Module, *, devices: Sequence[torch.device] = ()) -> Iterator[None]:
    """Run a block that trains or probes the model and leave the model as it was.

    Any train-mode pass updates BatchNorm running statistics: profiling without this was measured to leave
    every BN buffer of the model changed.
    Restores every buffer slot (BatchNorm running statistics, ``num_batches_tracked``; also undoing a forward
    that rebinds a buffer), each parameter's ``.grad`` object, the train/eval flag of every submodule and the
    RNG states (the CPU's and those of ``devices``, any accelerator: a ``cpu`` entry adds nothing). The probe
    run here and the worker's profilers and measurements all use it, so profiling is invisible to the caller.
    Grad mode is left as it is.
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
        with _forked_rng(devices):
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
def untouched(model: nn.Module, where: torch.Tensor | torch.device) -> Iterator[None]:
    """Run a probe that leaves no trace: no grad, RNG forked (the CPU's and ``where``'s device's), every buffer
    slot restored."""
    device = where.device if isinstance(where, torch.Tensor) else torch.device(where)
    with preserved_state(model, devices=[device]), torch.no_grad():
        yield


def buffer_owners(
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
                for storage in storages(buf):
                    owners.setdefault(id(storage), (storage, []))[1].append((module, name))
    return owners


def running_stat_slots(modules: Sequence[nn.Module]) -> list[tuple[nn.Module, str]]:
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


class RecordingInterpreter(torch.fx.Interpreter):
    """Runs the graph once, telling the recorder which node runs and what each node produced."""

    def __init__(self, gm: torch.fx.GraphModule, recorder: WriteRecorder) -> None:
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

