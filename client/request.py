"""A profiling request: which model, at which input signature and conventions, to profile and plan.

One definition for the CLI (``remat-client plan MODEL``), the service's jobs (``POST /v1/jobs`` stores
``to_dict()`` and the worker rebuilds it with ``from_dict``) and the pipeline that runs it
(``remat.worker.pipeline``). Plain data: importing it loads no torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from remat.client.devices import DEVICES
from remat.client.errors import ModelError, PlanError
from remat.client.hf_models import MAX_SEQ_LEN
from remat.client.model_spec import canonical_spec, default_sample_shape, fixed_sample_shape, size_argument, source_of
from remat.client.plan_key import MAX_DIM, MAX_DIMS, MAX_NUMEL
from remat.client.precision import normalize_precision
from remat.client.trace import GRAD_CONVENTIONS, MODES

__all__ = ["DEFAULT_CPU_BATCH", "DEFAULT_CPU_RESOLUTION", "DEFAULT_CUDA_BATCH", "ModelRequest", "ProgressFn",
           "check_fixed_size", "default_request"]

DEFAULT_CPU_BATCH = 4
DEFAULT_CPU_RESOLUTION = 128
DEFAULT_CUDA_BATCH = 32
ProgressFn = Callable[[str, float], None]
"""Progress of a long request: called with what starts now and the fraction of the work done before it."""


@dataclass(kw_only=True, frozen=True)
class ModelRequest:
    """What a user asked for: a model and the input signature and conventions to plan for."""

    spec: str
    """A model spec (remat.client.model_spec): ``resnet152``, ``timm:NAME``, ``hf:gpt2``, ``pkg.module:callable``."""
    batch_size: int
    sample_shape: tuple[int, ...]
    """Input shape of one sample (C, H, W for images; ``(seq_len,)`` for a token model's ``input_ids``)."""
    device: str = "cpu"
    grads: str = "none"
    dtype: str = "float32"
    """The step's precision (``remat.client.precision``)."""
    mode: str = "train"
    model_kwargs: dict[str, Any] = field(default_factory=dict, hash=False)
    """Keyword arguments of the model's builder (``--model-kwargs``; an ``hf:`` model's configuration fields):
    they change the architecture."""
    seq_len: int | None = None
    """Tokens per sample of an ``hf:`` token model (``--seq-len``); then ``sample_shape`` is ``(seq_len,)``. None
    for every other model (and absent from ``to_dict``, so that their fingerprints stay)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "spec", canonical_spec(self.spec))
        if not isinstance(self.model_kwargs, dict) or not all(isinstance(k, str) for k in self.model_kwargs):
            raise ModelError(f"model_kwargs: must be a JSON object, got {self.model_kwargs!r}")
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
        if self.seq_len is not None:
            if (isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int)
                    or not 1 <= self.seq_len <= MAX_SEQ_LEN):
                raise PlanError(f"seq_len: must be an integer in 1..{MAX_SEQ_LEN}, got {self.seq_len!r}")
            if source_of(self.spec) != "hf":
                raise ModelError(f"seq_len: {self.spec} takes no token sequence (only hf: token models do)")
            if shape != (self.seq_len,):
                raise PlanError(f"seq_len: {self.seq_len} but input_shape is {list(shape)}; a token model's "
                                f"input_shape is [seq_len]")
        for name, choices in (("device", DEVICES), ("grads", GRAD_CONVENTIONS), ("mode", MODES)):
            if getattr(self, name) not in choices:
                raise PlanError(f"{name}: must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        object.__setattr__(self, "dtype", normalize_precision(self.dtype))

    @property
    def name(self) -> str:
        """Canonical model spec, as stored: ``torchvision:resnet152``."""
        return self.spec

    @property
    def source(self) -> str:
        """``torchvision``, ``timm``, ``hf``, ``python`` or ``custom`` (remat.client.model_spec)."""
        return source_of(self.spec)

    @property
    def call_signature(self) -> str:
        """The plan key's ``inputs`` for the call this request trains with: "" for one tensor (zoo models), the
        keyword call of an ``hf:`` model (remat.client.hf_models.hf_call_signature)."""
        if self.source != "hf":
            return ""
        from remat.client.hf_models import hf_call_signature

        return hf_call_signature(self.spec, batch_size=self.batch_size, sample_shape=self.sample_shape,
                                 dtype=self.dtype, overrides=self.model_kwargs)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return (self.batch_size, *self.sample_shape)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form a job stores (the API's ``JobCreate`` fields); ``model_kwargs`` and ``seq_len`` only when
        given, so that requests without them keep their fingerprint."""
        out: dict[str, Any] = {"model": self.name, "batch_size": self.batch_size,
                               "input_shape": list(self.sample_shape), "dtype": self.dtype, "device": self.device,
                               "mode": self.mode, "grads": self.grads}
        if self.model_kwargs:
            out["model_kwargs"] = dict(self.model_kwargs)
        if self.seq_len is not None:
            out["seq_len"] = self.seq_len
        return out

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> ModelRequest:
        """Parse ``to_dict``'s form; missing conventions take the defaults."""
        try:
            return cls(spec=obj["model"], batch_size=obj["batch_size"], sample_shape=tuple(obj["input_shape"]),
                       device=obj.get("device", "cpu"), grads=obj.get("grads", "none"),
                       dtype=obj.get("dtype", "float32"), mode=obj.get("mode", "train"),
                       model_kwargs=dict(obj.get("model_kwargs") or {}), seq_len=obj.get("seq_len"))
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
                    grads: str, dtype: str = "float32", model_kwargs: dict[str, Any] | None = None,
                    seq_len: int | None = None) -> ModelRequest:
    """Fill in defaults that keep a CPU run to a couple of minutes and a GPU run realistic.

    On CPU the images are 128 px (a 3-channel model's default resolution is scaled down, unless the model
    only runs at its own, like ViT) and the batch is 4; on CUDA the zoo's own input shape and a batch of 32.
    A model from a callable has no known input: ``sample_shape`` is then required. An ``hf:`` token model
    takes ``seq_len`` instead (default 128 tokens on CPU, 512 on CUDA; ``sample_shape`` becomes
    ``(seq_len,)``); an ``hf:`` vision model trains at its configuration's image size. ``hf:`` overrides
    are checked against the configuration's fields here (which imports transformers when there are any).

    Raises:
        ModelError: ``--seq-len`` for a model that takes no tokens, ``--input-shape`` for a token model, an
            unknown ``hf:`` name or configuration field; PlanError: a malformed size.
    """
    if source_of(spec) == "hf":
        sample_shape, seq_len, model_kwargs = _hf_input(spec, sample_shape, seq_len, device, model_kwargs)
    elif seq_len is not None:
        kind = "images" if source_of(spec) in ("torchvision", "timm") else "the input --input-shape gives"
        raise ModelError(f"--seq-len: {canonical_spec(spec)} takes {kind}, not token sequences; --seq-len applies "
                         f"to hf: token models")
    if sample_shape is not None and source_of(spec) == "torchvision":
        check_fixed_size(spec, sample_shape, model_kwargs)  # timm's is checked where the model is built: it
    elif sample_shape is None and source_of(spec) != "hf":  # imports torch, which a stored plan's answer does not
        sample_shape = fixed_sample_shape(spec, model_kwargs)
    if sample_shape is None:
        from remat.client.zoo import fixed_resolution

        shape = default_sample_shape(spec)
        if shape is None:
            raise ModelError(f"--input-shape is needed for {canonical_spec(spec)}: remat knows the input shape "
                             f"of torchvision, timm and hf: models only")
        scalable = source_of(spec) != "torchvision" or not fixed_resolution(spec)
        if device == "cpu" and len(shape) == 3 and scalable:
            shape = (shape[0], DEFAULT_CPU_RESOLUTION, DEFAULT_CPU_RESOLUTION)
        sample_shape = shape
    if batch_size is None:
        batch_size = DEFAULT_CPU_BATCH if device == "cpu" else DEFAULT_CUDA_BATCH
    return ModelRequest(spec=spec, batch_size=batch_size, sample_shape=tuple(sample_shape), device=device,
                        grads=grads, dtype=dtype, model_kwargs=dict(model_kwargs or {}), seq_len=seq_len)


