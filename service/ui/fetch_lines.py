"""The exact lines that fetch one stored plan: Python for a training script, the CLI, and the JSON route.

A key's page ends with what a user copies into a training script, so each line is written from the key itself,
with this server's address: every key field the client would otherwise take from its defaults is spelled out
(a default that changes must not point a copied line at another key). The CLI builds models from their name,
so its line exists only for names it can build (torchvision, timm, hf, and ``package.module:callable``
specs); an ``hf:`` token model is asked for by ``--seq-len``, an image model by ``--input-shape``.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from urllib.parse import urlencode

from remat.client.errors import ModelError
from remat.client.model_spec import canonical_spec, source_of
from remat.client.plan_key import PlanKey
from remat.client.service_client import key_query

__all__ = ["FetchLines", "fetch_lines"]

CLI_SOURCES = ("torchvision", "timm", "hf", "python")
"""Model specs ``remat-client plan MODEL`` can build from the name alone (``custom:`` names a model that
lived in a training script's memory)."""


@dataclass(frozen=True, kw_only=True)
class FetchLines:
    python: str
    """``remat.client.fetch_and_apply`` (and ``fetch_plan``) for this key."""
    cli: str | None
    """``remat-client plan MODEL ... --server URL``; None when the CLI cannot build the model from its name."""
    cli_note: str | None
    """Why there is no CLI line, or what it assumes."""
    http: str
    """``curl`` of ``GET /v1/plans/{model_hash}`` with every key field."""


def _cli_spec(model: str | None) -> str | None:
    if not model:
        return None
    try:
        spec = canonical_spec(model)
    except ModelError:
        return None
    # A profiler records a request's canonical spec; any other name (a class name, "tiny-net") is a label.
    if spec != model or source_of(spec) not in CLI_SOURCES or (spec.startswith("hf:") and spec.endswith(".json")):
        return None
    return spec


def fetch_lines(key: PlanKey, *, model: str | None, server: str, algorithm: str,
                read_token: bool) -> FetchLines:
    """The lines for ``key``'s ``algorithm`` plan on the service at ``server`` (this request's base URL);
    ``read_token``: the server requires a token for reads, so each line passes one."""
    shape = tuple(key.input_shape)
    inputs = "inputs" if key.inputs else repr(shape)
    token_arg = ', token=os.environ["REMAT_READ_TOKEN"]' if read_token else ""
    arguments = (f"server={server!r}, algorithm={algorithm!r}, dtype={key.dtype!r}, grads={key.grads!r}, "
                 f"mode={key.mode!r}, device={key.device!r}{token_arg}")
    lines = [*(["import os"] if read_token else []), "import remat.client", "",
             f"# model: the {model or 'model'} to be trained, under torch {key.torch_version} (apply refuses a plan "
             f"made with another torch)"]
    if key.inputs:
        lines.append(f"# inputs: one training call's inputs, a dict of keyword tensors: {key.inputs}")
    if key.mode == "train":
        lines.append(f"model = remat.client.fetch_and_apply(model, {inputs}, {arguments})")
    lines.append(f"plan = remat.client.fetch_plan(model, {inputs}, {arguments})")
    python = "\n".join(lines)

    spec = _cli_spec(model)
    cli = note = None
    if spec is None:
        note = (f"The CLI builds a model from its name, and {model!r} is not one it can build; use the Python "
                "lines in the training script." if model else "The trace recorded no model name for the CLI.")
    elif key.mode != "train":
        note = "The CLI plans training steps only; this key is an eval step."
    else:
        size = (["--seq-len", str(shape[1])] if len(shape) == 2 and key.inputs
                else ["--input-shape", ",".join(str(d) for d in shape[1:])])
        words = ["remat-client", "plan", spec, "--batch-size", str(shape[0]), *size, "--dtype", key.dtype,
                 "--device", key.device, "--grads", key.grads, "--algorithm", algorithm, "--server", server]
        cli = shlex.join(words)
        if spec.startswith(("hf:", "timm:")) or source_of(spec) == "python":
            note = "With the --model-kwargs it was profiled with, if any: they are part of the architecture hash."
    path, params = key_query(key, algorithm=algorithm)
    auth = ["-H", "Authorization: Bearer $REMAT_READ_TOKEN"] if read_token else []
    http = " ".join([*(shlex.quote(w) for w in ["curl", "-s", *auth[:1]]),
                     *([f'"{auth[1]}"'] if auth else []), shlex.quote(f"{server}{path}?{urlencode(params)}")])
    return FetchLines(python=python, cli=cli, cli_note=note, http=http)
