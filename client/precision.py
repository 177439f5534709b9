"""Training precision: what the plan key's ``dtype`` field names, and how a step runs in it.

Activation memory depends on the dtype the network computes in, not on the dtype of its input (token ids
are int64 whatever the model computes in), so the key's ``dtype`` field names the *precision* of the step:

- a floating dtype (``float32``, ``bfloat16``, ``float16``, ``float64``): the model's parameters and its
  floating inputs are in that dtype and no autocast is active;
- ``autocast_bfloat16`` / ``autocast_float16``: float32 parameters, forward and loss under
  ``torch.autocast(device_type, dtype=...)``, backward outside it (PyTorch's mixed-precision recipe).

The spellings are checked here and nowhere else, so the client, the service and the workers accept and refuse
the same ones. Parsing imports no torch; only :func:`autocast_context` and :func:`precision_of_call` do.

Public API::

    PRECISIONS                                    # every accepted spelling
    normalize_precision("torch.bfloat16") -> "bfloat16"
    autocast_dtype("autocast_bfloat16") -> "bfloat16"     (None for a plain dtype)
    autocast_context(precision, device_type)      # torch.autocast(...) or a no-op context
    precision_of_call(model, x) -> "autocast_bfloat16" | "float32" | ...   # what a training call runs in
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from remat.client.errors import PlanError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["AUTOCAST_PREFIX", "PLAIN_DTYPES", "PRECISIONS", "SPELLINGS", "autocast_context", "autocast_dtype",
           "normalize_precision", "precision_of_call"]

PLAIN_DTYPES = ("float32", "bfloat16", "float16", "float64")
AUTOCAST_PREFIX = "autocast_"
AUTOCAST_DTYPES = ("bfloat16", "float16")
PRECISIONS: tuple[str, ...] = PLAIN_DTYPES + tuple(AUTOCAST_PREFIX + d for d in AUTOCAST_DTYPES)
_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
            "fp64": "float64", "double": "float64"}


def _spellings() -> dict[str, str]:
    out = {}
    for name in PLAIN_DTYPES:
        out[name] = out[f"torch.{name}"] = name
    for alias, name in _ALIASES.items():
        out[alias] = name
        if name in AUTOCAST_DTYPES:
            out[AUTOCAST_PREFIX + alias] = AUTOCAST_PREFIX + name
    for name in AUTOCAST_DTYPES:
        out[AUTOCAST_PREFIX + name] = AUTOCAST_PREFIX + name
    return out


SPELLINGS: dict[str, str] = _spellings()
"""Every accepted spelling (exactly these strings, case included) and the precision it names. The API
publishes this set as its dtype pattern, so what it declares valid and what is accepted agree."""


def normalize_precision(value: object, field: str = "dtype") -> str:
    """The canonical spelling of a precision; one-line :class:`PlanError` naming ``field`` otherwise.

    ``torch.float32``, ``"torch.float32"``, ``"fp32"`` → ``"float32"``; ``"autocast_bf16"`` →
    ``"autocast_bfloat16"``.
    """
    name = SPELLINGS.get(str(value).strip()) if value is not None else None
    if name is None:
        raise PlanError(f"{field}: must be one of {', '.join(PRECISIONS)}, got {value!r}")
    return name


def autocast_dtype(precision: str) -> str | None:
    """The autocast dtype of a precision (``"bfloat16"`` for ``autocast_bfloat16``), None for a plain one."""
    name = normalize_precision(precision)
    return name.removeprefix(AUTOCAST_PREFIX) if name.startswith(AUTOCAST_PREFIX) else None


def autocast_context(precision: str, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """The context a step's forward and loss run in: ``torch.autocast`` for an autocast precision."""
    amp = autocast_dtype(precision)
    if amp is None:
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device_type=device_type, dtype=getattr(torch, amp))


def precision_of_call(model: nn.Module, x: torch.Tensor) -> str:
    """The precision a training call with input ``x`` runs in, read from the autocast state and dtypes.

    Under an enabled autocast for x's device type: ``autocast_<its dtype>``. Otherwise a floating input's
    dtype, or (integer inputs such as token ids) the dtype of the model's first floating parameter.
    """
    import torch

    if not isinstance(x, torch.Tensor):  # a ModelCall: its first floating input, else its first tensor
        x = x.floating() if x.floating() is not None else x.main
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return AUTOCAST_PREFIX + str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")
    if x.is_floating_point():
        return str(x.dtype).removeprefix("torch.")
    for p in model.parameters():
        if p.is_floating_point():
            return str(p.dtype).removeprefix("torch.")
    return "float32"
