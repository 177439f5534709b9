"""Tracing a model for remat: torch.fx for a single-tensor call, torch.export for any other call.

``trace_model`` is the one tracer behind both the stage chain (``stage_graph``) and the architecture hash
(``hashing``). ``StochasticDepth`` stays a leaf so its train/eval switch is not baked into the graph; the
trace runs in the requested mode, which is restored on every submodule afterwards.

A call of several inputs, keywords or constants (``remat.client.graph.model_call.ModelCall``) — every Hugging
Face model — is traced with ``torch.export`` (``strict=False``): fx's symbolic tracer cannot follow their
forwards (``co_varnames is too small`` on Llama), while export runs the Python code on fake tensors and keeps
aten ops. The exported graph, with its parameters looked up on the live model by their qualified names,
computes losses and gradients bit-equal to the eager model's, dropout included (same random ops, same
order: tests/client/graph/test_export_chain.py). Its placeholders are the call's flat pytree leaves (constants
included) and its output the flat leaves of the model's output; ``meta["remat_pytree"]`` keeps both specs.
A single-tensor model fx cannot trace is exported too, when the caller gives the call.

Exporting takes seconds (GPT-2: about 1.8 s in a fresh process), so each exported graph is kept on disk beside
the plan cache and rebuilt from there the next time the same model is traced for the same call
(``export_cache``: the file is JSON, keyed without tracing; a file that does not rebuild is ignored).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch import nn

from remat.client.errors import ModelError

if TYPE_CHECKING:
    from remat.client.graph.model_call import ModelCall

__all__ = ["ANY_SIZES_GUARDS", "export_any_sizes", "sizes_refused", "trace_model"]


def _extra_leaves() -> tuple[type[nn.Module], ...]:
    """Module types that must stay opaque to the tracer. torchvision is optional and slow to import; a
    model containing ``StochasticDepth`` has necessarily imported it already, so look it up lazily."""
    module = sys.modules.get("torchvision.ops.stochastic_depth")
    return (module.StochasticDepth,) if module is not None else ()


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
def training_mode(model: nn.Module, train: bool) -> Iterator[None]:
    """Put every submodule in ``train`` mode and restore each module's own flag afterwards."""
    flags = [(m, m.training) for m in model.modules()]
    model.train(train)
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def trace_model(model: nn.Module, *, train: bool = True, call: ModelCall | None = None,
                cache_dir: Path | None = None) -> torch.fx.GraphModule:
    """Trace ``model`` in the given mode; raise ``ModelError`` if it cannot be traced.

    A single-tensor call (or none given) is traced with torch.fx, on a shallow copy of the model as root: the
    copy shares the parameter, buffer and submodule dictionaries (so every ``get_attr`` resolves to the live
    tensors) while the tracer's own bookkeeping attributes (``_tensor_constant0``…) land on the copy instead
    of the user's model. Any other call, or a single-tensor model fx cannot follow, is exported (module
    docstring); ``meta["remat_tracer"]`` says which.
    """
    if call is None or call.single_tensor is not None:
        try:
            return _fx_trace(model, train)
        except ModelError:
            if call is None:
                raise
    return export_model(model, call, train=train, cache_dir=cache_dir)


def call_defaults(model: nn.Module) -> dict[str, Any]:
    """The parameters of ``model.forward`` after its first that have defaults, with them: what a call with one
    tensor leaves to the model (timm's ViT: ``attn_mask=None``, ``is_causal=False``).

    fx traces such a parameter as a proxy, on which the forward's ``if attn_mask is not None`` takes the branch
    no one-tensor call takes. Traced as ``concrete_args`` they hold their defaults: the graph keeps each as a
    placeholder with that default (and an assertion of it), which the chain is handed as a constant input.
    """
    import inspect

    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a signature: traced as it is
        return {}
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name: p.default for p in parameters[1:] if p.kind in kinds and p.default is not inspect.Parameter.empty}


