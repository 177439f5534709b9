"""Is an exported graph the model? One training step each way, compared bit for bit.

``torch.export`` traces the Python code that runs for the example, with export's own branches where a
library offers them: a mixture-of-experts layer that loops over the experts the batch routed to when eager
loops over every expert when exported (transformers' Mixtral), and sums the same numbers in another order.
Such a graph computes the same loss and gradients that differ in their last bits; planning it would train a
different program than the user's. So before a chain cut from an exported graph is used:

1. a graph that routes by values (``topk``, ``sort``, ``argmax``, ``nonzero``… of activations: which code runs
   depends on the batch, as in a mixture of experts) is refused: one batch that agrees proves nothing for the
   next (transformers' Mixtral exports a sorted grouped-matmul path; its eager forward loops over the experts
   a batch hit, and the two agree bit for bit on some shapes only);
2. one step of the eager model and one of the chain without checkpoints, from the same RNG state, must give
   ``torch.equal`` losses and gradients; otherwise the model is refused, with where they differ and why.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from remat.client.errors import ModelError
from remat.client.graph.write_probe import preserved_state

__all__ = ["RTOL", "check_export_fidelity"]

RTOL = 1e-4
"""Tolerance off the CPU, relative to the largest gradient: the measured step's gradient check uses the same."""


def _loss(output: Any) -> torch.Tensor | None:
    """The model's own loss when it computes one, else the sum of its floating outputs (any scalar function
    of the outputs shows whether two programs agree)."""
    loss = output.get("loss") if hasattr(output, "get") else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum((t.float().sum() for t in leaves), torch.zeros(())) if leaves else None


def _step(run: Any, params: list[nn.Parameter], seed: int) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    torch.manual_seed(seed)
    for p in params:
        p.grad = None
    with torch.enable_grad():
        loss = _loss(run())
    if loss is None or not loss.requires_grad:
        return loss, []
    loss.backward()
    return loss.detach(), [None if p.grad is None else p.grad.detach().clone() for p in params]


ROUTING_OPS = ("topk", "sort", "argsort", "argmax", "argmin", "nonzero", "multinomial", "unique", "histc")
"""aten ops whose result orders or selects by values: in a training forward they route (mixture of experts)."""


def routing_ops(graph: torch.fx.Graph) -> list[str]:
    """The routing ops (``ROUTING_OPS``) a graph runs, in order, each once."""
    found = []
    for n in graph.nodes:
        if n.op == "call_function":
            name = str(n.target).removeprefix("aten.").split(".")[0]
            if name.lstrip("_") in ROUTING_OPS and name not in found:
                found.append(name)
    return found


def _all_ones_inputs(call: Any) -> list[str]:
    """Names of the call's integer or boolean tensor inputs whose every element is one (masks without padding)."""
    out = []
    for name, value in call.kwargs.items():
        if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.numel() and bool(
                (value == 1).all()):
            out.append(name)
    return out


def check_export_fidelity(model: nn.Module, chain: Any, call: Any, *, train: bool = True) -> None:
    """Raise ``ModelError`` when the chain (cut from an exported graph) does not train like the model.

    Runs one eager step (``type(model).forward`` on ``call``) and one step of ``chain.run_call(call)`` without
    checkpoints, each from the same seed; parameters, buffers, gradients, modes and RNG are restored after.
    """
    from remat.client.graph.fx_trace import training_mode

    name = type(model).__name__
    routes = routing_ops(chain.graph_module.graph)
    if routes:
        raise ModelError(f"{name} routes tokens by their values (aten.{', aten.'.join(routes)}: a mixture of "
                         f"experts): the code that runs depends on the batch, and its exported graph need not be "
                         f"its eager forward, so remat does not plan it")
    params = [p for p in model.parameters() if p.requires_grad]
    devices = [call.device]
    with preserved_state(model, devices=devices), training_mode(model, train):
        eager_loss, eager_grads = _step(
            lambda: type(model).forward(model, *call.args, **call.kwargs), params, seed=0)
        chain_loss, chain_grads = _step(lambda: chain.run_call(call, ()), params, seed=0)
    exact = call.device.type == "cpu"  # elsewhere two eager steps may differ in their last bits (atomics)
    reason = ("its forward takes another path when exported (data-dependent control flow), so a plan would "
              "train another program")
    ones = _all_ones_inputs(call)
    if ones:
        # transformers skips an attention mask without padding in its eager forward (SDPA's is_causal path),
        # never in an exported graph, which must hold for every batch.
        reason += (f"; input {ones[0]} is all ones: the model's own forward skips such a mask, its exported graph "
                   f"cannot; pass {ones[0]}=None when no position is padded")
    if eager_loss is None or chain_loss is None:
        return
    scale = max((float(g.abs().max()) for g in eager_grads if g is not None and g.numel()), default=0.0)

    def same(a: torch.Tensor, b: torch.Tensor, magnitude: float) -> bool:
        return torch.equal(a, b) if exact else float((a.float() - b.float()).abs().max()) <= RTOL * magnitude

    if not same(eager_loss, chain_loss, abs(float(eager_loss))):
        raise ModelError(f"{name} cannot be planned exactly: the exported graph's loss differs from the model's "
                         f"({float(chain_loss)} vs {float(eager_loss)}); {reason}")
    named = [n for n, p in model.named_parameters() if p.requires_grad]
    for label, a, b in zip(named, eager_grads, chain_grads, strict=False):
        if (a is None) != (b is None) or (a is not None and b is not None and not same(a, b, scale)):
            diff = "one of them is missing" if a is None or b is None else \
                f"max difference {float((a.float() - b.float()).abs().max()):.1e}"
            raise ModelError(f"{name} cannot be planned exactly: the exported graph's gradient of {label} "
                             f"differs from the model's ({diff}); {reason}")
