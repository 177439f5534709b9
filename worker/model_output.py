"""A model's training output: one tensor, or a tuple of tensors whose first is the main output.

Stage boundaries always carry one tensor (client/graph/boundaries.py), but the *last* stage returns whatever the
model returns. GoogLeNet and Inception v3 return a namedtuple in train mode — the main logits and the
auxiliary classifiers' logits (``GoogLeNetOutputs(logits, aux_logits2, aux_logits1)``,
``InceptionOutputs(logits, aux_logits)``) — so the profiler and the measured step accept a tuple, list or
namedtuple of tensors there and nothing else.

The measured step's loss over such an output is the main loss plus the auxiliary losses weighted by
``AUX_LOSS_WEIGHT`` (0.3, the GoogLeNet paper's weight; docs/cost-model.md, "Models with auxiliary outputs").
The weight changes no allocation; what matters for memory is that every output takes part in the loss, so
the auxiliary heads' activations are saved and their gradients flow as in real training.
"""

from __future__ import annotations

from typing import Any

import torch

from remat.client.errors import ModelError

__all__ = ["AUX_LOSS_WEIGHT", "output_tensors", "requires_grad", "seeded_sum"]

AUX_LOSS_WEIGHT = 0.3


def output_tensors(y: Any, *, where: str = "the model") -> tuple[torch.Tensor, ...]:
    """``y`` as a tuple of tensors, the main output first.

    Raises:
        ModelError: ``y`` is neither a tensor nor a flat tuple/list/namedtuple of tensors.
    """
    if isinstance(y, torch.Tensor):
        return (y,)
    if isinstance(y, (tuple, list)) and y and all(isinstance(t, torch.Tensor) for t in y):
        return tuple(y)
    raise ModelError(f"{where} returns a {type(y).__name__}, not a tensor or a tuple of tensors (remat "
                     f"plans models whose output is one tensor, or a main output with auxiliary ones)")


def requires_grad(y: Any) -> bool:
    """Whether any output tensor takes part in autograd."""
    return any(t.requires_grad for t in output_tensors(y))


def seeded_sum(y: Any, seeds: Any) -> torch.Tensor:
    """``Σ (y_k * seed_k).sum()``: a scalar whose gradient for each output is its seed (the profiler's loss)."""
    ys, ss = output_tensors(y), output_tensors(seeds)
    total = (ys[0] * ss[0]).sum()
    for t, s in zip(ys[1:], ss[1:], strict=True):
        total = total + (t * s).sum()
    return total