def check_fixed_size(spec: str, sample_shape: Sequence[int], model_kwargs: Mapping[str, Any] | None) -> None:
    """Refuse a sample shape that a model built with ``model_kwargs`` cannot take (``fixed_sample_shape``), naming
    the shape it takes and the argument that builds it for the one given, before seconds of building and
    tracing end inside its forward.

    Raises:
        ModelError: the model takes one input size and ``sample_shape`` is not it.
    """
    fixed = fixed_sample_shape(spec, model_kwargs)
    given = tuple(sample_shape)
    if fixed is None or given == fixed:
        return

    def dims(shape: tuple[int, ...]) -> str:
        return ",".join(str(d) for d in shape)

    canonical = canonical_spec(spec)
    text = f"--input-shape {dims(given)}: {canonical} is built for {dims(fixed)} images only"
    argument = size_argument(canonical)
    if argument is None or len(given) != 3 or given[0] != fixed[0]:
        raise ModelError(f"{text}: use --input-shape {dims(fixed)}")
    size: object = given[1] if given[1] == given[2] and argument != "input_size" else [given[1], given[2]]
    kwargs = json.dumps({**(model_kwargs or {}), argument: size})
    raise ModelError(f"{text}: use --input-shape {dims(fixed)}, or build it for {given[1]}x{given[2]} with "
                     f"--model-kwargs '{kwargs}'")


def _hf_input(spec: str, sample_shape: Sequence[int] | None, seq_len: int | None, device: str,
              model_kwargs: dict[str, Any] | None) -> tuple[tuple[int, ...], int | None, dict[str, Any]]:
    """An hf: request's sample shape, sequence length and checked configuration overrides."""
    from remat.client.hf_models import (
        check_overrides,
        check_two_tower_input,
        default_seq_len,
        hf_image_shape,
        input_kind,
    )

    canonical = canonical_spec(spec)
    model_kwargs = check_overrides(canonical, model_kwargs)
    kind = input_kind(canonical)
    if kind != "image":
        if sample_shape is not None:
            images = (" (its images take vision_config.image_size of --model-kwargs)"
                      if kind == "tokens+image" else "")
            raise ModelError(f"--input-shape: {canonical} takes token ids, not a sample shape; give --seq-len N "
                             f"(tokens per sample){images}")
        if seq_len is None:
            seq_len = default_seq_len(device, canonical, model_kwargs)
        check_two_tower_input(canonical, model_kwargs, seq_len, field="--seq-len")
        return (seq_len,), seq_len, model_kwargs
    if seq_len is not None:
        raise ModelError(f"--seq-len: {canonical} takes images, not token sequences")
    shape = hf_image_shape(canonical, model_kwargs)
    if sample_shape is not None and tuple(sample_shape) != shape:
        raise ModelError(f"--input-shape: {canonical} trains at its configuration's image size "
                         f"{','.join(map(str, shape))}; set image_size (and num_channels) in --model-kwargs to "
                         f"change it")
    return shape, None, model_kwargs
