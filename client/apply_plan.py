"""Apply a checkpoint plan to a model at train time: ``model = remat.client.apply(model, plan)``.

Public API::

    apply(model, plan, *, key=None, strict=True) -> nn.Module     # returns ``model`` itself
    apply_with_chain(model, plan, *, key, chain) -> nn.Module     # the same, traced once by the caller
    remove(model) -> nn.Module                                     # undo apply
    applied_plan(model) -> Plan | None
    applied_chain(model) -> StageChain | None                      # built at apply time or first train call

How: the model is cut into the same stage chain the profiler measured (``stage_graph.build_stage_chain``)
and the *instance's* ``forward`` is replaced by one that runs the chain with every segment but the last
under non-reentrant ``torch.utils.checkpoint``. A graph plan (``acg``'s, ``plan.dropped_vertices``) runs
on the model's op graph instead (``op_graph.build_op_graph``), each group of dropped vertices as one
checkpointed call. The returned object is the original module, so its
parameters, buffers, ``state_dict()`` keys, hooks and optimizers are untouched. In eval mode or without
grad mode the class's own ``forward`` runs, unchanged. docs/apply.md lists what is guaranteed.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat.client.errors import ModelError, PlanError, PlanMismatchError, StalePlanError
from remat.client.graph.fx_trace import (
    ANY_SIZES_GUARDS,
    any_sizes_probe_facts,
    export_any_sizes,
    export_model,
    keep_any_sizes_probe_facts,
    sizes_refused,
)
from remat.client.graph.hashing import architecture_hash
from remat.client.graph.mask_skips import MASK_SKIPS, PRECONDITION, mask_decisions
from remat.client.graph.model_call import ModelCall, synthetic_call
from remat.client.graph.op_graph import OpGraph, build_op_graph
from remat.client.graph.stage_graph import StageChain, build_stage_chain, trace_model
from remat.client.held_output import OutputWatch
from remat.client.model_wrappers import refuse_inner_units, trained_module
from remat.client.plan import Plan
from remat.client.plan_key import PlanKey, current_torch_version
from remat.client.precision import autocast_dtype, precision_of_call
from remat.client.user_frame import user_stacklevel

__all__ = ["applied_chain", "applied_plan", "apply", "apply_with_chain", "example_for", "remove"]

_STATE = "_remat_applied"
MAX_SIZED_CHAINS = 8
"""Sizes other than its chain's whose chain an applied exported model keeps (NOTE [ other sizes ]); the least
recently used goes first. A chain for one size holds a graph and its stage modules (GPT-2's graph file is
0.5 MiB); sizes run on the chain for any sizes share it, and keeping them only spares asking its guards."""


@dataclass(eq=False)
class _Applied:
    plan: Plan
    key: PlanKey | None
    strict: bool
    chain: StageChain | OpGraph | None = None
    """What runs the plan: the stage chain, or the op graph for a graph plan."""
    checked: bool = False
    warned: bool = False
    warned_compile: bool = False
    sizes: str | None = None
    """``ModelCall.sizes`` of the call ``chain`` was cut for; None until known (set at the first training call)."""
    sized_chains: OrderedDict[str, StageChain | OpGraph] = field(default_factory=OrderedDict)
    """Chains of an exported model for calls at other sizes (NOTE [ other sizes ]), by their ``sizes``."""
    any_sizes: dict[tuple[bool, ...], StageChain | None] = field(default_factory=dict)
    """The chains cut from the export for any sizes (NOTE [ any sizes ] in remat.client.graph.fx_trace), by the
    mask decisions they were exported with (NOTE [ masks without padding ]); None: tried, not usable."""
    warned_sizes: bool = False
    warned_masks: bool = False
    graph_cache: Path | None = None
    """The plan cache directory whose ``graphs`` hold the exports of other sizes (``checkpoint(cache_dir=)``);
    None: the user's."""
    watch: OutputWatch | None = None
    """The first training step's watch for an output the loop keeps through backward (NOTE [ an output alive
    through backward ] in remat.client.held_output); made at the first training call."""

    def __deepcopy__(self, memo: dict) -> _Applied:
        # A deep-copied model gets its own chain, built from its own modules at its first training call.
        return _Applied(plan=self.plan, key=self.key, strict=self.strict, graph_cache=self.graph_cache)

    def __getstate__(self) -> dict[str, Any]:
        # A pickled model (``torch.save(model)``) keeps its plan, not its chains (graph modules do not pickle):
        # they are cut again at its first training call, as a deep copy's. The cache directory is this
        # machine's; the loading one exports into its own.
        return {"plan": self.plan, "key": self.key, "strict": self.strict}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]