def _fx_trace(model: nn.Module, train: bool) -> torch.fx.GraphModule:
    root = copy.copy(model)
    with training_mode(model, train):
        root.training = train
        try:
            graph = _Tracer().trace(root, concrete_args=call_defaults(model) or None)
        except Exception as exc:  # noqa: BLE001 - any failure of user code under tracing means "not traceable"
            raise ModelError(f"torch.fx cannot trace {type(model).__name__}: {one_line(exc)}") from exc
    gm = torch.fx.GraphModule(root, graph, class_name=type(model).__name__)
    gm.meta["remat_train"] = train  # hashing.architecture_hash only reuses train-mode traces
    gm.meta["remat_tracer"] = "fx"
    return gm


@contextlib.contextmanager
def _library_eager_paths(call: ModelCall, mask_skips: tuple[bool, ...] = ()) -> Iterator[None]:
    """Let libraries take, while remat exports, the code path their eager forward takes for this call (a change
    here changes exported graphs: bump ``export_cache.EXPORT_RECIPE``).

    transformers picks, while exporting, a graph valid for every later input; eagerly it looks at the call.
    Two such choices decide its attention mask, and with them the kernel and the last bits of every gradient
    (Llama without an attention mask: refused by ``fidelity`` until they were given their eager answers):

    - ``find_packed_sequence_indices``: eagerly, position ids that count up from zero mean one sequence per
      row (no packing); exported, it must assume packing. When the call passes no ``position_ids`` the model
      makes them from the length (an arange): not packed, for every call of this signature.
    - ``_ignore_causal_mask_sdpa`` and ``_ignore_bidirectional_mask_sdpa``: eagerly, a mask without padding
      (or none) at equal query and key lengths is left out (SDPA's ``is_causal``, or no mask); exported,
      never. Without a mask in the call the eager answer holds for every call of this signature; with one it
      depends on the mask's values, and the export takes ``mask_skips`` (NOTE [ masks without padding ] in
      remat.client.graph.mask_skips).

    With position ids passed as tensors, whose values export cannot see, the exporting answer stands, as for
    every other library branch; a plan's graph runs only calls of its own signature.
    """
    from remat.client.graph.mask_skips import export_skips

    module = sys.modules.get("transformers.masking_utils")
    if module is None:
        yield
        return
    original_packed = getattr(module, "find_packed_sequence_indices", None)
    given = set(call.kwargs)

    def eager_packed(position_ids: Any) -> Any:
        if "position_ids" in given:
            return original_packed(position_ids)  # type: ignore[misc]
        return None

    if original_packed is not None:
        module.find_packed_sequence_indices = eager_packed
    try:
        with export_skips(mask_skips):
            yield
    finally:
        if original_packed is not None:
            module.find_packed_sequence_indices = original_packed


_EXPORT_NOISE = ("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range")
"""aten ops export adds to check what it assumed (dtypes, shapes); they compute nothing a stage needs."""


