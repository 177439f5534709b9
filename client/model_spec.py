"""What a MODEL argument may name, and how it becomes an ``nn.Module``.

Five sources, one spelling each (``canonical_spec``):

- ``resnet152`` or ``torchvision:resnet152``: a torchvision model, random weights (remat.client.zoo);
- ``timm:convnext_tiny``: a timm model when timm is installed, never with pretrained weights;
- ``hf:gpt2`` or ``hf:path/to/config.json``: a Hugging Face transformers architecture of remat's allow-list,
  built from its configuration (``--model-kwargs`` overrides its fields), never downloaded
  (remat.client.hf_models); a path is canonical as its absolute path;
- ``package.module:callable`` (``mymodels.nets:build_unet``): any importable callable that returns an
  ``nn.Module``, called with ``--model-kwargs`` (a JSON object). The current directory is importable, as
  for ``python -m``;
- ``custom:ClassName``: a model that lives only in a training script's memory (``remat.client.checkpoint``);
  it names stored results and cannot be rebuilt from the name.

A service takes torchvision names and ``hf:NAME`` only: a callable spec would run code named by
whoever submits a job, and a path names a file of the client's. Plans never depend on weights, so nothing here
downloads any.

Importing this module loads no torch.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from remat.client.errors import ModelError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["MAX_SPEC_LENGTH", "SOURCES", "build_model", "canonical_spec", "default_sample_shape",
           "fixed_sample_shape", "parse_model_kwargs", "size_argument", "source_of"]

SOURCES = ("torchvision", "timm", "hf", "python", "custom")
MAX_SPEC_LENGTH = 200
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_ZOO_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_CALLABLE_RE = re.compile(rf"{_NAME}(\.{_NAME})*:{_NAME}(\.{_NAME})*")
_FORMS = ("a torchvision name (resnet152), torchvision:NAME, timm:NAME, hf:NAME, hf:CONFIG.json or "
          "package.module:callable")


def _malformed(spec: object) -> ModelError:
    return ModelError(f"model: {spec!r} is not {_FORMS}")


def canonical_spec(spec: object) -> str:
    """The one spelling of a model spec: ``resnet152`` → ``torchvision:resnet152``, ``hf:GPT2`` → ``hf:gpt2``,
    ``hf:cfg/config.json`` → ``hf:`` and its absolute path; others as written.

    Raises:
        ModelError: not one of the five forms (the message lists them), or an ``hf:`` name that is not on the
            allow-list (the message gives close matches).
    """
    if not isinstance(spec, str) or not spec.strip() or len(spec.strip()) > MAX_SPEC_LENGTH:
        raise _malformed(spec)
    text = spec.strip()
    source, sep, name = text.partition(":")
    if not sep:
        if not _ZOO_NAME_RE.fullmatch(text) or "." in text:
            raise _malformed(spec)
        return f"torchvision:{text.lower()}"
    if source == "torchvision" and _ZOO_NAME_RE.fullmatch(name):
        return f"torchvision:{name.lower()}"
    if source in ("timm", "custom") and _ZOO_NAME_RE.fullmatch(name):
        return f"{source}:{name}"
    if source == "hf" and name.strip() and name.isprintable():
        from remat.client.hf_models import canonical_hf_name

        canonical = f"hf:{canonical_hf_name(name)}"
        if len(canonical) > MAX_SPEC_LENGTH:
            raise ModelError(f"model: {canonical[:60]}…: longer than {MAX_SPEC_LENGTH} characters (move the "
                             f"config.json to a shorter path)")
        return canonical
    if _CALLABLE_RE.fullmatch(text) and source not in SOURCES:
        return text
    raise _malformed(spec)


def source_of(spec: str) -> str:
    """``torchvision``, ``timm``, ``hf``, ``python`` or ``custom``."""
    source = canonical_spec(spec).partition(":")[0]
    return source if source in ("torchvision", "timm", "hf", "custom") else "python"


def parse_model_kwargs(text: str | None) -> dict[str, Any]:
    """``--model-kwargs '{"num_classes": 10}'`` → a dict; ModelError naming the flag otherwise.

    Read by ``wire_json`` like every JSON remat accepts: NaN would reach a builder and then a service job's
    request, and a 10^5-deep array raised ``RecursionError`` (exit 1, not the input error it is)."""
    if text is None or not text.strip():
        return {}
    from remat.client import wire_json

    try:
        value = wire_json.loads(text, where="--model-kwargs")
    except wire_json.WireJSONError as exc:
        raise ModelError(str(exc) if str(exc).startswith("--model-kwargs") else f"--model-kwargs: {exc}") from None
    if not isinstance(value, dict):
        raise ModelError(f"--model-kwargs: must be a JSON object such as '{{\"num_classes\": 10}}', "
                         f"got {type(value).__name__}")
    return value


def _timm() -> Any:
    try:
        return importlib.import_module("timm")
    except ImportError:
        raise ModelError("timm models need timm: `uv sync --extra timm` (or `pip install timm`)") from None


def _import_callable(spec: str) -> Any:
    module_name, _, attr_path = spec.partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # `remat-client plan mymodels:build` from the project's directory, as python -m
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelError(f"model {spec}: cannot import {module_name} ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failing at import is the user's error to read
        raise ModelError(f"model {spec}: importing {module_name} failed: {type(exc).__name__}: "
                         f"{(str(exc).splitlines() or [''])[0]}") from None
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ModelError(f"model {spec}: {module_name} has no attribute {attr_path}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelError(f"model {spec}: {attr_path} is not callable")
    return obj


def build_model(spec: str, kwargs: Mapping[str, Any] | None = None) -> nn.Module:
    """The model a spec names, built with ``kwargs``, random weights (for ``hf:`` specs ``kwargs`` override
    configuration fields; the model is in train mode with ``use_cache=False``).

    Raises:
        ModelError: unknown name, timm missing, an import or call that fails, or a result that is no module
            (one line each, naming the spec).
    """
    from torch import nn

    from remat.client.zoo import resolve_model

    canonical = canonical_spec(spec)
    kwargs = dict(kwargs or {})
    source = source_of(canonical)
    name = canonical.partition(":")[2]
    if source == "torchvision":
        return _built_with(canonical, kwargs, lambda: resolve_model(canonical, **kwargs))
    if source == "hf":
        from remat.client.hf_models import build_hf_model

        return build_hf_model(canonical, kwargs)
    if source == "custom":
        raise ModelError(f"model {canonical}: a model in a training script's memory cannot be rebuilt from its "
                         f"name; remat.client.checkpoint(model, example_input) plans it there")
    if source == "timm":
        timm = _timm()
        if kwargs.get("pretrained"):
            raise ModelError("--model-kwargs: remat builds models without pretrained weights (plans do not "
                             "depend on them)")
        try:
            model = _built_with(canonical, kwargs,
                                lambda: timm.create_model(name, **{**kwargs, "pretrained": False}))
        except RuntimeError as exc:  # timm's "Unknown model (...)"
            raise ModelError(f"model {canonical}: {(str(exc).splitlines() or [''])[0]}") from None
    else:
        builder = _import_callable(canonical)
        try:
            model = builder(**kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure of the user's builder is reported, not raised
            raise ModelError(f"model {canonical}: calling it with {json.dumps(kwargs)} failed: "
                             f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}") from None
    if not isinstance(model, nn.Module):
        raise ModelError(f"model {canonical}: returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _built_with(canonical: str, kwargs: Mapping[str, Any], build: Callable[[], Any]) -> Any:
    """A library's builder called with the user's ``--model-kwargs``: a failure they cause (an argument the
    model has no parameter for, a value it cannot take) is bad input, one line naming them (exit 2), as for a
    user's own builder; a failure without any is remat's to report (exit 1)."""
    try:
        return build()
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the arguments make the builder raise is reported
        if not kwargs:
            raise
        raise ModelError(f"model {canonical}: building it with --model-kwargs {json.dumps(dict(kwargs))} failed: "
                         f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}") from None


#: The ``--model-kwargs`` field that sets the image size a fixed-size model is built for, by source and name.
_SIZE_ARGUMENTS = {("torchvision", "vit_"): "image_size", ("torchvision", "maxvit_"): "input_size",
                   ("timm", ""): "img_size"}


def size_argument(spec: str) -> str | None:
    """The builder argument that sets a fixed-size model's image size (``image_size`` for torchvision's ViT,
    ``input_size`` for its MaxViT, ``img_size`` for timm), None where remat knows of none."""
    canonical = canonical_spec(spec)
    source, _, name = canonical.partition(":")
    return next((arg for (src, prefix), arg in _SIZE_ARGUMENTS.items()
                 if src == source and name.startswith(prefix)), None)


def _side_lengths(value: object) -> tuple[int, int] | None:
    """An image size as a builder takes it (``224`` or ``[224, 224]``) as (height, width); None if it is neither."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    if (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        return int(value[0]), int(value[1])
    return None


