"""Cut a model into a chain of stages that can be checkpointed segment by segment.

Public API (what profilers, ``apply`` and tests code against)::

    chain = build_stage_chain(model, example_input, train=True)   # -> StageChain; raises ModelError
    chain.num_stages            # n
    chain.names                 # list[str], n human-readable stage labels (module paths)
    chain.boundaries            # list[str], n-1 boundary labels (fx node names / child names): x_1..x_{n-1}
    chain.stage_nodes           # list[list[str]], the fx nodes (or children) of each stage
    chain.cut_vertices          # every articulation node found (before unsafe ones were dropped)
    chain.dropped               # cut vertices dropped because a later node writes their storage in place
    chain.source                # "fx" or "children" (fallback when torch.fx cannot trace the model)
    chain.graph_module          # the full traced torch.fx.GraphModule, None for the "children" fallback
    chain.stage(i)              # callable x_{i-1} -> x_i for stage i (1-indexed); parameters are bound
    chain.stage_parameters(i)   # list[nn.Parameter] stage i uses (for parameter-gradient bytes G_i)
    chain.run(x, checkpoints=(2, 5))   # the whole chain; every segment but the last checkpointed
    chain(x, checkpoints=...)          # same as run
    trace_model(model, train=True)     # -> GraphModule (the tracer used for stages and hashing)
    with preserved_state(model, cuda_devices=(0,)): ...   # restores buffers (BN stats) and RNG on exit
    brute_force_cut_vertices(chain)    # -> list[str]; O(V·E) reference for chain.cut_vertices (tests)

How the chain is found (docs/apply.md and /work/shared/feasibility.md §2–3 explain why):

1. Trace with torch.fx, treating ``torchvision.ops.StochasticDepth`` as a leaf so the train/eval switch is
   not baked into the graph, in the requested mode (aux heads still depend on it: one chain per mode).
2. Run the graph once on ``example_input`` (no grad, RNG forked, buffers restored afterwards, so the model
   is left exactly as it was) under a dispatch mode that records which storages each node writes in place
   and whether each node's value carries a tensor.
3. Boundaries = articulation nodes of the graph restricted to tensor-carrying edges (``x.size()`` and
   ``x.shape`` edges are ignored: shapes are static for a plan), by a linear sweep over topological order.
   A boundary whose storage a later node writes in place (``ReLU(inplace=True)`` after a BN) is dropped,
   which keeps the in-place op in its producer's stage. The node feeding only the output is not a boundary.
4. Each stage becomes its own small GraphModule sharing the model's submodules. ``get_attr`` parameters and
   buffers are not copied into the stages: they are looked up on the live model every time a stage runs,
   so ``model.to(device)`` after building still works and the BN recompute context can restore buffers.

If fx cannot trace the model (or the traced graph cannot run), the model's top-level children are used
when they form a chain (each child called once, in turn, on the previous child's output, with no other
op in between); otherwise ``ModelError`` says both reasons in one line.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from remat.client.errors import ModelError, PlanError

__all__ = [
    "StageChain",
    "brute_force_cut_vertices",
    "build_stage_chain",
    "preserved_state",
    "trace_model",
]

_INPUT = "<input>"
_OUTPUT = "<output>"


def _extra_leaves() -> tuple[type[nn.Module], ...]:
    """Module types that must stay opaque to the tracer. torchvision is optional and slow to import; a
    model containing ``StochasticDepth`` has necessarily imported it already, so look it up lazily."""
    module = sys.modules.get("torchvision.ops.stochastic_depth")
    return (module.StochasticDepth,) if module is not None else ()


# ----------------------------------------------------------------------------------------------------------
# Tracing
# ----------------------------------------------------------------------------------------------------------


class _Tracer(torch.fx.Tracer):
    """fx tracer that keeps modules with a runtime train/eval switch opaque.

    ``StochasticDepth`` reads ``self.training`` inside a non-leaf module, so a default trace bakes the
    flag into a ``stochastic_depth(..., True)`` call that keeps dropping rows after ``.eval()`` (P1).
    """

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        leaves = _extra_leaves()
        if leaves and isinstance(m, leaves):
            return True
        return super().is_leaf_module(m, module_qualified_name)


@contextlib.contextmanager
def _training_mode(model: nn.Module, train: bool) -> Iterator[None]:
    """Put every submodule in ``train`` mode and restore each module's own flag afterwards."""
    flags = [(m, m.training) for m in model.modules()]
    model.train(train)
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def trace_model(model: nn.Module, *, train: bool = True) -> torch.fx.GraphModule:
    """Trace ``model`` with remat's tracer in the given mode; raise ``ModelError`` if fx cannot.

    The trace uses a shallow copy of the model as root: the copy shares the parameter, buffer and submodule
    dictionaries (so every ``get_attr`` resolves to the live tensors) while the tracer's own bookkeeping
    attributes (``_tensor_constant0``…) land on the copy instead of the user's model.
    """
    root = copy.copy(model)
    with _training_mode(model, train):
        root.training = train
        try:
            graph = _Tracer().trace(root)
        except Exception as exc:  # noqa: BLE001 - any failure of user code under tracing means "not traceable"
            raise ModelError(f"torch.fx cannot trace {type(model).__name__}: {_one_line(exc)}") from exc
    gm = torch.fx.GraphModule(root, graph, class_name=type(model).__name__)
    gm.meta["remat_train"] = train  # hashing.architecture_hash only reuses train-mode traces
    return gm