def export_model(model: nn.Module, call: ModelCall, *, train: bool = True, cache_dir: Path | None = None,
                 mask_skips: tuple[bool, ...] | None = None) -> torch.fx.GraphModule:
    """``torch.export`` of ``model`` on ``call`` (non-strict), unlifted: parameters and buffers are ``get_attr``
    nodes named by their qualified names in the model, the input guards are dropped (a plan's key checks the
    call's signature instead). Raises ``ModelError`` naming why export failed (data-dependent control flow,
    say): such a model cannot be cut, and is refused rather than half-planned.

    ``mask_skips``: the decisions to take at transformers' mask decision points (NOTE [ masks without padding ]
    in remat.client.graph.mask_skips); None, the eager forward's for this call's values, asked of the
    precondition of a graph exported with other decisions and exported (or read back) again when they differ:
    a call whose masks have no padding costs two exports the first time, and a start that takes the same
    decisions as the last one reads one graph back (``export_cache.load_skips``).

    The graph comes from the disk cache (``export_cache``) when the model and call have been exported before:
    same nodes, names, targets, ``nn_module_stack`` and ``meta`` keys, hence the same architecture hash and
    chain; otherwise it is exported and stored for next time. ``cache_dir``: the plan cache directory the
    caller uses (``checkpoint(cache_dir=...)``), whose ``graphs`` folder holds them; default the user's."""
    from remat.client.graph import export_cache
    from remat.client.graph.mask_skips import MASK_SKIPS, mask_decisions

    keys = export_cache.pre_keys(model, call, train=train)
    directory = export_cache.graphs_in(cache_dir)
    if mask_skips is not None:
        gm, key = _export_cached(model, call, train, cache_dir, mask_skips, keys)
        _attach_hash_graph(gm, model, call, train, cache_dir, key)
        return gm
    # The call's own decisions: asked of a graph's precondition, first of the one exported with the decisions
    # this model and signature took last (one graph read on a start like the last), else of the export that
    # builds every mask. A graph without a precondition builds every mask, as export does.
    flat = call.flat_inputs()
    note = export_cache.load_skips(keys(()), directory=directory) if keys is not None else None
    guess, differ = note if note is not None else ((), None)
    skips = guess
    for _ in range(2):
        gm, key = _export_cached(model, call, train, cache_dir, skips, keys)
        own = mask_decisions(gm, flat)
        if own is None:
            own = tuple(False for _ in gm.meta[MASK_SKIPS])
        if own == gm.meta[MASK_SKIPS]:
            break
        skips, differ = own, None
    else:  # the decisions moved twice: build every mask, which holds for every call
        gm, key = _export_cached(model, call, train, cache_dir, (), keys)
        own = gm.meta[MASK_SKIPS]
    if any(own):
        # NOTE [ one layout for every batch ]: a padded batch runs the plan on a chain that builds its masks,
        # which must be cut into the plan chain's stages. Without the mask a chain may have more (ALBERT and
        # ModernBERT inside their first block, a one-block Llama between its rotary table and the block). Then
        # the plan's graph builds every mask (a batch without padding runs on it too: the same numbers up to
        # rounding), unless that graph does not train like the model on this call, where the plan stays on
        # the skipping graph and a padded batch is refused at its call (it was refused at planning before).
        if differ is None:
            differ = _cut_otherwise(model, call, gm, train, cache_dir, keys)
        if differ:
            gm, key = _export_cached(model, call, train, cache_dir, tuple(False for _ in own), keys)
    if keys is not None and any(own) and note != (own, differ):
        export_cache.store_skips(keys(()), own, differ, directory=directory)  # a padded call leaves it be
    _attach_hash_graph(gm, model, call, train, cache_dir, key)
    return gm


def _cut_otherwise(model: nn.Module, call: ModelCall, gm: torch.fx.GraphModule, train: bool,
                   cache_dir: Path | None, keys: Callable[[tuple[bool, ...]], str] | None) -> bool:
    """Whether the plan's graph for ``call`` must build every mask although ``gm`` skips one (NOTE [ one layout
    for every batch ]): the two are cut into chains of other layouts, and the one that builds the masks trains
    like the model on ``call`` (``fidelity``). Each cut probes the model once without gradients, the check runs
    two steps. A graph that cannot be cut at all leaves the decision to ``build_stage_chain``."""
    from remat.client.graph.fidelity import check_export_fidelity
    from remat.client.graph.mask_skips import MASK_SKIPS
    from remat.client.graph.stage_graph import build_stage_chain

    masked_graph, _ = _export_cached(model, call, train, cache_dir, tuple(False for _ in gm.meta[MASK_SKIPS]), keys)
    example = call.single_tensor if call.single_tensor is not None else call
    try:  # cutting reads a graph, never changes it: the caller cuts ``gm`` again for its own chain
        skipping, masked = (build_stage_chain(model, example, train=train, graph=g, check=False)
                            for g in (gm, masked_graph))
    except ModelError:
        return False
    if skipping.layout() == masked.layout():
        return False
    try:
        check_export_fidelity(model, masked, call, train=train)
    except ModelError:
        return False  # only the skipping graph trains like the model here: a padded batch is refused at its call
    return True


