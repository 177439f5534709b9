"""Architecture hash: one hex sha256 per model architecture, independent of weight values.

Public API::

    architecture_hash(model, *, graph=None) -> str      # 64 hex digits
    architecture_description(model, *, graph=None) -> dict   # the canonical JSON-able form that is hashed

What is covered: the torch.fx graph (traced in train mode by default, the mode plans are made for) as
ops, targets and edges by position; every submodule's qualified name, type and configuration (its
``extra_repr`` with memory addresses removed, and its public scalar attributes such as ``in_channels`` or
``eps``); every parameter's name, shape, dtype and ``requires_grad`` (frozen layers change what backward
keeps, hence the plan); every buffer's name, shape and dtype.

What is not: weight and buffer values (fine-tuned copies share plans), devices (the device class is a
separate field of the plan key), the train/eval flags (also a key field), Python object ids, and dict
iteration order of anything but the model's own ordered registries. The description is serialised with
sorted keys, so the hash is the same in every process and on every machine with the same torch major.minor
(fx's graph may change between torch versions, which is why the torch version is part of the plan key).

Exported graphs (calls of several inputs, remat.client.graph.fx_trace.export_model) hold the batch size, and
a token model's sequence length, in their shape arguments (``view(x, [4, 64, 768])``). Their hash describes the
graph exported at batch 2 and, for token ids, 2 tokens instead (``fx_trace.HASH_BATCH``, ``HASH_SEQ_LEN``; the
graph's ``meta["remat_hash_graph"]``, and ``meta["remat_architecture_hash"]`` for the hash itself, kept in the
graph cache so a start does not rebuild that second graph), so one architecture has one hash at every batch
size and sequence length of at least 2 and its profiles at several sizes form one family
(remat.client.derived_trace). A call at batch 1 (or 1 token), a token call with as many tokens as samples, or
one that cannot be exported at the small sizes, is described by its own graph at that size.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from typing import Any

import torch
import torch.fx
from torch import nn

from remat.client.errors import ModelError
from remat.client.graph.fx_trace import ARCHITECTURE_HASH, HASH_GRAPH

__all__ = ["ARCH_HASH_FORMAT", "architecture_description", "architecture_hash", "canon", "description_hash",
           "module_description"]

ARCH_HASH_FORMAT = "remat-arch/4"
"""Part of every hash: raised when plans stored under the old hashes would no longer fit the models they name.
A chain plan numbers the boundaries of the stage chain the cutter makes, so a cutter that cuts an
architecture differently must change its hash. /2: dense blocks are cut after every layer (NOTE [side values]
in stage_graph; DenseNet went from 20 stages to 236), so a /1 plan for them names other boundaries. /3: token
ids are held like a call's other inputs (NOTE [ token ids are held ] in stage_graph; RoBERTa, whose position
ids are computed from the ids, went from 24 stages to 29). /4: values that wait while another tower runs are
handed past it (NOTE [ parked values ] in boundaries: BART given labels 13 stages to 25, CLIP 1 to 17) and views
of held token ids are held too (GPT-2's first stage, a view of its ids, is gone: 14 stages to 13)."""
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
#: Instance attributes that are state or remat's own bookkeeping, not configuration.
_SKIP_ATTRS = {"training", "forward", "call_super_init", "dump_patches"}


def _qualname(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or ""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__qualname__
    return f"{module}.{name}" if module else str(name)


def _target_name(node: torch.fx.Node) -> str:
    if node.op == "call_function":
        try:
            return torch.fx.node._get_qualified_name(node.target)  # type: ignore[arg-type]
        except (RuntimeError, AttributeError):
            return _qualname(node.target)
    return str(node.target)


def canon(value: Any, index: dict[torch.fx.Node, int] | None = None, depth: int = 0) -> Any:
    """A JSON-able, process-independent form of a graph argument or module attribute."""
    if depth > 8:
        return ["deep", type(value).__qualname__]
    if index is not None and isinstance(value, torch.fx.Node):
        return ["node", index[value]]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return ["float", repr(value)]
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, [canon(v, index, depth + 1) for v in value]]
    if isinstance(value, dict):
        items = [[str(k), canon(v, index, depth + 1)] for k, v in value.items()]
        return ["dict", sorted(items, key=lambda kv: kv[0])]
    if isinstance(value, slice):
        return ["slice", canon(value.start, index), canon(value.stop, index), canon(value.step, index)]
    if value is Ellipsis:
        return ["ellipsis"]
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return [type(value).__name__, str(value)]
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), str(value.dtype)]
    if isinstance(value, functools.partial):
        return [
            "partial",
            canon(value.func, index, depth + 1),
            canon(list(value.args), index, depth + 1),
            canon(dict(value.keywords), index, depth + 1),
        ]
    if isinstance(value, type) or callable(value):
        return ["callable", _qualname(value)]
    return ["object", _qualname(type(value))]


