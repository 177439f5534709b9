"""``hf:`` model specs: Hugging Face transformers architectures built from their configurations, never downloaded.

Two spellings (``remat.client.model_spec`` makes them canonical):

- ``hf:gpt2``: an architecture of the allow-list :data:`HF_ARCHITECTURES`, at its built-in default
  configuration (``AutoConfig.for_model``); ``--model-kwargs`` overrides configuration fields
  (``'{"n_layer": 6}'``), and the fields of a sub-configuration as an object of them (CLIP's
  ``'{"text_config": {"num_hidden_layers": 4}}'``);
- ``hf:path/to/config.json`` (canonical: its absolute path): a local ``config.json`` whose ``model_type`` is on
  the allow-list. Client side only: a service's workers never read a path that a request names.

Models get random weights (plans never depend on them), train mode and ``use_cache=False`` (a training step
keeps no cache); no remote code ever runs (``trust_remote_code`` is never passed, ``auto_map`` is dropped).
A model trains on one call of keyword inputs (:func:`hf_example_call`): token models on ``input_ids``,
``attention_mask`` and ``labels`` (so the model computes its own loss), ``(seq_len,)`` being one sample's
shape; vision models on ``pixel_values`` and ``labels``, at the image size of their configuration; two-tower
models (CLIP) on ``input_ids`` and ``pixel_values`` with ``return_loss=True`` (their contrastive loss), the
tokens at ``(seq_len,)`` and the images at their vision configuration's size.

Importing this module loads neither torch nor transformers: the checks a request needs before anything is
built read the allow-list and, for a path, the JSON file. Checking override names against the configuration
(:func:`check_overrides`) and building import transformers (and so torch).

Public API::

    HF_ARCHITECTURES                    # short name -> HfArchitecture(model_type, task)
    canonical_hf_name(name) -> str      # "gpt2" or an absolute config.json path; ModelError with close matches
    is_hf_path(name) -> bool
    hf_architecture(spec) -> str        # the allow-list name a spec builds (a path: by its model_type)
    input_kind(spec) -> "tokens" | "image" | "tokens+image"
    is_token_model(spec) -> bool        # takes --seq-len: tokens, or tokens and images
    default_seq_len(device, spec, overrides) -> int
    text_positions(spec, overrides) -> int | None     # a two-tower model's longest caption, without transformers
    check_two_tower_input(spec, overrides, seq_len, field=...) -> None   # its images and captions, before building
    hf_image_shape(spec, overrides) -> (C, H, W)      # models that take images: from the configuration
    check_override_values(overrides) -> dict          # JSON scalars or lists; no field remat sets itself
    check_overrides(spec, overrides) -> dict          # + every key a field of the configuration (transformers)
    check_service_spec(spec, overrides) -> None       # what a service's workers may build ("model: …" errors)
    build_hf_model(spec, overrides) -> nn.Module
    hf_example_call(model, spec, *, batch_size, seq_len, device) -> (args, kwargs)
    hf_zoo() -> list[HfZooModel]        # what `remat-client zoo hf` profiles, sized for a CPU
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from remat.client.errors import ModelError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["DEFAULT_CPU_SEQ_LEN", "DEFAULT_CUDA_SEQ_LEN", "HF_ARCHITECTURES", "HF_PREFIX", "MAX_SEQ_LEN", "TASKS",
           "HfArchitecture", "HfZooModel", "build_hf_model", "canonical_hf_name", "check_override_values",
           "check_overrides", "check_service_spec", "check_two_tower_input", "default_seq_len", "hf_architecture",
           "hf_example_call", "hf_image_shape", "hf_zoo", "input_kind", "is_hf_path", "is_token_model",
           "text_positions"]

HF_PREFIX = "hf:"
DEFAULT_CPU_SEQ_LEN = 128
DEFAULT_CUDA_SEQ_LEN = 512
MAX_SEQ_LEN = 1 << 20
"""Longest ``--seq-len`` a request may ask for (a model's own position limit is checked when it is built)."""

TASKS = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "image-classification": "AutoModelForImageClassification",
    "contrastive": "AutoModel",
}
"""A task decides the transformers Auto class that builds the model (and so its head and its loss). A
``contrastive`` model (CLIP's ``CLIPModel``) has no head: called with ``return_loss=True`` it computes the
contrastive loss of its two towers' embeddings."""


