"""What a graph exported for any sizes assumes about its inputs' sizes, held as data.

A graph from ``fx_trace.export_any_sizes`` holds for some sizes only: export fixed some dimensions, gave the
others symbols with ranges (``seq_len >= 17``, never 1), tied equal ones together and wrote what the model's code
decided on sizes as guard expressions (``input_ids.size()[1] <= 512``). A call at new sizes is asked all of it
before it runs on the graph (NOTE [ sizes export assumed ] in remat.client.graph.fx_trace).

In the process that exported the graph, export's own guards module answers the guard expressions. A graph read
back from disk (remat.client.graph.export_cache) has no such module: export builds it by ``exec`` of generated
source, and a cache file is never executed. So the expressions are stored as text and evaluated here by a
small interpreter over Python's ``ast`` that knows integer arithmetic, comparisons, ``and``/``or``/``not``,
``min``/``max`` and one way to read a size, ``args[i].size()[j]``; any other name, attribute, call or
construct is refused when the text is parsed, so an expression cannot reach anything but the call's sizes.
Before a graph is stored, the interpreter must agree with export's guards module on the exporting call and on
calls at sizes moved around it (:func:`agrees_with_module`); a graph whose guards it cannot read or agree on
is not stored.

Public API::

    checks = SizeChecks.of_graph(gm, guard_code)    # at export: placeholders' sizes and the guard text
    checks.refusal(flat_inputs, guards_module=None) # why a call does not hold (one line), None if it does
    checks.to_json() / SizeChecks.from_json(data)   # the stored form, validated on the way back
    agrees_with_module(checks, module, indices, flat_inputs)
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MAX_GUARDS", "SIZE_CHECKS", "DerivedDim", "SizeChecks", "SymbolDim", "agrees_with_module"]

SIZE_CHECKS = "remat_size_checks"
"""``meta`` entry of a graph exported for any sizes, fresh or read back from disk: its ``SizeChecks``."""

MAX_GUARDS = 4096
"""Guard expressions a graph may carry (GPT-2's export has 6, T5's 8); more is not stored."""
MAX_GUARD_CHARS = 4096
"""Characters of one guard expression beyond this: not stored (and a file holding one is ignored)."""
MAX_INPUTS = 4096
MAX_DIMS = 64
MAX_INT = 1 << 62
"""Integers in a stored guard or range beyond this magnitude are refused: sizes are far smaller."""


@dataclass(frozen=True)
class SymbolDim:
    """A dimension export left to a symbol: any size in ``lower..upper`` (``upper`` None: unbounded), equal
    wherever the same ``symbol`` appears."""

    symbol: str
    lower: int
    upper: int | None


@dataclass(frozen=True)
class DerivedDim:
    """A dimension export computed from symbols (``2*s27``, another input twice as long). The guard expressions
    tie it; the expression lets :func:`agrees_with_module` move it with its symbols."""

    expr: str

    def size(self, symbols: dict[str, int]) -> int | None:
        """The size given the symbols' sizes, None where one is unknown."""
        try:
            return _int(_compiled(self.expr, symbols=True)(symbols))  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return None


Dim = int | SymbolDim | DerivedDim | None
"""One input dimension: a size it must have, a symbol, a size computed from symbols, or None for one whose
expression is not plain arithmetic (it holds when the guard expressions do)."""


