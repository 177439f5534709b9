"""A profiling request: which zoo model, at which input signature and conventions, to profile and plan.

One definition for the CLI (``remat-client plan MODEL``), the service's jobs (``POST /v1/jobs`` stores
``to_dict()`` and the worker rebuilds it with ``from_dict``) and the pipeline that runs it
(``remat.worker.pipeline``). Plain data: importing it loads no torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from remat.client.errors import ModelError, PlanError
from remat.client.plan_key import MAX_DIM, MAX_DIMS, MAX_NUMEL
from remat.client.precision import normalize_precision
from remat.client.trace import GRAD_CONVENTIONS, MODES

__all__ = ["DEFAULT_CPU_BATCH", "DEFAULT_CPU_RESOLUTION", "DEFAULT_CUDA_BATCH", "DEVICES", "ModelRequest",
           "ProgressFn", "default_request"]

DEFAULT_CPU_BATCH = 4
DEFAULT_CPU_RESOLUTION = 128
DEFAULT_CUDA_BATCH = 32
DEVICES = ("cpu", "cuda")
ProgressFn = Callable[[str, float], None]
"""Progress of a long request: called with what starts now and the fraction of the work done before it."""


@dataclass(kw_only=True, frozen=True)
class ModelRequest:
    """What a user asked for: a zoo model and the input signature and conventions to plan for."""

    spec: str
    """Zoo name: ``resnet152`` or ``torchvision:resnet152``."""
    batch_size: int
    sample_shape: tuple[int, ...]
    """Input shape of one sample (C, H, W for images)."""
    device: str = "cpu"
    grads: str = "none"
    dtype: str = "float32"
    """The step's precision (``remat.client.precision``)."""
    mode: str = "train"

    def __post_init__(self) -> None:
        spec = self.spec.strip() if isinstance(self.spec, str) else ""
        if not spec or len(spec) > 200:
            raise ModelError(f"model: must be a zoo name such as resnet152, got {self.spec!r}")
        object.__setattr__(self, "spec", spec)
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or not 1 <= self.batch_size:
            raise PlanError(f"batch_size: must be a positive integer, got {self.batch_size!r}")
        shape = tuple(self.sample_shape)
        if not shape or len(shape) >= MAX_DIMS or any(
                isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= MAX_DIM for d in shape):
            raise PlanError(f"input_shape: must be 1 to {MAX_DIMS - 1} positive integers, got {list(shape)}")
        numel = self.batch_size
        for d in shape:
            numel *= d
        if numel > MAX_NUMEL:
            raise PlanError(f"input_shape: batch {self.batch_size} x {list(shape)} is {numel} elements, more "
                            f"than the {MAX_NUMEL} allowed")
        object.__setattr__(self, "sample_shape", shape)
        for name, choices in (("device", DEVICES), ("grads", GRAD_CONVENTIONS), ("mode", MODES)):
            if getattr(self, name) not in choices:
                raise PlanError(f"{name}: must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        object.__setattr__(self, "dtype", normalize_precision(self.dtype))

    @property
    def name(self) -> str:
        """Canonical zoo name, as stored: ``torchvision:resnet152``."""
        return "torchvision:" + self.spec.lower().removeprefix("torchvision:")

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.batch_size, *self.sample_shape)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form a job stores (the API's ``JobCreate`` fields)."""
        return {"model": self.name, "batch_size": self.batch_size, "input_shape": list(self.sample_shape),
                "dtype": self.dtype, "device": self.device, "mode": self.mode, "grads": self.grads}

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> ModelRequest:
        """Parse ``to_dict``'s form; missing conventions take the defaults."""
        try:
            return cls(spec=obj["model"], batch_size=obj["batch_size"], sample_shape=tuple(obj["input_shape"]),
                       device=obj.get("device", "cpu"), grads=obj.get("grads", "none"),
                       dtype=obj.get("dtype", "float32"), mode=obj.get("mode", "train"))
        except KeyError as exc:
            raise PlanError(f"request: field {exc.args[0]!r} is missing") from None
        except TypeError as exc:
            raise PlanError(f"request: malformed ({exc})") from None

    @property
    def fingerprint(self) -> str:
        """sha256 of the canonical request: equal requests, however spelled, have one (jobs deduplicate on it)."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


def default_request(spec: str, *, batch_size: int | None, sample_shape: Sequence[int] | None, device: str,
                    grads: str, dtype: str = "float32") -> ModelRequest:
    """Fill in defaults that keep a CPU run to a couple of minutes and a GPU run realistic.

    On CPU the images are 128 px (a 3-channel model's default resolution is scaled down, unless the model
    only runs at its own, like ViT) and the batch is 4; on CUDA the zoo's own input shape and a batch of 32.
    """
    if sample_shape is None:
        from remat.client.zoo import default_input_shape, fixed_resolution

        shape = tuple(default_input_shape(spec, check_known=False))
        if device == "cpu" and len(shape) == 3 and not fixed_resolution(spec):
            shape = (shape[0], DEFAULT_CPU_RESOLUTION, DEFAULT_CPU_RESOLUTION)
        sample_shape = shape
    if batch_size is None:
        batch_size = DEFAULT_CPU_BATCH if device == "cpu" else DEFAULT_CUDA_BATCH
    return ModelRequest(spec=spec, batch_size=batch_size, sample_shape=tuple(sample_shape), device=device,
                        grads=grads, dtype=dtype)
