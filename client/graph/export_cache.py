"""Exported graphs on disk: ``torch.export`` runs once per model and call, not at every start of a script.

Exporting a Hugging Face model is most of what ``remat.client.checkpoint`` costs on a plan-cache hit (GPT-2:
about 1.8 s in a fresh process), and the hit needs the very graph the plan key's architecture hash and the
stage chain come from. So ``fx_trace.export_model`` keeps each exported graph in ``graphs/`` beside the plan
cache (``REMAT_PLAN_CACHE_DIR``), under a *pre-key* that is computed without tracing, and rebuilds the graph
from the file on the next start; everything downstream (hash, probe facts, chain) sees the same graph.

The pre-key (:func:`pre_key`, sha256) covers what the export depends on and can be read off the model and the
call without running them: the module tree (hashing's module description: names, types, ``extra_repr`` and
public attributes) and every module's other instance state (configuration objects such as a transformers
``config`` described field by field, shared modules, an instance ``forward``); each parameter's and buffer's
name, shape, dtype, device, ``requires_grad`` and ties; the code of every class in the model and its bases
(its ``forward`` as it is in memory — bytecode, constants, defaults, closure, every function it wraps — and
the digests of the files that define them, which cover the forward's source text and its helpers beside it;
its package's version) and the versions of torch and Python; the call's signature with every tensor's
device; the train flag, the default dtype, grad mode and autocast state. A model with hooks, tensor subclasses
or code that is not in a file is not cached. Library code outside the model's classes' files (transformers'
attention and mask helpers) is covered by the package version only: an editable install edited in place
keeps its version, so clear ``graphs/`` after editing such a library.

The export for any sizes (``fx_trace.export_any_sizes``, NOTE [ any sizes on disk ]) is kept too, under a
pre-key that describes each input's number of dimensions instead of its sizes (``pre_keys(any_sizes=True)``),
its size checks and export's guard expressions beside its nodes (``size_checks``: data, asked by
remat.client.graph.size_guards's interpreter of size arithmetic, never executed).

A graph file holds JSON only, never pickle, and loading it executes nothing it names. Node targets are
resolved to ``torch.ops.<namespace>.<op>.<overload>`` overloads that exist in this process or to functions
of the ``operator`` module; arguments are node references, None, bools, ints, floats (inf and nan too),
strings, tuples, lists, dicts, slices, dtypes, devices, layouts and memory formats; ``get_attr`` targets must
be tensors of the model; the pytree specs use torch's ``treespec_dumps``, which names only registered types.
A graph with anything else (higher-order ops, constants export lifted) is not stored, and a file that is
malformed, unresolvable, too large or for another key is ignored: the model is exported again and the file
rewritten. Before a graph is stored, it is rebuilt from its JSON and must generate the same code. The folder
keeps the :data:`MAX_CACHED_GRAPHS` most recently used graphs (and as many hash files), removing the others as
it stores a new one.

Public API::

    key = pre_key(model, call, train=True)          # None: not cacheable (a hook, unreadable source…)
    any_sizes_key = pre_keys(model, call, train=True, any_sizes=True)(mask_skips)
    gm = load_graph(model, key, train=True)         # the rebuilt GraphModule, or None
    store_graph(model, gm, key)                     # the file's path, or None when the graph is not storable
    load_hash(key, hash_format) / store_hash(key, hash_format, h)   # an exported model's architecture hash
    load_probe_facts(key) / store_probe_facts(key, facts)            # how a stored graph is cut, without a probe
    graph_cache_dir() -> Path                       # <plan cache dir>/graphs
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib.metadata
import inspect
import json
import logging
import operator
import os
import platform
import re
import sys
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

from remat.client.graph.fidelity import ROUTING_META, ROUTING_OPS, graph_routing
from remat.client.graph.hashing import canon, module_description
from remat.client.graph.size_guards import SIZE_CHECKS, SizeChecks

if TYPE_CHECKING:
    from remat.client.graph.model_call import ModelCall

__all__ = ["GRAPH_FORMAT", "HASH_FORMAT", "Uncacheable", "decode_graph", "encode_graph", "graph_cache_dir",
           "graphs_in", "load_graph", "load_hash", "load_probe_facts", "load_skips", "pre_key", "pre_keys",
           "store_graph", "store_hash", "store_probe_facts", "store_skips"]

logger = logging.getLogger("remat")

GRAPH_FORMAT = "remat-graph/2"
"""2: the graph's routing verdict is stored with it (``fidelity.ROUTING_META``); a /1 file is exported again."""
EXPORT_RECIPE = 4
"""What ``fx_trace.export_model`` does around ``torch.export`` (node clean-up, transformers' eager mask
decisions and, from 3, their markers; from 4, inputs that alias one another exported as distinct tensors): part
of the pre-key, so a graph exported by an older recipe is exported again. Bump it with any change there."""
MAX_GRAPH_BYTES = 64 * 1024 * 1024
"""A graph file larger than this is ignored (GPT-2's is about 0.5 MiB)."""
MAX_CACHED_GRAPHS = 256
"""Graph files ``graphs/`` keeps, and as many hash files: storing one more removes the least recently used
(a hit counts as a use). A graph is stored per model and call signature, sizes included, and calls at sizes the
export for any sizes refuses (a batch of one row) each store one: unbounded, the folder grew with every size a
script ever met."""
MAX_NODES = 500_000
MAX_DEPTH = 24
"""Nesting of argument values and of described state beyond this is not cached."""
MAX_STATE_ITEMS = 500_000
"""Values in the model's instance state (configurations) beyond this: not cached (describing it would cost)."""
MAX_TENSOR_ATTR_BYTES = 1 << 20
"""A plain tensor attribute (not a parameter or buffer) is described by its bytes up to this size."""

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_ATTR_PART = re.compile(r"[A-Za-z0-9_]+\Z")
_OPS = ("placeholder", "get_attr", "call_function", "output")
_OPERATOR_NAMES = (
    "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "invert", "eq", "ne",
    "lt", "le", "gt", "ge", "and_", "or_", "xor", "not_", "lshift", "rshift", "matmul", "truth", "is_", "is_not",
    "contains", "index",
)
_OPERATORS: dict[str, Any] = {name: getattr(operator, name) for name in _OPERATOR_NAMES}
_OPERATOR_BY_ID = {id(fn): name for name, fn in _OPERATORS.items()}


