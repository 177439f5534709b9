"""The op graph of a model: every tensor it computes as a vertex, for planners that cut inside blocks.

The stage chain (``stage_graph``) can only cut where one tensor separates the whole graph; inside a
ResNet block, a DenseNet dense block or an Inception module it has no boundary. Feng & Huang's planner
(``remat.client.planning.planners.acg``) plans on the whole graph instead, and this module gives it one:

    graph = build_op_graph(model, example_input, train=True)   # -> OpGraph; raises ModelError
    graph.weights       # list[int]: bytes of the new storages vertex v's ops create (its activation)
    graph.edges         # list[(u, v)]: v consumes a tensor u computed; u < v, on input→output paths only
    graph.names         # readable labels (module path of the vertex's first op)
    graph.run(x, dropped=(3, 4, 9))   # the model; dropped vertices re-run under checkpoint in backward
    graph.run_call(call, (3, 4, 9))   # the same for a call of several inputs, its output folded back

A model called with several inputs (``ModelCall``: token ids, labels, masks; an exported graph, NOTE [ an op
graph of a call ]) has every input in vertex 0, the source.

How vertices are formed, from the fx graph and one probe run (no grad, state restored, as for the chain):
- A vertex is a set of fx nodes that produce one group of storages. Nodes that return a storage another
  node created — in-place writers (``out += identity``, ``ReLU(inplace=True)``) and views (``flatten``,
  ``view``) — join that node's vertex, so a vertex is never handed on while a later op rewrites it (the
  chain builder's in-place rule, at op granularity), and keeping a view is keeping its base.
- Nodes whose value holds no tensor (a shape from ``x.size(0)``) join the vertex of the node they read,
  and items unpacked from a tuple join the tuple's vertex; shape values still flow to later vertices but
  are no planning edges (shapes are static for a plan, as in the chain builder). A tuple that only
  gathers existing tensors (a model's auxiliary outputs) is a vertex of weight 0.
- Fusing can close a cycle (a value read by a later op and then rewritten in place); cycles are merged.
- Vertex 0 is the input. The sink is the vertex the output reads, or a virtual vertex of weight 0 when
  the output reads several (GoogLeNet's and Inception v3's auxiliary heads).

Running a plan (``run``): the dropped vertices fall into connected groups; each group runs as one
non-reentrant ``torch.utils.checkpoint`` call that takes every value it reads from outside and returns
every value read outside it, with the BatchNorm restore and RNG preservation of the chain executor
(NOTE [BatchNorm running stats under recompute], NOTE [RNG on recompute] in ``stage_chain``). Groups and
the other nodes run in a topological order that keeps the traced order wherever it can, and random ops
always in the traced order. Gradients are bit-identical to the model's when every group's nodes are
consecutive in the traced order; a group interleaved with kept ops is created earlier than some of them,
so autograd sums the gradient of a tensor both read in another order (equal up to float rounding). A
group that a kept op both reads and feeds (no order can run it in one call), or a plan that would
reorder random ops, is refused with ``PlanError``.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat.client.errors import ModelError, PlanError
from remat.client.graph.boundaries import on_path_edges
from remat.client.graph.fx_trace import trace_model, training_mode
from remat.client.graph.model_call import ModelCall
from remat.client.graph.stage_chain import recompute_contexts
from remat.client.graph.stage_graph import module_path
from remat.client.graph.write_probe import (
    RecordingInterpreter,
    WriteRecorder,
    buffer_owners,
    running_stat_slots,
    storages,
    untouched,
)
from remat.client.planning.graph_predict import call_groups
from remat.client.trace import GraphVertex, TraceGraph

__all__ = ["OpGraph", "build_op_graph"]

_SINK = "<sink>"


class _SeededRecorder(WriteRecorder):
    """The write recorder, also noting which nodes run a random (seeded) op."""

    def __init__(self, buffer_slots: dict) -> None:
        super().__init__(buffer_slots)
        self.seeded: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.current not in (None, "<between>") and torch.Tag.nondeterministic_seeded in func.tags:
            self.seeded.add(self.current)
        return super().__torch_dispatch__(func, types, args, kwargs)


class _StorageInterpreter(RecordingInterpreter):
    """The probe run, also recording which storages each node returns and their sizes."""

    def __init__(self, gm: torch.fx.GraphModule, recorder: WriteRecorder) -> None:
        super().__init__(gm, recorder)
        self.storages: dict[str, list[tuple[int, int]]] = {}
        self._alive: list[Any] = []  # keeps storages alive so ids stay unique for the whole run

    def run_node(self, n: torch.fx.Node) -> Any:
        value = super().run_node(n)
        found = storages(value)
        self._alive += found
        self.storages[n.name] = [(id(s), s.nbytes()) for s in found]
        return value


_CONVEX_REMEMBERED = 1024
"""Vertex sets whose convexity an op graph keeps (then it forgets them all): a search asks about the groups of the
plans around the one it stands on, and remembering every set of 2,000 plans held megabytes for the graph's life."""


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


