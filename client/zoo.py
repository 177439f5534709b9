"""Model zoo names: ``resnet152`` or ``torchvision:vit_b_16`` → a randomly initialised ``nn.Module``.

Plans depend on the architecture, never on weight values (see ``hashing.architecture_hash``), so the zoo
never downloads weights: not the model's, not a detection backbone's.

Public API::

    resolve_model(spec: str, **kwargs) -> nn.Module          # raises UnknownModelError (a ValueError)
    default_input_shape(spec: str) -> tuple[int, ...]          # per-sample shape, e.g. (3, 299, 299)
    available_models() -> list[str]
    canonical_name(spec: str) -> str                           # "torchvision:resnet152"
"""

from __future__ import annotations

import difflib
import inspect
from typing import TYPE_CHECKING, Any

from remat.client.errors import UnknownModelError

if TYPE_CHECKING:  # torch loads only when a model is built: the CLI's store lookups must stay torch-free
    from torch import nn

__all__ = ["available_models", "canonical_name", "default_input_shape", "fixed_resolution", "resolve_model"]

_SOURCE = "torchvision"

#: Models whose input resolution is fixed or whose default is not 224².
_SPECIAL_SHAPES: dict[str, tuple[int, ...]] = {
    "inception_v3": (3, 299, 299),
    "quantized_inception_v3": (3, 299, 299),
    "ssd300_vgg16": (3, 300, 300),
    "ssdlite320_mobilenet_v3_large": (3, 320, 320),
    "fasterrcnn_mobilenet_v3_large_320_fpn": (3, 320, 320),
    "raft_large": (3, 360, 720),
    "raft_small": (3, 360, 720),
}
#: Video models take (C, T, H, W).
_VIDEO_SHAPES: dict[str, tuple[int, ...]] = {
    "r3d_18": (3, 16, 112, 112),
    "mc3_18": (3, 16, 112, 112),
    "r2plus1d_18": (3, 16, 112, 112),
    "s3d": (3, 16, 224, 224),
    "mvit_v1_b": (3, 16, 224, 224),
    "mvit_v2_s": (3, 16, 224, 224),
    "swin3d_t": (3, 16, 224, 224),
    "swin3d_s": (3, 16, 224, 224),
    "swin3d_b": (3, 16, 224, 224),
}


def _split(spec: str) -> str:
    spec = spec.strip()
    source, sep, name = spec.partition(":")
    if not sep:
        return spec
    if source != _SOURCE:
        raise UnknownModelError(f"unknown model source {source!r} in {spec!r}; use {_SOURCE}:NAME or just NAME")
    return name


def available_models() -> list[str]:
    """Every name ``resolve_model`` accepts (without the ``torchvision:`` prefix)."""
    import torchvision

    return list(torchvision.models.list_models())


def canonical_name(spec: str) -> str:
    """``resnet152`` and ``torchvision:resnet152`` both become ``torchvision:resnet152``; unknown names raise."""
    name = _split(spec)
    _check_known(name)
    return f"{_SOURCE}:{name}"


def _check_known(name: str) -> None:
    known = available_models()
    if name in known:
        return
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
    hint = f"; close matches: {', '.join(close)}" if close else "; see torchvision.models.list_models()"
    raise UnknownModelError(f"unknown model {name!r}{hint}")


def resolve_model(spec: str, **kwargs: Any) -> nn.Module:
    """Build the zoo model ``spec`` with random weights; ``kwargs`` go to its torchvision builder.

    Weights are never downloaded: ``weights=None`` always, and ``weights_backbone=None`` for builders that
    would otherwise fetch a pretrained backbone. inception_v3 and googlenet default to
    ``init_weights=False``: their scipy-based initialisation takes seconds and weights do not affect plans.

    Raises:
        UnknownModelError: the name is not a torchvision model (the message lists close matches).
    """
    import torchvision

    name = _split(spec)
    _check_known(name)
    builder = torchvision.models.get_model_builder(name)
    params = inspect.signature(builder).parameters
    if kwargs.get("weights") is not None or kwargs.get("weights_backbone") is not None:
        raise UnknownModelError("the zoo builds models without pretrained weights (weights=None only)")
    kwargs["weights"] = None
    if "weights_backbone" in params:
        kwargs["weights_backbone"] = None
    if name in ("inception_v3", "googlenet"):
        kwargs.setdefault("init_weights", False)
    return builder(**kwargs)


#: Name prefixes of models that only run at their native resolution (ViT checks the image size, MaxViT's
#: window partition needs multiples of its grid, Inception v3's auxiliary head a 17×17 map, so 299 px, in
#: train mode); everything else in the classification zoo runs at 128 px.
_FIXED_RESOLUTION_PREFIXES = ("vit_", "maxvit_", "inception_v3")


def fixed_resolution(spec: str) -> bool:
    """Whether the model must be fed its native input size (so a CPU run cannot scale images down)."""
    return _split(spec).startswith(_FIXED_RESOLUTION_PREFIXES)


def default_input_shape(spec: str, *, check_known: bool = True) -> tuple[int, ...]:
    """Per-sample input shape (no batch dimension) the model expects by default, e.g. ``(3, 224, 224)``.

    ``check_known=False`` skips asking torchvision whether the name exists (which imports it): the CLI
    first looks the request up in the plan store, and only builds — and so checks — the model on a miss.
    """
    name = _split(spec)
    if check_known:
        _check_known(name)
    return _SPECIAL_SHAPES.get(name) or _VIDEO_SHAPES.get(name) or (3, 224, 224)
