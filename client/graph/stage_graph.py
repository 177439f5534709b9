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
    with preserved_state(model, devices=[x.device]): ...   # restores buffers (BN stats) and RNG on exit
    brute_force_cut_vertices(chain)    # -> list[str]; O(V·E) reference for chain.cut_vertices (tests)

How the chain is found (docs/apply.md, "How it works"; the reason for each step is given with it):

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

Where each part lives: ``fx_trace`` (the tracer, ``trace_model``, the train/eval mode context),
``write_probe`` (the recording probe run, ``preserved_state``), ``boundaries`` (cut vertices, in-place
safety, ``brute_force_cut_vertices``), ``stage_chain`` (``StageChain``, checkpointed runs, the BN and RNG
notes). This module builds the chain from those and re-exports the public API above.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn

from remat.client.errors import ModelError
from remat.client.graph.boundaries import (
    INPUT,
    OUTPUT,
    SOURCE,
    brute_force_cut_vertices,
    cut_vertices,
    on_path_edges,
    parked_gaps,
    reachable,
    safe_boundaries,
)
from remat.client.graph.fx_trace import one_line, trace_model, training_mode
from remat.client.graph.stage_chain import ChainStage, ChildrenStage, StageChain
from remat.client.graph.write_probe import (
    ProbeFacts,
    RecordingInterpreter,
    WriteRecorder,
    buffer_owners,
    preserved_state,
    running_stat_slots,
    untouched,
)

if TYPE_CHECKING:
    from remat.client.graph.model_call import ModelCall

__all__ = [
    "StageChain",
    "brute_force_cut_vertices",
    "build_stage_chain",
    "preserved_state",
    "trace_model",
]


# ----------------------------------------------------------------------------------------------------------
# Building from an fx graph
# ----------------------------------------------------------------------------------------------------------


def module_path(n: torch.fx.Node) -> str:
    if n.op == "call_module":
        return str(n.target)
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return ""
    key = next(reversed(stack))
    value = stack[key]
    # torch.export keys the stack by a tracing name (``L__self__h.0``) and keeps the module's path in the value.
    return value[0] if isinstance(value, tuple) and value and isinstance(value[0], str) else str(key)


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
    paths = [module_path(n) for n in compute]
    prefix = _common_prefix(paths)
    if prefix and prefix in paths and prefix not in used:
        return prefix

    def label(n: torch.fx.Node) -> str:
        return module_path(n) or n.name

    first, last = label(compute[0]), label(compute[-1])
    return first if first == last else f"{first}..{last}"


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out


def module_lists(model: nn.Module) -> dict[str, dict[str, int]]:
    """The model's containers of repeated blocks (``nn.ModuleList``, ``nn.ModuleDict``): qualified name ->
    {child name: its position}. DenseNet's dense blocks are ``ModuleDict``s."""
    return {name: {key: i for i, key in enumerate(m.keys() if isinstance(m, nn.ModuleDict) else
                                                  (str(j) for j in range(len(m))))}
            for name, m in model.named_modules() if isinstance(m, nn.ModuleList | nn.ModuleDict)}


def block_of(n: torch.fx.Node, lists: dict[str, dict[str, int]]) -> tuple[str, int] | None:
    """The repeated block whose code produced node ``n``: (its container, its position there)."""
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return None
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else str(value)
        parent, _, key = str(path).rpartition(".")
        if parent in lists and key in lists[parent]:
            return parent, lists[parent][key]
    return None