@dataclass(frozen=True)
class SizeChecks:
    """Everything a call's sizes are asked before they run on a graph for any sizes."""

    names: tuple[str, ...]
    """The graph's placeholders, one per flat input: the names refusals use."""
    labels: tuple[str, ...]
    """The flat inputs as the user passed them (``input_ids``, ``past[0]``): the names guard refusals use."""
    dims: tuple[tuple[Dim, ...] | None, ...]
    """Per flat input, its dimensions, or None when export saw no tensor there."""
    guards: tuple[str, ...] | None
    """export's guard expressions over ``args[i].size()[j]``; None when they could not be read (then only an
    in-process guards module answers them, and the graph is not stored)."""

    @staticmethod
    def of_graph(gm: torch.fx.GraphModule, guard_code: tuple[list[str], list[str]] | None) -> SizeChecks:
        """The checks of a fresh export: its placeholders' example values (symbolic sizes and their ranges)
        and ``guard_code`` (the expressions and the flat inputs' labels, ``fx_trace``'s reading of export's
        guards), None when unread."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        dims: list[tuple[Dim, ...] | None] = []
        for node in placeholders:
            value = node.meta.get("val")
            if not isinstance(value, torch.Tensor):
                dims.append(None)
                continue
            dims.append(tuple(_dim(size) for size in value.shape))
        labels = tuple(guard_code[1]) if guard_code is not None else tuple(n.name for n in placeholders)
        guards = tuple(guard_code[0]) if guard_code is not None else None
        if guards is not None and len(labels) != len(placeholders):
            guards = None
        return SizeChecks(tuple(n.name for n in placeholders), labels, tuple(dims), guards)

    def refusal(self, flat_inputs: Sequence[Any], guards_module: Callable[..., Any] | None = None,
                indices: Sequence[int] = ()) -> str | None:
        """Why ``flat_inputs`` do not hold for the graph (one line), None if they do: a size outside what export
        assumed, then a guard that fails: asked of ``guards_module`` (export's, on the flat inputs at
        ``indices``) when given, else of the stored expressions."""
        outside = self._outside(flat_inputs)
        if outside is not None:
            return outside
        if guards_module is not None:
            try:
                guards_module(*(flat_inputs[i] for i in indices))
            except Exception as exc:  # noqa: BLE001 - a guard that fails to run refuses as much as one that fails
                lines = str(exc).strip().splitlines()
                text = lines[0] if lines else ""
                return text if isinstance(exc, AssertionError) and text else f"{type(exc).__name__}: {text}"
            return None
        if self.guards is None:
            return "the graph's guards cannot be read"
        for text in self.guards:
            try:
                holds = _compiled(text)(flat_inputs)
            except (ValueError, TypeError, IndexError, ZeroDivisionError) as exc:
                return f"guard {self._shown(text)} cannot be asked: {exc}"
            if not holds:
                return f"Guard failed: {self._shown(text)}"
        return None

    def _outside(self, flat_inputs: Sequence[Any]) -> str | None:
        """The first input dimension outside what export assumed (NOTE [ sizes export assumed ] in
        remat.client.graph.fx_trace), None if none."""
        seen: dict[str, tuple[str, int]] = {}
        for name, dims, value in zip(self.names, self.dims, flat_inputs, strict=False):
            if dims is None or not isinstance(value, torch.Tensor):
                continue
            if len(dims) != value.dim():
                return f"{name} has {value.dim()} dimensions, the graph's {len(dims)}"
            for index, (dim, actual) in enumerate(zip(dims, value.shape, strict=True)):
                where = f"{name}.shape[{index}]"
                if isinstance(dim, int):
                    if dim != actual:
                        return f"{where} is {actual}, the graph's {dim}"
                    continue
                if not isinstance(dim, SymbolDim):
                    continue  # a size computed from others: it holds when the guards do
                first = seen.setdefault(dim.symbol, (where, actual))
                if first[1] != actual:
                    return f"{where} is {actual} where {first[0]} is {first[1]}: the graph has them equal"
                if actual < dim.lower or (dim.upper is not None and actual > dim.upper):
                    span = f"{dim.lower} or more" if dim.upper is None else f"{dim.lower} to {dim.upper}"
                    why = "; a size of 1 may take branches the graph does not hold" if actual <= 1 else ""
                    return f"{where} is {actual}, outside the sizes export assumed ({span}{why})"
        return None

    def _shown(self, text: str) -> str:
        """A guard expression with ``args[i]`` written as the input's label, as export's messages write it."""
        shown = text
        for index in sorted(range(len(self.labels)), reverse=True):  # args[12] before args[1]
            shown = shown.replace(f"args[{index}]", self.labels[index])
        try:  # without redundant parentheses, as export's messages
            return ast.unparse(ast.parse(shown, mode="eval"))
        except (SyntaxError, ValueError, RecursionError):
            return shown

    def to_json(self) -> dict[str, Any]:
        """The stored form (``export_cache``); only checks whose guards were read are stored."""
        if self.guards is None:
            raise ValueError("the graph's guards were not read")

        def dim_json(dim: Dim) -> Any:
            if isinstance(dim, DerivedDim):
                return {"expr": dim.expr}
            return [dim.symbol, dim.lower, dim.upper] if isinstance(dim, SymbolDim) else dim

        return {"names": list(self.names), "labels": list(self.labels),
                "dims": [None if dims is None else [dim_json(d) for d in dims] for dims in self.dims],
                "guards": list(self.guards)}

    @staticmethod
    def from_json(data: Any) -> SizeChecks:
        """The checks of a stored graph; ValueError when anything in ``data`` is not what :meth:`to_json` writes
        (every guard expression is parsed and checked here, never later)."""
        if not isinstance(data, dict) or set(data) != {"names", "labels", "dims", "guards"}:
            raise ValueError("size checks are not {names, labels, dims, guards}")
        names, labels, dims, guards = data["names"], data["labels"], data["dims"], data["guards"]
        if not all(isinstance(x, list) and len(x) <= MAX_INPUTS for x in (names, labels, dims)) \
                or not len(names) == len(labels) == len(dims):
            raise ValueError("size checks' names, labels and dims are not lists of one length")
        if not all(isinstance(s, str) and len(s) <= 256 for s in (*names, *labels)):
            raise ValueError("a name is not a short string")
        if not isinstance(guards, list) or len(guards) > MAX_GUARDS:
            raise ValueError("guards are not a list")
        for text in guards:
            _compiled(text)  # raises on anything but the grammar
            if any(index >= len(names) for index in _inputs_read(text)):
                raise ValueError("a guard reads an input the graph does not have")
        return SizeChecks(tuple(names), tuple(labels), tuple(_dims_of(d) for d in dims), tuple(guards))


def _dims_of(dims: Any) -> tuple[Dim, ...] | None:
    if dims is None:
        return None
    if not isinstance(dims, list) or len(dims) > MAX_DIMS:
        raise ValueError("an input's dims are not a list")
    out: list[Dim] = []
    for dim in dims:
        if dim is None or (type(dim) is int and 0 <= dim <= MAX_INT):
            out.append(dim)
        elif (isinstance(dim, list) and len(dim) == 3 and isinstance(dim[0], str) and len(dim[0]) <= 64
              and type(dim[1]) is int and 0 <= dim[1] <= MAX_INT
              and (dim[2] is None or (type(dim[2]) is int and dim[1] <= dim[2] <= MAX_INT))):
            out.append(SymbolDim(dim[0], dim[1], dim[2]))
        elif isinstance(dim, dict) and set(dim) == {"expr"}:
            _compiled(dim["expr"], symbols=True)  # raises on anything but size arithmetic over symbols
            out.append(DerivedDim(dim["expr"]))
        else:
            raise ValueError(f"not a dimension: {str(dim)[:40]!r}")
    return tuple(out)


def _dim(size: Any) -> Dim:
    """One dimension of an exported placeholder's example value."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr = size.node.expr
    if expr.is_Integer:
        return int(expr)
    if not expr.is_Symbol:
        try:
            from torch.utils._sympy.printers import PythonPrinter

            text = PythonPrinter().doprint(expr)
            _compiled(text, symbols=True)
        except Exception:  # noqa: BLE001 - an expression beyond plain arithmetic: the guards alone tie it
            return None
        return DerivedDim(text)
    bounds = size.node.shape_env.var_to_range.get(expr)
    if bounds is None:
        return SymbolDim(str(expr), 0, None)
    upper = None if "oo" in str(bounds.upper) else int(bounds.upper)
    return SymbolDim(str(expr), max(0, int(bounds.lower)), upper)