def _export_cached(model: nn.Module, call: ModelCall, train: bool, cache_dir: Path | None,
                   mask_skips: tuple[bool, ...],
                   keys: Callable[[tuple[bool, ...]], str] | None) -> tuple[torch.fx.GraphModule, str | None]:
    """``export_model``'s graph for these mask decisions, from the disk cache or exported and stored; with the
    pre-key it is stored under (None: not cacheable; ``keys``: ``export_cache.pre_keys``)."""
    from remat.client.graph import export_cache
    from remat.client.graph.mask_skips import split_precondition

    key = keys(mask_skips) if keys is not None else None
    directory = export_cache.graphs_in(cache_dir)
    if key is not None:
        cached = export_cache.load_graph(model, key, train=train, directory=directory)
        if cached is not None:
            split_precondition(cached, mask_skips)
            return cached, key
    gm = _exported(model, call, train, mask_skips=mask_skips)
    _finish_export(gm, train)
    if key is not None:
        export_cache.store_graph(model, gm, key, directory=directory)  # markers and all: split once loaded
    split_precondition(gm, mask_skips)
    return gm, key


def _exported(model: nn.Module, call: ModelCall, train: bool, dynamic_shapes: dict[str, Any] | None = None,
              *, what: str = "", mask_skips: tuple[bool, ...] = ()) -> torch.fx.GraphModule:
    """``torch.export`` (non-strict) of ``model`` on ``call`` in ``train`` mode, with the libraries' eager paths
    for this call and ``mask_skips`` (``_library_eager_paths``), unlifted; ``ModelError`` naming why it failed
    (``what`` says which export)."""
    import warnings

    distinct = call.unaliased()  # NOTE [ inputs that alias ] in remat.client.graph.model_call
    with training_mode(model, train), warnings.catch_warnings(), _library_eager_paths(call, mask_skips):
        warnings.simplefilter("ignore")
        try:
            program = torch.export.export(model, tuple(distinct.args), dict(distinct.kwargs),
                                          dynamic_shapes=dynamic_shapes, strict=False)
            gm = program.module()
        except Exception as exc:  # noqa: BLE001 - export failing on user code means "cannot be traced"
            if call.kwargs.get("use_cache") is True and "cache_utils" in str(exc):
                raise ModelError(f"{type(model).__name__} called with use_cache=True returns its key/value cache, "
                                 f"which torch.export cannot trace, and a training step never reads: pass "
                                 f"use_cache=False") from exc
            raise ModelError(f"torch.export cannot trace {type(model).__name__}{what}: {one_line(exc)}"
                             f"{_where(exc)}") from exc
    if dynamic_shapes is not None:
        gm.meta[_GUARD_CODE] = _guard_code(program, gm)
    return gm


_GUARD_CODE = "remat_guard_code"
"""``meta`` entry of a fresh export for any sizes, until ``export_any_sizes`` reads it: ``_guard_code``'s answer."""


def _guard_code(program: torch.export.ExportedProgram, gm: torch.fx.GraphModule) -> tuple[list[str], list[str]] | None:
    """The guard expressions of export's guards module for ``gm`` (``program.module()``), with each input written
    ``args[i]`` (its flat index), and the inputs' labels; None when they cannot be read. torch assembles them
    as text and ``exec``s them into the module (torch.export._unlift, ``_unlift_exported_program_lifted_states``);
    they are read here the same way, from the same private helpers, to be stored as data and asked without
    ``exec`` (remat.client.graph.size_guards, which checks the reading against the module before a graph is
    stored)."""
    import inspect
    import logging

    import torch.utils._pytree as pytree

    try:
        from torch.export import _unlift

        signature = inspect.signature(gm.forward)
        paths = _unlift._get_input_paths(program.example_inputs, signature)
        placeholders = gm.graph.find_nodes(op="placeholder")
        code = list(_unlift._get_input_guards_for_graph(placeholders, program.range_constraints, paths))
        own = _unlift._force_ep_signature_match(program._guards_code, paths)
        code.extend(_unlift._force_gm_signature_match(own, signature))
        sources = sorted(((f"L{pytree.keystr(path)}", index) for index, path in enumerate(paths)),
                         key=lambda item: -len(item[0]))  # L['x'][10] before L['x'][1]
        guards = []
        for text in code:
            for source, index in sources:
                text = text.replace(source, f"args[{index}]")
            guards.append(text)
        labels = [path[0].key + pytree.keystr(path[1:]) for path in paths]
    except Exception as exc:  # noqa: BLE001 - private helpers of another torch: the guards stay in-process only
        logging.getLogger("remat").debug("remat: export's guards not read (%s: %s)", type(exc).__name__, exc)
        return None
    return guards, labels