def side_values(nodes: list[torch.fx.Node], lists: dict[str, dict[str, int]], has_tensor: dict[str, bool]) -> set[str]:
    """Tensors that every repeated block reads again besides the one they hand each other: attention masks,
    position biases, an encoder's output read by every decoder block, a dense block's features.

    NOTE [side values] A transformer's blocks are called in a loop with keyword arguments computed once
    before it (masks, rotary tables) or by the first block (T5's position bias); every block reads them.
    Their edges jump over every block, so a graph cut would find no boundary between blocks at all. So they
    are handed to every stage that reads them (a checkpointed segment keeps them as an input, not as
    something it saves, and returns those it makes) and priced as the trace's side values
    (docs/cost-model.md, "Side values").
    A value is one when, in some container of blocks (``nn.ModuleList``, ``nn.ModuleDict``), two or more
    blocks read it: every block after the first, for what the first made (T5's position bias), or every
    block, for what comes from outside the container. In a *dense* container, one where something the first
    block made is such a value, so is what a later block makes and two or more blocks read, every block
    after it: today's torchvision DenseNet, whose every layer reads the list of all earlier features (a
    ``ModuleDict`` of layers), so that a dense block is cut after every layer, its features kept as side
    values, as the older definition that returns the running concatenation is cut at one tensor
    (docs/benchmarks.md, "Feng & Huang's own code"). A cell output that the next two cells read (DARTS-like
    networks) is not: it is an ordinary activation, freed when they are done.
    """
    if not lists:
        return set()
    readers_of: dict[str, tuple[tuple[str, int] | None, dict[str, set[int]]]] = {}
    for n in nodes:
        if n.op in ("placeholder", "get_attr", "output") or not has_tensor.get(n.name, False):
            continue
        own = block_of(n, lists)
        readers: dict[str, set[int]] = {}
        for u in n.users:
            block = block_of(u, lists)
            if block is not None and block != own:
                readers.setdefault(block[0], set()).add(block[1])
        readers_of[n.name] = (own, readers)

    def read_by_all_later(own: tuple[str, int] | None, parent: str, indices: set[int]) -> bool:
        first = own[1] + 1 if own is not None and own[0] == parent else 0
        # Two readers at least: with two blocks, what the first hands the second is its hidden state.
        return len(indices) >= 2 and indices >= set(range(first, len(lists[parent])))

    out: set[str] = set()
    dense: set[str] = set()
    for name, (own, readers) in readers_of.items():
        for parent, indices in readers.items():
            if (own is None or own[0] != parent or own[1] == 0) and read_by_all_later(own, parent, indices):
                out.add(name)
                if own is not None and own[0] == parent:
                    dense.add(parent)
    for name, (own, readers) in readers_of.items():
        if own is not None and own[0] in dense and own[1] > 0 and own[0] in readers \
                and read_by_all_later(own, own[0], readers[own[0]]):
            out.add(name)
    return out


def _flat_inputs(gm: torch.fx.GraphModule, example: torch.Tensor | ModelCall) -> list[Any]:
    """The values of ``gm``'s placeholders for ``example``: the tensor (and the defaults of the forward's other
    parameters, which an fx trace keeps as placeholders: ``fx_trace.call_defaults``), or the call's flat pytree
    leaves."""
    if gm.meta.get("remat_tracer") != "export":
        tensor = example if isinstance(example, torch.Tensor) else (
            example.single_tensor if example.single_tensor is not None else example.main)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        return [tensor, *(n.args[0] for n in placeholders[1:] if n.args)]
    if isinstance(example, torch.Tensor):  # a one-tensor model fx could not follow, exported
        return [example]
    leaves, spec = pytree.tree_flatten((tuple(example.args), dict(example.kwargs)))
    in_spec = gm.meta["remat_pytree"][0]
    if spec != in_spec:
        raise ModelError("the call's inputs are not those the model was traced with")
    return leaves


# NOTE [ token ids are held ]
# A call's inputs other than the main one (masks, labels) are held by the caller for the whole step and handed
# to every stage that reads them, so their edges never decide a boundary. The main input used to be the one
# exception: an edge from it to a late node jumps over every block. Token ids are read late by every decoder
# classifier (``…ForSequenceClassification`` pools each row's last token that is not padding, from
# ``input_ids != pad``): with that edge deciding, GPT-2's whole transformer was one stage and no plan could
# checkpoint anything. Ids are held by the caller like the other inputs and never differentiated, so a main
# input that is not floating point is handed the same way (``StageChain.main_handed``). A floating main input
# (an image) still decides: its late readers (a global skip) would change the chains plans are stored for.


