"""``acg``: checkpoints for arbitrary computation graphs (Feng & Huang 2021), in our exact formulation.

The model
---------
A graph is ``weights`` (non-negative ints, bytes: vertex v's output tensor) and ``edges`` over vertices
0..n-1 numbered in topological order (every edge u < v). Vertex 0 is the unique source, n-1 the unique sink,
n ≥ 2, and every vertex lies on some 0→n-1 path (with one source and one sink in a DAG this already follows:
walking predecessors from any vertex ends at a source, walking successors at a sink). Duplicate edges are
allowed and ignored. Bad input raises :class:`~remat.client.errors.PlanError` with a one-line message.

A plan is a kept set K ⊇ {0, n-1}. The dropped vertices V∖K fall into the weakly connected components of the
subgraph they induce. Each component X must have exactly one *entry* (the kept vertices with an edge into X
form a set of size 1) and exactly one *exit* (the kept vertices with an edge out of X form a set of size 1):
at train time X is re-run from its entry under checkpoint (``remat.client.graph.op_graph`` runs the exit's op
inside the same call when the exit reads no other dropped component, so X's last tensor is not kept by the
exit's backward; the exit may also read other kept vertices). Note that every neighbour of a component
outside it is kept, so whether a component is valid depends on the component alone. The cost is the
``classic`` objective of cubic.py:

    cost(K) = Σ_{v ∈ K∖{0, n-1}} w_v + max_X Σ_{v ∈ X} w_v        (the max is 0 when nothing is dropped)

Keeping everything is always valid, and so is dropping everything (every component then has entry 0 and exit
n-1). On a chain 0→1→…→n this is cubic's classic objective with checkpoints C = K∖{0, n}: a trace with input
bytes d_0 and output bytes d_1..d_n is the chain with weights [d_0, d_1, …, d_n] (:func:`chain_as_graph`).

The algorithm: a division tree
------------------------------
A *region* is a pair of kept vertices s < t and an interior I such that every vertex of I lies on an s→t
path inside the region and every edge of an interior vertex stays in I ∪ {s, t}. Components of a plan then
never leave a region, so regions can be solved independently. For a bound M on the largest component,
Solve(region, M) is the least kept weight strictly inside the region with every dropped component ≤ M, and
the answer is min over candidate bounds M of Solve(whole graph, M) + M. The whole graph is split once, before
any M is tried, into a tree of regions of three kinds:

1. **Linear level** — the region has *splitting vertices* s = v_0 < v_1 < … < v_k < v_{k+1} = t (interior
   vertices every s→t path passes through; in topological order they are the vertices no edge jumps over).
   The pieces P_i = [v_i, v_{i+1}] are regions again. If a splitting vertex is dropped, the whole region
   strictly between the nearest kept splitting vertices on either side is dropped with it (proof at
   :func:`_linear_node`), so a chain DP over the splitting vertices is exact.
2. **Branch level** — no splitting vertex, and the interior is ≥ 2 weakly connected components, or one
   component plus a direct s→t edge. Each branch (a component with s and t) is a region, solved on its own;
   the costs add.
3. **Complicated level** — no splitting vertex, one interior component, no direct s→t edge. Up to
   ``exhaustive_limit`` interior vertices every subset is enumerated once, and Solve(·, M) is read from the
   Pareto frontier of (largest component, kept weight) by bisection; identical regions (same relabelled
   edges and weights, e.g. repeated cells) share one enumeration. Larger regions use a restricted family, a
   deterministic form of Feng & Huang's complicated level: either the whole interior is dropped, or every
   interior vertex whose in- or out-degree is not 1 is kept and each maximal run of in = out = 1 vertices
   between two kept vertices is solved as a chain with both ends kept.

Optimality: the plan is optimal whenever no complicated region has more than ``exhaustive_limit`` interior
vertices (series-parallel graphs, chains and residual networks have none at all). Beyond the limit the plan
is valid and optimal within the restricted family, which may be worse than the true optimum. Dense blocks
(every layer reads all earlier outputs) and cells that read the two previous cells are such regions.

Bounds: Solve(·, M) only changes where some component of the family can start to fit: at interval sums
between splitting vertices (runs included), at whole-region interiors and at the frontier's component sums,
so the best M is one of those or 0. Solve is non-increasing in M, so instead of trying every candidate the
sorted candidates are searched by bisection: an interval whose two ends give the same Solve is worth its
left end; an interval whose smallest M plus Solve at its right end cannot beat the best found is skipped. A
geometric ladder of bounds run first narrows the candidates to a band: every M at or below a rung whose
Solve already reaches the best total is useless, and so is every M at or above the best total itself.

Among optimal plans the one with the smallest largest component is reported: at equal cost it keeps the most
weight, so it drops (and re-runs) the fewest bytes. The division tree's DPs break remaining ties
deterministically.

References:
    Jianwei Feng and Dong Huang, "Optimal Gradient Checkpoint Search for Arbitrary Computation Graphs",
    CVPR 2021, arXiv 1808.00079.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from remat.client.errors import PlanError
from remat.client.trace import Trace

__all__ = ["GraphPlan", "Segment", "chain_as_graph", "graph_cost", "plan", "plan_graph"]

DEFAULT_EXHAUSTIVE_LIMIT = 14


@dataclass(frozen=True, slots=True)
class Segment:
    """One dropped component: its vertices are re-run from ``entry`` and feed ``exit``."""

    entry: int
    exit: int
    interior: tuple[int, ...]
    """Sorted dropped vertices."""


@dataclass(frozen=True, slots=True)
class GraphPlan:
    """A plan for a graph and its cost under the model of this module."""

    value: int
    """cost(kept): kept weight (source and sink left out) plus ``max_term``."""
    max_term: int
    """The largest component's weight, 0 when nothing is dropped."""
    kept: tuple[int, ...]
    """Sorted kept vertices, 0 and n-1 included."""
    segments: tuple[Segment, ...]
    """One per dropped component, sorted by exit (then entry, then interior)."""


