"""The web pages' URLs, built in one place: a plan key's page carries every key field in its query, exactly as
``GET /v1/plans/{model_hash}`` takes them (``remat.client.service_client.key_query``), so a link names one key
and the page's route reads it with the JSON routes' own key parameters."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from remat.client.plan_key import PlanKey
from remat.client.service_client import key_query

__all__ = ["UI_PREFIX", "key_url", "with_query"]

UI_PREFIX = "/ui"


def key_url(key: PlanKey, what: str = "", **extra: Any) -> str:
    """``/ui/plans/{model_hash}{what}?<every key field>&<extra>``; ``what`` is ``""`` (the key's page),
    ``/timeline.svg`` or ``/frontier.svg``; ``extra`` values that are None are left out."""
    path, params = key_query(key)
    del params["algorithm"]
    params.update({name: str(value) for name, value in extra.items() if value is not None})
    return f"{UI_PREFIX}/plans/{path.removeprefix('/v1/plans/')}{what}?{urlencode(params)}"


def with_query(path: str, **params: Any) -> str:
    """``path`` with the given query parameters (None and "" left out): pagination and filter links."""
    kept = {name: str(value) for name, value in params.items() if value is not None and value != ""}
    return f"{path}?{urlencode(kept)}" if kept else path