class _PlanForward:
    """The instance ``forward`` that ``apply`` installs: ``_forward`` bound to the model, as a bound method
    would be (``__func__``, ``__self__`` for tools that unwrap one), but with the class forward's signature
    (transformers' ``Trainer`` keeps the dataset columns that ``forward`` names: of ``(*args, **kwargs)``, none)
    and pickled by reference to its model (a bound method pickles as a lookup of its function's name on the
    model, which fails on loading)."""

    __slots__ = ("__self__",)

    def __init__(self, model: nn.Module) -> None:
        self.__self__ = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _forward(self.__self__, *args, **kwargs)

    @property
    def __func__(self) -> Any:
        return _forward

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.__self__).forward.__get__(self.__self__))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_PlanForward, (self.__self__,))


def _plan_key(plan: Plan, key: PlanKey | None) -> PlanKey | None:
    if key is not None:
        return key
    raw = plan.extra.get("key") if isinstance(plan.extra, Mapping) else None
    if raw is None:
        return None
    if isinstance(raw, PlanKey):
        return raw
    if not isinstance(raw, Mapping):
        raise PlanError(f"plan: extra['key'] must be an object (PlanKey.to_dict()), got {type(raw).__name__}")
    return PlanKey.from_dict(raw)


def _model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def example_for(key: PlanKey, model: nn.Module) -> torch.Tensor | ModelCall:
    """A probe input with the key's shape in its precision's floating dtype, on the model's device, without
    touching the global RNG (an autocast precision runs a float32 model on float32 inputs); for a key of a
    call of several inputs, a call of its signature (``model_call.synthetic_call``: integer inputs zeros)."""
    if key.inputs:
        call = synthetic_call(key.inputs, model, _model_device(model))
        if call is None:
            raise PlanError(f"plan: the call signature {key.inputs[:80]!r} cannot be rebuilt to cut the chain")
        return call
    dtype = getattr(torch, "float32" if autocast_dtype(key.dtype) else key.dtype)
    generator = torch.Generator().manual_seed(0)
    return torch.randn(key.input_shape, generator=generator).to(dtype).to(_model_device(model))


def _mismatch(plan: Plan, detail: str, kind: type[PlanMismatchError] = PlanMismatchError) -> PlanMismatchError:
    return kind(f"plan ({plan.algorithm}, {plan.num_stages} stages) does not fit this model: {detail}")


def _check_stages(state: _Applied) -> None:
    """Refuse a plan whose boundaries or vertices name another chain or op graph than the model's (an older
    remat's cut, or another model's plan forced with strict=False): indices only mean something on the chain or
    graph they were chosen for, so this is refused even when not strict."""
    assert state.chain is not None
    if isinstance(state.chain, OpGraph):
        if state.chain.num_vertices != state.plan.num_vertices:
            raise _mismatch(state.plan, f"the model's op graph has {state.chain.num_vertices} vertices, the "
                                        f"plan's {state.plan.num_vertices}", StalePlanError)
        try:
            state.chain.check(state.plan.dropped_vertices or ())
        except PlanError as exc:
            raise _mismatch(state.plan, f"on the model's op graph, {exc}", StalePlanError) from None
        return
    n = state.chain.num_stages
    if n != state.plan.num_stages:
        raise _mismatch(state.plan, f"the model splits into {n} stages, the plan into {state.plan.num_stages}",
                        StalePlanError)


@contextlib.contextmanager
def _uninstalled(model: nn.Module) -> Iterator[None]:
    """The model as it was before ``apply`` while a chain is cut from it at a training call: a trace must follow
    the class's forward, not the installed one (which would run the plan inside its own trace), and the
    export cache's key must not see remat's state."""
    saved = {name: model.__dict__.pop(name) for name in (_STATE, "forward") if name in model.__dict__}
    try:
        yield
    finally:
        model.__dict__.update(saved)


def _build(state: _Applied, model: nn.Module, example: torch.Tensor | ModelCall, graph: Any = None) -> None:
    state.sizes = (example if isinstance(example, ModelCall) else ModelCall.bind(model, (example,), {})).sizes
    try:
        with _uninstalled(model):
            if state.plan.is_graph_plan:
                state.chain = build_op_graph(model, example, train=True, graph=graph)
            else:
                state.chain = build_stage_chain(model, example, train=True, graph=graph)
    except ModelError as exc:
        raise _mismatch(state.plan, str(exc)) from exc
    _check_stages(state)