def _held_views(nodes: list[torch.fx.Node], held: set[str], node_name: Callable[[torch.fx.Node], str]) -> set[str]:
    """``held`` and the views of held inputs: an op whose schema says its output aliases its input (``view``,
    ``unsqueeze``, ``expand``…) on a value the caller holds makes a tensor whose storage the caller holds too,
    so handing it to later stages keeps nothing alive (CLIP pools its text tower at the end of token ids it
    reshaped at the start). Exported graphs only: their targets are aten overloads with schemas."""
    out = set(held)
    for n in nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        returns = n.target._schema.returns
        first = n.args[0] if n.args else None
        if (len(returns) == 1 and returns[0].alias_info is not None and not returns[0].alias_info.is_write
                and isinstance(first, torch.fx.Node) and node_name(first) in out):
            out.add(n.name)
    return out


def _boundaries(model: nn.Module, nodes: list[torch.fx.Node], main: torch.fx.Node, tensor_at: list[int],
                has_tensor: Mapping[str, bool], is_tensor: Mapping[str, bool], hits: list[tuple[str, str]],
                main_handed: bool = False, floating: frozenset[str] = frozenset()
                ) -> tuple[list[str], list[str], list[str], dict[str, list[str]]]:
    """(cut vertices, safe boundaries, cut vertices dropped as unsafe, on-path tensor edges) of a traced graph.

    Paths start at every tensor input. Inputs besides the main one (masks, labels) are held by the caller for
    the whole step and side values (NOTE [side values]) by every stage that reads them: their edges never
    decide a boundary, nor do the main input's when it is handed too (NOTE [ token ids are held ]), nor a view
    of such an input (``_held_views``). A boundary is on the paths of the main input or of another
    floating-point input (CLIP's pixels, whose tower runs before the text tower of its token ids; not a mask's)
    and carries one tensor (a cut
    vertex whose value is a tuple, shufflenet's channel split, is none: the nodes that unpack it stay in its
    stage).
    """
    placeholders = [n for n in nodes if n.op == "placeholder"]

    def node_name(n: torch.fx.Node) -> str:
        return INPUT if n is main else OUTPUT if n.op == "output" else n.name

    others = {n.name for n in placeholders if n is not main}
    order = [SOURCE, *(node_name(n) for n in nodes)]
    edges: dict[str, list[str]] = {SOURCE: [node_name(placeholders[i]) for i in tensor_at]}
    for n in nodes:
        if n.op != "output" and has_tensor.get(n.name, False):
            edges[node_name(n)] = [node_name(u) for u in n.users]
    path_edges = on_path_edges(order, edges, SOURCE, OUTPUT)
    lists = module_lists(model)
    side = side_values(nodes, lists, dict(has_tensor)) & set(path_edges)
    held = _held_views(nodes, others | ({INPUT} if main_handed else set()), node_name)
    jump_edges = {u: vs for u, vs in path_edges.items() if u not in side and u not in held and u != SOURCE}
    from_main = reachable(path_edges, INPUT)
    for name in floating - {main.name}:
        from_main |= reachable(path_edges, name)
    candidates = {c for c in from_main if c not in (INPUT, OUTPUT) and c not in side and is_tensor.get(c, False)}
    bits = {node_name(n): 1 << i for i, n in enumerate(placeholders)}
    blocks = {n.name: b for n in nodes if (b := block_of(n, lists)) is not None}
    gaps = parked_gaps(order, path_edges, jump_edges, bits, candidates, blocks)
    # A parked value is no boundary: it is handed past its stretch, as a side value (NOTE [ parked values ]).
    cuts = [c for c in cut_vertices(order, jump_edges, SOURCE, OUTPUT, gaps)
            if c != INPUT and c in from_main and is_tensor.get(c, False) and c not in gaps]
    path_edges = {u: vs for u, vs in path_edges.items() if u != SOURCE}
    bounds, unsafe = safe_boundaries([n.name for n in nodes], cuts, hits, path_edges)
    return cuts, bounds, unsafe, path_edges