_LAYERDROP_HINT = ("LayerDrop skips layers at random, a different program at every step: set the configuration's "
                   "layerdrop fields to 0 to plan it")


def _where(exc: BaseException) -> str:
    """Where in the model's own code export failed, as `` at file:line: `code` ``: the innermost frame outside
    torch and remat (export's message names an expression such as ``Eq(u0, 1)``, rarely the line of Python
    that branched on a tensor's value, which is what the user can change). Empty when there is none."""
    import traceback

    skipped = (Path(torch.__file__).parent, Path(__file__).parents[1])
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f.line and not any(Path(f.filename).is_relative_to(root) for root in skipped)]
    if not frames:
        return ""
    frame = frames[-1]
    hint = f"; {_LAYERDROP_HINT}" if "layerdrop" in frame.line.lower() else ""
    return f" at {Path(frame.filename).name}:{frame.lineno}: `{frame.line.strip()}`{hint}"


def _finish_export(gm: torch.fx.GraphModule, train: bool) -> tuple[nn.Module, tuple[int, ...]] | None:
    """Clean an exported module up in place: its input guards and export's checking ops go (they compute
    nothing a stage needs); returns the guards (the module and the flat inputs it reads), None without any."""
    graph = gm.graph
    guards = None
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target) == "_guards_fn":
            if all(arg in placeholders for arg in node.args) and not node.kwargs:
                guards = (gm.get_submodule("_guards_fn"), tuple(placeholders.index(arg) for arg in node.args))
            graph.erase_node(node)
        elif node.op == "call_function" and any(name in str(node.target) for name in _EXPORT_NOISE) and not node.users:
            graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.recompile()
    info = graph._codegen.pytree_info  # type: ignore[attr-defined]
    gm.meta["remat_train"] = train
    gm.meta["remat_tracer"] = "export"
    gm.meta["remat_pytree"] = (info.in_spec, info.out_spec)
    return guards


# NOTE [ any sizes ] An export at one call's sizes writes them into every view, so another size needs another
# export and chain (NOTE [ other sizes ] in remat.client.apply_plan): a second or two per new size, and under a
# collator that pads to each batch's longest sequence that is most batches. ``export_any_sizes`` leaves every
# dimension of every tensor input to export (``Dim.AUTO``): what the code computes from sizes becomes
# ``sym_size`` nodes and shape arithmetic, and what it decides on sizes becomes a guard (``seq_len >= 17``) or,
# where the code needs one value, that value. The guards are kept (``ANY_SIZES_GUARDS``) and asked before each
# call at new sizes, with the sizes export assumed (NOTE [ sizes export assumed ]: no dimension of 1): a call
# they refuse is never run on this graph. The graph is kept on disk for later starts (NOTE [ any sizes on disk ]).
# export keeps full slices
# (``x[:, 0:sys.maxsize]``) that it writes as one ``alias`` at fixed sizes, where it knows them for no-ops; they
# are written so here too, so that both graphs cut into the same stages (two views for one is one more place to
# cut). Checked on the zoo's GPT-2, Llama, BERT and T5 at batch 2 to 4 and 7 to 40 tokens: the same stages as at
# the plan's sizes, losses and gradients bit-equal to the eager model's (tests/client/graph/test_export_any_sizes.py).
#
# NOTE [ any sizes on disk ] The export for any sizes costs 0.6-3.4 s for the allow-listed transformers on a 2-core
# CPU, and under padding to each batch's longest sequence nearly every script pays it at its first batch, at
# every start. So it is kept in ``graphs/`` beside the plan's own graph (remat.client.graph.export_cache) under a
# pre-key that describes each input's number of dimensions but not its sizes: one stored graph serves every
# start, whatever sizes its first batch has. A stored graph is used only for a call its checks hold for; else
# the call is exported again, and the file rewritten. Its checks are data: what export assumed about each
# dimension (``SizeChecks`` in remat.client.graph.size_guards) and export's guard expressions, which torch turns
# into Python source and ``exec``s; read back, they are asked by an interpreter of size arithmetic, never run as
# code. A graph is stored only when that interpreter agrees with export's guards module on the call and on sizes
# around it, and the guards are read from torch's private helpers (``_guard_code``): another torch whose helpers
# differ leaves the graph unstored, never stored with guards of its own making.
ANY_SIZES_KEY = "remat_any_sizes_key"
"""``meta`` entry of a graph from ``export_any_sizes``: the pre-key it is stored under (None: not cacheable), for
its probe facts (``any_sizes_probe_facts``)."""
ANY_SIZES_GUARDS = "remat_any_sizes_guards"
"""``meta`` entry of a fresh graph from ``export_any_sizes``: (export's guard module, the indices of the flat
inputs it reads). Calling it raises on inputs the graph does not hold for. A graph read back from disk has none:
its ``SIZE_CHECKS`` (remat.client.graph.size_guards) ask the same guard expressions."""


