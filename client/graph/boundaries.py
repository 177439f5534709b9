"""Articulation boundaries of a stage chain: cut vertices over tensor edges, and which of them are safe.

Pure graph code over node names (no torch): ``on_path_edges`` keeps the tensor-carrying edges on some
input→output path, ``cut_vertices`` finds the nodes every such path passes through in one sweep over
topological order, ``safe_boundaries`` drops those a later node writes in place (and one that feeds only
the output), and ``brute_force_cut_vertices`` is the O(V·E) reference the tests compare against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from remat.client.graph.stage_chain import StageChain

__all__ = ["brute_force_cut_vertices"]

INPUT = "<input>"
OUTPUT = "<output>"
SOURCE = "<inputs>"
"""A virtual node before every graph input: paths start at any input, a boundary lies on the main one's."""


def reachable(edges: dict[str, list[str]], start: str) -> set[str]:
    """Every node reachable from ``start`` (itself included)."""
    seen = {start}
    stack = [start]
    while stack:
        for v in edges.get(stack.pop(), ()):
            if v not in seen:
                seen.add(v)
                stack.append(v)
    return seen


def on_path_edges(
    order: list[str], edges: dict[str, list[str]], source: str, sink: str
) -> dict[str, list[str]]:
    """Restrict ``edges`` to nodes that lie on some source→sink path."""
    reach = reachable(edges, source)
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


def cut_vertices(order: list[str], path_edges: dict[str, list[str]], source: str, sink: str) -> list[str]:
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
    nodes = [u for u in edges if u not in (INPUT, OUTPUT)]
    out = []
    for w in nodes:
        seen = {INPUT}
        stack = [INPUT]
        while stack:
            u = stack.pop()
            for v in edges.get(u, ()):
                if v != w and v not in seen:
                    seen.add(v)
                    stack.append(v)
        if OUTPUT not in seen:
            out.append(w)
    return out


def safe_boundaries(
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
    while bounds and path_edges.get(bounds[-1]) == [OUTPUT]:
        bounds.pop()
    return bounds, unsafe
