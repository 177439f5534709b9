"""Is an exported graph the model? One training step each way, compared bit for bit.

``torch.export`` traces the Python code that runs for the example, with export's own branches where a
library offers them: a mixture-of-experts layer that loops over the experts the batch routed to when eager
loops over every expert when exported (transformers' Mixtral), and sums the same numbers in another order.
Such a graph computes the same loss and gradients that differ in their last bits; planning it would train a
different program than the user's. So before a chain cut from an exported graph is used:

1. a graph that routes by values (``topk``, ``sort``, ``argmax``, ``nonzero``… of activations: which code runs
   depends on the batch, as in a mixture of experts) is refused: one batch that agrees proves nothing for the
   next (transformers' Mixtral exports a sorted grouped-matmul path; its eager forward loops over the experts
   a batch hit, and the two agree bit for bit on some shapes only). Only values computed from floating-point
   ones count (NOTE [ routing by activations ]): the same ops on token ids alone pick a position, not code
   (a classifier pooling each row's last non-padding token, CLIP's end-of-text token);
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

__all__ = ["ROUTING_META", "RTOL", "check_export_fidelity", "custom_functions", "graph_routing", "routing_ops"]

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


MAX_BACKWARD_NODES = 1_000_000
"""How many nodes of a loss's backward graph :func:`custom_functions` visits at most."""


def custom_functions(loss: torch.Tensor) -> list[str]:
    """The ``torch.autograd.Function`` classes in ``loss``'s backward graph, each once.

    ``torch.export`` traces such a function's forward and differentiates it like any other code: the class's own
    ``backward`` (BLOOM's GeLU, fused kernels, straight-through estimators) is not in the exported graph, so its
    gradients are at best equal in value, and a refusal should say that rather than blame control flow.
    """
    found: list[str] = []
    seen: set[Any] = set()  # autograd nodes: one Python object per node while it is referenced
    stack = [loss.grad_fn]
    while stack and len(seen) < MAX_BACKWARD_NODES:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            name = type(node).__name__.removesuffix("Backward")
            if name not in found:
                found.append(name)
        stack.extend(fn for fn, _ in node.next_functions)
    return found


def _step(run: Any, params: list[nn.Parameter], seed: int, *, find_functions: bool = False
          ) -> tuple[torch.Tensor | None, list[torch.Tensor | None], list[str]]:
    """One step from ``seed``: the loss, every gradient, and (``find_functions``) the custom autograd functions
    it backpropagated."""
    torch.manual_seed(seed)
    for p in params:
        p.grad = None
    with torch.enable_grad():
        loss = _loss(run())
    if loss is None or not loss.requires_grad:
        return loss, [], []
    functions = custom_functions(loss) if find_functions else []
    loss.backward()
    return loss.detach(), [None if p.grad is None else p.grad.detach().clone() for p in params], functions


ROUTING_OPS = ("topk", "sort", "argsort", "argmax", "argmin", "nonzero", "multinomial", "unique", "histc")
"""aten ops whose result orders or selects by values: in a training forward they route (mixture of experts)."""


SIZE_QUERIES = ("sym_size", "sym_stride", "sym_numel", "sym_storage_offset")
"""aten ops that read a tensor's sizes, not its values: a value computed from a size does not depend on the data."""

# NOTE [ routing by activations ]
# A mixture of experts picks its code by scores its forward computes: ``topk`` of a softmax of router logits.
# The same ops also pool by position: ``GPT2ForSequenceClassification`` and every decoder's
# ``…ForSequenceClassification`` take ``argmax`` of ``arange * (input_ids != pad)`` to find each row's last
# token, CLIP's text model ``argmax`` of its token ids. There the exported graph is the eager code (one
# gather, whatever the batch), and refusing them refused every decoder classifier and reward model. So a
# routing op counts only when its input depends on a floating-point value: a float input, parameter or
# activation, followed through every op except size queries (a sequence length read off hidden states is a
# size, not a value). A node whose value export did not record counts as floating (refusing is the safe side).


def _op_name(node: torch.fx.Node) -> str:
    """``topk`` for ``aten.topk.default``: the op a ``call_function`` node runs, without namespace or overload."""
    return str(node.target).removeprefix("aten.").split(".")[0]


def _float_dependent(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes whose value is floating point or computed from one (graph order is topological)."""
    dependent: set[torch.fx.Node] = set()
    for n in graph.nodes:
        if n.op == "output":
            continue
        if n.op == "call_function" and _op_name(n) in SIZE_QUERIES:
            continue
        if "val" not in n.meta:
            floating = n.op in ("placeholder", "get_attr") or n.op == "call_function" and not n.all_input_nodes
        else:
            floating = any(isinstance(v, torch.Tensor) and v.is_floating_point()
                           for v in pytree.tree_leaves(n.meta["val"]))
        if floating or any(a in dependent for a in n.all_input_nodes):
            dependent.add(n)
    return dependent


ROUTING_META = "remat_routing"
"""``GraphModule.meta`` key of a graph read back from the export cache: ``routing_ops`` of the graph as exported.
A graph rebuilt from its JSON has no recorded values (``meta["val"]``), so every node would count as floating
and CLIP or a decoder classifier, pooling by token ids, would be refused as a mixture of experts at a later
start; the verdict is taken when the graph is exported and stored with it."""


def graph_routing(gm: torch.fx.GraphModule) -> list[str]:
    """``routing_ops`` of an exported graph: the verdict stored with it when it was read back from the cache."""
    if ROUTING_META in gm.meta:
        return list(gm.meta[ROUTING_META])
    return routing_ops(gm.graph)


def routing_ops(graph: torch.fx.Graph) -> list[str]:
    """The routing ops (``ROUTING_OPS``) a graph runs on floating-point values, in order, each once."""
    dependent = _float_dependent(graph)
    found = []
    for n in graph.nodes:
        if n.op == "call_function":
            name = _op_name(n)
            if name.lstrip("_") in ROUTING_OPS and name not in found and any(
                    a in dependent for a in n.all_input_nodes):
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
    routes = graph_routing(chain.graph_module)
    if routes:
        raise ModelError(f"{name} routes tokens by their values (aten.{', aten.'.join(routes)}: a mixture of "
                         f"experts): the code that runs depends on the batch, and its exported graph need not be "
                         f"its eager forward, so remat does not plan it")
    params = [p for p in model.parameters() if p.requires_grad]
    devices = [call.device]
    with preserved_state(model, devices=devices), training_mode(model, train):
        eager_loss, eager_grads, functions = _step(
            lambda: type(model).forward(model, *call.args, **call.kwargs), params, seed=0, find_functions=True)
        chain_loss, chain_grads, _ = _step(lambda: chain.run_call(call, ()), params, seed=0)
    exact = call.device.type == "cpu"  # elsewhere two eager steps may differ in their last bits (atomics)
    if functions:
        reason = (f"its forward applies torch.autograd.Function {', '.join(functions)}, whose own backward "
                  f"torch.export does not keep (it differentiates the function's forward instead), so a plan "
                  f"would train another program")
    else:
        reason = ("its forward takes another path when exported (data-dependent control flow), so a plan would "
                  "train another program")
    from remat.client.graph.mask_skips import PRECONDITION

    ones = _all_ones_inputs(call) if chain.graph_module.meta.get(PRECONDITION) is None else []
    if ones:
        # transformers skips an attention mask without padding in its eager forward (SDPA's is_causal path);
        # an exported graph takes the same decision where remat sees it (NOTE [ masks without padding ]), a
        # model deciding in its own code is exported with the mask built, which holds for every batch.
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