def export_any_sizes(model: nn.Module, call: ModelCall, *, train: bool = True, mask_skips: tuple[bool, ...] = (),
                     cache_dir: Path | None = None) -> torch.fx.GraphModule:
    """``torch.export`` of ``model`` on ``call`` with every input dimension left to export (NOTE [ any sizes ]),
    cleaned up like ``export_model``'s graphs, what it assumed about sizes in ``meta[SIZE_CHECKS]`` and, fresh,
    export's guards in ``meta[ANY_SIZES_GUARDS]``. Read back from the disk cache (``cache_dir`` as in
    ``export_model``) when a graph for this model and signature, at any sizes, is stored there and holds for
    ``call``; otherwise exported and stored (NOTE [ any sizes on disk ]). Raises ``ModelError`` when it cannot
    be exported, its inputs cannot be bound to the forward's parameters, or export left no guards to ask."""
    import inspect

    import torch.utils._pytree as pytree

    from remat.client.graph import export_cache
    from remat.client.graph.mask_skips import split_precondition
    from remat.client.graph.size_guards import SIZE_CHECKS, SizeChecks, agrees_with_module

    try:
        bound = inspect.signature(model.forward).bind(*call.args, **call.kwargs).arguments
    except (TypeError, ValueError) as exc:
        raise ModelError(f"the call's inputs do not bind to {type(model).__name__}.forward: {exc}") from None

    keys = export_cache.pre_keys(model, call, train=train, any_sizes=True)
    key = keys(mask_skips) if keys is not None else None
    directory = export_cache.graphs_in(cache_dir)
    if key is not None:
        cached = export_cache.load_graph(model, key, train=train, directory=directory)
        if cached is not None and SIZE_CHECKS in cached.meta and sizes_refused(cached, call.flat_inputs()) is None:
            split_precondition(cached, mask_skips)
            cached.meta[ANY_SIZES_KEY] = key
            return cached

    def dims(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return dict.fromkeys(range(value.dim()), torch.export.Dim.AUTO)
        return None

    dynamic_shapes = {name: pytree.tree_map(dims, value) for name, value in bound.items()}
    gm = _exported(model, call, train, dynamic_shapes, what=" for any sizes", mask_skips=mask_skips)
    _alias_full_slices(gm.graph)
    guards = _finish_export(gm, train)
    if guards is None:
        raise ModelError("torch.export left no input guards to check other sizes against")
    checks = SizeChecks.of_graph(gm, gm.meta.pop(_GUARD_CODE, None))
    gm.meta[ANY_SIZES_GUARDS] = guards
    gm.meta[SIZE_CHECKS] = checks
    stored = None
    if key is not None and checks.guards is not None and agrees_with_module(checks, *guards, call.flat_inputs()):
        stored = export_cache.store_graph(model, gm, key, directory=directory)  # markers and all: split once loaded
    split_precondition(gm, mask_skips)
    gm.meta[ANY_SIZES_KEY] = key if stored is not None else None
    return gm


def any_sizes_probe_facts(gm: torch.fx.GraphModule, cache_dir: Path | None) -> Any:
    """The probe facts (``write_probe.ProbeFacts``) stored beside a graph that ``export_any_sizes`` read back
    from disk, or None (a fresh export, none stored, or a malformed file). ``build_stage_chain`` uses them only
    when they fit the graph and model; a graph for any sizes is cut from one probe whatever the sizes of later
    calls, in one process as across starts."""
    from remat.client.graph import export_cache
    from remat.client.graph.write_probe import ProbeFacts

    key = gm.meta.get(ANY_SIZES_KEY)
    if key is None or ANY_SIZES_GUARDS in gm.meta:
        return None
    data = export_cache.load_probe_facts(key, directory=export_cache.graphs_in(cache_dir))
    return ProbeFacts.from_dict(data) if data is not None else None


def keep_any_sizes_probe_facts(gm: torch.fx.GraphModule, facts: Any, cache_dir: Path | None) -> None:
    """Store ``facts`` (a probe of ``gm``, a graph ``export_any_sizes`` stored) for a later start's cut."""
    from remat.client.graph import export_cache

    key = gm.meta.get(ANY_SIZES_KEY)
    if key is not None and facts is not None:
        export_cache.store_probe_facts(key, facts.to_dict(),
                                       directory=export_cache.graphs_in(cache_dir))


def sizes_refused(gm: torch.fx.GraphModule, flat_inputs: list[Any]) -> str | None:
    """Why a graph from ``export_any_sizes`` does not hold for these flat inputs (one line), None if it does:
    a size outside what export assumed (NOTE [ sizes export assumed ]) or a guard that fails."""
    from remat.client.graph.size_guards import SIZE_CHECKS

    return gm.meta[SIZE_CHECKS].refusal(flat_inputs, *gm.meta.get(ANY_SIZES_GUARDS, ()))


# NOTE [ sizes export assumed ] Export's guards module does not check everything the graph assumes. A dimension
# left to export (``Dim.AUTO``) from an example size of 2 or more becomes a symbol whose range starts at 2: export
# assumes it is never 0 or 1 and takes, without a guard, the branch a size other than 1 takes (``if
# h.shape[0] == 1:`` is False for every call). The guards module accepted batch 1 all the same, and a model that
# branches on a size of 1 then trained the other branch's program, silently. So every input dimension is checked
# against the placeholder's size: a number it must equal, a symbol whose range (``var_to_range``) must hold the
# call's size and which must be the same size wherever it appears (``SizeChecks`` in
# remat.client.graph.size_guards, which keeps them as data so that a graph read back from disk is asked them too).


def _alias_full_slices(graph: torch.fx.Graph) -> None:
    """Replace ``aten.slice.Tensor(x, dim, 0, sys.maxsize[, 1])`` by ``aten.alias(x)``, a chain of them by one,
    as export writes them at fixed sizes (NOTE [ any sizes ])."""
    alias = torch.ops.aten.alias.default
    made: set[torch.fx.Node] = set()
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.slice.Tensor or node.kwargs:
            continue
        args = node.args
        start, end, step = (args[2] if len(args) > 2 else None, args[3] if len(args) > 3 else None,
                            args[4] if len(args) > 4 else 1)
        base = args[0]
        if start not in (0, None) or end not in (sys.maxsize, None) or step != 1 or not isinstance(base, torch.fx.Node):
            continue
        if base in made:
            replacement = base
        else:
            with graph.inserting_before(node):
                replacement = graph.call_function(alias, (base,))
            replacement.meta = dict(node.meta)
            made.add(replacement)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)


