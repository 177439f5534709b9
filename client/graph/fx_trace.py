"""Tracing a model with torch.fx for remat: the custom tracer and the train/eval mode it traces in.

``trace_model`` is the one tracer behind both the stage chain (``stage_graph``) and the architecture hash
(``hashing``). ``StochasticDepth`` stays a leaf so its train/eval switch is not baked into the graph; the
trace runs in the requested mode, which is restored on every submodule afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator

import torch
import torch.fx
from torch import nn

from remat.client.errors import ModelError

__all__ = ["trace_model"]


def _extra_leaves() -> tuple[type[nn.Module], ...]:
    """Module types that must stay opaque to the tracer. torchvision is optional and slow to import; a
    model containing ``StochasticDepth`` has necessarily imported it already, so look it up lazily."""
    module = sys.modules.get("torchvision.ops.stochastic_depth")
    return (module.StochasticDepth,) if module is not None else ()


class _Tracer(torch.fx.Tracer):
    """fx tracer that keeps modules with a runtime train/eval switch opaque.

    ``StochasticDepth`` reads ``self.training`` inside a non-leaf module, so a default trace bakes the
    flag into a ``stochastic_depth(..., True)`` call that keeps dropping rows after ``.eval()`` (P1).
    """

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        leaves = _extra_leaves()
        if leaves and isinstance(m, leaves):
            return True
        return super().is_leaf_module(m, module_qualified_name)


@contextlib.contextmanager
def training_mode(model: nn.Module, train: bool) -> Iterator[None]:
    """Put every submodule in ``train`` mode and restore each module's own flag afterwards."""
    flags = [(m, m.training) for m in model.modules()]
    model.train(train)
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def trace_model(model: nn.Module, *, train: bool = True) -> torch.fx.GraphModule:
    """Trace ``model`` with remat's tracer in the given mode; raise ``ModelError`` if fx cannot.

    The trace uses a shallow copy of the model as root: the copy shares the parameter, buffer and submodule
    dictionaries (so every ``get_attr`` resolves to the live tensors) while the tracer's own bookkeeping
    attributes (``_tensor_constant0``…) land on the copy instead of the user's model.
    """
    root = copy.copy(model)
    with training_mode(model, train):
        root.training = train
        try:
            graph = _Tracer().trace(root)
        except Exception as exc:  # noqa: BLE001 - any failure of user code under tracing means "not traceable"
            raise ModelError(f"torch.fx cannot trace {type(model).__name__}: {one_line(exc)}") from exc
    gm = torch.fx.GraphModule(root, graph, class_name=type(model).__name__)
    gm.meta["remat_train"] = train  # hashing.architecture_hash only reuses train-mode traces
    return gm


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
