"""One instrumented training step of an op graph's model, recorded as torch-free data for the graph predictor.

``profile_graph(model, x, graph, grads=...)`` runs the *unmodified* model once (after a warm-up step, as
``measure_step`` does) through its traced graph module, under a storage recorder (the CPU
:class:`~remat.worker.memory_meter.MemoryMeter`, extended to log every storage's birth and death), autograd's
saved-tensor hooks, and pre/post hooks on every autograd node of the step. The result is a
:class:`~remat.client.planning.graph_predict.GraphProfile` (torch-free, JSON-able through ``to_dict``) that
:func:`remat.client.planning.graph_predict.predict_graph_peak` replays for any dropped set of the graph, so that
a planner can judge thousands of plans from one profile without running them.

Why these records (what the predictor must know to replay what PyTorch does with a plan):

- per fx node (forward): the storages it creates that survive it (``births``), the storages its value refers
  to (``value``: a view or an in-place op refers to an earlier node's storage), its transient peak above the
  level it started at (``peak``), and every tensor autograd packed while it ran (``packs``), in order, with
  the peak reached up to each pack and the storages alive then. Non-reentrant checkpoint stops a recompute
  right after the group's last pack, and a pack of an op's *inputs* happens before its output exists, so the
  stopping point is inside a node.
- per pack: the storage (or none for parameters, buffers and the input batch) and the autograd node that
  unpacked it in backward (``torch._C._current_autograd_node()``), which releases it.
- per autograd node: which fx node created it, its creation rank (the engine runs the ready node of the
  highest sequence number first, and a plan changes creation order), its edges, its apply's transient peak
  above the level at its start, and for each gradient it sends: a new storage (bytes), the very tensor it
  received (``AddBackward0``), a view of a received gradient's storage (``CatBackward0``'s slices), with the
  gradient's own bytes and layout, which decide whether the engine can accumulate into it in place.

Instrumentation that changes memory is avoided: packed tensors are returned detached inside a token (the
same storage, no reference cycle through an output's ``grad_fn``), and the hooks allocate nothing.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_flatten

from remat.client.graph.model_call import ModelCall
from remat.client.graph.op_graph import OpGraph
from remat.client.graph.write_probe import running_stat_slots
from remat.client.planning.graph_predict import LOSS, AutogradRecord, GraphProfile, NodeRecord, PackRecord
from remat.worker.measure import step_loss
from remat.worker.memory_meter import MemoryMeter, storage_key
from remat.worker.profilers.common import preserved_state, set_grad_convention

__all__ = ["LOSS", "executor_units", "profile_graph"]

_ACCUMULATE_SEQ = -1
"""Recorded creation rank of ``AccumulateGrad`` nodes: the engine gives them the highest priority."""


class _Token:
    """What a pack hook returns: the saved tensor (detached) and the pack's index."""

    __slots__ = ("index", "tensor")

    def __init__(self, index: int, tensor: torch.Tensor) -> None:
        self.index = index
        self.tensor = tensor