def _graph_description(graph: torch.fx.Graph, owner: nn.Module | None) -> list[Any]:
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    out = []
    for n in nodes:
        entry: list[Any] = [n.op, _target_name(n), canon(n.args, index), canon(dict(n.kwargs), index)]
        if n.op == "get_attr" and owner is not None:
            # Tracer-made constants (_tensor_constant0) live on the traced module only: describe their
            # shape and dtype, not their values.
            obj: Any = owner
            try:
                for part in str(n.target).split("."):
                    obj = getattr(obj, part)
                entry.append(canon(obj))
            except AttributeError:
                pass
        out.append(entry)
    return out


def module_description(model: nn.Module) -> list[Any]:
    out = []
    for name, module in model.named_modules():
        attrs = {
            key: canon(value)
            for key, value in vars(module).items()
            if not key.startswith("_") and key not in _SKIP_ATTRS
        }
        try:
            extra = _ADDRESS.sub("0x?", module.extra_repr())
        except Exception:  # noqa: BLE001 - a broken extra_repr must not make a model unhashable
            extra = "<extra_repr failed>"
        out.append([name, _qualname(type(module)), extra, sorted(attrs.items())])
    return out


def architecture_description(model: nn.Module, *, graph: torch.fx.Graph | torch.fx.GraphModule | None = None) -> dict:
    """The canonical, JSON-serialisable description that ``architecture_hash`` hashes (for debugging:
    diff two descriptions to see why two models hash differently)."""
    owner: nn.Module | None = None
    if isinstance(graph, torch.fx.GraphModule) and callable(graph.meta.get(HASH_GRAPH)):
        graph = graph.meta[HASH_GRAPH]() or graph  # an export at another batch: describe it at batch 2
    if isinstance(graph, torch.fx.GraphModule):
        if graph.meta.get("remat_train") is False:
            graph = None  # an eval-mode trace (e.g. a chain built with train=False): hash the train one
        else:
            owner, graph = graph, graph.graph
    if graph is None:
        from remat.client.graph.stage_graph import trace_model

        try:
            owner = trace_model(model, train=True)
            graph = owner.graph
        except ModelError:
            graph = None
    return {
        "format": ARCH_HASH_FORMAT,
        "graph": _graph_description(graph, owner) if graph is not None else "untraceable",
        "modules": module_description(model),
        "parameters": [
            [name, list(p.shape), str(p.dtype), bool(p.requires_grad)] for name, p in model.named_parameters()
        ],
        "buffers": [[name, list(b.shape), str(b.dtype)] for name, b in model.named_buffers()],
    }


def architecture_hash(model: nn.Module, *, graph: torch.fx.Graph | torch.fx.GraphModule | None = None) -> str:
    """Hex sha256 of the model's architecture (see the module docstring for what it covers).

    Args:
        model: the model; not modified (tracing works on a shallow copy and restores train/eval flags).
        graph: an fx graph already traced by ``stage_graph.trace_model`` (or a chain's ``graph_module``)
            to avoid tracing twice. None traces in train mode (as does an eval-mode ``trace_model``
            result, which is ignored: the hash is always of the train-mode graph); a model fx cannot
            trace is hashed on its modules, parameters and buffers alone.
    """
    if isinstance(graph, torch.fx.GraphModule) and callable(graph.meta.get(ARCHITECTURE_HASH)):
        return graph.meta[ARCHITECTURE_HASH]()  # an export at another batch: its hash, maybe from disk
    return description_hash(architecture_description(model, graph=graph))


def description_hash(description: dict) -> str:
    """Hex sha256 of an ``architecture_description``: what ``architecture_hash`` returns."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