class Uncacheable(Exception):
    """This model, call or graph is not cached; the message says why (logged at debug level)."""


def graph_cache_dir() -> Path:
    """``graphs`` in the plan cache directory (``REMAT_PLAN_CACHE_DIR`` or the user cache directory)."""
    from remat.client.local_plans import default_cache_dir

    return default_cache_dir() / "graphs"


def graphs_in(cache_dir: Path | None) -> Path | None:
    """The ``graphs`` folder of a plan cache directory a caller chose (``checkpoint(cache_dir=...)``); None for
    the default, which every function here reads as :func:`graph_cache_dir`."""
    return cache_dir / "graphs" if cache_dir is not None else None


# ----------------------------------------------------------------------------------------------------------
# The pre-key
# ----------------------------------------------------------------------------------------------------------


def pre_key(model: nn.Module, call: ModelCall, *, train: bool, mask_skips: tuple[bool, ...] = ()) -> str | None:
    """Hex sha256 of what ``torch.export`` of ``model`` on ``call`` depends on (module docstring), computed
    without tracing, with the mask decisions it is exported with (remat.client.graph.mask_skips); None when the
    model or call is not cached (the reason is logged at debug level)."""
    keys = pre_keys(model, call, train=train)
    return None if keys is None else keys(mask_skips)


def pre_keys(model: nn.Module, call: ModelCall, *, train: bool,
             any_sizes: bool = False) -> Callable[[tuple[bool, ...]], str] | None:
    """``pre_key`` for any mask decisions, the model and call described once; None when not cached.
    ``any_sizes``: the key of the export for any sizes (``fx_trace.export_any_sizes``), which describes each
    input's number of dimensions, not its sizes: one graph serves every size its checks let through."""
    try:
        description = _description(model, call, train, any_sizes)
    except Uncacheable as exc:
        logger.debug("remat: exported graph of %s not cached: %s", type(model).__name__, exc)
        return None

    def key(mask_skips: tuple[bool, ...]) -> str:
        text = json.dumps({**description, "mask_skips": [bool(skip) for skip in mask_skips]}, sort_keys=True,
                          separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    return key


def _description(model: nn.Module, call: ModelCall, train: bool, any_sizes: bool = False) -> dict[str, Any]:
    describer = _Describer()
    return {
        "format": GRAPH_FORMAT,
        "recipe": EXPORT_RECIPE,
        "sizes": "any" if any_sizes else "fixed",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "train": bool(train),
        "state": _global_state(call),
        "call": _call_description(call, any_sizes),
        "modules": module_description(model),
        "instances": _instance_description(model, describer),
        "objects": describer.objects,
        "tensors": _tensor_description(model),
        "code": _code_description(model),
    }


def _global_state(call: ModelCall) -> list[Any]:
    from torch.nn.modules import module as nn_module

    hooks = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
             "_global_backward_pre_hooks")
    if any(getattr(nn_module, name, None) for name in hooks):
        raise Uncacheable("global module hooks are registered")
    autocast = []
    for device in sorted({"cpu", "cuda", *(t.device.type for t in call.leaves())}):
        try:
            autocast.append([device, torch.is_autocast_enabled(device), str(torch.get_autocast_dtype(device))])
        except (RuntimeError, TypeError, ValueError):
            autocast.append([device, None, None])
    return [str(torch.get_default_dtype()), torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast]


def _call_description(call: ModelCall, any_sizes: bool = False) -> dict[str, Any]:
    leaves, spec = pytree.tree_flatten_with_path((tuple(call.args), dict(call.kwargs)))
    out = []
    for path, leaf in leaves:
        label = pytree.keystr(path)
        if isinstance(leaf, torch.Tensor):
            if type(leaf) is not torch.Tensor:
                raise Uncacheable(f"input {label} is a {type(leaf).__name__}")
            out.append([label, leaf.dim() if any_sizes else list(leaf.shape), str(leaf.dtype), str(leaf.device),
                        leaf.requires_grad, str(leaf.layout), leaf.is_contiguous()])
        else:
            out.append([label, canon(leaf)])
    # The signature writes every size; without them the leaves above say all it does.
    return {"signature": None if any_sizes else call.signature, "structure": str(spec), "leaves": out}


def _tensor_description(model: nn.Module) -> dict[str, Any]:
    first: dict[int, str] = {}

    def describe(kind: str, named: Any, exact: type) -> list[Any]:
        out = []
        for name, t in named:
            if type(t) is not exact:
                raise Uncacheable(f"{kind} {name} is a {type(t).__name__}")
            out.append([name, list(t.shape), str(t.dtype), str(t.device), t.requires_grad, t.is_contiguous(),
                        first.setdefault(id(t), name)])
        return out

    return {"parameters": describe("parameter", model.named_parameters(remove_duplicate=False), nn.Parameter),
            "buffers": describe("buffer", model.named_buffers(remove_duplicate=False), torch.Tensor)}