class _Recorder(MemoryMeter):
    """The CPU meter, also giving each storage born under it an id (sid) and logging births and deaths."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []
        self.sid_of_key: dict[int, int] = {}
        self.alive: set[int] = set()
        self.window_births: list[int] = []  # sids born since the current window began
        self.step_peak = 0
        """The step's peak above the baseline (the meter's own peak restarts with every window)."""

    def _follow(self, t: torch.Tensor, key: int, nbytes: int) -> None:
        new = key not in self._ledger.sizes
        super()._follow(t, key, nbytes)
        self.step_peak = max(self.step_peak, self.current_bytes - self.baseline_bytes)
        if not new:  # a followed storage grew in place: book it on its sid
            sid = self.sid_of_key.get(key)
            if sid is not None:
                self.sizes[sid] += nbytes
            return
        sid = len(self.sizes)
        self.sizes.append(nbytes)
        self.sid_of_key[key] = sid
        self.alive.add(sid)
        self.window_births.append(sid)
        weakref.finalize(t.untyped_storage(), self._died, key, sid)

    def _died(self, key: int, sid: int) -> None:
        self.alive.discard(sid)
        if self.sid_of_key.get(key) == sid:
            del self.sid_of_key[key]

    def sid(self, t: torch.Tensor) -> int | None:
        """The sid of a live followed storage, None for storages born before (parameters, input batch)."""
        key = storage_key(t)
        if key is None:
            return None
        sid = self.sid_of_key.get(key)
        return sid if sid is not None and sid in self.alive else None

    def begin(self) -> int:
        self.window_births = []
        self.reset_peak()
        return self.current_bytes


def _tensors(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _grad_fns(value: Any) -> list[Any]:
    return [t.grad_fn for t in _tensors(value) if t.grad_fn is not None]


def _dense(t: torch.Tensor) -> bool:
    """Whether the engine may accumulate into ``t`` in place (``can_accumulate_inplace``'s layout part)."""
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


class _Profiler:
    def __init__(self, model: nn.Module, graph: OpGraph) -> None:
        self.model = model
        self.graph = graph
        self.rec = _Recorder()
        self.nodes: list[NodeRecord] = []
        self.packs: list[PackRecord] = []
        self.autograd: list[AutogradRecord] = []
        self.node_index: dict[int, int] = {}  # id(autograd node) -> index
        self.node_refs: list[Any] = []
        self.current: dict[str, Any] | None = None
        self.current_base = 0
        self.apply_state: dict[int, tuple[int, list[tuple[int | None, int]]]] = {}
        self.handles: list[Any] = []

    # -- forward --------------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> _Token:
        rec = self.rec
        index = len(self.packs)
        node = self.current
        sid = rec.sid(t)
        entry: PackRecord = {"node": node["name"] if node else None, "sid": sid, "consumer": None}
        self.packs.append(entry)
        if node is not None:
            node["packs"].append(index)
            node["pack_peaks"].append(rec.peak_bytes - self.current_base)
            node["pack_alive"].append([s for s in rec.window_births if s in rec.alive])
        return _Token(index, t.detach())

    def unpack(self, token: _Token) -> torch.Tensor:
        fn = torch._C._current_autograd_node()
        index = self.node_index.get(id(fn)) if fn is not None else None
        if self.packs[token.index]["consumer"] is None:
            self.packs[token.index]["consumer"] = index
        return token.tensor

    def run_fx_node(self, name: str, reads: list[str], run: Any, module_slots: list[list[Any]]) -> Any:
        rec = self.rec
        record: dict[str, Any] = {"name": name, "reads": reads, "packs": [], "pack_peaks": [], "pack_alive": [],
                                  "slots": module_slots, "autograd": []}
        self.current = record
        self.current_base = rec.begin()
        value = run()
        record["peak"] = rec.peak_bytes - self.current_base
        record["births"] = [s for s in rec.window_births if s in rec.alive]
        vals = []
        for t in _tensors(value):
            sid = rec.sid(t)
            if sid is not None and sid not in vals:
                vals.append(sid)
        record["value"] = vals
        self.current = None
        self._discover(value, record)
        self.nodes.append(cast("NodeRecord", record))  # complete now
        return value

    def _discover(self, value: Any, record: dict[str, Any]) -> None:
        """Autograd nodes first reachable from this fx node's outputs were created by it."""
        stack = _grad_fns(value)
        found = []
        while stack:
            fn = stack.pop()
            if id(fn) in self.node_index:
                continue
            index = len(self.autograd)
            self.node_index[id(fn)] = index
            self.node_refs.append(fn)
            accumulate = type(fn).__name__ == "AccumulateGrad"
            self.autograd.append({"index": index, "type": type(fn).__name__, "fx": record["name"],
                                  "seq": _ACCUMULATE_SEQ if accumulate else fn._sequence_nr()})
            found.append(index)
            for nxt, _ in fn.next_functions:
                if nxt is not None:
                    stack.append(nxt)
        record["autograd"] = sorted((i for i in found if self.autograd[i]["seq"] != _ACCUMULATE_SEQ),
                                    key=lambda i: self.autograd[i]["seq"])

    # -- backward -------------------------------------------------------------------------------------
    def hook_all(self) -> None:
        for index, fn in enumerate(self.node_refs):
            entry = self.autograd[index]
            entry["next"] = [[self.node_index[id(nxt)] if nxt is not None else -1, nr]
                             for nxt, nr in fn.next_functions]
            self.handles.append(fn.register_prehook(self._prehook(index)))
            self.handles.append(fn.register_hook(self._posthook(index)))

    def unhook(self) -> None:
        """Remove every hook: a parameter's ``AccumulateGrad`` node outlives the step (the parameter keeps it
        while any graph holds it), and left hooked it rewrote this profile's records in every later step
        (a measured plan of a GPT-2 changed what the profile predicted for another plan, by 33 KB)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _prehook(self, index: int) -> Any:
        def hook(grad_outputs: Sequence[torch.Tensor | None]) -> None:
            rec = self.rec
            incoming = [(rec.sid(g), id(g)) if g is not None else (None, 0) for g in grad_outputs]
            self.apply_state[index] = (rec.begin(), incoming)
        return hook

    def _posthook(self, index: int) -> Any:
        def hook(grad_inputs: Sequence[torch.Tensor | None], grad_outputs: Sequence[torch.Tensor | None]) -> None:
            rec = self.rec
            base, incoming = self.apply_state.pop(index)
            entry = self.autograd[index]
            entry["extra"] = rec.peak_bytes - base
            born = [s for s in rec.window_births if s in rec.alive]
            outs = []
            for g in grad_inputs:
                if g is None:
                    outs.append(None)
                    continue
                sid = rec.sid(g)
                out: dict[str, Any] = {"bytes": g.numel() * g.element_size(), "dense": _dense(g)}
                if sid is not None and sid in born:
                    out["new"] = born.index(sid)
                    out["storage"] = rec.sizes[sid]
                else:
                    slots = [j for j, (s, _) in enumerate(incoming) if s is not None and s == sid]
                    same = [j for j, (_, ident) in enumerate(incoming) if ident == id(g)]
                    if same:
                        out["same"] = same[0]
                    elif slots:
                        out["view"] = slots[0]
                    else:  # a storage from elsewhere (a saved tensor, a parameter): no new memory
                        out["other"] = sid
                outs.append(out)
            entry["outs"] = outs
            entry["inputs"] = len(grad_outputs)
            entry["incoming_sids"] = [s for s, _ in incoming]
            entry["incoming_bytes"] = [g.numel() * g.element_size() if g is not None else 0 for g in grad_outputs]
            entry["leftover"] = sum(rec.sizes[s] for s in born if not any(o and o.get("new") == born.index(s)
                                                                             for o in outs))
        return hook


def _module_slots(gm: torch.fx.GraphModule, graph: OpGraph, n: torch.fx.Node) -> list[list[Any]]:
    """Buffers the checkpoint's BatchNorm restore snapshots for this node: [slot name, bytes]."""
    slots = []
    if n.op == "call_module":
        slots += running_stat_slots([gm.get_submodule(str(n.target))])
    slots += graph._slots.get(n.name, [])
    out = []
    for module, name in dict.fromkeys(slots):
        buf = module._buffers.get(name)
        if buf is not None:
            out.append([f"{id(module)}.{name}", buf.numel() * buf.element_size()])
    return out


def profile_graph(model: nn.Module, example_input: torch.Tensor | ModelCall, graph: OpGraph, *,
                  grads: str = "kept", train: bool = True) -> GraphProfile:
    """Record one training step of ``model`` (no checkpointing) for the graph predictor; see the module doc.

    The step is the one ``measure_step`` measures: the same loss (the model's own when it computes one, else
    :func:`remat.worker.measure.make_loss`), the same gradient convention, after a warm-up step; the model
    comes back unchanged. ``example_input``: one batch, or one call of several inputs (``ModelCall``) for an
    op graph cut from its exported graph.
    """
    gm = graph.graph_module
    inputs = graph.split_call(example_input)
    with preserved_state(model):
        model.train(train)
        with torch.no_grad():
            loss_fn = step_loss(graph.run_call(example_input))
        set_grad_convention(model, grads)
        loss_fn(graph.run_call(example_input)).backward()  # warm-up, as measure_step does
        set_grad_convention(model, grads)
        gc.collect()
        prof = _Profiler(model, graph)
        rec = prof.rec
        gc.disable()
        try:
            with rec:
                rec.mark_baseline()
                with torch.autograd.graph.saved_tensors_hooks(prof.pack, prof.unpack):
                    env: dict[torch.fx.Node, Any] = {}
                    last_use: dict[torch.fx.Node, torch.fx.Node] = {}
                    nodes = list(gm.graph.nodes)
                    input_of = dict(zip([n for n in nodes if n.op == "placeholder"], inputs, strict=True))
                    for n in nodes:
                        for u in n.all_input_nodes:
                            last_use[u] = n
                    interp = torch.fx.Interpreter(gm, garbage_collect_values=False)
                    output_value: Any = None
                    for n in nodes:
                        if n.op == "output":
                            output_value = torch.fx.node.map_arg(n.args[0], env.__getitem__)
                        else:
                            reads = [u.name for u in n.all_input_nodes if u.op != "get_attr"]

                            def run(n: torch.fx.Node = n) -> Any:
                                a = torch.fx.node.map_arg(n.args, env.__getitem__)
                                k = torch.fx.node.map_arg(n.kwargs, env.__getitem__)
                                return getattr(interp, n.op)(n.target, a, k)

                            if n.op == "placeholder":
                                env[n] = input_of[n]
                                prof.nodes.append({"name": n.name, "reads": [], "packs": [], "pack_peaks": [],
                                                   "pack_alive": [], "slots": [], "autograd": [], "peak": 0,
                                                   "births": [], "value": []})
                            else:
                                env[n] = prof.run_fx_node(n.name, reads, run, _module_slots(gm, graph, n))
                        for u in n.all_input_nodes:
                            if last_use.get(u) is n and n.op != "output":
                                del env[u]
                    outputs = [u.name for u in nodes[-1].all_input_nodes] if nodes[-1].op == "output" else []
                    env.clear()
                    output_value = graph.fold_output(output_value)  # the model's own (a ModelOutput, its loss)
                    box = [output_value]  # handed to the loss and dropped by it, as in measure_step's one expression
                    output_value = None
                    loss = prof.run_fx_node(LOSS, outputs, lambda: loss_fn(box.pop()), [])
                    prof.hook_all()
                    root = prof.node_index[id(loss.grad_fn)]
                    rec.begin()
                    grad = torch.ones_like(loss)
                    root_births = list(rec.window_births)
                    torch.autograd.backward(loss, grad)
                    del grad, loss
                peak = rec.step_peak
        finally:
            prof.unhook()
            gc.enable()
        param_grads = {rec.sid(p.grad) for p in model.parameters() if p.grad is not None}
        param_grads.discard(None)
    return GraphProfile(nodes=prof.nodes, packs=prof.packs, autograd=prof.autograd, storage_bytes=rec.sizes,
                        root=root, root_grad_bytes=[rec.sizes[s] for s in root_births],
                        param_grad_sids=sorted(param_grads), measured_peak_bytes=peak, grads=grads)


def executor_units(graph: OpGraph, dropped: Sequence[int]) -> list[dict[str, Any]]:
    """The order in which ``graph.run(x, dropped)`` runs fx nodes (``OpGraph.execution_order``) as a list
    of units, each ``{"call": bool, "nodes": [fx names]}``, so that the pure-Python predictor needs no fx
    graph (a checkpointed call runs its nodes in traced order)."""
    nodes = list(graph.graph_module.graph.nodes)
    groups, order = graph.execution_order(sorted(set(dropped)))
    units = []
    for kind, index in order:
        if kind == "g":
            units.append({"call": True, "nodes": [n.name for n in groups[index]]})
        elif nodes[index].op not in ("output", "get_attr"):
            units.append({"call": False, "nodes": [nodes[index].name]})
    return units