# NOTE [ other sizes ] torch.export writes every size of the call into the graph's views and expands, so a chain
# cut from an exported graph runs only at the sizes it was exported for: the smaller last batch of an epoch
# (a DataLoader's default) or a batch padded to another length failed inside the graph with a reshape error.
# A training call at other sizes (the same inputs, dtypes and constants: ``ModelCall.same_inputs``) runs on
# the chain cut from one more export of the model, for any sizes (NOTE [ any sizes ] in
# remat.client.graph.fx_trace), when that export's guards hold for the call; otherwise (a size the code decides
# on, a model export cannot follow with symbolic sizes) on a chain of its own sizes, cut by the same
# ``build_stage_chain`` as the plan's (export, disk-cached like any, and the no-grad probe), a second or two
# per new size. Either is kept for the next call at those sizes (``MAX_SIZED_CHAINS``). Both exports hold
# what the code decides on sizes, as a guard or as the very sizes. The fidelity
# check (an eager and a chain step without checkpoints) is not run again: what it guards against, a path
# that depends on values or that export takes differently, was checked at the plan's sizes for this kind of
# call, and every later batch of the plan's own sizes runs unchecked with other values anyway; while two
# uncheckpointed steps at a larger padded length are what may not fit in memory at all. The plan's boundary
# indices are used on the new chain only when it is cut into the same stages (``StageChain.layout``: the
# modules, parameters and buffers each stage reads); otherwise, or when the model cannot be exported at those
# sizes, the call is refused naming the sizes, never run on a graph made for other ones. Measured on a 2-core
# CPU, for every allow-listed transformer (remat.client.hf_models) with and without a mask: the export for any
# sizes took 0.6-3.4 s, was cut into the plan chain's stages and trained bit-equal at (4, 40), (3, 17) and
# (2, 32), a batch of one row going to a chain of its own (NOTE [ sizes export assumed ]); a chain for one
# size took 0.7-2.0 s each. On a 6-block GPT-2 trained 30 steps at 24 padded lengths,
# remat took 30.5 s against 29.8 unmodified, and 59.8 s with one export per size (docs/benchmarks.md). A chain
# cut for the plan's sizes predicts the plan's peak; another size's peak scales with it and is not predicted.
def _chain_for_sizes(state: _Applied, model: nn.Module, call: ModelCall) -> StageChain:
    """The chain for a training call at other sizes than ``state.chain``'s (NOTE [ other sizes ])."""
    assert isinstance(state.chain, StageChain) and state.sizes is not None

    def cut(sizes: str) -> tuple[StageChain, str]:
        chain = _any_sizes_chain(state, model, call, _skips_of(state.chain))
        if chain is None:
            return (_one_size_chain(state, model, call, sizes), "the plan's checkpoints on a graph exported for "
                    "these sizes (once per new size; pad batches to fixed sizes to avoid it)")
        if chain.graph_module is not None and ANY_SIZES_GUARDS not in chain.graph_module.meta:
            return chain, "the plan's checkpoints on its graph for any sizes, read back from an earlier start"
        return chain, "the plan's checkpoints on its graph exported for any sizes (once)"

    return _at_other_sizes(state, call, "chain", cut)


def _at_other_sizes(state: _Applied, call: ModelCall, what: str, cut: Callable[[str], tuple[Any, str]]) -> Any:
    """The chain or op graph (``what``) that runs a training call at other sizes than the plan's: cut by ``cut``
    the first time (given the sizes as the messages name them, it returns what it cut and how it ran, for the
    one warning) and kept for the next call at those sizes (NOTE [ other sizes ], NOTE [ graph plans of a
    call ]). A call that passes other inputs than the plan's is refused naming them."""
    assert state.sizes is not None
    if call.sizes not in state.sized_chains:
        sizes = f"{_short(call.sizes)} (the plan's {what}: {_short(state.sizes)})"
        if not call.same_inputs(state.sizes):
            raise _mismatch(state.plan, f"this training call passes other inputs than the first: {sizes}"
                                        f"{_pass_them_too(call, state.sizes)}")
        started = time.perf_counter()
        known, how = cut(sizes)
        if not state.warned_sizes:
            warnings.warn(f"remat: a training call at other sizes than the plan's, {sizes}, runs {how}: "
                          f"{time.perf_counter() - started:.1f} s; its peak is not the plan's prediction",
                          RuntimeWarning, stacklevel=user_stacklevel())
            state.warned_sizes = True
        state.sized_chains[call.sizes] = known
    return _used(state, call.sizes)


def _used(state: _Applied, name: str) -> Any:
    """The kept chain ``name``, marked the most recently used; the least recently used beyond
    ``MAX_SIZED_CHAINS`` go."""
    state.sized_chains.move_to_end(name)
    while len(state.sized_chains) > MAX_SIZED_CHAINS:
        state.sized_chains.popitem(last=False)
    return state.sized_chains[name]