@functools.lru_cache(maxsize=1)
def _module_infrastructure() -> frozenset[str]:
    """Instance attributes every ``nn.Module`` has (registries, hook tables, the train flag): not state."""
    return frozenset(vars(nn.Module()))


def _instance_description(model: nn.Module, describer: _Describer) -> list[Any]:
    infrastructure = _module_infrastructure()
    seen: dict[int, str] = {}
    out: list[Any] = []
    for name, module in model.named_modules(remove_duplicate=False):
        first = seen.setdefault(id(module), name)
        if first != name:
            out.append([name, "same as", first])
            continue
        if (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks):
            raise Uncacheable(f"module {name or type(model).__name__} has hooks")
        state = [[key, describer(value)] for key, value in vars(module).items() if key not in infrastructure]
        out.append([name, sorted(state, key=lambda kv: kv[0])])
    return out


_VOLATILE = frozenset({"_original_object_hash"})
"""Object attributes that differ between processes and say nothing about the forward: transformers'
``GenerationConfig`` keeps Python's ``hash()`` of itself (salted per process) to tell whether it was edited."""


class _Describer:
    """A JSON form of instance state: values, containers, and objects by their ``vars`` (configurations),
    each object described once in ``objects`` and referred to by index (one config is shared by every
    module of a transformer)."""

    def __init__(self) -> None:
        self.objects: list[Any] = []
        self._index: dict[int, int] = {}
        self._keep: list[Any] = []  # ids stay unique while described objects are alive
        self._items = 0

    def __call__(self, value: Any, depth: int = 0) -> Any:
        self._items += 1
        if self._items > MAX_STATE_ITEMS:
            raise Uncacheable(f"the model's instance state has more than {MAX_STATE_ITEMS} values")
        if depth > MAX_DEPTH:
            raise Uncacheable("the model's instance state is nested too deeply")
        kind = type(value)
        if value is None or kind in (bool, int, str):
            return value
        if kind is float:
            return ["float", repr(value)]
        if isinstance(value, enum.Enum):
            return ["enum", _qualname(kind), str(value.name)]
        if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return [kind.__name__, str(value)]
        if isinstance(value, torch.Tensor):
            return _tensor_value(value)
        if isinstance(value, nn.Module):
            return ["module", _qualname(kind)]
        if isinstance(value, (list, tuple)):
            return [_qualname(kind), [self(v, depth + 1) for v in value]]
        if isinstance(value, dict):
            items = [[_text(self(k, depth + 1)), self(v, depth + 1)] for k, v in value.items()]
            return [_qualname(kind), sorted(items, key=lambda kv: kv[0])]
        if isinstance(value, (set, frozenset)):
            return [_qualname(kind), sorted(_text(self(v, depth + 1)) for v in value)]
        if isinstance(value, functools.partial):
            return ["partial", self(value.func, depth + 1), self(list(value.args), depth + 1),
                    self(dict(value.keywords), depth + 1)]
        if isinstance(value, type):
            return ["type", _qualname(value)]
        if isinstance(value, (types.FunctionType, types.MethodType, types.BuiltinFunctionType)) or (
                callable(value) and not hasattr(value, "__dict__")):
            return _callable(value)
        state = getattr(value, "__dict__", None)
        if isinstance(state, dict):
            index = self._index.get(id(value))
            if index is None:
                index = self._index[id(value)] = len(self.objects)
                self._keep.append(value)
                self.objects.append(None)
                fields = {k: v for k, v in state.items() if k not in _VOLATILE}
                self.objects[index] = [_qualname(kind), self(fields, depth + 1)]
            return ["object", index]
        return ["opaque", _qualname(kind)]


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, separators=(",", ":"))


def _tensor_value(t: torch.Tensor) -> list[Any]:
    """A plain tensor attribute (not a parameter or buffer): export would bake it in as a constant, and code
    may read its values, so its bytes are part of the key."""
    entry: list[Any] = ["tensor", list(t.shape), str(t.dtype), str(t.device)]
    if t.device.type == "meta":
        return entry
    nbytes = t.numel() * t.element_size()
    if nbytes > MAX_TENSOR_ATTR_BYTES or type(t) is not torch.Tensor or t.layout != torch.strided:
        raise Uncacheable(f"a {type(t).__name__} attribute of {nbytes} bytes")
    if not t.numel():
        return [*entry, ""]
    data = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
    return [*entry, hashlib.sha256(data.numpy().tobytes()).hexdigest()]


def _qualname(obj: Any) -> str:
    module = getattr(obj, "__module__", None) or ""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__qualname__
    return f"{module}.{name}" if module else str(name)


def _callable(fn: Any) -> list[Any]:
    """A function or method by its qualified name and its code (:func:`_function`); a builtin by its name."""
    if isinstance(fn, types.MethodType):
        return ["method", _qualname(type(fn.__self__)), _callable(fn.__func__)]
    if isinstance(getattr(fn, "__code__", None), types.CodeType):
        return ["callable", _qualname(fn), _function(fn)]
    return ["callable", _qualname(fn)]


# -- code ----------------------------------------------------------------------------------------------------

_FUNCTION_CODE: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
_FILE_DIGESTS: dict[str, tuple[int, int, str]] = {}
_VERSIONS: dict[str, str | None] = {}