def _build_from_fx(
    model: nn.Module, gm: torch.fx.GraphModule, example: torch.Tensor | ModelCall, train: bool,
    facts: ProbeFacts | None = None, check: bool = True
) -> StageChain:
    graph = gm.graph
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    flat = _flat_inputs(gm, example)
    if len(placeholders) != len(flat):
        raise ModelError(f"{type(model).__name__}.forward takes {len(placeholders)} inputs; the example gives "
                         f"{len(flat)}: pass every input of one training call (remat.client.checkpoint(model, "
                         f"*args, **kwargs))")
    tensor_at = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
    if not tensor_at:
        raise ModelError(f"{type(model).__name__}: the example passes no tensor")
    main, main_value = placeholders[tensor_at[0]], flat[tensor_at[0]]
    main_handed = not (main_value.is_floating_point() or main_value.is_complex())
    extra_inputs = {n.name: v for n, v in zip(placeholders, flat, strict=True) if n is not main or main_handed}
    device = main_value.device

    small_values: dict[str, Any] = {}
    if facts is not None and facts.fits(model, gm):
        probed = False
        has_tensor, is_tensor, hits = facts.has_tensor, facts.is_tensor, list(facts.hits)
        buffer_writes = facts.buffer_slots(model, gm)
    else:
        probed = True
        with training_mode(model, train), untouched(model, device):
            recorder = WriteRecorder(buffer_owners(model, gm))
            interp = RecordingInterpreter(gm, recorder)
            with recorder:
                interp.run(*flat)
        facts = ProbeFacts.recorded(model, gm, interp.has_tensor, interp.is_tensor, recorder)
        has_tensor, is_tensor, hits = interp.has_tensor, interp.is_tensor, recorder.hits
        buffer_writes = recorder.buffer_writes
        small_values = interp.small_values

    floating = frozenset(n.name for n, v in zip(placeholders, flat, strict=True)
                         if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()))
    cuts, bounds, unsafe, path_edges = _boundaries(model, nodes, main, tensor_at, has_tensor, is_tensor, hits,
                                                   main_handed, floating)

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

    # The last stage that uses each value computed in an earlier stage; the main input counts as stage 1's
    # value (a later `x.shape` reads it from there) unless it is handed; the other inputs are handed to every
    # stage that reads them.
    def handed(u: torch.fx.Node) -> bool:
        return u.op == "placeholder" and (u is not main or main_handed)

    last_use: dict[str, int] = {}
    for n in nodes:
        for u in n.all_input_nodes:
            if u.op != "get_attr" and not handed(u) and stage_of[u.name] < stage_of[n.name]:
                last_use[u.name] = max(last_use.get(u.name, 0), stage_of[n.name])

    stages: list[ChainStage] = []
    incoming = main
    for idx, stage_nodes in enumerate(members, start=1):
        g = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {incoming: g.placeholder("x")}
        inputs: list[tuple[str, str]] = []
        # Extra inputs first: placeholders must precede every other node.
        for n in stage_nodes:
            for u in n.all_input_nodes:
                if u not in env and (u.op == "get_attr" or handed(u) or stage_of[u.name] < idx):
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
        slots = running_stat_slots(called)
        for n in stage_nodes:
            slots += buffer_writes.get(n.name, [])
        stages.append(
            ChainStage(
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

    chain = StageChain(
        model=model,
        source="fx",
        graph_module=gm,
        _stages=stages,
        boundaries=bounds,
        cut_vertices=cuts,
        dropped=unsafe,
        _edges=path_edges,
        _root=gm,
        _example_values={k: v for k, v in small_values.items() if k in last_use},
        train=train,
        probe_facts=facts,
        probed=probed,
        main_input=main.name,
        main_handed=main_handed,
        input_names=tuple(n.name for n in placeholders),
        side_values=tuple(n.name for n in nodes if n.name in last_use and n.name not in bound_set
                          and n.op != "placeholder" and has_tensor.get(n.name, False)),
        pytree_specs=gm.meta.get("remat_pytree"),
        _extra_inputs=extra_inputs,
    )
    if check and probed and train and gm.meta.get("remat_tracer") == "export":
        from remat.client.graph.fidelity import check_export_fidelity
        from remat.client.graph.model_call import ModelCall

        call = example if isinstance(example, ModelCall) else ModelCall(args=(example,), kwargs={})
        check_export_fidelity(model, chain, call, train=train)
    return chain


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

    with training_mode(model, train), untouched(model, example):
        recorder = WriteRecorder(buffer_owners(model))

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
            raise ModelError(f"running it on the example input failed: {one_line(exc)}") from exc
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

    order = [INPUT, *names, OUTPUT]
    edges = {u: [v] for u, v in zip(order[:-1], order[1:], strict=False)}
    bounds, unsafe = safe_boundaries(order, list(names), recorder.hits, edges)
    modules = dict(children)
    groups: list[list[str]] = [[]]
    for name in names:
        groups[-1].append(name)
        if name in bounds:
            groups.append([])
    stages = []
    for group in groups:
        mods = [modules[n] for n in group]
        slots = running_stat_slots(mods) + [s for n in group for s in recorder.buffer_writes.get(n, [])]
        stages.append(
            ChainStage(
                module=ChildrenStage(mods),
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

def build_stage_chain(model: nn.Module, example_input: torch.Tensor | ModelCall, *, train: bool = True,
                      graph: torch.fx.GraphModule | None = None, facts: ProbeFacts | None = None,
                      check: bool = True) -> StageChain:
    """Cut ``model`` into a chain of stages for checkpointing; raise ``ModelError`` if it cannot be.

    Args:
        model: the model; it is not modified (its buffers and the RNG are restored after the probe run).
        example_input: one input batch, or one training call's inputs (``ModelCall``: several tensors,
            keywords, constants). Values do not matter, shapes, dtypes and devices do: the probe run records
            which nodes carry tensors and which write in place.
        train: trace and probe in train mode (True, what checkpointing needs) or eval mode. Graphs differ
            between modes (aux heads), so a chain belongs to one mode.
        graph: ``trace_model(model, train=train, call=...)`` when the caller already has it (the key's hash
            needs the same trace): tracing runs the model's Python once more for nothing otherwise.
        facts: an earlier probe's ``chain.probe_facts`` for the same plan key (from the plan cache): the chain
            is cut from them without running the model, when they name exactly this graph's nodes and this
            model's buffers; otherwise the probe runs as without them. Such a chain has ``probed`` False.
        check: run the export-fidelity check (``fidelity.check_export_fidelity``: an eager and a chain training
            step, both without checkpoints) on a chain cut from an exported graph. False only for another size
            of a call kind already checked (NOTE [ other sizes ] in remat.client.apply_plan).

    Returns:
        The chain; its stages share the model's submodules, parameters and buffers.
    """
    from remat.client.graph.model_call import ModelCall

    if isinstance(example_input, ModelCall):
        call: ModelCall | None = example_input
        single = example_input.single_tensor
    elif isinstance(example_input, torch.Tensor):
        # A one-tensor call (its signature "", so keys stay those of a bare tensor): a model fx cannot follow is
        # exported, as checkpoint() exports it (timm's CrossViT), before its top-level children are tried.
        call, single = ModelCall(args=(example_input,), kwargs={}), example_input
    else:
        raise ModelError(f"example_input must be a tensor or a ModelCall, got {type(example_input).__name__}")
    run_error = None
    try:
        gm = graph if graph is not None else trace_model(model, train=train, call=call)
        return _build_from_fx(model, gm, example_input, train, facts, check)
    except ModelError as exc:
        fx_reason = str(exc)
    except Exception as exc:  # noqa: BLE001 - a traced graph that cannot run is as unusable as no graph
        run_error = one_line(exc)
        fx_reason = f"the traced graph does not run: {run_error}"
    if single is None:  # no fallback for a call of several inputs: the reason is the export's or the model's
        name = type(model).__name__
        raise ModelError(fx_reason if name in fx_reason else f"cannot cut {name} into stages: {fx_reason}") from None
    try:
        return _build_from_children(model, single, train)
    except ModelError as exc:
        if run_error is not None and run_error in str(exc):  # the model itself refuses this input
            raise ModelError(f"{type(model).__name__} does not run on input {list(single.shape)}: "
                             f"{run_error}") from None
        raise ModelError(
            f"cannot cut {type(model).__name__} into stages: {fx_reason}; "
            f"and its top-level children do not form a chain: {exc}"
        ) from None