class HfArchitecture(NamedTuple):
    model_type: str
    """The configuration's ``model_type`` (``AutoConfig.for_model``'s argument)."""
    task: str
    """A key of :data:`TASKS`."""


HF_ARCHITECTURES: dict[str, HfArchitecture] = {
    "gpt2": HfArchitecture("gpt2", "causal-lm"),
    "llama": HfArchitecture("llama", "causal-lm"),
    "mistral": HfArchitecture("mistral", "causal-lm"),
    "qwen2": HfArchitecture("qwen2", "causal-lm"),
    "mixtral": HfArchitecture("mixtral", "causal-lm"),  # mixture of experts
    "bert": HfArchitecture("bert", "masked-lm"),
    "roberta": HfArchitecture("roberta", "masked-lm"),
    "t5": HfArchitecture("t5", "seq2seq-lm"),
    "bart": HfArchitecture("bart", "seq2seq-lm"),
    "vit": HfArchitecture("vit", "image-classification"),
    "clip": HfArchitecture("clip", "contrastive"),  # two towers: text and image
}
"""The architectures remat builds (a fixed allow-list: a name is never looked up anywhere else)."""

_DEFAULT_IMAGE = {"vit": (3, 224), "clip": (3, 224)}
"""(num_channels, image_size) of each architecture's default configuration that takes images (a test holds them
equal to transformers'), so that a request's input shape needs no transformers."""
_SUB_CONFIGS = {"clip": {"text": "text_config", "image": "vision_config"}}
"""Where a composite configuration keeps the fields of its text and its image tower (the others keep them at
the top level)."""
_DEFAULT_TEXT_POSITIONS = {"clip": 77}
"""The text tower's position limit of a composite default configuration (a test holds it equal to
transformers'): the default ``--seq-len`` is at most that."""

_REFUSED_OVERRIDES = {
    "model_type": "the spec names the architecture",
    "auto_map": "remat never runs a model's remote code",
    "dtype": "--dtype sets the precision",
    "torch_dtype": "--dtype sets the precision",
    "use_cache": "a training step runs without the cache (remat sets use_cache=False)",
    "architectures": "it sets no architecture field",
    "transformers_version": "it sets no architecture field",
    "name_or_path": "it sets no architecture field",
}
"""Configuration fields that ``--model-kwargs`` may not set, and why."""
_DROPPED_FROM_JSON = ("auto_map", "dtype", "torch_dtype", "use_cache", "transformers_version", "_name_or_path",
                      "quantization_config")
"""Fields of a config.json that remat does not pass on (remote code, precision: the request's, the cache)."""
_MAX_LIST_ITEMS = 1024
_MAX_TEXT = 200
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
_MAX_JSON_BYTES = 1 << 20


def _known() -> str:
    return ", ".join(HF_ARCHITECTURES)


def is_hf_path(name: str) -> bool:
    """Whether the part after ``hf:`` names a config.json (has a directory part or ends in ``.json``)."""
    return "/" in name or os.sep in name or name.lower().endswith(".json") or name.startswith((".", "~"))