def _code_description(model: nn.Module) -> list[Any]:
    """Every class of the model's modules and their bases (torch's own aside: torch's version covers them):
    its package's version, the digest of the file that defines it, and its ``forward`` (:func:`_function`)."""
    out: dict[str, Any] = {}
    for cls in dict.fromkeys(type(m) for m in model.modules()):
        for klass in cls.__mro__:
            name = _qualname(klass)
            module_name = getattr(klass, "__module__", "") or ""
            top = module_name.split(".")[0]
            if name in out or klass is object or top in ("builtins", "torch"):
                continue
            path = getattr(sys.modules.get(module_name), "__file__", None)
            if not path:
                raise Uncacheable(f"{name} is not defined in a file")
            forward = vars(klass).get("forward")
            out[name] = [name, _package_version(top), _file_digest(path),
                         _function(forward) if forward is not None else None]
    return [out[name] for name in sorted(out)]


def _function(forward: Any) -> list[Any]:
    """A class's ``forward`` and every function it wraps (decorators such as transformers'
    ``can_return_tuple``), each as it is in memory — a digest of its bytecode and constants, its defaults and
    closure — and as it is on disk: the digest of its source file (which covers its text and the helpers
    beside it), or its source text where there is no file (a notebook cell). Reading whole files is cheaper
    than ``inspect.getsource``'s tokenizing: 8 ms for GPT-2's classes in a fresh process, against under 2 ms
    for their files. The in-memory part is memoized per function object, the files are read again when they
    change."""
    fn = getattr(forward, "__func__", forward)
    try:
        memo = _FUNCTION_CODE.get(fn)
    except TypeError:  # not weak-referenceable: described afresh each time
        memo = None
    if memo is None:
        memo = []
        current: Any = fn
        for _ in range(16):
            code = getattr(current, "__code__", None)
            if isinstance(code, types.CodeType):
                readable = Path(code.co_filename).is_file()
                memo.append([_qualname(current), _code_digest(code), _short(getattr(current, "__defaults__", None)),
                             _short(getattr(current, "__kwdefaults__", None)),
                             [_short(_cell(c)) for c in (getattr(current, "__closure__", None) or ())],
                             code.co_filename if readable else None,
                             None if readable else _source(current)])
            else:
                memo.append([_qualname(current), None])
            current = getattr(current, "__wrapped__", None)
            if current is None:
                break
        else:
            raise Uncacheable(f"{_qualname(fn)} wraps too many functions")
        try:
            _FUNCTION_CODE[fn] = memo
        except TypeError:
            pass
    return [[*entry[:5], _file_digest(entry[5]) if entry[5] else entry[6]] if len(entry) == 7 else entry
            for entry in memo]


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return "<empty cell>"


def _short(value: Any) -> Any:
    """A function's defaults or closure values: ``hashing.canon``, with functions by their code."""
    if isinstance(value, types.FunctionType):
        return ["function", _qualname(value), _code_digest(value.__code__)]
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, [_short(v) for v in value]]
    if isinstance(value, dict):
        return ["dict", sorted([str(k), _short(v)] for k, v in value.items())]
    return canon(value)


def _code_digest(code: types.CodeType) -> str:
    """sha256 of a code object's bytecode, names and constants (nested code included): what runs, in memory,
    whatever the file on disk says now. Constants are written canonically (a frozenset's order would follow
    the process's string hashing)."""
    digest = hashlib.sha256()

    def feed(c: types.CodeType) -> None:
        digest.update(c.co_code)
        digest.update(repr((c.co_names, c.co_varnames, c.co_freevars, c.co_cellvars, c.co_argcount,
                            c.co_kwonlyargcount, c.co_posonlyargcount, c.co_flags)).encode())
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                feed(const)
            else:
                digest.update(_const_text(const).encode())
                digest.update(b"\0")

    feed(code)
    return digest.hexdigest()


def _const_text(const: Any) -> str:
    if isinstance(const, (frozenset, set)):
        return "{" + ",".join(sorted(_const_text(c) for c in const)) + "}"
    if isinstance(const, tuple):
        return "(" + ",".join(_const_text(c) for c in const) + ")"
    if isinstance(const, types.CodeType):
        return _code_digest(const)
    return f"{type(const).__name__}:{const!r}"


def _source(fn: Any) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError) as exc:
        raise Uncacheable(f"the source of {_qualname(fn)} cannot be read ({exc})") from None


def _file_digest(path: str) -> str:
    """sha256 of a source file, memoized while its modification time and size stay the same."""
    try:
        stat = Path(path).stat()
        known = _FILE_DIGESTS.get(path)
        if known is not None and known[:2] == (stat.st_mtime_ns, stat.st_size):
            return known[2]
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        raise Uncacheable(f"source file {path} cannot be read") from None
    _FILE_DIGESTS[path] = (stat.st_mtime_ns, stat.st_size, digest)
    return digest


def _package_version(top: str) -> str | None:
    if top not in _VERSIONS:
        try:
            _VERSIONS[top] = importlib.metadata.version(top)
        except (importlib.metadata.PackageNotFoundError, ValueError):
            _VERSIONS[top] = None
    return _VERSIONS[top]


# ----------------------------------------------------------------------------------------------------------
# The graph as JSON, and back
# ----------------------------------------------------------------------------------------------------------


def _graph_path(key: str, directory: Path | None) -> Path:
    return (directory if directory is not None else graph_cache_dir()) / f"{key}.json"