def _any_sizes_chain(state: _Applied, model: nn.Module, call: ModelCall,
                     mask_skips: tuple[bool, ...] = ()) -> StageChain | None:
    """The chain for any sizes, exported with ``mask_skips``, when it holds for ``call`` (its export's guards),
    else None. Exported and cut once per ``mask_skips``, from the first call at other sizes whose dimensions are
    all 2 or more (export fixes a dimension of size 1 for good), and kept only when cut into the plan chain's
    stages (NOTE [ any sizes ])."""
    assert isinstance(state.chain, StageChain)
    if mask_skips not in state.any_sizes:
        if any(size == 1 for leaf in call.leaves() for size in leaf.shape):
            return None
        state.any_sizes[mask_skips] = None
        try:
            with _uninstalled(model):
                graph = export_any_sizes(model, call, train=True, mask_skips=mask_skips,
                                         cache_dir=state.graph_cache)
                chain = build_stage_chain(model, call.single_tensor if call.single_tensor is not None else call,
                                          train=True, graph=graph, check=False,
                                          facts=any_sizes_probe_facts(graph, state.graph_cache))
                if chain.probed:
                    keep_any_sizes_probe_facts(graph, chain.probe_facts, state.graph_cache)
        except ModelError:
            return None
        if chain.layout() == state.chain.layout():
            state.any_sizes[mask_skips] = chain
    chain = state.any_sizes[mask_skips]
    if chain is None or chain.graph_module is None:
        return None
    return chain if sizes_refused(chain.graph_module, call.flat_inputs()) is None else None


# NOTE [ graph plans of a call ] A graph plan names vertices of one op graph, cut from the graph exported for the
# plan's call (NOTE [ an op graph of a call ] in remat.client.graph.op_graph): its sizes and its mask decisions.
# A training call at other sizes (the same inputs: ``ModelCall.same_inputs``) runs on an op graph cut from the
# model exported at its sizes, with the plan graph's mask decisions, when that graph has the plan graph's layout
# (``OpGraph.layout``: every vertex the same ops, the same edges): then the plan's dropped vertices recompute
# the same ops on it. It is kept for the next call at those sizes (``MAX_SIZED_CHAINS``, beside a chain plan's
# chains). Otherwise (export traced other ops at those sizes: a batch of one row, whose size-1 ops export drops;
# a size the code branches on) the call is refused naming the sizes. Unlike a chain plan's, there is no export
# for any sizes: it adds ops of its own for the symbolic sizes (two sym_size in BERT's and Llama's), so its
# layout is not the plan graph's although its vertex count is. Measured on a 2-core CPU with the tests' tiny
# transformers: a new size's first step took 0.34-0.80 s, export and op graph included (docs/benchmarks.md). A
# call whose masks have no padding while the graph builds them runs on it (the same numbers up to float
# rounding, as a chain plan's does, with the same warning); a call with padding that the graph leaves out is
# refused, as a chain plan's is.
def _graph_for_sizes(state: _Applied, model: nn.Module, call: ModelCall) -> OpGraph:
    """The op graph for a training call at other sizes than the graph plan's (NOTE [ graph plans of a call ])."""
    graph = state.chain
    assert isinstance(graph, OpGraph)

    def cut(sizes: str) -> tuple[OpGraph, str]:
        try:
            with _uninstalled(model):
                exported = export_model(model, call, train=True, cache_dir=state.graph_cache,
                                        mask_skips=_skips_of(graph))
                known = build_op_graph(model, call, train=True, graph=exported)
        except ModelError as exc:
            raise _mismatch(state.plan, f"the model cannot be exported at this call's sizes, {sizes}: {exc}") from None
        if known.layout() != graph.layout():
            raise _mismatch(state.plan, f"a graph plan ({state.plan.algorithm}) runs at other sizes only where the "
                                        f"model exports the same ops, and at this call's it does not ("
                                        f"{known.num_vertices} vertices against {graph.num_vertices}, or other ops "
                                        f"in them), {sizes}; a chain plan (linear, checkpoint()'s default) runs at "
                                        f"any sizes")
        return known, ("the graph plan on an op graph exported for these sizes (once per new size; pad batches to "
                       "fixed sizes to avoid it)")

    return _at_other_sizes(state, call, "graph", cut)


def _check_graph_call(state: _Applied, graph: OpGraph, call: ModelCall) -> None:
    """Refuse a training call ``graph`` (the plan's, or one cut at the call's sizes) cannot run with the plan's
    mask decisions (NOTE [ graph plans of a call ])."""
    gm = graph.graph_module
    if gm.meta.get(PRECONDITION) is None:
        return
    wanted, have = mask_decisions(gm, call.flat_inputs()), gm.meta[MASK_SKIPS]
    if wanted is None or wanted == have:
        return
    if any(h and not w for h, w in zip(have, wanted, strict=True)):
        raise _mismatch(state.plan, "this training call's attention masks have padding the plan's graph leaves "
                                    "out (it was made from a batch without padding), and a graph plan runs on "
                                    "that graph only (give checkpoint() a padded batch to plan for both)")
    if not state.warned_masks:
        warnings.warn("remat: the model's own forward leaves out this training call's attention masks (no "
                      "padding); the graph plan runs on its graph, which builds them: the same numbers up to "
                      "float rounding", RuntimeWarning, stacklevel=user_stacklevel())
        state.warned_masks = True