# ----------------------------------------------------------------------------------------------------------
# Recording a run: tensor-ness of every node, in-place writes, buffers written
# ----------------------------------------------------------------------------------------------------------


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
    """Restore every buffer slot of ``model`` and the RNG states (CPU and ``cuda_devices``) on exit.

    For profilers that run stages in train mode: without it, each probe updates BatchNorm running
    statistics (feasibility P5) and advances the RNG. Grad mode is left as it is.
    """
    saved = [
        (module, name, buf, buf.detach().clone())
        for module in model.modules()
        for name, buf in module._buffers.items()
        if buf is not None
    ]
    try:
        with torch.random.fork_rng(devices=list(cuda_devices)):
            yield
    finally:
        with torch.no_grad():
            for module, name, buf, copy_ in saved:
                module._buffers[name] = buf  # also undoes a forward that rebinds a buffer
                buf.copy_(copy_)


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


# ----------------------------------------------------------------------------------------------------------
# The chain
# ----------------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Stage:
    module: Callable[..., tuple[Any, ...]]
    """Called as ``module(x, *extra)``; returns ``(x_out, *exports)``."""
    inputs: tuple[tuple[str, str], ...]
    """Extra inputs after x: ("attr", target) looked up on the live model, or ("value", node name)."""
    exports: tuple[str, ...]
    """Names of the values after x_out in the returned tuple, used by later stages."""
    slots: tuple[tuple[nn.Module, str], ...]
    """Buffers the stage updates in place in train mode (restored after it is recomputed)."""
    nodes: tuple[str, ...]
    name: str = ""
    modules: tuple[nn.Module, ...] = ()
    """The (leaf) modules the stage calls."""


class _ChildrenStage:
    """A run of consecutive top-level children (the fallback when fx cannot trace the model)."""

    def __init__(self, children: Sequence[nn.Module]) -> None:
        self.children = list(children)

    def __call__(self, x: Any) -> tuple[Any]:
        for child in self.children:
            x = child(x)
        return (x,)