def store_graph(model: nn.Module, gm: torch.fx.GraphModule, key: str, *, directory: Path | None = None) -> Path | None:
    """Write ``gm`` (``export_model``'s unlifted graph of ``model``) under ``key``; None when the graph holds
    something the format does not (module docstring) or the cache directory cannot be written."""
    from remat.client.local_plans import write_json_atomically

    try:
        data = encode_graph(model, gm, key)
        try:
            rebuilt = decode_graph(json.loads(json.dumps(data)), model, key, train=bool(gm.meta.get("remat_train")))
        except Exception as exc:  # noqa: BLE001 - whatever fails to rebuild is not stored
            raise Uncacheable(f"the graph does not rebuild from its JSON ({type(exc).__name__}: {exc})") from None
        if rebuilt.code != gm.code:
            raise Uncacheable("the graph rebuilt from its JSON generates other code")
        if rebuilt.meta.get(SIZE_CHECKS) != gm.meta.get(SIZE_CHECKS):
            raise Uncacheable("the graph's size checks do not survive its JSON")
    except Uncacheable as exc:
        logger.debug("remat: exported graph of %s not cached: %s", type(model).__name__, exc)
        return None
    try:
        path = write_json_atomically(_graph_path(key, directory), data, indent=None)
    except OSError as exc:  # a read-only or full cache directory costs the next start an export, no more
        logger.info("remat: exported graph not cached (%s)", exc)
        return None
    _keep_recent(path.parent, ".json", keep=path)
    return path


def _used(path: Path) -> None:
    """Mark a cache file as just used (its modification time), so that pruning keeps it longest."""
    try:
        os.utime(path)
    except OSError:
        pass  # a read-only cache still serves; it is only pruned less well


def _keep_recent(directory: Path, suffix: str, *, keep: Path) -> None:
    """Remove the least recently used files ending in ``suffix`` (graphs: ``.json`` but not the side files,
    ``_SIDE_SUFFIXES``)
    beyond :data:`MAX_CACHED_GRAPHS`, never ``keep``. Another process pruning or reading at the same time loses
    nothing but a cache hit."""
    def age(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:
            return float("inf")  # already gone

    graphs = suffix == ".json"
    files = [f for f in directory.glob(f"*{suffix}")
             if not (graphs and f.name.endswith(_SIDE_SUFFIXES))]
    if len(files) <= MAX_CACHED_GRAPHS:
        return
    for old in sorted(files, key=age)[: len(files) - MAX_CACHED_GRAPHS]:
        if old != keep:
            old.unlink(missing_ok=True)


def _side_path(key: str, suffix: str, directory: Path | None) -> Path:
    return (directory if directory is not None else graph_cache_dir()) / f"{key}{suffix}"


_SIDE_SUFFIXES = (".hash.json", ".skips.json", ".probe.json")
"""Small files kept beside a graph under its key; each kind is pruned on its own (``_keep_recent``)."""


def _read_side(key: str, suffix: str, file_format: str, directory: Path | None,
               limit: int = 16384) -> dict[str, Any] | None:
    """The body of a small file kept beside a graph (a hash, mask decisions) when it is well-formed for
    ``key`` and ``file_format``, marked used; None otherwise (none stored or malformed: ignored)."""
    path = _side_path(key, suffix, directory)
    try:
        data = json.loads(path.read_bytes()[:limit])
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("format") != file_format or data.get("key") != key:
        return None
    _used(path)
    return data


def _write_side(key: str, suffix: str, body: dict[str, Any], directory: Path | None, what: str) -> None:
    """Write a small file beside the graphs (``_read_side``), keeping the most recently used of its kind; a
    directory that cannot be written costs the next start what the file spares, no more."""
    from remat.client.local_plans import write_json_atomically

    try:
        path = write_json_atomically(_side_path(key, suffix, directory), body, indent=None)
    except OSError as exc:
        logger.debug("remat: %s not cached: %s", what, exc)
        return
    _keep_recent(path.parent, suffix, keep=path)


SKIPS_FORMAT = "remat-mask-skips/1"


def load_skips(key: str, *, directory: Path | None = None) -> tuple[tuple[bool, ...], bool | None] | None:
    """What :func:`store_skips` kept under ``key`` (the pre-key without decisions), or None: the mask decisions
    a call under it took last, and whether a chain cut from the graph exported with them has other stages than
    the one that builds every mask (None: not compared). The decisions are a guess, checked by the graph read
    back with them (``fx_trace.export_model``): it spares a start with a mask without padding the graph that
    builds every mask, read only to learn the call's decisions."""
    data = _read_side(key, ".skips.json", SKIPS_FORMAT, directory)
    if data is None:
        return None
    skips, differ = data.get("mask_skips"), data.get("layouts_differ")
    if not (isinstance(skips, list) and len(skips) <= 4096 and all(isinstance(s, bool) for s in skips)):
        return None
    if differ is not None and not isinstance(differ, bool):
        return None
    return tuple(skips), differ


def store_skips(key: str, mask_skips: tuple[bool, ...], layouts_differ: bool | None = None, *,
                directory: Path | None = None) -> None:
    """Keep what :func:`load_skips` reads."""
    body = {"format": SKIPS_FORMAT, "key": key, "mask_skips": [bool(s) for s in mask_skips],
            "layouts_differ": layouts_differ}
    _write_side(key, ".skips.json", body, directory, "mask decisions")


PROBE_FORMAT = "remat-graph-probe/1"
MAX_PROBE_BYTES = 16 * 1024 * 1024
"""A probe-facts file larger than this is ignored (the 6-block GPT-2's is about 20 KiB)."""


def load_probe_facts(key: str, *, directory: Path | None = None) -> dict[str, Any] | None:
    """The probe facts (``write_probe.ProbeFacts.to_dict``) kept under ``key`` by :func:`store_probe_facts`,
    or None. The caller checks them against its graph and model (``ProbeFacts.fits``) before use."""
    data = _read_side(key, ".probe.json", PROBE_FORMAT, directory, limit=MAX_PROBE_BYTES)
    facts = data.get("facts") if data is not None else None
    return facts if isinstance(facts, dict) else None


def store_probe_facts(key: str, facts: dict[str, Any], *, directory: Path | None = None) -> None:
    """Keep what a probe of the graph stored under ``key`` learned, so that a later start cuts it into stages
    without running the model (the export for any sizes: NOTE [ any sizes on disk ] in fx_trace)."""
    _write_side(key, ".probe.json", {"format": PROBE_FORMAT, "key": key, "facts": facts}, directory, "probe facts")


HASH_FORMAT = "remat-graph-hash/1"


def load_hash(key: str, hash_format: str, *, directory: Path | None = None) -> str | None:
    """The architecture hash stored under ``key`` (the pre-key of the call it was computed for) by
    :func:`store_hash`, or None (none stored, another hash format, or a malformed file: ignored).

    The hash is a function of what the pre-key covers (the model's code, state, parameters and the call's
    signature), so a file under the key may answer for it; it spares a start the second graph a batch other
    than 2 hashes (remat.client.graph.fx_trace, ``HASH_BATCH``)."""
    data = _read_side(key, ".hash.json", HASH_FORMAT, directory)
    if data is None or data.get("hash_format") != hash_format:
        return None
    value = data.get("architecture_hash")
    if not (isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value)):
        return None
    return value