def _skips_of(chain: StageChain | OpGraph | None) -> tuple[bool, ...]:
    """The mask decisions the graph of ``chain`` was exported with (NOTE [ masks without padding ])."""
    graph = getattr(chain, "graph_module", None)
    return graph.meta.get(MASK_SKIPS, ()) if graph is not None else ()


# NOTE [ masks per batch ] A chain is cut from a graph exported with the mask decisions of one call (NOTE [ masks
# without padding ] in remat.client.graph.mask_skips): a batch padded or not, the model's own forward builds its
# attention masks or leaves them out, and a graph holds one of the two. Before each training call the chain's
# precondition gives the call's own decisions (one host sync, as the model's own forward reads its mask); a
# call whose decisions differ runs on a chain exported with them, at its sizes: from the export for any sizes
# with those decisions when its guards hold, else exported for its very sizes (disk-cached), kept like a chain
# of other sizes (``MAX_SIZED_CHAINS``). Like those, it is used only when cut into the plan chain's stages;
# otherwise a call without padding runs on the chain at hand, which builds the mask it would leave out (the
# same numbers up to float rounding; the first such call warns), and a padded call whose mask the chain at
# hand leaves out is refused (NOTE [ one layout for every batch ] in remat.client.graph.fx_trace).
def _chain_for_masks(state: _Applied, model: nn.Module, call: ModelCall, chain: StageChain) -> StageChain:
    """``chain``, or the chain of the same sizes exported with ``call``'s own mask decisions when they differ
    from ``chain``'s (NOTE [ masks per batch ])."""
    graph = chain.graph_module
    if graph is None or graph.meta.get(PRECONDITION) is None:
        return chain
    wanted = mask_decisions(graph, call.flat_inputs())
    if wanted is None or wanted == graph.meta[MASK_SKIPS]:
        return chain
    name = f"{call.sizes}, masks skipped {''.join('1' if w else '0' for w in wanted)}"
    known = state.sized_chains.get(name)
    if known is None:
        known = _any_sizes_chain(state, model, call, wanted) if ANY_SIZES_GUARDS in graph.meta else None
        if known is None:
            try:
                known = _cut_for(state, model, call, wanted)
            except ModelError as exc:
                reason = str(exc)
            else:
                reason = f"it is cut into other stages ({known.num_stages} against {state.chain.num_stages})"
                if known.layout() != state.chain.layout():  # type: ignore[union-attr]
                    known = None
        if known is None:
            have = graph.meta[MASK_SKIPS]
            if any(h and not w for h, w in zip(have, wanted, strict=True)):
                # The chain at hand leaves out a mask this call needs: it would attend to its padding.
                raise _mismatch(state.plan, f"this training call's attention masks have padding the plan's graph "
                                            f"leaves out (it was made from a batch without padding), and a graph "
                                            f"that builds them cannot run the plan: {reason}; {_short(name)} "
                                            f"(give checkpoint() a padded batch to plan for both)")
            if not state.warned_masks:
                warnings.warn(f"remat: the model's own forward leaves out this training call's attention masks "
                              f"(no padding), and a graph exported so cannot run the plan: {_short(reason)}; the "
                              f"call runs on the plan's graph, which builds them: the same numbers up to float "
                              f"rounding ({_short(name)})", RuntimeWarning, stacklevel=user_stacklevel())
                state.warned_masks = True
            known = chain
        state.sized_chains[name] = known
    return _used(state, name)


def _cut_for(state: _Applied, model: nn.Module, call: ModelCall, mask_skips: tuple[bool, ...]) -> StageChain:
    """A chain cut for ``call``'s very sizes, exported with ``mask_skips`` when the plan chain's graph was
    exported, traced as the plan chain's otherwise (disk-cached like any export); ``ModelError`` when it cannot
    be. Its stages are the caller's to compare with the plan chain's."""
    assert isinstance(state.chain, StageChain)
    with _uninstalled(model):
        if state.chain.graph_module is not None and state.chain.graph_module.meta.get("remat_tracer") == "export":
            graph = export_model(model, call, train=True, cache_dir=state.graph_cache, mask_skips=mask_skips)
        else:
            graph = trace_model(model, train=True, call=call, cache_dir=state.graph_cache)
        return build_stage_chain(model, call.single_tensor if call.single_tensor is not None else call,
                                 train=True, graph=graph, check=False)