# --- input checks and scoring -------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_graph(weights: Sequence[int], edges: Iterable[tuple[int, int]]) -> tuple[list[set[int]], list[set[int]]]:
    """Validate a graph; return successor and predecessor sets (duplicate edges merged)."""
    n = len(weights)
    if n < 2:
        raise PlanError(f"graph: needs at least 2 vertices (a source and a sink), got {n}")
    for v, w in enumerate(weights):
        if not _is_int(w) or w < 0:
            raise PlanError(f"weights[{v}]: must be a non-negative integer number of bytes, got {w!r}")
    succ: list[set[int]] = [set() for _ in range(n)]
    pred: list[set[int]] = [set() for _ in range(n)]
    for index, edge in enumerate(edges):
        try:
            u, v = edge
        except (TypeError, ValueError):
            raise PlanError(f"edges[{index}]: must be a pair of vertex ids, got {edge!r}") from None
        for x in (u, v):
            if not _is_int(x) or not 0 <= x < n:
                raise PlanError(f"edges[{index}]: vertex {x!r} is out of range 0..{n - 1}")
        if u == v:
            raise PlanError(f"edges[{index}]: ({u}, {v}) is a self-loop")
        if u > v:
            raise PlanError(f"edges[{index}]: ({u}, {v}) goes backward; number vertices in topological order "
                            "(every edge u < v)")
        succ[u].add(v)
        pred[v].add(u)
    for v in range(1, n):
        if not pred[v]:
            raise PlanError(f"vertex {v} has no in-edge: a second source, not on a path from 0 to {n - 1} "
                            "(vertex 0 must be the only source)")
    for v in range(n - 1):
        if not succ[v]:
            raise PlanError(f"vertex {v} has no out-edge: a second sink, not on a path from 0 to {n - 1} "
                            f"(vertex {n - 1} must be the only sink)")
    return succ, pred