@dataclass(eq=False)
class StageChain:
    """A model cut into stages 1..n; see the module docstring for the API."""

    model: nn.Module
    source: str
    graph_module: torch.fx.GraphModule | None
    _stages: list[_Stage]
    boundaries: list[str]
    cut_vertices: list[str]
    dropped: list[str]
    _edges: dict[str, list[str]] = field(repr=False)
    """Tensor-carrying edges (by node name) restricted to input→output paths, for the brute-force check."""
    _root: nn.Module | None = field(default=None, repr=False)
    _example_values: dict[str, Any] = field(default_factory=dict, repr=False)
    _probe_env: dict[str, Any] = field(default_factory=dict, repr=False)
    train: bool = True

    @property
    def num_stages(self) -> int:
        return len(self._stages)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self._stages]

    @property
    def stage_nodes(self) -> list[list[str]]:
        return [list(s.nodes) for s in self._stages]

    def stage_parameters(self, i: int) -> list[nn.Parameter]:
        """Parameters stage ``i`` uses (its modules' and its ``get_attr`` ones), each once, in order of use.

        A parameter shared by several stages (tied weights) is listed for each of them.
        """
        st = self._stages[i - 1]
        found: dict[int, nn.Parameter] = {}
        for module in st.modules:
            for p in module.parameters():
                found.setdefault(id(p), p)
        for kind, name in st.inputs:
            if kind == "attr":
                value = self._resolve((kind, name), {})
                if isinstance(value, nn.Parameter):
                    found.setdefault(id(value), value)
        return list(found.values())

    # -- running ---------------------------------------------------------------------------------------

    def _resolve(self, spec: tuple[str, str], env: dict[str, Any]) -> Any:
        kind, name = spec
        if kind != "attr":
            return env[name]
        # The live model first (parameters moved by .to(), buffers restored by the recompute context), then
        # the traced root for the tracer's own constants (_tensor_constant0…), which only it holds.
        for obj in (self.model, self._root):
            try:
                for part in name.split("."):
                    obj = getattr(obj, part)
                return obj
            except AttributeError:
                continue
        raise ModelError(f"the model has no attribute {name!r} any more (was it changed after planning?)")

    def _run_stages(self, lo: int, hi: int, x: Any, env: dict[str, Any]) -> Any:
        for st in self._stages[lo - 1 : hi]:
            out = st.module(x, *(self._resolve(spec, env) for spec in st.inputs))
            x = out[0]
            env.update(zip(st.exports, out[1:], strict=True))
        return x

    def stage(self, i: int) -> Callable[[Any], Any]:
        """Stage ``i`` (1-indexed) as a callable mapping x_{i-1} to x_i, for profiling one stage at a time.

        Parameters and buffers are looked up on the live model at each call. Values that the stage takes
        from earlier stages other than x_{i-1} (rare: shape integers such as a batch size, constants) come
        from earlier ``stage(j)`` calls made through this chain, or else from the build-time example run.
        """
        if not 1 <= i <= self.num_stages:
            raise IndexError(f"stage {i} is not in 1..{self.num_stages}")
        st = self._stages[i - 1]

        def call(x: Any) -> Any:
            env = {**self._example_values, **self._probe_env}
            missing = [name for kind, name in st.inputs if kind == "value" and name not in env]
            if missing:
                raise ModelError(f"stage {i} needs {missing} from earlier stages: run stages 1..{i - 1} first")
            out = st.module(x, *(self._resolve(spec, env) for spec in st.inputs))
            self._probe_env.update(zip(st.exports, out[1:], strict=True))
            return out[0]

        call.__name__ = f"stage_{i}"
        return call

    def run(self, x: Any, checkpoints: Sequence[int] = ()) -> Any:
        """Run the whole chain on ``x``; boundaries in ``checkpoints`` (1..n-1) keep their activations.

        Segments are the runs of stages between consecutive kept boundaries. Every segment but the last
        runs under non-reentrant ``torch.utils.checkpoint`` so that only its input is kept and its inside is
        recomputed during backward. Without grad mode nothing is checkpointed (there is no backward).
        """
        n = self.num_stages
        cps = tuple(sorted(checkpoints))
        if len(set(cps)) != len(cps) or any(
            isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= n - 1 for c in cps
        ):
            raise PlanError(f"checkpoints {list(checkpoints)} must be distinct boundaries in 1..{n - 1}")
        env: dict[str, Any] = {}
        if not torch.is_grad_enabled():
            return self._run_stages(1, n, x, env)
        bounds = (0, *cps, n)
        for k in range(len(bounds) - 1):
            lo, hi = bounds[k] + 1, bounds[k + 1]
            if k == len(bounds) - 2:
                return self._run_stages(lo, hi, x, env)
            slots = tuple(dict.fromkeys(s for st in self._stages[lo - 1 : hi] for s in st.slots))
            # The env is copied: checkpoint keeps its arguments for the recompute, which must see the
            # values as they were at this point, not as later segments extend them.
            x, new = checkpoint(
                partial(self._segment, lo, hi),
                x,
                dict(env),
                use_reentrant=False,
                preserve_rng_state=True,
                context_fn=partial(_recompute_contexts, slots),
            )
            env.update(new)
        raise AssertionError("unreachable")  # pragma: no cover

    __call__ = run

    def _segment(self, lo: int, hi: int, x: Any, env: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        local = dict(env)
        x = self._run_stages(lo, hi, x, local)
        return x, {k: v for k, v in local.items() if k not in env}


# NOTE [BatchNorm running stats under recompute]
# A checkpointed segment runs its forward twice: once for real and once during backward to rebuild the
# activations. In train mode BatchNorm updates running_mean/var and num_batches_tracked on *every* forward,
# so a plain recompute updates them twice (feasibility §3: 150/159 buffers wrong after one ResNet-50 step,
# num_batches_tracked = 2). Disabling track_running_stats during the recompute does not work: the BN node
# saves the running stats, so the number of saved tensors differs and checkpoint raises. What works is to
# snapshot the running-stat buffers when the recompute starts and copy the snapshot back on exit: the
# recompute computes the same outputs (train-mode BN normalises with batch statistics), its updates are
# undone, and the exit also runs when non-reentrant checkpoint stops the recompute early. Buffers that the
# recorded run saw written in place (custom EMA buffers, functional batch_norm on get_attr buffers) are
# restored the same way.
# An earlier version swapped the buffers for clones instead (feasibility's other working option). Because
# BN saves its running stats for backward, every clone then stayed alive until that BN's backward: memory no
# trace can see, up to -1.7% prediction error on kept-gradient plans (docs/cost-model.md, Calibration).
# The snapshot is freed as soon as the recompute ends.


class _RestoreBuffers:
    """Context manager: snapshot buffer values on enter, copy them back in place on exit."""

    def __init__(self, slots: Sequence[tuple[nn.Module, str]]) -> None:
        self.slots = slots
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> _RestoreBuffers:
        for module, name in self.slots:
            buf = module._buffers.get(name)
            if buf is not None:
                self.saved.append((buf, buf.detach().clone()))
        return self

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for buf, snapshot in reversed(self.saved):
                buf.copy_(snapshot)
        self.saved.clear()


# NOTE [RNG on recompute]
# Dropout and stochastic depth inside a checkpointed segment must draw the same masks when the segment is
# recomputed, or the backward differentiates a different function than the forward computed: the loss is
# unchanged but gradients are silently wrong (feasibility P7: max abs diff 0.05 on VGG-19's classifier).
# run() passes preserve_rng_state=True, which saves the CPU and device RNG states before each checkpointed
# segment and restores them for its recompute. Stages keep fx's node order (see _build_from_fx), so the
# sequence of random ops, hence every mask, is also the eager model's.


def _recompute_contexts(slots: Sequence[tuple[nn.Module, str]]) -> tuple[Any, Any]:
    """``context_fn`` for checkpoint: nothing around the forward, buffer restore around the recompute."""
    return contextlib.nullcontext(), _RestoreBuffers(slots)


# ----------------------------------------------------------------------------------------------------------
# Articulation boundaries
# ----------------------------------------------------------------------------------------------------------


def _on_path_edges(
    order: list[str], edges: dict[str, list[str]], source: str, sink: str
) -> dict[str, list[str]]:
    """Restrict ``edges`` to nodes that lie on some source→sink path."""
    reach = {source}
    stack = [source]
    while stack:
        u = stack.pop()
        for v in edges.get(u, ()):
            if v not in reach:
                reach.add(v)
                stack.append(v)
    reverse: dict[str, list[str]] = {}
    for u, vs in edges.items():
        for v in vs:
            reverse.setdefault(v, []).append(u)
    coreach = {sink}
    stack = [sink]
    while stack:
        v = stack.pop()
        for u in reverse.get(v, ()):
            if u not in coreach:
                coreach.add(u)
                stack.append(u)
    keep = reach & coreach
    return {u: [v for v in edges.get(u, ()) if v in keep] for u in order if u in keep}


def _cut_vertices(order: list[str], path_edges: dict[str, list[str]], source: str, sink: str) -> list[str]:
    """Nodes every source→sink path passes through, by one sweep over topological order.

    In a DAG laid out in topological order, an on-path node is a cut vertex iff no on-path edge jumps over
    it; a difference array over edge spans finds all of them in O(V + E).
    """
    pos = {name: i for i, name in enumerate(order)}
    diff = [0] * (len(order) + 1)
    for u, vs in path_edges.items():
        for v in vs:
            a, b = pos[u], pos[v]
            if b > a + 1:
                diff[a + 1] += 1
                diff[b] -= 1
    cover, out = 0, []
    for i, name in enumerate(order):
        cover += diff[i]
        if cover == 0 and name in path_edges and name not in (source, sink):
            out.append(name)
    return out


def brute_force_cut_vertices(chain: StageChain) -> list[str]:
    """Reference implementation of ``chain.cut_vertices``: delete each node, test reachability. O(V·E)."""
    edges = chain._edges
    nodes = [u for u in edges if u not in (_INPUT, _OUTPUT)]
    out = []
    for w in nodes:
        seen = {_INPUT}
        stack = [_INPUT]
        while stack:
            u = stack.pop()
            for v in edges.get(u, ()):
                if v != w and v not in seen:
                    seen.add(v)
                    stack.append(v)
        if _OUTPUT not in seen:
            out.append(w)
    return out


def _safe_boundaries(
    order: list[str], cuts: list[str], hits: list[tuple[str, str]], path_edges: dict[str, list[str]]
) -> tuple[list[str], list[str]]:
    """Drop cut vertices whose storage a later node writes in place, and one that feeds only the output.

    Cutting after such a node would hand the next segment a tensor that the segment then overwrites, which
    autograd detects at backward ("modified by an inplace operation"); keeping the in-place consumer in the
    producer's stage avoids it. Returns (boundaries, dropped-as-unsafe).
    """
    pos = {name: i for i, name in enumerate(order)}
    written_later = {producer for writer, producer in hits if pos.get(writer, -1) > pos.get(producer, -1)}
    unsafe = [b for b in cuts if b in written_later]
    bounds = [b for b in cuts if b not in written_later]
    # A boundary whose only on-path successor is the output would leave the last stage empty.
    while bounds and path_edges.get(bounds[-1]) == [_OUTPUT]:
        bounds.pop()
    return bounds, unsafe


# ----------------------------------------------------------------------------------------------------------
# Building from an fx graph
# ----------------------------------------------------------------------------------------------------------


def _node_name(n: torch.fx.Node) -> str:
    if n.op == "placeholder":
        return _INPUT
    if n.op == "output":
        return _OUTPUT
    return n.name


def _module_path(n: torch.fx.Node) -> str:
    if n.op == "call_module":
        return str(n.target)
    stack = n.meta.get("nn_module_stack")
    return next(reversed(stack)) if stack else ""


def _common_prefix(paths: list[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for group in zip(*parts, strict=False):
        if all(g == group[0] for g in group):
            common.append(group[0])
        else:
            break
    return ".".join(common)


def _stage_name(nodes: list[torch.fx.Node], used: set[str]) -> str:
    """A module path for the stage: the enclosing module when the stage is one module (a ResNet block),
    else "first..last" module paths."""
    compute = [n for n in nodes if n.op not in ("placeholder", "output", "get_attr")] or nodes
    paths = [_module_path(n) for n in compute]
    prefix = _common_prefix(paths)
    if prefix and prefix in paths and prefix not in used:
        return prefix

    def label(n: torch.fx.Node) -> str:
        return _module_path(n) or n.name

    first, last = label(compute[0]), label(compute[-1])
    return first if first == last else f"{first}..{last}"


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out


class _RecordingInterpreter(torch.fx.Interpreter):
    """Runs the graph once, telling the recorder which node runs and what each node produced."""

    def __init__(self, gm: torch.fx.GraphModule, recorder: _WriteRecorder) -> None:
        super().__init__(gm)
        self.recorder = recorder
        self.has_tensor: dict[str, bool] = {}
        self.small_values: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        self.recorder.current = n.name
        value = super().run_node(n)
        self.recorder.current = "<between>"
        self.has_tensor[n.name] = _has_tensor(value)
        if self.has_tensor[n.name]:
            self.recorder.register(n.name, value)
        else:
            self.small_values[n.name] = value
        return value


def _probe_devices(example: torch.Tensor) -> list[int]:
    if example.device.type != "cuda":
        return []
    return [example.device.index if example.device.index is not None else torch.cuda.current_device()]


def _build_from_fx(
    model: nn.Module, gm: torch.fx.GraphModule, example: torch.Tensor, train: bool
) -> StageChain:
    graph = gm.graph
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise ModelError(
            f"{type(model).__name__}.forward takes {len(placeholders)} inputs; only one tensor is supported"
        )

    with _training_mode(model, train), _untouched(model, example):
        recorder = _WriteRecorder(_buffer_owners(model, gm))
        interp = _RecordingInterpreter(gm, recorder)
        with recorder:
            interp.run(example)

    # Tensor-carrying edges, restricted to input→output paths.
    order = [_node_name(n) for n in nodes]
    edges: dict[str, list[str]] = {}
    for n in nodes:
        if n.op != "output" and interp.has_tensor.get(n.name, False):
            edges[_node_name(n)] = [_node_name(u) for u in n.users]
    path_edges = _on_path_edges(order, edges, _INPUT, _OUTPUT)
    cuts = _cut_vertices(order, path_edges, _INPUT, _OUTPUT)
    bounds, unsafe = _safe_boundaries([n.name for n in nodes], cuts, recorder.hits, path_edges)

    # Every node goes to a stage by its position: stage k holds the nodes after boundary k-1 up to and
    # including boundary k. Keeping fx's order (rather than moving nodes next to their users) keeps the
    # order of random ops, hence dropout masks, identical to the eager model's.
    bound_set = set(bounds)
    stage_of: dict[str, int] = {}
    k = 1
    for n in nodes:
        stage_of[n.name] = k
        if n.name in bound_set:
            k += 1
    members: list[list[torch.fx.Node]] = [[] for _ in range(len(bounds) + 1)]
    for n in nodes:
        if n.op != "get_attr":  # parameters are looked up per stage, never handed between stages
            members[stage_of[n.name] - 1].append(n)

    # The last stage that uses each value computed in an earlier stage.
    last_use: dict[str, int] = {}
    for n in nodes:
        for u in n.all_input_nodes:
            if u.op != "get_attr" and stage_of[u.name] < stage_of[n.name]:
                last_use[u.name] = max(last_use.get(u.name, 0), stage_of[n.name])

    stages: list[_Stage] = []
    incoming = placeholders[0]
    for idx, stage_nodes in enumerate(members, start=1):
        g = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {incoming: g.placeholder("x")}
        inputs: list[tuple[str, str]] = []
        # Extra inputs first: placeholders must precede every other node.
        for n in stage_nodes:
            for u in n.all_input_nodes:
                if u not in env and (u.op == "get_attr" or stage_of[u.name] < idx):
                    inputs.append(("attr", str(u.target)) if u.op == "get_attr" else ("value", u.name))
                    env[u] = g.placeholder(f"in_{u.name}")
        boundary = stage_nodes[-1] if idx <= len(bounds) else None
        export_nodes = [
            n for n in stage_nodes
            if last_use.get(n.name, 0) > (idx + 1 if n is boundary else idx)
        ]
        for n in stage_nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                result = torch.fx.map_arg(n.args[0], env.__getitem__)
                g.output((result, *(env[e] for e in export_nodes)))
                continue
            env[n] = g.node_copy(n, env.__getitem__)
        if boundary is not None:
            assert boundary.name == bounds[idx - 1]
            g.output((env[boundary], *(env[e] for e in export_nodes)))
            incoming = boundary
        g.lint()
        stage_gm = torch.fx.GraphModule(gm, g, class_name=f"Stage{idx}")
        called = [stage_gm.get_submodule(str(n.target)) for n in stage_nodes if n.op == "call_module"]
        slots = _running_stat_slots(called)
        for n in stage_nodes:
            slots += recorder.buffer_writes.get(n.name, [])
        stages.append(
            _Stage(
                module=stage_gm,
                inputs=tuple(inputs),
                exports=tuple(e.name for e in export_nodes),
                slots=tuple(dict.fromkeys(slots)),
                nodes=tuple(n.name for n in stage_nodes),
                name=_stage_name(stage_nodes, {st.name for st in stages}),
                modules=tuple(dict.fromkeys(called)),
            )
        )
    for st, name in zip(stages, _unique([st.name for st in stages]), strict=True):
        st.name = name

    return StageChain(
        model=model,
        source="fx",
        graph_module=gm,
        _stages=stages,
        boundaries=bounds,
        cut_vertices=cuts,
        dropped=unsafe,
        _edges=path_edges,
        _root=gm,
        _example_values={k: v for k, v in interp.small_values.items() if k in last_use},
        train=train,
    )


# ----------------------------------------------------------------------------------------------------------
# Fallback: top-level children that form a chain
# ----------------------------------------------------------------------------------------------------------


def _build_from_children(model: nn.Module, example: torch.Tensor, train: bool) -> StageChain:
    """Use the top-level children as stage units if the forward is exactly "each child on the last output".

    Checked on one eager run with hooks: every child is called once, in order, with the previous child's
    output object (the example input for the first) as its only argument, the forward returns the last
    child's output object, and no aten op runs outside a child.
    """
    children = list(model.named_children())
    if not children:
        raise ModelError("it has no children")
    calls: list[str] = []
    problems: list[str] = []
    last_output: list[Any] = [example]
    handles = []

    with _training_mode(model, train), _untouched(model, example):
        recorder = _WriteRecorder(_buffer_owners(model))

        def pre_hook(name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
            if recorder.current != "<between>":
                problems.append(f"child {name!r} runs inside child {recorder.current!r}")
            elif kwargs or len(args) != 1 or args[0] is not last_output[0]:
                problems.append(f"child {name!r} does not take the previous output as its only input")
            calls.append(name)
            recorder.current = name

        def post_hook(name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            recorder.register(name, output)
            last_output[0] = output
            recorder.current = "<between>"

        for name, child in children:
            handles.append(child.register_forward_pre_hook(partial(pre_hook, name), with_kwargs=True))
            handles.append(child.register_forward_hook(partial(post_hook, name), with_kwargs=True))
        try:
            with recorder:
                recorder.current = "<between>"
                # The class's forward, not the instance attribute: apply() may have replaced the latter.
                result = type(model).forward(model, example)
                recorder.current = None
        except Exception as exc:  # noqa: BLE001 - the eager model failing on the example is a user error
            raise ModelError(f"running it on the example input failed: {_one_line(exc)}") from exc
        finally:
            for h in handles:
                h.remove()
    names = [name for name, _ in children]
    if problems:
        raise ModelError(problems[0])
    if calls != names:
        missing = [n for n in names if n not in calls]
        if missing:
            raise ModelError(f"child {missing[0]!r} is never called")
        raise ModelError(f"its children are called in the order {calls}, not once each in turn")
    if result is not last_output[0]:
        raise ModelError("its output is not the last child's output")
    outside = [op for op in recorder.ops_outside if op]
    if outside:
        raise ModelError(f"its forward runs {outside[0]} between children")

    order = [_INPUT, *names, _OUTPUT]
    edges = {u: [v] for u, v in zip(order[:-1], order[1:], strict=False)}
    bounds, unsafe = _safe_boundaries(order, list(names), recorder.hits, edges)
    modules = dict(children)
    groups: list[list[str]] = [[]]
    for name in names:
        groups[-1].append(name)
        if name in bounds:
            groups.append([])
    stages = []
    for group in groups:
        mods = [modules[n] for n in group]
        slots = _running_stat_slots(mods) + [s for n in group for s in recorder.buffer_writes.get(n, [])]
        stages.append(
            _Stage(
                module=_ChildrenStage(mods),
                inputs=(),
                exports=(),
                slots=tuple(dict.fromkeys(slots)),
                nodes=tuple(group),
                name=group[0] if len(group) == 1 else f"{group[0]}..{group[-1]}",
                modules=tuple(mods),
            )
        )
    return StageChain(
        model=model,
        source="children",
        graph_module=None,
        _stages=stages,
        boundaries=bounds,
        cut_vertices=list(names),
        dropped=unsafe,
        _edges=edges,
        _root=model,
        train=train,
    )


# ----------------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def build_stage_chain(model: nn.Module, example_input: torch.Tensor, *, train: bool = True) -> StageChain:
    """Cut ``model`` into a chain of stages for checkpointing; raise ``ModelError`` if it cannot be.

    Args:
        model: the model; it is not modified (its buffers and the RNG are restored after the probe run).
        example_input: one input batch (its values do not matter, its shape, dtype and device do: the
            probe run records which nodes carry tensors and which write in place).
        train: trace and probe in train mode (True, what checkpointing needs) or eval mode. Graphs differ
            between modes (aux heads), so a chain belongs to one mode.

    Returns:
        The chain; its stages share the model's submodules, parameters and buffers.
    """
    if not isinstance(example_input, torch.Tensor):
        raise ModelError(f"example_input must be a tensor, got {type(example_input).__name__}")
    try:
        gm = trace_model(model, train=train)
        return _build_from_fx(model, gm, example_input, train)
    except ModelError as exc:
        fx_reason = str(exc)
    except Exception as exc:  # noqa: BLE001 - a traced graph that cannot run is as unusable as no graph
        fx_reason = f"the traced graph does not run: {_one_line(exc)}"
    try:
        return _build_from_children(model, example_input, train)
    except ModelError as exc:
        raise ModelError(
            f"cannot cut {type(model).__name__} into stages: {fx_reason}; "
            f"and its top-level children do not form a chain: {exc}"
        ) from None