def _one_size_chain(state: _Applied, model: nn.Module, call: ModelCall, sizes: str) -> StageChain:
    """A chain exported and cut for ``call``'s very sizes with the plan chain's mask decisions (the call's own
    are asked next: NOTE [ masks per batch ])."""
    assert isinstance(state.chain, StageChain)
    try:
        chain = _cut_for(state, model, call, _skips_of(state.chain))
    except ModelError as exc:
        raise _mismatch(state.plan, f"the model cannot be cut at this call's sizes, {sizes}: {exc}") from None
    if chain.layout() != state.chain.layout():
        raise _mismatch(state.plan, f"at this call's sizes the model is cut into other stages ({chain.num_stages} "
                                    f"against {state.chain.num_stages}, or other modules in them), {sizes}")
    return chain


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _cut_points(plan: Plan) -> tuple[int, ...]:
    return plan.dropped_vertices if plan.dropped_vertices is not None else plan.checkpoints


def _check_call(state: _Applied, model: nn.Module, call: ModelCall) -> None:
    """First training call: the input signature must be the one the plan was measured for. For a call of
    several inputs, only up to sizes: the first batch of a shuffled, dynamically padded loader is rarely the
    example's length, and it runs on a chain of its own sizes like any later batch (NOTE [ other sizes ])."""
    key = state.key
    if key is None or not state.strict:
        return
    diffs = []
    x = call.main
    other_sizes = bool(key.inputs) and call.same_inputs(key.inputs)
    if tuple(x.shape) != key.input_shape and not key.inputs:  # a call of several inputs: its sizes are in them
        diffs.append(f"input_shape: plan {list(key.input_shape)} vs input {list(x.shape)}")
    if call.signature != key.inputs and not other_sizes:
        planned = ModelCall(args=(), kwargs={}, signature=key.inputs)
        diffs.append(f"inputs: {planned.describe_difference(call) or 'the plan was made for one tensor'} "
                     f"(plan vs call)")
    precision = precision_of_call(model, call)
    if precision != key.dtype:
        diffs.append(f"dtype: plan {key.dtype} vs this call's {precision}")
    if x.device.type != key.device:
        diffs.append(f"device: plan {key.device} vs input {x.device.type}")
    if diffs:
        hint = _pass_them_too(call, key.inputs) if key.inputs else ""
        if not hint and precision != key.dtype:
            hint = _same_precision(key.dtype, precision)
        raise _mismatch(state.plan, "; ".join(diffs) + (hint or " (apply(..., strict=False) to use it anyway)"))


def _same_precision(planned: str, called: str) -> str:
    """A precision refusal's last words: where the plan and the loop part ways (accelerate's mixed precision
    wraps the forward in autocast after ``checkpoint`` ran outside it), and how to plan for the loop's."""
    if called.startswith("autocast_"):
        return (f" (the loop trains under autocast: call checkpoint() inside the same torch.autocast, or, with "
                f"accelerate's mixed precision, inside `with accelerator.autocast():`, to plan for {called})")
    if planned.startswith("autocast_"):
        return " (the plan was made under autocast: train under the same autocast, or call checkpoint() outside it)"
    return " (the plan was made for other weights' dtype: call checkpoint() on the model as it trains)"


def _pass_them_too(call: ModelCall, planned: str) -> str:
    """A refusal's last words when the call passes inputs the plan's call did not (module docstring of
    ``model_call``: ``inputs_beyond``)."""
    extra = call.inputs_beyond(planned)
    if extra is None:
        return ""
    return (f" (this call also passes {_short(extra, 120)}: give checkpoint() every input of the training call, "
            f"e.g. checkpoint(model, **batch, num_items_in_batch=torch.tensor(1.0)) under transformers' Trainer)")


def _forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Replacement forward: the chain with checkpoints in training, the class's forward otherwise."""
    if not self.training or not torch.is_grad_enabled():
        return type(self).forward(self, *args, **kwargs)  # under torch.compile, compiled as ever
    if torch.compiler.is_compiling():
        return _planned_under_compile(self, *args, **kwargs)
    return _planned(self, *args, **kwargs)


