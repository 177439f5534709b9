"""The plan key: everything a measured plan depends on besides the algorithm and the budget.

A plan measured for one (architecture, input shape, dtype, mode, gradient convention, device class, torch
version) says nothing reliable about another: activation sizes scale with the input, the gradient convention
decides what checkpointing buys (feasibility P8), and fx graphs may change between torch releases. The field
names are those of the trace metadata (``model_hash``, ``input_shape``, ``dtype``, ``mode``, ``grads``,
``device``, ``torch_version``), so a trace's metadata dict can be read with ``PlanKey.from_dict``.

Public API::

    PlanKey(model_hash, input_shape, dtype="float32", mode="train", grads="none", device="cpu",
            torch_version=<this torch's major.minor>)
    PlanKey.for_model(model, input_shape, *, dtype=..., mode=..., grads=..., device=..., graph=None)
    key.to_dict() / PlanKey.from_dict(obj)
    key.describe_mismatch(other, fields=None) -> str | None
    current_torch_version() -> "2.15"
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from remat.client.errors import PlanError
from remat.client.trace import GRAD_CONVENTIONS, MODES

if TYPE_CHECKING:  # torch loads only when a key is built from a model: the CLI's store lookups stay torch-free
    import torch
    from torch import nn

__all__ = ["KEY_FIELDS", "PlanKey", "current_torch_version", "normalize_dtype", "normalize_torch_version"]


def normalize_torch_version(version: str) -> str:
    """``"2.15.0+cu132"`` → ``"2.15"`` (plans are keyed on major.minor)."""
    parts = str(version).split("+")[0].split(".")
    if len(parts) < 2 or not parts[0].isdigit():
        raise PlanError(f"torch_version: expected MAJOR.MINOR[.PATCH], got {version!r}")
    minor = "".join(ch for ch in parts[1] if ch.isdigit())
    return f"{int(parts[0])}.{int(minor or 0)}"


def current_torch_version() -> str:
    import torch

    return normalize_torch_version(torch.__version__)


def normalize_dtype(dtype: torch.dtype | str) -> str:
    """``torch.float32`` / ``"torch.float32"`` → ``"float32"``; other strings (autocast labels) kept."""
    text = str(dtype).strip()
    text = text.removeprefix("torch.")
    if not text:
        raise PlanError("dtype: must not be empty")
    return text


def _normalize_device(device: torch.device | str) -> str:
    """``torch.device("cuda:1")`` / ``"cuda:1"`` → ``"cuda"``."""
    return str(device).split(":")[0].strip().lower()


@dataclass(frozen=True, slots=True)
class PlanKey:
    """What a plan is valid for. Two keys match when every field is equal."""

    model_hash: str
    """``hashing.architecture_hash`` of the model (hex sha256)."""
    input_shape: tuple[int, ...]
    """Full input shape, batch dimension included."""
    dtype: str = "float32"
    """Input/compute dtype (``float32``, ``bfloat16``…), without the ``torch.`` prefix."""
    mode: str = "train"
    """``train`` or ``eval``: graphs (aux heads) and memory differ between the two."""
    grads: str = "none"
    """``none``: gradients set to None between steps (``zero_grad(set_to_none=True)``, PyTorch's default);
    ``kept``: gradients stay allocated across steps."""
    device: str = "cpu"
    """Device class: ``cpu`` or ``cuda``."""
    torch_version: str = field(default_factory=current_torch_version)
    """torch major.minor the plan was measured with."""

    def __post_init__(self) -> None:
        if not isinstance(self.model_hash, str) or not self.model_hash:
            raise PlanError(f"model_hash: must be a non-empty string, got {self.model_hash!r}")
        try:
            shape = tuple(int(d) for d in self.input_shape)
        except (TypeError, ValueError):
            raise PlanError(f"input_shape: must be a list of integers, got {self.input_shape!r}") from None
        if not shape or any(d <= 0 for d in shape):
            raise PlanError(f"input_shape: must be positive integers, got {list(shape)}")
        if self.mode not in MODES:
            raise PlanError(f"mode: must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.grads not in GRAD_CONVENTIONS:
            raise PlanError(f"grads: must be one of {', '.join(GRAD_CONVENTIONS)}, got {self.grads!r}")
        object.__setattr__(self, "input_shape", shape)
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        object.__setattr__(self, "device", _normalize_device(self.device))
        object.__setattr__(self, "torch_version", normalize_torch_version(self.torch_version))

    @classmethod
    def for_model(
        cls,
        model: nn.Module,
        input_shape: Sequence[int],
        *,
        dtype: torch.dtype | str = "float32",
        mode: str = "train",
        grads: str = "none",
        device: torch.device | str | None = None,
        graph: Any = None,
    ) -> PlanKey:
        """The key of ``model`` for one input signature (computes the architecture hash).

        ``device`` defaults to the device class of the model's parameters; ``graph`` is passed on to
        ``architecture_hash`` (a train-mode trace from ``trace_model``, or None to trace here).
        """
        from remat.client.hashing import architecture_hash

        if device is None:
            tensor = next(model.parameters(), None)
            device = tensor.device if tensor is not None else "cpu"

        return cls(
            model_hash=architecture_hash(model, graph=graph),
            input_shape=tuple(input_shape),
            dtype=normalize_dtype(dtype),
            mode=mode,
            grads=grads,
            device=_normalize_device(device),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON form; the names are the trace metadata's."""
        return {
            "model_hash": self.model_hash,
            "input_shape": list(self.input_shape),
            "dtype": self.dtype,
            "mode": self.mode,
            "grads": self.grads,
            "device": self.device,
            "torch_version": self.torch_version,
        }

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> PlanKey:
        """Parse ``to_dict``'s form (extra keys, e.g. the rest of a trace's metadata, are ignored)."""
        if not isinstance(obj, Mapping):
            raise PlanError(f"plan key: must be an object, got {type(obj).__name__}")
        missing = [name for name in ("model_hash", "input_shape") if name not in obj]
        if missing:
            raise PlanError(f"plan key: field {missing[0]!r} is missing")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in obj.items() if k in known})

    def describe_mismatch(self, other: PlanKey, fields: Iterable[str] | None = None) -> str | None:
        """None when ``other`` matches on ``fields`` (all by default), else one line naming each difference
        as ``field: <self's value> vs <other's value>``."""
        names = list(fields) if fields is not None else list(KEY_FIELDS)
        diffs = []
        for name in names:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                if name == "model_hash":
                    mine, theirs = f"{mine[:12]}…", f"{theirs[:12]}…"
                elif name == "input_shape":
                    mine, theirs = list(mine), list(theirs)
                diffs.append(f"{name}: {mine} vs {theirs}")
        return "; ".join(diffs) or None


KEY_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(PlanKey))