HASH_BATCH = 2
"""The batch size whose exported graph names a model called with several inputs (the module docstring of
``hashing``, "Exported graphs"). Two, not one: export specialises a dimension of size 1."""
HASH_SEQ_LEN = 2
"""The sequence length of that graph for a token call (integer ids ``(batch, seq_len)``): export writes the
length into views too, and profiles of one architecture at several lengths form one family as well."""
HASH_GRAPH = "remat_hash_graph"
"""``meta`` entry of an exported graph at another batch size: a function returning the graph the
architecture hash describes (the export at ``HASH_BATCH``), or None when that call cannot be exported."""
ARCHITECTURE_HASH = "remat_architecture_hash"
"""``meta`` entry beside ``HASH_GRAPH``: a function returning the hash itself, read from the graph cache when
an earlier start stored it there (``export_cache.load_hash``), so a hit does not rebuild the second graph."""


def hash_call(model: nn.Module, call: ModelCall) -> ModelCall | None:
    """``call`` at batch ``HASH_BATCH`` and, for a token call, ``HASH_SEQ_LEN`` tokens: the first
    ``HASH_BATCH`` rows of every tensor input whose first dimension is the main input's (the batch), and of a
    token call the first ``HASH_SEQ_LEN`` positions of every dimension past the first that is as long as the
    main input's second (ids, masks, labels, position ids); None when the call is at those sizes already or
    smaller (a size of 1 cannot be told from a broadcast dimension, so such sizes keep their own graph)."""
    import torch.utils._pytree as pytree

    from remat.client.graph.model_call import ModelCall

    main = call.main
    if main.dim() == 0:
        return None
    batch = int(main.shape[0])
    cut_batch = batch > HASH_BATCH
    is_tokens = main.dim() == 2 and not main.is_floating_point() and not main.is_complex()
    seq_len = int(main.shape[1]) if is_tokens else 0
    cut_seq = is_tokens and seq_len > HASH_SEQ_LEN and seq_len != batch
    if not cut_batch and not cut_seq:
        return None

    def cut(t: torch.Tensor) -> torch.Tensor:  # copies: a view would keep the whole batch alive
        small = t
        if t.dim() > 0 and cut_batch and int(t.shape[0]) == batch:
            small = small[:HASH_BATCH]
        if cut_seq:
            for dim in range(1, t.dim()):
                if int(t.shape[dim]) == seq_len:
                    small = small.narrow(dim, 0, HASH_SEQ_LEN)
        return small.clone() if small is not t else t

    args, kwargs = pytree.tree_map_only(torch.Tensor, cut, (call.args, call.kwargs))
    return ModelCall.bind(model, tuple(args), kwargs)  # bound again: its signature names the small sizes