# NOTE [ torch.compile keeps the plan ] Compiled as one graph, an applied model does not keep its plan:
# AOTAutograd re-partitions the whole step and decides on its own what to save. Measured on CPU (torch 2.15,
# ResNet-50, batch 8, 64², gradients kept, allocator peak above the step's start): eager 71.1 MiB unmodified,
# 27.2 MiB with the ``linear`` plan; compiled 147.6 MiB unmodified and 90.0 MiB with the plan applied (3.3x
# the plan's), and slower (295 against 244 ms). So dynamo does not trace the planned training forward: a
# compiled applied model runs it eagerly, with the plan's memory and bit-equal gradients (27.2 MiB, 254 ms),
# and warns once. Evaluation and no-grad calls run the class's forward and are compiled as usual.
# ``torch._dynamo.disable`` imports torch._dynamo, which took 4.3 s of every start on this VM (bytecode not
# cached) as a decorator at import: the eager path never needs it, so it is applied at the first compiled call.
_DYNAMO_DISABLED: dict[str, Any] = {}


def _planned_under_compile(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A training call traced by dynamo: one warning, then the plan run eagerly with dynamo off."""
    run = _DYNAMO_DISABLED.get("planned")
    if run is None:
        import torch._dynamo

        run = _DYNAMO_DISABLED["planned"] = torch._dynamo.disable(_warned_planned)
    return run(self, *args, **kwargs)


def _warned_planned(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: _Applied = self.__dict__[_STATE]
    if not state.warned_compile:
        warnings.warn("remat: torch.compile does not compile an applied model's training forward; it runs "
                      "eagerly with the plan's checkpoints (compiled as one graph, the plan's memory is lost: "
                      "docs/apply.md, 'torch.compile')", RuntimeWarning, stacklevel=user_stacklevel())
        state.warned_compile = True
    return _planned(self, *args, **kwargs)


def _planned(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A training call: the chain with the plan's checkpoints (NOTE [ torch.compile keeps the plan ])."""
    state: _Applied = self.__dict__[_STATE]
    try:
        call: ModelCall | None = ModelCall.bind(self, args, kwargs)
    except PlanError:
        call = None
    # A plan is for one kind of call (one tensor, or the inputs its key names); without a key, the first call's.
    several = bool(state.key.inputs) if state.key is not None else None
    if call is None or (several is not None and several != (call.single_tensor is None)):
        return _unplanned(state, self, args, kwargs)
    example = call.single_tensor if call.single_tensor is not None else call
    if state.chain is None:
        _build(state, self, example)
    if not state.checked:
        refuse_inner_units(self)
        _check_call(state, self, call)
        state.checked = True
        if state.sizes is None:  # a chain handed over by checkpoint(): cut for the key's call, or for this one
            state.sizes = state.key.inputs if state.key is not None and state.key.inputs else call.sizes
    if call.single_tensor is None and getattr(state.chain, "pytree_specs", None) is None:
        return _unplanned(state, self, args, kwargs)  # a chain cut for one tensor (no key), several inputs given
    if state.watch is None:
        state.watch = OutputWatch(state.plan.predicted_peak_bytes)
    return state.watch.output(_run_planned(state, self, call, example), (args, kwargs))


def _run_planned(state: _Applied, model: nn.Module, call: ModelCall, example: torch.Tensor | ModelCall) -> Any:
    """The chain (or op graph) of this call's sizes and masks, run with the plan's checkpoints."""
    chain = state.chain
    assert chain is not None
    nested = {"nested": True} if state.plan.nested else {}  # a nested plan runs on a StageChain (_build)
    if isinstance(chain, OpGraph) and chain.pytree_specs is not None:
        if call.sizes != state.sizes:
            chain = _graph_for_sizes(state, model, call)
        _check_graph_call(state, chain, call)
        return chain.run_call(example, _cut_points(state.plan))
    if isinstance(chain, StageChain) and chain.pytree_specs is not None:
        if call.sizes != state.sizes:
            chain = _chain_for_sizes(state, model, call)
        chain = _chain_for_masks(state, model, call, chain)
        return chain.run_call(example, _cut_points(state.plan), **nested)
    assert call.single_tensor is not None  # a call of several inputs on a one-tensor chain is unplanned
    return chain.run(call.single_tensor, _cut_points(state.plan), **nested)


def _unplanned(state: _Applied, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The class's forward for a training call the plan was not made for, with a warning the first time: the
    user believes the plan is saving memory, and on this call it is not."""
    if not state.warned:
        warnings.warn("remat: the applied plan was made for another kind of call (one tensor, or the inputs "
                      "the plan names); this training call ran without checkpointing", RuntimeWarning,
                      stacklevel=user_stacklevel())
        state.warned = True
    return type(model).forward(model, *args, **kwargs)


def apply(model: nn.Module, plan: Plan, *, key: PlanKey | None = None, strict: bool = True) -> nn.Module:
    """Make ``model`` train with ``plan``'s checkpoints; returns the same module object.

    Args:
        model: the model to train. Only its instance ``forward`` is replaced; parameters, buffers,
            submodules and ``state_dict()`` keys stay as they are, so optimizers built before or after
            keep working, and so do saved checkpoints.
        plan: the plan (``plan.checkpoints`` are stage boundaries 1..n-1 of the model's stage chain).
        key: what the plan was made for; defaults to ``plan.extra["key"]`` (a ``PlanKey.to_dict()``).
        strict: refuse a plan whose key does not match: architecture hash and torch version now, input
            shape, dtype and device class at the first training call. A stage count that differs from
            the plan's is refused even when not strict: the boundary indices would mean other cuts.

    Raises:
        PlanMismatchError: the plan was made for another model, input signature, mode or torch version.
        PlanError: the plan or its key is malformed.
        ModelError: the model is sharded or wrapped in a way a plan cannot train under (NOTE [ plans under
            data parallelism ] in remat.client.model_wrappers); a DistributedDataParallel wrapper is returned
            with the plan applied to its module.
    """
    if not isinstance(plan, Plan):
        raise PlanError(f"apply: expected a remat.client.plan.Plan, got {type(plan).__name__}")
    wrapper, model = model, trained_module(model, "apply")
    key = _plan_key(plan, key)
    remove(model)
    graph = None  # the hash check's trace, when there is one, is the trace the chain is cut from
    example = example_for(key, model) if key is not None else None
    if key is not None and strict:
        call = example if isinstance(example, ModelCall) else None
        try:
            graph = trace_model(model, train=True, call=call)
        except ModelError as exc:
            if call is not None:  # the hash of a call of several inputs is of its exported graph
                raise _mismatch(plan, f"the model cannot be traced for the plan's inputs: {exc}") from None
            graph = None
        _check_key(plan, key, architecture_hash(model, graph=graph))
    state = _Applied(plan=plan, key=key, strict=strict)
    if example is not None:
        try:
            _build(state, model, example, graph=graph)
        except PlanMismatchError:
            raise
        except (RuntimeError, TypeError, ValueError, IndexError):
            # The model does not take a floating input of this shape (token ids, say): the chain is built
            # from the first real training batch instead, and a real mismatch is reported there.
            state.chain = None
    _install(model, state)
    return wrapper


def apply_with_chain(model: nn.Module, plan: Plan, *, key: PlanKey, chain: StageChain,
                     cache_dir: Path | None = None) -> nn.Module:
    """``apply`` for a caller that already traced the model for its key and built its chain from that trace
    (``remat.client.checkpoint``): the same checks against ``key.model_hash``, no second trace. ``cache_dir``:
    the plan cache directory the caller used, where exports at other sizes go too (NOTE [ other sizes ])."""
    if not isinstance(plan, Plan):
        raise PlanError(f"apply: expected a remat.client.plan.Plan, got {type(plan).__name__}")
    remove(model)
    planned_for = _plan_key(plan, None)
    if planned_for is not None:
        _check_key(plan, planned_for, key.model_hash)
        differs = planned_for.describe_mismatch(key)
        if differs:
            raise _mismatch(plan, f"{differs} (plan vs this model and input)")
    state = _Applied(plan=plan, key=key, strict=True, chain=chain, graph_cache=cache_dir)
    if plan.is_graph_plan:  # the op graph, from the caller's trace
        _build(state, model, example_for(key, model), graph=chain.graph_module)
    _check_stages(state)
    _install(model, state)
    return model


def _check_key(plan: Plan, key: PlanKey, model_hash: str) -> None:
    """What can be checked before the first training call: mode, torch version, architecture."""
    if key.mode != "train":
        raise _mismatch(plan, f"mode: plan {key.mode} vs train (checkpointing only matters in training)")
    if key.torch_version != current_torch_version():
        raise _mismatch(plan, f"torch_version: plan {key.torch_version} vs installed {current_torch_version()}")
    if model_hash != key.model_hash:
        raise _mismatch(
            plan, f"model_hash: plan {key.model_hash[:12]}… vs model {model_hash[:12]}… (another architecture)"
        )


def _install(model: nn.Module, state: _Applied) -> None:
    model.__dict__[_STATE] = state
    model.__dict__["forward"] = _PlanForward(model)


def remove(model: nn.Module) -> nn.Module:
    """Undo ``apply``: the model runs its class's forward again. A model without a plan is returned as is."""
    if _STATE in model.__dict__:
        del model.__dict__[_STATE]
        model.__dict__.pop("forward", None)
    return model


def applied_plan(model: nn.Module) -> Plan | None:
    """The plan applied to ``model``, or None."""
    state = model.__dict__.get(_STATE)
    return state.plan if state is not None else None


def applied_chain(model: nn.Module) -> StageChain | OpGraph | None:
    """The stage chain ``apply`` runs, or the op graph for a graph plan (None before it is built: without a
    key, at the first train call)."""
    state = model.__dict__.get(_STATE)
    return state.chain if state is not None else None