def _components(n: int, succ: list[set[int]], pred: list[set[int]],
                is_kept: list[bool]) -> list[tuple[set[int], set[int], list[int]]]:
    """(entries, exits, sorted members) of each weakly connected component of the dropped vertices."""
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for u in range(n):
        if is_kept[u]:
            continue
        for v in succ[u]:
            if not is_kept[v]:
                ru, rv = find(u), find(v)
                if ru != rv:
                    parent[max(ru, rv)] = min(ru, rv)
    groups: dict[int, list[int]] = {}
    for v in range(n):
        if not is_kept[v]:
            groups.setdefault(find(v), []).append(v)
    out = []
    for members in groups.values():
        entries = {u for v in members for u in pred[v] if is_kept[u]}
        exits = {u for v in members for u in succ[v] if is_kept[u]}
        out.append((entries, exits, members))
    return out


def _score(weights: Sequence[int], succ: list[set[int]], pred: list[set[int]],
           kept: Iterable[int]) -> GraphPlan:
    """The plan record of a kept set; PlanError naming the first bad component when it is invalid."""
    n = len(weights)
    is_kept = [False] * n
    for v in kept:
        if not _is_int(v) or not 0 <= v < n:
            raise PlanError(f"kept: vertex {v!r} is out of range 0..{n - 1}")
        is_kept[v] = True
    for v in (0, n - 1):
        if not is_kept[v]:
            raise PlanError(f"kept: must contain the source 0 and the sink {n - 1}, vertex {v} is missing")
    segments = []
    max_term = 0
    for entries, exits, members in _components(n, succ, pred, is_kept):
        for name, ends in (("entries", entries), ("exits", exits)):
            if len(ends) != 1:
                raise PlanError(f"kept: the dropped component {members} has {len(ends)} {name} "
                                f"{sorted(ends)}, must have exactly one")
        segments.append(Segment(entry=next(iter(entries)), exit=next(iter(exits)), interior=tuple(members)))
        max_term = max(max_term, sum(weights[v] for v in members))
    kept_sorted = tuple(v for v in range(n) if is_kept[v])
    value = sum(weights[v] for v in kept_sorted[1:-1]) + max_term
    segments.sort(key=lambda s: (s.exit, s.entry, s.interior))
    return GraphPlan(value=value, max_term=max_term, kept=kept_sorted, segments=tuple(segments))


def graph_cost(weights: Sequence[int], edges: Sequence[tuple[int, int]], kept: Iterable[int]) -> int:
    """cost(kept) under the model above: callers score any plan with it.

    Raises:
        PlanError: when the graph is malformed, or ``kept`` misses 0 or n-1, names an unknown vertex, or leaves
            a dropped component with other than one entry and one exit.
    """
    succ, pred = check_graph(weights, edges)
    return _score(weights, succ, pred, kept).value