# ----------------------------------------------------------------------------------------------------------
# Guard expressions: parsed once into a closure over the flat inputs; nothing else is reachable
# ----------------------------------------------------------------------------------------------------------

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_COMPARE: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
_FUNCTIONS: dict[str, Callable[..., Any]] = {"min": min, "max": max, "Min": min, "Max": max}
_Evaluator = Callable[[Sequence[Any]], Any]
_COMPILED: dict[tuple[str, bool], _Evaluator] = {}
_SYMBOL = re.compile(r"[a-z]{1,8}[0-9]{1,9}\Z")


def _compiled(text: Any, symbols: bool = False) -> _Evaluator:
    """The evaluator of one guard expression (called on the flat inputs) or, ``symbols``, of one size expression
    over export's symbols (called on their values by name); ValueError when it is not in the grammar (module
    docstring)."""
    if not isinstance(text, str) or len(text) > MAX_GUARD_CHARS:
        raise ValueError("a guard is not a string of at most 4096 characters")
    found = _COMPILED.get((text, symbols))
    if found is None:
        try:
            tree = ast.parse(text, mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            raise ValueError(f"guard {text[:80]!r} does not parse") from None
        found = _node(tree.body, depth=0, symbols=symbols)
        if len(_COMPILED) < 16384:
            _COMPILED[(text, symbols)] = found
    return found


def _node(node: ast.AST, depth: int, symbols: bool = False) -> _Evaluator:
    if depth > 64:
        raise ValueError("a guard is nested too deeply")
    deeper = depth + 1
    if isinstance(node, ast.Constant) and type(node.value) in (int, bool):
        if abs(int(node.value)) > MAX_INT:
            raise ValueError("a guard's constant is too large")
        value = node.value
        return lambda _: value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd, ast.Not)):
        inner = _node(node.operand, deeper, symbols)
        if isinstance(node.op, ast.Not):
            return lambda a: not inner(a)
        return (lambda a: -_int(inner(a))) if isinstance(node.op, ast.USub) else (lambda a: _int(inner(a)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        apply = _BINARY[type(node.op)]
        left, right = _node(node.left, deeper, symbols), _node(node.right, deeper, symbols)
        return lambda a: apply(_int(left(a)), _int(right(a)))
    if isinstance(node, ast.BoolOp) and isinstance(node.op, (ast.And, ast.Or)):
        parts = [_node(v, deeper, symbols) for v in node.values]
        if isinstance(node.op, ast.And):
            return lambda a: all(bool(p(a)) for p in parts)
        return lambda a: any(bool(p(a)) for p in parts)
    if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
        first = _node(node.left, deeper, symbols)
        rest = [(_COMPARE[type(op)], _node(c, deeper, symbols))
                for op, c in zip(node.ops, node.comparators, strict=True)]

        def compare(a: Sequence[Any]) -> bool:
            left = _int(first(a))
            for test, right_of in rest:
                right = _int(right_of(a))
                if not test(left, right):
                    return False
                left = right
            return True

        return compare
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and node.args and not node.keywords):
        function, parts = _FUNCTIONS[node.func.id], [_node(v, deeper, symbols) for v in node.args]
        return lambda a: function(_int(p(a)) for p in parts)
    if symbols:  # a size expression over export's symbols (``2*s27``): it reads nothing else
        if isinstance(node, ast.Name) and _SYMBOL.match(node.id):
            name = node.id
            return lambda a: _int(a[name])
    elif isinstance(node, ast.Subscript):
        size = _size_read(node)
        if size is not None:
            index, dim = size
            return lambda a: _int(_tensor(a[index]).size()[dim])
        value = _input_read(node)
        if value is not None:
            return lambda a: _int(a[value])
    raise ValueError(f"a guard holds {ast.unparse(node)[:80]!r}, which is not size arithmetic")


def _int(value: Any) -> int:
    """Guards compute on sizes: an int (or a bool from a comparison), nothing else."""
    if type(value) not in (int, bool):
        raise TypeError(f"a guard computes on a {type(value).__name__}")
    return int(value)


def _tensor(value: Any) -> torch.Tensor:
    """Only a tensor's ``size()`` is read: never a method of another object."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"a guard reads the size of a {type(value).__name__}")
    return value


def _constant_index(node: ast.AST) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value < MAX_INPUTS:
        return node.value
    return None


def _input_read(node: ast.Subscript) -> int | None:
    """``args[i]``: the index i, else None."""
    if isinstance(node.value, ast.Name) and node.value.id == "args":
        return _constant_index(node.slice)
    return None


def _size_read(node: ast.Subscript) -> tuple[int, int] | None:
    """``args[i].size()[j]``: (i, j), else None."""
    call = node.value
    dim = _constant_index(node.slice)
    if (dim is None or not isinstance(call, ast.Call) or call.args or call.keywords
            or not isinstance(call.func, ast.Attribute) or call.func.attr != "size"
            or not isinstance(call.func.value, ast.Subscript)):
        return None
    index = _input_read(call.func.value)
    return None if index is None else (index, dim)


def _inputs_read(text: str) -> set[int]:
    """The flat inputs a parsed guard expression reads."""
    found = set()
    for node in ast.walk(ast.parse(text, mode="eval")):
        if isinstance(node, ast.Subscript):
            index = _input_read(node)
            if index is not None:
                found.add(index)
    return found


# ----------------------------------------------------------------------------------------------------------
# The interpreter against export's guards module
# ----------------------------------------------------------------------------------------------------------


def agrees_with_module(checks: SizeChecks, module: Callable[..., Any], indices: Sequence[int],
                       flat_inputs: Sequence[Any]) -> bool:
    """Whether the stored expressions refuse exactly the calls export's guards module refuses, asked on the
    exporting call's sizes and on sizes moved around them (every dimension alone one up and one down, and every
    symbol's dimensions together up by one, by seven and doubled): a reading of export's guards that missed or
    mangled one shows here, and at every symbol's range ends and one beyond them. Only sizes are asked, on meta
    tensors (no memory, no compute)."""
    if checks.guards is None:
        return False
    base = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in flat_inputs]
    variants: list[list[tuple[int, ...] | None]] = [base]
    for i, shape in enumerate(base):
        for j in range(len(shape or ())):
            for step in (1, -1):
                moved = list(base)
                moved[i] = tuple(s + step if k == j else s for k, s in enumerate(shape or ()))
                if moved[i][j] >= 0:  # type: ignore[index]
                    variants.append(moved)
    symbols = {d.symbol: d for dims in checks.dims if dims for d in dims if isinstance(d, SymbolDim)}
    for symbol, dim in sorted(symbols.items()):
        ends = [dim.lower - 1, dim.lower, dim.lower + 1]
        if dim.upper is not None:
            ends += [dim.upper, dim.upper + 1]
        changes: list[Callable[[int], int]] = [lambda s: s + 1, lambda s: s + 7, lambda s: 2 * s]
        changes += [lambda _, end=end: end for end in ends if end >= 0]
        for change in changes:
            variants.append(_moved(checks, base, symbol, change))
    for shapes in variants:
        inputs = [torch.empty(shape, device="meta", dtype=x.dtype) if shape is not None else x
                  for shape, x in zip(shapes, flat_inputs, strict=True)]
        try:
            module(*(inputs[i] for i in indices))
            by_module = True
        except Exception:  # noqa: BLE001 - the module refuses by raising
            by_module = False
        held = all(_holds(text, inputs) for text in checks.guards)
        if held != by_module:
            return False
    return True


def _moved(checks: SizeChecks, base: list[tuple[int, ...] | None], symbol: str,
           change: Callable[[int], int]) -> list[tuple[int, ...] | None]:
    """The shapes ``base`` with ``symbol``'s size changed wherever it appears, and the sizes computed from it."""
    sizes: dict[str, int] = {}
    for dims, shape in zip(checks.dims, base, strict=False):
        for dim, size in zip(dims or (), shape or (), strict=False):
            if isinstance(dim, SymbolDim):
                sizes.setdefault(dim.symbol, size)
    if symbol in sizes:
        sizes[symbol] = change(sizes[symbol])
    moved = list(base)
    for i, (dims, shape) in enumerate(zip(checks.dims, base, strict=False)):
        if dims is None or shape is None:
            continue
        new = []
        for dim, size in zip(dims, shape, strict=False):
            if isinstance(dim, SymbolDim):
                size = sizes[dim.symbol]
            elif isinstance(dim, DerivedDim):
                derived = dim.size(sizes)
                size = derived if derived is not None and derived >= 0 else size
            new.append(size)
        moved[i] = tuple(new)
    return moved


def _holds(text: str, inputs: Sequence[Any]) -> bool:
    try:
        return bool(_compiled(text)(inputs))
    except (ValueError, TypeError, IndexError, ZeroDivisionError):
        return False
