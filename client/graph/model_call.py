"""A training call's inputs, whatever the model's ``forward`` takes: one tensor, several, keywords, constants.

``remat.client.checkpoint(model, *args, **kwargs)`` plans for one *call signature*: which inputs the call
passes, each tensor's shape and dtype, and every non-tensor value (``None``, flags such as
``use_cache=False``), which the trace bakes in. :class:`ModelCall` is that call, in one canonical spelling:
arguments are bound to ``forward``'s parameter names, so ``model(ids, mask)`` and
``model(input_ids=ids, attention_mask=mask)`` are the same call, with the same plan key.

A call of one positional tensor is the *single-tensor* call every earlier version planned: its key's
``inputs`` field stays empty (input_shape and dtype say everything), so existing plans keep their keys.

Public API::

    call = ModelCall.bind(model, args, kwargs)     # PlanError naming the input that cannot be planned
    call.single_tensor        # the tensor of a single-tensor call, else None
    call.main                 # the tensor the key's input_shape is read from (first tensor input)
    call.signature            # "input_ids: int64[2, 256]; labels: int64[2, 256]; use_cache=False" ("" if single)
    call.leaves()             # the tensors in order (pytree leaves of args and kwargs that are tensors)
    call.flat_inputs()        # every pytree leaf, constants too: an exported graph's placeholders' values
    call.args, call.kwargs    # the canonical spelling, to call the model with
    call.describe_difference(other) -> str | None   # what differs, for refusing a plan made for another call
    call.inputs_beyond(signature) -> str | None      # what it passes that the other does not (a refusal's hint)
    call.sizes                # the signature with every tensor's shape, a single tensor's too
    call.unaliased()          # the same call where no two tensor inputs share memory (what export is given)
    cache_turned_off(model, args, kwargs)   # the warning when bind passes use_cache=False the call left out
    call.same_inputs(sizes)   # whether a call of those sizes passes the same inputs, at any sizes
    synthetic_call(signature, model, device)        # a call of that signature with made-up values
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from remat.client.errors import PlanError
from remat.client.plan_key import MAX_INPUTS_CHARS as MAX_SIGNATURE_CHARS

__all__ = ["ModelCall", "cache_turned_off", "path_text", "synthetic_call", "tensor_text"]


_CONSTANTS = (type(None), bool, int, float, str)


def tensor_text(t: torch.Tensor) -> str:
    """A tensor as signatures and messages spell it: ``int64[2, 256]``."""
    dims = ", ".join(str(d) for d in t.shape)
    return f"{str(t.dtype).removeprefix('torch.')}[{dims}]"


def _leaf_text(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return tensor_text(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f"float('{value}')"
    return repr(value)


def path_text(path: tuple[Any, ...]) -> str:
    """Where a pytree leaf sits, as Python indexes it: ``['logits']``, ``[0]`` ("" for the root)."""
    out = ""
    for entry in path:
        if isinstance(entry, pytree.SequenceKey):
            out += f"[{entry.idx}]"
        elif isinstance(entry, pytree.MappingKey):
            out += f"[{entry.key!r}]"
        else:
            out += str(entry)
    return out


@dataclass(frozen=True, eq=False)
class ModelCall:
    """One call of a model's forward, bound to its parameter names (the module docstring says why)."""

    args: tuple[Any, ...]
    """Positional arguments that cannot be named (``*args``, positional-only parameters)."""
    kwargs: dict[str, Any]
    """Every other argument, by parameter name, in the order of ``forward``'s parameters."""
    signature: str = field(default="")
    """The call's canonical text: each input's name with its dtype and shape, or its value; "" for the
    single-tensor call (module docstring)."""

    @classmethod
    def bind(cls, model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> ModelCall:
        """The call ``model(*args, **kwargs)`` in canonical form.

        Raises:
            PlanError: no inputs, inputs that do not fit ``forward``, or an input that is neither a tensor,
                a constant (None, bool, int, float, str) nor a tuple, list or dict of those (one line
                naming the input and why).
        """
        kwargs = dict(kwargs)
        if not args and not kwargs:
            raise PlanError(f"checkpoint: give the example inputs of one training call of "
                            f"{type(model).__name__} (a tensor, or the arguments its forward takes)")
        if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
            return cls(args=(args[0],), kwargs={}, signature="")
        positional, named = _bind_names(model, args, kwargs)
        parts = []
        for name, value in [*((f"*{i}", v) for i, v in enumerate(positional)), *named.items()]:
            leaves, _ = pytree.tree_flatten_with_path(value)
            if not leaves and value is not None:
                parts.append(f"{name}={_leaf_text(value)}" if isinstance(value, _CONSTANTS) else f"{name}=()")
                continue
            if value is None:
                parts.append(f"{name}=None")
                continue
            for path, leaf in leaves:
                label = name + path_text(path)
                if isinstance(leaf, torch.Tensor):
                    if leaf.layout != torch.strided:
                        raise PlanError(f"input {label}: a {leaf.layout} tensor cannot be traced; pass dense tensors")
                    parts.append(f"{label}: {_leaf_text(leaf)}")
                elif isinstance(leaf, _CONSTANTS):
                    parts.append(f"{label}={_leaf_text(leaf)}")
                else:
                    raise PlanError(f"input {label}: a {type(leaf).__name__} cannot be traced; pass tensors, "
                                    f"numbers, strings, None, or tuples, lists and dicts of them")
        if not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves((positional, named))):
            raise PlanError(f"checkpoint: the example call of {type(model).__name__} passes no tensor")
        text = "; ".join(parts)
        if len(text) > MAX_SIGNATURE_CHARS:
            raise PlanError(f"checkpoint: the call's signature is {len(text)} characters, more than the "
                            f"{MAX_SIGNATURE_CHARS} a plan key holds (too many inputs)")
        return cls(args=tuple(positional), kwargs=named, signature=text)

    @property
    def single_tensor(self) -> torch.Tensor | None:
        """The input of a single-tensor call, else None."""
        return self.args[0] if not self.signature else None

    def leaves(self) -> list[torch.Tensor]:
        """Every tensor input, in the order the call passes them."""
        return [leaf for leaf in self.flat_inputs() if isinstance(leaf, torch.Tensor)]

    def flat_inputs(self) -> list[Any]:
        """Every input, constants included, in the order an exported graph's placeholders take them."""
        return pytree.tree_leaves((tuple(self.args), dict(self.kwargs)))

    def inputs_for(self, in_spec: Any) -> list[Any] | None:
        """``flat_inputs`` when the call has the structure an exported graph's input spec records (its names,
        nesting and constants' places), else None: one call may only run on a graph exported for its kind."""
        leaves, spec = pytree.tree_flatten((tuple(self.args), dict(self.kwargs)))
        return leaves if spec == in_spec else None

    @property
    def main(self) -> torch.Tensor:
        """The tensor whose shape is the key's ``input_shape``: the first tensor input (``input_ids``)."""
        return self.leaves()[0]

    @property
    def device(self) -> torch.device:
        return self.main.device

    @property
    def shape(self) -> torch.Size:
        """The main input's shape (what the key's ``input_shape`` records)."""
        return self.main.shape

    def to(self, device: torch.device | str) -> ModelCall:
        """The same call with every tensor on ``device`` (the call itself when they are there already)."""
        target = torch.device(device)
        if all(t.device == target or (target.index is None and t.device.type == target.type) for t in self.leaves()):
            return self
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(target), (self.args, self.kwargs))
        return ModelCall(args=tuple(args), kwargs=dict(kwargs), signature=self.signature)

    def detach(self) -> ModelCall:
        """The same call with every tensor detached (an example batch must not hold an autograd graph)."""
        args, kwargs = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, (self.args, self.kwargs))
        return ModelCall(args=tuple(args), kwargs=dict(kwargs), signature=self.signature)

    def unaliased(self) -> ModelCall:
        """The same call where no two tensor inputs share memory: each one that shares its storage with an
        earlier input is a copy of itself (the call itself when none does).

        NOTE [ inputs that alias ] ``torch.export`` merges inputs that are one tensor: Hugging Face's own
        causal-LM example, ``model(input_ids=ids, labels=ids)``, exported with GPT-2's every read of
        ``input_ids`` on the ``labels`` placeholder, and a chain whose first and last stage read one input was
        one stage: a plan without checkpoints, silently. The export is given distinct tensors instead, and the
        graph's placeholders are then as many as the call's inputs; training calls that pass one tensor twice
        run on it as they are, and the check that the graph trains bit-equal to the model's forward runs the
        call as given, aliasing included (``fidelity.check_export_fidelity``)."""
        seen: set[tuple[str, int]] = set()
        copied = False

        def own(t: torch.Tensor) -> torch.Tensor:
            nonlocal copied
            try:
                where = (str(t.device), t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # a tensor subclass without a plain storage
                return t
            if where in seen and t.numel():
                copied = True
                return t.clone()
            seen.add(where)
            return t

        args, kwargs = pytree.tree_map_only(torch.Tensor, own, (self.args, self.kwargs))
        return ModelCall(args=tuple(args), kwargs=dict(kwargs), signature=self.signature) if copied else self

    @property
    def sizes(self) -> str:
        """What an exported graph of this call is specialised to: the signature, and for a single-tensor call its
        tensor's dtype and shape (torch.export writes sizes into views, so another size needs another graph)."""
        return self.signature or _leaf_text(self.args[0])

    def same_inputs(self, sizes: str) -> bool:
        """Whether the call whose ``sizes`` are given passes the same inputs as this one (names, dtypes,
        constants) at whatever sizes: a smaller last batch or another padded length, not another kind of call."""
        return _SIZES.sub(r"\1[]", self.sizes) == _SIZES.sub(r"\1[]", sizes)

    def floating(self) -> torch.Tensor | None:
        """The first floating tensor input (what decides a call's precision), else None (token ids only)."""
        return next((t for t in self.leaves() if t.is_floating_point()), None)

    def describe_difference(self, other: ModelCall) -> str | None:
        """None when both calls have one signature, else one line naming the first inputs that differ."""
        if self.signature == other.signature:
            return None
        mine, theirs = _entries(self.signature), _entries(other.signature)
        names = [name for name in dict.fromkeys([*mine, *theirs]) if mine.get(name) != theirs.get(name)]
        # Inputs that differ in more than their sizes first: an input left out or added is what decides.
        names.sort(key=lambda name: name in mine and name in theirs and _unsized(mine[name]) == _unsized(theirs[name]))
        diffs = [f"{name}: {mine.get(name, 'absent')} vs {theirs.get(name, 'absent')}" for name in names]
        return "; ".join(diffs[:3]) + ("; …" if len(diffs) > 3 else "")


    def inputs_beyond(self, signature: str) -> str | None:
        """The inputs this call passes that a call of ``signature`` does not (``num_items_in_batch: float32[]``),
        as a hint for a refusal: transformers' ``Trainer`` adds a loss argument to every training call of a model
        whose forward takes ``**kwargs``, which the example given to ``checkpoint`` rarely has. None: no such
        input."""
        theirs = _entries(signature)
        extra = [f"{name}: {value}" if value else name for name, value in _entries(self.signature).items()
                 if name not in theirs]
        return "; ".join(extra) if extra else None


_SIZES = re.compile(r"((?:^|: )[a-z0-9_]+)\[[0-9, ]*\](?=;|$)")
"""A tensor's shape in a signature (``int64[2, 32]`` at its start or after a name's colon), for ``same_inputs``."""


def _unsized(entry: str) -> str:
    """An entry of a signature (``int64[2, 32]``) without its sizes (``int64[]``), for ordering differences."""
    return _SIZES.sub(r"\1[]", f"x: {entry}")


def _entries(signature: str) -> dict[str, str]:
    out = {}
    for part in filter(None, signature.split("; ")):
        name, *rest = re.split(r": |=", part, maxsplit=1)
        out[name] = rest[0] if rest else ""
    return out


_USE_CACHE = "use_cache"


def _cache_slot(model: nn.Module, sig: inspect.Signature, arguments: Mapping[str, Any]) -> str | None:
    """Where a call that would return the model's key/value cache takes ``use_cache=False``: ``use_cache``
    itself, or the ``**kwargs`` parameter that hands it to a wrapped model; None when the call does not leave
    it out, ``forward`` does not take it, or the configuration turns the cache off (it is on by default in
    GPT-2's, Llama's, T5's configurations and most checkpoints' ``config.json``).

    NOTE [ training without the cache ] A training call planned with ``use_cache`` left to such a
    configuration returned a ``DynamicCache``, which ``torch.export`` cannot trace, and ``checkpoint`` refused
    the model with export's message. A training step never reads the cache, and keeping it holds every block's
    keys and values until the output is dropped; transformers' own ``gradient_checkpointing_enable()`` turns it
    off in training, with a warning. remat binds such a call with ``use_cache=False``, the same for the example
    and for every training call (so both have one signature, and a plan made for an explicit
    ``use_cache=False`` is the same plan); ``checkpoint`` warns once. The configuration is left as it is, and
    so are calls outside training (eval mode and ``no_grad`` run the model's own forward)."""
    if getattr(getattr(model, "config", None), _USE_CACHE, None) is not True:
        return None
    return _parameter_left_out(model, sig, arguments)


def _parameter_left_out(model: nn.Module, sig: inspect.Signature, arguments: Mapping[str, Any]) -> str | None:
    """The parameter through which ``forward`` takes ``use_cache`` when the call leaves it out: ``use_cache``
    by name, or the ``**kwargs`` a PEFT ``PeftModel`` hands to the model it wraps (``get_base_model()``), when
    that model's ``forward`` names it. Other ``**kwargs`` are not assumed to reach a cache: BERT's masked LM
    takes them, and its configuration's ``use_cache=True`` builds no cache there."""
    param = sig.parameters.get(_USE_CACHE)
    if param is not None and param.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
        return None if _USE_CACHE in arguments else _USE_CACHE
    var_keyword = next((p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    base = getattr(model, "get_base_model", None)
    if var_keyword is None or not callable(base) or _USE_CACHE in arguments.get(var_keyword, {}):
        return None
    try:
        return var_keyword if _USE_CACHE in inspect.signature(type(base()).forward).parameters else None
    except (TypeError, ValueError):
        return None


def cache_turned_off(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str | None:
    """What ``checkpoint``, ``fetch_plan`` and ``fetch_and_apply`` warn when ``ModelCall.bind`` passes
    ``use_cache=False`` for this call, which leaves it out (NOTE [ training without the cache ]); None when it
    does not."""
    try:
        sig = inspect.signature(type(model).forward)
        bound = sig.bind(model, *args, **kwargs)
    except (TypeError, ValueError):
        return None
    if _cache_slot(model, sig, bound.arguments) is None:
        return None
    return (f"remat: {type(model).__name__}'s configuration turns its key/value cache on (use_cache=True); its "
            f"training calls run with use_cache=False, as transformers' gradient checkpointing does (a training "
            f"step never reads the cache). Pass use_cache=False to say so")


def _bind_names(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """Bind the call to ``type(model).forward``'s parameters: (arguments that stay positional, the rest by
    name in parameter order). A forward whose signature cannot be read keeps the call as given."""
    try:
        sig = inspect.signature(type(model).forward)
    except (TypeError, ValueError):
        return list(args), kwargs
    try:
        bound = sig.bind(model, *args, **kwargs)
    except TypeError as exc:
        raise PlanError(f"checkpoint: the example inputs do not fit {type(model).__name__}.forward: {exc}") from None
    slot = _cache_slot(model, sig, bound.arguments)
    if slot == _USE_CACHE:
        bound.arguments[slot] = False
    elif slot is not None:  # the **kwargs a wrapper hands on
        bound.arguments[slot] = {**bound.arguments.get(slot, {}), _USE_CACHE: False}
    positional: list[Any] = []
    named: dict[str, Any] = {}
    params = list(sig.parameters.values())[1:]  # without self
    for param in params:
        if param.name not in bound.arguments:
            continue
        value = bound.arguments[param.name]
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            positional.extend(value)
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif param.kind is inspect.Parameter.POSITIONAL_ONLY or positional:
            positional.append(value)
        else:
            named[param.name] = value
    return positional, named


_TENSOR_TEXT = re.compile(r"^([a-z0-9_]+)\[([0-9, ]*)\]$")


def synthetic_call(signature: str, model: nn.Module, device: torch.device | str) -> ModelCall | None:
    """A call with ``signature`` made of made-up values (integer inputs zeros, floating ones seeded normal
    values, constants as written), on ``device``, without touching the global RNG; None when the signature
    names nested inputs or values it cannot rebuild. Used to cut a plan's chain at ``apply`` time."""
    generator = torch.Generator().manual_seed(0)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for name, rest in _entries(signature).items():
        if not re.fullmatch(r"\*?[A-Za-z_][A-Za-z0-9_]*", name):
            return None
        match = _TENSOR_TEXT.match(rest)
        if match:
            dtype = getattr(torch, match.group(1), None)
            if not isinstance(dtype, torch.dtype):
                return None
            shape = [int(d) for d in match.group(2).split(",") if d.strip()]
            if dtype.is_floating_point:
                value: Any = torch.randn(shape, generator=generator).to(dtype)
            else:
                value = torch.zeros(shape, dtype=dtype)
            value = value.to(device)
        else:
            try:
                value = _constant(rest)
            except ValueError:
                return None
        if name.startswith("*"):
            args.append(value)
        else:
            kwargs[name] = value
    return ModelCall.bind(model, tuple(args), kwargs)


def _constant(text: str) -> Any:
    import ast

    if text.startswith("float('"):
        return float(text[7:-2])
    value = ast.literal_eval(text)
    if not isinstance(value, _CONSTANTS):
        raise ValueError(text)
    return value