def canonical_hf_name(name: str) -> str:
    """The part after ``hf:`` in its one spelling: an allow-list name in lower case, or a config.json's
    absolute path (a relative path is resolved against the current directory; the file is not read here).

    Raises:
        ModelError: an unknown architecture (with close matches) or an empty name.
    """
    text = name.strip()
    if not text:
        raise ModelError(f"model: hf: needs an architecture ({_known()}) or a path to a config.json")
    if is_hf_path(text):
        return os.path.abspath(os.path.expanduser(text))
    lowered = text.lower()
    if lowered in HF_ARCHITECTURES:
        return lowered
    close = difflib.get_close_matches(lowered, list(HF_ARCHITECTURES), n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    shown = text if _NAME_RE.fullmatch(text) else text[:40]
    raise ModelError(f"unknown hf: architecture {shown!r}{hint} (known: {_known()}; or hf:path/to/config.json)")


def _name_of(spec: str) -> str:
    """``hf:gpt2`` → ``gpt2``; a bare name or path is accepted too."""
    return canonical_hf_name(spec[len(HF_PREFIX):] if spec.startswith(HF_PREFIX) else spec)


def _read_config_json(path: str) -> dict[str, Any]:
    """A config.json as a dict, its model_type on the allow-list; ModelError naming the file otherwise."""
    label = f"model {HF_PREFIX}{path}"
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_JSON_BYTES + 1)
    except OSError as exc:
        raise ModelError(f"{label}: cannot be read ({exc.strerror or exc})") from None
    if len(raw) > _MAX_JSON_BYTES:
        raise ModelError(f"{label}: larger than {_MAX_JSON_BYTES} bytes, not a model configuration")
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{label}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ModelError(f"{label}: must be a JSON object (a transformers config.json)")
    model_type = value.get("model_type")
    types = {arch.model_type for arch in HF_ARCHITECTURES.values()}
    if model_type not in types:
        raise ModelError(f"{label}: model_type {model_type!r} is not one remat builds (known: "
                         f"{', '.join(sorted(types))})")
    return value


def _resolve(spec: str) -> tuple[str, dict[str, Any]]:
    """(allow-list name, the config.json's fields, empty for a name)."""
    name = _name_of(spec)
    if not is_hf_path(name):
        return name, {}
    values = _read_config_json(name)
    arch = next(n for n, a in HF_ARCHITECTURES.items() if a.model_type == values["model_type"])
    return arch, values


def hf_architecture(spec: str) -> str:
    """The allow-list name ``spec`` builds: its own, or the one of a config.json's ``model_type``."""
    return _resolve(spec)[0]


def input_kind(spec: str) -> Literal["tokens", "image", "tokens+image"]:
    """What one sample is: ``tokens`` (a sequence of ids, ``(seq_len,)``), ``image`` (``(C, H, W)``) or both
    (CLIP: a caption of ``seq_len`` ids and an image at its vision configuration's size)."""
    task = HF_ARCHITECTURES[hf_architecture(spec)].task
    if task == "image-classification":
        return "image"
    return "tokens+image" if task == "contrastive" else "tokens"


def is_token_model(spec: str) -> bool:
    """Whether the spec's model takes token ids, and so ``--seq-len`` (a request's ``input_shape`` is then
    ``[seq_len]``; a two-tower model's images take its configuration's size, like a vision model's)."""
    return input_kind(spec) != "image"


def default_seq_len(device: str, spec: str | None = None, overrides: Mapping[str, Any] | None = None) -> int:
    """The sequence length of a token model when none is asked for: short on a CPU, realistic on a GPU; for a
    two-tower model (``spec`` given) at most its text tower's positions (:func:`text_positions`)."""
    length = DEFAULT_CPU_SEQ_LEN if str(device).split(":")[0] == "cpu" else DEFAULT_CUDA_SEQ_LEN
    limit = text_positions(spec, overrides) if spec is not None else None
    return length if limit is None else min(length, limit)


def text_positions(spec: str, overrides: Mapping[str, Any] | None = None) -> int | None:
    """A two-tower model's longest caption (CLIP: 77 tokens at its default configuration), read without
    transformers from the overrides, the config.json or the default configuration; None for the other models,
    whose position limit is checked once the model is built (:func:`hf_example_call`)."""
    arch, values = _resolve(spec)
    if arch not in _DEFAULT_TEXT_POSITIONS:
        return None
    text = _merged_fields(values, overrides or {}).get(_SUB_CONFIGS[arch]["text"])
    limit = text.get("max_position_embeddings") if isinstance(text, dict) else None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        limit = _DEFAULT_TEXT_POSITIONS[arch]
    return limit