def fixed_sample_shape(spec: str, model_kwargs: Mapping[str, Any] | None = None) -> tuple[int, ...] | None:
    """The one sample shape a model built with ``model_kwargs`` trains on, for a model whose input size is part
    of its architecture (a vision transformer's position table, MaxViT's attention grids), else None.

    Such a model cannot be profiled on smaller CPU images, and any other ``--input-shape`` fails inside its
    forward after seconds of building; knowing the shape, remat defaults to it and refuses another one up front,
    naming the argument that builds the model for it. torchvision's ViT and MaxViT take ``image_size`` and
    ``input_size``; a timm model says so in its pretrained configuration (``fixed_input_size``) and takes
    ``img_size`` (and ``in_chans``); an ``hf:`` vision model takes its configuration's ``image_size`` (its
    requests check their shapes themselves: ``remat.client.request``). A size argument of another type is
    left to the builder to refuse.
    """
    canonical = canonical_spec(spec)
    source, _, name = canonical.partition(":")
    kwargs = model_kwargs or {}
    if source == "hf":
        from remat.client.hf_models import hf_image_shape, input_kind

        return hf_image_shape(canonical, kwargs) if input_kind(canonical) == "image" else None
    argument = size_argument(canonical)
    if source == "torchvision" and argument is not None:
        from remat.client.zoo import default_input_shape

        channels, *native = default_input_shape(canonical, check_known=False)
        sides = _side_lengths(kwargs[argument]) if argument in kwargs else (native[0], native[1])
        return None if sides is None else (channels, *sides)
    if source == "timm":
        try:
            cfg = _timm().models.get_pretrained_cfg(name)
        except ModelError:
            raise
        except Exception:  # noqa: BLE001 - no configuration: nothing known of its input
            return None
        if cfg is None or not getattr(cfg, "fixed_input_size", False) or len(cfg.input_size) != 3:
            return None
        sides = _side_lengths(kwargs["img_size"]) if "img_size" in kwargs else tuple(cfg.input_size[1:])
        channels = kwargs.get("in_chans", cfg.input_size[0])
        if sides is None or not isinstance(channels, int) or isinstance(channels, bool):
            return None
        return (channels, *sides)
    return None


def default_sample_shape(spec: str) -> tuple[int, ...] | None:
    """One sample's input shape when the source knows it (torchvision; timm's pretrained config; an hf vision
    model's configuration), else None: an hf token model has a sequence length instead (``--seq-len``)."""
    canonical = canonical_spec(spec)
    source = source_of(canonical)
    if source == "hf":
        from remat.client.hf_models import hf_image_shape, is_token_model

        return None if is_token_model(canonical) else hf_image_shape(canonical)
    if source == "torchvision":
        from remat.client.zoo import default_input_shape

        return tuple(default_input_shape(canonical, check_known=False))
    if source == "timm":
        timm = _timm()
        try:
            cfg = timm.models.get_pretrained_cfg(canonical.partition(":")[2])
        except Exception:  # noqa: BLE001 - no config: the caller asks for --input-shape
            cfg = None
        size = getattr(cfg, "input_size", None) if cfg is not None else None
        return tuple(size) if size else None
    return None