def store_hash(key: str, hash_format: str, architecture_hash: str, *, directory: Path | None = None) -> None:
    """Keep ``architecture_hash`` under ``key`` for :func:`load_hash`."""
    body = {"format": HASH_FORMAT, "key": key, "hash_format": hash_format, "architecture_hash": architecture_hash}
    _write_side(key, ".hash.json", body, directory, "architecture hash")


def load_graph(model: nn.Module, key: str, *, train: bool,
               directory: Path | None = None) -> torch.fx.GraphModule | None:
    """The graph stored under ``key`` rebuilt on ``model``, or None (none stored, or a file that is not a
    well-formed ``remat-graph/1`` graph for this key and model: ignored, module docstring)."""
    path = _graph_path(key, directory)
    try:
        if path.stat().st_size > MAX_GRAPH_BYTES:
            return None
        data = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    try:
        graph = decode_graph(data, model, key, train=train)
    except Exception as exc:  # noqa: BLE001 - a cache file that does not rebuild is ignored, whatever is wrong
        logger.info("remat: ignoring the cached graph %s (%s)", path, exc)
        return None
    _used(path)
    return graph


def encode_graph(model: nn.Module, gm: torch.fx.GraphModule, key: str) -> dict[str, Any]:
    """The JSON form of ``gm``; raises ``Uncacheable`` naming what it cannot hold."""
    codegen = gm.graph._codegen
    if not isinstance(codegen, _PyTreeCodeGen):
        raise Uncacheable(f"the graph's code generator is a {type(codegen).__name__}")
    info = codegen.pytree_info
    if not all(isinstance(a, str) and _IDENT.match(a) for a in info.orig_args):
        raise Uncacheable("the graph's arguments are not plain names")
    specs = []
    for spec in (info.in_spec, info.out_spec):
        try:
            text = pytree.treespec_dumps(spec)
            same = pytree.treespec_loads(text) == spec
        except Exception as exc:  # noqa: BLE001 - torch's serializer refusing a type means "not cached"
            raise Uncacheable(f"a pytree spec cannot be serialized ({type(exc).__name__}: {exc})") from None
        if not same:
            raise Uncacheable("a pytree spec does not survive serialization")
        specs.append(text)
    nodes = []
    for n in gm.graph.nodes:
        if n.op not in _OPS:
            raise Uncacheable(f"node {n.name} is a {n.op}")
        if n.type is not None:
            raise Uncacheable(f"node {n.name} has a type annotation")
        if n.op == "call_function":
            target: Any = _encode_target(n.target)
        elif n.op == "get_attr":
            value = _lookup(model, str(n.target))
            if not isinstance(value, torch.Tensor) or value is not _lookup(gm, str(n.target)):
                raise Uncacheable(f"get_attr {n.target} is not a tensor of the model (a lifted constant?)")
            target = str(n.target)
        else:
            target = str(n.target)
        nodes.append([n.name, n.op, target, _encode_value(n.args), _encode_value(dict(n.kwargs)),
                      _encode_stack(n.meta.get("nn_module_stack"))])
    data = {"format": GRAPH_FORMAT, "key": key, "torch": torch.__version__,
            "codegen": {"orig_args": list(info.orig_args), "in_spec": specs[0], "out_spec": specs[1]},
            "nodes": nodes, "routing": graph_routing(gm)}
    checks = gm.meta.get(SIZE_CHECKS)
    if checks is not None:
        if checks.guards is None:
            raise Uncacheable("export's guards for other sizes were not read")
        data["size_checks"] = checks.to_json()
    return data


def _encode_target(target: Any) -> list[str]:
    if isinstance(target, torch._ops.OpOverload):
        name = torch.fx.node._get_qualified_name(target)  # torch.ops.aten.add.Tensor
        parts = name.split(".")
        try:
            same = len(parts) == 5 and parts[:2] == ["torch", "ops"] and _resolve_op(*parts[2:]) is target
        except ValueError:
            same = False
        if not same:
            raise Uncacheable(f"op {name} does not resolve back to itself")
        return ["op", *parts[2:]]
    name = _OPERATOR_BY_ID.get(id(target))
    if name is not None and _OPERATORS[name] is target:
        return ["operator", name]
    raise Uncacheable(f"call_function target {target!r} is neither an aten-style op nor an operator function")