def check_two_tower_input(spec: str, overrides: Mapping[str, Any] | None, seq_len: int, *, field: str) -> None:
    """What a request of a two-tower model must hold before anything is built (nothing for other models): its
    images a positive ``vision_config.image_size`` (:func:`hf_image_shape`) and its captions within its text
    tower's positions (:func:`text_positions`). One check for the CLI and the service's jobs.

    Raises:
        ModelError: ``model_kwargs: …`` for the image size; ``{field}: …`` (``--seq-len`` or ``seq_len``) for a
            caption longer than the text tower takes.
    """
    if input_kind(spec) != "tokens+image":
        return
    hf_image_shape(spec, overrides)
    limit = text_positions(spec, overrides)
    if limit is not None and seq_len > limit:
        raise ModelError(f"{field}: {spec} takes captions of at most {limit} tokens (its text tower's position "
                         f"embeddings, text_config.max_position_embeddings), got {seq_len}")


def hf_image_shape(spec: str, overrides: Mapping[str, Any] | None = None) -> tuple[int, int, int]:
    """One image's shape ``(num_channels, image_size, image_size)`` for a spec that takes images: the
    overrides', else the config.json's, else the architecture's default configuration (a two-tower model's
    from its vision configuration, ``vision_config``). Needs no transformers.

    Raises:
        ModelError: a token model, or a size that is not a positive integer.
    """
    arch, values = _resolve(spec)
    if arch not in _DEFAULT_IMAGE:
        raise ModelError(f"model {HF_PREFIX}{_name_of(spec)}: takes token ids, not images")
    channels, size = _DEFAULT_IMAGE[arch]
    merged = _merged_fields(values, overrides or {})
    where = _SUB_CONFIGS.get(arch, {}).get("image")
    if where is not None:
        merged = merged.get(where) if isinstance(merged.get(where), dict) else {}
    out = []
    for field, default in (("num_channels", channels), ("image_size", size)):
        value = merged.get(field, default)
        if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
            value = value[0]  # [224, 224]: square
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 16:
            label = f"{where}.{field}" if where else field
            raise ModelError(f"model_kwargs: {label} must be a positive integer (one side of a square image), "
                             f"got {value!r}")
        out.append(value)
    return out[0], out[1], out[1]


