"""A relaxed step: a lower bound on the peak of every one-level graph plan, and a MILP that minimises it.

NOTE [relaxed step] ``forced_peak`` (NOTE [forced memory]) counts what each event needs whatever the plan, so
it misses the trade a plan makes: what forward keeps against what backward re-runs. The relaxed step counts,
at chosen events, only storages that are *surely* alive there under the executor's rules (module docstring
of remat.client.planning.graph_predict), for whichever plan ``dropped`` is:

- the event's own needs (``backward_needs``) plus the gradients surely waiting: sent by an autograd node that
  must run before it to one that must run after it, one storage per input slot;
- a storage packed by a vertex that is kept and reads only kept vertices (so no call takes it in as an exit,
  ``OpGraph.calls``), while the pack's consumer must run after the event;
- a frame input: a value of a kept vertex ``w`` read by a dropped vertex ``u`` that packs something, while a
  consumer of ``u``'s packs must run after the event (the call's frame holds its inputs until its last
  pack owner has run);
- at a re-run (the backward of a node consuming a pack of a dropped vertex ``t``, which comes after the call
  was re-run): the recomputed packs, consumed after that node, of every dropped vertex with a dropped path to
  ``t`` (all in ``t``'s call, every branch of it, not only its longest path); and at the end of a re-run of
  ``t``'s call, all their packs.
Each storage is counted once per event, by the vertex that packs it first, so no storage is counted by two
rules. Every term is a sum over storages of indicator functions of the plan that are lower than the truth,
so ``relaxed_peak(dropped) <= predict_graph_peak(dropped)`` for every plan the executor accepts; the tests
check it on every plan a search judges. The relaxation is loose where a call reaches beyond what is
upstream of one vertex, at a call's exit (a kept vertex run inside the call), or where ``AddBackward0``
passes a gradient on as it is (not counted as waiting).

:func:`certified_bound` minimises the relaxed peak over every 0/1 choice of kept vertices with a MILP
(HiGHS): its dual bound at the time limit is no more than the relaxed peak of any plan, hence no more than
the predicted peak of any one-level graph plan. Re-run paths are cut to ``RUN_WINDOW`` vertices in the MILP,
which only lowers it. Nested plans (two levels of re-runs) are not covered: ``forced_peak`` still bounds
them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from remat.client.planning.graph_predict import (
    GraphProfile,
    autograd_ancestors,
    autograd_senders,
    backward_needs,
)

__all__ = ["RUN_WINDOW", "Certificate", "Relaxation", "certified_bound", "relaxed_peak"]

RUN_WINDOW = 10
"""Edges upstream of a re-run's vertex that the MILP follows along dropped paths (what lies further up is
left out, which only lowers the bound)."""
MIB = 2**20

Reason = tuple[Any, ...]
"""Why a storage is alive: ``("kept", q)`` — vertex q is kept and reads only kept vertices; ``("frame", w, u)``
— vertex w is kept and vertex u, which reads it, is dropped."""


@dataclass(frozen=True, slots=True)
class Event:
    """One backward event of the relaxed step."""

    index: int
    """The autograd node whose backward this is."""
    floor: int
    """Bytes alive whatever the plan: its needs (``backward_needs``) and the gradients surely waiting."""
    alive: dict[int, frozenset[Reason]]
    """Per storage (sid) not in the floor, the reasons that make it surely alive at this event."""


@dataclass(frozen=True, slots=True)
class RerunEvent:
    """The backward of ``event``, a consumer of vertex ``vertex``'s packs: when ``vertex`` is dropped, its call
    was re-run before it and the recomputed packs consumed after it are alive."""

    vertex: int
    event: int
    """Position in ``Relaxation.events``."""
    own: dict[int, int]
    """Per vertex, bytes of the packs it makes first of storages it made, consumed after the event."""
    handed: dict[tuple[int, int], int]
    """Per edge (u, v), bytes of the packs v makes first of storages u made, consumed after the event."""
    alive: dict[int, frozenset[Reason]]
    """The event's ``alive`` less what a re-run path may count: a storage first packed by a vertex that made
    it (or whose predecessor did) is alive here only through that first pack kept."""


@dataclass(frozen=True, slots=True)
class Relaxation:
    """The relaxed step of one graph profile on its op graph (NOTE [relaxed step])."""

    n: int
    pred: tuple[tuple[int, ...], ...]
    """Per vertex, the vertices of the op graph's edges into it (tensors on input→output paths): two dropped
    vertices joined by one are in one call."""
    reads: tuple[tuple[int, ...], ...]
    """Per vertex, every vertex whose value it reads (shapes and off-path tensors too): a kept vertex reading a
    dropped one may run inside that call as its exit (``OpGraph.calls``)."""
    sizes: Sequence[int]
    events: tuple[Event, ...]
    own: dict[int, int]
    """Per vertex, bytes of the packs it makes first of storages it made (recomputed when it is re-run)."""
    handed: dict[tuple[int, int], int]
    """Per edge (u, v), bytes of the packs v makes first of storages u made (recomputed when both are)."""
    rerun_alive: tuple[dict[int, frozenset[Reason]], ...]
    """Per vertex t, the storages surely alive at the end of a re-run of t's call, beyond the re-run's packs."""
    reruns: tuple[RerunEvent, ...]

    @classmethod
    def of(cls, profile: GraphProfile, vertex_nodes: Sequence[Sequence[str]],
           edges: Iterable[tuple[int, int]]) -> Relaxation:
        """The relaxed step of ``profile`` (``profile_graph``'s record) on the op graph of ``vertex_nodes`` and
        ``edges`` (``graph.vertex_nodes``, ``graph.edges``)."""
        n = len(vertex_nodes)
        vertex_of = {name: v for v, names in enumerate(vertex_nodes) for name in names}
        nodes = {rec["name"]: rec for rec in profile.nodes}
        sizes = profile.storage_bytes
        autograd = profile.autograd
        ancestors = autograd_ancestors(autograd, autograd_senders(autograd))
        pred: list[set[int]] = [set() for _ in range(n)]
        for u, v in edges:
            pred[v].add(u)
        reads = [set(p) for p in pred]
        for rec in profile.nodes:
            v = vertex_of.get(rec["name"])
            if v is not None:
                reads[v].update(vertex_of[name] for name in rec["reads"] if vertex_of.get(name, v) != v)
        born = {sid: vertex_of[rec["name"]] for rec in profile.nodes if rec["name"] in vertex_of
                for sid in rec["births"]}
        # Every pack that holds a storage born in the step, and whether it is that storage's first.
        holders: list[int] = [0] * n  # per vertex, a bitset of the autograd nodes that consume its packs
        packs: list[tuple[int, int, int, bool]] = []  # (sid, packing vertex, consumer, first)
        seen: set[int] = set()
        for pk in profile.packs:
            sid, consumer = pk["sid"], pk["consumer"]
            if sid is None or consumer is None or pk["node"] not in vertex_of or not sizes[sid]:
                continue
            q = vertex_of[pk["node"]]
            holders[q] |= 1 << consumer
            packs.append((sid, q, consumer, sid not in seen))
            seen.add(sid)
        frames: set[tuple[int, int, int]] = set()  # (sid, kept vertex w, reader u)
        for rec in profile.nodes:
            u = vertex_of.get(rec["name"])
            for name in rec["reads"] if u is not None else ():
                w = vertex_of.get(name)
                if w is not None and w != u:
                    frames.update((sid, w, u) for sid in nodes[name]["value"] if sizes[sid])

        def after(mask: int, i: int) -> bool:
            """Whether some node of ``mask`` must run after node ``i``."""
            return any(ancestors[h] >> i & 1 for h in _bits(mask))

        waiting = _waiting_slots(profile)
        received = [sum(a.get("incoming_bytes", ())) for a in autograd]
        events: list[Event] = []
        need_sids: dict[int, frozenset[int]] = {}
        for need in backward_needs(profile):
            need_sids[need.index] = need.sids
            i = need.index
            alive: dict[int, set[Reason]] = {}
            for sid, q, consumer, _ in packs:
                if sid not in need.sids and ancestors[consumer] >> i & 1:
                    alive.setdefault(sid, set()).add(("kept", q))
            for sid, w, u in frames:
                if sid not in need.sids and after(holders[u], i):
                    alive.setdefault(sid, set()).add(("frame", w, u))
            events.append(Event(index=i, floor=need.bytes + _waiting_bytes(waiting, ancestors, received, i),
                                alive={s: frozenset(r) for s, r in alive.items()}))
        own = [0] * n
        handed: dict[tuple[int, int], int] = {}
        for sid, q, _, first in packs:
            b = born.get(sid)
            if first and b == q:
                own[q] += sizes[sid]
            elif first and b in pred[q]:
                handed[(b, q)] = handed.get((b, q), 0) + sizes[sid]
        runnable = {sid: q for sid, q, _, first in packs if first and (born.get(sid) == q or born.get(sid) in pred[q])}
        rerun_alive = []
        for t in range(n):
            alive = {}
            for sid, q, consumer, first in packs:
                if holders[t] and first and q != t and ancestors[consumer] & holders[t]:
                    alive.setdefault(sid, set()).add(("kept", q))
            for sid, w, u in frames:
                if holders[t] and born.get(sid) == w and (u == t or any(ancestors[h] & holders[t]
                                                                      for h in _bits(holders[u]))):
                    alive.setdefault(sid, set()).add(("frame", w, u))
            rerun_alive.append({s: frozenset(r) for s, r in alive.items()})
        position = {e.index: k for k, e in enumerate(events)}
        reruns = []
        for t in range(n):
            for h in _bits(holders[t]):
                if h not in position:
                    continue
                r_own: dict[int, int] = {}
                r_handed: dict[tuple[int, int], int] = {}
                r_alive = dict(events[position[h]].alive)
                for sid, q in runnable.items():
                    if sid in r_alive:
                        kept_first = r_alive[sid] & {("kept", q)}
                        if kept_first:
                            r_alive[sid] = frozenset(kept_first)
                        else:
                            del r_alive[sid]
                for sid, q, consumer, first in packs:
                    if not first or not ancestors[consumer] >> h & 1 or sid in need_sids[h]:
                        continue
                    b = born.get(sid)
                    if b == q:
                        r_own[q] = r_own.get(q, 0) + sizes[sid]
                    elif b in pred[q]:
                        r_handed[(b, q)] = r_handed.get((b, q), 0) + sizes[sid]
                reruns.append(RerunEvent(vertex=t, event=position[h], own=r_own, handed=r_handed, alive=r_alive))
        return cls(n=n, pred=tuple(tuple(sorted(p)) for p in pred), reads=tuple(tuple(sorted(r)) for r in reads),
                   sizes=sizes, events=tuple(events), own=dict(enumerate(own)), handed=handed,
                   rerun_alive=tuple(rerun_alive), reruns=tuple(reruns))


def _bits(mask: int) -> Iterable[int]:
    """The positions of the set bits of ``mask``."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


_Slot = tuple[int, int]


def _waiting_slots(profile: GraphProfile) -> dict[_Slot, list[tuple[int, Any, int]]]:
    """Per input slot (receiving node, slot) of a node that is not ``AccumulateGrad``: (sender, storage key,
    bytes) of each gradient sent there that is a new storage or a view (one passed on as it is, by
    ``AddBackward0``, is left out: it is counted where it was made, or not at all)."""
    autograd = profile.autograd
    slots: dict[_Slot, list[tuple[int, Any, int]]] = {}
    for a in autograd:
        for k, ((t, slot), out) in enumerate(zip(a.get("next", []), a.get("outs", []) or [], strict=False)):
            if t < 0 or out is None or autograd[t]["type"] == "AccumulateGrad":
                continue
            if "new" in out:
                key: Any = ("new", a["index"], out["new"])
            elif "view" in out:
                key = ("view", a["index"], k)
            else:
                continue
            slots.setdefault((t, slot), []).append((a["index"], key, out["bytes"]))
    return slots


def _waiting_bytes(slots: dict[_Slot, list[tuple[int, Any, int]]], ancestors: Sequence[int], received: Sequence[int],
                   i: int) -> int:
    """Bytes of gradients surely waiting at node ``i``'s backward: in a slot of a node that must run after it,
    sent by a node that must run before it. A slot holds one storage once its gradients are summed (the
    smallest of them counted); slots that may share a storage (one new storage sent to several) count once,
    at the largest; the views one node sent count no more than the gradients it received (``received``)."""
    parent: dict[Any, Any] = {}

    def find(key: Any) -> Any:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    counted: list[tuple[Any, int]] = []
    for (t, _), sent in slots.items():
        if t == i or not ancestors[t] >> i & 1:
            continue
        before = [(key, nbytes) for sender, key, nbytes in sent if ancestors[i] >> sender & 1]
        if before:
            for key, _ in before[1:]:
                parent[find(key)] = find(before[0][0])
            counted.append((before[0][0], min(nbytes for _, nbytes in before)))
    largest: dict[Any, int] = {}
    views: dict[int, int] = {}  # per sender, the bytes of its views waiting
    for key, nbytes in counted:
        if key[0] == "view":
            views[key[1]] = views.get(key[1], 0) + nbytes
        else:
            root = find(key)
            largest[root] = max(largest.get(root, 0), nbytes)
    return sum(largest.values()) + sum(min(total, received[sender]) for sender, total in views.items())


def relaxed_peak(relax: Relaxation, dropped: Iterable[int]) -> tuple[int, str]:
    """The relaxed step's peak for a plan (NOTE [relaxed step]) and the event that reaches it: no more than
    ``predict_graph_peak`` of the same plan."""
    n, sizes, pred = relax.n, relax.sizes, relax.pred
    kept = [True] * n
    for v in dropped:
        kept[v] = False
    sure = [kept[v] and all(kept[u] for u in relax.reads[v]) for v in range(n)]

    def holds(reasons: frozenset[Reason]) -> bool:
        return any(sure[r[1]] if r[0] == "kept" else kept[r[1]] and not kept[r[2]] for r in reasons)

    def alive(storages: dict[int, frozenset[Reason]]) -> int:
        return sum(sizes[sid] for sid, reasons in storages.items() if holds(reasons))

    best, where = 0, "nothing"
    for e in relax.events:
        if e.floor + alive(e.alive) > best:
            best, where = e.floor + alive(e.alive), f"backward of autograd node #{e.index}"
    for t in range(n):
        if not kept[t]:
            rerun = _call_upstream(pred, kept, t, relax.own, relax.handed) + alive(relax.rerun_alive[t])
            if rerun > best:
                best, where = rerun, f"re-run through vertex {t}"
    for r in relax.reruns:
        if kept[r.vertex]:
            continue
        e = relax.events[r.event]
        total = e.floor + _call_upstream(pred, kept, r.vertex, r.own, r.handed) + alive(r.alive)
        if total > best:
            best, where = total, f"backward of autograd node #{e.index} after re-running vertex {r.vertex}"
    return best, where


def _call_upstream(pred: Sequence[Sequence[int]], kept: Sequence[bool], t: int, own: dict[int, int],
                   handed: dict[tuple[int, int], int]) -> int:
    """Bytes re-run with dropped vertex ``t``: ``own`` of every dropped vertex with a dropped path to ``t`` (all in
    ``t``'s call, run before it when the call is re-run) and ``handed`` of every edge into one of them from
    another. Every branch of a call counts, not only its longest path."""
    upstream, stack = {t}, [t]
    while stack:
        v = stack.pop()
        for u in pred[v]:
            if not kept[u] and u not in upstream:
                upstream.add(u)
                stack.append(u)
    return sum(own.get(v, 0) for v in upstream) + sum(
        handed.get((u, v), 0) for v in upstream for u in pred[v] if u in upstream)


@dataclass(frozen=True, slots=True)
class Certificate:
    """A lower bound on the predicted peak of every one-level graph plan of a step."""

    bound: int
    """Bytes: the MILP's dual bound, never below the ``floor`` it was given."""
    optimal: bool
    """Whether the MILP was solved to optimality (else its dual bound at the time limit)."""
    seconds: float
    relaxed_best: int | None
    """The least relaxed peak the solver found (an upper end of what the relaxation can certify)."""
    dropped: tuple[int, ...] | None
    """The plan that reached ``relaxed_best`` (the executor may refuse it: the relaxation knows no convexity)."""


def certified_bound(relax: Relaxation, *, floor: int, seconds: float) -> Certificate:
    """:func:`relaxed_peak` minimised over every choice of kept vertices by a MILP (HiGHS, at most
    ``seconds``): its dual bound certifies that no one-level graph plan peaks below it. ``floor`` is a bound
    known already (``forced_peak``), which the answer never goes below.

    Variables: x_v (kept, binary; the source and the sink kept), y_v ≥ x_v + Σ x_u − deg (kept and reading
    only kept), z_wu ≥ x_w − x_u (a frame), φ per storage with several reasons, per re-run vertex t the
    indicators a_v of a dropped path from v to t and e_uv of an edge into one (``_Milp.upstream``: linear, so
    every branch of a call adds its bytes and no big-M weakens them), and the peak M, minimised, above every
    event of the relaxed step.
    """
    import highspy
    import numpy as np

    model = _Milp(relax)
    model.build(floor)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(seconds))
    inf = highspy.kHighsInf
    ncols = len(model.lower)
    h.addVars(ncols, np.array(model.lower), np.array(model.upper))
    h.changeColsCost(1, np.array([model.peak], dtype=np.int32), np.array([1.0]))
    h.changeColsIntegrality(relax.n, np.arange(relax.n, dtype=np.int32),
                            np.array([highspy.HighsVarType.kInteger] * relax.n))
    starts, indices, values = [], [], []
    for _, idx, val in model.rows:
        starts.append(len(indices))
        indices += idx
        values += val
    h.addRows(len(model.rows), np.array([lo for lo, _, _ in model.rows]), np.full(len(model.rows), inf),
              len(indices), np.array(starts, dtype=np.int32), np.array(indices, dtype=np.int32),
              np.array(values))
    started = time.perf_counter()
    h.run()
    spent = time.perf_counter() - started
    info = h.getInfo()
    optimal = h.getModelStatus() == highspy.HighsModelStatus.kOptimal
    dual = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else 0.0
    # The solver's tolerances are relative to values in MiB; a millionth off keeps the bound a bound.
    bound = max(floor, int(dual * MIB * (1 - 1e-6)))
    primal = info.objective_function_value
    found = bool(info.primal_solution_status) and math.isfinite(primal)
    values = h.getSolution().col_value if found else []
    return Certificate(bound=bound, optimal=optimal, seconds=spent, relaxed_best=int(primal * MIB) if found else None,
                       dropped=tuple(v for v in range(relax.n) if values[v] < 0.5) if found else None)