def _strongly_connected(nodes: list[str], succ: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (graphs reach thousands of vertices)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(succ.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(succ.get(w, ())))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(comp)
    return out


def _topological(units: Sequence[Any], succ: dict[Any, set[Any]], priority: dict[Any, int]) -> list[Any]:
    """Kahn's algorithm, the ready unit of least ``priority`` first; units left out mean a cycle."""
    indeg = dict.fromkeys(units, 0)
    for vs in succ.values():
        for v in vs:
            indeg[v] += 1
    heap = [(priority[u], u) for u in units if indeg[u] == 0]
    heapq.heapify(heap)
    order: list[Any] = []
    while heap:
        _, unit = heapq.heappop(heap)
        order.append(unit)
        for v in succ.get(unit, ()):
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(heap, (priority[v], v))
    return order


@dataclass(eq=False)
class _Group:
    """A connected set of dropped vertices, run as one checkpointed call."""

    nodes: list[torch.fx.Node]
    inputs: list[torch.fx.Node]
    outputs: list[torch.fx.Node]
    slots: tuple[tuple[nn.Module, str], ...]


class _CheckpointedGroup(nn.Module):
    """Runs a group's nodes under non-reentrant checkpoint (plainly without grad mode)."""

    def __init__(self, body: torch.fx.GraphModule, slots: tuple[tuple[nn.Module, str], ...]) -> None:
        super().__init__()
        self.body = body
        self.slots = slots

    def forward(self, *inputs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.body(*inputs)
        return checkpoint(self.body, *inputs, use_reentrant=False, preserve_rng_state=True,
                          context_fn=partial(recompute_contexts, self.slots))


@dataclass(eq=False)
class OpGraph:
    """A model's op graph; see the module docstring."""

    model: nn.Module
    graph_module: torch.fx.GraphModule
    vertex_nodes: list[tuple[str, ...]]
    """fx node names of each vertex, in graph order; vertex 0 holds the input placeholder."""
    names: list[str]
    weights: list[int]
    edges: list[tuple[int, int]]
    virtual_sink: bool
    train: bool
    _slots: dict[str, list[tuple[nn.Module, str]]] = field(repr=False, default_factory=dict)
    _seeded: frozenset[str] = field(repr=False, default=frozenset())
    _executors: dict[tuple[int, ...], torch.fx.GraphModule] = field(repr=False, default_factory=dict)
    _convex_failures: dict[frozenset[int], int | str | None] = field(repr=False, default_factory=dict, init=False)
    """``_convex_failure``'s answers, at most ``_CONVEX_REMEMBERED``."""
    num_inputs: int = 1
    """Graph inputs (placeholders): 1 for a model of one tensor; a call's flat inputs, constants included."""
    pytree_specs: Any = field(default=None, repr=False)
    """(input spec, output spec) of an exported model, as ``StageChain.pytree_specs``; None for fx traces."""

    @property
    def num_vertices(self) -> int:
        return len(self.weights)

    def to_trace_graph(self) -> TraceGraph:
        """The graph as a trace carries it (``remat-trace/1``'s ``graph``): names, bytes and edges only."""
        return TraceGraph(vertices=tuple(GraphVertex(name=name, bytes=w) for name, w in zip(self.names, self.weights,
                                                                                             strict=True)),
                          edges=tuple(self.edges))

    @property
    def sink(self) -> int:
        return self.num_vertices - 1

    def layout(self) -> tuple[tuple[Any, ...], ...]:
        """What each vertex runs (its nodes' ops, in order) and the value edges between vertices. Two op graphs
        of one model exported at other sizes have one layout when export traced the same ops, so a graph plan's
        dropped vertices mean the same recomputation on both (NOTE [ graph plans of a call ] in
        remat.client.apply_plan). Sizes, which an export writes into its views and expands, are arguments, not
        ops: they are left out."""
        by_name = self._node_by_name
        ops = tuple(tuple(str(by_name[name].target) for name in names if name in by_name)
                    for names in self.vertex_nodes)
        return ops, tuple(self.edges)

    def run(self, x: Any, dropped: Sequence[int] = (), *, inputs: Sequence[Any] = ()) -> Any:
        """The model's forward with the ``dropped`` vertices recomputed in backward (see module docstring).

        ``dropped`` names vertices 1..sink-1; () runs the traced graph without checkpointing. ``inputs``: the
        graph's other inputs, in placeholder order, for a call of several (``run_call`` splits a call).
        """
        if len(inputs) + 1 != self.num_inputs:
            raise PlanError(f"this op graph takes {self.num_inputs} inputs, given {len(inputs) + 1}")
        key = tuple(sorted(set(dropped)))
        if len(key) != len(dropped) or any(
            isinstance(v, bool) or not isinstance(v, int) or not 0 < v < self.sink for v in key
        ):
            raise PlanError(f"dropped vertices {list(dropped)} must be distinct vertices in 1..{self.sink - 1}")
        if key not in self._executors:
            self._executors[key] = self._build_executor(key)
        return self._executors[key](x, *inputs)

    __call__ = run

    def split_call(self, call: Any) -> list[Any]:
        """A call's graph inputs in placeholder order (a tensor for a model of one); refused when its
        structure is not the one the graph was exported for."""
        if isinstance(call, torch.Tensor):
            return [call]
        if self.pytree_specs is None:
            return [call.main]
        leaves = call.inputs_for(self.pytree_specs[0])
        if leaves is None or len(leaves) != self.num_inputs:
            raise PlanError("this call's inputs are not those the op graph was built for (names or structure differ)")
        return leaves

    def fold_output(self, flat: Any) -> Any:
        """The model's output from the graph's: an exported model's flat outputs folded back into its
        ``ModelOutput`` (``StageChain.fold_output``)."""
        if self.pytree_specs is None:
            return flat
        return pytree.tree_unflatten(list(flat), self.pytree_specs[1])

    def run_call(self, call: Any, dropped: Sequence[int] = ()) -> Any:
        """``run`` on a whole call (tensor or ``ModelCall``), returning what the model returns."""
        first, *rest = self.split_call(call)
        return self.fold_output(self.run(first, dropped, inputs=rest))

    def dropped_for_chain_plan(self, stage_nodes: Sequence[Sequence[str]], boundaries: Sequence[str],
                               checkpoints: Sequence[int]) -> list[int]:
        """A chain plan's checkpoints (boundaries 1..n-1 of the stage chain cut from the same fx graph) as the
        vertices it drops: every vertex of a checkpointed segment but what the segment returns, which is kept:
        its output, and the side values it makes that later stages read (a dense block's features,
        NOTE [side values] in stage_graph).

        Why: the graph search starts from the chain planners' plans too, so that its answer is never worse
        than the best chain plan under the predictor. Vertices the chain does not name (none, when both come
        from one trace) stay kept.
        """
        vertex_of = self._vertex_of_node
        by_name = self._node_by_name
        n = len(stage_nodes)
        stage_of = {name: i for i, stage in enumerate(stage_nodes, start=1) for name in stage}
        bounds = (0, *sorted(checkpoints), n)
        dropped: set[int] = set()
        for k in range(len(bounds) - 2):  # every segment but the last is checkpointed
            lo, hi = bounds[k] + 1, bounds[k + 1]
            returned = {vertex_of.get(boundaries[hi - 1])}
            for stage in stage_nodes[lo - 1:hi]:
                for name in stage:
                    if name not in vertex_of:
                        continue
                    dropped.add(vertex_of[name])
                    node = by_name.get(name)
                    if node is not None and any(stage_of.get(u.name, 0) > hi for u in node.users):
                        returned.add(vertex_of[name])
            dropped -= returned  # type: ignore[arg-type]
        dropped -= {0, self.sink}
        return sorted(dropped)

    def groups(self, dropped: Sequence[int]) -> list[list[int]]:
        """The connected groups of ``dropped`` vertices (over every value edge), each sorted."""
        return call_groups(dropped, self._vertex_reads)

    def _convex_failure(self, members: Sequence[int]) -> int | str | None:
        """A vertex outside ``members`` that reads them and feeds them (so no order runs them in one call).
        Remembered per vertex set: the graph search asks about the same groups again and again."""
        key = frozenset(members)
        known = self._convex_failures
        if key not in known:
            if len(known) >= _CONVEX_REMEMBERED:
                known.clear()
            known[key] = self._find_convex_failure(members)
        return known[key]

    def _find_convex_failure(self, members: Sequence[int]) -> int | str | None:
        node_vertex, by_name = self._vertex_of_node, self._node_by_name
        inside = {name for v in members for name in self.vertex_nodes[v]}
        frontier = [u for name in inside for u in by_name[name].users if u.name not in inside]
        seen: set[str] = set()
        while frontier:
            u = frontier.pop()
            if u.name in seen:
                continue
            seen.add(u.name)
            for w in u.users:
                if w.name in inside:
                    return node_vertex.get(u.name, u.name)
                frontier.append(w)
        return None

    def check(self, dropped: Sequence[int]) -> None:
        """Raise ``PlanError`` unless every group of ``dropped`` can run as one checkpointed call.

        A group can when no value leaves it and comes back: a kept op that reads the group and feeds it
        would have to run both before and after the call.
        """
        self._check_groups(self.groups(dropped))

    def _check_groups(self, groups: list[list[int]]) -> None:
        for members in groups:
            between = self._convex_failure(members)
            if between is not None:
                raise PlanError(f"dropped vertices {members} are no single checkpointable group: kept "
                                f"vertex {between} reads them and feeds them")

    def calls(self, dropped: Sequence[int]) -> list[list[int]]:
        """The vertices each checkpointed call runs: a group of ``dropped`` vertices plus the kept vertices
        that read nothing dropped but that group (its exit, in Feng & Huang's terms).

        Running the exit's op inside the call is what makes the group's last tensor free: a conv or BN
        that ran outside would save the group's output for its backward and keep it alive. A kept vertex
        reading several groups (a concatenation of dropped branches) runs outside, so that the groups are
        recomputed one at a time; the joins that do this (cat, add) save none of their inputs.
        """
        drop = set(dropped)
        groups = self.groups(dropped)
        self._check_groups(groups)
        group_of = {v: gi for gi, members in enumerate(groups) for v in members}
        readers: dict[int, set[int]] = {}
        for u, v in self._vertex_edges:
            if u in drop and v not in drop and v != 0:
                readers.setdefault(v, set()).add(group_of[u])
        calls = [list(members) for members in groups]
        for v in sorted(readers):
            if len(readers[v]) == 1 and self.vertex_nodes[v]:
                gi = next(iter(readers[v]))
                if self._convex_failure([*calls[gi], v]) is None:
                    calls[gi].append(v)
        return [sorted(c) for c in calls]

    # The graph search (remat.client.planning.graph_predict.search_plan) asks for the groups, calls and run order
    # of up to 2,000 dropped sets; what they read of the fx graph, which never changes once the op graph is cut,
    # is computed once.
    @cached_property
    def _nodes(self) -> list[torch.fx.Node]:
        return list(self.graph_module.graph.nodes)

    @cached_property
    def _node_index(self) -> dict[str, int]:
        return {n.name: i for i, n in enumerate(self._nodes)}

    @cached_property
    def _node_reads(self) -> list[tuple[int, int]]:
        """(i, j) for every node j and every node i it reads, by traced position, in traced order."""
        index = self._node_index
        return [(index[u.name], j) for j, n in enumerate(self._nodes) for u in n.all_input_nodes]

    @cached_property
    def _vertex_edges(self) -> set[tuple[int, int]]:
        """Vertex pairs (u, v) where a node of v reads a value of a node of u (tensors and shapes)."""
        node_vertex = self._vertex_of_node
        out = set()
        for n in self._nodes:
            v = node_vertex.get(n.name)
            if v is None:
                continue
            for u in n.all_input_nodes:
                w = node_vertex.get(u.name)
                if w is not None and w != v:
                    out.add((w, v))
        return out

    @cached_property
    def _vertex_reads(self) -> list[set[int]]:
        """Per vertex, the vertices its nodes read (``_vertex_edges`` by reader)."""
        reads: list[set[int]] = [set() for _ in self.vertex_nodes]
        for w, v in self._vertex_edges:
            reads[v].add(w)
        return reads

    @cached_property
    def _vertex_of_node(self) -> dict[str, int]:
        return {name: v for v, names in enumerate(self.vertex_nodes) for name in names}

    @cached_property
    def _node_by_name(self) -> dict[str, torch.fx.Node]:
        return {n.name: n for n in self._nodes}

    def execution_order(self, dropped: Sequence[int]) -> tuple[list[list[torch.fx.Node]], list[tuple[str, int]]]:
        """How ``run(x, dropped)`` orders the fx nodes: each call's nodes (traced order), and the units in run
        order — ``("g", i)`` for call i, ``("n", k)`` for the k-th traced node alone — topologically sorted,
        ties by first traced position. The executor and the graph predictor both read it.

        Raises:
            PlanError: as :meth:`calls`, when the groups cannot be ordered, or when the order would run random
                ops (dropout) in another order than the model does.
        """
        nodes, index = self._nodes, self._node_index
        unit_of: list[tuple[str, int]] = [("n", i) for i in range(len(nodes))]
        groups: list[list[torch.fx.Node]] = []
        for gi, members in enumerate(self.calls(dropped) if dropped else []):
            at = sorted({index[name] for v in members for name in self.vertex_nodes[v] if name in index})
            for i in at:
                unit_of[i] = ("g", gi)
            groups.append([nodes[i] for i in at])
        first: dict[tuple[str, int], int] = {}
        for i, unit in enumerate(unit_of):
            first.setdefault(unit, i)
        succ: dict[tuple[str, int], set[tuple[str, int]]] = {}
        for i, j in self._node_reads:
            if unit_of[i] != unit_of[j]:
                succ.setdefault(unit_of[i], set()).add(unit_of[j])
        order = _topological(list(first), succ, first)
        if len(order) != len(first):  # check() rules cycles out; kept as a guard
            raise PlanError(f"dropped vertices {list(dropped)} cannot be ordered into checkpointed groups")
        # Random ops must keep their order, or dropout masks differ from the model's (NOTE [RNG on recompute]).
        # Checked here, not only when building the executor, so that a plan search judging dropped sets by
        # this order never picks one the executor refuses.
        seeded = [n for unit in order for n in (groups[unit[1]] if unit[0] == "g" else [nodes[unit[1]]])
                  if n.name in self._seeded]
        if seeded != sorted(seeded, key=lambda n: index[n.name]):
            raise PlanError(f"dropping vertices {list(dropped)[:8]}… would reorder random ops (dropout masks "
                            "would differ from the model's)")
        return groups, order

    def _build_executor(self, dropped: tuple[int, ...]) -> torch.fx.GraphModule:
        gm = self.graph_module
        nodes = list(gm.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        call_nodes, order = self.execution_order(dropped)
        groups = [_Group(nodes=group_nodes, inputs=[], outputs=[], slots=()) for group_nodes in call_nodes]
        for grp in groups:
            member = set(grp.nodes)
            inputs: dict[torch.fx.Node, None] = {}
            for n in grp.nodes:
                for u in n.all_input_nodes:
                    if u not in member and u.op != "get_attr":
                        inputs[u] = None
            grp.inputs = sorted(inputs, key=pos.__getitem__)
            grp.outputs = [n for n in grp.nodes if any(user not in member for user in n.users)]
            called = [gm.get_submodule(str(n.target)) for n in grp.nodes if n.op == "call_module"]
            slots = running_stat_slots(called)
            for n in grp.nodes:
                slots += self._slots.get(n.name, [])
            grp.slots = tuple(dict.fromkeys(slots))

        new = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        root = nn.Module()
        root.traced = gm  # get_attr targets and submodules resolve on the traced root (shared with the model)
        for kind, index in order:
            if kind == "n":
                n = nodes[index]
                if n.op == "get_attr":
                    env[n] = new.get_attr(f"traced.{n.target}")
                elif n.op == "call_module":
                    env[n] = new.call_module(f"traced.{n.target}",
                                             *torch.fx.map_arg((n.args, n.kwargs), env.__getitem__))
                else:
                    env[n] = new.node_copy(n, env.__getitem__)
                continue
            grp = groups[index]
            setattr(root, f"group{index}", _CheckpointedGroup(self._group_body(grp), grp.slots))
            call = new.call_module(f"group{index}", tuple(env[u] for u in grp.inputs))
            for k, out in enumerate(grp.outputs):
                env[out] = new.call_function(operator.getitem, (call, k))
        new.lint()
        return torch.fx.GraphModule(root, new, class_name="CheckpointedGraph")

    def _group_body(self, grp: _Group) -> torch.fx.GraphModule:
        g = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for k, u in enumerate(grp.inputs):
            env[u] = g.placeholder(f"in{k}_{u.name}")

        def lookup(u: torch.fx.Node) -> torch.fx.Node:
            if u not in env:  # a parameter or constant read inside the group
                assert u.op == "get_attr", u
                env[u] = g.get_attr(str(u.target))
            return env[u]

        for n in grp.nodes:
            env[n] = g.node_copy(n, lookup)
        g.output(tuple(env[o] for o in grp.outputs))
        g.lint()
        return torch.fx.GraphModule(self.graph_module, g, class_name="Group")


def _module_label(n: torch.fx.Node) -> str:
    path = module_path(n)
    if not path:
        return n.name
    return path if n.op == "call_module" else f"{path}:{n.name}"


def _attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


# NOTE [ an op graph of a call ] A model called with several inputs (a transformer's token ids, labels, masks)
# is cut from its exported graph (remat.client.graph.fx_trace.export_model), whose placeholders are the call's
# flat inputs, constants included. All of them form vertex 0: the planners' single source, never dropped, as
# the one input of a model of one tensor is. What the model computes from any of them (a causal mask from the
# ids, position tables, the labels' shift) depends on the source and is planned like any other tensor;
# what depends on none of them (position and token-type embeddings of a buffer's ids, rotary tables) hangs off
# the source too, as if it read it: left off the planned paths it would run as traced, outside every
# checkpointed call, and a call that reads it would hold it as an input until its backward (BERT: a hidden
# state and a position table, 640 KiB above the chain plan the graph plan was translated from, at every
# plan); on them, a plan re-runs it inside the call, as the chain's stage does.
def build_op_graph(model: nn.Module, example_input: torch.Tensor | ModelCall, *, train: bool = True,
                   graph: torch.fx.GraphModule | None = None) -> OpGraph:
    """The op graph of ``model`` (see the module docstring); raise ``ModelError`` if it has none.

    Args:
        model: the model; it is not modified (the probe run restores buffers and RNG).
        example_input: one input batch, or one training call of several inputs (``ModelCall``, with
            ``graph`` its exported graph: NOTE [ an op graph of a call ]); shapes and dtypes give the vertex
            sizes.
        train: trace and probe in train mode (what checkpointing needs) or eval mode.
        graph: ``trace_model(model, train=train)`` when the caller already has it.
    """
    if isinstance(example_input, ModelCall) and example_input.single_tensor is not None:
        example_input = example_input.single_tensor
    if isinstance(example_input, ModelCall):
        if graph is None:
            graph = trace_model(model, train=train, call=example_input)
        specs = graph.meta.get("remat_pytree")
        found = example_input.detach().inputs_for(specs[0]) if specs is not None else None
        if found is None:
            raise ModelError(f"the graph of {type(model).__name__} was not exported for this call's inputs")
        inputs = found
    elif isinstance(example_input, torch.Tensor):
        specs, inputs = None, [example_input]
    else:
        raise ModelError(f"example_input must be a tensor or a ModelCall, got {type(example_input).__name__}")
    gm = graph if graph is not None else trace_model(model, train=train)
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise ModelError(
            f"{type(model).__name__}.forward takes {len(placeholders)} inputs; only one tensor is supported"
            if specs is None else
            f"the graph of {type(model).__name__} takes {len(placeholders)} inputs, the call {len(inputs)}"
        )
    where = example_input.main if isinstance(example_input, ModelCall) else example_input
    with training_mode(model, train), untouched(model, where):
        recorder = _SeededRecorder(buffer_owners(model, gm))
        interp = _StorageInterpreter(gm, recorder)
        try:
            with recorder:
                interp.run(*inputs)
        except Exception as exc:  # noqa: BLE001 - a traced graph that cannot run has no op graph
            raise ModelError(f"the traced graph of {type(model).__name__} does not run: {exc}") from None

    compute = [n for n in nodes if n.op not in ("get_attr", "output")]
    # Parameters, buffers and traced constants are no activations: a view of a weight (``w.t()``) creates
    # nothing and joins nobody.
    constant = {id(s) for t in (*model.parameters(), *model.buffers(), *gm.parameters(), *gm.buffers())
                for s in storages(t)}
    constant |= {id(s) for n in nodes if n.op == "get_attr" for s in storages(_attr(gm, str(n.target)))}
    uf = _UnionFind()
    for n in compute:
        uf.find(n.name)
    for n in placeholders[1:]:  # every input of a call is the source (NOTE [ an op graph of a call ])
        uf.union(placeholders[0].name, n.name)
    first_owner: dict[int, str] = {}
    for n in compute:  # nodes returning a storage an earlier node created join that node
        owners = []
        for sid, _ in interp.storages.get(n.name, ()):
            if sid in constant:
                continue
            if sid in first_owner:
                owners.append(first_owner[sid])
            else:
                first_owner[sid] = n.name
        # A tuple of items from several nodes only gathers them (a model's outputs): it joins nobody.
        if interp.is_tensor.get(n.name, False) or len({uf.find(o) for o in owners}) == 1:
            for o in owners:
                uf.union(o, n.name)
    for n in compute:  # shapes join the node they read, unpacked tuple items the tuple
        if not interp.has_tensor.get(n.name, False):
            for u in n.all_input_nodes:
                if u.op != "get_attr":
                    uf.union(u.name, n.name)
        if (n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node)
                and n.args[0].op != "get_attr"):
            uf.union(n.args[0].name, n.name)

    # Vertex graph over every value edge (shapes too: a group must run after what it reads), cycles merged.
    def vertex_edges() -> dict[str, set[str]]:
        succ: dict[str, set[str]] = {}
        for n in compute:
            for u in n.all_input_nodes:
                if u.op != "get_attr" and uf.find(u.name) != uf.find(n.name):
                    succ.setdefault(uf.find(u.name), set()).add(uf.find(n.name))
        return succ

    roots = list(dict.fromkeys(uf.find(n.name) for n in compute))
    for comp in _strongly_connected(roots, vertex_edges()):
        for other in comp[1:]:
            uf.union(comp[0], other)

    pos = {n.name: i for i, n in enumerate(nodes)}
    members: dict[str, list[str]] = {}
    for n in compute:
        members.setdefault(uf.find(n.name), []).append(n.name)
    # Topological order of vertices, ties broken by first node position.
    order = _topological(list(members), vertex_edges(), {r: pos[names[0]] for r, names in members.items()})
    source_root = uf.find(placeholders[0].name)
    if order[0] != source_root:
        raise ModelError(f"{type(model).__name__} computes tensors that do not depend on its input first; "
                         "its op graph has no single source")

    # Tensor edges between vertices; keep those on input→output paths.
    tensor_succ: dict[str, set[str]] = {}
    for n in compute:
        for u in n.all_input_nodes:
            if u.op == "get_attr" or not interp.has_tensor.get(u.name, False):
                continue
            a, b = uf.find(u.name), uf.find(n.name)
            if a != b:
                tensor_succ.setdefault(a, set()).add(b)
    if specs is not None:  # tables made from buffers alone hang off the source (NOTE [ an op graph of a call ])
        fed_by_tensor = {b for bs in tensor_succ.values() for b in bs}
        for r in order[1:]:
            if r not in fed_by_tensor and any(interp.has_tensor.get(name, False) for name in members[r]):
                tensor_succ.setdefault(source_root, set()).add(r)
    output_node = next(n for n in nodes if n.op == "output")
    fed = list(dict.fromkeys(uf.find(u.name) for u in output_node.all_input_nodes if u.op != "get_attr"))
    virtual = not (len(fed) == 1 and not tensor_succ.get(fed[0]))
    sink = _SINK if virtual else fed[0]
    if virtual:
        for r in fed:
            tensor_succ.setdefault(r, set()).add(_SINK)
    path_edges = on_path_edges([*order, _SINK], {u: sorted(vs) for u, vs in tensor_succ.items()},
                                source_root, sink)
    if source_root not in path_edges:
        raise ModelError(f"the output of {type(model).__name__} does not depend on its input tensor")
    on_path = [r for r in path_edges if r != _SINK]
    if not virtual and on_path[-1] != sink:
        raise ModelError(f"{type(model).__name__}'s op graph has no single sink")
    # Off-path vertices (ops that do not lead to the output, or do not depend on the input) always run as
    # traced: they are not planned. They still belong to no group, so they are never dropped.
    index = {r: i for i, r in enumerate(on_path)}
    index[_SINK] = len(on_path)
    vertex_nodes = [tuple(sorted(members[r], key=pos.__getitem__)) for r in on_path]
    weights = []
    for names in vertex_nodes:
        seen: dict[int, int] = {}
        for name in names:
            for sid, nbytes in interp.storages.get(name, ()):
                if first_owner.get(sid) == name:
                    seen[sid] = nbytes
        weights.append(sum(seen.values()))
    edges = sorted({(index[u], index[v]) for u, vs in path_edges.items() for v in vs})
    if virtual:
        vertex_nodes.append(())
        weights.append(0)
    by_name = {n.name: n for n in nodes}
    labels = [_module_label(by_name[names[0]]) if names else _SINK for names in vertex_nodes]
    labels[0] = "<input>"
    del interp
    return OpGraph(
        model=model, graph_module=gm, vertex_nodes=vertex_nodes, names=labels, weights=weights, edges=edges,
        virtual_sink=virtual, train=train, _slots=dict(recorder.buffer_writes),
        _seeded=frozenset(recorder.seeded), num_inputs=len(inputs), pytree_specs=specs,
    )