def _merged_fields(values: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A config.json's fields with the overrides on top; a sub-configuration given in both (``text_config``)
    is merged field by field, as transformers builds it from the one dict it is handed."""
    merged = dict(values)
    for key, value in overrides.items():
        below = merged.get(key)
        merged[key] = {**below, **value} if isinstance(value, dict) and isinstance(below, dict) else value
    return merged


# --- configuration overrides ------------------------------------------------------------------------------

def _check_value(key: str, value: Any, depth: int = 0) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        if isinstance(value, str) and len(value) > _MAX_TEXT:
            raise ModelError(f"model_kwargs: {key}: text longer than {_MAX_TEXT} characters")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ModelError(f"model_kwargs: {key}: must be a finite number, got {value!r}")
        return value
    if isinstance(value, (list, tuple)) and depth < 2:
        if len(value) > _MAX_LIST_ITEMS:
            raise ModelError(f"model_kwargs: {key}: a list of more than {_MAX_LIST_ITEMS} items")
        return [_check_value(key, item, depth + 1) for item in value]
    raise ModelError(f"model_kwargs: {key}: must be a JSON scalar or a list of them, got "
                     f"{type(value).__name__} (an object only for a sub-configuration's fields, such as "
                     f"text_config; set deeper fields in a config.json: hf:path/to/config.json)")


def _check_field_values(fields: Mapping[Any, Any], prefix: str = "") -> dict[str, Any]:
    """Each key a plain field name remat does not set itself, each value :func:`_check_value`'s; at the top
    level (``prefix`` empty) a value may also be an object of one sub-configuration's fields."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        label = f"{prefix}{key}"
        if not isinstance(key, str) or not key or key.startswith("_"):
            raise ModelError(f"model_kwargs: {label!r} is not a configuration field")
        if key in _REFUSED_OVERRIDES:
            raise ModelError(f"model_kwargs: {label} cannot be set: {_REFUSED_OVERRIDES[key]}")
        if isinstance(value, Mapping) and not prefix:
            if len(value) > _MAX_LIST_ITEMS:
                raise ModelError(f"model_kwargs: {key}: an object of more than {_MAX_LIST_ITEMS} fields")
            out[key] = _check_field_values(value, f"{key}.")
        else:
            out[key] = _check_value(label, value)
    return out


def check_override_values(overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """The overrides as plain JSON values; needs no transformers. A value may be an object of fields itself
    (one level deep): the fields of a sub-configuration, such as CLIP's ``text_config``, which
    :func:`check_overrides` holds to that sub-configuration's fields.

    Raises:
        ModelError: (``model_kwargs: …``) a key remat sets itself or that is private, or a value that is not a
            JSON scalar (null, boolean, number, text), a list of them or, at the top, an object of them.
    """
    if overrides is None:
        return {}
    if not isinstance(overrides, Mapping):
        raise ModelError(f"model_kwargs: must be a JSON object of configuration fields, got "
                         f"{type(overrides).__name__}")
    return _check_field_values(overrides)


def _config_fields(config: Any) -> set[str]:
    """The fields a configuration has: its serialised fields, their aliases (GPT-2's ``num_hidden_layers`` for
    ``n_layer``) and ``num_labels``; methods and properties are not fields."""
    names = set(config.to_dict()) | set(getattr(config, "attribute_map", {}) or {}) | {"num_labels"}
    return {n for n in names if not n.startswith("_") and n not in _REFUSED_OVERRIDES}


def _transformers() -> Any:
    """transformers, its log quiet below errors: this module runs in remat's own processes (the CLI, workers,
    the service), where a shrunken vocabulary below the default special token ids or an unset loss type would
    print warnings about a configuration the user asked for on purpose."""
    try:
        import transformers
    except ImportError:
        raise ModelError("hf: models need transformers: `uv sync --extra hf` (or `pip install "
                         "'transformers>=5'`)") from None
    transformers.logging.set_verbosity_error()
    return transformers


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def _base_config(arch: str, values: Mapping[str, Any]) -> Any:
    transformers = _transformers()
    model_type = HF_ARCHITECTURES[arch].model_type
    try:
        return transformers.AutoConfig.for_model(model_type, **values)
    except Exception as exc:  # noqa: BLE001 - a configuration's own validation: its words, one line
        raise ModelError(f"model {HF_PREFIX}{arch}: the configuration is refused: {type(exc).__name__}: "
                         f"{_one_line(exc)}") from None


def _json_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k != "model_type" and k not in _DROPPED_FROM_JSON}


def check_overrides(spec: str, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """:func:`check_override_values`, then every key a field of the spec's configuration, and the configuration
    with them passing transformers' own checks (imports transformers, and so torch, when there are overrides).

    Raises:
        ModelError: ``model_kwargs: …`` naming the unknown fields and their close matches, or a bad value;
            ``model hf:NAME: the configuration is refused: …`` with transformers' reason.
    """
    checked = check_override_values(overrides)
    if not checked:
        return checked
    arch, values = _resolve(spec)
    config = _base_config(arch, _json_fields(values))
    _check_known(config, checked, f"{HF_PREFIX}{arch}'s configuration")
    _check_kinds(config, checked)
    for key, fields in checked.items():
        if not isinstance(fields, dict):
            continue
        sub = getattr(config, key, None)
        if not callable(getattr(sub, "to_dict", None)):
            raise ModelError(f"model_kwargs: {key}: an object sets the fields of a sub-configuration, and {key} "
                             f"is not one of {HF_PREFIX}{arch}'s (set it in a config.json: hf:path/to/config.json)")
        _check_known(sub, fields, f"{HF_PREFIX}{arch}'s {key}")
        _check_kinds(sub, fields, f"{key}.")
    _base_config(arch, _merged_fields(_json_fields(values), checked))  # the configuration's own checks
    return checked


def _check_known(config: Any, overrides: Mapping[str, Any], what: str) -> None:
    """Every key a field of ``config`` (``what`` names it in the error, with close matches)."""
    known = _config_fields(config)
    unknown = [k for k in overrides if k not in known]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.6)
            hints.append(f"{key!r}" + (f" (did you mean {' or '.join(close)}?)" if close else ""))
        raise ModelError(f"model_kwargs: {what} has no field {', '.join(hints)}")


def _check_kinds(config: Any, overrides: Mapping[str, Any], prefix: str = "") -> None:
    """Each value of the kind of its field's default: transformers checks few values itself, and a layer count
    of -1 built a model with no blocks that planned without a word, a count given as text failed deep in the
    build. A field whose default is None takes anything the configuration accepts."""
    for key, value in overrides.items():
        default = getattr(config, key, None)
        if default is None or value is None or isinstance(default, (list, tuple, dict)) or isinstance(value, dict):
            continue
        if isinstance(default, bool):
            fits, kind = isinstance(value, bool), "true or false"
        elif isinstance(default, int):
            fits = isinstance(value, int) and not isinstance(value, bool) and (value >= 0 or default < 0)
            kind = "a non-negative integer" if default >= 0 else "an integer"
        elif isinstance(default, float):
            fits, kind = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        elif isinstance(default, str):
            fits, kind = isinstance(value, str), "text"
        else:
            continue
        if not fits:
            raise ModelError(f"model_kwargs: {prefix}{key} must be {kind} like its default ({default!r}), got "
                             f"{value!r}")


def check_service_spec(spec: str, overrides: Mapping[str, Any] | None) -> None:
    """What a service's workers may build from a request: an allow-list name (never a path: workers do not
    read files a request names) with overrides of its configuration's fields.

    Raises:
        ModelError: starting with the request's field, ``model: …`` or ``model_kwargs: …``.
    """
    raw = spec[len(HF_PREFIX):] if spec.startswith(HF_PREFIX) else spec
    if is_hf_path(raw.strip()):
        raise ModelError(f"model: {spec[:80]!r} names a file; a service's workers build hf:NAME models only "
                         f"(known: {_known()}); plan a config.json here, `remat-client plan hf:PATH`")
    try:
        canonical_hf_name(raw)
    except ModelError as exc:
        message = str(exc)
        raise ModelError(message if message.startswith("model: ") else f"model: {message}") from None
    if check_override_values(overrides) and importlib.util.find_spec("transformers") is None:
        raise ModelError("model_kwargs: this service cannot check hf: configuration fields without transformers "
                         "(install remat with the hf extra)")
    try:
        check_overrides(spec, overrides)
    except ModelError as exc:
        message = str(exc)
        raise ModelError(message if message.startswith("model_kwargs: ") else f"model_kwargs: {message}") from None


# --- building ---------------------------------------------------------------------------------------------

def _training_config(spec: str, overrides: Mapping[str, Any] | None) -> tuple[str, Any]:
    arch, values = _resolve(spec)
    checked = check_overrides(spec, overrides)
    config = _base_config(arch, _merged_fields(_json_fields(values), checked))
    if "use_cache" in config.to_dict() or hasattr(config, "use_cache"):
        config.use_cache = False  # a training step keeps no cache (with it, outputs carry a DynamicCache)
    if HF_ARCHITECTURES[arch].task == "seq2seq-lm":
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = 0
        if getattr(config, "decoder_start_token_id", None) is None:
            config.decoder_start_token_id = 0  # T5's default has none; labels need it (shift right)
    return arch, config


def build_hf_model(spec: str, overrides: Mapping[str, Any] | None = None) -> nn.Module:
    """The spec's model with random weights, in train mode, ``use_cache=False``; ``overrides`` set fields of
    its configuration (``{"n_layer": 6}``). Never downloads, never runs remote code.

    Raises:
        ModelError: an unknown architecture or field, a bad value, a configuration that transformers refuses
            or a model that cannot be built from it (one line naming the spec).
    """
    arch, config = _training_config(spec, overrides)
    transformers = _transformers()
    auto_class = getattr(transformers, TASKS[HF_ARCHITECTURES[arch].task])
    try:
        model = auto_class.from_config(config)
    except Exception as exc:  # noqa: BLE001 - a configuration that cannot make a model is the user's to fix
        raise ModelError(f"model {HF_PREFIX}{_name_of(spec)}: cannot be built from its configuration: "
                         f"{type(exc).__name__}: {_one_line(exc)}") from None
    model.train()
    return model


def _max_tokens(config: Any) -> int | None:
    """The longest sequence the model's position embeddings take (None: relative positions, no limit)."""
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not isinstance(limit, int):
        return None
    if getattr(config, "model_type", None) == "roberta":  # positions start after the padding index
        limit -= int(getattr(config, "pad_token_id", 1) or 0) + 1
    return limit


def hf_example_call(model: nn.Module, spec: str, *, batch_size: int, seq_len: int | None,
                    device: torch.device | str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of one training call of ``model`` (built from ``spec``): keyword inputs only, seeded
    random values from a generator of their own (the global RNG is not touched), on ``device``.

    Token models: ``input_ids`` ``(batch_size, seq_len)`` below the vocabulary size and ``labels`` (so the
    model returns its own loss: the ids again for a causal LM, as a tensor of their own; other token ids for
    masked and seq2seq LMs). No attention mask: the batch has no padding, and a mask without padding is left
    out by the model's forward anyway (remat.client.graph.mask_skips); the plan keys of the zoo's profiles name
    no mask. ``seq_len`` None: :func:`default_seq_len`, at
    most the model's position limit. Vision models: ``pixel_values`` ``(batch_size, C, H, W)`` at the
    configuration's image size in the model's floating dtype, and ``labels`` below ``num_labels``. Two-tower
    models: ``input_ids`` as a token model's (its text configuration's vocabulary and position limit),
    ``pixel_values`` as a vision model's (its vision configuration's size) and ``return_loss=True``.

    Raises:
        ModelError: a ``seq_len`` for a vision model, or longer than the model's position embeddings.
    """
    import torch

    config = model.config  # type: ignore[union-attr]
    arch = hf_architecture(spec)
    name = f"{HF_PREFIX}{_name_of(spec)}"
    kind = input_kind(spec)
    generator = torch.Generator().manual_seed(0)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ModelError(f"batch_size: must be a positive integer, got {batch_size!r}")

    def pixels() -> torch.Tensor:
        whole = model.config  # type: ignore[union-attr]
        image = getattr(whole, _SUB_CONFIGS[arch]["image"]) if arch in _SUB_CONFIGS else whole
        size, channels = int(image.image_size), int(image.num_channels)
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        return torch.randn((batch_size, channels, size, size), generator=generator).to(device=device, dtype=dtype)

    if kind == "image":
        if seq_len is not None:
            raise ModelError(f"--seq-len: {name} takes images, not token sequences")
        pixel_values = pixels()
        labels = torch.randint(0, int(config.num_labels), (batch_size,), generator=generator)
        return (), {"pixel_values": pixel_values, "labels": labels.to(device)}
    if kind == "tokens+image":
        config = getattr(config, _SUB_CONFIGS[arch]["text"])
    limit = _max_tokens(config)
    if seq_len is None:
        seq_len = default_seq_len(torch.device(device).type)
        seq_len = min(seq_len, limit) if limit else seq_len
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= MAX_SEQ_LEN:
        raise ModelError(f"--seq-len: must be an integer in 1..{MAX_SEQ_LEN}, got {seq_len!r}")
    if limit is not None and seq_len > limit:
        raise ModelError(f"--seq-len: {name} takes at most {limit} tokens (its position embeddings), got {seq_len}")
    vocab = int(config.vocab_size)
    shape = (batch_size, seq_len)
    input_ids = torch.randint(0, vocab, shape, generator=generator)
    if kind == "tokens+image":  # the images drawn after the ids: a caption's ids do not depend on the image size
        return (), {"input_ids": input_ids.to(device), "pixel_values": pixels(), "return_loss": True}
    if HF_ARCHITECTURES[arch].task == "causal-lm":
        labels = input_ids.clone()  # as a collator makes them (NOTE [ inputs that alias ]: one tensor works too)
    else:
        labels = torch.randint(0, vocab, shape, generator=generator)
    return (), {"input_ids": input_ids.to(device), "labels": labels.to(device)}


def hf_call_signature(spec: str, *, batch_size: int, sample_shape: tuple[int, ...], dtype: str,
                      overrides: Mapping[str, Any] | None = None) -> str:
    """The plan key's ``inputs`` for the call :func:`hf_example_call` makes, without building anything: what a
    lookup by name in the store compares (every allow-listed forward takes its main input before ``labels``,
    CLIP's ids before its pixels; a test holds this equal to ``ModelCall.bind(...).signature``). ``overrides``
    (the request's configuration fields) size a two-tower model's images."""
    dims = ", ".join(str(d) for d in (batch_size, *sample_shape))
    floating = "float32" if dtype.startswith("autocast_") else dtype
    kind = input_kind(spec)
    if kind == "tokens+image":
        image = ", ".join(str(d) for d in (batch_size, *hf_image_shape(spec, overrides)))
        return f"input_ids: int64[{dims}]; pixel_values: {floating}[{image}]; return_loss=True"
    if kind == "tokens":
        return f"input_ids: int64[{dims}]; labels: int64[{batch_size}, {sample_shape[0]}]"
    return f"pixel_values: {floating}[{dims}]; labels: int64[{batch_size}]"


# --- the hf zoo -------------------------------------------------------------------------------------------

class HfZooModel(NamedTuple):
    """One model of ``remat-client zoo hf``: an hf spec and the configuration overrides that size it."""

    spec: str
    model_kwargs: dict[str, Any]

    @property
    def name(self) -> str:
        """What ``--filter`` matches: the spec without ``hf:`` (``gpt2``)."""
        return self.spec.removeprefix(HF_PREFIX)


_SMALL_VOCAB = 8000
_SMALL_DECODER = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "vocab_size": _SMALL_VOCAB}


_SMALL_TOWER = {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4}


def hf_zoo() -> list[HfZooModel]:
    """The models ``remat-client zoo hf`` profiles: one per family (GPT-2, a Llama-style decoder, Mixtral's
    mixture of experts, BERT, T5, ViT, CLIP's two towers), each small enough for a CPU training step well under
    a second or two at the default batch and sequence length."""
    return [
        HfZooModel("hf:gpt2", {"n_layer": 6, "n_embd": 384, "n_head": 6, "n_positions": 512,
                               "vocab_size": _SMALL_VOCAB, "bos_token_id": 0, "eos_token_id": 0}),
        HfZooModel("hf:llama", dict(_SMALL_DECODER)),
        HfZooModel("hf:mixtral", {**_SMALL_DECODER, "intermediate_size": 512, "num_local_experts": 4,
                                  "num_experts_per_tok": 2}),
        HfZooModel("hf:bert", {"num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 1024,
                               "num_attention_heads": 4, "vocab_size": _SMALL_VOCAB}),
        HfZooModel("hf:t5", {"num_layers": 2, "num_decoder_layers": 2, "d_model": 256, "d_ff": 1024, "d_kv": 64,
                             "num_heads": 4, "vocab_size": _SMALL_VOCAB}),
        HfZooModel("hf:vit", {"image_size": 64, "patch_size": 16, "num_hidden_layers": 4, "hidden_size": 192,
                              "intermediate_size": 768, "num_attention_heads": 3, "num_labels": 10}),
        HfZooModel("hf:clip", {"projection_dim": 128,
                               "text_config": {**_SMALL_TOWER, "vocab_size": _SMALL_VOCAB},
                               "vision_config": {**_SMALL_TOWER, "image_size": 128, "patch_size": 8}}),
    ]
