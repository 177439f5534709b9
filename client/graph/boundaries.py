"""Articulation boundaries of a stage chain: cut vertices over tensor edges, and which of them are safe.

Pure graph code over node names (no torch): ``on_path_edges`` keeps the tensor-carrying edges on some
input→output path, ``cut_vertices`` finds the nodes every such path passes through in one sweep over
topological order, ``safe_boundaries`` drops those a later node writes in place (and one that feeds only
the output), and ``brute_force_cut_vertices`` is the O(V·E) reference the tests compare against.
"""

from __future__ import annotations

from collections.abc import Mapping
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


def cut_vertices(order: list[str], path_edges: dict[str, list[str]], source: str, sink: str,
                 gaps: Mapping[str, list[tuple[str, str]]] | None = None) -> list[str]:
    """Nodes every source→sink path passes through, by one sweep over topological order.

    In a DAG laid out in topological order, an on-path node is a cut vertex iff no on-path edge jumps over
    it; a difference array over edge spans finds all of them in O(V + E). ``gaps``: stretches a node's edges
    do not cover (``parked_gaps``).
    """
    pos = {name: i for i, name in enumerate(order)}
    diff = [0] * (len(order) + 1)
    for u, vs in path_edges.items():
        for v in vs:
            a, b = pos[u], pos[v]
            if b > a + 1:
                diff[a + 1] += 1
                diff[b] -= 1
        for after, before in (gaps or {}).get(u, ()):  # inside every edge of u that reaches past it
            a, b = pos[after], pos[before]
            covering = sum(1 for v in vs if pos[v] >= b)
            diff[a + 1] -= covering
            diff[b] += covering
    cover, out = 0, []
    for i, name in enumerate(order):
        cover += diff[i]
        if cover == 0 and name in path_edges and name not in (source, sink):
            out.append(name)
    return out


def parked_gaps(order: list[str], path_edges: dict[str, list[str]], jump_edges: dict[str, list[str]],
                inputs: dict[str, int], candidates: set[str],
                blocks: Mapping[str, tuple[str, int]]) -> dict[str, list[tuple[str, str]]]:
    """Stretches where a value waits, untouched, while a part of the graph that shares no input with it runs:
    node -> [(the node before the stretch, the node after it)].

    NOTE [ parked values ] BART, T5 and every encoder–decoder given ``labels`` shift them right into the
    decoder's input ids before the encoder runs; the decoder reads them after it. That edge jumped over the
    whole encoder, so no node there was a cut vertex and the encoder was one stage (BART, 4 + 4 layers, 4 ×
    128 tokens: 25 stages, all in the decoder, 28.2 of 50.5 MiB with `linear`; with its encoder cut, 45
    stages and 11.6 MiB). Such a value is handed from the stage that makes it to the stages that read it,
    like a side value (NOTE [side values]; it is one: alive beside every stage it crosses, in the eager model
    too), so its edges do not cover the stretch it waits through.
    A stretch is a run of on-path nodes between two readers of the value (or the value and its first reader)
    that descend from none of the graph inputs the value descends from (``inputs``: input node -> its bit;
    descent over ``path_edges``, held inputs' edges included; values are the nodes of ``jump_edges``) and
    hold a whole repeated block (``blocks``: node -> its block, ``stage_graph.block_of``) and a node that could
    be a boundary (``candidates``): another tower. A residual branch or a downsampled shortcut computed
    between a block's body and its add descends from the block's own input, and a mask built between a
    transformer's embeddings and its first block holds no block, so a ResNet's or a language model's chain is
    never changed by this; nor is a cross-attention, whose keys and values are computed from the encoder's
    output while its queries wait, inside one block.
    A floating value waits the same way: CLIP's image embedding while the text tower runs, after which the
    loss reads both (CLIP went from one stage to 17 with it). The stage that makes it also starts the text
    tower, so its gradient reaches that stage by the parked value only; the profiler seeds it there (NOTE
    [ seeding a stage's exports ] in remat.worker.profilers.export_seeds), without which those plans were
    predicted −20% to +2.6% against measured.
    """
    if len(inputs) < 2:  # one input: everything descends from it, nothing waits for another part of the graph
        return {}
    values = [u for u, vs in jump_edges.items() if vs]
    pos = {name: i for i, name in enumerate(order)}
    readers: dict[str, list[str]] = {}
    for u, vs in path_edges.items():
        for v in vs:
            readers.setdefault(v, []).append(u)
    sources: dict[str, int] = {}
    for name in order:  # the inputs each on-path node descends from, as bits
        sources[name] = inputs.get(name, 0)
        for u in readers.get(name, ()):
            sources[name] |= sources.get(u, 0)
    block_size: dict[tuple[str, int], int] = {}
    for name in order:
        if name in path_edges and name in blocks:
            block_size[blocks[name]] = block_size.get(blocks[name], 0) + 1

    def holds_a_block(run: list[int]) -> bool:
        seen: dict[tuple[str, int], int] = {}
        for j in run:
            if order[j] in blocks:
                seen[blocks[order[j]]] = seen.get(blocks[order[j]], 0) + 1
        return any(count == block_size[b] for b, count in seen.items())

    gaps: dict[str, list[tuple[str, str]]] = {}
    for u in values:
        if u not in pos or not sources.get(u):
            continue
        before = pos[u]
        for at in sorted({pos[v] for v in jump_edges[u]}):
            run: list[int] = []  # positions of the current run of on-path nodes foreign to u
            for i in range(before + 1, at + 1):
                w = order[i]
                if i < at and w not in path_edges:
                    continue
                if i < at and not sources[w] & sources[u]:
                    run.append(i)
                    continue
                if run and any(order[j] in candidates for j in run) and holds_a_block(run):
                    gaps.setdefault(u, []).append((order[run[0] - 1], order[run[-1] + 1]))
                run = []
            before = at
    return gaps


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
