"""A model's training output: one tensor, a tuple of tensors whose first is the main output, or any pytree
of tensors (a dict, a ``transformers`` ``ModelOutput``), possibly holding the model's own loss.

A model that computes its own loss (``labels=`` given: ``output.loss``) is trained on that loss: the
profiled and measured steps backpropagate it alone (:func:`training_outputs`), as its training loop does.
Otherwise the step's loss covers every floating output.

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
import torch.utils._pytree as pytree

from remat.client.errors import ModelError

__all__ = ["AUX_LOSS_WEIGHT", "output_tensors", "own_loss", "requires_grad", "seeded_sum", "training_outputs"]

AUX_LOSS_WEIGHT = 0.3


def own_loss(y: Any) -> torch.Tensor | None:
    """The loss a model computed itself (``output.loss``, ``output["loss"]``: a scalar floating tensor), else None."""
    if isinstance(y, torch.Tensor) or isinstance(y, (tuple, list)) and not hasattr(y, "keys"):
        return None
    loss = y.get("loss") if hasattr(y, "get") else getattr(y, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point():
        return loss
    return None


def output_tensors(y: Any, *, where: str = "the model") -> tuple[torch.Tensor, ...]:
    """``y`` as a tuple of tensors, the main output first: a tensor, a flat tuple/list/namedtuple of tensors, or
    the floating tensors of any other pytree (dict, ``ModelOutput``) in order.

    Raises:
        ModelError: ``y`` holds no floating tensor.
    """
    if isinstance(y, torch.Tensor):
        return (y,)
    if isinstance(y, (tuple, list)) and y and all(isinstance(t, torch.Tensor) for t in y):
        return tuple(y)
    leaves = tuple(t for t in pytree.tree_leaves(y) if isinstance(t, torch.Tensor) and t.is_floating_point())
    if not leaves:
        raise ModelError(f"{where} returns a {type(y).__name__} without a floating tensor: nothing to train on")
    return leaves


def training_outputs(y: Any) -> Any:
    """What the step's loss is made of: the model's own loss when it computed one, else ``y`` itself."""
    loss = own_loss(y)
    return (loss,) if loss is not None else y


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

