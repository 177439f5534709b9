"""A stage as its isolated passes run it: what it hands to later stages, and the gradients those receive.

NOTE [ seeding a stage's exports ] A stage may hand later stages more than its output: side values (an
encoder's output that every cross-attention reads, T5's position bias, a dense block's features; NOTE [side
values] in remat.client.graph.stage_graph). In a training step, the backward of every later reader sends such
a value a gradient; they add up in one buffer that the maker's backward consumes. The isolated pass of the maker
used to start its backward from its output alone, so
- what the stage does for its exports alone was never run backward: a stage that ends one tower of a two-tower
  model (CLIP's image embedding) and starts the other one had none of the first tower's backward measured;
- the exports themselves stayed alive through the backward, held by the chain's probe environment, and in a
  recomputed backward (B°) beside the re-run's copies, though in a step nothing holds them there but what
  autograd saved (+3.5% over on a two-block BART's `linear` plan, +2.57% on T5's at 4 + 4 layers).

So stages are profiled from the last to the first (they are anyway: NOTE [ output gradient layout ]), the
gradients each stage's isolated backward sends to side values are summed per value, and when the maker's turn
comes its pass
- gets its exports handed back (``StageChain.stage(i, hand_exports=True)``) instead of kept for later stages,
  holds them through its forward as a step does, and lets them go before its backward;
- starts its backward from its output and from each export that received a gradient, whose seed is a copy of
  that gradient made just before the meter's baseline and then owned by the engine alone (``_SeedGradient``),
  so that it is freed when the export's node has consumed it, as the real buffer is.
The cost model books that buffer from its first sender's backward through the maker's (``SideLifetimes``'s
``gradients``); the maker's measured backward peak sees it leave, so the two add up to what a step holds.
Measured (docs/cost-model.md, "Side values"; docs/benchmarks.md): BART, T5 and CLIP plans to the byte, where
CLIP's first cut, unseeded, was predicted −20% to +2.6%.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from remat.client.model_output import requires_grad as any_requires_grad
from remat.client.model_output import seeded_sum
from remat.worker.memory_meter import storage_key

ExportGradients = dict[str, list[torch.Tensor | None]]
"""Side value name -> per tensor leaf of the value, the sum of the gradients later stages sent it (or None)."""


class _SeedGradient(torch.autograd.Function):
    """A zero scalar in forward; in backward, hands its export the seed it was given and keeps no reference, so
    the engine owns the seed alone and frees it once the export's node has consumed it."""

    @staticmethod
    def forward(ctx: Any, export: torch.Tensor, holder: list[torch.Tensor]) -> torch.Tensor:
        ctx.holder = holder
        return export.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        holder, ctx.holder = ctx.holder, None
        return (holder.pop() if holder else None), None


class StagePass:
    """Stage ``i`` of a chain as the profiler's isolated passes call it: ``x -> (y, exports)``.

    ``arm()`` makes the seeds of one backward (call it inside the meter, before its baseline); ``loss`` turns
    the output and the exports into the scalar whose backward is the stage's, consuming the seeds.
    """

    def __init__(self, chain: Any, i: int, plain: Callable[[Any], Any], gradients: ExportGradients) -> None:
        exports = getattr(chain, "stage_exports", None)
        self.names = tuple(exports(i)) if exports is not None and i < chain.num_stages else ()
        self._run = chain.stage(i, hand_exports=True) if self.names else plain
        self._gradients = {name: gradients[name] for name in self.names if name in gradients}

    def __call__(self, x: Any) -> tuple[Any, dict[str, Any]]:
        if not self.names:
            return self._run(x), {}
        return self._run(x)

    @property
    def seeded(self) -> bool:
        """Whether any export receives a gradient in a step."""
        return any(g is not None for leaves in self._gradients.values() for g in leaves)

    def arm(self) -> list[tuple[str, int, torch.Tensor]]:
        """Fresh copies of the seeds: (export name, tensor leaf index, seed)."""
        return [(name, k, g.clone()) for name, leaves in self._gradients.items()
                for k, g in enumerate(leaves) if g is not None]

    @staticmethod
    def loss(y: Any, ones: Any, exports: Mapping[str, Any], armed: list[tuple[str, int, torch.Tensor]]
             ) -> torch.Tensor | None:
        """``Σ y·ones`` plus a zero per seeded export whose backward hands it its seed (None when nothing needs
        a gradient). ``armed`` is emptied: from here the seeds belong to the graph."""
        loss = seeded_sum(y, ones) if any_requires_grad(y) else None
        while armed:
            name, k, seed = armed.pop()
            leaves = pytree.tree_leaves(exports.get(name))
            leaf = leaves[k] if k < len(leaves) else None
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                term = _SeedGradient.apply(leaf, [seed])
                loss = term if loss is None else loss + term
            del seed
        return loss


def add_side_gradients(chain: Any, gradients: ExportGradients) -> dict[int, int]:
    """After an isolated backward: add the gradients it sent to side values (leaves of the probe environment,
    NOTE [side values]) to ``gradients``, by value name. Returns what it sent, by the side value's storage key:
    the gradient's bytes (the trace's ``side_values``)."""
    env = getattr(chain, "_probe_env", {})
    sent: dict[int, int] = {}
    for name in getattr(chain, "side_values", ()):
        leaves = pytree.tree_leaves(env.get(name))
        sums = gradients.get(name)
        for k, t in enumerate(leaves):
            if not (isinstance(t, torch.Tensor) and t.is_leaf and t.grad is not None):
                continue
            if sums is None:
                sums = gradients[name] = [None] * len(leaves)
            g = t.grad.detach()
            sums[k] = g if sums[k] is None else sums[k] + g
            key = storage_key(t)
            if key is not None:
                sent[key] = sent.get(key, 0) + g.numel() * g.element_size()
    return sent