def _attach_hash_graph(gm: torch.fx.GraphModule, model: nn.Module, call: ModelCall, train: bool,
                       cache_dir: Path | None, key: str | None) -> None:
    """Give ``gm`` (exported at the call's batch) the graph its architecture hash describes, exported lazily.

    torch.export writes the batch size into every ``view``/``reshape``/``expand`` of the graph, so a graph's
    own description names one batch size: profiles of one architecture at batch 2 and 4 would have two hashes,
    and no trace could be derived for batch 8 from them (remat.client.derived_trace). The hash describes the
    model's graph at ``HASH_BATCH`` instead, exported (and cached on disk, like any export) only when a hash is
    asked for. Two architectures share a hash only where their graphs at batch 2 are the same."""
    from remat.client.graph.mask_skips import MASK_SKIPS

    small: ModelCall | None = hash_call(model, call)
    if small is None:
        return
    memo: list[torch.fx.GraphModule | None] = []

    def hash_graph() -> torch.fx.GraphModule | None:
        nonlocal small
        if not memo:
            assert small is not None
            try:
                memo.append(export_model(model, small, train=train, cache_dir=cache_dir,
                                         mask_skips=gm.meta.get(MASK_SKIPS, ())))
            except ModelError:
                memo.append(None)  # not exportable at batch 2: the hash describes the graph at hand
            small = None  # the graph outlives the hash (a chain keeps it): it need not keep two rows of inputs
        return memo[0]

    gm.meta[HASH_GRAPH] = hash_graph
    if key is None:
        return  # not cacheable: the hash is computed from the graph each time
    from remat.client.graph import export_cache, hashing

    directory = export_cache.graphs_in(cache_dir)
    known: list[str] = []
    # A stored hash names the small sizes it was computed at: one stored before token calls were cut to
    # HASH_SEQ_LEN (the graph at batch 2 and the call's own length) is not read back.
    cached_as = f"{hashing.ARCH_HASH_FORMAT}; at batch {HASH_BATCH}, {HASH_SEQ_LEN} tokens"

    def architecture_hash() -> str:
        if not known:
            stored = export_cache.load_hash(key, cached_as, directory=directory)
            if stored is None:
                stored = hashing.description_hash(hashing.architecture_description(model, graph=gm))
                export_cache.store_hash(key, cached_as, stored, directory=directory)
            known.append(stored)
        return known[0]

    gm.meta[ARCHITECTURE_HASH] = architecture_hash


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
