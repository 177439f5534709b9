"""Parked values (NOTE [ parked values ] in remat.client.graph.boundaries), on small graphs written by hand.

The oracle is the graph itself: which nodes lie between a value and its next reader, which inputs they descend
from, and whether they hold a whole block. Each case changes one of those and the answer with it.
"""

from __future__ import annotations

from remat.client.graph.boundaries import cut_vertices, parked_gaps

SOURCE, OUTPUT = "<inputs>", "<output>"


def _graph(*edges: str) -> tuple[list[str], dict[str, list[str]]]:
    """Order and edges from "u v" strings; the order is that of first appearance (a topological one here)."""
    order: list[str] = [SOURCE]
    out: dict[str, list[str]] = {}
    for edge in edges:
        u, v = edge.split()
        for name in (u, v):
            if name not in order:
                order.append(name)
            out.setdefault(name, [])
        out[u].append(v)
    order.remove(OUTPUT)
    order.append(OUTPUT)
    return order, out


# A seq2seq call: labels shifted (shift) before the encoder (e1, e2: one block each), read by the decoder (d).
SEQ2SEQ = ("<inputs> ids", "<inputs> labels", "labels shift", "ids emb", "emb e1", "e1 e2", "e2 d", "shift d",
           "d loss", "labels loss", "loss <output>")
BLOCKS = {"e1": ("encoder.layers", 0), "e2": ("encoder.layers", 1), "d": ("decoder.layers", 0)}
INPUTS = {"ids": 1, "labels": 2}
CANDIDATES = {"emb", "e1", "e2", "d", "loss"}


def _jump(edges: dict[str, list[str]]) -> dict[str, list[str]]:
    """What the stage builder counts: not the held inputs' own edges nor the virtual source's."""
    return {u: vs for u, vs in edges.items() if u not in (SOURCE, "ids", "labels")}


def test_a_shifted_label_waits_through_the_encoder() -> None:
    order, edges = _graph(*SEQ2SEQ)
    jump = _jump(edges)
    # Boundaries are cut vertices on the ids' paths (the stage builder's filter), never a parked value.
    assert [c for c in cut_vertices(order, jump, SOURCE, OUTPUT) if c in CANDIDATES] == ["d", "loss"]
    gaps = parked_gaps(order, edges, jump, INPUTS, CANDIDATES, BLOCKS)
    assert gaps == {"shift": [("shift", "d")]}
    assert [c for c in cut_vertices(order, jump, SOURCE, OUTPUT, gaps) if c in CANDIDATES] == \
        ["emb", "e1", "e2", "d", "loss"]


def test_a_tower_output_waits_through_the_other_tower() -> None:
    """CLIP: the image tower (p1, p2) runs first, its embedding (img) waits while the text tower (t1, t2) runs,
    and the loss reads both. A gradient reaches img (its tail is profiled with it: NOTE [ seeding a stage's
    exports ]); it is parked all the same, and the text tower is cut."""
    order, edges = _graph("<inputs> ids", "<inputs> pixels", "pixels p1", "p1 p2", "p2 img", "ids t1", "t1 t2",
                          "t2 txt", "img loss", "txt loss", "loss <output>")
    jump = _jump(edges)
    blocks = {"p1": ("vision.layers", 0), "p2": ("vision.layers", 1), "t1": ("text.layers", 0),
              "t2": ("text.layers", 1)}
    inputs = {"ids": 1, "pixels": 2}
    candidates = {"p1", "p2", "img", "t1", "t2", "txt", "loss"}
    assert [c for c in cut_vertices(order, jump, SOURCE, OUTPUT) if c in candidates] == \
        ["p1", "p2", "img", "loss"]
    gaps = parked_gaps(order, edges, jump, inputs, candidates, blocks)
    assert gaps == {"img": [("img", "loss")]}
    assert [c for c in cut_vertices(order, jump, SOURCE, OUTPUT, gaps) if c in candidates] == \
        ["p1", "p2", "img", "t1", "t2", "txt", "loss"]


def test_nothing_waits_in_a_graph_of_one_input() -> None:
    order, edges = _graph("<inputs> x", "x a", "a b", "b c", "a c", "c <output>")
    assert parked_gaps(order, edges, _jump(edges), {"x": 1}, {"a", "b", "c"}, {"b": ("layers", 0)}) == {}


def test_a_stretch_without_a_whole_block_is_not_parked() -> None:
    order, edges = _graph(*SEQ2SEQ)
    one_block = dict.fromkeys(("e1", "e2", "d"), ("layers", 0))  # the decoder's part is outside the stretch
    assert parked_gaps(order, edges, _jump(edges), INPUTS, CANDIDATES, one_block) == {}
    own_blocks = {**one_block, "d": ("layers", 1)}
    assert parked_gaps(order, edges, _jump(edges), INPUTS, CANDIDATES, own_blocks) == \
        {"shift": [("shift", "d")]}


def test_a_stretch_without_a_possible_boundary_is_not_parked() -> None:
    order, edges = _graph(*SEQ2SEQ)
    assert parked_gaps(order, edges, _jump(edges), INPUTS, {"d", "loss"}, BLOCKS) == {}


def test_a_residual_branch_shares_the_blocks_input_and_is_never_parked() -> None:
    # x -> body (a, b) -> add, and a shortcut s computed from x between the body and the add.
    # A second input (a mask read by the add) keeps the graph from being one input's.
    order, edges = _graph("<inputs> x", "<inputs> mask", "x a", "a b", "x s", "b add", "s add", "mask add",
                          "add <output>")
    blocks = dict.fromkeys(("a", "b", "s", "add"), ("layers", 0))
    jump = {u: vs for u, vs in edges.items() if u not in (SOURCE, "mask")}
    assert parked_gaps(order, edges, jump, {"x": 1, "mask": 2}, {"a", "b", "s", "add"}, blocks) == {}