@functools.lru_cache(maxsize=4096)
def _resolve_cached(namespace: Any, op: Any, overload: Any) -> torch._ops.OpOverload:
    """:func:`_resolve_op` once per name: a graph names a few dozen ops hundreds of times."""
    if not all(isinstance(p, str) for p in (namespace, op, overload)):
        raise ValueError("op names are strings")
    return _resolve_op(namespace, op, overload)


def _resolve_op(namespace: str, op: str, overload: str) -> torch._ops.OpOverload:
    """``torch.ops.<namespace>.<op>.<overload>`` if it exists in this process, else ValueError."""
    # The op may be a dunder (aten.__and__); the namespace and overload never are. Each step's result is
    # checked for its type, so a name such as __class__ resolves to nothing.
    if not (all(isinstance(p, str) and _IDENT.match(p) for p in (namespace, op, overload))
            and not namespace.startswith("_") and not overload.startswith("_")):
        raise ValueError(f"not an op name: {namespace!r}.{op!r}.{overload!r}")
    space = getattr(torch.ops, namespace, None)
    if not isinstance(space, torch._ops._OpNamespace):
        raise ValueError(f"torch.ops.{namespace} is not an op namespace")
    try:
        packet = getattr(space, op)
    except (AttributeError, RuntimeError):
        raise ValueError(f"no op torch.ops.{namespace}.{op}") from None
    if not isinstance(packet, torch._ops.OpOverloadPacket) or overload not in packet.overloads():
        raise ValueError(f"no op torch.ops.{namespace}.{op}.{overload}")
    resolved = getattr(packet, overload)
    if not isinstance(resolved, torch._ops.OpOverload):
        raise ValueError(f"torch.ops.{namespace}.{op}.{overload} is not an op overload")
    return resolved


def _encode_value(value: Any, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise Uncacheable("an argument is nested too deeply")
    if isinstance(value, torch.fx.Node):
        return ["n", value.name]
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return ["f", repr(value)]
    if kind is tuple:
        return ["t", [_encode_value(v, depth + 1) for v in value]]
    if isinstance(value, list) and kind in (list, torch.fx.immutable_collections.immutable_list):
        return ["l", [_encode_value(v, depth + 1) for v in value]]
    if isinstance(value, dict) and kind in (dict, torch.fx.immutable_collections.immutable_dict):
        if not all(type(k) is str for k in value):
            raise Uncacheable("a dict argument with keys that are not strings")
        return ["d", [[k, _encode_value(v, depth + 1)] for k, v in value.items()]]
    if kind is slice:
        return ["s", _encode_value(value.start, depth + 1), _encode_value(value.stop, depth + 1),
                _encode_value(value.step, depth + 1)]
    if value is Ellipsis:
        return ["e"]
    if kind is torch.dtype:
        return ["dtype", str(value).removeprefix("torch.")]
    if kind is torch.device:
        return ["device", str(value)]
    if kind is torch.layout:
        return ["layout", str(value).removeprefix("torch.")]
    if kind is torch.memory_format:
        return ["memory_format", str(value).removeprefix("torch.")]
    raise Uncacheable(f"an argument of type {kind.__name__}")


def _encode_stack(stack: Any) -> list[list[str]] | None:
    if stack is None:
        return None
    if not isinstance(stack, dict):
        raise Uncacheable("nn_module_stack is not a dict")
    out = []
    for key, value in stack.items():
        if not (isinstance(key, str) and isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str)):
            raise Uncacheable("an nn_module_stack entry is not (path, type)")
        out.append([key, value[0], value[1] if isinstance(value[1], str) else _qualname(value[1])])
    return out