class _Milp:
    """The MILP of :func:`certified_bound` as columns (bounds) and rows (``lower <= Σ value·column``), in MiB."""

    def __init__(self, relax: Relaxation) -> None:
        self.relax = relax
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.cols: dict[Any, int] = {}
        self.rows: list[tuple[float, list[int], list[float]]] = []
        self._windows: dict[int, tuple[dict[int, int], dict[tuple[int, int], int]]] = {}
        n = relax.n
        for v in range(n):
            self.col(("x", v), 1.0 if v in (0, n - 1) else 0.0, 1.0)
        self.peak = self.col(("M",), 0.0, math.inf)

    def col(self, key: Any, lower: float = 0.0, upper: float = 1.0) -> int:
        if key not in self.cols:
            self.cols[key] = len(self.lower)
            self.lower.append(lower)
            self.upper.append(upper)
        return self.cols[key]

    def row(self, lower: float, terms: Iterable[tuple[int, float]]) -> None:
        """``lower <= Σ value·column``, repeated columns summed (HiGHS refuses a row that repeats one)."""
        merged: dict[int, float] = {}
        for c, value in terms:
            merged[c] = merged.get(c, 0.0) + value
        self.rows.append((lower, list(merged), list(merged.values())))

    def x(self, v: int) -> int:
        return self.cols[("x", v)]

    def reason(self, r: Reason) -> int:
        if r[0] == "kept":
            return self.cols[("y", r[1])]
        key = ("z", r[1], r[2])
        if key not in self.cols:
            self.row(0.0, [(self.col(key), 1.0), (self.x(r[1]), -1.0), (self.x(r[2]), 1.0)])
        return self.cols[key]

    def alive(self, storages: dict[int, frozenset[Reason]]) -> list[tuple[int, float]]:
        """−bytes·indicator terms of the storages alive: one column per set of several reasons (their "or",
        the same at every event that has it)."""
        terms = []
        for sid, reasons in storages.items():
            if len(reasons) == 1:
                c = self.reason(next(iter(reasons)))
            elif ("or", reasons) in self.cols:
                c = self.cols[("or", reasons)]
            else:
                c = self.col(("or", reasons))
                for r in sorted(reasons):
                    self.row(0.0, [(c, 1.0), (self.reason(r), -1.0)])
            terms.append((c, -self.relax.sizes[sid] / MIB))
        return terms

    def paths(self, own: dict[int, int], handed: dict[tuple[int, int], int], vertices: Sequence[int],
              tag: Any) -> None:
        """r_v ≥ own_v (v dropped) and r_v ≥ r_u + own_v + handed_uv (u and v dropped) over ``vertices``
        (topological), each r_v at most the most its path can hold: the longest dropped path into v, however
        far upstream it starts, where :meth:`upstream` sums every branch but only within the window."""
        pred, inside = self.relax.pred, set(vertices)
        most: dict[int, float] = {}
        for v in vertices:
            mine = own.get(v, 0) / MIB
            most[v] = mine + max((most[u] + handed.get((u, v), 0) / MIB for u in pred[v] if u in inside),
                                 default=0.0)
            r = self.col(("r", tag, v), 0.0, most[v])
            if mine:
                self.row(mine, [(r, 1.0), (self.x(v), mine)])
            for u in pred[v]:
                if u in inside:
                    gain = mine + handed.get((u, v), 0) / MIB
                    big = gain + most[u]
                    self.row(gain, [(r, 1.0), (self.col(("r", tag, u)), -1.0), (self.x(v), big), (self.x(u), big)])

    def upstream(self, t: int) -> tuple[dict[int, int], dict[tuple[int, int], int]]:
        """For dropped vertex ``t``: a_v (v in ``t``'s window) at least 1 when v has a dropped path to ``t``
        (a_t ≥ 1 − x_t, a_u ≥ a_v − x_u along each edge u → v), and e_uv ≥ a_v − x_u, an edge into such a vertex
        from a dropped one. Made once per vertex; every event that re-runs ``t``'s call weighs them by its own
        bytes. Returns the a columns and the e columns."""
        if t not in self._windows:
            window = _upstream(self.relax.pred, t, RUN_WINDOW)
            inside = set(window)
            a = {v: self.col(("a", t, v)) for v in window}
            e = {(u, v): self.col(("e", t, u, v)) for v in window for u in self.relax.pred[v] if u in inside}
            self.row(1.0, [(a[t], 1.0), (self.x(t), 1.0)])
            for (u, v), c in e.items():
                self.row(0.0, [(c, 1.0), (a[v], -1.0), (self.x(u), 1.0)])
                self.row(0.0, [(a[u], 1.0), (c, -1.0)])
            self._windows[t] = (a, e)
        return self._windows[t]

    def rerun_bytes(self, t: int, own: dict[int, int], handed: dict[tuple[int, int], int]) -> list[tuple[int, float]]:
        """−bytes terms of what ``t``'s call re-runs upstream of ``t`` (``_call_upstream``, cut to the window)."""
        a, e = self.upstream(t)
        return ([(c, -own[v] / MIB) for v, c in a.items() if own.get(v)]
                + [(c, -handed[edge] / MIB) for edge, c in e.items() if handed.get(edge)])

    def build(self, floor: int) -> None:
        relax, n = self.relax, self.relax.n
        for v in range(n):
            y = self.col(("y", v))
            self.row(-len(relax.reads[v]), [(y, 1.0), (self.x(v), -1.0)] + [(self.x(u), -1.0) for u in relax.reads[v]])
        self.row(floor / MIB, [(self.peak, 1.0)])
        for e in relax.events:
            self.row(e.floor / MIB, [(self.peak, 1.0), *self.alive(e.alive)])
        self.paths(relax.own, relax.handed, range(n), "all")
        for t in range(n):
            extra = self.alive(relax.rerun_alive[t])
            # Both forms of the bytes re-run by t's call, each a lower bound of _call_upstream: every branch
            # within the window (vanishing with t kept: a_t may be 0) and the longest path from anywhere. Its
            # alive storages need a big-M.
            big = sum(-value for _, value in extra)
            self.row(0.0, [(self.peak, 1.0), *self.rerun_bytes(t, relax.own, relax.handed), (self.x(t), big), *extra])
            r_big = self.upper[self.cols[("r", "all", t)]] + big
            self.row(0.0, [(self.peak, 1.0), (self.cols[("r", "all", t)], -1.0), (self.x(t), r_big), *extra])
        for r in relax.reruns:
            e = relax.events[r.event]
            # With t kept its terms vanish and the row is the event's own: no big-M needed.
            self.row(e.floor / MIB, [(self.peak, 1.0), *self.rerun_bytes(r.vertex, r.own, r.handed),
                                     *self.alive(r.alive)])


def _upstream(pred: Sequence[Sequence[int]], t: int, depth: int) -> list[int]:
    """``t`` and the vertices at most ``depth`` edges upstream of it, in topological (index) order (breadth
    first: each vertex once, at its least distance, however many paths a dense block has)."""
    found = {t: 0}
    frontier = [t]
    for distance in range(1, depth + 1):
        nearer = []
        for v in frontier:
            for u in pred[v]:
                if u not in found:
                    found[u] = distance
                    nearer.append(u)
        frontier = nearer
    return sorted(found)
