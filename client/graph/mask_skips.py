"""Padding masks without padding: the attention path transformers' eager forward takes for each batch.

NOTE [ masks without padding ] transformers builds every attention mask in ``masking_utils``, and there it
decides, per mask, whether the mask can be left out: a padding mask whose every position is kept (no padding)
at equal query and key lengths becomes SDPA's ``is_causal`` (a causal model) or no mask at all (an encoder).
Eagerly it reads the mask's values to decide (``padding_mask.all()``); exported, it cannot, and always builds
the mask, which holds for every batch. The two paths are different kernels (on CUDA, flash attention against
a masked one; a ``(batch, 1, len, len)`` mask materialised), and they agree bit for bit often, not always (a
tiny Llava at 3×40 on CPU differed in the last bits). So a graph exported for a call with a mask computed other
bits than the model's own forward for every batch without padding: refused at planning where they differed at
the example's sizes, silently inexact for later batches.

An export now takes, for each mask it builds, the decision it is told (``export_skips``): to build it (what
export does) or to skip it as the eager forward does for a mask without padding. Every such decision point
also leaves in the graph a marker (``aten._assert_async`` on ``padding_mask.all()``, its message naming the
decision's index), so that the graph says how each decision is computed from the call's inputs, whatever the
model did to its mask on the way (GPT-2 reshapes it, T5 builds two from one). ``split_precondition`` moves the
markers and what only they need out of the graph into a small graph of its own, the precondition: run on a
call's inputs, it gives the eager forward's decisions for that call. ``export_model`` exports a call with its
own decisions (a batch without padding gets the skipping graph); an applied model asks its chain's
precondition before every training call and runs a call whose decisions differ on a chain exported with them
(NOTE [ other sizes ] in remat.client.apply_plan). Decisions are only asked where the eager forward would skip
a mask without padding at this call's sizes (a decision point at other sizes cannot be skipped anyway).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

__all__ = ["MASK_SKIPS", "PRECONDITION", "export_skips", "mask_decisions", "split_precondition"]

MASK_SKIPS = "remat_mask_skips"
"""``meta`` entry of an exported graph: the decision it was exported with at each of its mask decision points,
in order (True: the mask is skipped, as the eager forward does without padding); empty without any."""
PRECONDITION = "remat_mask_precondition"
"""``meta`` entry beside ``MASK_SKIPS``: a graph module taking the flat inputs of the call and returning, per
decision point, whether that mask has no padding (a 0-dimensional bool tensor each); None without any."""
_MARK = "remat: padding mask decision "


@contextlib.contextmanager
def export_skips(skips: tuple[bool, ...]) -> Iterator[None]:
    """While exporting: give transformers' mask decisions ``skips`` (decision points in the order the forward
    reaches them; False beyond), and leave a marker at each (module docstring). Nothing without transformers."""
    module = sys.modules.get("transformers.masking_utils")
    if module is None:
        yield
        return
    original_causal = getattr(module, "_ignore_causal_mask_sdpa", None)
    original_bidirectional = getattr(module, "_ignore_bidirectional_mask_sdpa", None)
    reached = [0]

    def decide(padding_mask: torch.Tensor) -> bool:
        index = reached[0]
        reached[0] += 1
        torch.ops.aten._assert_async.msg(padding_mask.all(), f"{_MARK}{index}")
        return skips[index] if index < len(skips) else False

    def causal(padding_mask: Any, q_length: Any, kv_length: Any, q_offset: Any, kv_offset: Any,
               local_attention_size: int | None = None) -> bool:
        if padding_mask is not None and padding_mask.shape[-1] > kv_length:
            padding_mask = padding_mask[:, kv_offset:kv_offset + kv_length]
        if local_attention_size is not None and kv_length >= local_attention_size:
            return False
        if not (q_length == 1 or kv_length == q_length):
            return False  # eagerly skipped, with padding, only for a static cache's prefill: never in training
        if padding_mask is None:
            return True  # the eager answer holds for every call of this signature (no mask in it)
        return decide(padding_mask)

    def bidirectional(padding_mask: Any, kv_length: Any, local_attention_size: int | None = None) -> bool:
        if local_attention_size is not None and kv_length >= local_attention_size:
            return False
        if padding_mask is None:
            return True
        return decide(padding_mask)

    patches = [(name, fn, original) for name, fn, original in (
        ("_ignore_causal_mask_sdpa", causal, original_causal),
        ("_ignore_bidirectional_mask_sdpa", bidirectional, original_bidirectional)) if original is not None]
    for name, fn, _ in patches:
        setattr(module, name, fn)
    try:
        yield
    finally:
        for name, _, original in patches:
            setattr(module, name, original)


def split_precondition(gm: torch.fx.GraphModule, skips: tuple[bool, ...]) -> None:
    """Move the decision markers of ``export_skips`` out of ``gm`` into ``meta[PRECONDITION]`` (module
    docstring), with ``meta[MASK_SKIPS]`` the decisions ``gm`` was exported with, one per marker. The graph is
    left as it would be without the markers; a marker whose inputs are not the call's alone (a parameter, say)
    gives no precondition, and the graph keeps the decisions it was exported with for every call."""
    graph = gm.graph
    marks = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.aten._assert_async.msg
             and isinstance(n.args[1], str) and n.args[1].startswith(_MARK)]
    if not marks:  # no decision point: nothing to move, and the graph's code stands (no recompile on a hit)
        gm.meta[MASK_SKIPS], gm.meta[PRECONDITION] = (), None
        return
    marks.sort(key=lambda n: int(n.args[1].removeprefix(_MARK)))
    flags = [m.args[0] for m in marks]
    needed: set[torch.fx.Node] = set()
    stack = list(flags)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    precondition = None
    if all(n.op in ("placeholder", "call_function") for n in needed):
        small = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in graph.nodes:
            if node.op == "placeholder" or node in needed:
                env[node] = small.node_copy(node, lambda n: env[n])
        small.output(tuple(env[f] for f in flags))
        precondition = torch.fx.GraphModule(gm, small, class_name="MaskPrecondition")
    for mark in marks:
        graph.erase_node(mark)
    for node in reversed(list(graph.nodes)):  # what only the markers read, the last first
        if node in needed and node.op != "placeholder" and not node.users:
            graph.erase_node(node)
    gm.recompile()
    gm.meta[MASK_SKIPS] = tuple(skips[i] if i < len(skips) else False for i in range(len(marks)))
    gm.meta[PRECONDITION] = precondition


def mask_decisions(gm: torch.fx.GraphModule, flat_inputs: list[Any]) -> tuple[bool, ...] | None:
    """The eager forward's mask decisions for a call's flat inputs (one host sync for them all), by ``gm``'s
    precondition; None when ``gm`` has none (no decision point, or one it cannot compute)."""
    precondition = gm.meta.get(PRECONDITION)
    if precondition is None:
        return None
    flags = precondition(*flat_inputs)
    return tuple(bool(v) for v in torch.stack([f.reshape(()) for f in flags]).tolist())