def chain_as_graph(d: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """The chain 0→1→…→n with weights [d_0, d_1, …, d_n]: a trace's stages as a graph."""
    return list(d), [(i, i + 1) for i in range(len(d) - 1)]


# --- the division tree ----------------------------------------------------------------------------------
#
# Nodes are built top-down, so a node's id is smaller than its children's: solving for a bound M walks the
# ids backwards (children first), reconstructing walks them forwards (parents first). Neither recurses, so
# deeply nested graphs do not meet Python's recursion limit. A node whose whole interior weighs ≤ M costs 0
# (the whole interior dropped, always valid) without running its solver; vals[c] for a child c is that
# child's Solve(·, M).


class _Linear:
    """A region with splitting vertices v_1..v_k (or a run of in = out = 1 vertices, whose pieces are empty).

    A[j] is the weight strictly between s and v_j, B[i] = A[i] + w(v_i), so the region strictly between
    v_i and v_j weighs S(i, j) = A[j] - B[i]; both are non-decreasing, hence the sliding window.
    """

    __slots__ = ("verts", "sw", "A", "B", "children")

    def __init__(self, verts: list[int], sw: list[int], A: list[int], B: list[int], children: list[int]) -> None:
        self.verts = verts  # v_1..v_k
        self.sw = sw  # [0, w(v_1), …, w(v_k), 0]
        self.A = A
        self.B = B
        self.children = children  # node id of piece P_i, -1 when its interior is empty

    def solve(self, bound: int, vals: list[int], parent: list[int] | None = None) -> int:
        """f[k+1] of the chain DP; ``parent[j]`` records j-1 (piece solved) or i (v_i..v_j dropped)."""
        A, B, sw, children = self.A, self.B, self.sw, self.children
        last = len(sw) - 1
        f = [0] * (last + 1)
        window: deque[int] = deque()  # i ≤ j-2 with increasing f[i]
        lo = 0
        for j in range(1, last + 1):
            c = children[j - 1]
            best = f[j - 1] + vals[c] if c >= 0 else f[j - 1]
            choice = j - 1
            if j >= 2:
                i = j - 2
                fi = f[i]
                while window and f[window[-1]] >= fi:
                    window.pop()
                window.append(i)
                need = A[j] - bound  # admissible i have B[i] ≥ need
                while lo <= i and B[lo] < need:
                    lo += 1
                while window and window[0] < lo:
                    window.popleft()
                if window and f[window[0]] < best:
                    choice = window[0]
                    best = f[choice]
            f[j] = best + sw[j]
            if parent is not None:
                parent[j] = choice
        return f[last]

    def reconstruct(self, bound: int, vals: list[int], kept: list[int], active: list[bool]) -> None:
        last = len(self.sw) - 1
        parent = [0] * (last + 1)
        self.solve(bound, vals, parent)
        j = last
        while j > 0:
            i = parent[j]
            if i == j - 1 and self.children[i] >= 0:
                active[self.children[i]] = True
            if i > 0:
                kept.append(self.verts[i - 1])
            j = i

    def candidates(self, low: int, high: int, out: set[int]) -> None:
        """Every S(i, j), j ≥ i + 2, with low < S < high."""
        A, B = self.A, self.B
        size = len(A)
        for i in range(size - 2):
            start = bisect_right(A, B[i] + low, i + 2, size)
            stop = bisect_right(A, B[i] + high - 1, start, size)
            out.update(a - B[i] for a in A[start:stop])


class _Sum:
    """Independent parts: a branch level (base 0), or a large complicated region's restricted family (base =
    the fixed kept vertices' weight, children = the runs)."""

    __slots__ = ("base", "fixed", "children")

    def __init__(self, base: int, fixed: list[int], children: list[int]) -> None:
        self.base = base
        self.fixed = fixed
        self.children = children

    def solve(self, bound: int, vals: list[int]) -> int:
        return self.base + sum(vals[c] for c in self.children)

    def reconstruct(self, bound: int, vals: list[int], kept: list[int], active: list[bool]) -> None:
        kept.extend(self.fixed)
        for c in self.children:
            active[c] = True

    def candidates(self, low: int, high: int, out: set[int]) -> None:
        return None


class _Frontier:
    """A small complicated region: the Pareto frontier of every valid subset, read by bisection."""

    __slots__ = ("interior", "max_terms", "kept_sums", "dropped_masks")

    def __init__(self, interior: list[int], frontier: tuple[list[int], list[int], list[int]]) -> None:
        self.interior = interior
        self.max_terms, self.kept_sums, self.dropped_masks = frontier

    def solve(self, bound: int, vals: list[int]) -> int:
        return self.kept_sums[bisect_right(self.max_terms, bound) - 1]

    def reconstruct(self, bound: int, vals: list[int], kept: list[int], active: list[bool]) -> None:
        mask = self.dropped_masks[bisect_right(self.max_terms, bound) - 1]
        kept.extend(v for b, v in enumerate(self.interior) if not mask >> b & 1)

    def candidates(self, low: int, high: int, out: set[int]) -> None:
        out.update(m for m in self.max_terms if low < m < high)


_Node = _Linear | _Sum | _Frontier


def _exhaustive_frontier(weights: list[int], in_masks: list[int], out_masks: list[int], from_s: int,
                         to_t: int) -> tuple[list[int], list[int], list[int]]:
    """(max_terms ascending, kept sums descending, dropped masks) of the non-dominated valid subsets.

    Interior vertex b is bit b; ``in_masks[b]``/``out_masks[b]`` are its interior in/out-neighbours and bit b of
    ``from_s``/``to_t`` says whether s feeds it / it feeds t. Every dropped set D is solved once, in increasing
    order: its component c holding the lowest bit is flooded through the neighbour tables, and D is valid iff
    c has one entry and one exit (every neighbour outside c is kept) and D ∖ c, a smaller mask, is valid.
    """
    r = len(weights)
    size = 1 << r
    wsum = [0] * size
    in_u = [0] * size
    out_u = [0] * size
    for m in range(1, size):
        low = m & -m
        b = low.bit_length() - 1
        rest = m ^ low
        wsum[m] = wsum[rest] + weights[b]
        in_u[m] = in_u[rest] | in_masks[b]
        out_u[m] = out_u[rest] | out_masks[b]
    valid = bytearray(size)
    valid[0] = 1
    max_term = [0] * size
    for dropped in range(1, size):
        comp = dropped & -dropped
        while True:
            grown = (comp | in_u[comp] | out_u[comp]) & dropped
            if grown == comp:
                break
            comp = grown
        rest = dropped ^ comp
        if not valid[rest]:
            continue
        if (in_u[comp] & ~comp).bit_count() + (1 if comp & from_s else 0) != 1:
            continue
        if (out_u[comp] & ~comp).bit_count() + (1 if comp & to_t else 0) != 1:
            continue
        valid[dropped] = 1
        max_term[dropped] = max(max_term[rest], wsum[comp])
    total = wsum[size - 1]
    best: dict[int, tuple[int, int]] = {}  # max term -> (kept sum, dropped mask), least kept then least mask
    for dropped in range(size):
        if valid[dropped]:
            key = (total - wsum[dropped], dropped)
            m = max_term[dropped]
            if m not in best or key < best[m]:
                best[m] = key
    max_terms: list[int] = []
    kept_sums: list[int] = []
    masks: list[int] = []
    for m in sorted(best):
        kept_sum, dropped = best[m]
        if not kept_sums or kept_sum < kept_sums[-1]:
            max_terms.append(m)
            kept_sums.append(kept_sum)
            masks.append(dropped)
    return max_terms, kept_sums, masks


@dataclass(slots=True)
class _Tree:
    nodes: list[_Node]
    totals: list[int]  # interior weight of each node's region


def build_tree(weights: Sequence[int], succ: list[set[int]], pred: list[set[int]], exhaustive_limit: int) -> _Tree:
    """Split the whole graph into the division tree (independent of any bound M)."""
    n = len(weights)
    nodes: list[_Node] = []
    totals: list[int] = []
    frontiers: dict[tuple, tuple[list[int], list[int], list[int]]] = {}
    # Work items: (s, t, sorted interior, direct s→t edge counts, parent's children list, slot in it); s = t = -1
    # marks a run of a restricted region (its ends are kept by the parent, so they play no part).
    root_children = [-1]
    work: list[tuple[int, int, list[int], bool, list[int], int]] = [
        (0, n - 1, list(range(1, n - 1)), (n - 1) in succ[0], root_children, 0)]
    while work:
        s, t, interior, direct, slots, slot = work.pop()
        if not interior:
            continue
        node_id = len(nodes)
        slots[slot] = node_id
        totals.append(sum(weights[v] for v in interior))
        if s < 0:  # a run of a restricted region: a chain whose every vertex splits it
            nodes.append(_linear_node(weights, succ, [s, *interior, t], list(range(1, len(interior) + 1)), work))
            continue
        nodes.append(_Sum(0, [], []))  # placeholder, replaced below
        order = [s, *interior, t]
        pos = {v: p for p, v in enumerate(order)}
        cover = [0] * (len(order) + 1)
        for p, u in enumerate(order[:-1]):
            for v in succ[u]:
                q = pos.get(v)
                if q is None or (p == 0 and q == len(order) - 1 and not direct):
                    continue
                if q > p + 1:
                    cover[p + 1] += 1
                    cover[q] -= 1
        splitting: list[int] = []
        running = 0
        for p in range(1, len(order) - 1):
            running += cover[p]
            if running == 0:
                splitting.append(p)
        if splitting:
            nodes[node_id] = _linear_node(weights, succ, order, splitting, work)
            continue
        components = _weak_components(interior, succ, pred, pos)
        if len(components) >= 2 or direct:
            node = _Sum(0, [], [-1] * len(components))
            nodes[node_id] = node
            for index, comp in enumerate(components):
                work.append((s, t, comp, False, node.children, index))
            continue
        if len(interior) <= exhaustive_limit:
            bit = {v: b for b, v in enumerate(interior)}
            in_masks = [sum(1 << bit[u] for u in pred[v] if u != s) for v in interior]
            out_masks = [sum(1 << bit[u] for u in succ[v] if u != t) for v in interior]
            from_s = sum(1 << b for b, v in enumerate(interior) if s in pred[v])
            to_t = sum(1 << b for b, v in enumerate(interior) if t in succ[v])
            local_weights = [weights[v] for v in interior]
            key = (tuple(local_weights), tuple(in_masks), tuple(out_masks), from_s, to_t)
            if key not in frontiers:
                frontiers[key] = _exhaustive_frontier(local_weights, in_masks, out_masks, from_s, to_t)
            nodes[node_id] = _Frontier(interior, frontiers[key])
            continue
        nodes[node_id] = _restricted_node(weights, succ, pred, interior, work)
    return _Tree(nodes, totals)


def _linear_node(weights: Sequence[int], succ: list[set[int]], order: list[int], splitting: list[int],
                 work: list) -> _Linear:
    """The chain DP of a region with splitting vertices at positions ``splitting`` of ``order``.

    Why the DP is exact. Let v_j be a dropped splitting vertex in component X, and e the exit of X. Every path
    from v_j forward meets a kept vertex (t is kept); the first one it meets has an edge from X, so it is e.
    Hence every v_j→t path, and so every s→t path, passes through e: e is a splitting vertex after v_j (or t).
    Any region vertex x with v_j < x < e lies on an s→t path, which reaches x after v_j; were x kept, the first
    kept vertex on that v_j→x stretch would be an exit before e. So everything strictly between v_j and e is
    dropped, and connected to v_j; symmetrically back to the entry, a splitting vertex (or s). No edge jumps
    over a splitting vertex, so that stretch has exactly that entry and that exit: dropping a splitting
    vertex means dropping the whole region between two kept splitting vertices as one component, admissible
    iff it weighs ≤ M. Between two adjacent kept splitting vertices the piece is a region of its own.
    """
    verts = [order[p] for p in splitting]
    bounds = [0, *splitting, len(order) - 1]
    sw = [0, *(weights[v] for v in verts), 0]
    A = [0]
    B = [0]
    children = [-1] * (len(bounds) - 1)
    for i in range(len(bounds) - 1):
        a, b = bounds[i], bounds[i + 1]
        piece = order[a + 1:b]
        A.append(B[-1] + sum(weights[v] for v in piece))
        B.append(A[-1] + sw[i + 1])
        if piece:
            u, v = order[a], order[b]
            work.append((u, v, piece, v in succ[u], children, i))
    return _Linear(verts, sw, A, B, children)


def _weak_components(interior: list[int], succ: list[set[int]], pred: list[set[int]],
                     pos: dict[int, int]) -> list[list[int]]:
    """Weakly connected components of the interior, each sorted, in order of their least vertex."""
    seen: set[int] = set()
    out = []
    for start in interior:
        if start in seen:
            continue
        seen.add(start)
        stack = [start]
        comp = []
        while stack:
            u = stack.pop()
            comp.append(u)
            for v in (*succ[u], *pred[u]):
                p = pos.get(v)
                if p is not None and 0 < p < len(pos) - 1 and v not in seen:
                    seen.add(v)
                    stack.append(v)
        out.append(sorted(comp))
    return out


def _restricted_node(weights: Sequence[int], succ: list[set[int]], pred: list[set[int]], interior: list[int],
                     work: list) -> _Sum:
    """A large complicated region: keep every vertex of in- or out-degree ≠ 1, solve the runs between as chains.

    Every edge of an interior vertex stays in the region, so its degrees in the region are its degrees in the
    graph. A run u_1→…→u_m of in = out = 1 vertices between kept p and q is a chain: any dropped stretch of
    it has the kept vertex before it as its only entry and the one after it as its only exit.
    """
    simple = {v for v in interior if len(pred[v]) == 1 and len(succ[v]) == 1}
    fixed = [v for v in interior if v not in simple]
    node = _Sum(sum(weights[v] for v in fixed), fixed, [])
    for v in interior:
        if v not in simple or next(iter(pred[v])) in simple:
            continue
        run = [v]
        nxt = next(iter(succ[v]))
        while nxt in simple:
            run.append(nxt)
            nxt = next(iter(succ[nxt]))
        node.children.append(-1)
        work.append((-1, -1, run, False, node.children, len(node.children) - 1))
    return node


# --- the search over bounds -----------------------------------------------------------------------------


class Search:
    """Solve(whole graph, M) for any M, and the bisection over candidate bounds."""

    def __init__(self, tree: _Tree) -> None:
        self.tree = tree
        self.best: tuple[int, int] | None = None  # (cost, M), least cost then least M
        self.evaluations = 0

    def values(self, bound: int) -> list[int]:
        nodes, totals = self.tree.nodes, self.tree.totals
        vals = [0] * len(nodes)
        for index in range(len(nodes) - 1, -1, -1):
            if totals[index] > bound:
                vals[index] = nodes[index].solve(bound, vals)
        return vals

    def cost(self, bound: int) -> int:
        """Solve(whole graph, bound), recording bound + it as a candidate total."""
        self.evaluations += 1
        f = self.values(bound)[0] if self.tree.nodes else 0
        if self.best is None or (f + bound, bound) < self.best:
            self.best = (f + bound, bound)
        return f

    def run(self) -> int:
        """The best bound: the least M of the least Solve + M over all candidates."""
        total = self.tree.totals[0] if self.tree.nodes else 0
        self.cost(total)
        self.cost(0)
        low = 0  # bounds ≤ low are settled: their Solve alone reaches the best total
        bound = total // 2
        while bound > 0:
            assert self.best is not None
            if self.cost(bound) >= self.best[0]:
                low = bound
                break
            bound //= 2
        assert self.best is not None
        found: set[int] = set()
        for node in self.tree.nodes:
            node.candidates(low, self.best[0], found)
        found.update(t for t in self.tree.totals if low < t < self.best[0])
        candidates = sorted(found)
        if candidates:
            first, last = self.cost(candidates[0]), self.cost(candidates[-1])
            self._bisect(candidates, 0, len(candidates) - 1, first, last)
        return self.best[1]

    def _bisect(self, candidates: list[int], i: int, j: int, fi: int, fj: int) -> None:
        """Search candidates strictly between i and j, whose Solve values fi ≥ fj are known."""
        if j - i <= 1 or fi == fj:
            return  # all of them cost at least fj = fi and are larger than candidates[i]
        assert self.best is not None
        floor = candidates[i + 1] + fj
        if floor > self.best[0] or (floor == self.best[0] and candidates[i + 1] >= self.best[1]):
            return
        mid = (i + j) // 2
        fm = self.cost(candidates[mid])
        self._bisect(candidates, i, mid, fi, fm)
        self._bisect(candidates, mid, j, fm, fj)

    def kept(self, bound: int) -> list[int]:
        """The interior vertices the division tree keeps for ``bound``."""
        nodes, totals = self.tree.nodes, self.tree.totals
        vals = self.values(bound)
        active = [False] * len(nodes)
        kept: list[int] = []
        if nodes:
            active[0] = True
        for index, node in enumerate(nodes):
            if active[index] and totals[index] > bound:
                node.reconstruct(bound, vals, kept, active)
        return kept


def plan_graph(weights: Sequence[int], edges: Sequence[tuple[int, int]], *,
               exhaustive_limit: int = DEFAULT_EXHAUSTIVE_LIMIT) -> GraphPlan:
    """The kept set of least cost (see the module docstring for the model, the algorithm and its guarantee).

    ``exhaustive_limit`` is the largest complicated region enumerated subset by subset (2^r subsets, each in
    O(r) big-integer steps, so every step up doubles the time); 0 uses the restricted family
    everywhere.

    Example:
        >>> plan_graph([1, 5, 5, 1], [(0, 1), (0, 2), (1, 3), (2, 3)]).segments  # a diamond: drop both arms
        (Segment(entry=0, exit=3, interior=(1,)), Segment(entry=0, exit=3, interior=(2,)))

    Raises:
        PlanError: when the graph breaks the model's rules (the message names what is wrong).
    """
    if not _is_int(exhaustive_limit) or exhaustive_limit < 0:
        raise PlanError(f"exhaustive_limit: must be an integer ≥ 0, got {exhaustive_limit!r}")
    succ, pred = check_graph(weights, edges)
    tree = build_tree(weights, succ, pred, exhaustive_limit)
    search = Search(tree)
    bound = search.run()
    result = _score(weights, succ, pred, [0, *search.kept(bound), len(weights) - 1])
    assert search.best is not None and result.value == search.best[0], (result.value, search.best)
    return result


def plan_trace_graph(trace: Trace) -> GraphPlan:
    """The plan on the trace's op graph (``trace.graph``), which must be present."""
    if trace.graph is None:
        raise PlanError("trace: has no op graph (graph); acg plans its chain instead (plan)")
    return plan_graph(trace.graph.weights, trace.graph.edges)


@dataclass(frozen=True, slots=True)
class GraphPlanned:
    """A graph planner's answer on a trace's op graph, as the registry hands it to plan reporting."""

    dropped_vertices: tuple[int, ...]
    predicted_peak_bytes: int
    """Under the planner's own model (here: classic)."""
    baseline_peak_bytes: int
    """The same model's peak with every vertex kept."""
    cost_model: str = "classic"


def plan_trace_graph_dropped(trace: Trace) -> GraphPlanned:
    """The registry's graph planner: the dropped vertices of :func:`plan_trace_graph`'s plan, its classic value
    (the kept vertices' bytes plus the largest recomputed group) and the value of keeping every vertex."""
    result = plan_trace_graph(trace)
    assert trace.graph is not None  # plan_trace_graph refused a trace without one
    weights, edges = trace.graph.weights, trace.graph.edges
    return GraphPlanned(dropped_vertices=tuple(v for seg in result.segments for v in seg.interior),
                        predicted_peak_bytes=result.value,
                        baseline_peak_bytes=graph_cost(weights, edges, range(len(weights))))


def plan(trace: Trace, *, cost_model: str = "classic") -> tuple[int, ...]:
    """Checkpoints minimising the classic cost model, found by the graph planner on the trace's chain.

    ``cost_model`` is accepted for the common planner signature and ignored, as in cubic.py: the graph model
    is the classic one. On a chain every region is linear, so the plan is exact.
    """
    weights, edges = chain_as_graph([trace.input_bytes, *trace.column("output_bytes")])
    return plan_graph(weights, edges).kept[1:-1]