def decode_graph(data: Any, model: nn.Module, key: str, *, train: bool) -> torch.fx.GraphModule:
    """The GraphModule of a graph file's JSON, on ``model``; raises ValueError (or TypeError, KeyError…)
    when anything in it is not what :func:`encode_graph` writes."""
    if not isinstance(data, dict) or data.get("format") != GRAPH_FORMAT or data.get("key") != key:
        raise ValueError(f"not a {GRAPH_FORMAT} graph for this key")
    codegen, nodes = data.get("codegen"), data.get("nodes")
    if not isinstance(codegen, dict) or not isinstance(nodes, list) or not 0 < len(nodes) <= MAX_NODES:
        raise ValueError("no codegen or nodes")
    orig_args = codegen.get("orig_args")
    if not isinstance(orig_args, list) or not all(isinstance(a, str) and _IDENT.match(a) for a in orig_args):
        raise ValueError("bad orig_args")
    if not isinstance(codegen.get("in_spec"), str) or not isinstance(codegen.get("out_spec"), str):
        raise ValueError("bad pytree specs")
    in_spec = pytree.treespec_loads(codegen["in_spec"])
    out_spec = pytree.treespec_loads(codegen["out_spec"])

    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for i, entry in enumerate(nodes):
        if not isinstance(entry, list) or len(entry) != 6:
            raise ValueError(f"node {i} is not [name, op, target, args, kwargs, stack]")
        name, op, target, args_in, kwargs_in, stack = entry
        if not isinstance(name, str) or not _IDENT.match(name) or name in env:
            raise ValueError(f"node {i}: bad or repeated name")
        if op not in _OPS or (op == "output") != (i == len(nodes) - 1):
            raise ValueError(f"node {name}: op {op!r} (one output, last)")
        if op == "call_function":
            target = _decode_target(target)
        elif not isinstance(target, str):
            raise ValueError(f"node {name}: target is not a name")
        elif op == "get_attr":
            if not all(_ATTR_PART.match(p) for p in target.split(".")) or not isinstance(_lookup(model, target),
                                                                                    torch.Tensor):
                raise ValueError(f"node {name}: the model has no tensor {target!r}")
        elif not _IDENT.match(target):
            raise ValueError(f"node {name}: bad target")
        args, kwargs = _decode_value(args_in, env), _decode_value(kwargs_in, env)
        if type(args) is not tuple or type(kwargs) is not dict:
            raise ValueError(f"node {name}: args are not a tuple and kwargs a dict")
        node = graph.create_node(op, target, args, kwargs, name=name)
        if node.name != name:
            raise ValueError(f"node {name} was renamed {node.name}")
        if stack is not None:
            node.meta["nn_module_stack"] = _decode_stack(stack)
        env[name] = node
    routing = data.get("routing")
    if not isinstance(routing, list) or not all(isinstance(r, str) and r.lstrip("_") in ROUTING_OPS for r in routing):
        raise ValueError("no routing verdict")
    graph._codegen = _PyTreeCodeGen(_PyTreeInfo(list(orig_args), in_spec, out_spec))
    graph.lint()
    gm = _graph_module_class()(model, graph, class_name=type(model).__name__)
    if "size_checks" in data:
        checks = SizeChecks.from_json(data["size_checks"])
        if list(checks.names) != [n.name for n in graph.nodes if n.op == "placeholder"]:
            raise ValueError("size checks for other inputs than the graph's")
        gm.meta[SIZE_CHECKS] = checks
    gm.meta["remat_train"] = train
    gm.meta["remat_tracer"] = "export"
    gm.meta["remat_pytree"] = (in_spec, out_spec)
    gm.meta[ROUTING_META] = tuple(routing)
    return gm


def _graph_module_class() -> type[torch.fx.GraphModule]:
    """fx's lazy GraphModule, which generates and compiles its Python code the first time it is called or its
    ``code`` is read: the chain runs its stages, never the whole graph, so a hit would compile it for
    nothing (about 20 ms for GPT-2). Behaviour is a GraphModule's; plain GraphModule where torch lacks it."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # pragma: no cover - torch before 2.3
        return torch.fx.GraphModule
    return _LazyGraphModule


def _decode_target(target: Any) -> Any:
    if isinstance(target, list) and len(target) == 4 and target[0] == "op":
        return _resolve_cached(target[1], target[2], target[3])
    if isinstance(target, list) and len(target) == 2 and target[0] == "operator" and target[1] in _OPERATORS:
        return _OPERATORS[target[1]]
    raise ValueError(f"unknown call_function target {str(target)[:80]!r}")


def _decode_value(value: Any, env: dict[str, torch.fx.Node], depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    if value is None or type(value) in (bool, int, str):
        return value
    if not isinstance(value, list) or not value or not isinstance(value[0], str):
        raise ValueError(f"not an encoded value: {str(value)[:80]!r}")
    tag, rest = value[0], value[1:]
    if tag == "n" and len(rest) == 1 and isinstance(rest[0], str) and rest[0] in env:
        return env[rest[0]]
    if tag == "f" and len(rest) == 1 and isinstance(rest[0], str) and len(rest[0]) < 40:
        return float(rest[0])
    if tag in ("t", "l") and len(rest) == 1 and isinstance(rest[0], list):
        items = [_decode_value(v, env, depth + 1) for v in rest[0]]
        return tuple(items) if tag == "t" else items
    if tag == "d" and len(rest) == 1 and isinstance(rest[0], list):
        out = {}
        for item in rest[0]:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                raise ValueError("bad dict item")
            out[item[0]] = _decode_value(item[1], env, depth + 1)
        return out
    if tag == "s" and len(rest) == 3:
        return slice(*(_decode_value(v, env, depth + 1) for v in rest))
    if tag == "e" and not rest:
        return Ellipsis
    if tag in ("dtype", "layout", "memory_format") and len(rest) == 1 and isinstance(rest[0], str) \
            and _IDENT.match(rest[0]):
        kind = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}[tag]
        found = getattr(torch, rest[0], None)
        if type(found) is kind:
            return found
    if tag == "device" and len(rest) == 1 and isinstance(rest[0], str) and re.fullmatch(r"[a-z_]+(:[0-9]+)?",
                                                                                         rest[0]):
        return torch.device(rest[0])
    raise ValueError(f"not an encoded value: {str(value)[:80]!r}")


def _decode_stack(stack: Any) -> dict[str, tuple[str, str]]:
    if not isinstance(stack, list) or not all(
            isinstance(e, list) and len(e) == 3 and all(isinstance(s, str) for s in e) for e in stack):
        raise ValueError("bad nn_module_stack")
    return {key: (path, kind) for key, path, kind in stack}


def _lookup(root: nn.Module, target: str) -> torch.Tensor | None:
    """The parameter or buffer ``target`` names under ``root``, through the module registries only (never a
    property or other attribute a file could name), else None."""
    *path, leaf = target.split(".")
    module: Any = root
    for part in path:
        module = module._modules.get(part) if isinstance(module, nn.Module) else None
        if module is None:
            return None
    if not isinstance(module, nn.Module):
        return None
    found = module._parameters.get(leaf)
    return found if found is not None else module._buffers.get(leaf)
