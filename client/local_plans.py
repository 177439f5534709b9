"""Plans this machine has fetched or made, on disk: a training job restarts without a service or a database.

One JSON file per (plan key, algorithm) under ``<user cache dir>/remat/plans`` (``REMAT_PLAN_CACHE_DIR``
overrides it). The file name is a digest of the key, so a lookup is one ``open``: no sqlalchemy, no torch.
Writes go to a temporary file renamed into place, so a job killed mid-write leaves the old file or none, and
two jobs writing the same plan leave one whole file.

Public API::

    LocalPlanCache(directory=None)
    cache.get(key, algorithm) -> CachedPlan | None
    cache.put(key, plan, source=...) -> Path
    cache.get_probe_facts(key) -> dict | None    # how the key's model is cut into stages, as plain JSON
    cache.put_probe_facts(key, facts) -> Path
    default_cache_dir() -> Path
    write_json_atomically(path, body) -> Path  # the one way of writing a cache file

Beside the plans, in ``probe-facts/``, one file per key keeps the probe facts its stage chain was cut from
(``remat.client.graph.write_probe.ProbeFacts``), so a hit cuts the chain without running the model. They are a
speed-up only: an unreadable or malformed facts file is ignored (and rewritten by the next probe). In
``graphs/``, the exported graphs of models called with several inputs (remat.client.graph.export_cache), by a
digest of the model and call, so a hit does not run ``torch.export`` again; also a speed-up only.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remat.client.errors import PlanError, PlanMismatchError
from remat.client.plan import Plan
from remat.client.plan_key import PlanKey

__all__ = ["CACHE_FORMAT", "CachedPlan", "LocalPlanCache", "default_cache_dir", "write_json_atomically"]

CACHE_FORMAT = "remat-plan-cache/1"
MAX_FILE_BYTES = 16 * 1024 * 1024  # a plan of the service's largest stage count is far below this


def default_cache_dir() -> Path:
    """``REMAT_PLAN_CACHE_DIR``, else ``plans`` in the user's cache directory (beside the local plan store)."""
    configured = os.environ.get("REMAT_PLAN_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("remat")) / "plans"


def _file_name(fields: dict[str, Any]) -> str:
    """A file name that is a digest of ``fields``: the same in every process, one ``open`` per lookup."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return f"{hashlib.sha256(text.encode('utf-8')).hexdigest()[:40]}.json"


@dataclass(frozen=True)
class CachedPlan:
    """A plan from the cache and where it first came from (``service http://…`` or ``profiled here``)."""

    plan: Plan
    source: str
    path: Path


class LocalPlanCache:
    """Plans by key and algorithm, one file each (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = Path(directory).expanduser() if directory is not None else default_cache_dir()

    def path(self, key: PlanKey, algorithm: str, variant: str = "") -> Path:
        """The file of one (key, algorithm) plan; ``variant`` tells a budget plan's budget apart."""
        fields: dict[str, Any] = {"key": key.to_dict(), "algorithm": algorithm}
        if variant:
            fields["variant"] = variant
        return self.directory / _file_name(fields)

    def get(self, key: PlanKey, algorithm: str, *, variant: str = "") -> CachedPlan | None:
        """The cached plan for ``key``, or None.

        Raises:
            PlanError: the file is not a cached plan (hand-edited, truncated by a full disk): the message
                names the file, to be deleted.
            PlanMismatchError: the file's plan was made for another key (it says what differs).
        """
        path = self.path(key, algorithm, variant)
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                raise PlanError(f"plan cache file {path} is larger than {MAX_FILE_BYTES} bytes; delete it")
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PlanError(f"plan cache file {path} is unreadable ({exc}); delete it") from None
        if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or not isinstance(data.get("plan"), dict):
            raise PlanError(f"plan cache file {path} is not a {CACHE_FORMAT} file; delete it")
        plan = Plan.from_dict(data["plan"])
        stored = PlanKey.from_dict(plan.extra.get("key") or {})
        differs = stored.describe_mismatch(key)
        if differs or plan.algorithm != algorithm:
            detail = differs or f"algorithm: {plan.algorithm} vs {algorithm}"
            raise PlanMismatchError(f"plan cache file {path} holds a plan for another key ({detail}); delete it")
        return CachedPlan(plan=plan, source=str(data.get("source") or "unknown"), path=path)

    def put(self, key: PlanKey, plan: Plan, *, source: str, variant: str = "") -> Path:
        """Store ``plan`` for ``key`` (replacing what was there), atomically."""
        body: dict[str, Any] = {"format": CACHE_FORMAT, "source": source,
                                "plan": {**plan.to_dict(), "key": key.to_dict()}}
        return self._write(self.path(key, plan.algorithm, variant), body)

    def probe_facts_path(self, key: PlanKey) -> Path:
        """The file of ``key``'s probe facts (one per key, whatever the algorithm), in a subdirectory: the
        cache directory's own ``*.json`` are plans."""
        return self.directory / "probe-facts" / _file_name(key.to_dict())

    def get_probe_facts(self, key: PlanKey) -> dict[str, Any] | None:
        """The probe facts stored for ``key`` as a dict, or None (none stored, or a file that is not ours)."""
        path = self.probe_facts_path(key)
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                return None
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        same_key = isinstance(data, dict) and data.get("key") == json.loads(json.dumps(key.to_dict()))
        if not same_key or data.get("format") != CACHE_FORMAT:
            return None
        facts = data.get("probe_facts")
        return facts if isinstance(facts, dict) else None

    def put_probe_facts(self, key: PlanKey, facts: dict[str, Any]) -> Path:
        """Store ``key``'s probe facts (replacing what was there), atomically."""
        return self._write(self.probe_facts_path(key),
                           {"format": CACHE_FORMAT, "key": key.to_dict(), "probe_facts": facts})

    def _write(self, path: Path, body: dict[str, Any]) -> Path:
        return write_json_atomically(path, body)


def write_json_atomically(path: Path, body: Any, *, indent: int | None = 1) -> Path:
    """Write ``body`` as JSON to ``path`` through a temporary file renamed into place: a reader sees the old
    file or the new one, whole, never a part (the cache's one way of writing, shared by the graph cache)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".plan-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(body, f, indent=indent, separators=None if indent is not None else (",", ":"))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
