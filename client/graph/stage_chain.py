"""The stage chain executor: stages 1..n of a model, run whole with checkpointed segments or one at a time.

``StageChain.run`` runs every segment but the last under non-reentrant ``torch.utils.checkpoint``, with
the BatchNorm-safe recompute context (NOTE [BatchNorm running stats under recompute]) and the RNG state
preserved for the recompute (NOTE [RNG on recompute]). Chains are built by ``stage_graph.build_stage_chain``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat.client.errors import ModelError, PlanError

__all__ = ["NestedRun", "StageChain"]


@dataclass(eq=False)
class ChainStage:
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

    def __post_init__(self) -> None:
        self.call = stage_entry(self.module)


def stage_entry(module: Callable[..., tuple[Any, ...]]) -> Callable[..., tuple[Any, ...]]:
    """What runs a stage: a stage GraphModule's generated ``forward`` itself, anything else as given.

    NOTE [ early stop through fx ] A non-reentrant checkpoint stops its recompute by raising from a pack hook
    once every tensor it needs is back; the exception unwinds through the stage. ``GraphModule.__call__``
    catches every exception to extract its whole traceback (reading source files through ``linecache``) before
    raising it again: 0.2 ms per checkpointed segment per step on CPU, measured with cProfile on ResNet-152
    (265 early stops in 5 steps, 55 ms), which hand-written checkpointing of the same segments does not pay.
    The stage modules are remat's own (no hooks can be registered on them by a user); the model's modules
    they call still run through ``__call__``, hooks included.
    """
    if isinstance(module, torch.fx.GraphModule):
        return module.forward
    return module


class ChildrenStage:
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
    _stages: list[ChainStage]
    boundaries: list[str]
    cut_vertices: list[str]
    dropped: list[str]
    _edges: dict[str, list[str]] = field(repr=False)
    """Tensor-carrying edges (by node name) restricted to input→output paths, for the brute-force check."""
    _root: nn.Module | None = field(default=None, repr=False)
    _example_values: dict[str, Any] = field(default_factory=dict, repr=False)
    _probe_env: dict[str, Any] = field(default_factory=dict, repr=False)
    train: bool = True
    probe_facts: Any = field(default=None, repr=False)
    """What the probe learned (``write_probe.ProbeFacts``), to cut the same chain again without running the
    model; None for the children fallback or when the facts cannot be named."""
    probed: bool = True
    """False when the chain was cut from cached ``probe_facts`` without a probe run: it serves ``run`` (and
    ``apply``) only, since ``stage(i)`` may need values from the build-time example run that it did not make."""
    main_input: str = ""
    """The graph input stage 1 receives as ``x``: the only one, or a call's first tensor (``input_ids``)."""
    main_handed: bool = False
    """The main input is also handed, by name, to later stages that read it (token ids: NOTE [ token ids are
    held ] in stage_graph.py), as the call's other inputs are."""
    input_names: tuple[str, ...] = ()
    """Every graph input (placeholder) in order: the call's flat pytree leaves for an exported model."""
    side_values: tuple[str, ...] = ()
    """Tensors computed in one stage and read by later ones besides the boundary (NOTE [side values] in
    stage_graph.py): masks, position tables. The profiler prices them once, as resident."""
    pytree_specs: Any = field(default=None, repr=False)
    """(input spec, output spec) of an exported model: how a call flattens into the graph's inputs and the
    graph's flat outputs fold back into the model's output (a ``ModelOutput``); None for fx traces."""
    _extra_inputs: dict[str, Any] = field(default_factory=dict, repr=False)
    """The build-time call's inputs other than ``x``, by placeholder name, for ``stage(i)``."""
    _defaults: dict[str, Any] | None = field(default=None, repr=False)
    """``_defaulted_inputs``, read from the graph once."""

    @property
    def num_stages(self) -> int:
        return len(self._stages)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self._stages]

    @property
    def stage_nodes(self) -> list[list[str]]:
        return [list(s.nodes) for s in self._stages]

    def layout(self) -> tuple[tuple[Any, ...], ...]:
        """What each stage reads of the model: the modules it calls (by identity) and the parameters and buffers
        it looks up (by name; an exported graph has no module calls). Two chains of one model cut alike have
        one layout whatever the input sizes, so a plan's boundary indices mean the same cuts on both. Node
        names would not do: an export at batch 1 drops and renames size-1 ops."""
        return tuple((tuple(id(m) for m in st.modules), tuple(name for kind, name in st.inputs if kind == "attr"))
                     for st in self._stages)

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
        return self._run_handed(lo, hi, [x], env)

    def _run_handed(self, lo: int, hi: int, handed: list[Any], env: dict[str, Any]) -> Any:
        """Stages ``lo..hi`` on the value the caller hands over in ``handed`` (emptied here), so that once the
        first stage is done nothing of this call keeps that value alive (NOTE [ the last segment's input ])."""
        x = handed.pop()
        for st in self._stages[lo - 1 : hi]:
            out = st.call(x, *(self._resolve(spec, env) for spec in st.inputs))
            x = out[0]
            env.update(zip(st.exports, out[1:], strict=True))
        return x

    def split_call(self, call: Any) -> tuple[Any, dict[str, Any]]:
        """A call's (``x`` for stage 1, the other graph inputs by name); ``call``: a tensor or a ``ModelCall``
        with the signature the chain was built for."""
        if isinstance(call, torch.Tensor) or self.pytree_specs is None:
            return (call if isinstance(call, torch.Tensor) else call.main), dict(self._defaulted_inputs())
        leaves = call.inputs_for(self.pytree_specs[0])
        if leaves is None or len(leaves) != len(self.input_names):
            raise PlanError("this call's inputs are not those the chain was built for (names or structure differ)")
        named = dict(zip(self.input_names, leaves, strict=True))
        return named.pop(self.main_input), named

    def _defaulted_inputs(self) -> dict[str, Any]:
        """An fx graph's inputs besides ``x``: the forward's parameters left at their defaults by a one-tensor
        call, which the trace kept as placeholders holding them (``fx_trace.call_defaults``). Read from the graph
        once; the mapping is the chain's own, copied by whoever changes what it holds."""
        if self._defaults is None:
            nodes = self.graph_module.graph.nodes if self.graph_module is not None and self.pytree_specs is None else ()
            self._defaults = {n.name: n.args[0] for n in nodes
                              if n.op == "placeholder" and n.name != self.main_input and n.args}
        return self._defaults

    def fold_output(self, flat: Any) -> Any:
        """The model's output from the last stage's: an exported model's flat leaves folded back."""
        if self.pytree_specs is None:
            return flat
        return pytree.tree_unflatten(list(flat), self.pytree_specs[1])

    def run_call(self, call: Any, checkpoints: Sequence[int] = (), *, nested: bool = False) -> Any:
        """``run`` on a whole call (tensor or ``ModelCall``), returning what the model returns."""
        x, extra = self.split_call(call)
        return self.fold_output(self.run(x, checkpoints, extra=extra, nested=nested))

    def bind_inputs(self, call: Any) -> Any:
        """Make ``call``'s inputs what ``stage(i)`` reads by name (all but ``x``, and ``x`` too when the main
        input is handed: ``run`` puts it by name itself); returns ``x``."""
        x, extra = self.split_call(call)
        self._extra_inputs = {**extra, self.main_input: x} if self.main_handed else extra
        return x

    def stage_exports(self, i: int) -> tuple[str, ...]:
        """The names of what stage ``i`` hands to later stages besides its output (side values, shape integers)."""
        return tuple(self._stages[i - 1].exports)

    def stage(self, i: int, *, hand_exports: bool = False) -> Callable[[Any], Any]:
        """Stage ``i`` (1-indexed) as a callable mapping x_{i-1} to x_i, for profiling one stage at a time.

        Parameters and buffers are looked up on the live model at each call. Values that the stage takes
        from earlier stages other than x_{i-1} (rare: shape integers such as a batch size, constants) come
        from earlier ``stage(j)`` calls made through this chain, or else from the build-time example run.
        What the stage hands to later ones (its exports: side values) is kept for them; with
        ``hand_exports`` the callable returns ``(x_i, {name: value})`` instead and keeps nothing, so that a
        measured pass holds the stage's exports only as long as its caller does (NOTE [ seeding a stage's
        exports ] in remat.worker.profilers.export_seeds).
        """
        if not 1 <= i <= self.num_stages:
            raise IndexError(f"stage {i} is not in 1..{self.num_stages}")
        st = self._stages[i - 1]

        def call(x: Any) -> Any:
            env = {**self._example_values, **self._extra_inputs, **self._probe_env}
            missing = [name for kind, name in st.inputs if kind == "value" and name not in env]
            if missing:
                raise ModelError(f"stage {i} needs {missing} from earlier stages: run stages 1..{i - 1} first")
            out = st.call(x, *(self._resolve(spec, env) for spec in st.inputs))
            if hand_exports:
                return out[0], dict(zip(st.exports, out[1:], strict=True))
            self._probe_env.update(zip(st.exports, out[1:], strict=True))
            return out[0]

        call.__name__ = f"stage_{i}"
        return call

    def run(self, x: Any, checkpoints: Sequence[int] = (), *, extra: dict[str, Any] | None = None,
            nested: bool = False) -> Any:
        """Run the whole chain on ``x``; boundaries in ``checkpoints`` (1..n-1) keep their activations.
        ``extra``: the graph's other inputs by name (``split_call``); the output is the last stage's (flat
        for an exported model: ``run_call`` folds it).

        Segments are the runs of stages between consecutive kept boundaries. Every segment but the last
        runs under non-reentrant ``torch.utils.checkpoint`` so that only its input is kept and its inside is
        recomputed during backward. Without grad mode nothing is checkpointed (there is no backward).
        ``nested``: inside each checkpointed segment every stage but the last runs under its own checkpoint
        too, so the segment's re-run keeps only its stage outputs (remat.client.planning.nested).
        """
        n = self.num_stages
        cps = tuple(sorted(checkpoints))
        if len(set(cps)) != len(cps) or any(
            isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= n - 1 for c in cps
        ):
            raise PlanError(f"checkpoints {list(checkpoints)} must be distinct boundaries in 1..{n - 1}")
        env: dict[str, Any] = {**self._defaulted_inputs(), **(extra or {})}
        if self.main_handed:  # later stages read x by name (NOTE [ token ids are held ] in stage_graph)
            env[self.main_input] = x
        if not torch.is_grad_enabled():
            return self._run_stages(1, n, x, env)
        bounds = (0, *cps, n)
        for k in range(len(bounds) - 1):
            lo, hi = bounds[k] + 1, bounds[k + 1]
            if k == len(bounds) - 2:
                handed = [x]
                del x  # NOTE [ the last segment's input ]
                return self._run_handed(lo, hi, handed, env)
            x, new = self._checkpointed(lo, hi, x, env, nested=nested)
            env.update(new)
        raise AssertionError("unreachable")  # pragma: no cover

    __call__ = run

    def _checkpointed(self, lo: int, hi: int, x: Any, env: dict[str, Any], *,
                      nested: bool = False) -> tuple[Any, dict[str, Any]]:
        """Stages lo..hi under non-reentrant checkpoint, their buffers restored around the re-run; returns their
        output and the values they add to ``env``."""
        slots = tuple(dict.fromkeys(s for st in self._stages[lo - 1 : hi] for s in st.slots))
        # The env is copied: checkpoint keeps its arguments for the recompute, which must see the values as
        # they were at this point, not as later segments extend them.
        return checkpoint(partial(self._nested_segment if nested else self._segment, lo, hi), x, dict(env),
                          use_reentrant=False, preserve_rng_state=True,
                          context_fn=partial(recompute_contexts, slots))

    def _segment(self, lo: int, hi: int, x: Any, env: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        local = dict(env)
        x = self._run_stages(lo, hi, x, local)
        return x, {k: v for k, v in local.items() if k not in env}

    def _nested_segment(self, lo: int, hi: int, x: Any, env: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """A checkpointed segment whose stages but the last each run under their own checkpoint."""
        local = dict(env)
        for i in range(lo, hi):
            x, new = self._checkpointed(i, i, x, local)
            local.update(new)
        x = self._run_stages(hi, hi, x, local)
        return x, {k: v for k, v in local.items() if k not in env}


class NestedRun:
    """A chain run nested (``StageChain.run(..., nested=True)``), as what runs a plan in the measured step and
    the gradient check (``run``/``run_call``, like the chain itself)."""

    def __init__(self, chain: StageChain) -> None:
        self.chain = chain

    def run(self, x: Any, checkpoints: Sequence[int] = ()) -> Any:
        return self.chain.run(x, checkpoints, nested=True)

    def run_call(self, call: Any, checkpoints: Sequence[int] = ()) -> Any:
        return self.chain.run_call(call, checkpoints, nested=True)


# NOTE [ the last segment's input ]
# The last segment runs without checkpoint, so its input x_a must die as soon as its first stage is done unless
# a stage saves it: the cost model charges it only then (``drop_input``). A local name in ``run`` that still
# held x_a kept it alive through the whole last segment's forward: measured on GPT-2 under bf16 autocast,
# where the head casts its input (saving the copy, not x_a) and the loss upcasts the bf16 logits (saving
# nothing of them), a checkpoint at the logits measured 8,192,000 bytes (the logits) over its prediction,
# +13%, and one at the final norm 786,432 bytes over. ``run`` hands x_a over in a list and forgets it.

# NOTE [BatchNorm running stats under recompute]
# A checkpointed segment runs its forward twice: once for real and once during backward to rebuild the
# activations. In train mode BatchNorm updates running_mean/var and num_batches_tracked on *every* forward,
# so a plain recompute updates them twice (measured: 150 of 159 BN buffers wrong after one ResNet-50 step,
# num_batches_tracked = 2). Disabling track_running_stats during the recompute does not work: the BN node
# saves the running stats, so the number of saved tensors differs and checkpoint raises. What works is to
# snapshot the running-stat buffers when the recompute starts and copy the snapshot back on exit: the
# recompute computes the same outputs (train-mode BN normalises with batch statistics), its updates are
# undone, and the exit also runs when non-reentrant checkpoint stops the recompute early. Buffers that the
# recorded run saw written in place (custom EMA buffers, functional batch_norm on get_attr buffers) are
# restored the same way.
# An earlier version swapped the buffers for clones instead (another option that kept every buffer
# bit-equal). Because BN saves its running stats for backward, every clone then stayed alive until that BN's
# backward: memory no trace can see, up to -1.7% prediction error on kept-gradient plans (docs/cost-model.md,
# "Fixed in the executor: BatchNorm buffer clones in the recompute").
# The snapshot is freed as soon as the recompute ends.


class _RestoreBuffers:
    """Context manager: snapshot buffer values on enter, copy them back in place on exit.

    The snapshot is one flat tensor per group of buffers and the restore one ``_foreach_copy_`` per group, not a
    clone and a copy per buffer: ResNet-152 has 465 BatchNorm buffers, and on a GPU, where a step at moderate
    batch is bound by kernel launches, 930 tiny kernels per recompute were a measurable share of the overhead
    (NOTE [ timing a plan ] in remat.worker.profilers.step_timing). Copies either way, so bit-equal."""

    def __init__(self, slots: Sequence[tuple[nn.Module, str]]) -> None:
        self.slots = slots
        self.saved: list[tuple[list[torch.Tensor], torch.Tensor]] = []

    def __enter__(self) -> _RestoreBuffers:
        # Grouped by device, dtype and whether the buffers are scalars (BatchNorm's num_batches_tracked): a
        # group of scalars is stacked and unbound, one of vectors (running_mean, running_var) concatenated and
        # split, so that no op runs per buffer on the host either; other shapes go flat.
        groups: dict[tuple[torch.device, torch.dtype, bool], list[torch.Tensor]] = {}
        for module, name in self.slots:
            buf = module._buffers.get(name)
            if buf is not None:
                groups.setdefault((buf.device, buf.dtype, buf.dim() == 0), []).append(buf)
        with torch.no_grad():
            for (_, _, scalars), bufs in groups.items():
                if scalars:
                    flat = torch.stack(bufs)
                else:
                    flat = torch.cat([b if b.dim() == 1 else b.reshape(-1) for b in bufs])
                self.saved.append((bufs, flat))
        return self

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for bufs, flat in reversed(self.saved):
                if bufs[0].dim() == 0:
                    parts = list(flat.unbind())
                else:
                    parts = [part if part.shape == b.shape else part.view(b.shape)
                             for part, b in zip(flat.split([b.numel() for b in bufs]), bufs, strict=True)]
                torch._foreach_copy_(bufs, parts)
        self.saved.clear()


# NOTE [RNG on recompute]
# Dropout and stochastic depth inside a checkpointed segment must draw the same masks when the segment is
# recomputed, or the backward differentiates a different function than the forward computed: the loss is
# unchanged but gradients are silently wrong (measured with preserve_rng_state=False: max abs diff 0.05 on
# VGG-19's classifier gradients).
# run() passes preserve_rng_state=True, which saves the CPU and device RNG states before each checkpointed
# segment and restores them for its recompute. Stages keep fx's node order (see _build_from_fx in
# stage_graph.py), so the sequence of random ops, hence every mask, is also the eager model's.


def recompute_contexts(slots: Sequence[tuple[nn.Module, str]]) -> tuple[Any, Any]:
    """``context_fn`` for checkpoint: nothing around the forward, buffer restore around the recompute."""
    return contextlib.nullcontext(), _RestoreBuffers(slots)
